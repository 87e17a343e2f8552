"""Memory of loading a checkpoint, every installed backend side by side: the resident set (RSS) of a fresh process
after importing the backend's framework, after ``adapter.load`` of the checkpoint, and after one forward pass, and
the process's peak, each as a multiple of the weights' bytes.

The target: loading never holds two copies of the weights, i.e. RSS after loading, and its peak while loading, <=
the framework's own import footprint + 1.15 x the weights. Each backend runs in its own process (a framework's
allocator keeps what it freed); the checkpoint is the seeded ``big`` preset in float32 (857 MB) unless
``--checkpoint`` names another.

A file mapped into the process (as safetensors' reader maps it) counts in the RSS until it is closed, though its
pages are page cache, not a copy the process owns; the checkpoint reader
(``reference_numpy.checkpoint.CheckpointReader``) therefore reads each tensor's bytes itself, straight into the
memory the backend's framework keeps. The anonymous memory (``RssAnon``, what the process itself allocated) is
reported beside the RSS. The peak is the process's own (``ru_maxrss``), import included, so it can only overstate
loading's. The exit status is 1 if a backend misses the target, held or peak.

``--resume`` measures resuming a run instead: a ``big`` training checkpoint (weights and Adam's two moments, 2.5 GB),
and in each port's fresh process ``checkpoint.load_checkpoint``, ``checkpoint.load_training_state`` and
``training.optimizer(model, state=state)``, as multiples of the weights' and moments' bytes together (the target:
each moment held once, as the weights are).

``--cli`` measures the command line's resume on that file, in every backend: ``train --resume RUN`` planned
(``train.plan_from``: the run's header only) and set up as ``train`` sets it up (``train.set_up``: the backend's
``load`` and ``load_training_state``, then its optimizer), before any step (a copy task sized to the model's
vocabulary, whose batches are never drawn).

    python scripts/bench_memory.py [--backends numpy,torch,jax,tf] [--checkpoint FILE] [--resume | --cli]

The runs hold an exclusive lock on /tmp/bench.lock, as the other benchmark scripts do.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import backends  # noqa: E402

LOCK = "/tmp/bench.lock"
TARGET = 1.15   # RSS after loading - import footprint, in weights
FORWARD_SHAPE = (1, 16)   # a short batch-1 forward: what a model must do right after loading

# Run in a fresh process per backend: prints one JSON line of /proc/self/status readings in MiB.
PROBE = """
import json, resource, sys
import numpy as np
sys.path.insert(0, {root!r})
def status():
    fields = {{}}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields
from equivalence import backends
adapters, _ = backends.load(({name!r},))
adapter = adapters[{name!r}]
adapter.devices()
imported = status()
model = adapter.load({path!r}, dtype="float32")
loaded = status()
peak_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
tokens = np.full({shape!r}, 3)
adapter.forward(model, tokens, tokens)
ran = status()
print(json.dumps({{"imported": imported, "loaded": loaded, "ran": ran, "peak_after_load": peak_after_load,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""

# The resume case, in a port's fresh process: the same readings around loading the run (weights, state, optimizer).
RESUME = PROBE.split("from equivalence import backends")[0] + """
import importlib
checkpoint = importlib.import_module({package!r} + ".checkpoint")
training = importlib.import_module({package!r} + ".training")
imported = status()
model = checkpoint.load_checkpoint({path!r}, dtype="float32")
state = checkpoint.load_training_state({path!r})
optimizer = training.optimizer(model, state=state)
loaded = status()
peak_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"imported": imported, "loaded": loaded, "peak_after_load": peak_after_load}}))
"""
# The command line's resume (``--cli``), in a backend's fresh process: ``train --resume`` planned and set up.
CLI = PROBE.split("from equivalence import backends")[0] + """
from equivalence import backends
from transformer_cli.commands import train
from transformer_cli.main import build_parser
adapters, _ = backends.load(({name!r},))
adapter = adapters[{name!r}]
adapter.devices()
imported = status()
plan = train.plan_from(build_parser().parse_args(
    ["train", "--backends", {name!r}, "--resume", {path!r}, "--symbols", {symbols!r}, "--max-length", "4",
     "--batch-size", "2", "--steps", "1", "--eval-size", "0"]))
model, optimizer = train.set_up(adapter, plan)
loaded = status()
peak_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"imported": imported, "loaded": loaded, "peak_after_load": peak_after_load}}))
"""
PACKAGES = {"torch": "transformer_torch", "jax": "transformer_jax", "tf": "transformer_tf"}


def big_checkpoint(directory: str, resume: bool = False) -> Path:
    """The seeded ``big`` preset in float32, written into ``directory``; ``resume``, with a training state (Adam's
    moments: the weights scaled by 1e-3, and their squares)."""
    from reference_numpy import TrainingConfig, TransformerConfig, init_params, save_checkpoint
    from reference_numpy.checkpoint import TrainingState
    config = TransformerConfig.preset("big")
    path = Path(directory) / f"big-float32{'-run' if resume else ''}.safetensors"
    params = init_params(config, seed=0, dtype=np.float32)
    state = None
    if resume:
        state = TrainingState(TrainingConfig(), 10, {name: value * np.float32(1e-3) for name, value in params.items()},
                              {name: np.square(value) for name, value in params.items()})
    save_checkpoint(path, config, params, state)
    return path


def held_mib(path: Path, resume: bool) -> float:
    """The weights' bytes (``resume``: with both moments') in MiB."""
    from reference_numpy.checkpoint import load_run
    _, params, state = load_run(path)
    moments = [] if not resume or state is None else [*state.first_moments.values(), *state.second_moments.values()]
    return sum(value.nbytes for value in [*params.values(), *moments]) / 2 ** 20


def probe(name: str, path: Path, resume: bool = False, cli: bool = False) -> dict:
    from reference_numpy.checkpoint import CheckpointReader
    symbols = str(CheckpointReader(path).config.src_vocab_size - 3) if cli else ""    # the copy task's vocabulary
    code = (CLI if cli else RESUME if resume else PROBE).format(
        root=str(Path(__file__).resolve().parents[1]), name=name, path=str(path), shape=FORWARD_SHAPE,
        package=PACKAGES.get(name), symbols=symbols)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(name: str, reading: dict, weights: float) -> tuple[str, bool]:
    """The backend's line of the table, and whether it meets the target (held and peak)."""
    base = reading["imported"]["VmRSS"]
    held = (reading["loaded"]["VmRSS"] - base) / weights
    anon = (reading["loaded"]["RssAnon"] - reading["imported"]["RssAnon"]) / weights
    peak = (reading["peak_after_load"] - base) / weights
    ran = f"{(reading['ran']['VmRSS'] - base) / weights:>10.2f}x" if "ran" in reading else f"{'-':>11}"  # resume: none
    verdict = lambda value: "met" if value <= TARGET else "not met"
    return (f"{name:<7}{base:>9.0f}{reading['loaded']['VmRSS']:>10.0f}{held:>9.2f}x{anon:>9.2f}x{peak:>9.2f}x"
            f"{ran}   held {verdict(held)}, peak {verdict(peak)}", max(held, peak) <= TARGET)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(backends.BACKENDS))
    parser.add_argument("--checkpoint", type=Path, help="a float32 checkpoint (default: the seeded big preset)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--resume", action="store_true",
                       help="resume a run: weights, Adam's moments and the optimizer (the ports only)")
    modes.add_argument("--cli", action="store_true",
                       help="the command line's resume: `train --resume RUN` planned and set up, every backend")
    args = parser.parse_args()
    names = tuple(name for name in args.backends.split(",") if not args.resume or name in PACKAGES)
    args.resume = args.resume or args.cli                       # a run (weights and moments) is what is read
    held = "weights + moments" if args.resume else "weights"
    with tempfile.TemporaryDirectory() as directory, open(LOCK, "w") as lock:
        path = args.checkpoint or big_checkpoint(directory, args.resume)
        weights = held_mib(path, args.resume)
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"checkpoint {path.name}: {held} {weights:.0f} MiB (float32); target: loaded - imported and peak - "
              f"imported <= {TARGET} x that")
        print(f"{'backend':<7}{'imported':>9}{'loaded':>10}{'held':>10}{'anon':>10}{'peak':>10}{'+forward':>11}")
        print(f"{'':<7}{'MiB':>9}{'MiB':>10}{'x':>10}{'x':>10}{'x':>10}{'x':>11}")
        missed = []
        for name in names:
            line, met = row(name, probe(name, path, args.resume, args.cli), weights)
            print(line, flush=True)
            missed += [] if met else [name]
    if missed:
        sys.exit(f"target not met by {', '.join(missed)}")


if __name__ == "__main__":
    main()
