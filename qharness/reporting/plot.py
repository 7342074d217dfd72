"""The Pareto plot (PNG): metric vs decode latency or ``.pte`` size, each run with its noise bars, the front drawn."""

from __future__ import annotations

import io
import math

from qharness.checks.stats import Z, stderr_name
from qharness.reporting.ranking import AXES
from qharness.reporting.rows import _number


def interval(row: dict, key: str) -> tuple[float, float]:
    """``row[key]``'s noise band: ``<key>_lo``/``_hi``, else the 95% normal band of an lm-eval standard error, else the value."""
    v, lo, hi = row[key], row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if _number(lo) and _number(hi):
        return min(lo, v), max(hi, v)
    if key.startswith("eval/") and key.count("/") == 3:
        _, task, metric, stage = key.split("/")
        se = row.get(f"eval/{task}/{stderr_name(metric)}/{stage}")
        if _number(se):
            return v - Z * se, v + Z * se
    return v, v


def paired_band(row: dict) -> tuple[float, float] | None:
    """The ``.pte`` perplexity's 95% band from its paired interval against FP (``ppl_fp`` x the ratio's interval):
    the noise that matters between runs scored on the same blocks (their own ``ppl_ci`` also holds the block-to-block
    variation every run shares)."""
    fp, lo, hi = row.get("ppl_fp"), row.get("ppl_pte_vs_fp_lo"), row.get("ppl_pte_vs_fp_hi")
    return (fp * (1 + lo), fp * (1 + hi)) if all(_number(v) for v in (fp, lo, hi)) else None


LABEL_ALL = 60  # points up to which every one is labelled (and the legend placed where it covers the fewest)
LABEL_CHARS = 60  # characters of a point's label

MODE_COLORS = {"fp": "black", "ptq": "tab:blue", "qat": "tab:orange"}


def plot_pareto(
    rows: list[dict],
    column: str,
    lower_is_better: bool,
    front_runs: set[str],
    title: str,
    max_latency_ms: float | None = None,
    axis: str = "latency",
    max_size_mb: float | None = None,
) -> bytes:
    """The PNG: metric vs decode latency (``axis="size"``: vs ``.pte`` MB), point area ~ ``.pte`` size, the Pareto
    front drawn and labelled."""
    x = AXES[axis]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if _number(r.get(x)) and _number(r.get(column))]
    sizes = [r.get("pte_size_mb") or 0.0 for r in pts]
    biggest = max(sizes, default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    _draw_points(ax, pts, x, column, biggest)
    _draw_front(ax, pts, x, column, front_runs)
    fp_ppl = {round(r["ppl_fp"], 9) for r in rows if _number(r.get("ppl_fp"))}
    if column == "ppl_pte" and len(fp_ppl) == 1:  # every run starts from the same FP model
        ax.axhline(fp_ppl.pop(), ls=":", color="black", lw=1, label="FP model before quantization (PyTorch)")
    _label_points(ax, pts, x, column, front_runs, biggest)
    if max_latency_ms is not None and axis == "latency":
        ax.axvline(max_latency_ms, ls="--", color="gray", lw=1, label=f"latency budget {max_latency_ms:g} ms")
    if max_size_mb is not None and axis == "size":
        ax.axvline(max_size_mb, ls="--", color="gray", lw=1, label=f"size budget {max_size_mb:g} MB")
    ax.set_xlabel(
        ".pte size (MB; lower is better)"
        if axis == "size"
        else "decode latency of the .pte (ms/token, median; bars: min-max; lower is better)"
    )
    label = ".pte validation perplexity" if column == "ppl_pte" else column
    bars = "95%, paired per block with FP" if column == "ppl_pte" else "95%"
    ax.set_ylabel(f"{label} ({'lower' if lower_is_better else 'higher'} is better; bars: {bars})")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.2, y=0.12)  # room for the labels
    # matplotlib's "best" place tests every point: slow past a few hundred (a report of thousands of runs)
    where = "best" if len(pts) <= LABEL_ALL else "upper right"
    ax.legend(loc=where, fontsize=8, title=f"point area ~ .pte size (largest {biggest:.2f} MB)", title_fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _draw_points(ax, pts: list[dict], x: str, column: str, biggest: float) -> None:
    """Each run as a point of its mode's colour (area ~ ``.pte`` size) with its noise bars; failed parity as gray x."""
    for mode, color in MODE_COLORS.items():
        sel = [r for r in pts if r["mode"] == mode and r.get("parity_passed") is True]
        if sel:
            ax.scatter(
                [r[x] for r in sel],
                [r[column] for r in sel],
                s=[60 + 540 * (r.get("pte_size_mb") or 0) / biggest for r in sel],
                c=color,
                alpha=0.55,
                edgecolors=color,
                linewidths=1,
            )
            ax.scatter([], [], s=60, c=color, alpha=0.55, label=mode)  # legend entry of a fixed size
    bars: dict[str, list] = {}  # colour -> the bars' x, y, xerr, yerr: one errorbar call per colour, not per run
    for r in pts:
        (xlo, xhi), (ylo, yhi) = (
            interval(r, x),
            (paired_band(r) if column == "ppl_pte" else None) or interval(r, column),
        )
        color = MODE_COLORS.get(r["mode"], "gray") if r.get("parity_passed") is True else "gray"
        b = bars.setdefault(color, [[], [], [[], []], [[], []]])
        b[0].append(r[x])
        b[1].append(r[column])
        # clipped at 0: a band computed apart from its value (ppl vs the paired per-block ratio) can miss it by
        # float rounding when it is ~1e-7 wide (the FP .pte against the FP model), which matplotlib refuses
        b[2][0].append(max(0.0, r[x] - xlo))
        b[2][1].append(max(0.0, xhi - r[x]))
        b[3][0].append(max(0.0, r[column] - ylo))
        b[3][1].append(max(0.0, yhi - r[column]))
    for color, (xs, ys, xerr, yerr) in bars.items():
        ax.errorbar(
            xs, ys, xerr=xerr, yerr=yerr, fmt="none", ecolor=color, elinewidth=1, capsize=3, alpha=0.8, zorder=2
        )
    failed = [r for r in pts if r.get("parity_passed") is not True]
    if failed:
        ax.scatter(
            [r[x] for r in failed],
            [r[column] for r in failed],
            s=80,
            marker="x",
            c="gray",
            label="parity failed/skipped",
        )


def _draw_front(ax, pts: list[dict], x: str, column: str, front_runs: set[str]) -> None:
    """The front as a crimson step line through its runs."""
    front = sorted((r for r in pts if r["run"] in front_runs), key=lambda r: r[x])
    if front:
        ax.plot(
            [r[x] for r in front],
            [r[column] for r in front],
            "-",
            drawstyle="steps-post",
            color="crimson",
            lw=1.5,
            zorder=0,
            label="Pareto front",
        )
        ax.scatter([r[x] for r in front], [r[column] for r in front], s=18, c="crimson", zorder=3)


def _label_points(ax, pts: list[dict], x: str, column: str, front_runs: set[str], biggest: float) -> None:
    """``recipe/mode`` beside each point (bold crimson on the front); beyond ``LABEL_ALL`` points, beside the
    front's only (thousands of labels are unreadable and slow). A label is cut to ``LABEL_CHARS`` characters."""
    for r in pts:
        on = r["run"] in front_runs
        if not on and len(pts) > LABEL_ALL:
            continue
        text = f"{r['recipe']}/{r['mode']}"
        text = text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 3] + "..."
        radius = math.sqrt(60 + 540 * (r.get("pte_size_mb") or 0) / biggest) / 2  # points: label beside the marker
        ax.annotate(
            text,
            (r[x], r[column]),
            xytext=(radius + 2, radius / 2 + 2),
            textcoords="offset points",
            fontsize=8,
            fontweight="bold" if on else "normal",
            color="crimson" if on else "dimgray",
        )
