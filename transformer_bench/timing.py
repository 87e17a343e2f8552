"""Timing, FLOP counts and the machine's anchors (its matrix-multiply rates, its memory bandwidth, the
bytes a decoding step reads): one copy for ``transformer-reference bench`` and ``compare`` and for the
per-port scripts ``scripts/bench_*.py``.

FLOPs are counted analytically, 2 per multiply-add of every matrix product (section 3 of the
paper; N layers, d_model = D, d_ff = F, source length S, target length T, batch B, target
vocabulary V), masked attention entries included (the scores are computed, then masked):

* encoder layer: the Q, K, V and output projections 4 S D^2, the scores and weighted sum
  2 S^2 D (eq. 1), the feed-forward network 2 S D F (eq. 2);
* decoder layer: the same over T positions, plus cross-attention: its Q and output projections
  2 T D^2, the memory's keys and values 2 S D^2, scores and weighted sum 2 T S D;
* output projection (the generator): T D V.

A cached decoding step (batch 1) cannot be faster than reading what it needs from memory once
(:func:`decode_step_bytes`) at the machine's measured bandwidth (:func:`memory_read`): that
quotient is the lower bound ``bench`` reports per-token times against.
"""

from __future__ import annotations

import contextlib
import importlib.util
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from equivalence import runtime
from reference_numpy import TransformerConfig


@dataclass(frozen=True)
class Timing:
    first: float     # seconds of the first (warm-up) call: includes tracing and compilation
    median: float    # median seconds of the timed calls after it
    result: object   # what the last call returned
    times: tuple[float, ...] = ()   # seconds of every timed call, in order

    @property
    def minimum(self) -> float:
        return min(self.times, default=self.median)

    @property
    def maximum(self) -> float:
        return max(self.times, default=self.median)


def timed(function: Callable[[], object]) -> tuple[float, object]:
    """Wall-clock seconds of one call of ``function``, and its result."""
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def measure(function: Callable[[], object], repeats: int, warm_up: Callable[[], object] | None = None) -> Timing:
    """Time a warm-up call (``warm_up``, by default ``function`` itself), then ``repeats`` calls of
    ``function``. ``function`` must return only when its work is done: a framework that computes
    asynchronously blocks on the result inside it."""
    first, result = timed(warm_up or function)
    times = []
    for _ in range(repeats):
        seconds, result = timed(function)
        times.append(seconds)
    return Timing(first, statistics.median(times), result, tuple(times))


Key = TypeVar("Key", bound=Hashable)


def round_robin(calls: dict[Key, Callable[[], object]], repeats: int | dict[Key, int],
                progress: Callable[[list], Iterable] | None = None) -> dict[Key, Timing]:
    """Time every call of ``calls`` interleaved: a warm-up round (each call once, in order: its tracing
    and compilation), then rounds in which every call runs once, in turn, ``repeats`` rounds (one number
    for every call, or one per key), so that whatever else the machine does falls on every call alike.
    ``progress`` wraps the list of (round, key) calls (a progress bar)."""
    counts = {key: repeats[key] if isinstance(repeats, dict) else repeats for key in calls}
    schedule = [(turn, key) for turn in range(max(counts.values(), default=0) + 1) for key in calls
                if turn <= counts[key]]
    first, times, results = {}, defaultdict(list), {}
    for turn, key in (progress(schedule) if progress else schedule):
        seconds, results[key] = timed(calls[key])
        if turn == 0:
            first[key] = seconds
        else:
            times[key].append(seconds)
    return {key: Timing(first[key], statistics.median(times[key]), results[key], tuple(times[key])) for key in calls}


def gflop_rate(flops: float, seconds: float) -> float:
    """Achieved rate in GFLOP/s."""
    return flops / seconds / 1e9


def matmul_rate(product: Callable[[], object], size: int, repeats: int) -> float:
    """This machine's rate in GFLOP/s for ``product``, one blocking float32 (size x size) @
    (size x size) matrix product of 2 size^3 FLOPs: the median of ``repeats`` calls after a warm-up."""
    return gflop_rate(2 * size ** 3, measure(product, repeats).median)


def numpy_product(size: int) -> Callable[[], object]:
    """One seeded float32 (size x size) @ (size x size) product in NumPy, for :func:`matmul_rate`."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    return lambda: a @ b


def torch_product(size: int) -> Callable[[], object]:
    """The same product as :func:`numpy_product` with ``torch.matmul`` (CPU, synchronous)."""
    import torch
    a, b = (torch.from_numpy(m) for m in _matrices(size))
    return lambda: torch.matmul(a, b)


def jax_product(size: int) -> Callable[[], object]:
    """The same product as :func:`numpy_product` with ``jax.numpy.matmul`` under ``jax.jit`` (XLA), blocking on
    the result."""
    import jax
    a, b = (jax.device_put(m) for m in _matrices(size))
    product = jax.jit(jax.numpy.matmul)
    return lambda: product(a, b).block_until_ready()


def tf_product(size: int) -> Callable[[], object]:
    """The same product as :func:`numpy_product` with ``tf.linalg.matmul`` (eager), blocking on one entry of
    the result."""
    tf = runtime.import_framework("tensorflow")          # its start-up notices held, as every command's
    a, b = (tf.constant(m) for m in _matrices(size))
    return lambda: tf.linalg.matmul(a, b)[0, 0].numpy()


def _matrices(size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((size, size), dtype=np.float32), rng.standard_normal((size, size), dtype=np.float32)


# framework -> (the module that must be installed, its product)
PRODUCTS = {"numpy": ("numpy", numpy_product), "torch": ("torch", torch_product), "jax": ("jax", jax_product),
            "tf": ("tensorflow", tf_product)}


def gemm_products(size: int) -> dict[str, Callable[[], object]]:
    """Every installed framework's blocking float32 (size x size) @ (size x size) product, framework -> call
    (2 size^3 FLOPs each)."""
    return {name: product(size) for name, (module, product) in PRODUCTS.items()
            if importlib.util.find_spec(module) is not None}


BANDWIDTH_OPERATION = "NumPy float32 matrix-vector product (BLAS sgemv), reading a {mib} MiB matrix once"


def memory_read(mebibytes: int) -> tuple[Callable[[], object], int]:
    """A call that reads ``mebibytes`` MiB from memory once, and its byte count: a NumPy float32 matrix-vector
    product over a (n, 512) matrix far larger than any cache -- the access of a decoding step's weights
    (:data:`BANDWIDTH_OPERATION`). Bytes over its time is the machine's memory bandwidth."""
    rows = mebibytes * 2 ** 20 // (4 * 512)
    matrix = np.random.default_rng(0).standard_normal((rows, 512), dtype=np.float32)
    vector = np.ones(512, dtype=np.float32)
    return lambda: matrix @ vector, matrix.nbytes


def decode_step_bytes(config: TransformerConfig, batch: int, src_len: int, steps: int, itemsize: int = 4) -> float:
    """Bytes a cached decoding step reads, on average over ``steps`` steps of ``batch`` rows: the weights it
    uses, once for the whole batch -- in every decoder layer the self-attention's four projections, the
    cross-attention's query and output projections (its keys and values are the memory's, projected once),
    the feed-forward network and the three LayerNorms; pre-LN's final LayerNorm; the output projection
    (D x V) -- and per row the
    caches it attends over: the self-attention keys and values of t positions at step t, and the memory's
    keys and values (``src_len`` positions). ``itemsize``: bytes per number of the model's dtype (4: float32; 2:
    bfloat16 and float16, whose weights and caches are stored in P)."""
    d, f = config.d_model, config.d_ff
    layer = 6 * d * d + 2 * d * f + (6 * d + f + d) + 6 * d          # matrices, their biases, three LayerNorms
    weights = config.n_decoder_layers * layer + 2 * d * config.norm_first + d * config.tgt_vocab_size
    caches = batch * config.n_decoder_layers * 2 * d * ((steps + 1) / 2 + src_len)
    return itemsize * (weights + caches)


def read_every_step(name: str) -> bool:
    """Whether a cached decoding step reads the weight at ``name`` -- a checkpoint name or a port's path
    to the weight, parts separated by ``.`` or ``/``: every decoder weight but the encoder-decoder
    attention's key and value projections, applied to the memory once per sentence (the weights
    :func:`decode_step_bytes` counts, the output projection aside)."""
    parts = set(name.replace("/", ".").split("."))
    return "decoder" in parts and not ("cross_attn" in parts and parts & {"k_proj", "v_proj"})


def layer_macs(config: TransformerConfig, queries: int, keys: int, memory: int | None = None) -> int:
    """Multiply-adds of one layer for ``queries`` new positions attending to ``keys`` positions;
    a decoder layer (``memory`` source positions) adds cross-attention, the memory's keys and
    values included."""
    d, f = config.d_model, config.d_ff
    macs = queries * (4 * d * d + 2 * d * f) + 2 * queries * keys * d
    if memory is not None:
        macs += queries * 2 * d * d + 2 * memory * d * d + 2 * queries * memory * d
    return macs


def encode_flops(config: TransformerConfig, batch: int, src_len: int) -> int:
    """The encoder stack over ``src_len`` positions."""
    return 2 * batch * config.n_encoder_layers * layer_macs(config, src_len, src_len)


def forward_flops(config: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> int:
    """Encoder, decoder and output projection over every position (attention over full T x T)."""
    decoder = config.n_decoder_layers * layer_macs(config, tgt_len, tgt_len, src_len)
    generator = tgt_len * config.d_model * config.tgt_vocab_size
    return encode_flops(config, batch, src_len) + 2 * batch * (decoder + generator)


def decode_flops(config: TransformerConfig, batch: int, src_len: int, steps: int, cached: bool) -> int:
    """The decoder and output projection of ``steps`` greedy steps over an encoded source of
    ``src_len`` positions (add :func:`encode_flops` for the encoder pass): step t computes one new
    position over t cached keys (``cached``; the memory's keys and values once, before the first
    step) or all t positions again (uncached; the memory's keys and values every step); logits for
    the newest position only."""
    d, v = config.d_model, config.tgt_vocab_size
    memory_keys_values = 2 * src_len * d * d
    macs = config.n_decoder_layers * memory_keys_values if cached else 0
    for t in range(1, steps + 1):
        layer = layer_macs(config, 1, t, src_len) - memory_keys_values if cached else layer_macs(config, t, t, src_len)
        macs += config.n_decoder_layers * layer + d * v
    return 2 * batch * macs


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux, else what :mod:`platform` knows)."""
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine() or "unknown"


BENCH_LOCK = "/tmp/bench.lock"


@contextlib.contextmanager
def bench_lock(path: str = BENCH_LOCK) -> Iterator[None]:
    """Hold ``path`` exclusively while timing, so that benchmark scripts sharing the machine do not overlap
    (``fcntl``: POSIX)."""
    import fcntl
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
