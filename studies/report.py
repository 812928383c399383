"""Learning-study statistics, tables and plots: per-cell summaries over seeds (final accuracy,
AUC, divergence, KL, gradient clipping), 95% intervals over seeds and over the held-out problem
set, the data a difference would need to be resolved, and accuracy-vs-budget curves.
Pure functions of run records (`studies.runs`)."""

from __future__ import annotations

import json
import os

import numpy as np
from scipy import stats

DIVERGE_RATIO = 0.5  # final accuracy below this times the start's counts as a collapse


def write_results(out_dir: str, summary: dict, markdown: str) -> None:
    """A study's results.json (the summary) and results.md (its report) in `out_dir`."""
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as fh:
        fh.write(markdown.rstrip("\n") + "\n")


def diverged(rec: dict) -> bool:
    """A run diverged when it errored (a trainer stop), skipped an update, logged a non-finite
    loss, or ended below DIVERGE_RATIO times its start's accuracy."""
    losses = np.asarray(rec["losses"], np.float64)
    acc0, acc_end = rec["curve"][0][1], rec["curve"][-1][1]
    return bool(
        rec["error"]
        or rec["skipped"]
        or not np.all(np.isfinite(losses))
        or acc_end < DIVERGE_RATIO * acc0
    )


def auc(curve, budget: int) -> float:
    """Mean accuracy over the budget: trapezoid area under accuracy vs responses / budget."""
    x = np.array([p[0] for p in curve], np.float64)
    y = np.array([p[1] for p in curve], np.float64)
    return float(np.trapezoid(y, x) / max(x[-1], 1.0)) if len(x) > 1 else float(y[0])


def cell_summary(recs: list[dict], budget: int) -> dict:
    final = np.array([r["curve"][-1][1] for r in recs])
    return {
        "seeds": len(recs),
        "final_mean": float(final.mean()),
        "final_std": float(final.std(ddof=1)) if len(final) > 1 else 0.0,
        "final_min": float(final.min()),
        "final_max": float(final.max()),
        "auc": float(np.mean([auc(r["curve"], budget) for r in recs])),
        "diverged": int(sum(diverged(r) for r in recs)),
        "kl_start": float(np.nanmean([r["kl_start"] for r in recs])),
        "steps": float(np.mean([r.get("steps", 0) for r in recs])),
        "time_s": float(np.mean([r["time_s"] for r in recs])),
        # CPU seconds of the run's process (nan for records from before they were logged): wall
        # time includes other jobs on the cores and any pause, CPU time does not.
        "cpu_s": float(np.mean([r.get("cpu_s", np.nan) for r in recs])),
        "ci95": ci95(final),
        # per-step means over every step of every seed (records before these were logged: nan)
        **{
            k: _step_mean(recs, k)
            for k in ("grad_norm", "grad_norm_max", "grad_clipped_frac", "clip_frac")
        },  # fmt: skip
    }


def _step_mean(recs: list[dict], key: str) -> float:
    vals = np.concatenate([np.asarray(r.get(key, []), np.float64) for r in recs])
    vals = vals[np.isfinite(vals)]
    return float(vals.mean()) if vals.size else float("nan")


# ----------------------------------------------------------------------------------------------
# Intervals: over seeds, over the held-out problems, and the data a difference needs


def logp_gap(recs: list[dict]) -> float:
    """Median over the runs' steps of `sampler_logp_gap_max`: the largest per-token gap (nats)
    between the log-prob the sampler drew a token with and the one the update recomputes. At
    k = 0 it is numerical noise; with stale rollouts it is how far the policy moved since."""
    vals = [s["sampler_logp_gap_max"] for r in recs for s in r.get("step_metrics", [])
            if np.isfinite(s.get("sampler_logp_gap_max", np.nan))]  # fmt: skip
    return float(np.median(vals)) if vals else float("nan")


def ci95(x) -> float:
    """Half-width of the 95% confidence interval of the mean of x (Student's t over seeds)."""
    x = np.asarray(x, np.float64)
    if len(x) < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))


def diff_ci95(a, b) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95% interval (Welch's t, the seeds of two
    cells as independent samples, at the Welch-Satterthwaite degrees of freedom, fractional as
    they are: rounding them down widens the interval). The difference is resolved when
    |diff| > half-width."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = np.sqrt(va + vb)
    if se == 0:
        return float(a.mean() - b.mean()), 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(a.mean() - b.mean()), float(stats.t.ppf(0.975, dof) * se)


def problems_ci95(pa: float, pb: float, problems: int) -> float:
    """Half-width of the 95% interval that the finite held-out set alone puts on a difference of
    two accuracies pa - pb, each measured on `problems` problems (normal approximation of the
    binomial). It treats the two as independent, which over-states it: both cells are scored on
    the same problems, and a problem one method finds hard the other tends to find hard too."""
    return float(1.96 * np.sqrt((pa * (1 - pa) + pb * (1 - pb)) / problems))


def data_to_resolve(a, b, problems: int) -> tuple[float, float, int, int]:
    """How much data would resolve mean(a) - mean(b) if it is real: seeds per cell at the two
    cells' seed spread and held-out problems at their accuracies, with the two sources sharing
    the combined 95% interval equally (each half-width <= |d| / sqrt(2); normal quantiles, so
    an under-estimate for few seeds). Returns (difference, the pooled seed std, seeds, problems);
    both counts are at least the data already used (3 seeds, `problems`)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = float(a.mean() - b.mean())
    seed_var = a.var(ddof=1) + b.var(ddof=1)
    pa, pb = float(a.mean()), float(b.mean())
    prob_var = pa * (1 - pa) + pb * (1 - pb)
    if d == 0:
        return d, float(np.sqrt(seed_var / 2)), 10**9, 10**9
    z2 = 2 * 1.96**2 / d**2
    seeds = max(int(np.ceil(z2 * seed_var)), len(a), len(b))
    return d, float(np.sqrt(seed_var / 2)), seeds, max(int(np.ceil(z2 * prob_var)), problems)


def spread_ratio(a, b) -> tuple[float, float, float]:
    """Seed std of a over that of b, with the 95% interval of the ratio (the F distribution of
    two normal samples' variance ratio, (len(a) - 1, len(b) - 1) degrees of freedom). The
    spreads differ when the interval excludes 1; with 3 seeds each it spans a factor of 39 in
    variance (6.2 in std) either way."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    da, db = len(a) - 1, len(b) - 1
    va, vb = a.var(ddof=1), b.var(ddof=1)
    if va == 0 or vb == 0:
        return float("nan"), float("nan"), float("nan")
    f = va / vb
    lo, hi = f / stats.f.ppf(0.975, da, db), f * stats.f.ppf(0.975, db, da)
    return float(np.sqrt(f)), float(np.sqrt(lo)), float(np.sqrt(hi))


def _recorded_pairs(records: dict[str, list[dict]], pairs, curve: str = "curve"):
    """(a, b, finals of a, finals of b) for each pair whose cells both have at least 2 seeds
    with a recorded `curve`; finals are the curve's last values, one per seed."""
    for a, b in pairs:
        xa = [r[curve][-1][1] for r in records.get(a, ()) if r.get(curve)]
        xb = [r[curve][-1][1] for r in records.get(b, ()) if r.get(curve)]
        if len(xa) >= 2 and len(xb) >= 2:
            yield a, b, xa, xb


def spread_lines(records: dict[str, list[dict]], pairs) -> list[str]:
    """Per recorded pair, the ratio of the two cells' seed spreads of final greedy accuracy
    (`spread_ratio`) and whether 3 seeds resolve it: is one method more stable across seeds?"""
    out = []
    for a, b, xa, xb in _recorded_pairs(records, pairs):
        ratio, lo, hi = spread_ratio(xa, xb)
        if not np.isfinite(ratio):
            continue
        verdict = "resolved" if hi < 1 or lo > 1 else "not resolved"
        out.append(f"- {a} / {b}: seed std {np.std(xa, ddof=1):.3f} / {np.std(xb, ddof=1):.3f} "
                   f"= {ratio:.2f} (95% {lo:.2f}-{hi:.2f}, {verdict})")  # fmt: skip
    return out


def diff_lines(records: dict[str, list[dict]], pairs, problems: int | None = None) -> list[str]:
    """Final-accuracy differences of the (first, second) cell `pairs` with at least 2 recorded
    seeds each (greedy and avg@n when recorded), with 95% intervals; 'resolved' when the
    interval excludes 0.

    The seeds' interval (Welch) says whether the difference holds on the evaluated problems.
    With `problems` (the held-out set's size) each line also gives the interval the finite
    problem set adds (`problems_ci95`), and a difference counts as resolved only when it
    exceeds both combined (their root sum of squares); one that only the seeds resolve is
    'resolved on these problems'.
    """
    out = []
    for a, b in pairs:
        if len(records.get(a, ())) < 2 or len(records.get(b, ())) < 2:
            continue
        parts = []
        for curve, label in (("curve", "greedy"), ("curve_sampled", "avg@n")):
            xa = [r[curve][-1][1] for r in records[a] if r.get(curve)]
            xb = [r[curve][-1][1] for r in records[b] if r.get(curve)]
            if len(xa) < 2 or len(xb) < 2:
                continue
            d, h = diff_ci95(xa, xb)
            if problems is None:
                verdict = "resolved" if abs(d) > h else "not resolved"
                parts.append(f"{label} {d:+.3f} +- {h:.3f} ({verdict})")
                continue
            hp = problems_ci95(float(np.mean(xa)), float(np.mean(xb)), problems)
            if abs(d) > np.hypot(h, hp):
                verdict = "resolved"
            elif abs(d) > h:
                verdict = "resolved on these problems"
            else:
                verdict = "not resolved"
            parts.append(f"{label} {d:+.3f} +- {h:.3f} seeds, +- {hp:.3f} problems ({verdict})")
        if parts:
            out.append(f"- {a} - {b}: " + "; ".join(parts))
    return out


def chance_note(comparisons: int) -> str:
    """What the number of 95% comparisons on show means: if no difference between the cells
    were real, about 1 in 20 would still come out 'resolved'."""
    return (
        f"({comparisons} comparisons at 95% each: if none of these differences were real, "
        f"about {comparisons / 20:.1f} of them would still come out resolved by chance.)"
    )


def needs_lines(records: dict[str, list[dict]], pairs, problems: int) -> list[str]:
    """For each recorded pair whose greedy difference `diff_lines` does not resolve: the seeds
    and problems `data_to_resolve` says a difference of that size would need."""
    out = []
    for a, b, xa, xb in _recorded_pairs(records, pairs):
        d, h = diff_ci95(xa, xb)
        if abs(d) > np.hypot(h, problems_ci95(float(np.mean(xa)), float(np.mean(xb)), problems)):
            continue  # already resolved
        d, sd, seeds, probs = data_to_resolve(xa, xb, problems)
        out.append(f"- {a} - {b}: {d:+.3f} at a seed std of {sd:.3f}: ~{seeds} seeds per cell "
                   f"and ~{probs} problems")  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Tables and plots


TABLE_HEAD = (
    "| cell | final acc (mean +- std) | 95% CI | min / max | AUC | diverged | KL to start "
    "| grad norm (mean / max) | clipped updates | ratio-clip frac | steps | s/run (CPU s) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _fmt(x: float, spec: str) -> str:
    return "-" if not np.isfinite(x) else format(x, spec)


def table(rows: list[tuple[str, dict]], start_acc: float, start: str = "the cold start") -> str:
    lines = [f"start (held-out greedy accuracy of {start}): {start_acc:.3f}", "", TABLE_HEAD]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['final_mean']:.3f} +- {s['final_std']:.3f} | "
            f"+- {_fmt(s['ci95'], '.3f')} | "
            f"{s['final_min']:.3f} / {s['final_max']:.3f} | {s['auc']:.3f} | "
            f"{s['diverged']}/{s['seeds']} | {s['kl_start']:.4f} | "
            f"{_fmt(s['grad_norm'], '.3g')} / {_fmt(s['grad_norm_max'], '.3g')} | "
            f"{_fmt(s['grad_clipped_frac'], '.2f')} | {_fmt(s['clip_frac'], '.3f')} | "
            f"{s['steps']:.0f} | {s['time_s']:.0f} ({_fmt(s['cpu_s'], '.0f')}) |"
        )
    return "\n".join(lines)


def sampled_table(series: list[tuple[str, list[dict]]]) -> str:
    """Final avg@n per cell: mean +- std, 95% interval, min / max, and the gain over the start."""
    lines = ["| cell | final avg@n (mean +- std) | 95% CI | min / max | gain over start |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, recs in series:
        end = np.array([r["curve_sampled"][-1][1] for r in recs])
        gain = end - np.array([r["curve_sampled"][0][1] for r in recs])
        std = end.std(ddof=1) if len(end) > 1 else 0.0
        lines.append(f"| {name} | {end.mean():.3f} +- {std:.3f} | +- {_fmt(ci95(end), '.3f')} | "
                     f"{end.min():.3f} / {end.max():.3f} | {gain.mean():+.3f} |")  # fmt: skip
    return "\n".join(lines)


def runs_table(runs: list[tuple[str, int, dict]]) -> str:
    """Markdown, a row per (cell, seed, record): the greedy curve's points, avg@n at the start
    and the end, KL to the start and CPU minutes."""
    lines = [
        "| cell | seed | greedy along the budget | avg@n start -> end | KL to start | CPU min |",
        "|---|---|---|---|---|---|",
    ]
    for name, seed, r in runs:
        greedy = " ".join(f"{a:.3f}" for _, a in r["curve"])
        sampled = r.get("curve_sampled") or [(0, np.nan)]
        lines.append(
            f"| {name} | {seed} | {greedy} | {_fmt(sampled[0][1], '.3f')} -> "
            f"{_fmt(sampled[-1][1], '.3f')} | {r['kl_start']:.3f} | "
            f"{_fmt(r.get('cpu_s', np.nan) / 60, '.0f')} |"
        )
    return "\n".join(lines)


def gain_stats(recs: list[dict], curve: str) -> dict:
    """Start, end and end - start of one accuracy curve over seeds (mean, sample std, min)."""
    start = np.array([r[curve][0][1] for r in recs])
    end = np.array([r[curve][-1][1] for r in recs])
    gain = end - start

    def std(x):
        return float(x.std(ddof=1)) if len(x) > 1 else 0.0

    return {
        "start": float(start.mean()),
        "end": float(end.mean()),
        "end_std": std(end),
        "gain": float(gain.mean()),
        "gain_std": std(gain),
        "gain_min": float(gain.min()),
    }


def demo_table(records: dict[str, list[dict]], eval_n: int) -> str:
    """Markdown: per trial, greedy and avg@n at the RL start and end (mean +- std over seeds)."""
    lines = [
        f"| trial | seeds | greedy start -> end (gain, min gain) | avg@{eval_n} start -> end "
        "(gain, min gain) | RL s (CPU s) per run |",
        "|---|---|---|---|---|",
    ]
    for name, recs in records.items():
        cells = []
        for curve in ("curve", "curve_sampled"):
            g = gain_stats(recs, curve)
            cells.append(
                f"{g['start']:.3f} -> {g['end']:.3f} +- {g['end_std']:.3f} "
                f"({g['gain']:+.3f} +- {g['gain_std']:.3f}, min {g['gain_min']:+.3f})"
            )
        t = np.mean([r["time_s"] for r in recs])
        cpu = np.mean([r.get("cpu_s", float("nan")) for r in recs])
        lines.append(f"| {name} | {len(recs)} | {cells[0]} | {cells[1]} | {t:.0f} ({cpu:.0f}) |")
    return "\n".join(lines)


def _seed_bands(ax, series: list[tuple[str, list[dict]]], title: str) -> None:
    """One axis: per cell the seed mean of held-out greedy accuracy and its min-max band."""
    for name, recs in series:
        grid = np.unique(np.concatenate([[p[0] for p in r["curve"]] for r in recs]))
        ys = np.stack([np.interp(grid, *np.array(r["curve"], np.float64).T) for r in recs])
        (line,) = ax.plot(grid / 1000, ys.mean(0), lw=1.5, marker=".", label=name)
        ax.fill_between(grid / 1000, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("sampled responses (thousands)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_panels(panels: list[tuple[str, list[tuple[str, list[dict]]]]], out_png: str) -> None:
    """Side-by-side `_seed_bands` axes with a shared accuracy scale, one per (title, series)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(panels), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True).ravel()
    for ax, (title, series) in zip(axes, panels, strict=True):
        _seed_bands(ax, series, title)
    fig.savefig(out_png, dpi=100)


def plot(exp: str, series: list[tuple[str, list[dict]]], out_png: str, extra=None) -> None:
    """Accuracy vs sampled responses: the seed mean and a min-max band per cell; with `extra`
    (name, SFT curve) pairs a second axis of SFT accuracy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = 2 if extra else 1
    fig = Figure(figsize=(6.5 * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False).ravel()
    _seed_bands(axes[0], series, f"{exp}: mean and min-max band over seeds")
    if extra:
        ax = axes[1]
        for name, curve in extra:
            x, y = np.array(curve, np.float64).T
            ax.plot(x, y, marker=".", lw=1.5, label=name)
        ax.set_xlabel("SFT steps")
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title("SFT on clean vs noisy demonstrations")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(out_png, dpi=100)
