"""Tests of the PyTorch port beyond the shared agreement matrix (tests/equivalence/test_agreement.py) and what every
port must do (tests/ports/test_every_port.py):
checkpoint I/O against the reference, the name table, nn.Transformer interop, the key/value
cache, the fully masked row through SDPA, dropout in train/eval mode, casting, devices, and
training (torch.optim.Adam and LambdaLR against the paper's update written out here)."""

from __future__ import annotations

import functools
import math
import os
import re
import unittest.mock

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]')")


from equivalence import cases, tolerance  # noqa: E402
from equivalence.backends import numpy as reference  # noqa: E402
from equivalence.backends import torch as backend  # noqa: E402
from equivalence.cases import MASK_CASES, VARIANTS  # noqa: E402
from equivalence.margins import greedy_margins  # noqa: E402
from reference_numpy import checkpoint as reference_checkpoint  # noqa: E402
from reference_numpy import precision  # noqa: E402
from reference_numpy.config import TrainingConfig  # noqa: E402
from reference_numpy.decoding import select_candidates  # noqa: E402
from reference_numpy.model import padding_mask as reference_padding_mask  # noqa: E402
from reference_numpy.precision import check_trainable, round_to  # noqa: E402
from reference_numpy.training import PAPER, learning_rate  # noqa: E402
from transformer_torch import checkpoint, decoding, device, interop, speed, training  # noqa: E402
from transformer_torch import precision as torch_precision  # noqa: E402
from transformer_torch.incremental import at_position, memory_cache, self_attention_cache  # noqa: E402
from transformer_torch.model import Transformer, scaled_dot_product_attention, target_mask  # noqa: E402

NO_GPU = "no CUDA GPU present: the GPU tests need torch.cuda.is_available()"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models gain nothing from intra-op threads, which only spin on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def port_model(variant: str, dtype: str = "float64", params: str = "seeded") -> Transformer:
    return backend.build(VARIANTS[variant], cases.PARAMS[params](VARIANTS[variant]), dtype)


@functools.cache
def reference_model(variant: str, dtype: str = "float64", params: str = "seeded"):
    return reference.build(VARIANTS[variant], cases.PARAMS[params](VARIANTS[variant]), dtype)


def log_probs(model, inputs) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs).cpu().numpy()


# ----------------------------------------------------------------------------- checkpoint

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_name_table_covers_every_parameter_exactly_once(variant):
    config = VARIANTS[variant]
    table, flipped = checkpoint.name_table(config), checkpoint.transposed(config)
    parameters = dict(Transformer(config).named_parameters())                  # tied weights listed once
    assert list(table) == list(reference_checkpoint.parameter_shapes(config))
    assert sorted(table.values()) == sorted(parameters), "table paths != model parameters"
    assert len(set(flipped)) == len(flipped) and set(flipped) <= set(table)
    for name, path in table.items():
        shape = reference_checkpoint.parameter_shapes(config)[name]
        expected = shape[::-1] if name in flipped else shape
        assert tuple(parameters[path].shape) == expected, name
    # (in, out) -> (out, in): every nn.Linear weight, square ones included, and the generator's
    projections = 4 * (config.n_encoder_layers + 2 * config.n_decoder_layers)
    ffn = 2 * (config.n_encoder_layers + config.n_decoder_layers)
    assert len(flipped) == projections + ffn + (not config.share_embeddings)
    aliases = {"tgt_embed.weight", "generator.embeddings.weight"} if config.share_embeddings else set()
    assert Transformer(config).state_dict().keys() == {*parameters, *aliases}


def test_a_wrong_transpose_list_is_caught_by_the_shape_check(monkeypatch):
    transposed = checkpoint.transposed
    monkeypatch.setattr(checkpoint, "transposed", lambda config: tuple(
        name for name in transposed(config) if name != "encoder.layers.0.ffn.linear1.weight"))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'encoder.layers.0.ffn.linear1.weight' has shape "
                                         r"\(16, 40\) after conversion; torch parameter "
                                         r"'encoder.layers.0.ffn.linear1.weight' needs \(40, 16\)"):
        checkpoint.from_params(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]))


@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings", "learned_pe"])
def test_loading_builds_no_random_weights_and_copies_the_arrays(variant):
    """The model is built on the meta device and filled by load_state_dict(assign=True): no random
    number is drawn; the parameters are copies (changing them leaves the caller's arrays alone);
    a shared embedding stays one parameter of one module (tied, section 3.4)."""
    config = VARIANTS[variant]
    params = cases.seeded_params(config)
    before = {name: value.copy() for name, value in params.items()}
    state = torch.random.get_rng_state()
    model = checkpoint.from_params(config, params)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.device.type == "cpu" and p.dtype == torch.float64 and p.requires_grad for p in model.parameters())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    assert all(np.array_equal(params[name], value) for name, value in before.items())
    if config.share_embeddings:
        assert model.generator.embeddings is model.tgt_embed is model.src_embed
        assert len(list(model.parameters())) == len(params)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_load_checkpoint_keeps_the_files_dtype(tmp_path, dtype):
    config = VARIANTS["tiny"]
    path = tmp_path / "model.safetensors"
    params = {name: value.astype(dtype) for name, value in cases.seeded_params(config).items()}
    reference_checkpoint.save_checkpoint(path, config, params)
    model = checkpoint.load_checkpoint(path)
    assert model.dtype == getattr(torch, dtype) and model.src_pos.table.dtype == getattr(torch, dtype)
    assert all(np.array_equal(value, params[name]) for name, value in checkpoint.to_params(model).items())
    assert checkpoint.load_checkpoint(path, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_file_loads_in_its_dtype_and_saves_back_bitwise(tmp_path, dtype):
    """A BF16 or F16 file loads into a model of its own dtype (weights and sinusoidal table the reference's, bit
    for bit), into float32 exactly, and a model in P saves a file of P that reads back bit for bit."""
    config = VARIANTS["tiny"]
    path, copy = tmp_path / "model.safetensors", tmp_path / "copy.safetensors"
    params = reference_checkpoint.init_params(config, dtype=dtype, perturb=cases.TEST_PERTURB)
    reference_checkpoint.save_checkpoint(path, config, params)
    model = checkpoint.load_checkpoint(path)
    assert model.dtype == getattr(torch, dtype) and model.src_pos.table.dtype == model.dtype
    table = reference_model("tiny", dtype).src_pos.table
    assert torch_precision.to_numpy(model.src_pos.table).tobytes() == table.tobytes()
    saved = checkpoint.to_params(model)
    assert all(saved[name].dtype == value.dtype and saved[name].tobytes() == value.tobytes()
               for name, value in params.items())
    checkpoint.save_checkpoint(model, copy)
    _, again = reference_checkpoint.load_checkpoint(copy)
    assert all(again[name].dtype == value.dtype and again[name].tobytes() == value.tobytes()
               for name, value in params.items())
    wide = checkpoint.to_params(checkpoint.load_checkpoint(path, "float32"))
    assert all(np.array_equal(wide[name], value.astype(np.float32)) for name, value in params.items())


def test_weights_are_rounded_to_bfloat16_once():
    """1 + 2^-8 + 2^-30 is 1 + 2^-7 in bfloat16 (nearest); torch's cast from float64 goes through float32, where it
    becomes the tie 1 + 2^-8, and then to 1 (ties to even). The port rounds as the reference does."""
    config = VARIANTS["tiny"]
    params = cases.seeded_params(config)
    params["encoder.layers.0.ffn.linear1.bias"][0] = 1 + 2 ** -8 + 2 ** -30
    assert torch.tensor(1 + 2 ** -8 + 2 ** -30, dtype=torch.float64).to(torch.bfloat16).item() == 1.0
    model = checkpoint.from_params(config, params, "bfloat16")
    assert model.encoder.layers[0].ffn.linear1.bias[0].item() == 1 + 2 ** -7
    exported = checkpoint.to_params(model)
    reference_params = reference_model("tiny", "bfloat16").params
    assert all(exported[name].tobytes() == value.tobytes() for name, value in reference_params.items()
               if name != "encoder.layers.0.ffn.linear1.bias")


def test_bad_arguments_give_one_line_value_errors():
    config, params = VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"])
    model = port_model("tiny")
    inputs = cases.model_inputs(config, "none")
    for dtype in ("int8", torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=f"dtype must be one of float64, float32, bfloat16, float16, got "
                                             f"{str(dtype).removeprefix('torch.')}$"):
            checkpoint.from_params(config, params, dtype)
    with pytest.raises(ValueError, match="device 'cuda:7' is not available here"):
        checkpoint.from_params(config, params, "float64", "cuda:7")
    with pytest.raises(ValueError, match="mask must be boolean"):
        model(inputs["src"], inputs["tgt"], src_mask=inputs["src_mask"].astype(np.int64))
    with pytest.raises(ValueError, match=r"tgt holds token ids outside \[0, 23\)"):
        model(inputs["src"], inputs["tgt"] + 23)
    with pytest.raises(ValueError, match="beam_size must be a positive int"):
        decoding.beam_search(model, inputs["src"], beam_size=0)


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fully_masked_row_gives_zeros_and_no_nan(dtype):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 8, dtype=dtype, generator=generator, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1, :, 2] = False                                                     # batch 1, query 2: no key
    fused, _ = scaled_dot_product_attention(q, k, v, mask)
    explicit, weights = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    for out in (fused, explicit):
        assert torch.all(out[1, :, 2] == 0) and not out.isnan().any()
        assert torch.all(out[0].abs().sum(-1) > 0)
    assert torch.all(weights[1, :, 2] == 0)
    fused.sum().backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))


def test_fully_masked_row_is_guarded_when_the_kernel_gives_nan(monkeypatch):
    """torch's CPU kernels return zeros for a query with no key; other kernels (and the
    textbook softmax below) give NaN there. The port's guard must hide that."""
    def textbook_sdpa(query, key, value, attn_mask=None):
        scores = (query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5).masked_fill(~attn_mask, -torch.inf)
        return torch.softmax(scores, dim=-1) @ value

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", textbook_sdpa)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    mask[1] = False
    assert textbook_sdpa(q, q, q, mask)[1].isnan().all()
    out, _ = scaled_dot_product_attention(q, q, q, mask)
    assert torch.all(out[1] == 0) and not out.isnan().any()


def test_return_weights_mirrors_the_reference():
    config = VARIANTS["tiny"]
    inputs = cases.attention_inputs(config, "ragged_batch")
    _, ref_weights = reference_model("tiny").encoder.layers[0].self_attn(
        inputs["query"], inputs["key"], inputs["value"], inputs["mask"], return_weights=True)
    attn = port_model("tiny").encoder.layers[0].self_attn
    with torch.no_grad():
        out, weights = attn(*(torch.as_tensor(inputs[n]) for n in ("query", "key", "value", "mask")),
                            return_weights=True)
    tolerance.assert_agrees(weights.numpy(), ref_weights, what="attention weights")
    tolerance.assert_agrees(out.numpy(), reference.component(reference_model("tiny"), "multi_head_attention", inputs))


# ----------------------------------------------------------------------------- the oneDNN linear

def _spy_on_f_linear(monkeypatch) -> list:
    """Record the dtype of every weight given to ``F.linear`` (the port's default linear)."""
    calls, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, weight, bias=None: calls.append(weight.dtype)
                        or linear(x, weight, bias))
    return calls


def test_linear_takes_onednn_only_without_gradients_on_large_float32_cpu_weights(monkeypatch):
    """speed.linear: oneDNN's inner product for a float32 CPU weight of at least _ONEDNN_MIN_WEIGHT elements when
    no gradient is needed, agreeing with x W^T + b under the float32 policy; F.linear in every other case."""
    calls = _spy_on_f_linear(monkeypatch)
    rng = np.random.default_rng(0)
    out_features = speed._ONEDNN_MIN_WEIGHT // 128
    x, weight, bias = rng.normal(size=(3, 5, 128)), rng.normal(size=(out_features, 128)), rng.normal(size=out_features)
    x32, weight32, bias32 = (torch.tensor(a, dtype=torch.float32) for a in (x, weight, bias))
    with torch.no_grad():
        fast = speed.linear(x32, weight32, bias32)
    assert calls == [], "the oneDNN path was not taken"
    tolerance.assert_agrees(fast.numpy(), x @ weight.T + bias,
                            x.astype(np.float32) @ weight.T.astype(np.float32) + bias.astype(np.float32),
                            what="oneDNN linear")
    with torch.no_grad():
        speed.linear(torch.as_tensor(x), torch.as_tensor(weight), torch.as_tensor(bias))       # float64
        speed.linear(x32[..., :16], weight32[:16, :16], bias32[:16])                           # small
    speed.linear(x32, weight32.requires_grad_(), bias32).sum().backward()                        # gradients
    assert weight32.grad is not None
    enabled, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, False
    try:
        with torch.no_grad():
            speed.linear(x32, weight32, bias32)                                                  # switched off
    finally:
        torch.backends.mkldnn.enabled = enabled
    assert calls == [torch.float64, torch.float32, torch.float32, torch.float32]


@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings"])
def test_onednn_on_every_projection_agrees_with_the_reference_in_float32(monkeypatch, variant):
    """The tiny configs' weights are below _ONEDNN_MIN_WEIGHT (F.linear: the agreement suite's path); here every
    projection and the generator take oneDNN: each forward stage agrees with the reference under the float32
    policy (the same bits on a second run), and greedy tokens are the reference's up to its first float32 near-tie
    (as in test_agreement.py)."""
    monkeypatch.setattr(speed, "_ONEDNN_MIN_WEIGHT", 0)
    calls = _spy_on_f_linear(monkeypatch)
    config = VARIANTS[variant]
    inputs = cases.model_inputs(config, "ragged_batch")
    model = backend.build(config, cases.seeded_params(config), "float32")
    stages = backend.forward(model, **inputs)
    assert np.array_equal(backend.forward(model, **inputs)["log_probs"], stages["log_probs"]), "not repeatable"
    ref64, ref32 = (reference.forward(reference_model(variant, dtype), **inputs) for dtype in ("float64", "float32"))
    for stage in ref64:
        tolerance.assert_agrees(stages[stage], ref64[stage], ref32[stage], what=f"oneDNN float32 {stage}")
    src, ref = cases.decoding_inputs(config), reference_model(variant, params="decoding")
    ref_tokens = reference.greedy(ref, src)
    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), ref_tokens[:, :-1]], axis=1)
    bound = tolerance.float32_bound(ref(src, tgt), reference_model(variant, "float32", "decoding")(src, tgt))
    tokens = backend.greedy(backend.build(config, cases.decoding_params(config), "float32"), src)
    agree, note, full_rows = tolerance.greedy_tokens_agree(tokens, ref_tokens, greedy_margins(ref, src, ref_tokens),
                                                           bound, config.pad_id)
    assert agree and full_rows, note
    assert calls == [], "a projection did not take the oneDNN path"


def _packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy ``speed.pack_weights`` holds for ``weight`` (None: none made yet)."""
    return (speed._PACKED[weight] or (None, None))[1]


def test_packed_weights_are_packed_once_and_follow_every_change_pytorch_counts():
    """speed.pack_weights: each weight packed at its first product on the oneDNN path and never again while it is
    unchanged; after an in-place change (a new version) or new storage (a new address) the product is the changed
    weight's (x W^T + b under the float32 policy); a change through ``.data``, which PyTorch does not count, is seen
    once ``pack_weights`` is called again, as its docstring says."""
    rng = np.random.default_rng(0)
    out_features = speed._ONEDNN_MIN_WEIGHT // 128
    layer = speed.pack_weights(torch.nn.Linear(128, out_features))
    x = rng.normal(size=(3, 5, 128))
    copies = []

    def agrees(what: str) -> None:
        weight, bias = (p.detach().double().numpy() for p in (layer.weight, layer.bias))
        with torch.no_grad():
            out = speed.linear(torch.tensor(x, dtype=torch.float32), layer.weight, layer.bias)
        tolerance.assert_agrees(out.numpy(), x @ weight.T + bias, x.astype(np.float32) @ weight.T.astype(np.float32)
                                + bias.astype(np.float32), what=what)
        if all(copy is not _packed_copy(layer.weight) for copy in copies):
            copies.append(_packed_copy(layer.weight))

    agrees("packed")
    agrees("packed, again")
    assert len(copies) == 1 and copies[0] is not None and copies[0].is_mkldnn, "not packed once"
    with torch.no_grad():
        layer.weight.mul_(-2.0)                                                  # in place: a new version
    agrees("after an in-place change")
    layer.weight.data = layer.weight.data.flip(0).contiguous()                   # new storage
    agrees("after new storage")
    assert len(copies) == 3
    layer.weight.data.mul_(0.5)                                                  # unseen by PyTorch's version
    speed.pack_weights(layer)
    agrees("after .data and pack_weights again")
    assert len(copies) == 4
    unregistered = torch.ones(out_features, 128)
    with torch.no_grad():
        speed.linear(torch.tensor(x, dtype=torch.float32), unregistered)
    assert unregistered not in speed._PACKED
    with torch.inference_mode():                               # parameters that count no versions: used as they are
        layer = speed.pack_weights(torch.nn.Linear(128, out_features))
        agrees("made under inference_mode")
    assert _packed_copy(layer.weight) is None


def test_the_adapter_s_packed_weights_follow_its_training_steps(monkeypatch):
    """A model of the adapter with every projection on the oneDNN path (packed: ``speed.pack_weights``) after a
    training step: its inference is that of a model built afresh from its trained weights, to the bit."""
    monkeypatch.setattr(speed, "_ONEDNN_MIN_WEIGHT", 0)
    config = VARIANTS["tiny"]
    inputs, src = cases.model_inputs(config, "ragged_batch"), cases.decoding_inputs(config)
    model = backend.build(config, cases.seeded_params(config), "float32")
    before = backend.log_probs(model, **inputs)
    assert _packed_copy(model.generator.weight if model.generator.embeddings is None
                        else model.generator.embeddings.weight) is not None, "the generator's weight was not packed"
    backend.train_step(model, backend.optimizer(model), **cases.training_inputs(config))
    fresh = backend.build(config, backend.export_params(model), "float32")
    after = backend.log_probs(model, **inputs)
    assert not np.array_equal(after, before), "the step changed nothing"
    np.testing.assert_array_equal(after, backend.log_probs(fresh, **inputs))
    np.testing.assert_array_equal(backend.greedy(model, src), backend.greedy(fresh, src))


# ----------------------------------------------------------------------------- train / eval, casting

def test_eval_is_deterministic_and_equals_the_reference_train_applies_dropout():
    config, inputs = VARIANTS["tiny"], cases.model_inputs(VARIANTS["tiny"], "source_padding")
    model = backend.build(config, cases.seeded_params(config))
    ref = reference_model("tiny")(**inputs)
    first, second = log_probs(model.eval(), inputs), log_probs(model, inputs)
    assert np.array_equal(first, second)
    tolerance.assert_agrees(first, ref, what="eval forward")
    calls = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(0)
    trained = log_probs(model.train(), inputs)
    # section 5.4: each sublayer output (2 per encoder layer, 3 per decoder layer) and the two embedding sums
    assert len(calls) == 2 + 2 * config.n_encoder_layers + 3 * config.n_decoder_layers
    assert not tolerance.agreement(trained, ref).ok
    assert not np.array_equal(trained, log_probs(model, inputs))


def test_train_mode_without_dropout_equals_eval():
    config = VARIANTS["pre_ln"].replace(dropout=0.0)
    model = backend.build(config, cases.seeded_params(config)).train()
    inputs = cases.model_inputs(config, "ragged_batch")
    tolerance.assert_agrees(log_probs(model, inputs), reference_model("pre_ln")(**inputs))


@pytest.mark.parametrize("variant", ["tiny", "learned_pe"])
def test_to_dtype_round_trip(variant):
    config = VARIANTS[variant]
    params32 = {name: value.astype(np.float32) for name, value in cases.seeded_params(config).items()}
    inputs = cases.model_inputs(config, "ragged_batch")
    ref64 = reference.build(config, params32, "float64")(**inputs)
    ref32 = reference.build(config, params32, "float32")(**inputs)
    model = backend.build(config, params32, "float32")
    out32 = log_probs(model, inputs)
    assert out32.dtype == np.float32
    tolerance.assert_agrees(out32, ref64, ref32, what="float32 model")
    widened = log_probs(model.to(torch.float64), inputs)                   # sinusoidal table re-derived in float64
    assert widened.dtype == np.float64
    tolerance.assert_agrees(widened, ref64, what="float32 model cast to float64")


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_cached_step_writes_its_cache_in_place(variant):
    """Along the reference's greedy output, one new position per step and then two at once (the steps whose
    log-probabilities tests/ports/test_every_port.py checks in every port): each step writes its keys and values into
    the self-attention buffers it was given, and returns those very buffers."""
    config = VARIANTS[variant]
    model, ref = port_model(variant, params="decoding"), reference_model(variant, params="decoding")
    src = cases.decoding_inputs(config)
    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), reference.greedy(ref, src)], axis=1)
    with torch.no_grad():
        memory, mask = model.encode(torch.as_tensor(src)), torch.as_tensor(reference_padding_mask(src, config.pad_id))
        cache = model.init_cache(memory, tgt.shape[1] + 1)
        ends = [*range(1, tgt.shape[1] - 1), tgt.shape[1]]                 # the last step feeds 2 positions
        for start, end in zip([0, *ends], ends):
            _, returned = decoding.next_token_log_probs(model, torch.as_tensor(tgt[:, start:end]), memory, mask,
                                                         cache, start)
            assert all(new[0].keys is old[0].keys and new[0].values is old[0].values
                       for new, old in zip(returned, cache, strict=True)), f"positions {start}..{end - 1}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_with_a_cache_equals_the_uncached_decoder(variant):
    """Transformer.decode with a cache and its default mask (causal over absolute positions, the
    unwritten positions hidden), and with an explicit mask over the cache for a target row with
    padding: new positions one or several at a time give the uncached decoder's rows for the
    whole prefix; beam search's reorder_cache keeps the rows asked for."""
    config, model = VARIANTS[variant], port_model(variant)
    rng = np.random.default_rng(4)
    src = torch.as_tensor(rng.integers(3, config.src_vocab_size, (3, 6)))
    tgt = torch.as_tensor(rng.integers(3, config.tgt_vocab_size, (3, 8)))
    with torch.no_grad():
        memory = model.encode(src)
        cache = model.init_cache(memory, 10)
        for start, end in ((0, 1), (1, 3), (3, 4), (4, 8)):
            out, cache = model.decode(tgt[:, start:end], memory, cache=at_position(cache, start))
            tolerance.assert_agrees(out.numpy(), model.decode(tgt[:, :end], memory)[:, start:].numpy(),
                                    what=f"{variant} positions {start}..{end - 1}")
        padded = tgt.clone()
        padded[1, 5:] = config.pad_id
        padded_cache = model.init_cache(memory, 10)
        for start, end in ((0, 4), (4, 5), (5, 8)):
            rows = target_mask(padded[:, :end], config.pad_id)[:, :, start:]  # (B, 1, T_new, end)
            tgt_mask = torch.nn.functional.pad(rows, (0, 10 - end))            # (B, 1, T_new, C)
            out, padded_cache = model.decode(padded[:, start:end], memory, tgt_mask=tgt_mask,
                                             cache=at_position(padded_cache, start))
            tolerance.assert_agrees(out.numpy(), model.decode(padded[:, :end], memory)[:, start:].numpy(),
                                    what=f"{variant} padded row, positions {start}..{end - 1}")
        beams = torch.tensor([2, 0, 0])
        reordered = decoding.reorder_cache(cache, beams)
        for layer, kept in zip(cache, reordered):
            for old, new in zip(layer, kept):
                assert torch.equal(new.keys, old.keys[beams]) and torch.equal(new.values, old.values[beams])


def test_attention_cache_branches_equal_the_uncached_attention():
    """MultiHeadAttention with a cache: encoder-decoder attention over memory_cache, and masked
    self-attention written into self_attention_cache's buffers from its position (section 3.2.3)."""
    config = VARIANTS["tiny"]
    layer = port_model("tiny").decoder.layers[0]
    generator = torch.Generator().manual_seed(3)
    x, memory = (torch.randn(2, n, config.d_model, dtype=torch.float64, generator=generator) for n in (5, 4))
    with torch.no_grad():
        cache = memory_cache(layer.cross_attn, memory)
        out, same = layer.cross_attn(x, memory, memory, cache=cache)
        assert same is cache and cache.keys.shape == (2, config.n_heads, 4, config.d_model // config.n_heads)
        tolerance.assert_agrees(out.numpy(), layer.cross_attn(x, memory, memory).numpy(), what="memory cache")
        cache = self_attention_cache(layer.self_attn, 2, 7)
        assert cache.keys.dtype == torch.float64 and not cache.keys.any() and cache.values.shape[2] == 7
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        full = layer.self_attn(x, x, x, causal)
        for start, end in ((0, 2), (2, 3), (3, 5)):
            visible = torch.arange(7) <= torch.arange(start, end)[:, None]  # (T_new, C)
            out, cache = layer.self_attn(x[:, start:end], x[:, start:end], x[:, start:end], visible,
                                         cache=cache._replace(position=start))
            tolerance.assert_agrees(out.numpy(), full[:, start:end].numpy(), what=f"self-attention {start}..{end - 1}")


def _assert_same_choice(candidates: np.ndarray, eos_id: int, beam_size: int) -> None:
    """The port's top-k selection against the reference's select_candidates (a stable sort of every candidate: the
    oracle), sentence by sentence of a batch (B, n_live, V): the same finite finishing (beam, score) pairs in rank
    order, and the same beams, tokens and scores, to the bit, for the next live beams (the reference drops impossible
    ones, the port keeps them at -inf). Beams not live (n_live < beam size) are slots of -inf, as in the search."""
    batch, n_live, vocab = candidates.shape
    slots = np.concatenate([candidates, np.full((batch, beam_size - n_live, vocab), -np.inf, candidates.dtype)], 1)
    chosen = decoding._select(torch.from_numpy(slots), eos_id, beam_size)
    for one, (scores, beams, tokens, finishing, keep) in zip(slots, zip(*(t.numpy() for t in chosen)), strict=True):
        expected = select_candidates(one, eos_id, beam_size)
        ends = finishing & np.isfinite(scores)        # an eos at -inf finishes nothing (the search scores it -inf)
        assert [(int(beam), score.tobytes()) for beam, score in zip(beams[ends], scores[ends])] == \
            [(beam, score.tobytes()) for beam, score in expected.finishing], (one, eos_id, beam_size)
        live = keep[np.isfinite(scores[keep])]
        for mine, theirs in ((beams[live], expected.beams), (tokens[live], expected.tokens),
                             (scores[live], expected.scores)):
            assert mine.astype(theirs.dtype).tobytes() == theirs.tobytes(), (one, eos_id, beam_size)
        assert scores.dtype == one.dtype


@pytest.mark.parametrize("block", [speed._TOP_K_BLOCK, 1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_candidate_selection_breaks_exact_ties_as_the_reference(dtype, block, monkeypatch):
    """Hand-set exact ties straddling the boundary of the 2K candidates torch.topk picks (more equal candidates than
    places, in several beams), eos inside and at the edge of the tie, +0.0 and -0.0, and too few finite candidates;
    with speed.top_k's blocks of 1 and 2 columns too, so that its choice of blocks meets the ties."""
    monkeypatch.setattr(speed, "_TOP_K_BLOCK", block)
    tied = np.full((4, 6), -1.0)
    tied[1, 4] = tied[3, 0] = -0.5                                           # 2 above, 22 equal at the boundary
    zeros = np.array([[0.0, -0.0, -3.0], [-0.0, 0.0, -0.0], [-1.0, 0.0, -0.0]])
    few = np.full((2, 5), -np.inf)
    few[1, 3], few[0, 2], few[1, 1] = -2.0, -2.0, -1.0                       # 3 finite candidates, beam size 4
    ladder = -np.repeat(np.arange(4.0)[:, None], 7, axis=1)                  # beam b: all -b
    for candidates in (tied, zeros, few, ladder, np.zeros((1, 9))):
        for eos_id in range(candidates.shape[1]):
            for beam_size in range(len(candidates), 5):
                _assert_same_choice(candidates[None].astype(dtype), eos_id, beam_size)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.data())
def test_candidate_selection_agrees_with_the_reference_on_random_steps(data):
    """Random steps of a batch of 1-3 sentences (n_live <= beam size, values drawn from a few exact ties and from
    any float, -inf included)."""
    beam_size = data.draw(st.integers(1, 5), label="beam_size")
    # vocab >= 2: a model's vocabulary holds pad, bos and eos (TransformerConfig), so each beam has a non-eos token
    # and K of the 2K best candidates are never eos
    n_live, vocab = data.draw(st.integers(1, beam_size), label="n_live"), data.draw(st.integers(2, 9), label="vocab")
    batch = data.draw(st.integers(1, 3), label="batch")
    dtype = data.draw(st.sampled_from([np.float32, np.float64]), label="dtype")
    value = st.one_of(st.sampled_from([0.0, -0.0, -0.25, -1.0, -np.inf]),
                      st.floats(max_value=0.0, allow_nan=False, width=32 if dtype == np.float32 else 64))
    size = batch * n_live * vocab
    values = data.draw(st.lists(value, min_size=size, max_size=size), label="values")
    eos_id = data.draw(st.integers(0, vocab - 1), label="eos_id")
    _assert_same_choice(np.array(values, dtype=dtype).reshape(batch, n_live, vocab), eos_id, beam_size)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.data())
def test_top_k_gives_torch_topk_s_values_and_their_indices(data):
    """speed.top_k against torch.topk over the whole row: the same values in order (+0.0 and -0.0 equal: torch.topk
    does not tell them apart) and indices, distinct in each row, that hold them; rows of a few exact ties, any float
    and -inf, widths around whole blocks (blocks of 1 to 5 columns and the port's own), so that the blocks' choice,
    the columns after the last block and the fallback to torch.topk all run."""
    block = data.draw(st.sampled_from([1, 2, 3, 5, speed._TOP_K_BLOCK]), label="block")
    width = data.draw(st.integers(1, 9 * block + 4), label="width")
    count, rows = data.draw(st.integers(1, min(width, 12)), label="count"), data.draw(st.integers(1, 3), label="rows")
    dtype = data.draw(st.sampled_from([np.float32, np.float64]), label="dtype")
    value = st.one_of(st.sampled_from([0.0, -0.0, -0.25, -1.0, -np.inf]),
                      st.floats(allow_nan=False, width=32 if dtype == np.float32 else 64))
    x = torch.as_tensor(np.array(data.draw(st.lists(value, min_size=rows * width, max_size=rows * width),
                                           label="values"), dtype=dtype).reshape(rows, width))
    with unittest.mock.patch.object(speed, "_TOP_K_BLOCK", block):
        values, indices = speed.top_k(x, count)
    expected = torch.topk(x, count, dim=1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(1, indices), values)
    assert all(len(set(row)) == count for row in indices.tolist())


def test_cache_refuses_to_overflow_and_bad_arguments():
    model = port_model("tiny")
    src = torch.as_tensor(cases.decoding_inputs(VARIANTS["tiny"]))
    with torch.no_grad():
        memory, mask = model.encode(src), (src != 0)[:, None, None, :]
        cache = model.init_cache(memory, 1)
        decoding.next_token_log_probs(model, torch.ones(3, 1, dtype=torch.long), memory, mask, cache, 0)
        with pytest.raises(ValueError, match="cache holds 1 positions; decoding needs 2"):
            decoding.next_token_log_probs(model, torch.ones(3, 1, dtype=torch.long), memory, mask, cache, 1)
        with pytest.raises(ValueError, match="cache holds 1 positions; decoding needs 2"):
            model.decoder.layers[0].self_attn(memory[:, :2], memory[:, :2], memory[:, :2], cache=cache[0][0])
        with pytest.raises(ValueError, match="cache.position must be an int >= 0, got -1"):
            model.decode(torch.ones(3, 1, dtype=torch.long), memory, mask, cache=at_position(cache, -1))
        with pytest.raises(ValueError, match="cache.position must be an int >= 0, got None"):
            model.decode(torch.ones(3, 1, dtype=torch.long), memory, mask, cache=at_position(cache, None))
        with pytest.raises(ValueError, match=r"capacity must be an int in \[1, 64\], got 65"):
            model.init_cache(memory, 65)
        with pytest.raises(ValueError, match=r"memory must have shape \(batch, source length, d_model\)"):
            model.init_cache(memory[0], 4)


def test_a_0_d_tensor_cache_index_is_read_and_checked_as_an_int():
    """An exported decoding step passes its position as a 0-d tensor (traced there); eagerly the tensor is read:
    the same output and cache as its int, and the reference's errors for a bad one."""
    model = port_model("tiny")
    src = torch.as_tensor(cases.decoding_inputs(VARIANTS["tiny"]))
    tgt = torch.ones(3, 1, dtype=torch.long)
    with torch.no_grad():
        memory, mask = model.encode(src), (src != 0)[:, None, None, :]
        outs = [model.decode(tgt, memory, mask, cache=at_position(model.init_cache(memory, 4), index))
                for index in (2, torch.tensor(2))]
        for (out, cache), (expected, expected_cache) in zip(outs[1:], outs[:1]):
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            torch.testing.assert_close(cache[0][0].keys, expected_cache[0][0].keys, rtol=0, atol=0)
        assert outs[0][1][0][0].keys[:, :, 2].abs().sum() > 0 == outs[0][1][0][0].keys[:, :, 3].abs().sum()
        for index, shown in ((torch.tensor(-1), "-1"), (torch.tensor(1.0), "1.0"), (torch.tensor([1]), r"tensor\(")):
            with pytest.raises(ValueError, match=f"cache.position must be an int >= 0, got {shown}"):
                model.decode(tgt, memory, mask, cache=at_position(model.init_cache(memory, 4), index))
        with pytest.raises(ValueError, match="cache holds 4 positions; decoding needs 5"):
            model.decode(tgt, memory, mask, cache=at_position(model.init_cache(memory, 4), torch.tensor(4)))


# ----------------------------------------------------------------------------- low precision

def reference_error(check, *arguments) -> str:
    """The ValueError message the reference's own ``check`` gives for ``arguments``."""
    with pytest.raises(ValueError) as raised:
        check(*arguments)
    return str(raised.value)


def test_a_low_precision_model_is_refused_by_the_port_s_own_training_before_any_work():
    """A P *model* is not trained (a float32 one is, with ``dtype=``; the adapters' refusals, every port:
    tests/ports/test_every_port.py): the port's own optimizer refuses a bfloat16 model, and a float32 model cast to
    float16 after its optimizer was built gets the reference's ``check_trainable`` error from a step, Adam and the
    schedule untouched; data parallelism over two processes refuses a float16 run before any process starts."""
    config, params = VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"])
    batch = cases.training_inputs(config)
    refusal = lambda dtype: pytest.raises(ValueError, match=re.escape(reference_error(check_trainable, dtype)))
    with refusal("bfloat16"):
        training.optimizer(backend.build(config, params, "bfloat16"))
    cast = backend.build(config, params, "float32")
    scheduled = training.optimizer(cast)
    cast.to(torch.float16)                                                  # after its optimizer was built
    with refusal("float16"):
        training.train_step(cast, scheduled, **batch)
    untouched = all(int(state["step"]) == 0 and not state["exp_avg"].any()
                    for state in scheduled.adam.state.values())
    assert untouched and scheduled.schedule.last_epoch == 0
    with refusal("float16"):                                                # before any process starts
        backend.train_data_parallel(config, params, None, None, lambda step: batch, 0, 1, 2, "float16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_steps_keep_float32_masters_and_their_rounding(dtype, monkeypatch):
    """Two steps with a growth interval of 2: float16's GradScaler doubles its scale (2^15 -> 2^16), bfloat16 has
    none; both steps count (Adam's t and the schedule together); the masters and Adam's moments stay float32 and the
    P model holds exactly the masters rounded to P."""
    monkeypatch.setattr(precision, "LOSS_SCALE_GROWTH_INTERVAL", 2)
    config = VARIANTS["tiny"]
    model = backend.build(config, cases.seeded_params(config), "float32")
    mixed = backend.optimizer(model, TrainingConfig(warmup_steps=10), None, dtype)
    assert backend.loss_scale(mixed) == (2.0 ** 15 if dtype == "float16" else None)
    for seed in range(2):
        assert math.isfinite(backend.train_step(model, mixed, **cases.training_inputs(config, seed=seed)))
    state = backend.training_state(model, mixed)
    assert backend.loss_scale(mixed) == (2.0 ** 16 if dtype == "float16" else None)
    assert state.step == 2 and mixed.schedule.last_epoch == 2 and mixed.low.dtype == getattr(torch, dtype)
    masters, low = backend.export_params(model), backend.export_params(mixed.low)
    for name, master in masters.items():
        assert master.dtype == state.first_moments[name].dtype == state.second_moments[name].dtype == np.float32
        assert np.array_equal(low[name], round_to(master, dtype)), name
    assert not np.array_equal(masters["src_embed.weight"], cases.seeded_params(config)["src_embed.weight"]
                              .astype(np.float32))                          # the masters did move
    assert backend.loss_scale(backend.optimizer(model)) is None


def test_a_float16_step_whose_gradients_overflow_is_skipped():
    """A loss scale of 1e30 (set through ``GradScaler.update(new_scale)``) overflows the float16 gradients: the step
    changes no master, no P weight, no moment and no count (Adam's t and LambdaLR's stay at 1), and halves the
    scale."""
    config = VARIANTS["tiny"]
    model = backend.build(config, cases.seeded_params(config), "float32")
    mixed = backend.optimizer(model, TrainingConfig(warmup_steps=10), None, "float16")
    backend.train_step(model, mixed, **cases.training_inputs(config))
    before = backend.export_params(model), backend.export_params(mixed.low), backend.training_state(model, mixed)
    mixed.loss_scale.update(1e30)
    huge = backend.loss_scale(mixed)
    backend.train_step(model, mixed, **cases.training_inputs(config, seed=1))
    after = backend.export_params(model), backend.export_params(mixed.low), backend.training_state(model, mixed)
    assert backend.loss_scale(mixed) == huge / 2
    assert after[2].step == before[2].step == mixed.schedule.last_epoch == 1
    for name in before[0]:
        assert np.array_equal(after[0][name], before[0][name]) and np.array_equal(after[1][name], before[1][name])
        assert all(np.array_equal(after[2][which][name], before[2][which][name]) for which in (2, 3)), name


# ----------------------------------------------------------------------------- nn.Transformer interop

class FastPathCounter:
    """Counts calls of torch's inference fast path for encoder layers."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch._transformer_encoder_layer_fwd

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nn_transformer_agrees_on_its_slow_path(monkeypatch, variant):
    counter = FastPathCounter(monkeypatch)
    wrapper = interop.to_nn_transformer(port_model(variant))
    for case in MASK_CASES:
        inputs = cases.model_inputs(VARIANTS[variant], case)
        out = wrapper(**inputs).detach().numpy()                             # grad enabled: slow path
        tolerance.assert_agrees(out, reference_model(variant)(**inputs), what=f"nn.Transformer {case}")
    assert counter.calls == 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nn_transformer_agrees_on_its_fast_path(monkeypatch, variant):
    counter = FastPathCounter(monkeypatch)
    wrapper = interop.to_nn_transformer(port_model(variant))
    for case in [case for case in MASK_CASES if case != "fully_masked_row"]:
        inputs = cases.model_inputs(VARIANTS[variant], case)
        tolerance.assert_agrees(log_probs(wrapper, inputs), reference_model(variant)(**inputs),
                                what=f"nn.Transformer fast path {case}")
    assert counter.calls == (len(MASK_CASES) - 1) * VARIANTS[variant].n_encoder_layers


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nn_transformer_weights_convert_back(variant):
    config = VARIANTS[variant]
    torch.manual_seed(1)
    wrapper = interop.NNTransformerModel(config).double().eval()            # torch's own initialization
    model = interop.from_nn_transformer(wrapper)
    for case in ("causal", "ragged_batch"):
        inputs = cases.model_inputs(config, case)
        with torch.set_grad_enabled(True):
            expected = wrapper(**inputs).detach().numpy()
        tolerance.assert_agrees(log_probs(model, inputs), expected, what=f"from nn.Transformer {case}")
    round_trip = checkpoint.to_params(interop.from_nn_transformer(interop.to_nn_transformer(port_model(variant))))
    assert all(np.array_equal(value, round_trip[name])
               for name, value in checkpoint.to_params(port_model(variant)).items())


def _refused(config, **changes):
    args = dict(d_model=config.d_model, nhead=config.n_heads, dim_feedforward=config.d_ff,
                layer_norm_eps=config.layer_norm_eps, batch_first=True, norm_first=config.norm_first)
    layer_args = {**args, **changes}
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**layer_args), config.n_encoder_layers,
                                          norm=None, enable_nested_tensor=False)
    decoder = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(**layer_args), config.n_decoder_layers)
    return torch.nn.Transformer(custom_encoder=encoder, custom_decoder=decoder, d_model=config.d_model,
                                nhead=config.n_heads, batch_first=True)


@pytest.mark.parametrize("transformer,message", [
    (lambda c: torch.nn.Transformer(c.d_model, c.n_heads, c.n_encoder_layers, c.n_decoder_layers, c.d_ff,
                                    layer_norm_eps=c.layer_norm_eps, batch_first=True),
     "transformer.encoder.norm is LayerNorm; a post-LN stack has no final LayerNorm"),
    (lambda c: _refused(c, activation="gelu"), "transformer.encoder.layers.0.activation is .*ReLU"),
    (lambda c: _refused(c, bias=False), "transformer.encoder.layers.0.linear1/linear2 must be 16 -> 40 -> 16"),
    (lambda c: _refused(c, layer_norm_eps=1e-5), r"transformer.encoder.layers.0.norm1.eps is 1e-05"),
    (lambda c: _refused(c, batch_first=False), "self_attn.batch_first is False"),
    (lambda c: _refused(c, norm_first=True), "transformer.encoder.layers.0.norm_first is True"),
    (lambda c: _refused(c.replace(n_decoder_layers=1)), "transformer.decoder has 1 layers; the config says 3"),
])
def test_nn_transformer_outside_the_paper_is_refused(transformer, message):
    config = VARIANTS["tiny"]
    with pytest.raises(ValueError, match=message):
        interop.from_nn_transformer(interop.NNTransformerModel(config, transformer(config)))


def test_mask_conversion_for_nn_multihead_attention():
    config = VARIANTS["tiny"]
    ours = port_model("tiny").encoder.layers[0].self_attn
    theirs = torch.nn.MultiheadAttention(config.d_model, config.n_heads, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.load_state_dict(ours.o_proj.state_dict())
    for case in ("causal", "source_padding", "ragged_batch", "fully_masked_row"):
        inputs = cases.attention_inputs(config, case)
        q, k, v = (torch.as_tensor(inputs[name]) for name in ("query", "key", "value"))
        mask = interop.to_nn_mask(torch.as_tensor(inputs["mask"]), len(q), config.n_heads, q.shape[1], k.shape[1])
        assert mask.shape == (len(q) * config.n_heads, q.shape[1], k.shape[1])
        out, _ = theirs(q, k, v, attn_mask=mask, need_weights=False)
        expected = reference.component(reference_model("tiny"), "multi_head_attention", inputs)
        tolerance.assert_agrees(out.detach().numpy(), expected, what=f"nn.MultiheadAttention {case}")


# ----------------------------------------------------------------------------- devices

def test_devices_and_switches():
    assert backend.devices()[0] == "cpu"
    assert len(backend.devices()) == 1 + torch.cuda.device_count() * torch.cuda.is_available()
    device.full_precision()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    try:
        device.deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.backends.cudnn.benchmark
    finally:
        device.deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_agrees_with_tf32_off(dtype):
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    model = backend.build(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]), dtype, "cuda:0")
    assert not torch.backends.cuda.matmul.allow_tf32
    for case in MASK_CASES:
        inputs = cases.model_inputs(VARIANTS["tiny"], case)
        tolerance.assert_agrees(log_probs(model, inputs), reference_model("tiny")(**inputs),
                                reference_model("tiny", "float32")(**inputs), what=f"cuda {dtype} {case}")


def test_cuda_determinism_switch_gives_identical_runs():
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    device.deterministic()
    try:
        model = backend.build(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]), "float32", "cuda:0")
        inputs = cases.model_inputs(VARIANTS["tiny"], "ragged_batch")
        assert np.array_equal(log_probs(model, inputs), log_probs(model, inputs))
        np.testing.assert_array_equal(backend.beam(model, cases.decoding_inputs(VARIANTS["tiny"]))[0],
                                      backend.beam(model, cases.decoding_inputs(VARIANTS["tiny"]))[0])
    finally:
        device.deterministic(False)


# ----------------------------------------------------------------------------- training

# warmup_steps = 2: three steps cover both branches of Eq. (3), at a learning rate (~0.09 for d_model = 16) where a
# rate rounded to float32 (relative 6e-8) or a misplaced epsilon moves the weights far beyond the float64 bound;
# with the paper's warmup (4000) the first rates are ~2e-6 and such errors hide under it.
FAST = TrainingConfig(warmup_steps=2)
FALSE_FAILURE = 1e-6   # the probability, for any seed, that a correct dropout fails the binomial bound below


def paper_adam(weight, grad, m, v, t: int, rate: float, config: TrainingConfig):
    """Kingma & Ba (2015), Algorithm 1, as section 5.3 uses it; written out here, sharing no code with the port."""
    m = config.beta1 * m + (1.0 - config.beta1) * grad
    v = config.beta2 * v + (1.0 - config.beta2) * grad ** 2
    m_hat, v_hat = m / (1.0 - config.beta1 ** t), v / (1.0 - config.beta2 ** t)
    return weight - rate * m_hat / (np.sqrt(v_hat) + config.epsilon), m, v


def eq3(t: int, d_model: int, config: TrainingConfig) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), Eq. (3), written out here."""
    return d_model ** -0.5 * min(t ** -0.5, t * config.warmup_steps ** -1.5)


def test_the_schedule_gives_eq_3_for_steps_counted_from_1():
    config = TrainingConfig(warmup_steps=3)
    schedule = training.learning_rate_schedule(16, config)
    for count in range(8):                                                  # LambdaLR's count, from 0
        rate, t = schedule(count), count + 1
        assert rate == learning_rate(t, 16, config), t                     # the reference's Eq. (3), bit for bit
        assert abs(rate - eq3(t, 16, config)) <= tolerance.FLOAT64_RELATIVE * eq3(t, 16, config), t  # a scalar
    model = backend.build(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]))
    scheduled = training.optimizer(model, config)
    assert scheduled.schedule.last_epoch == 0 and scheduled.schedule.base_lrs == [1.0]   # count 0, base rate 1
    for t in range(1, 8):                                                   # the rate update t uses
        rate = scheduled.adam.param_groups[0]["lr"]
        assert type(rate) is float and rate == learning_rate(t, 16, config), t   # a Python float: float64
        scheduled.adam.step()                                               # no gradients: no parameter moves
        scheduled.schedule.step()


def test_adam_steps_are_the_papers_update():
    """One and three steps from the port's own gradients: weights, m and v (not bias-corrected) and t against
    Algorithm 1 written out in this file, float64, dropout 0, for the paper's config and a fast warmup."""
    config = VARIANTS["tiny"].replace(dropout=0.0)
    for settings in (PAPER, FAST):
        model = backend.build(config, cases.seeded_params(config))
        scheduled = training.optimizer(model, settings)
        weights = checkpoint.to_params(model)
        m, v = ({name: np.zeros_like(value) for name, value in weights.items()} for _ in range(2))
        for t in range(1, 4):
            batch = cases.training_inputs(config, seed=t)
            _, grads = training.gradients(model, **batch)                   # at the weights before step t
            training.train_step(model, scheduled, **batch)
            for name, grad in grads.items():
                weights[name], m[name], v[name] = paper_adam(weights[name], grad, m[name], v[name], t,
                                                             eq3(t, config.d_model, settings), settings)
            state, after = training.training_state(model, scheduled), checkpoint.to_params(model)
            assert state.step == t and state.config == settings
            for name in weights:
                what = f"warmup {settings.warmup_steps}, step {t}, {name}"
                tolerance.assert_agrees(after[name], weights[name], what=f"{what}: weight")
                tolerance.assert_agrees(state.first_moments[name], m[name], what=f"{what}: m")
                tolerance.assert_agrees(state.second_moments[name], v[name], what=f"{what}: v")


def assert_dropout_statistics(out: np.ndarray, before: np.ndarray, p_drop: float, what: str) -> None:
    """Section 5.4 on units whose input is not 0: each is zeroed with probability P_drop, independently, and a
    survivor is scaled by 1 / (1 - P_drop). Hoeffding: P(|zeroed / n - P_drop| >= delta) <= 2 exp(-2 n delta^2),
    so delta = sqrt(ln(2 / FALSE_FAILURE) / (2 n)) fails a correct dropout with probability at most FALSE_FAILURE."""
    live = before != 0
    zeroed, n = (out == 0) & live, int(live.sum())
    delta = math.sqrt(math.log(2 / FALSE_FAILURE) / (2 * n))
    assert abs(zeroed.sum() / n - p_drop) <= delta, f"{what}: {zeroed.sum() / n:.4f} zeroed, P_drop {p_drop}"
    tolerance.assert_agrees(out[live & ~zeroed], before[live & ~zeroed] / (1 - p_drop), what=f"{what}: survivors")


@pytest.mark.parametrize("p_drop", [0.1, 0.5])
def test_dropout_in_training_mode_has_the_papers_statistics(p_drop):
    """On the sum of embeddings and positional encodings, and on every sublayer output (each call of a layer's
    dropout, seen by a hook), in train mode."""
    config = VARIANTS["tiny"].replace(dropout=p_drop)
    model = backend.build(config, cases.seeded_params(config)).train()
    x = torch.full((32, config.max_len, config.d_model), 3.0, dtype=torch.float64)   # no unit is 0
    torch.manual_seed(0)
    with torch.no_grad():
        summed, expected = model.src_pos(x).numpy(), model.src_pos.eval()(x).numpy()
    assert_dropout_statistics(summed, expected, p_drop, "embedding sum")
    calls = []
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        layer.dropout.register_forward_hook(lambda module, args, out: calls.append((args[0].numpy(), out.numpy())))
    tokens = np.random.default_rng(0).integers(3, config.src_vocab_size, size=(16, 32))
    with torch.no_grad():
        model.train()(tokens, tokens)
    assert len(calls) == 2 * config.n_encoder_layers + 3 * config.n_decoder_layers
    assert_dropout_statistics(np.concatenate([out.ravel() for _, out in calls]),
                              np.concatenate([before.ravel() for before, _ in calls]), p_drop, "sublayer outputs")


def test_a_training_step_applies_dropout_and_leaves_eval_mode_untouched():
    config = VARIANTS["tiny"]                                               # P_drop = 0.1
    model = backend.build(config, cases.seeded_params(config))
    batch, inputs = cases.training_inputs(config), cases.model_inputs(config, "source_padding")
    eval_loss = backend.loss(model, **batch)
    torch.manual_seed(0)
    train_loss = training.train_step(model, training.optimizer(model), **batch)
    assert isinstance(train_loss, float) and not model.training
    assert abs(train_loss - eval_loss) > tolerance.float64_bound(eval_loss), "no dropout in the training step"
    first, second = log_probs(model, inputs), log_probs(model, inputs)
    assert np.array_equal(first, second)
    tolerance.assert_agrees(first, reference.build(config, checkpoint.to_params(model))(**inputs),
                            what="eval forward after a training step")


def test_a_run_saved_with_its_state_resumes_where_it_stopped(tmp_path):
    """training_state -> save_checkpoint(training=) -> load_training_state -> optimizer(state=): the next step is
    the one the run in memory takes, bit for bit; tied weights have one pair of moments; a float32 model takes
    the float64 state cast."""
    config, path = VARIANTS["shared_embeddings"].replace(dropout=0.0), tmp_path / "run.safetensors"
    batches = [cases.training_inputs(config, seed=seed) for seed in range(4)]
    model = backend.build(config, cases.seeded_params(config))
    scheduled = training.optimizer(model, FAST)
    for batch in batches[:3]:
        training.train_step(model, scheduled, **batch)
    assert len(scheduled.adam.state) == len(checkpoint.to_params(model))   # shared_embed.weight once
    checkpoint.save_checkpoint(model, path, training.training_state(model, scheduled))
    state = reference_checkpoint.load_training_state(path)
    assert state.step == 3 and state.config == FAST
    resumed = checkpoint.load_checkpoint(path)
    rescheduled = training.optimizer(resumed, state=state)
    assert rescheduled.schedule.get_last_lr() == scheduled.schedule.get_last_lr() == [
        learning_rate(4, config.d_model, FAST)]
    assert training.train_step(resumed, rescheduled, **batches[3]) == training.train_step(model, scheduled,
                                                                                            **batches[3])
    ours, theirs = training.training_state(model, scheduled), training.training_state(resumed, rescheduled)
    assert theirs.step == ours.step == 4
    for name, value in checkpoint.to_params(model).items():
        assert np.array_equal(checkpoint.to_params(resumed)[name], value), name
        assert np.array_equal(theirs.first_moments[name], ours.first_moments[name]), name
        assert np.array_equal(theirs.second_moments[name], ours.second_moments[name]), name
    narrow = checkpoint.load_checkpoint(path, torch.float32)
    assert all(slot["exp_avg"].dtype == torch.float32 and int(slot["step"]) == 3
               for slot in training.optimizer(narrow, state=state).adam.state.values())


def test_adam_and_its_schedule_counting_apart_is_refused():
    """A run whose Adam took a step its schedule did not: its training state, which holds one step count, is
    refused (a saved run's bad moments, every port: tests/ports/test_every_port.py)."""
    config = VARIANTS["tiny"]
    fresh = backend.build(config, cases.seeded_params(config))
    scheduled = training.optimizer(fresh)
    training.gradients(fresh, **cases.training_inputs(config))
    scheduled.adam.step()                                                   # Adam stepped, the schedule not
    with pytest.raises(ValueError, match=r"the Adam step counts and the schedule's count differ \(\[0, 1\]\)"):
        training.training_state(fresh, scheduled)
