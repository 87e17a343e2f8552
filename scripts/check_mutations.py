"""Break the code on purpose and check that the suite notices: each mutation is applied to a
copy of the repository and the tests it names -- the independent check meant to catch it --
must fail.

Two scopes of mutation:

* **single**: a classic bug in one backend; the naive checks of the reference or the agreement
  matrix must see it.
* **consistent**: the same bug planted in the reference and in every port at once (one
  mutation edits several files: a beam rule lives in the reference and in each port's own
  candidate selection). The agreement matrix cannot see such a bug, since every
  backend still agrees; only the independent oracles written from the paper can. With
  ``--blind`` the script also runs the mutation's agreement selection and requires it to
  *pass*, which proves the plant really is the same everywhere.

    python scripts/check_mutations.py                       # every mutation (50 minutes on a 2-core machine)
    python scripts/check_mutations.py --scope consistent    # only the consistent ones
    python scripts/check_mutations.py --kind loss --kind ties
    python scripts/check_mutations.py --only "final LayerNorm" --blind
    python scripts/check_mutations.py --scope consistent --every-test   # name every test that fails
    python scripts/check_mutations.py --list                # list them (and check every edit applies)

Prints one line per mutation -- caught (the selected tests failed), MISSED (they passed) or
ERROR (they could not run: a collection error, or no test selected) -- with the first failing
test (every failing test with ``--every-test``), then a summary per kind. Exits 1 unless every mutation is caught (and, with ``--blind``,
every consistent one passes its agreement selection).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF, TORCH, JAX, TF = "reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf"
BACKENDS = (REF, TORCH, JAX, TF)


@dataclass(frozen=True)
class Edit:
    """Replace ``original`` (found exactly once) by ``mutated`` in ``path``."""

    path: str
    original: str
    mutated: str


@dataclass(frozen=True)
class Mutation:
    """One planted bug: its kind, scope ("single" or "consistent"), the edits that plant it, the
    pytest arguments that must fail (``catch``) and, for a consistent bug, the agreement tests that
    must still pass (``blind``). ``shared`` names ports that run the reference's own code for the
    mutated part (they get the bug through the reference's edit)."""

    kind: str
    bug: str
    scope: str
    edits: tuple[Edit, ...]
    catch: tuple[str, ...]
    blind: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()

    def __post_init__(self):
        if self.scope not in ("single", "consistent"):
            raise ValueError(f"{self.bug}: scope must be 'single' or 'consistent', got {self.scope!r}")
        touched = {edit.path.split("/")[0] for edit in self.edits} | set(self.shared)
        if self.scope == "consistent" and touched != set(BACKENDS):
            raise ValueError(f"{self.bug}: a consistent mutation plants the bug in every backend, "
                             f"missing {sorted(set(BACKENDS) - touched)}")


def single(kind: str, bug: str, path: str, original: str, mutated: str, catch: list[str]) -> Mutation:
    return Mutation(kind, bug, "single", (Edit(path, original, mutated),), tuple(catch))


def consistent(kind: str, bug: str, edits: list[tuple[str, str, str]], catch: list[str],
               blind: list[str] = (), shared: tuple[str, ...] = ()) -> Mutation:
    return Mutation(kind, bug, "consistent", tuple(Edit(*edit) for edit in edits), tuple(catch), tuple(blind),
                    shared)


# The independent checks, and the agreement selections a consistent bug passes (float64, CPU).
ORACLE = ["tests/reference/test_oracle.py"]
LOSS_ORACLE = ["tests/equivalence/test_loss_oracle.py"]
DECODING_ORACLE = ["tests/equivalence/test_decoding_oracle.py", "tests/reference/test_decoding.py"]
CHOICES_ORACLE = ["tests/families/test_config_choices.py"]


def agreement(variants: str, decoding: bool = False) -> list[str]:
    """Forward stages of every port (one mask case, the ragged batch) for ``variants`` (a -k
    expression), and with ``decoding`` the float64 greedy and beam tokens too."""
    checks = "(test_forward_stages and ragged_batch or test_decoded_tokens_float64)" if decoding \
        else "test_forward_stages and ragged_batch"
    return ["tests/equivalence/test_agreement.py", "-k", f"cpu and float64 and {checks} and ({variants})"]


GRADIENTS = ["tests/equivalence/test_gradients.py", "-k", "tiny"]
FUZZ = ["tests/equivalence/test_fuzz.py", "-k", "configurations and torch"]


# ----------------------------------------------------------------------------- single-backend bugs

SINGLE = [
    single("layer-norm", "reference: LayerNorm epsilon outside the square root", "reference_numpy/model.py",
           "np.sqrt(var + self.eps)", "(np.sqrt(var) + self.eps)", ["tests/reference/test_reference.py", "-k", "layer_norm"]),
    single("positional-encoding", "reference: positional encoding [sin | cos] instead of interleaved",
           "reference_numpy/model.py",
           "    table[:, 0::2] = np.sin(angle)\n    table[:, 1::2] = np.cos(angle)",
           "    table[:, :d_model // 2] = np.sin(angle)\n    table[:, d_model // 2:] = np.cos(angle)",
           ["tests/reference/test_reference.py", "-k", "positional"]),
    single("masks", "reference: decoder may see one future position", "reference_numpy/model.py",
           "np.tril(np.ones((length, length), dtype=bool))", "np.tril(np.ones((length, length), dtype=bool), k=1)",
           ["tests/reference/test_reference.py", "-k", "causal"]),
    single("attention", "reference: heads split token-major", "reference_numpy/model.py",
           "x = x.reshape(batch, length, self.n_heads, width // self.n_heads)  # (B, T, H, d_k)\n"
           "        return x.transpose(0, 2, 1, 3)",
           "x = x.reshape(batch, self.n_heads, length, width // self.n_heads)\n        return x",
           ["tests/reference/test_reference.py", "-k", "multi_head"]),
    single("embedding-scale", "reference: embeddings not scaled by sqrt(d_model)", "reference_numpy/model.py",
           "return narrow(wide(self.weight[tokens]) * self.scale, self.weight.dtype)", "return self.weight[tokens]",
           ["tests/reference/test_reference.py", "-k", "shared_embeddings"]),
    single("ties", "reference: greedy ties go to the highest token id", "reference_numpy/decoding.py",
           "token = log_probs.argmax(axis=-1)", "token = log_probs.shape[-1] - 1 - log_probs[:, ::-1].argmax(axis=-1)",
           ["tests/reference/test_decoding.py", "-k", "ties_to_the_lowest_id"]),
    single("ties", "reference: equal beam scores go to the later hypothesis", "reference_numpy/decoding.py",
           "key=lambda i: (finished[i][0], -i)", "key=lambda i: (finished[i][0], i)",
           ["tests/reference/test_decoding.py", "-k", "equal_scores"]),
    single("ties", "torch: the beam's candidate selection never sees a candidate topk left out at the boundary",
           f"{TORCH}/decoding.py", "values[:, top] == boundary[:, 0]", "values[:, top] != values[:, top]",
           ["tests/ports/test_torch.py", "-k", "candidate_selection"]),
    single("epsilon", "torch: LayerNorm epsilon left at torch's default 1e-5", "transformer_torch/model.py",
           "super().__init__(config.d_model, eps=config.layer_norm_eps)", "super().__init__(config.d_model)",
           ["tests/equivalence/test_agreement.py", "-k", "torch and cpu and test_component and encoder_layer and none"]),
    single("checkpoint", "torch: a square projection not transposed on load", "transformer_torch/checkpoint.py",
           "if _LAYOUT[tensor.kind][1])",
           'if _LAYOUT[tensor.kind][1] and not tensor.name.endswith("o_proj.weight"))',
           ["tests/equivalence/test_agreement.py", "-k", "torch and cpu and test_component and multi_head_attention and none"]),
    single("dropout", "torch: dropout left on at inference", "equivalence/backends/torch.py",
           "_, stages = capture_stages(model.eval(), src, tgt, src_mask, tgt_mask)",
           "_, stages = capture_stages(model.train(), src, tgt, src_mask, tgt_mask)",
           ["tests/equivalence/test_agreement.py", "-k", "torch and cpu and test_forward_stages and tiny and none"]),
    single("epsilon", "keras: LayerNorm epsilon left at Keras' default 1e-3", "transformer_tf/model.py",
           "super().__init__(axis=-1, epsilon=config.layer_norm_eps, **float32_under_autocast(kwargs))",
           "super().__init__(axis=-1, **float32_under_autocast(kwargs))",
           ["tests/equivalence/test_agreement.py", "-k", "tf and cpu and test_component and encoder_layer and none"]),
    single("embedding-scale", "keras: embeddings not scaled by sqrt(d_model)", "transformer_tf/model.py",
           "self.scale = math.sqrt(self.config.d_model)", "self.scale = 1.0",
           ["tests/equivalence/test_agreement.py", "-k", "tf and cpu and test_forward_stages and tiny and none"]),
    single("masks", "jax: masked scores filled with -1e9 (uniform average on a fully masked row)",
           "transformer_jax/softmax.py",
           "scores = jnp.where(mask, scores, -jnp.inf)", "scores = jnp.where(mask, scores, -1e9)",
           ["tests/ports/test_masked_rows.py", "-k", "jax"]),
    single("masks", "torch: a row that sees no key outputs its zero weights times the values (NaN over an infinite "
           "value)", "transformer_torch/softmax.py",
           "    return torch.where(mask.any(dim=-1, keepdim=True), x, 0.0)", "    return x",
           ["tests/ports/test_masked_rows.py", "-k", "infinite and torch"]),
    single("cache", "keras: attention along beam hypotheses ignores its mask (a step sees positions not yet written)",
           "transformer_tf/incremental.py", "weights = masked_softmax(scores, mask, query.shape[-1])",
           "weights = masked_softmax(scores, None, query.shape[-1])",
           ["tests/ports/test_beam_cache.py", "-k", "naive_loop and tf"]),
    single("cache", "reference: key/value cache written one position late", "reference_numpy/incremental.py",
           "buffer[:, :, index:index + new.shape[2]] = new", "buffer[:, :, index + 1:index + 1 + new.shape[2]] = new",
           ["tests/reference/test_reference.py", "-k", "cached"]),
    single("cache", "torch: key/value cache written one position late", "transformer_torch/incremental.py",
           "        buffer[:, :, positions] = new",
           "        buffer[:, :, positions.start + 1:positions.stop + 1] = new",
           ["tests/ports/test_every_port.py", "tests/ports/test_torch.py", "-k", "cache and torch"]),
    single("export", "torch: an exported step's cache written one position late (a traced index)",
           "transformer_torch/incremental.py", "return start + torch.arange(length, device=start.device)",
           "return start + 1 + torch.arange(length, device=start.device)",
           ["tests/cli/test_export.py", "-k", "decoding_step_agrees and torch-export"]),
    single("export", "export --check: the serving loops (section 6.1's rules) held to the checkpoint's own decoding "
           "conventions", "transformer_export/check.py", "config = config.paper_decoding()",
           "config = config", ["tests/cli/test_export.py", "-k", "whatever_the_checkpoints"]),
    # export --check on artefacts with one part wrong, the other right (tests/cli/test_export.py, ONE_PART_WRONG)
    single("export", "export --check: the cached decoding step's verdict left out of the exit status",
           "transformer_export/check.py", "and (self.step is None or self.step.ok)",
           "and (self.step is None or True)", ["tests/cli/test_export.py", "-k", "one_part_of_the_artefact and onnx"]),
    single("export", "export --check: the cached decoding step's log-probabilities compared at the first position "
           "alone", "transformer_export/check.py",
           "read = oracle.inputs[\"tgt\"] != config.pad_id ",
           "read = (oracle.inputs[\"tgt\"] != config.pad_id) & (np.arange(oracle.inputs[\"tgt\"].shape[1]) == 0) ",
           ["tests/cli/test_export.py", "-k", "one_part_of_the_artefact and onnx"]),
    single("export", "torch: the compiled decoding step handed a constant cache index (position 0)",
           "transformer_torch/speed.py", "torch.tensor(cache_index, device=tgt.device)",
           "torch.tensor(0, device=tgt.device)",
           ["tests/export/test_exporters.py", "-k", "compiled_decoding"]),
    single("cache", "keras: key/value cache written one position late", "transformer_tf/incremental.py",
           "positions = tf.cast(index, tf.int32) + tf.range(shape[2])",
           "positions = tf.cast(index, tf.int32) + 1 + tf.range(shape[2])",
           ["tests/ports/test_every_port.py", "tests/ports/test_tf.py", "-k", "cache and tf"]),
    single("cache", "jax: key/value cache written one position late", "transformer_jax/incremental.py",
           "return KVCache(lax.dynamic_update_slice_in_dim(self.keys, keys, cache_index, axis=2),",
           "return KVCache(lax.dynamic_update_slice_in_dim(self.keys, keys, cache_index + 1, axis=2),",
           ["tests/ports/test_every_port.py", "tests/ports/test_jax.py", "-k", "cache and jax"]),
    single("cache", "keras: a beam table not marked at the new positions (read from the row that held them)",
           "transformer_tf/incremental.py", "return tf.where((position >= 0) & (position < length), own, beams)",
           "return beams", ["tests/ports/test_beam_cache.py", "-k", "tf"]),
    # Bugs only some configurations show: the fuzzer's suite budget must find them (tests/equivalence/test_fuzz.py).
    single("fuzz", "torch: heads split token-major when their count is odd", "transformer_torch/model.py",
           "x = x.view(batch, length, self.n_heads, width // self.n_heads)     # (B, T, H, d_k)",
           "x = (x.view(batch, length, width // self.n_heads, self.n_heads).transpose(2, 3) if self.n_heads % 2\n"
           "             else x.view(batch, length, self.n_heads, width // self.n_heads))",
           FUZZ),
    single("fuzz", "torch: the encoder's source mask hides min(pad_id, eos_id) (wrong only when pad_id > eos_id)",
           "transformer_torch/model.py",
           "            src_mask = padding_mask(src, self.config.pad_id)\n        x = self.src_pos",
           "            src_mask = padding_mask(src, min(self.config.pad_id, self.config.eos_id))\n"
           "        x = self.src_pos", FUZZ),
    # The select that guards a one-term product (the next mutation) stands between the scaled scores and the
    # subtraction too, and alone keeps this bug from showing: it goes with it, as the code was when the case was found.
    Mutation("fuzz", "jax: the scores scaled before their row maximum, no select between them and the subtraction "
             "(XLA:CPU computes the scaled scores twice, once contracted into an FMA)", "single",
             (Edit("transformer_jax/softmax.py", "    if mask is not None:\n        scores = jnp.where(mask, scores, -jnp.inf)",
                   "    scores = scores / math.sqrt(d_k)\n    if mask is not None:\n"
                   "        scores = jnp.where(mask, scores, -jnp.inf)"),
              Edit("transformer_jax/softmax.py", "exp = jnp.exp((scores - row_max) / math.sqrt(d_k))",
                   "exp = jnp.exp(scores - row_max)"),
              Edit("transformer_jax/softmax.py", "    scores = jnp.where(jnp.isnan(scores), jnp.nan, scores)\n", "")),
             ("tests/equivalence/test_fuzz.py", "-k", "fused-maximum and jax")),
    *(single("fuzz", f"{port}: no select between a one-term Q K^T and the subtraction of its row maximum (XLA:CPU "
             "recomputes the product and contracts it into an FMA)", f"{package}/softmax.py", guard, "",
             ["tests/equivalence/test_fuzz.py", "-k", f"one_dimension_a_head and {port}"])
      for port, package, guard in (
          ("jax", JAX, "    scores = jnp.where(jnp.isnan(scores), jnp.nan, scores)\n"),
          ("tf", TF, "    scores = tf.where(tf.math.is_nan(scores), tf.constant(np.nan, scores.dtype), scores)\n"))),
    single("fuzz", "torch: a LayerNorm whose float32 variance overflows gives the kernel's bias, not NaN (finite "
           "where the reference is not, after an overflow outside Eq. (1))", "transformer_torch/model.py",
           "return narrow(torch.where(rstd == 0, torch.nan, y), x.dtype)", "return narrow(y, x.dtype)",
           ["tests/equivalence/test_fuzz.py", "-k", "layer-norm-bias and torch"]),
    single("fuzz", "reference: its training pass counts the decoder's fairseq positions by token (its forward pass "
           "and every port by step)", "reference_numpy/backward.py",
           'learned, y, tgt, grads, by_step=True,', 'learned, y, tgt, grads,',
           ["tests/equivalence/test_fuzz.py", "-k", "pad-target and torch"]),
    # The decoding conventions the fuzzer draws (equivalence/fuzz.py, `conventions`), checked in greedy decoding and
    # beam search against the reference.
    single("fuzz", "torch: the suppressed tokens the paper's pad and bos, not the config's suppressed_ids",
           f"{TORCH}/decoding.py", "scores[:, list(config.never_emitted)] = -torch.inf",
           "scores[:, [config.pad_id, config.bos_id]] = -torch.inf", FUZZ),
    Mutation("fuzz", "every port's beam search: lp(Y) with alpha 1 whatever the config's (|Y| for \"hf\")", "single",
             tuple(Edit(f"{port}/decoding.py", "length_penalty(n, alpha, cfg.decoding.length_normalization)",
                        "length_penalty(n, 1.0, cfg.decoding.length_normalization)") for port in (TORCH, JAX, TF)), tuple(FUZZ)),
    # The documentation names files that exist, and documents the command's exit codes.
    single("docs", "docs: a test module named by a path that does not exist", "docs/testing.md",
           "* `tests/reference/test_oracle.py` recomputes", "* `tests/reference/test_oracles.py` recomputes", ["tests/project/test_references.py"]),
    single("docs", "a docstring names a test file that does not exist", "equivalence/contract.py",
           "``tests/equivalence/test_equivalence.py`` checks", "``tests/equivalence/test_contract.py`` checks", ["tests/project/test_references.py"]),
    single("docs", "docs/benchmarks.md: a section named as a before/after comparison", "docs/benchmarks.md",
           "## Training throughput: `scripts/bench_training.py`",
           "## Training throughput before and after: `scripts/bench_training.py`",
           ["tests/project/test_references.py", "-k", "state_what_is"]),
    single("docs", "docs/benchmarks.md: a result file no document cites", "docs/benchmarks.md",
           "**16.1 s** wall ([results/2026-11-22-compare.md](results/2026-11-22-compare.md))", "**16.1 s** wall",
           ["tests/project/test_references.py", "-k", "state_what_is"]),
    single("docs", "docs/cli.md: the internal error's exit code left out of the table", "docs/cli.md",
           "| `3` | internal error", "| 3 | internal error", ["tests/cli/test_cli.py", "-k", "exit_codes_are_documented"]),
]


# ----------------------------------------------------------------------------- consistent model bugs

RM, TM, JM, FM = (f"{package}/model.py" for package in BACKENDS)
JL, FL = f"{JAX}/layers.py", f"{TF}/layers.py"   # Flax's and Keras' plumbing beside model.py
RI, TI, JI, FI = (f"{package}/incremental.py" for package in BACKENDS)   # the cache beside each model.py
RS, TS, JS, FS = (f"{package}/softmax.py" for package in BACKENDS)   # Eq. (1)'s masked softmax and fully masked row
JD, FD = f"{JAX}/decoding.py", f"{TF}/decoding.py"

# The cached path in every backend's model.py and its cache in every incremental.py (the same text in all four).
_FIRST_DECODER_LAYER = [
    ("x, layer_cache = layer(x, memory", "x, layer_cache = self.layers[0](x, memory"),
]
_FIRST_DECODER_LAYER_CACHE = ("memory_cache(layer.cross_attn, memory)) for layer in model.decoder.layers)",
                              "memory_cache(model.decoder.layers[0].cross_attn, memory)) for layer in model.decoder.layers)")

STACKING = [
    consistent("stacking", "encoder: every layer applied twice", [
        (RM, "x = layer(x, mask)\n", "x = layer(layer(x, mask), mask)\n"),
        (TM, "x = layer(x, mask)\n", "x = layer(layer(x, mask), mask)\n"),
        (JM, "x = layer(x, mask, deterministic=deterministic)",
         "x = layer(layer(x, mask, deterministic=deterministic), mask, deterministic=deterministic)"),
        (FM, "x = layer(x, mask, training=training)", "x = layer(layer(x, mask, training=training), mask, training=training)"),
    ], ORACLE, agreement("tiny")),
    consistent("stacking", "encoder: layers run in reverse order", [
        (RM, "for layer in self.layers:\n            x = layer(x, mask)",
         "for layer in list(self.layers)[::-1]:\n            x = layer(x, mask)"),
        (TM, "for layer in self.layers:\n            x = layer(x, mask)",
         "for layer in list(self.layers)[::-1]:\n            x = layer(x, mask)"),
        (JM, "for layer in self.layers:\n            x = layer(x, mask,",
         "for layer in list(self.layers)[::-1]:\n            x = layer(x, mask,"),
        (FM, "for layer in self.layers:\n            x = layer(x, mask,",
         "for layer in list(self.layers)[::-1]:\n            x = layer(x, mask,"),
    ], ORACLE, agreement("tiny")),
    consistent("stacking", "decoder: the first layer's weights at every depth", [
        *[(module, *edit) for module in (RM, TM, JM, FM) for edit in _FIRST_DECODER_LAYER],
        *[(module, *_FIRST_DECODER_LAYER_CACHE) for module in (RI, TI, JI, FI)],
        (RM, "x = layer(x, memory, src_mask, tgt_mask)\n", "x = self.layers[0](x, memory, src_mask, tgt_mask)\n"),
        (TM, "x = layer(x, memory, src_mask, tgt_mask)\n", "x = self.layers[0](x, memory, src_mask, tgt_mask)\n"),
        (JM, "x = layer(x, memory, src_mask, tgt_mask, deterministic=deterministic)",
         "x = self.layers[0](x, memory, src_mask, tgt_mask, deterministic=deterministic)"),
        (FM, "x = layer(x, memory, src_mask, tgt_mask, training=training)",
         "x = self.layers[0](x, memory, src_mask, tgt_mask, training=training)"),
    ], ORACLE, agreement("tiny", decoding=True)),
]

RESIDUAL = [
    consistent("residual", "post-LN: LayerNorm of the sublayer output alone, x + LN(Sublayer(x))", [
        (RM, "return norm(add(x, sublayer(x)))", "return add(x, norm(sublayer(x)))"),
        *[(module, "return norm(add(x, dropout(sublayer(x))))", "return add(x, norm(dropout(sublayer(x))))")
          for module in (TM, JM, FM)],
    ], ORACLE, agreement("tiny")),
    consistent("residual", "pre-LN: the residual branch carries the normalized input, LN(x) + Sublayer(LN(x))", [
        (RM, "return add(x, sublayer(norm(x)))", "return add(norm(x), sublayer(norm(x)))"),
        *[(module, "return add(x, dropout(sublayer(norm(x))))", "return add(norm(x), dropout(sublayer(norm(x))))")
          for module in (TM, JM, FM)],
    ], ORACLE, agreement("pre_ln")),
    consistent("residual", "decoder: the cross-attention sublayer uses the self-attention sublayer's LayerNorm", [
        (RM, "self.cross_attn_norm, self.norm_first)", "self.self_attn_norm, self.norm_first)"),
        (TM, "self.cross_attn_norm, self.norm_first, self.dropout)", "self.self_attn_norm, self.norm_first, self.dropout)"),
        (JM, "self.cross_attn_norm, self.norm_first, drop)", "self.self_attn_norm, self.norm_first, drop)"),
        (FM, "self.cross_attn_norm, self.norm_first, dropout)", "self.self_attn_norm, self.norm_first, dropout)"),
    ], ORACLE, agreement("tiny or pre_ln", decoding=True)),
    consistent("residual", "encoder: feed-forward sublayer before self-attention", [
        (RM, "x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first)\n"
             "        return residual(x, self.ffn, self.ffn_norm, self.norm_first)",
         "x = residual(x, self.ffn, self.ffn_norm, self.norm_first)\n"
         "        return residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first)"),
        (TM, "x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first,\n"
             "                     self.dropout)\n"
             "        return residual(x, self.ffn, self.ffn_norm, self.norm_first, self.dropout)",
         "x = residual(x, self.ffn, self.ffn_norm, self.norm_first, self.dropout)\n"
         "        return residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first,\n"
         "                        self.dropout)"),
        (JM, "x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, drop)\n"
             "        return residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)",
         "x = residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)\n"
         "        return residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, drop)"),
        (FM, "x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, dropout)\n"
             "        return residual(x, self.ffn, self.ffn_norm, self.norm_first, dropout)",
         "x = residual(x, self.ffn, self.ffn_norm, self.norm_first, dropout)\n"
         "        return residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, dropout)"),
    ], ORACLE, agreement("tiny")),
]

FINAL_NORMS = [
    consistent("final-norm", "pre-LN: the encoder's final LayerNorm left out", [
        (module, "        return self.norm(x) if self.norm is not None else x\n", "        return x\n")
        for module in (RM, TM, JM, FM)
    ], ORACLE, agreement("pre_ln")),
    consistent("final-norm", "pre-LN: the decoder's final LayerNorm left out", [
        (module, "x = self.norm(x) if self.norm is not None else x\n        return x if cache is None else (x, tuple(kept))",
         "x = x\n        return x if cache is None else (x, tuple(kept))") for module in (RM, TM, JM, FM)
    ], ORACLE, agreement("pre_ln", decoding=True)),
]

EMBEDDING_SCALE = [
    consistent("embedding-scale", "source embeddings not scaled by sqrt(d_model) (the target's still are)", [
        (RM, "x = self.src_pos(self.src_embed(src),", "x = self.src_pos(self.src_embed(src) / self.src_embed.scale,"),
        (TM, "x = self.src_pos(self.src_embed(src),", "x = self.src_pos(self.src_embed(src) / self.src_embed.scale,"),
        (JM, "self.src_pos(self.src_embed(src),", "self.src_pos(self.src_embed(src) / self.src_embed.scale,"),
        (FM, "x = self.src_pos(self.src_embed(src),", "x = self.src_pos(self.src_embed(src) / self.src_embed.scale,"),
    ], ORACLE, agreement("tiny or shared_embeddings")),
    consistent("embedding-scale", "target embeddings not scaled by sqrt(d_model) (the source's still are)", [
        (module, "y = self.tgt_pos(self.tgt_embed(tgt),", "y = self.tgt_pos(self.tgt_embed(tgt) / self.tgt_embed.scale,")
        for module in (RM, TM, JM, FM)
    ], ORACLE, agreement("tiny or shared_embeddings", decoding=True)),
]

# Every combination of the embedding choices by hand and against transformers (tests/families/test_embedding_choices.py)
EMBEDDINGS = ["tests/families/test_embedding_choices.py"]
_TARGET_SCALED = {
    RM: ("self.tgt_embed = Embeddings(config, p, tgt_name)",
         "self.tgt_embed = Embeddings(config.replace(scale_embeddings=config.scale_embeddings or not "
         "config.share_embeddings), p, tgt_name)"),
    TM: ("else Embeddings(config, config.tgt_vocab_size)",
         "else Embeddings(config.replace(scale_embeddings=True), config.tgt_vocab_size)"),
    JM: ("else Embeddings(config, config.tgt_vocab_size, **kw)",
         "else Embeddings(config.replace(scale_embeddings=True), config.tgt_vocab_size, **kw)"),
    FM: ('else Embeddings(cfg, cfg.tgt_vocab_size, **sub("tgt_embed"))',
         'else Embeddings(cfg.replace(scale_embeddings=True), cfg.tgt_vocab_size, **sub("tgt_embed"))'),
}
EMBEDDING_CHOICES = [
    single("embedding-scale", "torch: separate target embeddings scaled by sqrt(d_model) whatever scale_embeddings "
           "says", TM, *_TARGET_SCALED[TM], [*EMBEDDINGS, "-k", "by_hand and torch"]),
    consistent("embedding-scale", "separate target embeddings scaled by sqrt(d_model) whatever scale_embeddings says",
               [(path, *edit) for path, edit in _TARGET_SCALED.items()], [*EMBEDDINGS, "-k", "transformers"],
               agreement("fairseq")),
]

EPSILON = [
    consistent("epsilon", "every LayerNorm uses 1e-6 whatever config.layer_norm_eps says", [
        (RM, "self.eps = config.layer_norm_eps", "self.eps = 1e-6"),
        (TM, "super().__init__(config.d_model, eps=config.layer_norm_eps)", "super().__init__(config.d_model, eps=1e-6)"),
        (JM, "epsilon=config.layer_norm_eps,", "epsilon=1e-6,"),
        (FM, "super().__init__(axis=-1, epsilon=config.layer_norm_eps, **float32_under_autocast(kwargs))",
         "super().__init__(axis=-1, epsilon=1e-6, **float32_under_autocast(kwargs))"),
    ], ORACLE, agreement("layer_norm_eps")),
    consistent("epsilon", "decoder: the cross-attention LayerNorm uses 1e-6, not config.layer_norm_eps", [
        (RM, 'LayerNorm(config, params, f"{name}.cross_attn_norm")',
         'LayerNorm(config.replace(layer_norm_eps=1e-6), params, f"{name}.cross_attn_norm")'),
        (TM, "self.cross_attn_norm = LayerNorm(config)", "self.cross_attn_norm = LayerNorm(config.replace(layer_norm_eps=1e-6))"),
        (JM, "self.cross_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)",
         "self.cross_attn_norm = LayerNorm(config.replace(layer_norm_eps=1e-6), dtype=dtype, rngs=rngs,"
         " param_dtype=param_dtype)"),
        (FM, 'LayerNorm(cfg, **sub("cross_attn_norm"))', 'LayerNorm(cfg.replace(layer_norm_eps=1e-6), **sub("cross_attn_norm"))'),
    ], ORACLE, agreement("layer_norm_eps")),
    consistent("epsilon", "pre-LN: the encoder's final LayerNorm uses 1e-5, not config.layer_norm_eps", [
        (RM, "range(config.n_encoder_layers)]\n        self.norm = LayerNorm(config, params,",
         "range(config.n_encoder_layers)]\n        self.norm = LayerNorm(config.replace(layer_norm_eps=1e-5), params,"),
        (TM, "range(config.n_encoder_layers))\n        self.norm = LayerNorm(config)",
         "range(config.n_encoder_layers))\n        self.norm = LayerNorm(config.replace(layer_norm_eps=1e-5))"),
        (JM, "range(config.n_encoder_layers)])\n        self.norm = LayerNorm(config, dtype=dtype, rngs=rngs,",
         "range(config.n_encoder_layers)])\n        self.norm = LayerNorm(config.replace(layer_norm_eps=1e-5), "
         "dtype=dtype, rngs=rngs,"),
        (FM, "range(cfg.n_encoder_layers)]\n        self.norm = LayerNorm(cfg,",
         "range(cfg.n_encoder_layers)]\n        self.norm = LayerNorm(cfg.replace(layer_norm_eps=1e-5),"),
    ], ORACLE, agreement("layer_norm_eps")),
]

ACTIVATION = [
    consistent("activation", "feed-forward: GELU (tanh approximation) instead of ReLU", [
        (RM, "        return np.maximum(x, 0)\n",
         "        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))\n"),
        (TM, "        return torch.relu(x)\n", "        return F.gelu(x, approximate=\"tanh\")\n"),
        (JM, "        return jnp.maximum(x, 0)\n", "        return jax.nn.gelu(x, approximate=True)\n"),
        (FM, "        return tf.maximum(x, 0)\n",          # tf.nn.gelu is 9e-10 off this formula in float64
         "        return 0.5 * x * (1 + tf.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))\n"),
    ], ORACLE, agreement("tiny")),
    consistent("activation", "feed-forward: no activation (two stacked linear maps)", [
        (RM, "        return np.maximum(x, 0)\n", "        return x\n"),
        (TM, "        return torch.relu(x)\n", "        return x\n"),
        (JM, "        return jnp.maximum(x, 0)\n", "        return x\n"),
        (FM, "        return tf.maximum(x, 0)\n", "        return x\n"),
    ], ORACLE, agreement("tiny")),
    consistent("activation", "SiLU: x sigmoid(-x) (the sigmoid's sign flipped)", [
        ("reference_numpy/variants.py", "return (x / (1.0 + np.exp(-x))).astype(x.dtype)",
         "return (x / (1.0 + np.exp(x))).astype(x.dtype)"),
        ("transformer_torch/variants.py", "    return F.silu(x)\n", "    return x * torch.sigmoid(-x)\n"),
        ("transformer_jax/variants.py", "    return jax.nn.silu(x)\n", "    return x * jax.nn.sigmoid(-x)\n"),
        ("transformer_tf/variants.py", "    return tf.nn.silu(x)\n", "    return x * tf.sigmoid(-x)\n"),
    ], CHOICES_ORACLE + ["-k", "activations"], agreement("marian")),
]

# The choices of Hugging Face's families (tests/families/test_config_choices.py holds their oracles).
CHOICES = [
    single("positional-encoding", "keras: Marian's halves swapped (the cosines first, then the sines)",
           "transformer_tf/variants.py",
           "return tf.concat([tf.sin(angle), tf.cos(angle)], axis=-1)",
           "return tf.concat([tf.cos(angle), tf.sin(angle)], axis=-1)",
           ["tests/equivalence/test_agreement.py", "-k", "tf and cpu and test_forward_stages and marian and float64 and ragged_batch"]),
    consistent("positional-encoding", "Marian's halves swapped (the cosines first, then the sines)", [
        ("reference_numpy/variants.py", "np.concatenate([np.sin(angle), np.cos(angle)], axis=1)",
         "np.concatenate([np.cos(angle), np.sin(angle)], axis=1)"),
        ("transformer_tf/variants.py", "return tf.concat([tf.sin(angle), tf.cos(angle)], axis=-1)",
         "return tf.concat([tf.cos(angle), tf.sin(angle)], axis=-1)"),
    ], CHOICES_ORACLE + ["-k", "halves_table or marian_table or embedded_source"], agreement("marian"), shared=(TORCH, JAX)),
    single("output-bias", "torch: the logits bias dropped", "transformer_torch/model.py",
           "return wide(_linear(x, weight, self.bias))", "return wide(_linear(x, weight))",
           ["tests/equivalence/test_agreement.py", "-k", "torch and cpu and test_forward_stages and marian and float64 and ragged_batch"]),
    consistent("output-bias", "the logits bias dropped", [
        (RM, "bias = 0.0 if self.bias is None else wide(cast(self.bias, dtype))", "bias = 0.0"),
        (TM, "return wide(_linear(x, weight, self.bias))", "return wide(_linear(x, weight))"),
        (JM, "return wide(_affine(x, weight, None if self.bias is None else self.bias[...], dtype))",
         "return wide(_affine(x, weight, None, dtype))"),
        (FL, "    if bias is not None:\n        logits = logits + wide(bias)",
         "    if False:\n        logits = logits + wide(bias)"),
    ], CHOICES_ORACLE + ["-k", "logits_bias_by_hand"], agreement("marian")),
    single("positional-encoding", "jax: fairseq's positions one past their row (counted from pad_id + 2)",
           "transformer_jax/variants.py", "return (offset + counted) * real", "return (offset + 1 + counted) * real",
           ["tests/equivalence/test_agreement.py", "-k", "jax and cpu and test_forward_stages and fairseq and float64 and ragged_batch"]),
    consistent("positional-encoding", "fairseq's positions counted from pad_id, not pad_id + 1 (the offset off by one)", [
        ("reference_numpy/variants.py", "position = pad_id + np.arange(1, length + 1, dtype=np.float64)[:, None]",
         "position = pad_id + np.arange(0, length, dtype=np.float64)[:, None]"),
        ("transformer_tf/variants.py", "position = pad_id + tf.range(1, length + 1, dtype=tf.float64)[:, None]",
         "position = pad_id + tf.range(0, length, dtype=tf.float64)[:, None]"),
    ], CHOICES_ORACLE + ["-k", "fairseq_table or embedded_source"], agreement("fairseq"), shared=(TORCH, JAX)),
    single("positional-encoding", "torch: the decoder's fairseq positions counted over its tokens, not by step",
           TM, "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True)",
           "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt)",
           ["tests/equivalence/test_fuzz.py", "-k", "pad_in_the_decoded_prefix and torch"]),
    consistent("positional-encoding", "the decoder's fairseq positions counted over its tokens, not by step", [
        (RM, "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True)",
         "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt)"),
        (TM, "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True)",
         "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt)"),
        (JM, "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True, deterministic=deterministic)",
         "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, deterministic=deterministic)"),
        (FM, "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True, training=training)",
         "y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, training=training)"),
    ], ["tests/equivalence/test_fuzz.py", "-k", "pad_in_the_decoded_prefix and torch"], agreement("fairseq")),
    single("embedding-norm", "jax: the encoder's embedding LayerNorm skipped",
           JM, "x = self.src_embed_norm(x) if self.src_embed_norm is not None else x", "x = x",
           ["tests/equivalence/test_agreement.py", "-k", "jax and cpu and test_forward_stages and bart and float64 and ragged_batch"]),
    consistent("embedding-norm", "the decoder's embedding LayerNorm skipped", [
        (RM, "y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y", "y = y"),
        (TM, "y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y", "y = y"),
        (JM, "y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y", "y = y"),
        (FM, "y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y", "y = y"),
    ], ["tests/families/test_hf_import.py", "-k", "reference_matches_transformers_in_float64 and bart"], agreement("bart")),
    single("position-offset", "torch: learned positions read from row t, not t + position_offset",
           TM, "table = self.weight[self.position_offset:] if self.learned else self.table",
           "table = self.weight if self.learned else self.table",
           ["tests/equivalence/test_agreement.py", "-k", "torch and cpu and test_forward_stages and bart and float64 and ragged_batch"]),
    consistent("position-offset", "learned positions read from row t, not t + position_offset", [
        (RM, 'self.table = params[f"{name}.weight"][config.position_offset:]', 'self.table = params[f"{name}.weight"]'),
        (TM, "table = self.weight[self.position_offset:] if self.learned else self.table",
         "table = self.weight if self.learned else self.table"),
        (JM, "start = offset + self.position_offset if self.fairseq_pad_id is None else offset + 1",
         "start = offset if self.fairseq_pad_id is None else offset + 1"),
        (FM, "offset = offset + 1 if fairseq else offset + self.config.position_offset",
         "offset = offset + 1 if fairseq else offset"),
    ], CHOICES_ORACLE + ["-k", "embedded_source and bart"], agreement("bart")),
]

LEARNED_PE = [
    consistent("learned-pe", "learned positions: the trained table ignored, the sinusoid added instead", [
        (RM, 'self.table = params[f"{name}.weight"]',
         "self.table = sinusoidal_positional_encoding(config.max_len, config.d_model, dtype)"),
        (TM, "table = self.weight[self.position_offset:] if self.learned else self.table",
         "table = sinusoidal_positional_encoding(self.max_len, self.d_model, self.weight.dtype, self.weight.device) "
         "if self.learned else self.table"),
        (JM, "table = self.weight if self.learned else self.table",
         "table = nnx.Variable(sinusoidal_positional_encoding(*self.weight[...].shape, self.weight[...].dtype)) "
         "if self.learned else self.table"),
        (FM, 'fairseq, table = self.config.sinusoidal_layout == "fairseq", tf.convert_to_tensor(self.weight)',
         'fairseq, table = self.config.sinusoidal_layout == "fairseq", '
         "sinusoidal_positional_encoding(self.config.max_len, self.config.d_model, self.compute_dtype)"),
    ], ORACLE, agreement("learned_pe", decoding=True)),
    consistent("learned-pe", "learned positions: no positional information added at all", [
        (RM, 'self.table = params[f"{name}.weight"]', 'self.table = 0 * params[f"{name}.weight"]'),
        (TM, "table = self.weight[self.position_offset:] if self.learned else self.table",
         "table = 0 * self.weight[self.position_offset:] if self.learned else self.table"),
        (JM, "return self.dropout(add(x, positions), deterministic=deterministic)",
         "return self.dropout(add(x, positions * (0.0 if self.learned else 1.0)), deterministic=deterministic)"),
        (FM, "return self.dropout(add(x, table), training=training)",
         "return self.dropout(add(x, table * (0.0 if self.learned else 1.0)), training=training)"),
    ], ORACLE, agreement("learned_pe", decoding=True)),
]

# ----------------------------------------------------------------------------- consistent loss bugs

RT, TT, JT, FT = (f"{package}/training.py" for package in BACKENDS)
LOSS = [
    consistent("loss", "label smoothing: the mass spread over the V - 1 other classes (the label excluded)", [
        (RT, "epsilon * log_probs.mean(axis=-1)", "epsilon * (log_probs.sum(axis=-1) - picked) / (log_probs.shape[-1] - 1)"),
        (TT, "epsilon * log_probs.mean(dim=-1)", "epsilon * (log_probs.sum(dim=-1) - picked) / (log_probs.shape[-1] - 1)"),
        (JT, "epsilon * log_probs.mean(axis=-1)", "epsilon * (log_probs.sum(axis=-1) - picked) / (log_probs.shape[-1] - 1)"),
        (FT, "epsilon * tf.reduce_mean(log_probs, axis=-1)",
         "epsilon * (tf.reduce_sum(log_probs, axis=-1) - picked) / (log_probs.shape[-1] - 1)"),
    ], LOSS_ORACLE, GRADIENTS),
    consistent("loss", "label smoothing: the label keeps weight 1 (q = one_hot + epsilon / V, mass 1 + epsilon)", [
        (path, "per_token = -(1.0 - epsilon) * picked", "per_token = -picked") for path in (RT, TT, JT, FT)
    ], LOSS_ORACLE, GRADIENTS),
    consistent("loss", "padding positions counted in the normalization (divided by B*T)", [
        (RT, "(per_token * real).sum() / count", "(per_token * real).sum() / real.size"),
        (TT, "(per_token * real).sum() / count", "(per_token * real).sum() / real.numel()"),
        (JT, "(per_token * real).sum() / count", "(per_token * real).sum() / real.size"),
        (FT, "tf.reduce_sum(per_token * real) / count",
         "tf.reduce_sum(per_token * real) / tf.cast(tf.size(real), real.dtype)"),
    ], LOSS_ORACLE, GRADIENTS),
    consistent("loss", "padding positions not masked (their loss is summed too)", [
        (RT, "(per_token * real).sum() / count", "per_token.sum() / count"),
        (TT, "(per_token * real).sum() / count", "per_token.sum() / count"),
        (JT, "(per_token * real).sum() / count", "per_token.sum() / count"),
        (FT, "tf.reduce_sum(per_token * real) / count", "tf.reduce_sum(per_token) / count"),
    ], LOSS_ORACLE, GRADIENTS),
]

# ----------------------------------------------------------------------------- consistent decoding bugs
#
# The PyTorch port runs the reference's own length_penalty, search_ends and best_hypothesis and
# selects candidates with torch.topk; JAX and TensorFlow implement the same rules inside their
# compiled loops, and import length_penalty and the constants from the reference.

RD, TD = f"{REF}/decoding.py", f"{TORCH}/decoding.py"
DECODING_PORTS = (TORCH, JAX, TF)
_LP = "return ((5.0 + length) / 6.0) ** alpha"


def decoding_agreement(kind: str = "") -> list[str]:
    """The float64 greedy and beam tokens (and beam scores) of every port against the reference."""
    return ["tests/equivalence/test_agreement.py", "-k", f"cpu and test_decoded_tokens_float64 and tiny {kind}".strip()]


LENGTH_PENALTY = [
    consistent("length-penalty", "lp(Y) = (5 + |Y|)^alpha, without the division by 6^alpha",
               [(RD, _LP, "return (5.0 + length) ** alpha")], DECODING_ORACLE, decoding_agreement("and beam"),
               shared=DECODING_PORTS),
    consistent("length-penalty", "alpha ignored: lp(Y) always uses the default 0.6",
               [(RD, _LP, "return ((5.0 + length) / 6.0) ** LENGTH_PENALTY_ALPHA")], DECODING_ORACLE,
               decoding_agreement("and beam"), shared=DECODING_PORTS),
    consistent("length-penalty", "default alpha 1.0 instead of the paper's 0.6",
               [(f"{REF}/config.py", "LENGTH_PENALTY_ALPHA = 0.6", "LENGTH_PENALTY_ALPHA = 1.0")], DECODING_ORACLE,
               decoding_agreement("and beam"), shared=DECODING_PORTS),
    consistent("length-penalty", "|Y| of a hypothesis ending with eos does not count the eos", [
        (RD, "score / search.lp(step), [*live", "score / search.lp(step - 1), [*live"),
        (TD, "finishing & ~done[:, None], scores / penalties[step],", "finishing & ~done[:, None], scores / penalties[step - 1],"),
        (JD, "finishing & ~done[:, None], scores / penalties[length],",
         "finishing & ~done[:, None], scores / penalties[length - 1],"),
        (FD, "finishing & ~done[:, None], scores / penalties[t],", "finishing & ~done[:, None], scores / penalties[t - 1],"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
]

BEAM_END = [
    consistent("beam-end", "a finished hypothesis stays in the beam and is extended past its eos", [
        (RD, "keep = np.flatnonzero(~is_eos & np.isfinite(scores))[:beam_size]",
         "keep = np.flatnonzero(np.isfinite(scores))[:beam_size]"),
        (TD, "keep = torch.sort(torch.where(is_eos, rank + top, rank), dim=1).indices[:, :beam_size]",
         "keep = rank[:, :beam_size].expand(batch, -1)"),
        (JD, "keep = lax.top_k(-jnp.where(is_eos, rank + ranked.shape[1], rank), beam_size)[1]",
         "keep = jnp.tile(rank[:, :beam_size], (batch, 1))"),
        (FD, "keep = tf.math.top_k(-tf.where(is_eos, rank + 2 * k, rank), k).indices",
         "keep = tf.tile(rank[:, :k], [batch, 1])"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
    consistent("beam-end", "a finished hypothesis leaves its slot empty (live beams only from the first beam_size ranks)", [
        (RD, "keep = np.flatnonzero(~is_eos & np.isfinite(scores))[:beam_size]",
         "keep = np.flatnonzero(~is_eos & np.isfinite(scores) & (np.arange(len(scores)) < beam_size))"),
        (TD, "live_scores = scores.gather(1, keep)", "live_scores = torch.where(keep < k, scores.gather(1, keep), -torch.inf)"),
        (JD, "live_scores = jnp.take_along_axis(scores, keep, axis=1)",
         "live_scores = jnp.where(keep < k, jnp.take_along_axis(scores, keep, axis=1), -jnp.inf)"),
        (FD, "live_scores = tf.gather(scores, keep, batch_dims=1)",
         "live_scores = tf.where(keep < k, tf.gather(scores, keep, batch_dims=1), never)"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
    consistent("beam-end", "an eos ranked outside the beam becomes a live beam (extended past its eos)", [
        (RD, "keep = np.flatnonzero(~is_eos & np.isfinite(scores))[:beam_size]",
         "keep = np.flatnonzero(~(is_eos & (np.arange(len(scores)) < beam_size)) & np.isfinite(scores))[:beam_size]"),
        (TD, "keep = torch.sort(torch.where(is_eos, rank + top, rank), dim=1).indices[:, :beam_size]",
         "keep = torch.sort(torch.where(is_eos & (rank < beam_size), rank + top, rank), dim=1).indices[:, :beam_size]"),
        (JD, "keep = lax.top_k(-jnp.where(is_eos, rank + ranked.shape[1], rank), beam_size)[1]",
         "keep = lax.top_k(-jnp.where(is_eos & (rank < beam_size), rank + ranked.shape[1], rank), beam_size)[1]"),
        (FD, "keep = tf.math.top_k(-tf.where(is_eos, rank + 2 * k, rank), k).indices",
         "keep = tf.math.top_k(-tf.where(is_eos & (rank < k), rank + 2 * k, rank), k).indices"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
    single("beam-end", "reference: a search that finishes no hypothesis scores its empty output 0, not -inf", RD,
           "return [], -math.inf", "return [], 0.0",
           ["tests/reference/test_decoding.py::test_a_search_that_finishes_no_hypothesis_gives_the_empty_output_scored_minus_inf"]),
]

# Section 6.1's budget, "input length + 50": the non-pad source tokens, eos included (the PyTorch and JAX ports
# count them with the reference's max_output_lengths, TensorFlow in its graph).
BUDGET = [
    consistent("budget", "the output budget leaves out the source's eos (non-pad, non-eos tokens + 50)", [
        (RD, "lengths = (np.asarray(src) != cfg.pad_id).sum(axis=1)",
         "lengths = ((np.asarray(src) != cfg.pad_id) & (np.asarray(src) != cfg.eos_id)).sum(axis=1)"),
        (FD, "lengths = tf.reduce_sum(tf.cast(tf.not_equal(src, cfg.pad_id), tf.int32), axis=1)",
         "lengths = tf.reduce_sum(tf.cast(tf.not_equal(src, cfg.pad_id) & tf.not_equal(src, cfg.eos_id),"
         " tf.int32), axis=1)"),
    ], DECODING_ORACLE, decoding_agreement(), shared=(TORCH, JAX)),
]

EARLY_STOPPING = [
    consistent("early-stopping", "stops when no live beam beats the best at lp(current length), not lp(maximum length)", [
        (RD, "live_scores.max() / search.lp(limit) <= (scores[0]", "live_scores.max() / search.lp(step) <= (scores[0]"),
        *[(port, "return best_live / limit_penalty <= best", "return best_live / penalty <= best")
          for port in (JD, TD, FD)],
    ], DECODING_ORACLE, decoding_agreement("and beam")),
    consistent("early-stopping", "stops as soon as one hypothesis has finished", [
        (RD, "return bool(live_scores.max() / search.lp(limit) <= (scores[0] if scores else -np.inf))",
         "return bool(finished)"),
        (JD, "return best_live / limit_penalty <= best", "return best > -jnp.inf"),
        (TD, "return best_live / limit_penalty <= best", "return best > -torch.inf"),
        (FD, "return best_live / limit_penalty <= best", "return best > -np.inf"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
]

# Hugging Face's decoding conventions (the config's decoder_start_id, suppressed_ids, forced tokens, length
# normalization "hf" and early_stopping): tests/families/test_hf_generate.py against transformers' generate. The paper's
# decoding is unchanged by each, so the agreement of the paper's models still passes.
HF_GENERATE = ["tests/families/test_hf_generate.py"]
# Every port's decoding of the families' conventions at once against the reference's (tests/equivalence/test_fuzz.py): the
# agreement a consistent plant of them passes, and a plant in the reference alone fails
CONVENTIONS = ["tests/equivalence/test_fuzz.py", "-k", "families_decoding_conventions"]
_CONFIG = f"{REF}/config.py"
_FORCE = {RD: ("return np.where(forced[:, None] >= 0,", "return log_probs if True else np.where(forced[:, None] >= 0,"),
          TD: ("return torch.where(forced[:, None] >= 0,", "return log_probs if True else torch.where(forced[:, None] >= 0,"),
          JD: ("return jnp.where(forced[:, None] >= 0,", "return log_probs if True else jnp.where(forced[:, None] >= 0,"),
          FD: ("return tf.where(forced[:, None] >= 0,", "return log_probs if True else tf.where(forced[:, None] >= 0,")}
HF_DECODING = [
    single("hf-decoding", "torch: decoding starts from bos, not the config's decoder start token", TD,
           "tokens[:, 0] = config.start_id", "tokens[:, 0] = config.bos_id", HF_GENERATE + ["-k", "torch"]),
    consistent("hf-decoding", "decoding starts from bos, not the config's decoder start token (Marian's pad, M2M100's eos)",
               [(_CONFIG, "return self.bos_id if start is None else start",
                 "return self.bos_id")], HF_GENERATE + ["-k", "reference"], decoding_agreement(), shared=DECODING_PORTS),
    single("hf-decoding", "jax: beam search's length penalty the paper's ((5 + |Y|) / 6)^alpha, not |Y|^alpha", JD,
           "length_penalty(n, alpha, cfg.decoding.length_normalization)", "length_penalty(n, alpha)", HF_GENERATE + ["-k", "jax"]),
    consistent("hf-decoding", "length normalization \"hf\" ignored: lp(Y) always the paper's ((5 + |Y|) / 6)^alpha",
               [(RD, 'if normalization == "gnmt" else float(length) ** alpha', "if normalization else 0.0")],
               HF_GENERATE + ["-k", "reference"], decoding_agreement("and beam"), shared=DECODING_PORTS),
    single("hf-decoding", "keras: the forced tokens ignored (no target-language token, no eos at the maximum length)",
           FD, *_FORCE[FD], HF_GENERATE + ["-k", "tf"]),
    consistent("hf-decoding", "the forced tokens ignored (M2M100's target-language token, Marian's eos at the limit)",
               [(path, *edit) for path, edit in _FORCE.items()], HF_GENERATE + ["-k", "reference"], CONVENTIONS),
    single("hf-decoding", "jax: the token forced at the budget's end always eos, not the config's forced_eos_id "
           "(a Marian config's id 0)", JD, "config.decoding.forced_eos, config.forced_last_id, forced)",
           "config.decoding.forced_eos, config.eos_id, forced)", HF_GENERATE + ["-k", "forced_token_other and jax"]),
    consistent("hf-decoding", "the token forced at the budget's end always eos, not the config's forced_eos_id (a "
               "Marian config's id 0)",
               [(_CONFIG, "return self.eos_id if forced is None else forced",
                 "return self.eos_id")], HF_GENERATE + ["-k", "forced_token_other and numpy"], CONVENTIONS,
               shared=DECODING_PORTS),
    consistent("hf-decoding", "the suppressed tokens always the paper's pad and bos, not the config's",
               [(_CONFIG, "return (self.pad_id, self.bos_id) if suppressed is None else suppressed",
                 "return (self.pad_id, self.bos_id)")], HF_GENERATE + ["-k", "reference"], decoding_agreement(),
               shared=DECODING_PORTS),
    single("hf-decoding", "jax: the log-probabilities not renormalized after the suppressed tokens (renormalize "
           "ignored)", JD, "return log_softmax(scores) if config.decoding.renormalize else scores",
           "return scores", CHOICES_ORACLE + ["-k", "test_decoded_tokens_float64 and marian and jax"]),
    consistent("hf-decoding", "renormalize ignored: the log-probabilities left as the softmax gave them (opus-mt's "
               "renormalize_logits)", [
                   (RD, "return log_softmax(log_probs) if config.decoding.renormalize else log_probs", "return log_probs"),
                   *[(port, "return log_softmax(scores) if config.decoding.renormalize else scores",
                      "return scores") for port in (TD, JD, FD)],
               ], HF_GENERATE + ["-k", "reference"], CONVENTIONS),
    single("hf-decoding", "keras: the budget the source length + 50 whatever max_output_length says (transformers' "
           "max_new_tokens)", FD, "if cfg.decoding.max_output_length is None else tf.fill(", "if True else tf.fill(",
           CHOICES_ORACLE + ["-k", "test_decoded_tokens_float64 and marian and tf"]),
    consistent("hf-decoding", "max_output_length ignored: every budget the source length + 50, not generate's", [
        (RD, "if cfg.decoding.max_output_length is None else np.full_like(", "if True else np.full_like("),
        (FD, "if cfg.decoding.max_output_length is None else tf.fill(", "if True else tf.fill("),
        (FD, "return min(src.shape[1] + EXTRA_OUTPUT_LENGTH if cfg.decoding.max_output_length is None else",
         "return min(src.shape[1] + EXTRA_OUTPUT_LENGTH if True else"),
    ], HF_GENERATE + ["-k", "budget"], CHOICES_ORACLE + ["-k", "test_decoded_tokens_float64 and marian"],
               shared=(TORCH, JAX)),
    consistent("hf-decoding", "early_stopping \"never\" bounds the live beams at the current length, as False does", [
        (RD, 'bound = limit if search.early_stopping == "never" else step', "bound = step"),
        *[(port, 'bound = limit_penalty if config.decoding.early_stopping == "never" else penalty', "bound = penalty")
          for port in (JD, TD, FD)],
    ], HF_GENERATE + ["-k", "reference"], CONVENTIONS),
]

# transformers' held-back tokens (the config's min_output_length and no_repeat_ngram_size, each backend's
# constrain): tests/families/test_hf_generate.py's settings against generate and a naive check of the rules; a plant alike in
# every backend passes the ports' agreement with the reference on them
HELD_BACK = ["tests/families/test_hf_generate.py", "-k", "held_back_tokens_decode_as_generate and marian and"]
HELD_BACK_AGREEMENT = ["tests/families/test_hf_generate.py", "-k", "held_back_tokens_agree_across_backends"]
_HELD_EOS = {RD: "if step < config.decoding.min_output_length:", TD: "if step < config.decoding.min_output_length:",
             JD: "& (step < config.decoding.min_output_length)", FD: "& (step < config.decoding.min_output_length)"}
_NGRAM_SIZE = {RD: ("    n = config.decoding.no_repeat_ngram_size\n",
                    "    n = config.decoding.no_repeat_ngram_size + (config.decoding.no_repeat_ngram_size > 0)\n"),
               **{port: ("n, vocab = config.decoding.no_repeat_ngram_size, log_probs.shape[1]",
                         "n, vocab = config.decoding.no_repeat_ngram_size + (config.decoding.no_repeat_ngram_size > 0), "
                         "log_probs.shape[1]") for port in (TD, JD, FD)}}
HELD_BACK_DECODING = [
    single("hf-decoding", "jax: beam search forces no first token when the call names none (the config's "
           "forced_bos_id, a generation config's forced_bos_token_id, ignored)", JD,
           "forced_bos_id = check_forced_bos(cfg, forced_bos_id)",
           "forced_bos_id = forced_bos_id if forced_bos_id is None else check_forced_bos(cfg, forced_bos_id)",
           HF_GENERATE + ["-k", "forced_first and jax"]),
    consistent("hf-decoding", "the config's forced_bos_id ignored: nothing forced when a call names no first token",
               [(RD, "        return config.decoding.forced_bos_id\n", "        return None\n")],
               HF_GENERATE + ["-k", "forced_first and numpy"], CONVENTIONS, shared=DECODING_PORTS),
    single("held-back", "jax: eos held back one output step less than min_output_length says", JD, _HELD_EOS[JD],
           _HELD_EOS[JD].replace("step <", "step + 1 <"), [*HELD_BACK[:-1], HELD_BACK[-1] + " jax"]),
    consistent("held-back", "eos held back one output step less than min_output_length says (transformers' "
               "min_length counted without its start token)",
               [(path, text, text.replace("step <", "step + 1 <")) for path, text in _HELD_EOS.items()],
               [*HELD_BACK[:-1], HELD_BACK[-1] + " numpy"], HELD_BACK_AGREEMENT),
    single("held-back", "torch: the n-gram ban matches the windows against the n - 1 tokens before the prefix's last",
           TD, "tail = history[:, step - n + 1:step]", "tail = history[:, step - n:step - 1]",
           [*HELD_BACK[:-1], HELD_BACK[-1] + " torch"]),
    consistent("held-back", "no_repeat_ngram_size n bans repeated (n + 1)-grams",
               [(path, *edit) for path, edit in _NGRAM_SIZE.items()], [*HELD_BACK[:-1], HELD_BACK[-1] + " numpy"],
               HELD_BACK_AGREEMENT),
]

# transformers' repetition_penalty (each backend's penalize, and the scores it reads: logits in greedy decoding,
# log-probabilities in beam search): tests/families/test_hf_generate.py against generate and the reference's hand-computed
# penalties; a plant alike in every backend passes the ports' agreement with the reference on a penalized model
REPETITION = ["tests/families/test_hf_generate.py", "-k", "repetition_penalty_decodes_as_generate and marian and"]
REPETITION_AGREEMENT = ["tests/families/test_hf_generate.py", "-k", "repetition_penalty_agrees_across_backends"]
_PENALTY_SIGN = {RD: ("scores[row, token] = score * penalty if score < 0 else score / penalty",
                      "scores[row, token] = score / penalty"),
                 TD: ("torch.where(scores < 0, scores * penalty, scores / penalty)",
                      "torch.where(scores < 0, scores / penalty, scores / penalty)"),
                 JD: ("jnp.where(scores < 0, scores * penalty, scores / penalty)",
                      "jnp.where(scores < 0, scores / penalty, scores / penalty)"),
                 FD: ("tf.where(scores < 0, scores * penalty, scores / penalty)",
                      "tf.where(scores < 0, scores / penalty, scores / penalty)")}
_PENALIZED_SCORES = {RD: ("(logits if greedy else log_softmax(logits))", "log_softmax(logits)"),
                     **{port: ("penalize(cfg, scores if greedy else log_softmax(scores), tokens, step)",
                               "penalize(cfg, log_softmax(scores), tokens, step)") for port in (TD, JD, FD)}}
REPETITION_PENALTY = [
    single("repetition", "torch: the repetition penalty divides a seen token's negative score too (raising it "
           "where it should lower it)", TD, *_PENALTY_SIGN[TD], [*REPETITION[:-1], REPETITION[-1] + " torch"]),
    consistent("repetition", "the repetition penalty divides a seen token's negative score too (raising it where it "
               "should lower it)", [(path, *edit) for path, edit in _PENALTY_SIGN.items()],
               [*REPETITION[:-1], REPETITION[-1] + " numpy"], REPETITION_AGREEMENT),
    consistent("repetition", "greedy decoding penalizes the log-probabilities, as beam search does, not the logits",
               [(path, *edit) for path, edit in _PENALIZED_SCORES.items()],
               ["tests/reference/test_decoding.py", "-k", "greedy_penalizes"], REPETITION_AGREEMENT),
]

TIES = [
    consistent("ties", "greedy: ties go to the highest token id", [
        (RD, "token = log_probs.argmax(axis=-1)", "token = log_probs.shape[-1] - 1 - log_probs[:, ::-1].argmax(axis=-1)"),
        (TD, "token = log_probs.argmax(dim=-1)", "token = log_probs.shape[-1] - 1 - log_probs.flip(-1).argmax(dim=-1)"),
        (JD, "token = jnp.argmax(log_probs, axis=-1).astype(_TOKEN_DTYPE)",
         "token = (log_probs.shape[-1] - 1 - jnp.argmax(log_probs[:, ::-1], axis=-1)).astype(_TOKEN_DTYPE)"),
        (FD, "token = tf.argmax(log_probs, axis=-1, output_type=tf.int64)",
         "token = log_probs.shape[-1] - 1 - tf.argmax(tf.reverse(log_probs, [-1]), axis=-1, output_type=tf.int64)"),
    ], DECODING_ORACLE, decoding_agreement("and greedy")),
    consistent("ties", "beam: equal candidates rank by the higher token id", [
        (RD, 'ranking = np.argsort(-candidates, axis=None, kind="stable")',
         'ranking = (lambda r, v: r // v * v + v - 1 - r % v)('
         'np.argsort(-candidates[:, ::-1], axis=None, kind="stable"), candidates.shape[1])'),
        (TD, "chosen = chosen.sort(dim=1).values",
         "chosen = chosen.gather(1, torch.argsort(chosen // vocab * vocab + vocab - 1 - chosen % vocab, dim=1))"),
        (JD, "scores, ranked = lax.top_k(jnp.where(flat == 0, 0.0, flat), min(2 * k, k * vocab))",
         "scores, ranked = lax.top_k(jnp.where(flat == 0, 0.0, flat).reshape(batch, k, vocab)[:, :, ::-1]"
         ".reshape(batch, -1), min(2 * k, k * vocab)); ranked = ranked // vocab * vocab + vocab - 1 - ranked % vocab"),
        (FD, "value, ranking = tf.math.top_k(tf.where(flat == 0, tf.zeros_like(flat), flat), 2 * k)",
         "value, ranking = tf.math.top_k(tf.reshape(tf.reverse(tf.reshape(tf.where(flat == 0, tf.zeros_like(flat), flat), "
         "(batch, k, vocab)), [-1]), (batch, k * vocab)), 2 * k); "
         "ranking = (lambda r: r // vocab * vocab + vocab - 1 - r % vocab)(ranking)"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
    consistent("ties", "beam: equal candidates rank by the higher beam", [
        (RD, 'ranking = np.argsort(-candidates, axis=None, kind="stable")',
         'ranking = (lambda r, k, v: (k - 1 - r // v) * v + r % v)('
         'np.argsort(-candidates[::-1], axis=None, kind="stable"), *candidates.shape)'),
        (TD, "chosen = chosen.sort(dim=1).values",
         "chosen = chosen.gather(1, torch.argsort((k - 1 - chosen // vocab) * vocab + chosen % vocab, dim=1))"),
        (JD, "scores, ranked = lax.top_k(jnp.where(flat == 0, 0.0, flat), min(2 * k, k * vocab))",
         "scores, ranked = lax.top_k(jnp.where(flat == 0, 0.0, flat).reshape(batch, k, vocab)[:, ::-1]"
         ".reshape(batch, -1), min(2 * k, k * vocab)); ranked = (k - 1 - ranked // vocab) * vocab + ranked % vocab"),
        (FD, "value, ranking = tf.math.top_k(tf.where(flat == 0, tf.zeros_like(flat), flat), 2 * k)",
         "value, ranking = tf.math.top_k(tf.reshape(tf.reverse(tf.reshape(tf.where(flat == 0, tf.zeros_like(flat), flat), "
         "(batch, k, vocab)), [1]), (batch, k * vocab)), 2 * k); "
         "ranking = (lambda r: (k - 1 - r // vocab) * vocab + r % vocab)(ranking)"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
    consistent("ties", "equal finished scores go to the hypothesis finished last", [
        (RD, "key=lambda i: (finished[i][0], -i)", "key=lambda i: (finished[i][0], i)"),
        (JD, "first = jnp.argmax(scores, axis=1)", "first = scores.shape[1] - 1 - jnp.argmax(scores[:, ::-1], axis=1)"),
        (JD, "better = score > best[0]", "better = score >= best[0]"),
        (FD, "first = tf.reduce_min(tf.where(scores == top, tf.range(scores.shape[1]), scores.shape[1] - 1), axis=1)",
         "first = tf.reduce_max(tf.where(scores == top, tf.range(scores.shape[1]), 0), axis=1)"),
        (FD, "better = score > best[0]", "better = score >= best[0]"),
        (TD, "first = scores.argmax(dim=1)", "first = scores.shape[1] - 1 - scores.flip(1).argmax(dim=1)"),
        (TD, "better = score > best[0]", "better = score >= best[0]"),
    ], DECODING_ORACLE, decoding_agreement("and beam")),
]

# The generator's log-softmax (section 3.4), the same formula in every backend.
LOG_SOFTMAX = [
    consistent("log-softmax", "log-softmax computed as log(softmax(x)): -inf where exp underflows", [
        (RM, "    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))",
         "    return np.log(np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True))"),
        (TM, "    return torch.log_softmax(x, dim=-1)", "    return torch.log(torch.softmax(x, dim=-1))"),
        (JM, "    return shifted - jnp.log(speed.sum_exp(shifted))",
         "    return jnp.log(jnp.exp(shifted) / speed.sum_exp(shifted))"),
        (FM, "    return shifted - tf.math.log(tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True))",
         "    return tf.math.log(tf.exp(shifted) / tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True))"),
    ], ORACLE, agreement("tiny", decoding=True)),
]

# Training (section 5): the reference's backward pass, Adam and schedule, and each port's optimizer.
TRAINING = [
    single("backward", "reference: the embeddings' gradient not scaled by sqrt(d_model)", "reference_numpy/backward.py",
           "np.add.at(table, tokens, wide(narrow(wide(grad_out) * embed.scale, dtype)))",
           "np.add.at(table, tokens, wide(narrow(wide(grad_out), dtype)))",
           ["tests/reference/test_backward.py"]),
    single("adam", "reference: Adam's epsilon added before the bias correction (Keras's placement)",
           "reference_numpy/training.py", "self.params[name] -= lr * m_hat / (np.sqrt(v_hat) + c.epsilon)",
           "self.params[name] -= lr * m_hat / (np.sqrt(v_hat) + c.epsilon / np.sqrt(1.0 - c.beta2 ** self.step))",
           ["tests/equivalence/test_training.py", "-k", "closed_form or constant"]),
    single("adam", "reference: the model holds the caller's arrays (its Adam writes into them)",
           "reference_numpy/model.py",
           "return rounded.copy() if copy and np.may_share_memory(rounded, given) else rounded", "return rounded",
           ["tests/equivalence/test_training.py", "-k", "owns_its_weights and numpy"]),
    single("schedule", "torch: Eq. (3) evaluated at LambdaLR's count, from 0", "transformer_torch/training.py",
           "return learning_rate(count + 1, self.d_model, self.config)",
           "return learning_rate(max(count, 1), self.d_model, self.config)",
           ["tests/equivalence/test_training.py", "-k", "torch and float64"]),
    single("adam", "jax: optax's epsilon under the square root too (eps_root = eps)", "transformer_jax/training.py",
           "eps=config.epsilon, eps_root=0.0)", "eps=config.epsilon, eps_root=config.epsilon)",
           ["tests/equivalence/test_training.py", "-k", "jax and float64"]),
    single("adam", "tf: Keras's own epsilon placement (before the bias correction)", "transformer_tf/training.py",
           "self.assign_sub(variable, lr * (m / c1) / (tf.sqrt(v / c2) + self.epsilon))",
           "self.assign_sub(variable, lr * (m / c1) / (tf.sqrt(v / c2) + self.epsilon / tf.sqrt(c2)))",
           ["tests/equivalence/test_training.py", "-k", "tf and float64"]),
]

# Text (section 5.1's shared BPE, the numbers task): one copy serves every backend, so the agreement matrix cannot
# see these; the tokenizer's round trip, its checks and the task's structure (written from French grammar) can.
TEXT = [
    single("text", "a lone carriage return read as part of its line", "transformer_tasks/textfiles.py",
           'LINE_END = re.compile(rb"\\r\\n|\\r|\\n")', 'LINE_END = re.compile(rb"\\r\\n|\\n")',
           ["tests/cli/test_text_files.py", "-k", "every_line_end"]),
    single("text", "tokenizer: decoding runs past eos", "reference_numpy/tokenizer.py",
           "            if i == self.config.eos_id:\n                break",
           "            if i == self.config.eos_id:\n                continue", ["tests/reference/test_tokenizer.py"]),
    single("text", "tokenizer: ids beyond the model's vocabulary accepted", "reference_numpy/tokenizer.py",
           "if max(ids.values()) >= limit or min(ids.values()) < 0:", "if min(ids.values()) < 0:",
           ["tests/reference/test_tokenizer.py"]),
    single("text", "numbers task: test and validation numbers left in the training pool", "transformer_tasks/numbers.py",
           "numbers = np.sort(numbers[n_test + n_valid:])", "numbers = np.sort(numbers)",
           ["tests/tasks/test_numbers_task.py"]),
    single("text", "numbers task: the validation numbers drawn past the test's and the validation's share (half of "
           "them left in the training pool)", "transformer_tasks/numbers.py",
           "validation.append(numbers[n_test:n_test + n_valid])",
           "validation.append(numbers[n_test + n_valid // 2:n_test + n_valid + n_valid // 2])",
           ["tests/tasks/test_numbers_task.py", "-k", "hold_no_held_out"]),
    single("text", "corpus: the held-out validation pairs left in the training pairs too", "transformer_tasks/corpus.py",
           "return pairs.subset(np.flatnonzero(~held)), pairs.subset(np.flatnonzero(held))",
           "return pairs, pairs.subset(np.flatnonzero(held))", ["tests/cli/test_corpus.py", "-k", "disjoint"]),
    single("text", "corpus: the validation pairs the file's first ones, not the pairs held out of training",
           "transformer_tasks/corpus.py",
           "return pairs.subset(np.flatnonzero(~held)), pairs.subset(np.flatnonzero(held))",
           "return pairs.subset(np.flatnonzero(~held)), pairs.subset(np.arange(size))",
           ["tests/cli/test_corpus.py", "-k", "disjoint"]),
    single("text", "numbers task: labels not shifted (the decoder sees the token it must predict)",
           "transformer_tasks/numbers.py", '"labels": pad_rows([[*ids, config.eos_id] for ids in target_ids]',
           '"labels": pad_rows([[config.bos_id, *ids] for ids in target_ids]', ["tests/tasks/test_numbers_task.py"]),
    single("text", "translate --batches-at-once: each batch's threads not shared out (every batch on all of them)",
           "equivalence/runtime.py", "    each = threads() // parts\n", "    each = threads()\n",
           ["tests/tasks/test_translator_batches.py"]),
]

# Data parallelism: each shard's loss over the whole batch's token count, the replicas' gradients summed.
DATA_PARALLEL = [
    single("data parallel", "reference: shards weighted equally (the mean of the shards' means)",
           "reference_numpy/data_parallel.py",
           'weight = token_count(part["labels"], model.config.pad_id) / total', "weight = 1 / world_size",
           ["tests/reference/test_data_parallel.py"]),
    single("data parallel", "torch: DDP's average not undone (each rank's loss not multiplied by N)",
           "transformer_torch/data_parallel.py", "(world_size * value).backward()", "value.backward()",
           ["tests/ports/test_data_parallel_torch.py"]),
    single("data parallel", "tf: each replica divides by its own shard's count", "transformer_tf/data_parallel.py",
           "tokens = tf.constant(token_count(label_ids, model.config.pad_id), model.compute_dtype)",
           "tokens = None", ["tests/ports/test_data_parallel_tf.py"]),
]

# The Hugging Face export (transformer_hf/exporter.py, the family modules): transformers itself loads and runs what it
# writes.
HF_EXPORT_ORACLE = ["tests/families/test_hf_export.py", "-k", "float64"]
HF_EXPORT = [
    single("hf export", "train --layer-norm-eps left unread: a new run keeps the presets' 1e-6",
           "transformer_cli/commands/train.py", "return made.config(dropout=args.dropout or 0.0, **eps)",
           "return made.config(dropout=args.dropout or 0.0)",
           ["tests/cli/test_families_commands.py", "-k", "families_layer_norm_epsilon"]),
    single("hf export", "train --resume takes another --layer-norm-eps without a word", "transformer_cli/commands/train.py",
           '"dropout": config.dropout, "layer_norm_eps": config.layer_norm_eps}',
           '"dropout": config.dropout, "layer_norm_eps": args.layer_norm_eps}', ["tests/cli/test_cli_reliability.py"]),
    single("hf export", "hf export: the attention projections written (in, out), their transpose dropped",
           "transformer_hf/weights.py", "np.ascontiguousarray(value.T if entry.transpose else value)",
           'np.ascontiguousarray(value.T if entry.transpose and "_proj." not in ours else value)', HF_EXPORT_ORACLE),
    single("hf export", "hf export: the paper's features permuted one place off (sigma rolled by one)",
           "transformer_hf/weights.py",
           "return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])",
           "return np.roll(np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)]), 1)",
           ["tests/families/test_hf_export.py", "-k", "paper"]),
    single("hf export", "hf import and export: W_q and W_k swapped in the shared name table",
           "transformer_hf/weights.py", '(("q_proj", "q_proj"), ("k_proj", "k_proj")',
           '(("q_proj", "k_proj"), ("k_proj", "q_proj")', HF_EXPORT_ORACLE),
    single("hf export", "hf export: generate starts from pad, not bos (decoder_start_token_id)",
           "transformer_hf/generation.py", '"decoder_start_token_id": config.start_id', '"decoder_start_token_id": config.pad_id',
           ["tests/families/test_hf_export.py", "-k", "generate"]),
    single("hf export", "hf export: the tokenizer appends no eos to the source", "transformer_hf/exporter.py",
           'single=f"$A {EOS}"', 'single="$A"', ["tests/families/test_hf_export.py", "-k", "autotokenizer"]),
    single("hf export", "hf export: an imported family's vocab.json written with every id one place off",
           "transformer_hf/tokenizer_files.py", 'json.dumps(record[field], ensure_ascii=False',
           'json.dumps({k: (v + 1) % len(record[field]) for k, v in record[field].items()}, ensure_ascii=False',
           ["tests/cli/test_families_commands.py", "-k", "export_of_an_imported"]),
    single("hf import", "hf import: an untied encoder embedding read from model.shared (transformers 4's ties, which "
           "tie_word_embeddings false no longer makes in 5)", "transformer_hf/weights.py",
           'table["src_embed.weight"] = Entry(("model.encoder.embed_tokens.weight", "model.shared.weight"))',
           'table["src_embed.weight"] = Entry(("model.shared.weight", "model.encoder.embed_tokens.weight"))',
           ["tests/families/test_hf_import.py", "-k", "untied"]),
    single("hf import", "hf tokenizer: Marian's target side looked up in the source vocabulary (separate_vocabs' "
           "target_vocab.json not read)", "transformer_hf/tokenizers.py",
           '"target": record.get("target_vocab") or record["vocab"]}', '"target": record["vocab"]}',
           ["tests/families/test_hf_tokenizers.py", "-k", "separate"]),
    single("hf import", "hf import: generation_config.json's num_beams not read (translate decodes greedily)",
           "transformer_hf/generation.py", 'beams = generation.get("num_beams", 1)', "beams = 1",
           ["tests/cli/test_families_commands.py", "-k", "own_beam"]),
    single("hf import", "translate: a checkpoint's beam_size not the default beam (greedy unless --beam)",
           "transformer_tasks/translation.py", "self.beam_size = model.config.decoding.beam_size if beam_size is None",
           "self.beam_size = 1 if beam_size is None", ["tests/cli/test_families_commands.py", "-k", "own_beam"]),
    single("hf import", "hf import: a pickle holding a Python object refused in torch's words, not by the object it "
           "holds", "transformer_hf/files.py", "    if unsafe:\n", "    if False:\n",
           ["tests/families/test_hf_import.py", "-k", "weights_only_loader_refuses and marian"]),
    single("hf import", "mBART: the encoder's and the decoder's final LayerNorms swapped",
           "transformer_hf/mbart.py", 'weights.norm(table, f"{stack}.norm", f"model.{stack}.layer_norm")',
           'weights.norm(table, f"{stack}.norm", f"model.{\'decoder\' if stack == \'encoder\' else \'encoder\'}'
           '.layer_norm")',
           ["tests/families/test_hf_import.py", "-k", "reference_matches_transformers_in_float64 and mbart"]),
    single("hf import", "hf import: generation_config.json's min_new_tokens not read (eos held back by min_length "
           "alone)", "transformer_hf/generation.py", '    min_new_tokens = generation.get("min_new_tokens")\n',
           "    min_new_tokens = None\n", HF_GENERATE + ["-k", "config_from_generation_config"]),
]

_PICKED = ("return beams[:, None, None, :, None, :] ==", "return (beams[:, None, None, :, None, :] + 1) % k ==")
BEAM_TABLE = [
    consistent("cache", "every backend: attention along beam hypotheses ignores its mask", [
        *((f"{package}/incremental.py", "weights = masked_softmax(scores, mask, query.shape[-1])",
           "weights = masked_softmax(scores, None, query.shape[-1])") for package in BACKENDS),
    ], ["tests/ports/test_beam_cache.py", "-k", "naive_loop"]),
    consistent("masks", "every backend: a row that sees no key outputs its zero weights times the values", [
        (RS, "    return np.where(mask.any(axis=-1, keepdims=True), x, 0.0)", "    return x"),
        (TS, "    return torch.where(mask.any(dim=-1, keepdim=True), x, 0.0)", "    return x"),
        (JS, "    return jnp.where(mask.any(axis=-1, keepdims=True), x, 0.0)", "    return x"),
        (FS, "    return tf.where(tf.reduce_any(mask, axis=-1, keepdims=True), x, tf.zeros_like(x))", "    return x"),
    ], ["tests/ports/test_masked_rows.py", "-k", "infinite"]),
    consistent("cache", "every backend: each position of a beam table read from the next beam's row", [
        (RI, "rows = (np.arange(batch)[:, None, None] * k + beams)", "rows = (np.arange(batch)[:, None, None] * k + (beams + 1) % k)"),
        *((f"{package}/speed.py", *_PICKED) for package in BACKENDS[1:]),
    ], ["tests/ports/test_beam_cache.py", "-k", "naive_loop"]),
    single("cache", "PyTorch: a sentence's K rows read the memory with their heads and beams swapped",
           f"{TORCH}/incremental.py", "x = x.reshape(batch, rows // batch, heads, length, width).transpose(1, 2)",
           "x = x.reshape(batch, heads, rows // batch, length, width)", ["tests/ports/test_beam_cache.py", "-k",
                                                                         "one_memory_per_sentence and torch"]),
    consistent("cache", "every backend: a row reads the memory of the sentence after its own", [
        *((f"{package}/incremental.py", "out, weights = attention(_by_sentence(query, batch), key, value, mask",
           f"out, weights = attention(_by_sentence(query, batch), {roll}(key, 1, 0), {roll}(value, 1, 0), mask")
          for package, roll in zip(BACKENDS, ("np.roll", "torch.roll", "jnp.roll", "tf.roll"))),
    ], ["tests/ports/test_beam_cache.py", "-k", "one_memory_per_sentence"]),
    single("cache", "PyTorch: beam search projects the memory's keys and values for every beam again",
           f"{TORCH}/decoding.py", "    cache = _in_place(model.init_cache(memory, max_steps) if use_cache else (), batch, k)\n"
           "    memory = memory.repeat_interleave(k, dim=0)                                  # (N, S, D)\n",
           "    memory = memory.repeat_interleave(k, dim=0)                                  # (N, S, D)\n"
           "    cache = _in_place(model.init_cache(memory, max_steps) if use_cache else (), batch, k)\n",
           ["tests/ports/test_beam_cache.py", "-k", "moves_tables and torch"]),
]

# A cached step reads the first W positions of its self-attention cache (reference_numpy.incremental.attended_widths): reading more
# gives the same numbers (the agreement cannot see it); positions past W filled with NaN can.
ATTENDED = ["tests/ports/test_attended_width.py", "-k"]
ATTENDED_WIDTH = [
    single("cache", "torch: a cached step reads every position of its self-attention cache", TI,
           "width = capacity if isinstance(cache_index, Tensor) else attended_width(capacity, cache_index + "
           "length)", "width = capacity", [*ATTENDED, "torch"]),
    single("cache", "jax: a traced step reads every position of its self-attention cache (the widest branch)", JI,
           "branch = jnp.searchsorted(jnp.asarray(widths), cache_index + length)", "branch = len(widths) - 1",
           [*ATTENDED, "searches and jax"]),
    single("cache", "keras: a traced step reads every position of its self-attention cache (the widest branch)", FI,
           "branch = tf.searchsorted(tf.constant(widths), tf.reshape(tf.cast(cache_index, tf.int32) + length, [1]))[0]",
           "branch = len(widths) - 1", [*ATTENDED, "searches and tf"]),
    single("cache", "reference: a cached step's width one position short (the newest position unread)", RI,
           "width = attended_width(capacity, cache_index + length)",
           "width = attended_width(capacity, cache_index + length - 1)", [*ATTENDED, "decoding_step and 64"]),
    single("cache", "torch: a cached step's width one position short (the newest position unread)", TI,
           "else attended_width(capacity, cache_index + length)",
           "else attended_width(capacity, cache_index + length - 1)", [*ATTENDED, "cross and torch"]),
    single("cache", "jax: a traced step's width one position short (the newest position unread)", JI,
           "branch = jnp.searchsorted(jnp.asarray(widths), cache_index + length)",
           "branch = jnp.searchsorted(jnp.asarray(widths), cache_index + length - 1)", [*ATTENDED, "cross and jax"]),
    single("cache", "keras: a traced step's width one position short (the newest position unread)", FI,
           "tf.reshape(tf.cast(cache_index, tf.int32) + length, [1])",
           "tf.reshape(tf.cast(cache_index, tf.int32) + length - 1, [1])", [*ATTENDED, "cross and tf"]),
    single("cache", "torch compiled: the program is handed every position of the self-attention caches",
           "transformer_torch/speed.py", "program(tgt, memory, src_mask, _narrowed(cache, written),",
           "program(tgt, memory, src_mask, cache,", [*ATTENDED, "compiled_pytorch_step"]),
    single("cache", "torch compiled: the step's new positions never written back into the search's caches",
           "transformer_torch/speed.py", "tensor[:, :, start:end] = written[:, :, start:end]", "pass",
           [*ATTENDED, "compiled_pytorch_step"]),
    consistent("cache", "every backend: a cached step reads every position of its self-attention cache", [
        (RI, "while (width := ATTENDED_WIDTH << len(widths)) < capacity:",
         "while (width := ATTENDED_WIDTH << len(widths)) < 0:"),
    ], [*ATTENDED, "reads_no_position"], decoding_agreement(), shared=(TORCH, JAX, TF)),
]

# ----------------------------------------------------------------------------- low precision (the recipe)

def low_precision(checks: str, components: bool = False) -> list[str]:
    """The CPU low-precision agreement tests selected by ``checks`` (a -k expression): the stages and decoding, or
    with ``components`` the components."""
    return [f"tests/equivalence/test_agreement{'_low_precision' if components else ''}.py", "-k", f"cpu and ({checks})"]


PRECISION = [
    single("precision", "reference: float64 rounded to bfloat16 through float32 (twice)", "reference_numpy/precision.py",
           "    if not is_low(dtype):\n        return x.astype(dtype, copy=False)",
           "    if True:\n        return x.astype(dtype, copy=False)", ["tests/reference/test_oracle.py", "-k", "round_to"]),
    Mutation("precision", "torch: attention (Eq. (1)), its softmax included, computed in P instead of wide", "single",
             (Edit("transformer_torch/precision.py",
                   "results = concept(wide(first), *(wide(a) if isinstance(a, Tensor) else a for a in args), **kwargs)",
                   "results = concept(first, *args, **kwargs)"),
              Edit("transformer_torch/softmax.py", "    scores = wide(scores)\n", "")),
             tuple(low_precision("torch and attention and tiny", components=True))),
    single("precision", "torch: the residual stream kept in float32", "transformer_torch/model.py",
           "    return narrow(wide(x) + wide(y), x.dtype)", "    return wide(x) + wide(y)",
           low_precision("torch and test_forward_stages and bfloat16 and tiny and ragged_batch")),
    single("precision", "jax: XLA's excess precision left on (roundings to P dropped in compiled code)",
           "transformer_jax/speed.py", '_EXACT_ROUNDING = {"xla_allow_excess_precision": False}', "_EXACT_ROUNDING = {}",
           low_precision("jax and test_trained_model_forward_stages and bfloat16")),
    single("precision", "keras: a low-precision model compiled by XLA (which drops roundings to P)",
           "transformer_tf/speed.py", "    return not is_low(tf.as_dtype(model.compute_dtype).as_numpy_dtype)", "    return True",
           low_precision("tf and test_log_probs and float16")),
    consistent("precision", "every backend: the logits left unrounded (log-softmax of the wide product)", [
        (RM, "logits = narrow(wide(cast(x, dtype)) @ wide(cast(self.weight, dtype)) + bias, dtype)",
         "logits = wide(cast(x, dtype)) @ wide(cast(self.weight, dtype)) + bias"),
        (TM, "return wide(_linear(x, weight, self.bias))",
         "return _linear(wide(x), wide(weight), None if self.bias is None else wide(self.bias))"),
        (JL, "    return narrow(logits, dtype)", "    return logits"),
        (FL, "logits = narrow(logits, x.dtype)", "logits = logits"),
    ], ORACLE, low_precision("test_forward_stages and bfloat16 and tiny and ragged_batch")),
    single("precision", "torch: the embedding's gradient rows summed in P (torch's own embedding backward)",
           "transformer_torch/layers.py",
           "    if weight.dtype in LOW and weight.requires_grad and torch.is_grad_enabled():",
           "    if False:",
           ["tests/equivalence/test_gradients.py", "-k", "hundreds and torch"]),
    single("precision", "torch: the schedule stepped on a skipped float16 step (Adam's t and Eq. (3)'s count part)",
           "transformer_torch/training.py", "        taken = scaler.get_scale() >= scale", "        taken = True",
           ["tests/equivalence/test_training.py", "-k", "overflow and torch"]),
    single("precision", "reference: mixed precision differentiates the float32 masters (no P model)",
           "reference_numpy/training.py",
           "value, grads = backward.loss_and_gradients(mixed.low, label_smoothed_cross_entropy,",
           "value, grads = backward.loss_and_gradients(model, label_smoothed_cross_entropy,",
           ["tests/equivalence/test_training.py", "-k", "mixed_precision_steps and torch and bfloat16"]),
    single("precision", "torch: under autocast the product weights . V left in float32 (autocast switched off)",
           "transformer_torch/model.py",
           "    return zero_fully_masked_rows(weights @ value, mask), (weights if return_weights else None)",
           "    with torch.autocast(query.device.type, enabled=False):\n"
           "        return zero_fully_masked_rows(weights @ wide(value), mask), (weights if return_weights else None)",
           ["tests/ports/test_mixed_precision.py", "-k", "attention_products and torch"]),
    single("ties", "torch: top_k keeps one block too few (a row's count-th largest value can be missed)",
           "transformer_torch/speed.py", "    starts = torch.topk(maxima, count, dim=1).indices * _TOP_K_BLOCK",
           "    starts = torch.topk(maxima, count - 1, dim=1).indices * _TOP_K_BLOCK",
           ["tests/ports/test_torch.py", "-k", "top_k or candidate_selection"]),
    single("precision", "torch: a packed weight never packed again (its product the weight as it was first packed)",
           "transformer_torch/speed.py", "    if held is None or held[0] != stamp:", "    if held is None:",
           ["tests/ports/test_torch.py", "-k", "packed_weights"]),
    single("precision", "torch: the oneDNN fast path taken under autocast (large linear maps stay float32)",
           "transformer_torch/speed.py", "            and autocast_dtype(x) is None\n", "",
           ["tests/ports/test_mixed_precision.py", "-k", "every_linear_map"]),
    single("precision", "torch: under autocast the residual stream rounded to P (its dtype still float32)",
           "transformer_torch/model.py", "    return narrow(wide(x) + wide(y), x.dtype)",
           "    return narrow(wide(x) + wide(y), y.dtype if y.dtype in LOW else x.dtype).to(x.dtype)",
           ["tests/ports/test_mixed_precision.py", "-k", "forward_stages and torch"]),
    single("precision", "reference: under autocast the residual stream rounded to P (its dtype still float32)",
           "reference_numpy/model.py",
           "    return narrow(wide(x) + wide(y).astype(wide(x).dtype, copy=False), x.dtype)",
           "    return round_to(wide(x) + wide(y), y.dtype).astype(x.dtype)",
           ["tests/ports/test_mixed_precision.py", "-k", "oracle"]),
    single("precision", "jax: under Flax's mixed precision the scores Q K^T left in float32 (not rounded to P)",
           "transformer_jax/model.py", "scores = attention_product(_matmul, query, jnp.swapaxes(key, -1, -2), dtype)",
           "scores = _matmul(query, jnp.swapaxes(key, -1, -2))",
           ["tests/ports/test_mixed_precision.py", "-k", "attention_products and jax"]),
    single("precision", "jax: under Flax's mixed precision the residual stream rounded to P (its dtype still float32)",
           "transformer_jax/model.py", "    return narrow(wide(x) + wide(y), x.dtype)",
           "    return narrow(wide(x) + wide(y), y.dtype).astype(x.dtype)",
           ["tests/ports/test_mixed_precision.py", "-k", "forward_stages and jax and pre_ln"]),
    single("precision", "keras: under mixed_bfloat16 the residual stream converted to P at every layer's entry",
           FL,
           "        return self.dtype_policy.variable_dtype if self._STREAM else self.compute_dtype",
           "        return self.compute_dtype", ["tests/ports/test_mixed_precision.py", "-k", "forward_stages and tf"]),
    single("precision", "keras: under mixed_bfloat16 LayerNorm's output cast to P (Keras' own LayerNormalization)",
           "transformer_tf/model.py",
           "        super().__init__(axis=-1, epsilon=config.layer_norm_eps, **float32_under_autocast(kwargs))",
           "        super().__init__(axis=-1, epsilon=config.layer_norm_eps, **kwargs)",
           ["tests/ports/test_mixed_precision.py", "-k", "forward_stages and tf"]),
    single("precision", "reference: under autocast a sublayer's gradient left float32 (the promotion's backward)",
           "reference_numpy/backward.py", "        return add(grad_summed, sublayer_backward(cast(grad_summed, out.dtype)))",
           "        return add(grad_summed, sublayer_backward(grad_summed))",
           ["tests/ports/test_mixed_precision.py", "-k", "test_gradients and tiny"]),
    single("precision", "reference: under autocast dL/dS left float32 (not rounded to P before dL/dQ, dL/dK)",
           "reference_numpy/backward.py",
           "        grad_scores = wide(round_to(softmax_backward(weights, grad_weights) / scale, low))",
           "        grad_scores = (softmax_backward(weights, grad_weights) / scale).astype(np.float64)",
           ["tests/ports/test_mixed_precision.py", "-k", "test_gradients"]),
    single("bound", "TrainingBound: the update's change through sqrt(v_hat)'s change left out",
           "equivalence/tolerance.py",
           "            moved = moved_m / low + m_hat * moved_s / ((root + epsilon) * low)",
           "            moved = moved_m / low", ["tests/equivalence/test_training.py", "-k", "carried"]),
    single("bound", "TrainingBound: the change of sqrt(v_hat) not bias-corrected",
           "equivalence/tolerance.py",
           "            moved_s = np.sqrt(self.squares[name] / (1.0 - beta2 ** step))",
           "            moved_s = np.sqrt(self.squares[name])", ["tests/equivalence/test_training.py", "-k", "carried"]),
    single("precision", "torch: mixed-float16 training steps against the gradient (the update negated)",
           "transformer_torch/training.py",
           "        master.grad = _grad(parameter).float()  ", "        master.grad = -_grad(parameter).float()  ",
           ["tests/ports/test_mixed_precision.py", "-k", "ten_steps and torch and mixed-float16"]),
    single("precision", "keras: mixed-float16 training steps against the gradient (the update negated)",
           "transformer_tf/training.py",
           "    grads = [tf.cast(_dense(grad), tf.float32) for grad in tape.gradient(scaled, low)]",
           "    grads = [-tf.cast(_dense(grad), tf.float32) for grad in tape.gradient(scaled, low)]",
           ["tests/ports/test_mixed_precision.py", "-k", "ten_steps and tf and mixed-float16"]),
    single("precision", "torch: mixed-float16 training with Eq. (3) evaluated at LambdaLR's count, from 0",
           "transformer_torch/training.py", "return learning_rate(count + 1, self.d_model, self.config)",
           "return learning_rate(max(count, 1), self.d_model, self.config)",
           ["tests/ports/test_mixed_precision.py", "-k", "ten_steps and torch and mixed-float16"]),
    single("precision", "torch: mixed-float16 training with the loss scale not divided out of the gradients",
           "transformer_torch/training.py",
           "        master.grad = _grad(parameter).float()  ",
           "        master.grad = _grad(parameter).float() * (1.0 if scaler is None else scaler.get_scale())  ",
           ["tests/ports/test_mixed_precision.py", "-k", "ten_steps and torch and mixed-float16"]),
    single("precision", "torch: automatic mixed precision in float16 without its GradScaler (unscaled float16 steps)",
           "transformer_torch/training.py",
           "        low, dtype = model, parse_dtype(dtype_name(torch.get_autocast_dtype(model.device.type)))   # autocast",
           "        low = model", ["tests/ports/test_mixed_precision.py", "-k", "ten_steps and torch"]),
]

# Every linear map of the autocast recipe against the recipe's rounding of its own input (tests/ports/test_linear_maps_in_p.py)
LINEAR_MAPS = ["tests/ports/test_linear_maps_in_p.py"]
_TORCH_FFN = "        return self.linear2(activation(self.linear1(x), self.activation))"
_TORCH_LOGITS = "        return wide(_linear(x, weight, self.bias))                                        # logits (B, T, V)"
LINEAR_MAPS_IN_P = [
    single("precision", "torch: under autocast the feed-forward network's first linear map reads its input unrounded "
           "(float32 x, W and b in P: more accurate than the recipe)", TM, _TORCH_FFN,
           "        low = speed.autocast_dtype(x)\n"
           "        if low is not None:\n"
           "            with torch.autocast(x.device.type, enabled=False):\n"
           "                hidden = _linear(x.float(), narrow(self.linear1.weight, low), narrow(self.linear1.bias, low))\n"
           "            return self.linear2(activation(hidden, self.activation))\n" + _TORCH_FFN,
           [*LINEAR_MAPS, "-k", "torch and bfloat16"]),
    single("precision", "jax: under Flax's mixed precision a linear map's product rounded to P before its bias is "
           "added (nnx.Linear's own second rounding)", JL,
           "preferred_element_type=jnp.float32, precision=_PRECISION, rngs=rngs)", "precision=_PRECISION, rngs=rngs)",
           [*LINEAR_MAPS, "-k", "jax and model"]),
    single("precision", "keras: a layer built with no dtype computes in float32 whatever the global policy says",
           FL, "        super().__init__(**kwargs)\n        self.config = _as_config(config)",
           "        super().__init__(**{**kwargs, \"dtype\": kwargs.get(\"dtype\") or \"float32\"})\n"
           "        self.config = _as_config(config)", [*LINEAR_MAPS, "-k", "alone and tf"]),
    consistent("precision", "every backend: under autocast the generator reads its input unrounded (float32 x, W and "
               "b in P: logits more accurate than the recipe)", [
                   (RM, "logits = narrow(wide(cast(x, dtype)) @ wide(cast(self.weight, dtype)) + bias, dtype)",
                    "logits = narrow(wide(x) @ wide(cast(self.weight, dtype)) + bias, dtype)"),
                   (TM, _TORCH_LOGITS,
                    "        low = speed.autocast_dtype(x)\n"
                    "        if low is not None:\n"
                    "            with torch.autocast(x.device.type, enabled=False):\n"
                    "                return wide(_linear(x.float(), narrow(weight, low),\n"
                    "                                    None if self.bias is None else narrow(self.bias, low)))\n"
                    + _TORCH_LOGITS),
                   (JL, "logits = jnp.matmul(wide(narrow(x, dtype)), wide(narrow(weight, dtype)), precision=_PRECISION)",
                    "logits = jnp.matmul(wide(x), wide(narrow(weight, dtype)), precision=_PRECISION)"),
                   (FM, "        return log_softmax(self.logits(x))",
                    "        return log_softmax(self.logits(x))\n\n    _STREAM = True"),
                   (FL, "    logits = narrow(logits, x.dtype)  ", "    logits = narrow(logits, weight.dtype)  "),
               ], [*LINEAR_MAPS, "-k", "model"], ["tests/ports/test_mixed_precision.py", "-k", "test_forward_stages"]),
]

HF_TOKENIZERS_ORACLE = ["tests/families/test_hf_tokenizers.py", "-k", "transformers"]
HF_TOKENIZERS = [
    single("hf-tokenizer", "families: a tokenizer_class of no kind read by another family's files",
           "transformer_hf/tokenizers.py", "if (named is None or named in GENERIC_CLASSES) and all(", "if all(",
           ["tests/families/test_hf_tokenizers.py", "-k", "no_kind"]),
    single("hf-tokenizer", "M2M100/NLLB: the source language's code at the wrong end (after eos)",
           "transformer_hf/tokenizers.py", 'ids = [language, *ids] if place == "prefix" else [*ids, language]',
           'ids = [*ids, language] if place == "prefix" else [language, *ids]', HF_TOKENIZERS_ORACLE),
    single("hf-tokenizer", "families: eos not appended to the source", "transformer_hf/tokenizers.py",
           "*self.content_ids(text, side), self.config.eos_id]", "*self.content_ids(text, side)]",
           HF_TOKENIZERS_ORACLE),
    single("hf-tokenizer", "Marian: the target SentencePiece model cuts the source", "transformer_hf/tokenizers.py",
           'tokenizer = self._source if side == "source" else self._target',
           'tokenizer = self._target if side == "source" else self._source', HF_TOKENIZERS_ORACLE),
    single("hf-tokenizer", "M2M100: the language codes one id off (after the vocabulary)",
           "transformer_hf/m2m_100.py", '"languages": {code: len(vocab) + i for',
           '"languages": {code: len(vocab) + 1 + i for', HF_TOKENIZERS_ORACLE),
    single("hf-tokenizer", "conversion: SentencePiece's control pieces matched in a text (\"</s>\" typed is eos)",
           "transformer_hf/tokenizer_files.py", 'piece.piece + "\\u2581" * (piece.type in (2, 3))', "piece.piece",
           HF_TOKENIZERS_ORACLE),
    single("hf-tokenizer", "NLLB: legacy_behaviour ignored (the source's code first, not after eos)",
           "transformer_hf/m2m_100.py", '"suffix" if settings.get("legacy_behaviour") else "prefix"', '"prefix"',
           ["tests/families/test_hf_tokenizers.py", "-k", "nllb"]),
    single("hf-tokenizer", "mBART-50: the source language's code after eos (mBART-cc25's layout)",
           "transformer_hf/mbart.py", '"source_language": "prefix", "target_language": "forced"',
           '"source_language": "suffix", "target_language": "forced"',
           ["tests/families/test_hf_tokenizers.py", "-k", "mbart50"]),
    single("hf-tokenizer", "BART: the record's prefix (<s>) not placed before the pieces", "transformer_hf/tokenizers.py",
           'ids = [*(self.record.get("prefix_ids") or []), *self.content_ids(text, side)',
           'ids = [*self.content_ids(text, side)', ["tests/families/test_hf_tokenizers.py", "-k", "bart"]),
    single("hf-tokenizer", "families: decoding keeps the special tokens", "transformer_hf/tokenizers.py",
           "if i not in self._skipped and i in self._pieces[\"target\"]:", "if i in self._pieces[\"target\"]:",
           HF_TOKENIZERS_ORACLE),
]

# train --init: tests/cli/test_finetune.py against transformers' tokenizer, shift_tokens_right and model loss, and every
# backend's first step against the reference's
FINETUNE_ORACLE = ["tests/cli/test_finetune.py", "-k", "transformers"]
FIRST_MASK = {REF: ("(padding_mask(tgt, pad_id) | (np.arange(length) == 0))", "padding_mask(tgt, pad_id)"),
              TORCH: ("(padding_mask(tgt, pad_id) | first)", "padding_mask(tgt, pad_id)"),
              JAX: ("(padding | (jnp.arange(padding.shape[-1]) == 0))", "padding"),
              TF: ("(padding_mask(tgt, pad_id) | (tf.range(length) == 0))", "padding_mask(tgt, pad_id)")}
FINETUNE = [
    single("finetune", "the decoder input is the labels shifted left, not right", "reference_numpy/tokenizer.py",
           '"tgt": pad_rows([[config.start_id, *ids[:-1]] for ids in labels]',
           '"tgt": pad_rows([[config.start_id, *ids[1:]] for ids in labels]', FINETUNE_ORACLE),
    single("finetune", "the decoder starts from bos, not the family's decoder start token",
           "reference_numpy/tokenizer.py", '"tgt": pad_rows([[config.start_id, *ids[:-1]] for ids in labels]',
           '"tgt": pad_rows([[config.bos_id, *ids[:-1]] for ids in labels]', FINETUNE_ORACLE),
    single("finetune", "M2M100: the source's language code missing", "transformer_tasks/corpus.py",
           "return tokenizer.ids(text, side) if isinstance(tokenizer, FamilyTokenizer)",
           'return tokenizer.ids(text, side) if isinstance(tokenizer, FamilyTokenizer) and side == "target"',
           FINETUNE_ORACLE),
    single("finetune", "--init's weights not loaded (the seeded initialisation)", "transformer_cli/commands/train.py",
           "return load_checkpoint(plan.init)[1] if plan.init else", "return", FINETUNE_ORACLE),
    single("finetune", "torch: the start token hidden when it is pad (Marian)", "transformer_torch/model.py",
           *FIRST_MASK[TORCH], ["tests/cli/test_finetune.py", "-k", "first_step and torch"]),
    consistent("finetune", "every backend: the start token hidden when it is pad (Marian)",
               [(f"{backend}/model.py", *FIRST_MASK[backend]) for backend in BACKENDS], FINETUNE_ORACLE,
               ["tests/cli/test_finetune.py", "-k", "first_step"]),
]

# The file benchmark's opus-mt option (scripts/bench_translate.py) hands every engine the checkpoint's conventions:
# tests/benchmarks/test_bench_translate.py compares each port's tokens and output count with transformers' generate
_BENCH = "scripts/bench_translate.py"
BENCH_TRANSLATE = ["tests/benchmarks/test_bench_translate.py"]
_BENCH_MODULE = "transformer_bench/bench.py"
BENCH_CHECKPOINT = ["tests/benchmarks/test_peers.py", "-k", "transformers_peer or checkpoint_with"]
BENCH = [
    single("bench", "bench_translate: transformers given one token less than the budget", _BENCH,
           "max_new_tokens=budget(args))", "max_new_tokens=budget(args) - 1)", BENCH_TRANSLATE),
    single("bench", "bench_translate: transformers attends to the sources' padding", _BENCH,
           "attention_mask=(src != pad).long()", "attention_mask=torch.ones_like(src)", BENCH_TRANSLATE),
    single("bench", "bench_translate: every port decodes the imported model with the paper's alpha 0.6", _BENCH,
           "alpha = LENGTH_PENALTY_ALPHA if checkpoint is None else None", "alpha = LENGTH_PENALTY_ALPHA",
           BENCH_TRANSLATE),
    # --profile's split of XLA's trace: a fusion holding a dot is a product; the loop is its body's kernels
    single("bench", "bench_translate --profile: a fusion holding a dot not counted a product", _BENCH,
           'opcodes = {opcode} if opcode != "fusion" else', 'opcodes = {opcode} if True else', BENCH_TRANSLATE),
    single("bench", "bench_translate --profile: the while loop counted beside its body's kernels", _BENCH,
           'XLA_CONTROL = {"while", "conditional", "call"}', 'XLA_CONTROL = {"conditional", "call"}',
           BENCH_TRANSLATE),
    # `bench CHECKPOINT --peers`: the transformers peer reads Marian's pad start token; every engine decodes within
    # --decode-tokens' budget; the inputs hold no special id (tests/benchmarks/test_peers.py)
    single("bench", "bench's transformers peer masks a target's pad start token", "transformer_bench/peers.py",
           "read[:, 0] = True", "read[:, 0] = read[:, 0]", BENCH_CHECKPOINT),
    single("bench", "bench CHECKPOINT: the ports decode to the checkpoint's own budget", _BENCH_MODULE,
           "config.with_decoding(max_output_length=None), params", "config, params", BENCH_CHECKPOINT),
    single("bench", "bench: the inputs drawn from every id, special ones included", _BENCH_MODULE,
           "source_ids, target_ids = ordinary_ids(config)\n    src =",
           "source_ids, target_ids = (np.arange(config.src_vocab_size), np.arange(config.tgt_vocab_size))\n    src =",
           BENCH_CHECKPOINT),
]

# Each framework's own training idiom (ecosystem.py): the independent checks are tests/ports/test_ecosystem.py's naive loops
# over the tokens and the float64 reference's run of the same steps.
ECOSYSTEM_TESTS = "tests/ports/test_ecosystem.py"
ECOSYSTEM = [
    single("ecosystem", "tf: Keras' one input read as (tgt, src) from a dict", FL,
           'return inputs["src"], inputs["tgt"]', 'return inputs["tgt"], inputs["src"]',
           [ECOSYSTEM_TESTS, "-k", "one_input"]),
    single("ecosystem", "tf: the Keras loss without label smoothing", "transformer_tf/ecosystem.py",
           "training.label_smoothed_cross_entropy(y_pred, y_true, self.pad_id, self.epsilon)",
           "training.label_smoothed_cross_entropy(y_pred, y_true, self.pad_id, 0.0)",
           [ECOSYSTEM_TESTS, "-k", "naive_sums"]),
    single("ecosystem", "tf: the token accuracy counts the padding", "transformer_tf/ecosystem.py",
           "hits = tf.logical_and(real, tf.argmax(y_pred, axis=-1) == labels)",
           "hits = tf.argmax(y_pred, axis=-1) == labels", [ECOSYSTEM_TESTS, "-k", "naive_sums"]),
    single("ecosystem", "tf: the compile optimizer's schedule for twice the model's width", "transformer_tf/ecosystem.py",
           "training.learning_rate_schedule(model.config.d_model, config)",
           "training.learning_rate_schedule(2 * model.config.d_model, config)",
           [ECOSYSTEM_TESTS, "-k", "keras_fit_makes_the_reference_updates and numpy"]),
    single("ecosystem", "torch: collate shifts the target without its start token", "reference_numpy/tokenizer.py",
           '"tgt": pad_rows([[config.start_id, *ids[:-1]] for ids in labels], config.pad_id)',
           '"tgt": pad_rows([ids[:-1] for ids in labels], config.pad_id)',
           [ECOSYSTEM_TESTS, "-k", "torch_dataset_collates"]),
    single("ecosystem", "from_pretrained: a Hugging Face directory's model without its tokenizer",
           "transformer_hf/pretrained.py", "        config, params, text = read_hf_directory(name_or_path)\n",
           "        config, params, _ = read_hf_directory(name_or_path)\n        text = None\n",
           ["tests/families/test_from_pretrained.py", "-k", "hugging_face_directory_in_memory"]),
    single("ecosystem", "from_pretrained: a port's model of a file ignores dtype", "transformer_hf/pretrained.py",
           "port.load_checkpoint(name_or_path, dtype, **placed)", "port.load_checkpoint(name_or_path, **placed)",
           ["tests/families/test_from_pretrained.py", "-k", "checkpoint_file and jax"]),
]

# The prepared GPU check (scripts/device_check.py) must be able to fail: tests/benchmarks/test_device_check.py runs it on the CPU
# with a port bug planted through --perturb, and its verdicts on rows of its own
_DEVICE_CHECK = "scripts/device_check.py"
DEVICE_CHECK = ["tests/benchmarks/test_device_check.py", "-m", "not slow"]
DEVICE = [
    single("device", "device_check: a forward run over its bound reported as agreement", _DEVICE_CHECK,
           "+ f\"; forward {run.forward_ms:.1f} ms\",\n                   ok=run.ok)",
           "+ f\"; forward {run.forward_ms:.1f} ms\",\n                   ok=run.error is None)", DEVICE_CHECK),
    single("device", "device_check: a disagreement leaves the exit status 0", _DEVICE_CHECK,
           'if any(row.status in ("FAIL", "error") for row in rows):', 'if any(row.status == "error" for row in rows):',
           DEVICE_CHECK),
    single("device", "device_check: a run in which no port compared anything passes", _DEVICE_CHECK,
           'return 0 if any(row.status == "ok" and row.backend in PORTS for row in rows) else 1', "return 0",
           DEVICE_CHECK),
]

# No command or exporter writes over one of its inputs (transformer_export/outputs.py)
OUTPUTS = [
    single("outputs", "a hard link to an input not taken for that input (written over)", "transformer_export/outputs.py",
           "if os.path.samestat(target, status):", "if os.path.realpath(output) == os.path.realpath(source):",
           ["tests/cli/test_inputs_never_replaced.py", "-k", "no_output_of_any_command and hard"]),
]

# The reference and the ports name no Hugging Face family or field: the scan of their sources
_NO_FAMILY = "tests/project/test_no_family_names.py::test_the_reference_and_the_ports_name_no_family_or_field"

# The packages import only downward (tests/project/test_layers.py runs import-linter's layers contract of pyproject.toml)
LAYERS = [
    single("layers", "the adapters import from the command line above them", "equivalence/backends/__init__.py",
           "from equivalence import runtime\n",
           "from equivalence import runtime\nfrom transformer_cli.extras import INSTALL  # noqa: F401\n",
           ["tests/project/test_layers.py", "-k", "only_downward"]),
    # The reference and the ports name no Hugging Face family or field (docs/huggingface.md, "Where the reference's
    # variants come from"): a mention is caught by the scan, whatever the backend
    single("layers", "the reference's halves table says whose it is (Marian's)", f"{REF}/variants.py",
           "Section 3.5's angles with the sines in the first half of the columns and the cosines in the second --",
           "Section 3.5's angles with the sines in the first half of the columns and the cosines in the second, Marian's --",
           [_NO_FAMILY]),
    consistent("layers", "every backend's decoding says whose conventions it follows (generate's num_beams)", [
        (RD, "Greedy decoding and beam search (section 6.1) for the reference.",
         "Greedy decoding and beam search (section 6.1) for the reference, with the beam of num_beams."),
        (TD, "Greedy decoding and beam search (section 6.1) with a key/value cache.",
         "Greedy decoding and beam search (section 6.1) with a key/value cache, with the beam of num_beams."),
        (JD, "Greedy decoding and beam search (section 6.1) for the JAX/Flax port, compiled.",
         "Greedy decoding and beam search (section 6.1) for the JAX/Flax port, compiled, with the beam of num_beams."),
        (FD, "Greedy decoding and beam search (section 6.1) for the TensorFlow port, compiled.",
         "Greedy decoding and beam search (section 6.1) for the TensorFlow port, compiled, with the beam of num_beams."),
    ], [_NO_FAMILY]),
]

# The command line's cache of compiled programs (equivalence/compile_cache.py) and the imports it defers: only
# fresh processes see them (tests/cli/test_compile_cache.py)
_CACHE_TEST = "tests/cli/test_compile_cache.py::test_a_second_process_reads_back_what_the_first_compiled"
CACHE = [
    single("compile-cache", "cache: JAX is not pointed at the cache's directory", "equivalence/compile_cache.py",
           'os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(jax))',
           'os.environ.setdefault("JAX_COMPILATION_CACHE_DIRECTORY", str(jax))', [f"{_CACHE_TEST}[jax]"]),
    single("compile-cache", "cache: --no-cache still reads and writes the cache", "equivalence/compile_cache.py",
           "    if not enabled:\n", "    if not enabled and False:\n",
           ["tests/cli/test_compile_cache.py::test_a_user_s_own_framework_cache_is_kept_and_no_cache_sets_none"]),
    single("compile-cache", "cache: TensorFlow's notices of a program read back are printed", "equivalence/runtime.py",
           "kept = [line for line in lines if not any(notice in line for notice in CACHE_NOTICES)]",
           "kept = list(lines)",
           [f"{_CACHE_TEST}[tf]", "tests/cli/test_compile_cache.py::test_tensorflow_s_notices_of_a_program_read_back_are_dropped"]),
    single("compile-cache", "imports: translate --backend tf imports JAX with TensorFlow", "equivalence/runtime.py",
           'UNNEEDED = {"equivalence.backends.tf": ("jax",)}', "UNNEEDED: dict = {}", [f"{_CACHE_TEST}[tf]"]),
    single("compile-cache", "runtime: freed memory handed back to the system (glibc's thresholds left as they are)",
           "equivalence/runtime.py", "    if mallopt is not None:\n", "    if mallopt is None:\n",
           ["tests/cli/test_cli_reliability.py", "-k", "freed_memory"]),
]

MUTATIONS = [*SINGLE, *BEAM_TABLE, *ATTENDED_WIDTH, *STACKING, *RESIDUAL, *FINAL_NORMS, *EMBEDDING_SCALE, *EMBEDDING_CHOICES, *EPSILON, *ACTIVATION, *CHOICES, *LEARNED_PE,
             *LOSS, *LENGTH_PENALTY, *BEAM_END, *BUDGET, *EARLY_STOPPING, *HF_DECODING, *HELD_BACK_DECODING, *REPETITION_PENALTY, *TIES, *LOG_SOFTMAX, *TRAINING,
             *TEXT, *DATA_PARALLEL, *HF_EXPORT, *PRECISION, *LINEAR_MAPS_IN_P, *HF_TOKENIZERS, *FINETUNE,
             *BENCH, *ECOSYSTEM, *DEVICE, *OUTPUTS, *LAYERS, *CACHE]


# ----------------------------------------------------------------------------- running

def apply(mutation: Mutation, root: Path) -> None:
    """Plant ``mutation`` in the tree at ``root``; every original text must be found exactly once."""
    for edit in mutation.edits:
        target = root / edit.path
        text = target.read_text()
        if text.count(edit.original) != 1:
            raise SystemExit(f"{mutation.bug}: the text to mutate is found {text.count(edit.original)} times "
                             f"(not exactly once) in {edit.path}:\n{edit.original}")
        target.write_text(text.replace(edit.original, edit.mutated))


def copy_repository(tmp: str) -> Path:
    """A copy of the checkout in ``tmp`` that shares the checkout's compilation cache (tests/helpers/compile_cache.py): a
    planted bug changes the programs it reaches, and so their keys; every other program is read back."""
    copy = Path(tmp) / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info",
                                                              ".hypothesis", ".pytest_cache", ".compile-cache"))
    (ROOT / ".compile-cache").mkdir(exist_ok=True)
    (copy / ".compile-cache").symlink_to(ROOT / ".compile-cache", target_is_directory=True)
    return copy


def pytest(copy: Path, selection: tuple[str, ...], first_failure: bool, full: bool = True
           ) -> subprocess.CompletedProcess:
    """Run pytest in ``copy`` (its packages shadow the installed ones: PYTHONPATH and the working directory): the
    selection's tests in the whole suite, or with ``full`` false those in the default tier."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n0", "-rf",
                           *(["-x"] if first_failure else []), *(["--full"] if full else []), *selection],
                          cwd=copy, capture_output=True, text=True, env=env)


def slow_reason(result: subprocess.CompletedProcess) -> str:
    """Why the default tier leaves out the first failing test: the line tests/conftest.py prints for it."""
    failed = failed_tests(result)
    section = result.stdout.partition("failed tests that the default tier leaves out")[2]
    return next((line.removeprefix(f"{failed[0]}: ") for line in section.splitlines()
                 if failed and line.startswith(f"{failed[0]}: ")), "")


def failed_tests(result: subprocess.CompletedProcess) -> list[str]:
    """The node ids pytest's summary reports as FAILED, in order."""
    return re.findall(r"^FAILED (\S+)", result.stdout, flags=re.MULTILINE)


@dataclass
class Outcome:
    status: str            # "caught", "MISSED" or "ERROR"
    caught_by: list[str]   # the failing tests' node ids (the first only, unless --every-test)
    blind: str             # with --blind: "passes (N passed)", "FAILS (...)" or ""
    seconds: float
    tier: str = ""         # caught by the selection's tests in the "default" tier, or only in the "full" suite
    why_full: str = ""     # for "full": why the default tier leaves the catching test out (tests/conftest.py)


def control(mutation: Mutation) -> str:
    """The agreement selection with the bug planted in the reference alone: it must fail, or the
    selection cannot tell whether the ports carry the same bug (``--blind`` would prove nothing)."""
    reference_only = Mutation(mutation.kind, mutation.bug, "single",
                              tuple(edit for edit in mutation.edits if edit.path.startswith(f"{REF}/")), ())
    with tempfile.TemporaryDirectory() as tmp:
        copy = copy_repository(tmp)
        apply(reference_only, copy)
        check = pytest(copy, mutation.blind, first_failure=True)
    if check.returncode == 1:
        return f"fails on the reference alone, as it must ({failed_tests(check)[:1]})"
    return f"INSENSITIVE: passes with the bug in the reference alone ({_last_line(check)})"


def run_mutation(mutation: Mutation, blind: bool, every_test: bool) -> Outcome:
    """Plant ``mutation`` in a copy and run its selection: first the tests of the default tier (``pytest``), then,
    unless they caught it, the whole suite's (``pytest --full``)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        copy = copy_repository(tmp)
        apply(mutation, copy)
        tier, why_full = "default", ""
        result = pytest(copy, mutation.catch, first_failure=not every_test, full=False)
        if not (result.returncode == 1 and failed_tests(result)):   # passed, or the tier holds none of them
            tier = "full"
            result = pytest(copy, mutation.catch, first_failure=not every_test)
            why_full = slow_reason(result)
        failed = failed_tests(result)
        if result.returncode == 1 and failed:
            status = "caught"
        elif result.returncode == 0:
            status, tier = "MISSED", ""
        else:                                     # collection error, interrupted, no test selected
            status, failed, tier = "ERROR", [_last_line(result)], ""
        blind_note = ""
        if blind and mutation.blind:
            check = pytest(copy, mutation.blind, first_failure=True)
            blind_note = f"passes ({_last_line(check)})" if check.returncode == 0 \
                else f"FAILS ({_last_line(check)}; {failed_tests(check)[:1]})"
            if any(not edit.path.startswith(f"{REF}/") for edit in mutation.edits):   # a port's own code is edited
                blind_note += f"\n{'':<8}control: {control(mutation)}"
    return Outcome(status, failed, blind_note, time.monotonic() - start, tier, why_full)


def _last_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else f"exit code {result.returncode}"


def function_name(node_id: str) -> str:
    """tests/test_x.py::test_y[params] -> test_x.py::test_y."""
    return node_id.split("[")[0].removeprefix("tests/")


def functions(node_ids: list[str]) -> list[str]:
    return list(dict.fromkeys(function_name(node_id) for node_id in node_ids))


def report(mutation: Mutation, outcome: Outcome) -> str:
    if outcome.status == "caught":
        first, *rest = functions(outcome.caught_by)
        tests = f"{outcome.caught_by[0]}" + (f" (+ {', '.join(rest)})" if rest else "")
    else:
        tests = "; ".join(outcome.caught_by) or "-"
    blind = f"\n{'':<8}agreement: {outcome.blind}" if outcome.blind else ""
    tier = {"default": "  [default tier]", "full": f"  [whole suite only: {outcome.why_full}]"}.get(outcome.tier, "")
    return (f"{outcome.status:<8}{mutation.kind:<21}{mutation.scope:<12}{mutation.bug}\n{'':<8}{tests}  "
            f"{outcome.seconds:.0f} s{tier}{blind}")


def summarize(results: list[tuple[Mutation, Outcome]]) -> None:
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for mutation, outcome in results:
        groups[(mutation.kind, mutation.scope)].append(outcome)
    print(f"\n{'kind':<21}{'scope':<12}{'caught':>8}  catching tests")
    for (kind, scope), outcomes in groups.items():
        caught = sum(outcome.status == "caught" for outcome in outcomes)
        tests = functions([node for outcome in outcomes if outcome.status == "caught" for node in outcome.caught_by])
        print(f"{kind:<21}{scope:<12}{f'{caught}/{len(outcomes)}':>8}  {', '.join(sorted(tests))}")
    caught = sum(outcome.status == "caught" for _, outcome in results)
    print(f"{'total':<33}{f'{caught}/{len(results)}':>8}")
    default = sum(outcome.tier == "default" for _, outcome in results)
    print(f"{'caught by the default tier':<33}{f'{default}/{len(results)}':>8}  ({100 * default / len(results):.0f} %)")
    only_full = [(mutation, outcome) for mutation, outcome in results if outcome.tier == "full"]
    if only_full:
        print("caught only by the whole suite (pytest --full):")
    for mutation, outcome in only_full:
        print(f"  {mutation.bug}\n    {function_name(outcome.caught_by[0])}: {outcome.why_full}")


def missing_test_files(mutations: list[Mutation]) -> list[str]:
    """The test files named by the selections (``catch`` and ``blind``) that do not exist: a selection of a moved
    file would collect nothing and prove nothing."""
    named = {arg.split("::")[0] for m in mutations for arg in (*m.catch, *m.blind) if arg.startswith("tests/")}
    return sorted(path for path in named if not (ROOT / path).exists())


def select(args: argparse.Namespace) -> list[Mutation]:
    chosen = [m for m in MUTATIONS
              if (not args.kind or m.kind in args.kind) and (not args.scope or m.scope == args.scope)
              and (not args.only or any(text.lower() in m.bug.lower() for text in args.only))]
    if not chosen:
        raise SystemExit("no mutation matches the filters (see --list)")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the mutations, check that every edit applies, exit")
    parser.add_argument("--kind", action="append", choices=sorted({m.kind for m in MUTATIONS}),
                        help="only mutations of this kind (repeatable)")
    parser.add_argument("--scope", choices=("single", "consistent"), help="only single-backend or consistent bugs")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="only mutations whose description contains TEXT (repeatable, case-insensitive)")
    parser.add_argument("--blind", action="store_true",
                        help="also run each consistent mutation's agreement selection, which must pass, and "
                             "(control) the same selection with the bug in the reference alone, which must fail")
    parser.add_argument("--every-test", action="store_true",
                        help="run the whole selection instead of stopping at the first failure, and name every test "
                             "that fails")
    args = parser.parse_args()
    chosen = select(args)
    if args.list:
        missing = missing_test_files(chosen)
        if missing:
            raise SystemExit("selections name test files that do not exist: " + ", ".join(missing))
        with tempfile.TemporaryDirectory() as tmp:
            copy = copy_repository(tmp)
            for mutation in chosen:
                for edit in mutation.edits:          # each mutation on a fresh copy of its files
                    shutil.copy(ROOT / edit.path, copy / edit.path)
                apply(mutation, copy)
                files = ", ".join([*sorted({edit.path for edit in mutation.edits}),
                                   *(f"{port} (runs the reference's code)" for port in mutation.shared)])
                print(f"{mutation.kind:<21}{mutation.scope:<12}{mutation.bug}\n{'':<33}{files}")
        return 0
    start, results, failures = time.monotonic(), [], 0
    for mutation in chosen:
        outcome = run_mutation(mutation, args.blind, args.every_test)
        results.append((mutation, outcome))
        failures += outcome.status != "caught" or outcome.blind.startswith("FAILS")
        print(report(mutation, outcome), flush=True)
    summarize(results)
    print(f"{time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
