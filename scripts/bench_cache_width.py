"""What a large budget costs a search whose sentences stop early: each port's beam search over the same batch and
the same steps, with self-attention caches of the budget's size and of the steps' (docs/benchmarks.md, "The
budget and the cache: what a step reads").

An imported opus-mt model decodes with a budget of 511 tokens (its ``max_length``), so its searches hold caches of
511 positions, while a sentence ends after a few dozen. The random opus-mt-shaped model of
``scripts/bench_translate.py`` never emits eos, so its budget decides how many steps run: here the budget stays at
``--steps`` and the caches are made ``--capacity`` positions (the model's ``init_cache`` asked for that many), the
steps and tokens unchanged -- what a budget of ``--capacity`` costs a search that stops at ``--steps``. Each port in
a process of its own, one thread by default, the first pass apart, then the best of ``--repeats`` warm passes.

    python scripts/bench_cache_width.py                       # torch, jax, tf; capacities 32 and 511; 16 rows
    python scripts/bench_cache_width.py --ports torch-compiled   # PyTorch's step under compile_decoding
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_translate  # noqa: E402

from equivalence import runtime  # noqa: E402


def passes(port: str, root: Path, steps: int, capacity: int, rows: int, repeats: int) -> list[float]:
    """Seconds of the first and each warm beam search (beam 4) of ``port`` over ``rows`` source rows, the
    checkpoint's budget ``steps`` tokens, caches of ``capacity`` positions."""
    from reference_numpy import load_checkpoint, save_checkpoint
    from reference_numpy.tokenizer import pad_rows

    config, params = load_checkpoint(root / "model.safetensors")
    path = root / f"model-{steps}-{capacity}.safetensors"
    config = config.replace(max_len=max(capacity, steps + 1)).with_decoding(max_output_length=steps)
    save_checkpoint(path, config, params)
    if port in ("torch", "torch-compiled"):
        import torch

        import transformer_torch as package
        model = package.load_checkpoint(path, dtype=torch.float32)
        if port == "torch-compiled":
            package.compile_decoding(model)
    else:
        package = __import__(f"transformer_{port}")
        model = package.load_checkpoint(path, dtype="float32")
    init_cache = type(model).init_cache
    type(model).init_cache = lambda self, memory, _: init_cache(self, memory, capacity)   # type: ignore[method-assign]
    src = pad_rows(bench_translate.source_rows(rows, bench_translate.OPUS_MT), config.pad_id)
    return bench_translate.passes(lambda: package.beam_search(model, src, beam_size=4), repeats)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", default="torch,jax,tf")
    parser.add_argument("--capacities", default="32,511", help="comma-separated cache sizes")
    parser.add_argument("--steps", type=int, default=32, help="the budget: every sentence's steps")
    parser.add_argument("--rows", type=int, default=16, help="source rows, decoded as one batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)      # port, capacity, model directory
    args = parser.parse_args()
    if args.worker:
        runtime.configure(args.threads)
        port, capacity, root = args.worker
        print(json.dumps(passes(port, Path(root), args.steps, int(capacity), args.rows, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        bench_translate.save_opus_mt(root, bench_translate.OPUS_MT)
        print(f"beam 4, {args.rows} rows of the opus-mt-shaped model, {args.steps} steps, {args.threads} thread(s); "
              f"seconds: first pass, best warm pass")
        for port in args.ports.split(","):
            for capacity in map(int, args.capacities.split(",")):
                done = subprocess.run([sys.executable, __file__, "--worker", port, str(capacity), str(root),
                                       "--steps", str(args.steps), "--rows", str(args.rows), "--threads",
                                       str(args.threads), "--repeats", str(args.repeats)],
                                      capture_output=True, text=True, check=True)
                first, *warm = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{port:<6} capacity {capacity:>5}: first {first:6.2f} s  warm {min(warm):6.2f} s", flush=True)


if __name__ == "__main__":
    main()
