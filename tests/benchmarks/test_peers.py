"""The peers on our weights (``transformer_bench/peers.py``, docs/peers.md) against the float64 NumPy reference,
under the project's one float32 policy (``equivalence.tolerance``, used as tests/equivalence/test_agreement.py uses
it):

* the CTranslate2 exporter (``transformer_export/ctranslate2.py``): each target token's log-probability
  (``Translator.score_batch``), greedy tokens, beam-search scores, on ``tiny`` configs (post-LN, pre-LN, learned
  positions, shared embeddings, other pad/bos/eos ids) and on the shipped trained model, whose beam-search
  tokens are compared too; its refusals, its rule for an existing output directory (the ``export`` command:
  tests/cli/test_export.py);
* HF Marian: its log-probabilities for every post-LN config (it computes the reference's function), its
  refusal of pre-LN; ``torch.nn.Transformer``'s wrapper likewise;
* the forced-length decoders ``bench --peers`` times: each writes the reference's greedy tokens up to eos;
* ``bench --peers``' report's tasks on an imported checkpoint (the whole report and its chart:
  tests/cli/test_bench_report.py).

An engine that is not installed is a skip with its reason. No time is asserted.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys

import numpy as np
import pytest
from support import require

from equivalence import cases, tolerance
from equivalence.margins import greedy_margins
from reference_numpy import (
    Transformer,
    TransformerConfig,
    beam_search,
    greedy_decode,
    init_params,
    parameter_shapes,
    save_checkpoint,
)
from reference_numpy.decoding import LENGTH_PENALTY_ALPHA, length_penalty
from transformer_bench import bench as bench_module
from transformer_bench import timing
from transformer_export import ctranslate2 as export
from transformer_tasks.numbers import NumbersTask
from transformer_tasks.translation import load_translator

TINY = TransformerConfig.preset("tiny")
VARIANTS = {**cases.VARIANTS, "special_ids": TINY.replace(pad_id=5, bos_id=3, eos_id=7)}
POST_LN = [name for name, config in VARIANTS.items() if not config.norm_first]
MASK_CASES = ("causal", "source_padding", "ragged_batch")     # the model's default masks (CTranslate2 has no others)
SHIPPED_SENTENCES = 8


def peers():
    from transformer_bench import peers as module
    return module


@functools.cache
def weights(variant: str, kind: str = "seeded") -> dict[str, np.ndarray]:
    """``cases.PARAMS[kind]``; decoding weights of ``special_ids`` from seed 3, whose greedy rows end with eos
    and run to the length limit alike (seed 0's never emit eos)."""
    return cases.PARAMS[kind](VARIANTS[variant], 3 if (variant, kind) == ("special_ids", "decoding") else 0)


@functools.cache
def reference(variant: str, params: str = "seeded", dtype=np.float64) -> Transformer:
    return Transformer(VARIANTS[variant], weights(variant, params), dtype)


@functools.cache
def ct2_peer(variant: str, params: str = "seeded"):
    require("ctranslate2", "peers")
    return peers().CTranslate2Peer(VARIANTS[variant], weights(variant, params), 1)


@functools.cache
def shipped():
    """The shipped numbers model, float64 and float32 references, a sample of its test split, its CTranslate2 peer."""
    config, params, tokenizer = load_translator()
    src, _ = NumbersTask(tokenizer).held_out(config, SHIPPED_SENTENCES, "test", 0)
    return config, params, src, Transformer(config, params), Transformer(config, params, np.float32)


@functools.cache
def shipped_decoding(kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The float64 reference's greedy tokens (and None), or beam-search tokens and scores, on :func:`shipped`."""
    _, _, src, model64, _ = shipped()
    if kind == "greedy":
        return greedy_decode(model64, src), None
    return beam_search(model64, src, 4, LENGTH_PENALTY_ALPHA)


def forced(model: Transformer, src, tgt) -> np.ndarray:
    """The reference's log-probability of each target token after its prefix -- labels tgt[1:] + eos, real
    positions only -- every row's in turn, as one vector (the quantity ``Translator.score_batch`` returns)."""
    log_probs, pad, eos = model(src, tgt), model.config.pad_id, model.config.eos_id
    rows = []
    for b, row in enumerate(np.asarray(tgt)):
        n = int((row != pad).sum())
        labels = [*row[1:n], eos]
        rows.append(log_probs[b, np.arange(n), labels])
    return np.concatenate(rows)


def hypotheses_as_targets(tokens: np.ndarray, config: TransformerConfig) -> np.ndarray:
    """Decoded rows (no bos, ending with eos or cut at the length limit) as teacher-forced targets whose forced
    labels are the rows themselves: bos + the row without its final eos (a row cut without eos keeps its last
    token, and the label after it -- an eos it never wrote -- is dropped by :func:`scores_of`)."""
    rows = [[config.bos_id, *(row[:-1] if row[-1] == config.eos_id else row)]
            for row in ([t for t in r if t != config.pad_id] for r in tokens)]
    out = np.full((len(rows), max(map(len, rows))), config.pad_id, dtype=np.int64)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


def scores_of(per_token: np.ndarray, tokens: np.ndarray, config: TransformerConfig, alpha: float) -> np.ndarray:
    """Section 6.1's beam score of each decoded row from its tokens' log-probabilities (as :func:`forced` orders
    them): log P(Y) / lp(|Y|), |Y| counting eos."""
    scores, start = [], 0
    for row in tokens:
        length = int((row != config.pad_id).sum())
        cut = length + (row[length - 1] != config.eos_id)          # targets of rows without eos hold one more label
        scores.append(per_token[start:start + length].sum() / length_penalty(length, alpha))
        start += cut
    return np.array(scores, dtype=per_token.dtype)


# ----------------------------------------------------------------------------- CTranslate2: agreement

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", MASK_CASES)
def test_ctranslate2_log_probs_agree(variant, case, agreement):
    """Each target token's float32 log-probability (``score_batch``: bos prepended, eos appended by CTranslate2)
    within the float32 policy of the float64 reference's."""
    inputs = cases.model_inputs(VARIANTS[variant], case)
    src, tgt = inputs["src"], inputs["tgt"]
    out = np.concatenate(ct2_peer(variant).score(src, tgt))
    agreement(out, forced(reference(variant), src, tgt), forced(reference(variant, dtype=np.float32), src, tgt),
              port="ctranslate2", device="cpu", dtype="float32", what=f"log-probs of the target: {variant}/{case}")


def decoding_bound(model64: Transformer, model32: Transformer, src, tokens) -> float:
    """The float32 bound of the log-probabilities along the reference's own output (as
    tests/equivalence/test_agreement.py)."""
    tgt = np.concatenate([np.full((len(src), 1), model64.config.bos_id), tokens[:, :-1]], axis=1)
    return tolerance.float32_bound(model64(src, tgt), model32(src, tgt))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ctranslate2_greedy_tokens(variant):
    """Greedy decoding, section 6.1's budget per row: CTranslate2 starts from our bos, stops on our eos, never
    writes pad or bos; its tokens are the reference's up to each row's first float32 near-tie
    (``tolerance.greedy_tokens_agree``), and at least one row is compared in full."""
    model64, model32 = reference(variant, "decoding"), reference(variant, "decoding", np.float32)
    src = cases.decoding_inputs(VARIANTS[variant])
    ref_tokens = greedy_decode(model64, src)
    tokens, _ = ct2_peer(variant, "decoding").translate(src)
    bound = decoding_bound(model64, model32, src, ref_tokens)
    agree, note, full_rows = tolerance.greedy_tokens_agree(tokens, ref_tokens, greedy_margins(model64, src, ref_tokens),
                                                           bound, VARIANTS[variant].pad_id)
    assert agree, note
    assert full_rows, "every row had a float32 near-tie; choose inputs with clear decisions"
    assert VARIANTS[variant].eos_id in tokens, "no row ended with eos: the test would not see the end token"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ctranslate2_beam_scores(variant, agreement):
    """Section 6.1's beam score (beam 4, alpha 0.6) of each of the reference's hypotheses, recomputed from
    CTranslate2's log-probabilities of its tokens, within the float32 policy of the reference's own scores (the
    float32 reference rescoring the same tokens gives ref32). CTranslate2's beam search itself normalizes by
    |Y|^alpha, not GNMT's, and renormalizes after suppressing pad and bos, so its tokens are compared on the
    shipped model only (:func:`test_ctranslate2_shipped_model`)."""
    config = VARIANTS[variant]
    model64, model32 = reference(variant, "decoding"), reference(variant, "decoding", np.float32)
    src = cases.decoding_inputs(config)
    tokens, ref_scores = beam_search(model64, src, 4, LENGTH_PENALTY_ALPHA)
    targets = hypotheses_as_targets(tokens, config)
    ct2 = scores_of(np.concatenate(ct2_peer(variant, "decoding").score(src, targets)), tokens, config,
                    LENGTH_PENALTY_ALPHA)
    ref32 = scores_of(forced(model32, src, targets), tokens, config, LENGTH_PENALTY_ALPHA)
    rescored = scores_of(forced(model64, src, targets), tokens, config, LENGTH_PENALTY_ALPHA)
    assert tolerance.max_abs(rescored, ref_scores) <= tolerance.float64_bound(ref_scores)   # it is the search's score
    agreement(ct2, ref_scores, ref32, port="ctranslate2", device="cpu", dtype="float32",
              what=f"beam scores (rescored): {variant}")


def test_ctranslate2_shipped_model(agreement):
    """The shipped model (trained weights, sharp decisions) on 16 held-out sentences: log-probabilities of its
    greedy translations within the policy; greedy tokens identical in every row; beam-search tokens identical
    (CTranslate2's beam 4 with length_penalty 0.6 -- its |Y|^alpha -- against section 6.1's search) and their
    section 6.1 scores, recomputed from CTranslate2's log-probabilities, within the policy."""
    config, params, src, model64, model32 = shipped()
    require("ctranslate2", "peers")
    peer = peers().CTranslate2Peer(config, params, 1)
    greedy = shipped_decoding("greedy")[0]
    targets = hypotheses_as_targets(greedy, config)
    agreement(np.concatenate(peer.score(src, targets)), forced(model64, src, targets), forced(model32, src, targets),
              port="ctranslate2", device="cpu", dtype="float32", what="log-probs of the target: shipped model")
    np.testing.assert_array_equal(peer.translate(src)[0], greedy)
    tokens, ref_scores = shipped_decoding("beam")
    np.testing.assert_array_equal(peer.translate(src, 4, LENGTH_PENALTY_ALPHA)[0], tokens)
    targets = hypotheses_as_targets(tokens, config)
    agreement(scores_of(np.concatenate(peer.score(src, targets)), tokens, config, LENGTH_PENALTY_ALPHA), ref_scores,
              scores_of(forced(model32, src, targets), tokens, config, LENGTH_PENALTY_ALPHA),
              port="ctranslate2", device="cpu", dtype="float32", what="beam scores (rescored): shipped model")


# ----------------------------------------------------------------------------- CTranslate2: the directory

def write_checkpoint(path, config: TransformerConfig, dtype=np.float32, seed: int = 0) -> str:
    save_checkpoint(path, config, init_params(config, seed=seed, dtype=dtype))
    return str(path)


def test_exported_directory(tmp_path):
    """The files CTranslate2 reads: our special tokens as its start, end and unknown tokens, no bos or eos added to
    the source, our LayerNorm epsilon, a vocabulary of one string per id (two when the sizes differ)."""
    require("ctranslate2", "peers")
    config = VARIANTS["special_ids"]
    out = export.export_ctranslate2(write_checkpoint(tmp_path / "m.safetensors", config), tmp_path / "model")
    settings = json.loads((out / "config.json").read_text())
    names = export.token_names(config, config.tgt_vocab_size)
    assert (names[config.bos_id], names[config.eos_id], names[config.pad_id]) == ("<s>", "</s>", "<pad>")
    assert settings["decoder_start_token"] == settings["bos_token"] == "<s>" and settings["eos_token"] == "</s>"
    assert settings["unk_token"] == "<pad>" and not settings["add_source_bos"] and not settings["add_source_eos"]
    assert settings["layer_norm_epsilon"] == config.layer_norm_eps
    assert json.loads((out / "target_vocabulary.json").read_text()) == names
    assert json.loads((out / "source_vocabulary.json").read_text()) == names[:config.src_vocab_size]
    assert names[4] == "<4>" and len(set(names)) == len(names)
    assert out.stat().st_mode & 0o777 == 0o777 & ~export._umask()         # not the temporary directory's 0o700


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_name_tables_cover_every_checkpoint_tensor(variant):
    """Each checkpoint tensor has exactly one entry in the CTranslate2 table (and, post-LN, Marian's), and the
    tables name what the CTranslate2 shapes list (tied and computed variables aside)."""
    config = VARIANTS[variant]
    assert sorted(export.name_table(config)) == sorted(parameter_shapes(config))
    computed = set(export.tied(config)) | ({"encoder/position_encodings/encodings",
                                            "decoder/position_encodings/encodings"}
                                           if config.positional_encoding == "sinusoidal" else set())
    assert set(export.name_table(config).values()) | computed == set(export.variable_shapes(config))
    if not config.norm_first and importlib.util.find_spec("torch"):
        assert sorted(peers().marian_name_table(config)) == sorted(parameter_shapes(config))


def test_ids_and_tokens_round_trip():
    config = VARIANTS["special_ids"]
    rows = np.array([[8, 9, 7, 5, 5], [3, 7, 5, 5, 5]])
    tokens = export.to_tokens(config, rows, config.src_vocab_size)
    assert tokens == [["<8>", "<9>", "</s>"], ["<s>", "</s>"]]
    np.testing.assert_array_equal(export.to_ids(config, tokens, config.src_vocab_size), rows[:, :3])
    with pytest.raises(ValueError, match=r"^row 0 holds pad_id \(5\) before its last token"):
        export.to_tokens(config, np.array([[8, 5, 9]]), config.src_vocab_size)


@pytest.mark.parametrize("changes,field", [({"layer_norm_eps": 1e-50}, "layer_norm_eps"),
                                           ({"d_model": 65536, "n_heads": 32768, "d_ff": 4}, "n_heads")])
def test_export_refuses_a_config_ctranslate2_cannot_hold(changes, field):
    with pytest.raises(ValueError, match=rf"^{field} \(") as error:
        export.check_representable(TINY.replace(**changes), {})
    assert len(str(error.value).splitlines()) == 1


def test_export_refuses_a_float64_weight_beyond_float32(tmp_path):
    """A float64 checkpoint is rounded to float32 (what CTranslate2 stores); a value float32 cannot hold is refused,
    naming the tensor, and nothing is written."""
    require("ctranslate2", "peers")
    params = init_params(TINY, seed=0)
    params["decoder.layers.1.ffn.linear2.weight"][0, 0] = 1e39
    save_checkpoint(tmp_path / "big.safetensors", TINY, params)
    with pytest.raises(ValueError, match=r"^tensor 'decoder.layers.1.ffn.linear2.weight' holds values beyond float32"):
        export.export_ctranslate2(tmp_path / "big.safetensors", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_export_never_replaces_without_force(tmp_path):
    """An existing directory or file is refused and kept; ``force=True`` replaces it; a failed export with
    ``force`` keeps the old directory; nothing temporary is left behind."""
    require("ctranslate2", "peers")
    checkpoint = write_checkpoint(tmp_path / "m.safetensors", TINY)
    out = tmp_path / "model"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    (tmp_path / "file").write_text("another")
    for target in (out, tmp_path / "file"):
        with pytest.raises(ValueError, match=rf"^'{target}' already exists; pass force=True \(--force\) to replace"):
            export.export_ctranslate2(checkpoint, target)
    assert (out / "mine.txt").read_text() == "a user's file" and (tmp_path / "file").read_text() == "another"
    with pytest.raises(ValueError, match=r"^directory '.*/no/such' of the output does not exist"):
        export.export_ctranslate2(checkpoint, tmp_path / "no" / "such" / "model")

    from ctranslate2.specs import TransformerSpec

    def fail(self, output_dir):
        (tmp_path / "written").write_text(output_dir)
        raise OSError("disk full")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransformerSpec, "save", fail)
        with pytest.raises(OSError, match="disk full"):
            export.export_ctranslate2(checkpoint, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    export.export_ctranslate2(checkpoint, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.bin", "source_vocabulary.json",
                                                    "target_vocabulary.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m.safetensors", "model", "written"]


def test_export_refuses_an_output_that_names_no_directory_of_its_own(tmp_path, monkeypatch):
    """``.`` and ``..`` (the current directory, its parent) are refused with --force too, naming the output, and
    leave the directory as it was; an output that cannot be moved aside leaves no holder directory behind."""
    require("ctranslate2", "peers")
    checkpoint = write_checkpoint(tmp_path / "m.safetensors", TINY)
    work = tmp_path / "work" / "inner"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("a user's file")
    monkeypatch.chdir(work)
    for target in (".", "..", "../inner/.."):
        with pytest.raises(ValueError, match=rf"^'{re.escape(target)}' names no directory of its own to write into"):
            export.export_ctranslate2(checkpoint, target, force=True)
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]

    def refused(source, destination):
        raise OSError("Device or resource busy")

    monkeypatch.setattr(export.os, "rename", refused)
    with pytest.raises(OSError, match="busy"):
        export._move_into_place(tmp_path / "staging", work)
    assert sorted(p.name for p in work.parent.iterdir()) == ["inner"]


def test_export_without_ctranslate2_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)                  # import ctranslate2 fails
    with pytest.raises(ValueError, match=r"^exporting to CTranslate2 needs ctranslate2: pip install "
                                         r"'transformer-reference\[peers\]'$"):
        export.export_ctranslate2(write_checkpoint(tmp_path / "m.safetensors", TINY), tmp_path / "model")
    assert not (tmp_path / "model").exists()


# ----------------------------------------------------------------------------- Marian and nn.Transformer

def marian(variant_or_config, params=None):
    require("transformers", "peers")
    require("torch", "torch")
    config = VARIANTS[variant_or_config] if isinstance(variant_or_config, str) else variant_or_config
    return peers().MarianPeer(config, weights(variant_or_config) if params is None else params, 1)


def full_log_probs(peer_log_probs: np.ndarray, variant: str, src, tgt, agreement, what: str, port: str) -> None:
    """The (B, T, V) log-probabilities at every real target position, within the float32 policy."""
    keep = np.asarray(tgt) != VARIANTS[variant].pad_id
    ref64, ref32 = reference(variant)(src, tgt), reference(variant, dtype=np.float32)(src, tgt)
    agreement(peer_log_probs[keep], ref64[keep], ref32[keep], port=port, device="cpu", dtype="float32", what=what)


@pytest.mark.parametrize("variant", POST_LN)
@pytest.mark.parametrize("case", MASK_CASES)
def test_marian_computes_the_reference_function(variant, case, agreement):
    """HF MarianMTModel with our weights, our interleaved sinusoid table in its position embeddings and our
    LayerNorm epsilon: its log-softmaxed logits within the float32 policy, every post-LN config."""
    inputs = cases.model_inputs(VARIANTS[variant], case)
    full_log_probs(marian(variant).log_probs(inputs["src"], inputs["tgt"]), variant, inputs["src"], inputs["tgt"],
                   agreement, f"log-probs: {variant}/{case}", "marian")


def test_marian_refuses_pre_ln():
    with pytest.raises(ValueError, match=r"^norm_first is True: MarianMTModel is post-LN only"):
        marian("pre_ln")


def test_marian_shipped_model(agreement):
    config, params, src, model64, model32 = shipped()
    targets = hypotheses_as_targets(shipped_decoding("greedy")[0], config)
    keep = targets != config.pad_id
    out = marian(config, params).log_probs(src, targets)
    agreement(out[keep], model64(src, targets)[keep], model32(src, targets)[keep], port="marian", device="cpu",
              dtype="float32", what="log-probs: shipped model")


def test_nn_transformer_peer(agreement):
    """The wrapper ``bench --peers`` times (``transformer_torch.interop``, tested in tests/ports/test_torch.py) on the
    pre-LN variant."""
    require("torch", "torch")
    config = VARIANTS["pre_ln"]
    inputs = cases.model_inputs(config, "ragged_batch")
    peer = peers().NNTransformerPeer(config, weights("pre_ln"), 1)
    full_log_probs(peer.log_probs(inputs["src"], inputs["tgt"]), "pre_ln", inputs["src"], inputs["tgt"], agreement,
                   "log-probs: pre_ln/ragged_batch", "torch.nn.Transformer")


# The Hugging Face families' variants of the matrix (equivalence/cases.py) with the epsilon both families construct
# nn.LayerNorm with (the export's one), fairseq's with one vocabulary (M2M100 has one).
EXPORTABLE = {"marian": cases.FORWARD_VARIANTS["marian"].replace(layer_norm_eps=1e-5),
              "fairseq": cases.FORWARD_VARIANTS["fairseq"].replace(layer_norm_eps=1e-5, src_vocab_size=23)}


@pytest.mark.parametrize("variant", list(EXPORTABLE))
def test_transformers_peer_computes_the_reference_function_and_decodes_by_the_checkpoints_conventions(
        variant, agreement):
    """The ``transformers`` peer -- transformers' own class on the checkpoint's ``export --to hf`` directory -- gives
    the reference's log-probabilities (float32 policy) at every real target position of a ragged batch, and its
    forced-length greedy decoding (exactly N tokens) writes the float64 reference's greedy tokens before each row's
    eos, the checkpoint's start token, suppressed and forced tokens (generation_config.json) included."""
    require("transformers", "peers")
    config = EXPORTABLE[variant]
    params = cases.decoding_params(config)
    peer = peers().TransformersPeer(config, params, 1)
    inputs = cases.model_inputs(config, "ragged_batch")
    src, tgt = inputs["src"], inputs["tgt"]
    tgt[:, 0] = config.start_id
    keep = tgt != config.pad_id
    agreement(peer.log_probs(src, tgt)[keep], *(Transformer(config, params, dtype)(src, tgt)[keep]
                                                for dtype in (np.float64, np.float32)),
              port="transformers", device="cpu", dtype="float32", what=f"log-probs: {variant}/ragged_batch")
    expected = greedy_decode(Transformer(config, params), src)
    out = peer.greedy(src, expected.shape[1])
    assert out.shape == expected.shape
    for row, ref in zip(out, expected):
        length = int((ref != config.pad_id).sum()) - int(config.eos_id in ref) - config.decoding.forced_eos
        assert length > 0
        np.testing.assert_array_equal(row[:length], ref[:length])


def test_transformers_peer_refuses_what_the_hugging_face_export_refuses():
    require("transformers", "peers")
    with pytest.raises(ValueError, match=r"^layer_norm_eps"):
        peers().TransformersPeer(TINY, weights("tiny"), 1)


@pytest.mark.parametrize("name", ["ctranslate2", "torch.nn.Transformer", "marian"])
def test_forced_length_greedy_is_the_reference_up_to_eos(name):
    """What ``bench --peers`` times as greedy decoding (exactly N tokens: eos can neither stop it nor, in
    CTranslate2 and Marian, be written) writes, on the shipped model, the reference's greedy tokens before each
    row's eos."""
    module = peers()
    peer_class, modules, extra = module.PEERS[name]
    for required in modules:
        require(required, extra)
    config, params, src, _, _ = shipped()
    expected = shipped_decoding("greedy")[0]
    steps = expected.shape[1]
    out = peer_class(config, params, 1).greedy(src, steps)
    assert out.shape == (len(src), steps)
    for row, ref in zip(out, expected):
        length = int((ref != config.pad_id).sum()) - int(config.eos_id in ref)
        np.testing.assert_array_equal(row[:length], ref[:length])


# ----------------------------------------------------------------------------- bench --peers

def test_a_peer_in_its_own_process_is_the_same_peer():
    """``bench --peers`` runs CTranslate2 in a process of its own (``OwnProcess``): the same outputs as in this
    process, its refusal as the same ``ValueError``, a failing call as an error naming the peer."""
    require("ctranslate2", "peers")
    module, config = peers(), VARIANTS["tiny"]
    worker = module.OwnProcess(module.CTranslate2Peer, config, weights("tiny"), 1)
    src, tgt = (cases.model_inputs(config, "ragged_batch")[key] for key in ("src", "tgt"))
    try:
        np.testing.assert_array_equal(worker.greedy(src, 9), ct2_peer("tiny").greedy(src, 9))
        np.testing.assert_array_equal(worker.beam(src, 9, 4, 0.6), ct2_peer("tiny").beam(src, 9, 4, 0.6))
        for ours, theirs in zip(worker.forward(src, tgt), ct2_peer("tiny").forward(src, tgt)):
            np.testing.assert_array_equal(ours, theirs)
        with pytest.raises(RuntimeError, match=r"^ctranslate2 worker: ValueError: row 0 holds pad_id"):
            worker.greedy(np.array([[4, config.pad_id, 5]]), 3)
    finally:
        worker.close()
    assert worker._process.returncode == 0
    with pytest.raises(ValueError, match=r"^layer_norm_eps \(1e-50\) is not a normal float32 number"):
        module.OwnProcess(module.CTranslate2Peer, config.replace(layer_norm_eps=1e-50), weights("tiny"), 1)


def test_a_peer_that_cannot_run_is_listed_with_the_reason(monkeypatch):
    """Not installed: the missing module and the extra to install; installed but unable to hold the config: its
    one-line refusal."""
    module = peers()
    monkeypatch.setattr(module, "PEERS", {"marian": (module.MarianPeer, ("no_such_module_here",), "peers")})
    assert module.load(TINY, weights("tiny"), 1) == ({}, [module.Missing(
        "marian", "not installed (no_such_module_here missing): pip install 'transformer-reference[peers]'")])
    require("transformers", "peers")
    monkeypatch.setattr(module, "PEERS", {"marian": (module.MarianPeer, ("transformers", "torch"), "peers")})
    built, missing = module.load(VARIANTS["pre_ln"], weights("pre_ln"), 1)
    assert built == {} and missing == [module.Missing("marian", "cannot run this config: norm_first is True: "
                                                                "MarianMTModel is post-LN only (a LayerNorm after "
                                                                "each residual)")]


# About 40 s on a new machine: Inductor compiles the cached decoding step's programs, the engine `bench --compiled`
# times (its own persistent cache, once warm, shortens it).
def test_bench_compiled_times_the_pytorch_ports_compiled_decoding_beside_the_eager_port(monkeypatch):
    """``bench --compiled``: the PyTorch port's cached decoding under ``compile_decoding`` is one more engine,
    beside the eager port (the forward pass and the uncached decoding are the eager port's alone)."""
    require("torch", "torch")
    monkeypatch.setattr(bench_module, "MATMUL_SIZE", 64)
    monkeypatch.setattr(bench_module, "BANDWIDTH_MIB", 4)
    monkeypatch.setattr(timing, "PRODUCTS", {"torch": timing.PRODUCTS["torch"]})
    report = bench_module.bench("tiny", batch=1, src_len=6, tgt_len=5, decode_tokens=51, names=("torch",), repeats=1,
                                compiled=True)
    assert {(m.backend, m.task) for m in report.measurements} == {
        ("torch", "forward"), ("torch", "greedy (cached)"), ("torch", "greedy (uncached)"),
        (bench_module.COMPILED, "greedy (cached)")}
    assert "compile_decoding" in report.computes[bench_module.COMPILED]["greedy (cached)"]
    assert bench_module.COMPILED in bench_module.format_bench(report)


def test_bench_times_a_checkpoint_with_its_own_config_and_conventions(monkeypatch, tmp_path):
    """``bench CHECKPOINT --peers`` on an imported Marian model (a random ``MarianMTModel`` saved by transformers,
    then ``import``): the ports decode with the checkpoint's conventions (its length penalty), within
    ``--decode-tokens``' budget, not the checkpoint's own; the ``transformers`` peer runs the model as transformers
    loads its export, exactly N tokens; the peers built with the paper's choices say why they cannot run it; the
    inputs avoid the special ids (pad is Marian's last id); the report names the checkpoint."""
    require("torch", "torch")
    require("transformers", "peers")
    from support import build

    from reference_numpy.checkpoint import load_checkpoint
    from transformer_hf.importer import import_hf

    model = build("marian", seed=1, vocab_size=40, pad_token_id=39, eos_token_id=0, decoder_start_token_id=39,
                  max_position_embeddings=64)
    model.generation_config.max_length = 9
    model.save_pretrained(tmp_path / "marian")
    path = tmp_path / "marian.safetensors"
    import_hf(tmp_path / "marian", path)
    config, _ = load_checkpoint(path)
    assert config.decoding.max_output_length == 8 and config.pad_id == config.src_vocab_size - 1
    monkeypatch.setattr(bench_module, "MATMUL_SIZE", 64)
    monkeypatch.setattr(bench_module, "BANDWIDTH_MIB", 4)
    monkeypatch.setattr(timing, "PRODUCTS", {"torch": timing.PRODUCTS["torch"]})
    shapes = {"batch": 2, "src_len": 6, "tgt_len": 5, "decode_tokens": 55}
    report = bench_module.bench(checkpoint=path, **shapes, names=("torch",), repeats=1, peers=True)
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert (data["preset"], data["checkpoint"]) == (None, str(path))
    assert data["shapes"]["alpha"] == config.decoding.length_penalty == 1.0
    tokens = {(m["backend"], m["task"]): m["tokens"] for m in data["measurements"]}
    assert set(tokens) == {(engine, task) for engine in ("torch", "transformers") for task in bench_module.PEER_TASKS}
    assert all(8 < tokens["torch", task] <= 55 for task in bench_module.PEER_TASKS[1:])      # N, not 8 (no eos)
    assert all(tokens["transformers", task] == 55 for task in bench_module.PEER_TASKS[1:])   # exactly N
    assert "|Y|^alpha" in data["computes"]["torch"]["beam 4 batch 1"]
    reasons = {m["name"]: m["reason"] for m in data["missing"]}
    assert {name for name in reasons if name in peers().PEERS} == set(peers().PEERS) - {"transformers"}
    assert all(reasons[name].startswith("cannot run this config: activation 'silu'")
               for name in ("ctranslate2", "torch.nn.Transformer", "marian"))
    src, tgt, decode_src = bench_module.bench_inputs(config, 2, 6, 5, 55, 8)
    for ids in (src, tgt[:, 1:], decode_src):
        assert not np.isin(ids, [config.pad_id, config.bos_id, config.eos_id]).any()
    assert (tgt[:, 0] == config.start_id).all()
    assert bench_module.format_bench(report).startswith(f"checkpoint {path}, float32;")
