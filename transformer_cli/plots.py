"""Pictures: the positional-encoding table (section 3.5), attention weights (one backend or all side by side) and
``bench``'s timings."""

from __future__ import annotations

import os
import textwrap

import numpy as np

from reference_numpy import sinusoidal_positional_encoding
from transformer_bench.bench import FORWARD, BenchReport
from transformer_cli.extras import require

TITLE_CHARACTERS_PER_INCH = 11      # of a "medium" (10 pt) title: a longer one is wrapped to the figure's width


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (files only, no screen needed)."""
    require("matplotlib", "drawing a picture").use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_positional_encoding(length: int, d_model: int, path: str | os.PathLike) -> None:
    """Heat maps of PE(pos, 2i) = sin and PE(pos, 2i+1) = cos side by side (the table stores them
    interleaved: column 2i is sin, column 2i+1 cos)."""
    if length < 1 or d_model < 2 or d_model % 2:
        raise ValueError(f"length must be >= 1 and d_model even and >= 2, got {length} and {d_model}")
    plt = pyplot()
    table = sinusoidal_positional_encoding(length, d_model)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True, constrained_layout=True)
    for ax, columns, name in ((axes[0], table[:, 0::2], "sin: PE(pos, 2i)"),
                              (axes[1], table[:, 1::2], "cos: PE(pos, 2i+1)")):
        image = ax.imshow(columns, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
        ax.set_title(name)
        ax.set_xlabel("i (frequency index; wavelength 2*pi * 10000^(2i/d_model))")
    axes[0].set_ylabel("position")
    fig.colorbar(image, ax=axes.tolist(), label="value")
    fig.suptitle(f"Sinusoidal positional encoding, d_model = {d_model} (section 3.5)")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_attention(weights: dict[str, np.ndarray], query_tokens: list[str], key_tokens: list[str],
                   title: str, path: str | os.PathLike) -> None:
    """One heat map per backend, side by side; ``weights`` maps a label to a (Tq, Tk) matrix."""
    plt = pyplot()
    width = 3.2 * len(weights) + 1                      # inches
    fig, axes = plt.subplots(1, len(weights), figsize=(width, 3.6), squeeze=False, constrained_layout=True)
    for ax, (label, matrix) in zip(axes[0], weights.items()):
        image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(label, fontsize="small")
        ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize="x-small")
        ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize="x-small")
        ax.set_xlabel("key")
    axes[0][0].set_ylabel("query")
    fig.colorbar(image, ax=axes[0].tolist(), label="attention weight", shrink=0.8)
    fig.suptitle(textwrap.fill(title, int(width * TITLE_CHARACTERS_PER_INCH)), fontsize="medium")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bench(report: BenchReport, path: str | os.PathLike) -> None:
    """Two bar charts: forward GFLOP/s per engine against the best GEMM rate, and milliseconds per decoding
    step of each decoding task (log scale) against the batch-1 bandwidth bound."""
    plt = pyplot()
    names = list(dict.fromkeys(m.backend for m in report.measurements))
    find = {(m.backend, m.task): m for m in report.measurements}
    tasks = [task for task in dict.fromkeys(m.task for m in report.measurements) if task != FORWARD]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    left.bar(names, [find[(n, FORWARD)].gflops if (n, FORWARD) in find else np.nan for n in names], color="tab:blue")
    best, rate = report.anchors.best_gemm
    left.axhline(rate, color="black", linestyle="--", label=f"best float32 GEMM rate ({best})")
    left.set_ylabel("achieved GFLOP/s")
    left.set_title(f"forward, batch {report.shapes['batch']} x {report.shapes['src_len']} x {report.shapes['tgt_len']}")
    left.legend(fontsize="small", loc="lower right")
    left.set_xticks(range(len(names)), names, rotation=25, ha="right")
    width = 0.8 / max(1, len(tasks))
    for i, task in enumerate(tasks):
        per_step = [1e3 * find[(n, task)].unit_seconds if (n, task) in find else np.nan for n in names]
        right.bar(np.arange(len(names)) + (i - (len(tasks) - 1) / 2) * width, per_step, width, label=task)
    if tasks:
        right.axhline(1e3 * report.anchors.bound_seconds(tasks[0]), color="black", linestyle="--",
                      label="batch-1 bandwidth bound")
    right.set_xticks(range(len(names)), names, rotation=25, ha="right")
    right.set_yscale("log")                                     # cached steps and prefix-recomputing loops alike
    right.set_ylabel("ms per decoding step (log scale)")
    right.set_title(f"decoding, {report.shapes['decode_tokens']} tokens")
    right.legend(fontsize="small")
    fig.suptitle(f"{report.model}, {report.shapes['dtype']} ({report.machine['cpu']}, "
                 f"{report.machine['cores']} cores)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
