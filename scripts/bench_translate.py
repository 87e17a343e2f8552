"""Translating a file: the shipped English-to-French model on the sentences of its test split (812), beam search
(4, alpha 0.6), sentences of similar length decoded together, in each backend (float32, ``translate``'s own
``Translator``) and in CTranslate2 (``Translator.translate_batch`` on the model ``export --to ctranslate2`` writes,
with its BPE vocabulary): output tokens per second, side by side in one run.

Each engine runs in a process of its own (a fresh import, ``--threads`` intra-op threads in every framework), one
after the other under /tmp/bench.lock. In each process the first pass over the sentences is timed apart (JAX and
TensorFlow compile each new batch shape there, and so does ``torch-compiled``, the PyTorch backend with
``transformer_torch.compile_decoding``, its decoding step), then ``--repeats`` warm passes; the table gives the
first pass, the median warm pass, output tokens per second (every emitted token, eos included) over the warm
median, its ratio to CTranslate2's time, and how many translations are the same text as CTranslate2's (its beam
search divides by |Y|^alpha, not by GNMT's penalty, so a few may differ: docs/peers.md).

    python scripts/bench_translate.py [--sentences N] [--batch-size 64] [--threads 1] [--repeats 3]
                                      [--engines torch,torch-compiled,jax,tf,ctranslate2] [--json FILE]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA  # noqa: E402
from transformer_cli import runtime  # noqa: E402
from transformer_cli.commands.translate import BATCH_SIZE  # noqa: E402
from transformer_cli.tasks.numbers import NumbersTask, english  # noqa: E402

LOCK = "/tmp/bench.lock"
ENGINES = ("torch", "torch-compiled", "jax", "tf", "ctranslate2")
PEER = "ctranslate2"
COMPILED = "torch-compiled"    # the PyTorch backend's Translator with transformer_torch.compile_decoding


def sentences(count: int | None) -> list[str]:
    """``count`` English sentences of the shipped model's test split (all 812 by default), in a seeded order."""
    numbers = NumbersTask().split.held_out("test")
    count = len(numbers) if count is None else count
    if not 1 <= count <= len(numbers):
        raise SystemExit(f"--sentences: the test split holds {len(numbers)} sentences; {count} were asked for")
    return [english(int(n)) for n in np.random.default_rng(0).permutation(numbers)[:count]]


def by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices in batches of ``batch_size``, shortest first (as ``Translator.decode_all`` orders them)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def port_passes(name: str, texts: list[str], batch_size: int, repeats: int) -> tuple[list[float], int, list[str]]:
    """Seconds of each pass of one backend's ``Translator`` over ``texts``, output tokens, translations
    (:data:`COMPILED`: PyTorch's, its model given to ``compile_decoding``)."""
    from transformer_cli import backends
    from transformer_cli.commands.translate import translator

    backend = "torch" if name == COMPILED else name
    adapters, _ = backends.load((backend,))
    engine = translator(adapters[backend], None, "float32", BEAM_SIZE, LENGTH_PENALTY_ALPHA, "cpu", batch_size)
    if name == COMPILED:
        from transformer_torch import compile_decoding

        compile_decoding(engine.model)
    rows, pad_id = [engine.encode(text) for text in texts], engine.tokenizer.config.pad_id
    seconds, outputs = [], []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        outputs = engine.decode_all(rows)
        seconds.append(time.perf_counter() - start)
    tokens = sum(int(np.sum(np.asarray(ids) != pad_id)) for ids in outputs)
    return seconds, tokens, [engine.tokenizer.decode(ids) for ids in outputs]


def peer_passes(texts: list[str], batch_size: int, repeats: int) -> tuple[list[float], int, list[str]]:
    """The same for CTranslate2's ``translate_batch`` on the exported model, same batches, same budget."""
    import ctranslate2
    import tokenizers

    from transformer_cli.commands.ctranslate2_export import save_ctranslate2, translate_options
    from transformer_cli.commands.translate import load_translator

    config, params, tokenizer = load_translator()
    with tempfile.TemporaryDirectory() as directory:
        path = save_ctranslate2(config, params, Path(directory) / "model", tokenizer=tokenizer.to_json())
        engine = ctranslate2.Translator(str(path), device="cpu", compute_type="float32",
                                        intra_threads=runtime.threads())
    library = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    sources = [library.encode(text, add_special_tokens=False).tokens for text in texts]
    options = translate_options(config.max_len, BEAM_SIZE, LENGTH_PENALTY_ALPHA)
    seconds, pieces = [], [[] for _ in texts]
    for _ in range(1 + repeats):
        start = time.perf_counter()
        for batch in by_length([len(source) for source in sources], batch_size):
            for i, result in zip(batch, engine.translate_batch([sources[i] for i in batch], **options)):
                pieces[i] = result.hypotheses[0]
        seconds.append(time.perf_counter() - start)
    eos = config.eos_id

    def text(row: list[str]) -> str:
        ids = [library.token_to_id(piece) for piece in row]
        return tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids)

    return seconds, sum(len(row) for row in pieces), [text(row) for row in pieces]


def worker(args: argparse.Namespace) -> None:
    runtime.configure(args.threads)
    texts = sentences(args.sentences)
    if args.worker == PEER:
        seconds, tokens, translations = peer_passes(texts, args.batch_size, args.repeats)
    else:
        seconds, tokens, translations = port_passes(args.worker, texts, args.batch_size, args.repeats)
    print(json.dumps({"seconds": seconds, "tokens": tokens, "translations": translations}))


def run(engine: str, args: argparse.Namespace) -> dict:
    sentences_option = ["--sentences", str(args.sentences)] if args.sentences else []
    command = [sys.executable, __file__, "--worker", engine, *sentences_option, "--batch-size", str(args.batch_size),
               "--threads", str(args.threads), "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{engine}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'failed'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict]) -> list[dict]:
    """One row per engine: first pass, warm median, tokens/s, ratio to CTranslate2, translations equal to its."""
    peer = results.get(PEER)
    rows = []
    for engine, result in results.items():
        warm = statistics.median(result["seconds"][1:])
        rows.append({"engine": engine, "first_s": result["seconds"][0], "warm_s": warm,
                     "tokens_per_s": result["tokens"] / warm,
                     "ratio": warm / statistics.median(peer["seconds"][1:]) if peer else None,
                     "same_as_peer": (sum(a == b for a, b in zip(result["translations"], peer["translations"]))
                                      if peer else None)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, help="how many of the test split's sentences (default: all 812)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    engines = [engine for engine in args.engines.split(",") if engine]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = {engine: run(engine, args) for engine in engines}
    rows = report(results)
    count = len(sentences(args.sentences))
    print(f"{count} sentences, beam {BEAM_SIZE}, batches of {args.batch_size} by length, "
          f"{args.threads} thread(s), median of {args.repeats} warm passes")
    print(f"{'engine':<15} {'first pass':>11} {'warm':>9} {'tokens/s':>9} {'x CT2':>6} {'same text as CT2':>17}")
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        same = "" if row["same_as_peer"] is None else f"{row['same_as_peer']}/{count}"
        print(f"{row['engine']:<15} {row['first_s']:>10.2f}s {row['warm_s']:>8.2f}s {row['tokens_per_s']:>9.0f} "
              f"{ratio:>6} {same:>17}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
