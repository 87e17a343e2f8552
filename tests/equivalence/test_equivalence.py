"""The equivalence harness itself: the adapter contract every backend's module satisfies, the decision margins of
the float32 token rules against a step-by-step recomputation and the selection rules they protect, and the
reference adapter's finite-difference gradients against autograd."""

from __future__ import annotations

import importlib
import inspect
import types
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence import cases, tolerance
from equivalence.backends import numpy as reference
from equivalence.cases import VARIANTS
from equivalence.contract import Backend
from equivalence.finite_differences import finite_difference_gradients
from equivalence.margins import beam_margins, beam_step_margin, greedy_margins
from reference_numpy import Transformer, TransformerConfig
from reference_numpy.decoding import select_candidates

# backend -> the framework module its adapter needs (None: NumPy only)
ADAPTERS = {"numpy": None, "torch": "torch", "jax": "flax", "tf": "keras"}
CONTRACT = ("NAME", "FORWARD_PATH", "devices", "build", "load", "load_training_state", "save", "export_params",
            "forward", "log_probs", "component", "component_gradients", "greedy", "beam", "attention_weights", "loss",
            "gradients", "optimizer", "loss_scale", "train_step", "training_state", "train_data_parallel")
# Small enough for the reference's gradient by finite differences (four loss evaluations per entry).
MICRO = TransformerConfig.preset("tiny").replace(d_model=4, n_heads=2, d_ff=8, n_encoder_layers=1,
                                                 n_decoder_layers=1, src_vocab_size=8, tgt_vocab_size=8, max_len=8)


def adapter(name: str) -> types.ModuleType:
    if ADAPTERS[name]:
        pytest.importorskip(ADAPTERS[name], reason=f"the {name} adapter needs {ADAPTERS[name]}, not installed here")
    return importlib.import_module(f"equivalence.backends.{name}")


def contract_methods() -> dict[str, inspect.Signature]:
    """Each method of the Protocol, by name, with its signature as a module function (no ``self``)."""
    methods = {name: member for name, member in vars(Backend).items() if inspect.isfunction(member)
               and not name.startswith("_")}
    return {name: inspect.signature(method).replace(parameters=list(inspect.signature(method).parameters.values())[1:])
            for name, method in methods.items()}


def contract_violations(module: types.ModuleType) -> list[str]:
    """What ``module`` lacks or declares differently from :class:`Backend`: names, argument names and kinds, and
    defaults (annotations name each backend's own model type and are not compared)."""
    problems = [f"{name} is missing or not a {kind.__name__}" for name, kind in typing.get_type_hints(Backend).items()
                if not isinstance(getattr(module, name, None), kind)]
    for name, expected in contract_methods().items():
        function = getattr(module, name, None)
        if not callable(function):
            problems.append(f"{name} is missing")
            continue
        found = [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]
        wanted = [(p.name, p.kind, p.default) for p in expected.parameters.values()]
        if found != wanted:
            problems.append(f"{name}{inspect.signature(function)} differs from the contract's {name}{expected}")
    return problems


def test_the_contract_declares_every_method_once_with_a_docstring():
    assert (*typing.get_type_hints(Backend), *contract_methods()) == CONTRACT
    assert all(inspect.getdoc(getattr(Backend, name)) for name in contract_methods())


@pytest.mark.parametrize("name", ADAPTERS)
def test_every_adapter_module_satisfies_the_contract(name):
    module = adapter(name)
    assert contract_violations(module) == [], f"equivalence.backends.{name}"
    assert module.NAME == name


def test_the_contract_check_finds_a_missing_method_and_a_changed_signature():
    broken = types.ModuleType("broken")
    broken.__dict__.update({name: getattr(reference, name) for name in CONTRACT})
    del broken.loss
    broken.beam = lambda model, src, beam_size=4, alpha=0.6: None               # no use_cache
    assert [problem.split(" ")[0].split("(")[0] for problem in contract_violations(broken)] == ["beam", "loss"]


@pytest.mark.parametrize("name", ADAPTERS)
def test_loss_is_the_references_and_gradients_return_it(name):
    """Every adapter's ``loss`` is the reference's section 5.4 loss (float64 policy), and ``gradients`` returns
    that same value with a float64 gradient for every checkpoint tensor."""
    module = adapter(name)
    params, inputs = cases.seeded_params(MICRO), cases.training_inputs(MICRO)
    model = module.build(MICRO, params, "float64", "cpu")
    expected = float(reference.loss(reference.build(MICRO, params), **inputs))
    value = module.loss(model, **inputs)
    assert isinstance(value, float) and abs(value - expected) <= tolerance.float64_bound(expected)
    with_grads, grads = module.gradients(model, **inputs)
    assert abs(with_grads - expected) <= tolerance.float64_bound(expected)
    assert list(grads) == list(params) and all(grads[key].dtype == np.float64 for key in grads)


def test_reference_gradients_match_finite_differences_and_autograd():
    """The reference adapter's gradient (the hand-written backward pass) against central differences of the
    reference's loss (Richardson-extrapolated), entry by entry within each entry's bound, and against PyTorch's
    autograd within the gradient policy; every finite-difference bound is below 1e-3 of the gradient's scale, so a
    wrong entry cannot hide in it."""
    torch_adapter = adapter("torch")
    params, inputs = cases.seeded_params(MICRO), cases.training_inputs(MICRO)
    value, grads = reference.gradients(reference.build(MICRO, params), **inputs)
    expected, bounds = finite_difference_gradients(lambda p: reference.loss(reference.build(MICRO, p), **inputs),
                                                   params)
    _, autograd = torch_adapter.gradients(torch_adapter.build(MICRO, params, "float64", "cpu"), **inputs)
    assert value == reference.loss(reference.build(MICRO, params), **inputs)
    scale = max(float(np.abs(grad).max()) for grad in autograd.values())
    assert max(tolerance.max_abs(grads[name], autograd[name]) for name in params) <= \
        tolerance.gradient_bound(grads, autograd)
    for name in params:
        assert np.all(np.abs(grads[name] - expected[name]) <= bounds[name]), name
        assert bounds[name].max() < 1e-3 * scale, f"{name}: a bound of {bounds[name].max():.1e} decides nothing"


def test_finite_differences_leave_the_parameters_unchanged():
    params = cases.seeded_params(MICRO)
    before = {name: value.copy() for name, value in params.items()}
    finite_difference_gradients(lambda p: float(sum(np.sin(v).sum() for v in p.values())), params)
    assert all(np.array_equal(params[name], before[name]) for name in params)


# ----------------------------------------------------------------------------- decision margins

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_margins_equal_a_step_by_step_recomputation(variant):
    """Teacher forcing gives the gaps the greedy loop saw: recompute each step from its prefix alone (the decoder
    on bos + the tokens so far), top two of the last position with pad and bos left out; inf once a row ended."""
    config = VARIANTS[variant]
    model = Transformer(config, cases.decoding_params(config))
    src = cases.decoding_inputs(config)
    tokens = reference.greedy(model, src)
    margins = greedy_margins(model, src, tokens)
    assert margins.shape == tokens.shape
    budget = np.minimum((src != config.pad_id).sum(axis=1) + 50, config.max_len)         # section 6.1
    for step in range(tokens.shape[1]):
        prefix = np.concatenate([np.full((len(src), 1), config.bos_id), tokens[:, :step]], axis=1)
        last = model(src, prefix)[:, -1]                                                   # (B, V)
        last[:, [config.pad_id, config.bos_id]] = -np.inf
        ranked = np.sort(last, axis=1)
        live = ~(tokens[:, :step] == config.eos_id).any(axis=1) & (step < budget)
        assert np.array_equal(np.isinf(margins[:, step]), ~live), f"step {step}"
        tolerance.assert_agrees(margins[live, step], (ranked[:, -1] - ranked[:, -2])[live], what=f"{variant} {step}")
        assert np.array_equal(tokens[live, step], last.argmax(axis=1)[live]), f"step {step}: not the greedy token"


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(3, 7), st.integers(1, 4), st.integers(0, 2**32 - 1), st.floats(0.0, 0.499))
def test_noise_below_half_the_beam_margin_changes_no_decision(n_live, vocab, beam_size, seed, fraction):
    """The margin protects the step: move every candidate score by less than half of it and the step's choice --
    which beams finish with eos, which (beam, token) pairs go on -- stays the same. (The order among the kept pairs
    may change; it only breaks exact ties at later steps, which those steps' margins report as zero.)"""
    rng = np.random.default_rng(seed)
    candidates = np.round(rng.normal(size=(n_live, vocab)), 1)                             # ties happen
    candidates[rng.random((n_live, vocab)) < 0.15] = -np.inf                              # impossible tokens
    eos = int(rng.integers(vocab))
    margin = beam_step_margin(candidates, eos, beam_size)
    if not np.isfinite(margin) or margin == 0:
        return
    noisy = candidates + fraction * margin * rng.uniform(-1, 1, candidates.shape)
    before, after = select_candidates(candidates, eos, beam_size), select_candidates(noisy, eos, beam_size)
    assert sorted(beam for beam, _ in before.finishing) == sorted(beam for beam, _ in after.finishing)
    assert sorted(zip(before.beams, before.tokens)) == sorted(zip(after.beams, after.tokens))


def test_beam_step_margin_by_hand():
    """Scores -1 .. -6 for tokens 0 .. 5 of one beam, beam size 2: the boundary between the kept second and the
    dropped third non-eos candidate decides; with eos at rank 3 it also decides whether eos finishes."""
    candidates = -np.arange(1.0, 7.0)[None, :]
    assert beam_step_margin(candidates, eos_id=5, beam_size=2) == 1.0      # (-2) - (-3)
    assert beam_step_margin(candidates, eos_id=2, beam_size=2) == 1.0      # does eos (-3) enter the top 2: -2 vs -3
    assert beam_step_margin(candidates, eos_id=0, beam_size=2) == 1.0      # eos first: live -2, -3 kept, -4 dropped
    candidates[0, 2:] = -np.inf                                             # nothing possible to drop
    assert beam_step_margin(candidates, eos_id=5, beam_size=2) == np.inf


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_beam_margins_follow_the_search(variant):
    """One margin per step and one for the final choice; the final one is the gap between the returned score and
    the next-best finished hypothesis, so it is positive where the search's choice was not a tie."""
    config = VARIANTS[variant]
    model = Transformer(config, cases.decoding_params(config))
    src = cases.decoding_inputs(config)
    tokens, _ = reference.beam(model, src)
    margins = beam_margins(model, src)
    assert len(margins) == len(src)
    for row, row_margins in enumerate(margins):
        assert len(row_margins) >= 2 and all(margin >= 0 for margin in row_margins)
        emitted = int((tokens[row] != config.pad_id).sum())
        assert len(row_margins) - 1 >= emitted, f"row {row}: fewer steps than tokens emitted"
