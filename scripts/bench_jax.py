"""Benchmark of the JAX/Flax port on this machine (a script, not a test).

* the machine's float32 matmul rate: ``transformer_bench.timing.jax_product``, a jitted ``jnp.matmul``
  (n x n by n x n, 2 n^3 FLOPs);
* the compiled forward pass of the ``base`` model (Table 3) in float32, batch 8, 128 source and
  128 target tokens: compile time, median time, achieved GFLOP/s from matmul FLOPs counted
  analytically (formula printed) and the ratio to the measured matmul rate (target >= 70%);
* greedy decoding of batch 1 with and without the key/value cache: 128 tokens, and 256 tokens
  for the cache speed-up (target >= 5x). The source has (tokens - 50) non-pad tokens, so the
  budget of section 6.1 is exactly the number of tokens; the eos row of the random model's
  shared embedding is zeroed (logit 0) so that decoding runs to the budget (checked);
* the forward pass cut after each part (encoder, decoder, output projection, log-softmax), and the
  log-softmax over (B T, V) by ``jax.nn.log_softmax`` against the port's ``log_softmax`` (the sum of exp
  as products with ones over chunks; time, and worst error against float64);
* the per-call overhead: a batch-1 forward pass of 64 source and 64 target tokens by the port's
  ``compiled_forward`` against plain ``jax.jit`` of the same function with the state split once
  (interleaved, ``transformer_bench.timing.round_robin``; target: within 10%);
* cached greedy decoding of batch 1 and batch 8 (ms per step) and beam search (beam 4, alpha 0.6)
  over 128 steps, interleaved;
* the batch-1 cached step's matrix-vector products alone (the weights it reads, in one compiled loop):
  how much of a step is reading the weights, and at what rate;
* ``from_params`` of ``base`` (the first call traces the model's structure).

The memory of loading a checkpoint is measured for every backend by ``scripts/bench_memory.py``.

Times are medians of ``--repeats`` runs after a warm-up call (the first call, which compiles,
is reported separately); uncached decoding, which is slow, runs half as often at 128 tokens and
once at 256. ``--quick`` runs a small version (for checking the script).

    flock /tmp/bench.lock python scripts/bench_jax.py
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from reference_numpy import init_params  # noqa: E402
from reference_numpy.config import TransformerConfig  # noqa: E402
from transformer_bench.timing import (  # noqa: E402
    cpu_name,
    forward_flops,
    gflop_rate,
    jax_product,
    matmul_rate,
    measure,
    read_every_step,
    round_robin,
    timed,
)
from transformer_jax import Transformer, beam_search, from_params, greedy_decode  # noqa: E402
from transformer_jax.model import log_softmax, padding_mask  # noqa: E402
from transformer_jax.speed import compiled_forward  # noqa: E402

FLOP_FORMULA = ("FLOPs = 2 x multiply-adds of every matmul:\n"
                "  encoder  N*B*S*(8D^2 + 4DF + 4SD)\n"
                "  decoder  N*B*T*(8D^2 + 4TD + 4D^2 + 4SD + 4DF) + N*B*S*4D^2   (self-attn, cross-attn Q/O,"
                " cross-attn K/V of the memory)\n"
                "  output   B*T*2DV\n"
                "  (causal attention counted in full: the masked scores are computed)")


def bench_forward(model: Transformer, batch: int, length: int, repeats: int) -> dict:
    config = model.config
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(3, config.src_vocab_size, (batch, length)))
    tgt = jnp.asarray(rng.integers(3, config.tgt_vocab_size, (batch, length))).at[:, 0].set(config.bos_id)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, src, tgt: nnx.merge(graphdef, state)(src, tgt))
    compile_s, compiled = timed(lambda: run.lower(state, src, tgt).compile())
    out = compiled(state, src, tgt)
    assert out.dtype == jnp.float32 and out.shape == (batch, length, config.tgt_vocab_size)
    seconds = measure(lambda: compiled(state, src, tgt).block_until_ready(), repeats).median
    flops = forward_flops(config, batch, length, length)
    return {"compile_s": compile_s, "seconds": seconds, "gflop": flops / 1e9, "gflops": gflop_rate(flops, seconds)}


def bench_forward_parts(model: Transformer, batch: int, length: int, repeats: int) -> dict:
    """The forward pass cut after each part, each compiled alone and timed interleaved: the encoder, the
    decoder's output, the logits (the output projection) and the whole pass (the log-softmax added)."""
    config = model.config
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(3, config.src_vocab_size, (batch, length)))
    tgt = jnp.asarray(rng.integers(3, config.tgt_vocab_size, (batch, length))).at[:, 0].set(config.bos_id)
    graphdef, state = nnx.split(model)

    def cut(part):
        def run(state):
            m = nnx.merge(graphdef, state)
            mask = padding_mask(src, config.pad_id)
            memory = m.encode(src, mask)
            if part == "encoder":
                return memory
            out = m.decode(tgt, memory, mask)
            if part == "+ decoder":
                return out
            return out @ m.src_embed.embedding[...].T if part == "+ output projection" else m(src, tgt)
        compiled = jax.jit(run)
        return lambda: compiled(state).block_until_ready()
    return round_robin({part: cut(part) for part in ("encoder", "+ decoder", "+ output projection",
                                                     "+ log-softmax")}, repeats)


def bench_log_softmax(rows: int, classes: int, repeats: int) -> dict:
    """``jax.nn.log_softmax`` over (rows, classes) float32 against the port's ``log_softmax`` (the sum of exp as
    products with ones over chunks): name -> (timing, worst absolute error against float64 NumPy)."""
    x = np.random.default_rng(4).standard_normal((rows, classes), dtype=np.float32) * 5
    exact = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(axis=-1, keepdims=True))
    forms = {"jax.nn.log_softmax": jax.jit(jax.nn.log_softmax),
             "the port's log_softmax (the sum by chunks)": jax.jit(log_softmax)}
    device_x = jnp.asarray(x)
    timings = round_robin({name: lambda f=f: f(device_x).block_until_ready() for name, f in forms.items()}, repeats)
    return {name: (timing, float(np.abs(np.asarray(timing.result) - exact).max())) for name, timing in timings.items()}


def bench_greedy(model: Transformer, tokens: int, use_cache: bool, repeats: int) -> dict:
    src = np.random.default_rng(1).integers(3, model.config.src_vocab_size, (1, tokens - 50))
    timing = measure(lambda: greedy_decode(model, src, use_cache), repeats)
    emitted = timing.result.shape[1]
    if emitted != tokens:
        raise RuntimeError(f"decoding stopped after {emitted} of {tokens} tokens")
    return {"first_s": timing.first, "seconds": timing.median, "ms_per_token": 1e3 * timing.median / tokens}


def bench_call_overhead(model: Transformer, length: int, repeats: int) -> dict:
    """Batch-1 forward pass: the port's compiled_forward and plain jax.jit with the state split once."""
    config = model.config
    rng = np.random.default_rng(2)
    src = rng.integers(3, config.src_vocab_size, (1, length))
    tgt = rng.integers(3, config.tgt_vocab_size, (1, length))
    tgt[:, 0] = config.bos_id
    graphdef, state = nnx.split(model)
    plain = jax.jit(lambda state, src, tgt: nnx.merge(graphdef, state)(src, tgt))
    src_j, tgt_j = jnp.asarray(src), jnp.asarray(tgt)
    return round_robin({"port": lambda: compiled_forward(model, src, tgt).block_until_ready(),
                        "plain": lambda: plain(state, src_j, tgt_j).block_until_ready()}, repeats)


def bench_decoding(model: Transformer, steps: int, repeats: int) -> dict:
    """Cached greedy decoding of batch 1 and 8 and beam search (beam 4, alpha 0.6), each ``steps`` steps."""
    rng = np.random.default_rng(3)
    one, eight = (rng.integers(3, model.config.src_vocab_size, (rows, steps - 50)) for rows in (1, 8))
    timings = round_robin({"greedy 1": lambda: greedy_decode(model, one),
                           "greedy 8": lambda: greedy_decode(model, eight),
                           "beam 4": lambda: beam_search(model, one, 4, 0.6)}, repeats)
    for name, timing in timings.items():
        emitted = (timing.result[0] if name == "beam 4" else timing.result).shape[1]
        if emitted != steps:
            raise RuntimeError(f"{name} stopped after {emitted} of {steps} steps")
    return timings


def bench_step_products(config: TransformerConfig, steps: int, repeats: int) -> tuple[float, float]:
    """The cached batch-1 step's matrix-vector products alone, ``steps`` times in one compiled loop (each
    step's input depends on the previous step's products, so nothing is hoisted): seeded matrices of the
    shapes a step reads once -- every decoder layer's self-attention projections, the cross-attention's
    query and output projections, the feed-forward layers, (in, out) as the port keeps them, and the
    (V, D) shared embedding as the output projection, ``x @ E^T`` as the port computes it. Returns
    (ms per step, MB read per step)."""
    params = init_params(config, dtype=np.float32)
    matrices = [jnp.asarray(value) for name, value in params.items() if value.ndim == 2 and read_every_step(name)]
    table = jnp.asarray(params["shared_embed.weight"])                                  # (V, D)

    @jax.jit
    def loop(x):
        def body(i, x):
            total = sum((x[:m.shape[0]] @ m).sum() for m in matrices) + (table @ x[:table.shape[1]]).sum()
            return x + 1e-30 * total
        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones(max(m.shape[0] for m in matrices), jnp.float32)
    seconds = measure(lambda: loop(x).block_until_ready(), repeats).median
    return seconds * 1e3 / steps, (sum(m.nbytes for m in matrices) + table.nbytes) / 1e6


def machine() -> list[str]:
    return [f"CPU: {cpu_name()}, {os.cpu_count()} logical cores visible (shared with other jobs)",
            f"JAX devices: {', '.join(str(d) for d in jax.devices())}",
            f"Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
            f"flax {flax.__version__}, numpy {np.__version__}",
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and one repeat, to check the script")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 5, quick 1)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    batch, length, short, long, n = (2, 32, 64, 96, 512) if args.quick else (8, 128, 128, 256, 2048)

    config = TransformerConfig.preset("base")
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    embedding = model.src_embed.embedding
    embedding[...] = embedding[...].at[config.eos_id].set(0.0)      # logit 0: never the argmax here

    print("\n".join(machine()))
    rate = matmul_rate(jax_product(n), n, repeats)
    print(f"\nfloat32 matmul {n}x{n} @ {n}x{n}: {rate:.1f} GFLOP/s")

    fwd = bench_forward(model, batch, length, repeats)
    print(f"\n{FLOP_FORMULA}")
    print(f"forward base float32, batch {batch} x {length} src x {length} tgt: compile {fwd['compile_s']:.2f} s, "
          f"median {fwd['seconds'] * 1e3:.1f} ms, {fwd['gflop']:.1f} GFLOP -> {fwd['gflops']:.1f} GFLOP/s = "
          f"{100 * fwd['gflops'] / rate:.0f}% of the matmul rate (target >= 70%)")

    for part, timing in bench_forward_parts(model, batch, length, repeats).items():
        print(f"forward cut after: {part}: {timing.median * 1e3:.0f} ms")
    for name, (timing, error) in bench_log_softmax(batch * length, config.tgt_vocab_size, repeats).items():
        print(f"log-softmax over ({batch * length}, {config.tgt_vocab_size}), {name}: {timing.median * 1e3:.0f} ms, "
              f"worst error against float64 {error:.1e}")

    results = {}
    for tokens in (short, long):
        for use_cache in (True, False):
            runs = repeats if use_cache else (1 if tokens == long else max(1, repeats // 2))  # uncached is slow
            r = bench_greedy(model, tokens, use_cache, runs)
            results[tokens, use_cache] = r
            print(f"greedy batch 1, {tokens} tokens, cache={use_cache}: first call {r['first_s']:.2f} s, "
                  f"median of {runs} {r['seconds']:.3f} s ({r['ms_per_token']:.2f} ms/token)")
    speedup = results[long, False]["seconds"] / results[long, True]["seconds"]
    print(f"cache speed-up at {long} tokens: {speedup:.1f}x (target >= 5x)")

    calls = bench_call_overhead(model, length // 2, 5 * repeats)
    port, plain = calls["port"].median, calls["plain"].median
    print(f"\nforward batch 1 x {length // 2} x {length // 2}: compiled_forward {port * 1e3:.1f} ms, plain jax.jit "
          f"of the split state {plain * 1e3:.1f} ms: {100 * (port / plain - 1):+.0f}% (target within 10%)")
    for name, timing in bench_decoding(model, short, repeats).items():
        per = "" if name == "beam 4" else f" ({timing.median * 1e3 / short:.2f} ms/step)"
        print(f"{name}, {short} steps: first call {timing.first:.2f} s, median {timing.median * 1e3:.0f} ms{per}")

    ms, megabytes = bench_step_products(config, short, repeats)
    print(f"the batch-1 step's matrix-vector products alone ({megabytes:.1f} MB of weights): {ms:.2f} ms/step, "
          f"{megabytes / ms:.1f} GB/s")

    params = init_params(config, dtype=np.float32)
    for turn in ("first", "second"):
        seconds, _ = timed(lambda: from_params(config, params, jnp.float32))
        print(f"from_params base float32, {turn} call: {seconds:.2f} s")


if __name__ == "__main__":
    main()
