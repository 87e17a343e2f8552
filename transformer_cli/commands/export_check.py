"""``transformer-reference export --check``: run a forward-pass artefact the way a serving process would -- in a
fresh Python process that cannot import this project, with only the artefact's runtime -- and hold its answers to
the reference (docs/deploy.md).

The process loads the artefact (:data:`LOADERS`), computes the log-probabilities of a ragged batch (the checkpoint's
own sentences when it has a tokenizer, else ``compare``'s seeded batch) and greedy-decodes the sources with a
NumPy loop over the forward pass (:data:`GREEDY`: the reference's rules, section 6.1). Here, the log-probabilities
are compared with the float64 reference under the float32 policy (``equivalence.tolerance``), and the tokens with
the float64 reference's greedy tokens under the float32 token rule (identical up to a near-tie the bound allows).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from equivalence import tolerance
from reference_numpy.checkpoint import load_checkpoint, load_tokenizer
from reference_numpy.decoding import EXTRA_OUTPUT_LENGTH
from transformer_cli.commands.compare import build_oracle, compare_inputs, greedy_verdict, translation_source

# The packages of this project: the checking process asserts that none of them can be imported.
PROJECT = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf", "transformer_cli",
           "equivalence")

# Each defines ``run(src, tgt) -> log_probs`` from the artefact in the directory sys.argv[1] (int64 ids in, float32
# (B, T, V) out): how a serving process loads it with its runtime alone.
LOADERS = {
    "savedmodel": """
import tensorflow as tf
model = tf.saved_model.load(sys.argv[1])
run = lambda src, tgt: model.serve(tf.constant(src), tf.constant(tgt)).numpy()
""",
    "jax-export": """
import jax
exported = jax.export.deserialize(bytearray(open(sys.argv[1] + "/forward.jax", "rb").read()))
weights = dict(np.load(sys.argv[1] + "/weights.npz"))
run = lambda src, tgt: np.asarray(exported.call(weights, src.astype(np.int32), tgt.astype(np.int32)))
""",
    "torch-export": """
import torch
program = torch.export.load(sys.argv[1] + "/model.pt2").module()
run = lambda src, tgt: program(torch.from_numpy(src), torch.from_numpy(tgt)).detach().numpy()
""",
    "onnx": """
import onnxruntime
session = onnxruntime.InferenceSession(sys.argv[1] + "/model.onnx", providers=["CPUExecutionProvider"])
run = lambda src, tgt: session.run(["log_probs"], {"src": src, "tgt": tgt})[0]
""",
}

# A serving process's greedy decoding over ``run``, NumPy only, with the reference's rules
# (``reference_numpy.decoding.greedy_decode``): every row starts with bos; each step runs the whole prefix and
# writes the last position's best id (argmax: a tie goes to the lowest id), never pad or bos; a row ends at eos or
# after len(src) + EXTRA_OUTPUT_LENGTH tokens (at most max_len, section 6.1) and is padded after.
GREEDY = """
def greedy(src, pad_id, bos_id, eos_id, max_len, extra_length):
    limits = np.minimum((src != pad_id).sum(axis=1) + extra_length, max_len)
    tgt = np.full((len(src), 1), bos_id, dtype=np.int64)
    done = np.zeros(len(src), dtype=bool)
    while not done.all():
        log_probs = np.array(run(src, tgt)[:, -1])                           # (B, V) the next token's
        log_probs[:, [pad_id, bos_id]] = -np.inf
        token = np.where(done, pad_id, log_probs.argmax(axis=-1))
        tgt = np.concatenate([tgt, token[:, None]], axis=1)
        done |= (token == eos_id) | (tgt.shape[1] - 1 >= limits)
    return tgt[:, 1:]
"""

# The checking process: only site-packages on its path (``python -I -S``: no site hooks, so an editable install's
# path is never added), the project not importable; reads inputs.npz (src, tgt), writes outputs.npz.
ISOLATION = f"""
import importlib.util, json, sys
sys.path[:0] = {site.getsitepackages()!r}
assert not [name for name in {PROJECT!r} if importlib.util.find_spec(name)], "the project is importable"
import numpy as np
"""
CHECK = """
config = json.load(open(sys.argv[1] + "/transformer.json"))["config"]
inputs = np.load(sys.argv[2])
tokens = greedy(inputs["src"], config["pad_id"], config["bos_id"], config["eos_id"], config["max_len"],
                int(sys.argv[4]))
np.savez(sys.argv[3], log_probs=run(inputs["src"], inputs["tgt"]), tokens=tokens)
print(json.dumps(sorted(name for name in ("tensorflow", "jax", "torch", "onnxruntime") if name in sys.modules)))
"""


def check_target(target: str) -> None:
    """A ``ValueError`` unless ``target``'s artefact is a forward pass this check runs (CTranslate2 brings its own
    decoder)."""
    if target not in LOADERS:
        raise ValueError(f"--check runs the forward-pass targets ({', '.join(LOADERS)}), not {target}")


@dataclass
class Checked:
    """What ``export --check`` found: the log-probabilities' agreement, the greedy tokens' verdict, the runtimes
    the checking process imported."""

    log_probs: tolerance.Agreement
    greedy_identical: bool
    greedy_note: str
    rows: int
    imported: list[str]

    @property
    def ok(self) -> bool:
        return self.log_probs.ok and self.greedy_identical

    def __str__(self) -> str:
        tokens = "identical" if self.greedy_identical else "DIFFER"
        note = f" ({self.greedy_note})" if self.greedy_note else ""
        return (f"checked in a process without this project ({', '.join(self.imported)}): log-probabilities "
                f"{self.log_probs} (float32 policy), greedy tokens of {self.rows} sentences {tokens}{note}")


def check_export(target: str, output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> Checked:
    """Run the ``target`` artefact in ``output_dir`` in a process without this project, on ``checkpoint``'s
    sentences (or ``compare``'s seeded batch), and compare it with the reference (see the module docstring)."""
    check_target(target)
    config, params = load_checkpoint(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    src = translation_source(tokenizer) if tokenizer is not None else None
    src = compare_inputs(config)["src"] if src is None else src
    oracle = build_oracle(config, params, src, dtypes=("float32",))
    with tempfile.TemporaryDirectory() as directory:
        inputs, outputs = Path(directory) / "inputs.npz", Path(directory) / "outputs.npz"
        np.savez(inputs, **oracle.inputs)     # type: ignore[arg-type]  # numpy's stub: a ** key might be allow_pickle
        imported = run_isolated(LOADERS[target] + GREEDY + CHECK, output_dir, inputs, outputs, EXTRA_OUTPUT_LENGTH)
        with np.load(outputs) as answers:
            log_probs, tokens = answers["log_probs"], answers["tokens"]
    agreement = tolerance.agreement(log_probs, oracle.stages64["log_probs"], oracle.stages["float32"]["log_probs"],
                                    "float32")
    identical, note = greedy_verdict(tokens, oracle, "float32", config.pad_id)
    return Checked(agreement, identical, note, len(src), imported)


def run_isolated(script: str, *args: object) -> Any:
    """Run ``script`` in ``python -I -S`` (no site hooks, no PYTHON* variables, no working directory on the path)
    after :data:`ISOLATION` (the interpreter's site-packages appended by hand, so that only installed runtimes
    import), from a temporary working directory; returns the JSON value it prints last. A failure is one
    ``ValueError`` with the process's last line of error."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", ISOLATION + script, *map(str, args)],
                              cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"the artefact did not run in a process without this project: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
