"""Human-readable output of ``compare``: one table and a plot of error per stage."""

from __future__ import annotations

import os

import numpy as np

from equivalence import tolerance
from reference_numpy.precision import is_low, parse_precision
from transformer_bench.compare import Report
from transformer_cli.plots import pyplot

STAGE_WIDTH, CELL_WIDTH = 18, 21


def _cell(text: str) -> str:
    return f"{text:>{CELL_WIDTH}}"


def format_table(report: Report) -> str:
    """Rows are stages (in the order the data flows), columns are backend/device/dtype runs.

    Each stage cell shows "max abs / max rel" error against the float64 reference, or "nan in
    output" / "inf in output" when the backend's output there is not finite; a "!" marks an error
    above the bound, a "+" the error a stage adds to its inputs' (over the bound in total, within it in what it
    adds: :func:`equivalence.tolerance.stage_agreement`). Footer rows: worst error/bound, first stage over the
    bound, first non-finite stage, greedy tokens identical, forward time.
    """
    runs = report.runs
    stages = list(next((run.stages for run in runs if run.stages), []))
    lines = [f"checkpoint: {report.source}",
             f"policy: float64 error <= {tolerance.FLOAT64_RELATIVE:g} x max(1, max|ref|); float32 error <= "
             f"{tolerance.FLOAT32_FACTOR} x max(float32 reference's own error, 1 ulp)"
             + (f"; bfloat16, float16 error <= {tolerance.LOW_PRECISION_FACTOR} x max(the reference's own error in "
                "that format or recipe, 1 unit)" if any(_low(run.dtype) for run in runs) else "")
             + "; cells: max abs / max rel against the float64 reference",
             "",
             f"{'stage':<{STAGE_WIDTH}}" + "".join(_cell(run.label) for run in runs)]
    for index, stage in enumerate(stages):
        cells = []
        for run in runs:
            if index >= len(run.stages):
                cells.append(_cell("-"))
                continue
            result = run.stages[index]
            mark = "!" if not result.ok else "+" if result.added else " "
            error = f"{result.non_finite} in output" if result.non_finite else \
                f"{result.max_abs_error:.1e} / {result.max_relative_error:.1e}"
            cells.append(_cell(error + mark))
        lines.append(f"{stage.stage:<{STAGE_WIDTH}}" + "".join(cells))
    lines.append("")
    footer = {
        "worst error/bound": lambda run: f"{np.max([s.max_abs_error / s.bound for s in run.stages]):.3f}"
        if run.stages else "-",                                              # NaN wins: np.max propagates it
        "first over bound": lambda run: run.first_failing_stage or "-",
        "first non-finite": lambda run: run.first_non_finite_stage or "-",
        "greedy identical": lambda run: "-" if run.greedy_identical is None else
        ("yes" + ("*" if run.greedy_note else "") if run.greedy_identical else "NO"),
        "forward ms": lambda run: "-" if run.forward_ms is None else f"{run.forward_ms:.1f}",
        "forward path": lambda run: run.forward_path or "-",
        "status": lambda run: "ok" if run.ok else ("ERROR" if run.error else "FAILED"),
    }
    for name, describe in footer.items():
        lines.append(f"{name:<{STAGE_WIDTH}}" + "".join(_cell(describe(run)) for run in runs))
    notes = [f"{run.label}: {run.error}" for run in runs if run.error]
    notes += [f"{run.label}: + at {', '.join(stage.stage for stage in run.stages if stage.added)}: the error the "
              "stage adds to its inputs', within the bound (their error, within their own bounds, carried further "
              "than the reference's own: docs/equivalence.md)" for run in runs
              if any(stage.added for stage in run.stages)]
    notes += [f"{run.label}: {'*' if run.greedy_identical else 'greedy tokens:'} {run.greedy_note}" for run in runs
              if run.greedy_note]
    notes += [f"{missing.name}: {missing.reason}" for missing in report.missing]
    failing = [f"{run.label} first exceeds its bound at {run.first_failing_stage}" for run in runs
               if run.first_failing_stage]
    failing += [f"{run.label} first gives non-finite values (NaN or inf) at {run.first_non_finite_stage}"
                for run in runs if run.first_non_finite_stage]
    lines += [""] + notes + failing if notes or failing else []
    lines += format_translations(report)
    lines.append("")
    lines.append("all backends agree with the reference" if report.ok else "SOME BACKENDS DISAGREE (see above)")
    return "\n".join(lines)


def format_translations(report: Report) -> list[str]:
    """Each source sentence, the float64 reference's greedy translation, and how many runs wrote the same text;
    a run that wrote something else is shown with its text and the reason it is (or is not) allowed."""
    if not report.translations:
        return []
    translated = [(run, run.translations) for run in report.runs if run.translations is not None]
    lines = ["", "translations (greedy decoding, section 6.1): source -> float64 reference; runs writing the same text"]
    for i, (source, reference) in enumerate(zip(report.sentences, report.translations)):
        same = sum(texts[i] == reference for _, texts in translated)
        lines += [f"  {source}", f"    -> {reference}   [{same} of {len(translated)} runs identical]"]
        lines += [f"       {run.label}: {texts[i]}  ({run.greedy_note or 'tokens differ'})"
                  for run, texts in translated if texts[i] != reference]
    return lines


def plot_errors(report: Report, path: str | os.PathLike) -> None:
    """Error per stage per run (log scale), with each run's bound dotted: error growth with depth."""
    plt = pyplot()
    runs = [run for run in report.runs if run.stages]
    stages = [result.stage for result in runs[0].stages] if runs else []
    fig, ax = plt.subplots(figsize=(11, 5.5), constrained_layout=True)
    for run in runs:
        errors = [max(result.max_abs_error, 1e-18) for result in run.stages]
        line, = ax.plot(range(len(errors)), errors, marker="o", label=run.label)
        ax.plot(range(len(errors)), [result.bound for result in run.stages], linestyle=":", color=line.get_color())
    ax.set_yscale("log")
    ax.set_xticks(range(len(stages)), stages, rotation=45, ha="right")
    ax.set_ylabel("max abs error vs float64 reference")
    ax.set_title("Error per stage (solid) and its bound (dotted)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _low(precision: str) -> bool:
    """Whether a run's precision is held to the low-precision rule: bfloat16, float16 or their autocast recipes."""
    stored, mixed = parse_precision(precision)
    return mixed is not None or is_low(stored)


def plot_precision(report: Report, path: str | os.PathLike) -> None:
    """The precision report: one panel per precision other than float64, each backend's error per stage against
    the float64 reference (log scale), the reference's own error in that precision drawn thick (the format's own
    drift: what the bound is a multiple of) and the bound dotted."""
    plt = pyplot()
    precisions = list(dict.fromkeys(run.dtype for run in report.runs if run.stages and run.dtype != "float64"))
    if not precisions:
        raise ValueError("--precision-report needs a precision other than float64 in --dtype")
    fig, axes = plt.subplots(1, len(precisions), figsize=(5.5 * len(precisions), 5.5), sharey=True, squeeze=False,
                             constrained_layout=True)
    for ax, precision in zip(axes[0], precisions):
        runs = [run for run in report.runs if run.dtype == precision and run.stages]
        stages = [result.stage for result in runs[0].stages]
        for run in runs:
            own = run.backend == "numpy"
            errors = [max(result.max_abs_error, 1e-18) for result in run.stages]
            ax.plot(range(len(errors)), errors, marker="o" if not own else None, linewidth=4 if own else 1.5,
                    color="black" if own else None, alpha=0.35 if own else 1.0,
                    label="reference (the format's own error)" if own else f"{run.backend}/{run.device}")
        bounds = [result.bound for result in runs[0].stages]
        ax.plot(range(len(bounds)), bounds, linestyle=":", color="grey", label="bound")
        ax.set_yscale("log")
        ax.set_xticks(range(len(stages)), stages, rotation=60, ha="right", fontsize="small")
        ax.set_title(precision)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("max abs error vs float64 reference")
    fig.suptitle(f"Drift from float64, stage by stage: {report.source}")
    fig.savefig(path, dpi=120)
    plt.close(fig)
