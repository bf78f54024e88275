"""Matplotlib figures for experiments (written as PNG, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _finish(fig: Any, ax: Any, title: str, path: Path, legend_outside: bool = False) -> Path:
    """Title, grid and legend (right of the axes where it would cover the
    lines), then write ``path`` and free the figure."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend_outside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def grouped_bars(
    rows: list[dict[str, Any]],
    group: str,
    series: str,
    value: str,
    ylabel: str,
    title: str,
    path: Path,
    err: str | None = None,
    mark: str | tuple[str, ...] | None = None,
) -> Path:
    """Bars of ``value`` per ``group`` and ``series``; with ``err``, each bar's
    95% interval half-width from that key, drawn as an error bar; with
    ``mark``, that key's value (a prediction) as a tick on each bar, black
    for the first key, then other colours."""
    marks = (mark,) if isinstance(mark, str) else mark or ()
    groups = list(dict.fromkeys(r[group] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(names):
        cell = [
            next((r for r in rows if r[group] == g and r[series] == name), None) for g in groups
        ]
        ys = [r[value] if r else 0.0 for r in cell]
        yerr = [r[err] if r else 0.0 for r in cell] if err else None
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, ys, width, label=name, yerr=yerr, capsize=3 if err else 0)
        for colour, key in zip(("k", "C3", "C2"), marks, strict=False):
            ys = [r[key] if r else float("nan") for r in cell]
            ax.plot(xs, ys, "_", color=colour, ms=width * 60, mew=2, label=key if i == 0 else None)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)  # ratios are read off bars: from zero
    # below the axes (and below labels of several lines), where it hides no bar
    lines = max(str(g).count("\n") for g in groups) + 1 if groups else 1
    ax.legend(ncol=min(3, len(names)), loc="upper center",
              bbox_to_anchor=(0.5, -0.1 - 0.06 * (lines - 1)))  # fmt: skip
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def step_timeline(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    """One lane per (model, hook) with ``bucket_spans_ms``: each bucket's
    (start, work, end) on the hook's thread as a pale bar (waiting for the
    ranks to agree) then a solid one (its sum; alternating shades, so
    neighbours stay apart), the median step as a black tick, and the model's
    compute alone (its ``local`` row, where measured) as a dashed line."""
    lanes = [r for r in rows if r.get("bucket_spans_ms")]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(lanes) + 1.6))
    for y, r in enumerate(lanes):
        spans = r["bucket_spans_ms"]
        shades = ["C0" if k % 2 == 0 else "C9" for k in range(len(spans))]
        ax.broken_barh([(a, w - a) for a, w, _ in spans], (y - 0.35, 0.7), facecolors=shades,
                       alpha=0.3, label="waiting for the ranks" if y == 0 else None)  # fmt: skip
        ax.broken_barh([(w, b - w) for _, w, b in spans], (y - 0.35, 0.7), facecolors=shades,
                       label="summing" if y == 0 else None)  # fmt: skip
        ax.plot([r["iter_ms"]] * 2, [y - 0.45, y + 0.45], "k", lw=2,
                label="step (median)" if y == 0 else None)  # fmt: skip
        local = next((q for q in rows if q["model"] == r["model"] and q["hook"] == "local"), None)
        if local:  # (labelled once, on the first lane that has it)
            named = "compute alone" in ax.get_legend_handles_labels()[1]
            ax.plot([local["iter_ms"]] * 2, [y - 0.45, y + 0.45], "k--", lw=1,
                    label=None if named else "compute alone")  # fmt: skip
    ax.set_yticks(range(len(lanes)), [f"{r['model']}, {r['hook']}" for r in lanes])
    ax.set_xlabel("ms from the step's start")
    ax.set_xlim(left=0)
    return _finish(fig, ax, title, path, legend_outside=True)


def measured_vs_bound(checks: list[dict[str, Any]], title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{c['subject']}\n{c['check'].split(' vs ')[0]}" for c in checks]
    ax.axhspan(0.95, 1.05, color="grey", alpha=0.2, label="±5% of the bound")
    ax.axhline(1.0, color="k", lw=1)
    for i, c in enumerate(checks):
        ax.plot(i, c["ratio"], "o", ms=9, color="tab:green" if c["within_5pct"] else "tab:red")
    ax.set_ylim(0.9, 1.1)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("measured / analytic bound")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def lines(
    xs: list[float],
    series: dict[str, list[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    logx: bool = False,
    err: dict[str, list[float]] | None = None,
    from_zero: bool = False,
    legend_outside: bool = False,
) -> Path:
    """One line per series; ``err``: a series' 95% interval half-widths,
    drawn as a band; ``from_zero``: the y axis starts at 0 (where a ratio is
    read off the lines); ``legend_outside``: the legend right of the axes."""
    fig, ax = plt.subplots(figsize=(11 if legend_outside else 7, 4))
    for name, ys in series.items():
        (line,) = ax.plot(xs, ys, marker="o", label=name)
        if err and name in err:
            lo = [y - e for y, e in zip(ys, err[name], strict=True)]
            hi = [y + e for y, e in zip(ys, err[name], strict=True)]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    if logx:
        ax.set_xscale("log")
    if from_zero:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(fig, ax, title, path, legend_outside)


def predicted_vs_measured(
    rows: list[dict[str, Any]], series: dict[str, str], title: str, path: Path
) -> Path:
    """Measured (x) against each predicted column of ``series`` (label ->
    row key) for every row, with the y = x line and a ±15% band."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    xs = [r["measured_ms"] for r in rows]
    top = max(xs + [r[k] for r in rows for k in series.values()]) * 1.1
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="grey", alpha=0.2,
                    label="±15%")  # fmt: skip
    ax.plot([0, top], [0, top], "k", lw=1)
    for label, key in series.items():
        ax.plot(xs, [r[key] for r in rows], "o", label=label)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    return _finish(fig, ax, title, path)


def time_vs_price(
    rows: list[dict[str, Any]], budget: float, title: str, path: Path
) -> Path:  # fmt: skip
    """One point per schedule (``train_plan``'s rows): its time-averaged
    price per hour (x) and measured step time with its 95% interval (y),
    the budget a vertical line."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axvline(budget, color="k", ls="--", lw=1, label=f"budget {budget:.2f} $/h")
    for r in rows:
        ax.errorbar([r["price_per_hour"]], [r["step_ms"]], yerr=[r["step_ms_half"]], fmt="o",
                    capsize=3, label=r["schedule"])  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.set_xlabel("price, averaged over the slots ($/h)")
    ax.set_ylabel("time-averaged step (ms, migrations included)")
    return _finish(fig, ax, title, path)
