"""The four backends are parallel texts: the same public names, in the reference's order, with
the reference's argument names, and inside each concept of model.py the same sublayers and functions
called in the reference's order. Only a short, documented list of framework idiom may differ
(docs/ports.md, "Parallel texts"). Read from the source with ``ast``: no framework is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "reference_numpy"
PORTS = ("transformer_torch", "transformer_jax", "transformer_tf")

# Argument names that are framework idiom: PRNG streams, dropout switches and callables, device
# and dtype placement, the reference's flat parameter dict (and whether it copies it: a port's weights are its
# framework's tensors), Keras's build/kwargs plumbing.
IDIOM_ARGUMENTS = {"self", "rngs", "training", "deterministic", "device", "dtype", "param_dtype", "dropout", "params",
                   "copy", "name", "input_shape", "kwargs"}
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
# call are written once, in reference_numpy/checks.py) and names only ports have (the compiled entry points are in
# each port's speed.py, not in model.py).
REFERENCE_ONLY = {"model.py": {"Linear"},
                  # the reference's own Adam and loss scaling: each port steps with its framework's optimizer
                  # and scales float16 losses with its framework's scaler
                  "training.py": {"LossScale", "Adam"},
                  # host-side beam bookkeeping: the ports' batched searches re-express it on tensors
                  "decoding.py": {"StepChoice", "select_candidates", "search_ends", "best_hypothesis"},
                 # the layouts' tables: computed once in float64, every port reads the reference's
                 "variants.py": {"halves_table", "fairseq_table"},
                 # the stages' table (which module's output each stage is), written once: every port reads it
                 "capture.py": {"stage_paths", "stage_modules"}}
# the training inputs' checks (check_labels, ...), written once in reference_numpy/training.py for the ports to call
REFERENCE_ONLY_PREFIXES = ("check_",)
PORT_ONLY = {"decoding.py": {"reorder_cache"},
             # Eq. (3) as each framework's own schedule object (LambdaLR's lambda, an optax schedule, a Keras
             # LearningRateSchedule); learning_rate itself follows the reference (torch imports it, JAX and Keras
             # define a traceable one with the reference's arguments)
             "training.py": {"learning_rate_schedule"},
             # TensorFlow: the device a Keras model's weights live on, for its tf.device scopes
             "device.py": {"model_device"}}
# Files whose template is the reference; the others have no reference counterpart and are
# compared port against port (the first port is the template).
AGAINST_REFERENCE = ("model.py", "softmax.py", "incremental.py", "variants.py", "decoding.py", "training.py",
                     "capture.py")
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
    return name in REFERENCE_ONLY.get(file, set()) or name.startswith(REFERENCE_ONLY_PREFIXES)


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


# Each port's ecosystem.py: its framework's own training idiom (docs/ports.md, "Parallel texts"), exported last and
# in no other port: Keras' loss, metric and optimizer for compile/fit and the training state of a fit, PyTorch's
# Dataset with its collate function, orbax's saving and restoring of the JAX training state.
ECOSYSTEM_EXPORTS = {"transformer_torch": ["TranslationDataset"],
                     "transformer_jax": ["adam", "restore_training", "save_training"],
                     "transformer_tf": ["LabelSmoothedCrossEntropy", "TokenAccuracy", "adam", "fit_state"]}


@pytest.mark.parametrize("port", PORTS)
def test_every_port_exports_the_same_names(port):
    """The same names in every port, then the port's own ecosystem names, which its ecosystem.py defines."""
    own = ECOSYSTEM_EXPORTS[port]
    assert shared_exports(port) == shared_exports(PORTS[0])
    assert exported(port)[len(shared_exports(port)):] == own
    assert set(own) <= {name for name, _ in public_text(ROOT / port / "ecosystem.py")}


def shared_exports(port: str) -> list[str]:
    names = exported(port)
    return names[:len(names) - len(ECOSYSTEM_EXPORTS[port])]


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


# ----------------------------------------------------------------------------- bodies
#
# Beyond names and arguments: inside each concept, the sublayers a port calls and the model.py functions it
# calls, in the reference's order. A concept is a class (all its methods read together, so that Keras' build
# and Flax's __init__ compare alike) or a top-level function of model.py. A port's private helper that the
# reference does not have is read through (its calls count where it is called): framework idiom may add
# helpers, not change what the concept does in which order. Repeats in a row count once (an if/else calling
# the same sublayer on both branches is one call).

def _definitions(text: str) -> dict[str, ast.AST]:
    return {node.name: node for node in ast.parse(text).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def sublayers(cls: ast.ClassDef, classes: set[str]) -> set[str]:
    """The attributes ``__init__`` sets to a layer of model.py: ``self.X = Layer(...)`` (or ``... if ... else``),
    ``self.layers = [Layer(...) for ...]``."""
    names = set()
    for node in ast.walk(cls):
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)):
            continue
        value = node.value.body if isinstance(node.value, ast.IfExp) else node.value
        value = value.elt if isinstance(value, ast.ListComp) else value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes:
            names.add(node.targets[0].attr)
    return names


def in_order(found: list[tuple[int, int, str]]) -> list[str]:
    names = [name for _, _, name in sorted(found)]
    return [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]


def _self_attribute(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def calls(node: ast.AST, shared: set[str], helpers: dict[str, ast.AST], layers: set[str],
          methods: dict[str, ast.AST], seen: tuple = ()) -> list[str]:
    """In source order: the sublayers (``layers``) ``node`` calls, passes on or loops over, and the ``shared``
    functions it calls; a port's own helper functions and ``methods`` (which the reference does not have) read
    through."""
    found = []
    for inner in ast.walk(node):
        used = ([inner.func, *inner.args] if isinstance(inner, ast.Call)
                else [inner.iter] if isinstance(inner, (ast.For, ast.comprehension)) else [])
        found += [(part.lineno, part.col_offset, f"self.{_self_attribute(part)}") for part in used
                  if _self_attribute(part) in layers]
        if not isinstance(inner, ast.Call):
            continue
        name = inner.func.id if isinstance(inner.func, ast.Name) else _self_attribute(inner.func)
        own = helpers if isinstance(inner.func, ast.Name) else methods
        if isinstance(inner.func, ast.Name) and name in shared:
            found.append((inner.lineno, inner.col_offset, name))
        elif name in own and name not in seen:
            found += [(inner.lineno, inner.col_offset + i / 1000, called) for i, called in
                      enumerate(calls(own[name], shared, helpers, layers, methods, (*seen, name)))]
    return in_order(found)


# The methods of a class compared one by one, a construction (``__init__`` with Keras' ``build``) as one;
# the other idiom methods (``IDIOM_METHODS``) are not compared.
CONSTRUCTION = ("__init__", "build")


def units(node: ast.AST) -> dict[str, list[ast.AST]]:
    if not isinstance(node, ast.ClassDef):
        return {"": [node]}
    parts: dict[str, list[ast.AST]] = {}
    for method in node.body:
        if isinstance(method, ast.FunctionDef):
            key = ("__init__" if method.name in CONSTRUCTION else
                   "__call__" if method.name in CALL_METHODS else method.name)
            if key == "__init__" or key not in IDIOM_METHODS:
                parts.setdefault(key, []).append(method)
    return parts


def body_divergences(reference_text: str, port_text: str, port: str) -> list[str]:
    """Every concept of ``port_text`` (a port's model.py) whose calls depart from the reference's."""
    reference, ported = _definitions(reference_text), _definitions(port_text)
    shared = {name for name, node in reference.items() if isinstance(node, ast.FunctionDef) and name in ported}
    helpers = {name: node for name, node in ported.items() if name not in reference and name.startswith("_")}
    classes = {name for name, node in reference.items() if isinstance(node, ast.ClassDef)}
    problems = []
    for name, node in reference.items():
        if name not in ported:
            continue
        layers = sublayers(node, classes) if isinstance(node, ast.ClassDef) else set()
        mine, theirs = units(node), units(ported[name])
        extra = {key: parts[0] for key, parts in theirs.items() if key not in mine and key.startswith("_")}
        for key, parts in mine.items():
            if key not in theirs:
                continue
            wanted = [call for part in parts for call in calls(part, shared, {}, layers, {})]
            found = [call for part in theirs[key] for call in calls(part, shared, helpers, layers, extra)]
            if found != wanted:
                problems.append(f"{port}/model.py: {name}{'.' + key if key else ''} calls {found}, "
                                f"the reference calls {wanted}")
    return problems


@pytest.mark.parametrize("port", PORTS)
def test_each_concept_calls_what_the_reference_calls_in_its_order(port):
    problems = body_divergences(model_text(REFERENCE), model_text(port), port)
    assert not problems, "\n".join(problems)


def model_text(package: str) -> str:
    return (ROOT / package / "model.py").read_text()


@pytest.mark.parametrize(("where", "old", "new", "expected"), [
    # post-LN's sublayers swapped in the feed-forward's residual connection
    ("transformer_torch", "residual(x, self.ffn, self.ffn_norm,", "residual(x, self.ffn_norm, self.ffn,",
     "EncoderLayer.__call__ calls"),
    # the decoder's cross-attention attends with the self-attention's weights
    ("transformer_jax", "_attend(self.cross_attn, h, memory", "_attend(self.self_attn, h, memory",
     "DecoderLayer.__call__ calls"),
    # the feed-forward network's two layers in the wrong order
    ("transformer_tf", "self.linear2(", "self.linear1(", "PositionwiseFeedForward.__call__ calls"),
    # the target's positions encoded before the embedding
    ("transformer_torch", "self.tgt_pos(self.tgt_embed(tgt)", "self.tgt_embed(self.tgt_pos(tgt)",
     "Transformer.decode calls"),
])
def test_a_changed_body_is_named(where, old, new, expected):
    """The checker itself: each planted change in one port is reported, naming the concept."""
    text = model_text(where)
    assert old in text, f"{where}/model.py no longer has {old!r}: update this test"
    problems = body_divergences(model_text(REFERENCE), text.replace(old, new, 1), where)
    assert any(expected in problem for problem in problems), problems


# Each port's layers.py: its framework's plumbing beside model.py (docs/ports.md, the layout table), private names
# only, but for TensorFlow's serialization registry and its mixed policies' names (training.py and ecosystem.py
# register their Keras objects with it). No concept of section 3 moves there: it defines no name the reference's
# model.py defines, so the checks above still read every concept in model.py.
LAYERS_PUBLIC = {"transformer_torch": set(), "transformer_jax": set(), "transformer_tf": {"register", "MIXED_POLICIES"}}


def top_level_names(text: str) -> set[str]:
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return names


@pytest.mark.parametrize("port", PORTS)
def test_a_ports_layers_py_holds_plumbing_alone(port):
    defined = top_level_names((ROOT / port / "layers.py").read_text())
    assert {name for name in defined if not name.startswith("_")} == LAYERS_PUBLIC[port]
    assert not defined & top_level_names(model_text(REFERENCE))


# ----------------------------------------------------------------------------- decoding's private helpers
#
# Every private helper of the three decoding.py files -- the generator's log-probabilities at one position, one
# decoding step, the checked source, the token buffer, the beam-search step helpers -- has one name, the same
# arguments in the same order and the same place in every port, unless its docstring declares it one framework's
# plumbing ("JAX only: ...", "TensorFlow only: ..."; a jitted loop, a tf.function cache).

FRAMEWORK_NAMES = {"transformer_torch": "PyTorch", "transformer_jax": "JAX", "transformer_tf": "TensorFlow"}
# TensorFlow's step takes the generator's (D, V) weight, read once per search: XLA does not hoist it out of the loop.
HELPER_IDIOM_ARGUMENTS = {"transformer_tf": {"weight"}}


def shared_helpers(text: str, port: str) -> list[tuple[str, list[str]]]:
    """(name, arguments) of the private top-level functions of a decoding.py ``text``, in file order, but for the
    ones its docstrings declare ``port``'s own; the port's idiom arguments left out."""
    own, idiom = f"{FRAMEWORK_NAMES[port]} only:", HELPER_IDIOM_ARGUMENTS.get(port, set())
    return [(node.name, [arg for arg in arguments(node, node.name) if arg not in idiom])
            for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_")
            and not (ast.get_docstring(node) or "").startswith(own)]


@pytest.mark.parametrize(("where", "old", "new", "expected"), [
    (None, None, None, None),
    # the token buffer renamed in one port
    ("transformer_jax", "_start_tokens(", "_history(",
     "transformer_jax/decoding.py: _start_tokens is missing (the transformer_torch has it)"),
    # a decoding step's arguments in another order
    ("transformer_tf", "def _step(model: Transformer, tokens: tf.Tensor, step: Index,",
     "def _step(model: Transformer, step: Index, tokens: tf.Tensor,",
     "transformer_tf/decoding.py: _step has ['model', 'step', 'tokens', 'memory', 'src_mask', 'cache', 'greedy']"),
    # a port's own helper not declared as such
    ("transformer_tf", '"""TensorFlow only: tokens[..., t] = token', '"""tokens[..., t] = token',
     "transformer_tf/decoding.py: _put is not in the transformer_torch"),
])
def test_the_decoders_share_their_private_helpers(where, old, new, expected):
    """docs/ports.md: the three decoding.py files have the same private helpers, in the same order, with the same
    arguments, but for the framework plumbing each declares; the checker reports a helper renamed in a copy of one
    port's text, arguments reordered, and an undeclared port-only helper."""
    texts = {port: (ROOT / port / "decoding.py").read_text() for port in PORTS}
    if where is not None:
        assert old in texts[where], f"{where}/decoding.py no longer has {old!r}: update this test"
        texts[where] = texts[where].replace(old, new)
    template = shared_helpers(texts[PORTS[0]], PORTS[0])
    assert {"_log_probs_at", "_step", "_checked_source", "_start_tokens", *BEAM_HELPERS} <= dict(template).keys()
    problems = [problem for port in PORTS[1:] for problem in
                divergences(template, shared_helpers(texts[port], port), file="decoding.py", port=port,
                            template_name=PORTS[0])]
    if expected is None:
        assert not problems, "\n".join(problems)
    else:
        assert any(problem.startswith(expected) for problem in problems), problems


# ----------------------------------------------------------------------------- model.py's docstrings
#
# A concept's docstring is written once and read the same in every backend (the idea of transformers'
# check_copies): each name of model.py that the reference and a port share has the reference's docstring, word for
# word, but for one last paragraph that a backend may add in its own words, starting with its framework's name
# ("PyTorch: ...", "NumPy: ..."). The why of a design choice is in docs/ports.md, not in the docstrings.

FRAMEWORK_TAGS = {REFERENCE: "NumPy", **FRAMEWORK_NAMES}


def docstrings(text: str) -> dict[str, str]:
    """name (``Class.method`` for a method) -> docstring of every function and class of a model.py ``text``."""
    found: dict[str, str] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                if (doc := ast.get_docstring(node)) is not None:
                    found[prefix + node.name] = doc
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{node.name}.")

    visit(ast.parse(text).body, "")
    return found


def shared_part(docstring: str, backend: str) -> str:
    """The docstring without its last paragraph when that paragraph is the backend's own ("PyTorch: ...")."""
    paragraphs = docstring.split("\n\n")
    if len(paragraphs) > 1 and paragraphs[-1].startswith(f"{FRAMEWORK_TAGS[backend]}:"):
        paragraphs = paragraphs[:-1]
    return "\n\n".join(paragraphs)


def docstring_divergences(texts: dict[str, str], file: str = "model.py") -> list[str]:
    """A line per shared name whose docstring, the backend's own paragraph aside, is not the reference's."""
    reference = {name: shared_part(doc, REFERENCE) for name, doc in docstrings(texts[REFERENCE]).items()}
    problems = []
    for port in PORTS:
        for name, doc in docstrings(texts[port]).items():
            base = name.split(".")[0]
            own = base not in reference and not name.startswith(tuple(CALL_METHODS))
            if name in reference and shared_part(doc, port) != reference[name]:
                problems.append(f"{port}/{file}: the docstring of {name} is not the reference's")
            elif not own and name not in reference and base in reference and "." not in name:
                problems.append(f"{port}/{file}: {name} has a docstring the reference lacks")
    return problems


@pytest.mark.parametrize(("file", "where", "old", "new", "expected"), [
    ("model.py", None, None, None, None),
    ("softmax.py", None, None, None, None),
    ("incremental.py", None, None, None, None),
    # a word changed in one port's copy
    ("model.py", "transformer_jax", "head_i = Attention(Q W_i^Q,", "head_i = Attention(W_i^Q Q,",
     "transformer_jax/model.py: the docstring of MultiHeadAttention is not the reference's"),
    ("incremental.py", "transformer_tf", "the positions before it are", "the positions after it are",
     "transformer_tf/incremental.py: the docstring of at_position is not the reference's"),
    # a framework paragraph under another framework's name
    ("model.py", "transformer_torch", "PyTorch: torch's fused kernel", "JAX: torch's fused kernel",
     "transformer_torch/model.py: the docstring of scaled_dot_product_attention is not the reference's"),
])
def test_docstrings_are_written_once(file, where, old, new, expected):
    """Every docstring model.py's (and softmax.py's and incremental.py's) backends share is the reference's, word for
    word, each backend's own last paragraph aside; the checker reports a word changed in one port and a paragraph under
    another framework's name."""
    texts = {backend: (ROOT / backend / file).read_text() for backend in (REFERENCE, *PORTS)}
    if where is not None:
        assert old in texts[where], f"{where}/{file} no longer has {old!r}: update this test"
        texts[where] = texts[where].replace(old, new, 1)
    problems = docstring_divergences(texts, file)
    if expected is None:
        assert not problems, "\n".join(problems)
    else:
        assert expected in problems, problems


def test_model_docstrings_are_one_line_and_shapes():
    """Each concept's docstring in the reference's model.py: a first line naming its equation or section, then at most
    two paragraphs (its behaviour with a cache or a choice of the config, and its Shape line)."""
    long = {name: doc for name, doc in docstrings(model_text(REFERENCE)).items() if doc.count("\n\n") > 3}
    assert not long, long
