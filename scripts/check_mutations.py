"""Break the code on purpose, one classic Transformer bug at a time, and check that the suite
notices: each mutation is applied to a copy of the repository and the named tests must fail.

    python scripts/check_mutations.py            # every mutation (a few minutes)
    python scripts/check_mutations.py --list

Prints one line per mutation: caught (the selected tests failed) or MISSED.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (bug, file, original text, mutated text, pytest arguments that must fail)
MUTATIONS = [
    ("reference: LayerNorm epsilon outside the square root", "reference_numpy/model.py",
     "np.sqrt(var + self.eps)", "(np.sqrt(var) + self.eps)", ["tests/test_reference.py", "-k", "layer_norm"]),
    ("reference: positional encoding [sin | cos] instead of interleaved", "reference_numpy/model.py",
     "    table[:, 0::2] = np.sin(angle)\n    table[:, 1::2] = np.cos(angle)",
     "    table[:, :d_model // 2] = np.sin(angle)\n    table[:, d_model // 2:] = np.cos(angle)",
     ["tests/test_reference.py", "-k", "positional"]),
    ("reference: decoder may see one future position", "reference_numpy/model.py",
     "np.tril(np.ones((length, length), dtype=bool))", "np.tril(np.ones((length, length), dtype=bool), k=1)",
     ["tests/test_reference.py", "-k", "causal"]),
    ("reference: heads split token-major", "reference_numpy/model.py",
     "x = x.reshape(batch, length, self.n_heads, width // self.n_heads)  # (B, T, H, d_k)\n        return x.transpose(0, 2, 1, 3)",
     "x = x.reshape(batch, self.n_heads, length, width // self.n_heads)\n        return x",
     ["tests/test_reference.py", "-k", "multi_head"]),
    ("reference: embeddings not scaled by sqrt(d_model)", "reference_numpy/model.py",
     "return self.weight[tokens] * self.scale", "return self.weight[tokens]",
     ["tests/test_reference.py", "-k", "shared_embeddings"]),
    ("reference: key/value cache written one position late", "reference_numpy/model.py",
     "buffer[:, :, index:index + new.shape[2]] = new", "buffer[:, :, index + 1:index + 1 + new.shape[2]] = new",
     ["tests/test_reference.py", "-k", "cached"]),
    ("reference: greedy ties go to the highest token id", "reference_numpy/decoding.py",
     "token = log_probs.argmax(axis=-1)", "token = log_probs.shape[-1] - 1 - log_probs[:, ::-1].argmax(axis=-1)",
     ["tests/test_decoding.py", "-k", "ties_to_the_lowest_id"]),
    ("reference: equal beam scores go to the later hypothesis", "reference_numpy/decoding.py",
     "key=lambda i: (finished[i][0], -i)", "key=lambda i: (finished[i][0], i)",
     ["tests/test_decoding.py", "-k", "equal_scores"]),
    ("torch: LayerNorm epsilon left at torch's default 1e-5", "transformer_torch/model.py",
     "super().__init__(config.d_model, eps=config.layer_norm_eps)", "super().__init__(config.d_model)",
     ["tests/test_agreement.py", "-k", "torch and cpu and test_component and encoder_layer and none"]),
    ("torch: a square projection not transposed on load", "transformer_torch/checkpoint.py",
     'for row in _linear(f"{prefix}.{proj}")]', 'for row in _linear(f"{prefix}.{proj}", proj == "o_proj")]',
     ["tests/test_agreement.py", "-k", "torch and cpu and test_component and multi_head_attention and none"]),
    ("torch: key/value cache written one position late", "transformer_torch/model.py",
     "        cache.keys[:, :, cache_index:cache_index + k.shape[2]] = k",
     "        cache.keys[:, :, cache_index + 1:cache_index + 1 + k.shape[2]] = k",
     ["tests/test_torch.py", "-k", "cache"]),
    ("torch: dropout left on at inference", "equivalence/adapters/torch.py",
     "_, stages = model.eval()(src, tgt, src_mask, tgt_mask, return_intermediates=True)",
     "_, stages = model.train()(src, tgt, src_mask, tgt_mask, return_intermediates=True)",
     ["tests/test_agreement.py", "-k", "torch and cpu and test_forward_stages and tiny and none"]),
    ("keras: LayerNorm epsilon left at Keras' default 1e-3", "transformer_tf/model.py",
     "super().__init__(axis=-1, epsilon=config.layer_norm_eps, **kwargs)", "super().__init__(axis=-1, **kwargs)",
     ["tests/test_agreement.py", "-k", "tf and cpu and test_component and encoder_layer and none"]),
    ("keras: key/value cache written one position late", "transformer_tf/model.py",
     "positions = tf.cast(index, tf.int32) + tf.range(shape[2])",
     "positions = tf.cast(index, tf.int32) + 1 + tf.range(shape[2])",
     ["tests/test_tf.py", "-k", "cache"]),
    ("keras: embeddings not scaled by sqrt(d_model)", "transformer_tf/model.py",
     "self.scale = math.sqrt(self.config.d_model)", "self.scale = 1.0",
     ["tests/test_agreement.py", "-k", "tf and cpu and test_forward_stages and tiny and none"]),
    ("jax: masked scores filled with -1e9 (uniform average on a fully masked row)", "transformer_jax/model.py",
     "scores = jnp.where(mask, scores, -jnp.inf)", "scores = jnp.where(mask, scores, -1e9)",
     ["tests/test_agreement.py", "-k", "jax and cpu and test_component and attention and fully_masked_row"]),
    ("jax: key/value cache written one position late", "transformer_jax/model.py",
     "cache = KVCache(lax.dynamic_update_slice_in_dim(cache.keys, k, cache_index, axis=2),",
     "cache = KVCache(lax.dynamic_update_slice_in_dim(cache.keys, k, cache_index + 1, axis=2),",
     ["tests/test_jax.py", "-k", "cache"]),
]


def run_mutation(bug: str, path: str, original: str, mutated: str, selection: list[str]) -> bool:
    """True when the selected tests fail on the mutated copy."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info"))
        target = copy / path
        text = target.read_text()
        if text.count(original) != 1:
            raise SystemExit(f"{bug}: the text to mutate is not found exactly once in {path}")
        target.write_text(text.replace(original, mutated))
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection],
                                cwd=copy, capture_output=True, text=True)
        return result.returncode == 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    missed = 0
    for bug, path, original, mutated, selection in MUTATIONS:
        if args.list:
            print(bug)
            continue
        caught = run_mutation(bug, path, original, mutated, selection)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {bug}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
