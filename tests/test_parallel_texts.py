"""The four backends are parallel texts: the same public names, in the reference's order, with
the reference's argument names. Only a short, documented list of framework idiom may differ
(docs/ports.md, "Parallel texts"). Read from the source with ``ast``: no framework is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "reference_numpy"
PORTS = ("transformer_torch", "transformer_jax", "transformer_tf")

# Argument names that are framework idiom: PRNG streams, dropout switches and callables, device
# and dtype placement, the reference's flat parameter dict, Keras's build/kwargs plumbing.
IDIOM_ARGUMENTS = {"self", "rngs", "training", "deterministic", "device", "dtype", "dropout", "params", "name",
                   "input_shape", "kwargs"}
# Arguments only the ports have, the same in every port: what the reference reads off its
# parameter dict (a vocabulary size, the shared embedding) and the decoders' cache switch.
PORT_ARGUMENTS = {"vocab_size", "embeddings", "use_cache"}
# torch's switch between its fused attention kernel and the explicit one that returns weights.
IDIOM_BY_NAME = {"scaled_dot_product_attention": {"return_weights"}}
# The call method of a module in each framework: NumPy and Flax ``__call__``, torch ``forward``, Keras ``call``.
CALL_METHODS = ("call", "forward", "__call__")
# Framework plumbing that is not part of the model's text: Keras build/config, torch properties.
IDIOM_METHODS = {"build", "get_config", "from_config", "compute_mask", "dtype", "device"}
# Public names only the reference has (it has no framework to provide them; the input checks the ports
# call are written once, in reference_numpy/checks.py) and names only ports have (compiled entry points).
REFERENCE_ONLY = {"model.py": {"Linear"},
                  # the reference's own Adam and loss scaling: each port steps with its framework's optimizer
                  # and scales float16 losses with its framework's scaler
                  "training.py": {"LossScale", "Adam"},
                  # host-side beam bookkeeping: the ports' batched searches re-express it on tensors
                  "decoding.py": {"StepChoice", "select_candidates", "search_ends", "best_hypothesis"}}
# the training inputs' checks (check_labels, ...), written once in reference_numpy/training.py for the ports to call
REFERENCE_ONLY_PREFIXES = ("check_",)
PORT_ONLY = {"model.py": {"compiled_forward", "forward", "stage_names"},
             "decoding.py": {"reorder_cache"},
             # Eq. (3) as each framework's own schedule object (LambdaLR's lambda, an optax schedule, a Keras
             # LearningRateSchedule); learning_rate itself follows the reference (torch imports it, JAX and Keras
             # define a traceable one with the reference's arguments)
             "training.py": {"learning_rate_schedule"},
             # TensorFlow: the device a Keras model's weights live on, for its tf.device scopes
             "device.py": {"model_device"}}
# Files whose template is the reference; the others have no reference counterpart and are
# compared port against port (the first port is the template).
AGAINST_REFERENCE = ("model.py", "decoding.py", "training.py")
PORT_FILES = ("checkpoint.py", "device.py")


def public_text(path: Path) -> list[tuple[str, list]]:
    """(name, arguments) of each public top-level function, and (name, [(method, arguments)]) of
    each public class, in file order; idiom arguments and methods left out."""
    items = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            items.append((node.name, arguments(node, node.name)))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            items.append((node.name, methods(node)))
    return items


def imported_from_reference(path: Path) -> set[str]:
    """Names a port takes from the reference as they are: the same text by construction."""
    return {alias.asname or alias.name for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(REFERENCE)
            for alias in node.names}


def arguments(node: ast.FunctionDef, owner: str) -> list[str]:
    args = node.args
    idiom = IDIOM_ARGUMENTS | IDIOM_BY_NAME.get(owner, set())
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in idiom]


def methods(node: ast.ClassDef) -> list[tuple[str, list[str]]]:
    """The class's methods; a class without its own call method calls its framework base class's."""
    found = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
    call = next((name for name in CALL_METHODS if name in found), None)   # Keras: call, not its __call__ check
    out = []
    for name, method in found.items():
        if name in IDIOM_METHODS or (name.startswith("_") and name not in ("__init__", call)):
            continue
        if name in CALL_METHODS and name != call:
            continue
        out.append(("__call__" if name == call else name, arguments(method, node.name)))
    if call is None and node.bases:
        out.append(("__call__", ["inherited"]))
    return out


def without_port_arguments(body):
    """A text as the reference can have it: the ports' own arguments left out."""
    if body and isinstance(body[0], tuple):
        return [(name, without_port_arguments(args)) for name, args in body]
    return [arg for arg in body if arg not in PORT_ARGUMENTS]


def reference_only(file: str, name: str) -> bool:
    return name in REFERENCE_ONLY[file] or name.startswith(REFERENCE_ONLY_PREFIXES)


def same_text(mine, theirs) -> bool:
    """Equal, where an inherited call method matches any call method of the template."""
    if mine and isinstance(mine[0], tuple):
        ours, other = dict(mine), dict(theirs)
        if ours.get("__call__") == ["inherited"] and "__call__" in other:
            ours["__call__"] = other["__call__"]
        return list(ours.items()) == list(other.items())
    return mine == theirs


def divergences(template: list, text: list, *, file: str, port: str, template_name: str,
                imported: frozenset = frozenset()) -> list[str]:
    """Every way ``text`` departs from ``template``: missing names, extra names, order, arguments."""
    problems = []
    against_reference = template_name == REFERENCE
    mine = {name: without_port_arguments(body) if against_reference else body for name, body in text}
    wanted = [(name, body) for name, body in template if not (against_reference and reference_only(file, name))]
    for name, body in wanted:
        if name in imported:
            continue
        if name not in mine:
            problems.append(f"{port}/{file}: {name} is missing (the {template_name} has it)")
        elif not same_text(mine[name], body):
            problems.append(f"{port}/{file}: {name} has {mine[name]}, the {template_name} has {body}")
    allowed = {name for name, _ in wanted} | PORT_ONLY.get(file, set()) | imported
    problems += [f"{port}/{file}: {name} is not in the {template_name} (and not a documented idiom)"
                 for name, _ in text if name not in allowed]
    order = [name for name, _ in text if name in dict(wanted)]
    expected = [name for name, _ in wanted if name in mine and name not in imported]
    if order != expected:
        problems.append(f"{port}/{file}: names in the order {order}, the {template_name}'s order is {expected}")
    return problems


@pytest.mark.parametrize("file", AGAINST_REFERENCE)
@pytest.mark.parametrize("port", PORTS)
def test_each_port_follows_the_reference(port, file):
    template = public_text(ROOT / REFERENCE / file)
    problems = divergences(template, public_text(ROOT / port / file), file=file, port=port, template_name=REFERENCE,
                           imported=frozenset(imported_from_reference(ROOT / port / file)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("file", AGAINST_REFERENCE + PORT_FILES)
@pytest.mark.parametrize("port", PORTS[1:])
def test_the_ports_follow_each_other(port, file):
    """Port-only names and framework extras (e.g. the shared embedding given to Generator) are
    the same in every port too."""
    template = public_text(ROOT / PORTS[0] / file)
    problems = divergences(template, public_text(ROOT / port / file), file=file, port=port, template_name=PORTS[0],
                           imported=frozenset(imported_from_reference(ROOT / port / file)
                                              | imported_from_reference(ROOT / PORTS[0] / file)))
    assert not problems, "\n".join(problems)


# The step helpers of the ports' one beam-search design (every sentence's beams rows of one batch, the
# self-attention caches kept in place under a beams table): the table, the caches following the beams,
# a step's choices and each sentence's best finished hypothesis.
BEAM_HELPERS = ("_in_place", "_reorder_own", "_select", "_keep_best")


def private_functions(path: Path, names: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(name, arguments) of the top-level functions ``names`` that ``path`` defines, in file order."""
    return [(node.name, arguments(node, node.name)) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name in names]


@pytest.mark.parametrize("port", PORTS[1:])
def test_the_beam_searches_share_their_step_helpers(port):
    """docs/ports.md: one search design in the three ports, with the same step helpers in the same order."""
    template = private_functions(ROOT / PORTS[0] / "decoding.py", BEAM_HELPERS)
    assert [name for name, _ in template] == list(BEAM_HELPERS)
    assert private_functions(ROOT / port / "decoding.py", BEAM_HELPERS) == template


def exported(package: str) -> list[str]:
    for node in ast.parse((ROOT / package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{package}/__init__.py has no __all__")


@pytest.mark.parametrize("port", PORTS[1:])
def test_every_port_exports_the_same_names(port):
    assert exported(port) == exported(PORTS[0])


def test_a_divergence_is_named_by_file_and_name():
    """The checker itself: a renamed argument, a missing class, an extra name and a swapped order."""
    template = [("padding_mask", ["tokens", "pad_id"]), ("causal_mask", ["length"]),
                ("LayerNorm", [("__init__", ["config"]), ("__call__", ["x"])])]
    text = [("causal_mask", ["length"]), ("padding_mask", ["ids", "pad_id"]), ("extra", [])]
    problems = divergences(template, text, file="model.py", port="p", template_name=REFERENCE)
    assert "p/model.py: padding_mask has ['ids', 'pad_id'], the reference_numpy has ['tokens', 'pad_id']" in problems
    assert "p/model.py: LayerNorm is missing (the reference_numpy has it)" in problems
    assert "p/model.py: extra is not in the reference_numpy (and not a documented idiom)" in problems
    assert any("order" in problem for problem in problems)


def test_framework_call_methods_and_idiom_arguments_are_the_same_text():
    source = ("class A:\n    def __init__(self, config, *, dtype, rngs): ...\n"
              "    def build(self, input_shape): ...\n    def __call__(self, x): ...\n"
              "    def call(self, x, training=None): ...\n"
              "    def _private(self): ...\n")
    assert methods(ast.parse(source).body[0]) == [("__init__", ["config"]), ("__call__", ["x"])]
