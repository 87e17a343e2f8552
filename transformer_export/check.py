"""``transformer-reference export --check``: run a forward-pass artefact the way a serving process would -- in a
fresh Python process that cannot import this project, with only the artefact's runtime -- and hold its answers to
the reference (docs/deploy.md).

The process loads the artefact (:data:`LOADERS`), computes the log-probabilities of a ragged batch (``compare``'s
sentences encoded by the artefact's own tokenizer, its ``tokenizer.json``, when it has one, else ``compare``'s
seeded batch), greedy-decodes the sources with a NumPy loop over the forward pass (:data:`GREEDY`: the reference's
rules, section 6.1) and beam-searches them (:data:`BEAM`: size 4, alpha 0.6, the reference's rules). Here, the
log-probabilities are compared with the float64 reference under the float32 policy (``equivalence.tolerance``), the
greedy tokens with the float64 reference's under the float32 token rule (identical up to a near-tie the bound
allows), and the beam tokens with the float64 reference's ``beam_search`` on every row the float32 rule compares
whole (``tolerance.beam_row_is_decisive``: no step or final choice within the bound of a tie).

The loops decode as section 6.1 does, whatever decoding conventions the checkpoint holds (an imported Hugging Face
model's start token, suppressed and forced tokens, budget, length normalization: reference_numpy/config.py), and the
reference they are held to decodes so too (``TransformerConfig.paper_decoding``): what the check proves is the
artefact's numbers, which a serving loop of the model's own conventions reads alike -- but for a start token that is
pad (Marian's), which the forward pass masks as padding: such a model is served through its cached decoding step,
whose attention reads every position written.

A target that exports the cached decoding step (``transformer.json``'s ``decoding_step``, :data:`STEPS`) is also run
through it in the same process: ``encode`` once and ``step`` per position along the reference's greedy translation
(teacher forcing), whose log-probabilities are held to the same float32 policy at every position a decoding loop
reads (those whose input is not padding: the step attends to every position written, the forward pass hides a
padded target's positions), and a cached greedy loop (:data:`CACHED_GREEDY`), whose tokens are held to the same
token rule.

The artefact's ``tokenizer.json`` is checked too (:func:`artefact_tokenizer`): a serving process encodes and decodes
text with it, so it must be the checkpoint's tokenizer; one that is missing, cannot be read or holds another
vocabulary fails the check (exit 1), as a wrong number does.
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
from typing import Any, NamedTuple

import numpy as np

from equivalence import tolerance
from equivalence.margins import beam_margins
from equivalence.oracle import build_oracle, compare_inputs, greedy_verdict, translation_source
from reference_numpy import Transformer, TransformerConfig, beam_search
from reference_numpy.checkpoint import load_checkpoint
from reference_numpy.decoding import BEAM_SIZE, EXTRA_OUTPUT_LENGTH, LENGTH_PENALTY_ALPHA
from reference_numpy.tokenizer import Tokenizer
from transformer_export.ctranslate2 import TOKENIZER_FILE
from transformer_export.export import read_manifest
from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer_json, tokenizer_of

# The packages of this project: the checking process asserts that none of them can be imported.
PROJECT = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf", "transformer_hf",
           "equivalence", "transformer_tasks", "transformer_export", "transformer_bench", "transformer_cli")

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
weights = jax.device_put(dict(np.load(sys.argv[1] + "/weights.npz")))          # once, not at every call
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

# A serving process's beam search over ``run``, NumPy only, one sentence at a time, with the reference's rules
# (``reference_numpy.decoding``'s docstring): candidates (beam, token) ranked by summed log-probability, ties to the
# lower beam then the lower token; an eos among the first beam_size ranks finishes a hypothesis scored
# log P / ((5 + |Y|) / 6)^alpha (|Y| counting eos); the first beam_size possible non-eos candidates live on; the
# search stops at the length limit (the live beams then finish too), with no live beam, or when no live beam can
# beat the best finished one; the best score wins, a tie going to the hypothesis finished first.
BEAM = """
def beam(src, pad_id, bos_id, eos_id, max_len, extra_length, beam_size, alpha):
    penalty = lambda length: ((5.0 + length) / 6.0) ** alpha
    limit = min(int((src != pad_id).sum()) + extra_length, max_len)
    live, scores, finished = [[bos_id]], np.zeros(1, dtype=np.float32), []
    for step in range(1, limit + 1):
        log_probs = np.array(run(np.repeat(src[None], len(live), axis=0), np.array(live, dtype=np.int64))[:, -1])
        log_probs[:, [pad_id, bos_id]] = -np.inf
        candidates = scores[:, None] + log_probs                            # (n_live, V)
        ranking = np.argsort(-candidates, axis=None, kind="stable")
        beams, tokens = np.divmod(ranking, candidates.shape[1])
        ranked = candidates.ravel()[ranking]
        finished += [(ranked[r] / penalty(step), live[beams[r]][1:] + [eos_id]) for r in range(beam_size)
                     if r < len(ranked) and tokens[r] == eos_id]
        keep = [r for r in range(len(ranked)) if tokens[r] != eos_id and np.isfinite(ranked[r])][:beam_size]
        live, scores = [live[beams[r]] + [int(tokens[r])] for r in keep], ranked[keep]
        if step == limit:
            finished += [(score / penalty(step), row[1:]) for score, row in zip(scores, live)]
        best = max((score for score, _ in finished), default=-np.inf)
        if step == limit or not live or scores.max() / penalty(limit) <= best:
            break
    return max(enumerate(finished), key=lambda item: (item[1][0], -item[0]))[1][1]


def beams(src, pad_id, *rules):
    rows = [beam(row, pad_id, *rules) for row in src]
    out = np.full((len(rows), max(map(len, rows))), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out
"""
# Each defines ``encode(src)`` and ``step(token, index, memory, src, self_keys, self_values, cross_keys,
# cross_values)`` (transformer_export.export.STEP; NumPy in and out, int64 ids) from the artefact in sys.argv[1],
# after its LOADERS entry.
STEPS = {
    "savedmodel": """
encode = lambda src: tuple(a.numpy() for a in model.encode(tf.constant(src)))
step = lambda token, index, memory, src, *caches: tuple(a.numpy() for a in model.step(
    tf.constant(token), tf.constant(index, tf.int64), tf.constant(memory), tf.constant(src), *map(tf.constant, caches)))
""",
    "jax-export": """
encode_exported, step_exported = (jax.export.deserialize(bytearray(open(sys.argv[1] + f"/{name}.jax", "rb").read()))
                                  for name in ("encode", "step"))
encode = lambda src: tuple(np.asarray(a) for a in encode_exported.call(weights, src.astype(np.int32)))
step = lambda token, index, memory, src, *caches: tuple(np.asarray(a) for a in step_exported.call(
    weights, token.astype(np.int32), np.int32(index), memory, src.astype(np.int32), *caches))
""",
    "torch-export": """
encode_program, step_program = (torch.export.load(sys.argv[1] + f"/{name}.pt2").module() for name in ("encode", "step"))
encode = lambda src: tuple(a.detach().numpy() for a in encode_program(torch.from_numpy(src)))
step = lambda token, index, memory, src, *caches: tuple(a.detach().numpy() for a in step_program(
    torch.from_numpy(token), torch.tensor(index, dtype=torch.int64), *map(torch.from_numpy, (memory, src, *caches))))
""",
    "onnx": """
encode_session, step_session = (onnxruntime.InferenceSession(sys.argv[1] + f"/{name}.onnx",
                                                             providers=["CPUExecutionProvider"])
                                for name in ("encode", "step"))
step_inputs = [argument.name for argument in step_session.get_inputs()]
encode = lambda src: tuple(encode_session.run(None, {"src": src}))
step = lambda token, index, *arrays: tuple(step_session.run(None, dict(zip(
    step_inputs, (token, np.array(index, np.int64), *arrays)))))
""",
}

# A serving process's cached decoding over ``encode`` and ``step``, NumPy only: ``stepped`` runs the step along a
# given target (B, T) and returns its log-probabilities (B, T, V); ``cached_greedy`` is GREEDY's loop (the same rules)
# feeding one token per step. The self-attention caches start as zeros of the capacity the loop needs: the target's
# length, or the longest output it may write (at most max_len, transformer.json's max_capacity).
CACHED_GREEDY = """
def empty_caches(cross_keys, capacity):
    layers, batch, heads, _, d_k = cross_keys.shape
    return np.zeros((layers, batch, heads, capacity, d_k), np.float32), np.zeros((layers, batch, heads, capacity, d_k),
                                                                                  np.float32)


def stepped(src, tgt):
    memory, cross_keys, cross_values = encode(src)
    self_keys, self_values = empty_caches(cross_keys, tgt.shape[1])
    out = []
    for index in range(tgt.shape[1]):
        log_probs, self_keys, self_values = step(tgt[:, index:index + 1], index, memory, src, self_keys, self_values,
                                                 cross_keys, cross_values)
        out.append(log_probs)
    return np.stack(out, axis=1)


def cached_greedy(src, pad_id, bos_id, eos_id, max_len, extra_length):
    limits = np.minimum((src != pad_id).sum(axis=1) + extra_length, max_len)
    memory, cross_keys, cross_values = encode(src)
    self_keys, self_values = empty_caches(cross_keys, int(limits.max()))
    token, tokens = np.full((len(src), 1), bos_id, dtype=np.int64), []
    done = np.zeros(len(src), dtype=bool)
    while not done.all():
        log_probs, self_keys, self_values = step(token, len(tokens), memory, src, self_keys, self_values, cross_keys,
                                                 cross_values)
        log_probs = np.array(log_probs)                                      # (B, V) the next token's
        log_probs[:, [pad_id, bos_id]] = -np.inf
        token = np.where(done, pad_id, log_probs.argmax(axis=-1))[:, None]
        tokens.append(token)
        done |= (token[:, 0] == eos_id) | (len(tokens) >= limits)
    return np.concatenate(tokens, axis=1)
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
manifest = json.load(open(sys.argv[1] + "/transformer.json"))
config = manifest["config"]
inputs = np.load(sys.argv[2])
rules = (config["pad_id"], config["bos_id"], config["eos_id"], config["max_len"], int(sys.argv[4]))
results = {"log_probs": run(inputs["src"], inputs["tgt"]), "tokens": greedy(inputs["src"], *rules),
           "beam_tokens": beams(inputs["src"], *rules, int(sys.argv[5]), float(sys.argv[6]))}
"""
CHECK_STEP = """
results.update(step_log_probs=stepped(inputs["src"], inputs["tgt"]), step_tokens=cached_greedy(inputs["src"], *rules))
"""
SAVE = """
np.savez(sys.argv[3], **results)
print(json.dumps(sorted(name for name in ("tensorflow", "jax", "torch", "onnxruntime") if name in sys.modules)))
"""


def check_target(target: str) -> None:
    """A ``ValueError`` unless ``target``'s artefact is a forward pass this check runs (CTranslate2 brings its own
    decoder)."""
    if target not in LOADERS:
        raise ValueError(f"--check runs the forward-pass targets ({', '.join(LOADERS)}), not {target}")


@dataclass
class Checked:
    """What ``export --check`` found: the log-probabilities' agreement, the greedy and beam tokens' verdicts, the
    runtimes the checking process imported, and the artefact's tokenizer's verdict (:func:`artefact_tokenizer`)."""

    log_probs: tolerance.Agreement
    greedy_identical: bool
    greedy_note: str
    beam_identical: bool
    beam_note: str
    rows: int
    imported: list[str]
    step: CheckedStep | None = None       # the cached decoding step's, if the artefact exports one
    tokenizer: Verdict | None = None      # the artefact's tokenizer.json's (None: neither has a tokenizer)

    @property
    def ok(self) -> bool:
        return (self.log_probs.ok and self.greedy_identical and self.beam_identical
                and (self.step is None or self.step.ok) and (self.tokenizer is None or self.tokenizer.identical))

    def __str__(self) -> str:
        step = "" if self.step is None else f"; {self.step}"
        tokenizer = "" if self.tokenizer is None else f"{TOKENIZER_FILE} of the artefact: {self.tokenizer}\n"
        return (f"{tokenizer}checked in a process without this project ({', '.join(self.imported)}): log-probabilities "
                f"{self.log_probs} (float32 policy), greedy tokens of {self.rows} sentences "
                f"{_verdict(self.greedy_identical, self.greedy_note)}, beam-{BEAM_SIZE} tokens "
                f"{_verdict(self.beam_identical, self.beam_note)}{step}")


class Verdict(NamedTuple):
    """Whether a part of the artefact is what it must be, and a note saying how (or what differs)."""

    identical: bool
    note: str = ""

    def __str__(self) -> str:
        return _verdict(self.identical, self.note)


@dataclass
class CheckedStep:
    """What the cached decoding step gave: its log-probabilities' agreement (teacher-forced along the reference's
    greedy translation, at the positions whose input is not padding) and its cached greedy tokens' verdict."""

    log_probs: tolerance.Agreement
    positions: int
    greedy_identical: bool
    greedy_note: str

    @property
    def ok(self) -> bool:
        return self.log_probs.ok and self.greedy_identical

    def __str__(self) -> str:
        return (f"cached decoding step: log-probabilities {self.log_probs} (float32 policy, {self.positions} "
                f"positions), greedy tokens {_verdict(self.greedy_identical, self.greedy_note)}")


def _verdict(identical: bool, note: str) -> str:
    if note.startswith("not compared"):
        return note
    return ("identical" if identical else "DIFFER") + (f" ({note})" if note else "")


def check_export(target: str, output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> Checked:
    """Run the ``target`` artefact in ``output_dir`` in a process without this project, on ``compare``'s sentences
    encoded by the artefact's tokenizer (or ``compare``'s seeded batch), and compare it with the reference and its
    tokenizer with ``checkpoint``'s (see the module docstring)."""
    check_target(target)
    config, params = load_checkpoint(checkpoint)
    config = config.paper_decoding()                     # the serving loops' rules (GREEDY, BEAM, CACHED_GREEDY)
    tokenizer, tokenizer_verdict = artefact_tokenizer(output_dir, config, load_tokenizer_json(checkpoint))
    src = translation_source(tokenizer, config) if tokenizer is not None else None
    src = compare_inputs(config)["src"] if src is None else src
    oracle = build_oracle(config, params, src, dtypes=("float32",))
    manifest = read_manifest(output_dir)
    has_step = target in STEPS and "decoding_step" in manifest
    with tempfile.TemporaryDirectory() as directory:
        inputs, outputs = Path(directory) / "inputs.npz", Path(directory) / "outputs.npz"
        np.savez(inputs, **oracle.inputs)     # type: ignore[arg-type]  # numpy's stub: a ** key might be allow_pickle
        script = LOADERS[target] + GREEDY + BEAM + CHECK
        script += STEPS[target] + CACHED_GREEDY + CHECK_STEP + SAVE if has_step else SAVE
        imported = run_isolated(script, output_dir, inputs, outputs, EXTRA_OUTPUT_LENGTH, BEAM_SIZE,
                                LENGTH_PENALTY_ALPHA)
        with np.load(outputs) as answers:
            results = dict(answers)
    agreement = tolerance.agreement(results["log_probs"], oracle.stages64["log_probs"],
                                    oracle.stages["float32"]["log_probs"], "float32")
    identical, note = greedy_verdict(results["tokens"], oracle, "float32", config.pad_id)
    checked = Checked(agreement, identical, note, *beam_verdict(results["beam_tokens"], config, params, src), len(src),
                      imported, tokenizer=tokenizer_verdict)
    if has_step:
        read = oracle.inputs["tgt"] != config.pad_id                      # (B, T): the positions a decoding loop reads
        step_agreement = tolerance.agreement(results["step_log_probs"][read], oracle.stages64["log_probs"][read],
                                             oracle.stages["float32"]["log_probs"][read], "float32")
        checked.step = CheckedStep(step_agreement, int(read.sum()),
                                   *greedy_verdict(results["step_tokens"], oracle, "float32", config.pad_id))
    return checked


def artefact_tokenizer(output_dir: str | os.PathLike, config: TransformerConfig, expected: str | None
                       ) -> tuple[Tokenizer | FamilyTokenizer | None, Verdict | None]:
    """The tokenizer a serving process reads from the artefact (its ``tokenizer.json``, checked against the model's
    ``config``; None if it has none or it cannot be read), and its verdict: identical if it is the checkpoint's
    (``expected``, its JSON text: the same record), else what differs -- missing, unreadable, another vocabulary;
    None if neither has a tokenizer."""
    path = Path(output_dir) / TOKENIZER_FILE
    if not path.exists():
        return None, None if expected is None else Verdict(False, "missing; the checkpoint has a tokenizer")
    try:
        text = path.read_text(encoding="utf-8")
        tokenizer = tokenizer_of(text, config)
    except (OSError, ValueError) as err:
        return None, Verdict(False, f"unreadable: {err}")
    if expected is None:
        return tokenizer, Verdict(False, "the checkpoint has no tokenizer")
    same = json.loads(text) == json.loads(expected)
    return tokenizer, Verdict(same, "the checkpoint's" if same else "another vocabulary than the checkpoint's")


def beam_verdict(tokens: np.ndarray, config: TransformerConfig, params: dict[str, np.ndarray], src: np.ndarray
                 ) -> tuple[bool, str]:
    """Whether ``tokens`` are the float64 reference's ``beam_search`` tokens (size 4, alpha 0.6) on every row the
    float32 rule compares whole: no step or final choice of the reference's search within twice the float32 bound
    (of the log-probabilities along its hypotheses) of a tie; the note counts the rows left out, or says that none
    was compared (every row with a near-tie: the report then says so instead of "identical")."""
    model64 = Transformer(config, params)
    expected = beam_search(model64, src, BEAM_SIZE, LENGTH_PENALTY_ALPHA)[0]
    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), expected[:, :-1]], axis=1)
    bound = tolerance.float32_bound(model64(src, tgt), Transformer(config, params, np.float32)(src, tgt))
    decisive = np.array([tolerance.beam_row_is_decisive(row, bound) for row in beam_margins(model64, src)])
    width = max(tokens.shape[1], expected.shape[1])
    tokens, expected = (np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=config.pad_id)
                        for a in (tokens, expected))
    left_out = len(src) - int(decisive.sum())
    if not decisive.any():
        return True, f"not compared: each of the {len(src)} rows has a near-tie"
    note = f"{left_out} of {len(src)} rows with a near-tie left out" if left_out else ""
    return bool(np.array_equal(tokens[decisive], expected[decisive])), note


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
