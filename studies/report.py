"""Learning-study tables and plots from run records (`studies.runs`): per-cell summaries over
seeds (final accuracy, AUC, divergence, KL, gradient clipping), the differences between cells
with their 95% intervals over seeds and held-out problems and the data they would need
(`studies.stats` on the records: paired by seed where runs share their first rollouts), and
accuracy-vs-budget curves."""

from __future__ import annotations

import json
import os

import numpy as np

from studies import stats
from studies.stats import ci95

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


def logp_gap(recs: list[dict]) -> float:
    """Median over the runs' steps of `sampler_logp_gap_max`: the largest per-token gap (nats)
    between the log-prob the sampler drew a token with and the one the update recomputes. At
    k = 0 it is numerical noise; with stale rollouts it is how far the policy moved since."""
    vals = [s["sampler_logp_gap_max"] for r in recs for s in r.get("step_metrics", [])
            if np.isfinite(s.get("sampler_logp_gap_max", np.nan))]  # fmt: skip
    return float(np.median(vals)) if vals else float("nan")


# ----------------------------------------------------------------------------------------------
# Differences between cells: over seeds, over the held-out problems, and the data they need

CURVES = (("curve", "greedy"), ("curve_sampled", "avg@n"))  # a record's final accuracies


def shares_first_rollouts(recs_a: list[dict], recs_b: list[dict]) -> bool:
    """Whether two cells' runs pair by seed: as many runs in each, and run i of both drew the
    same first rollout, as runs with the same seed from the same start do when what their
    arms change acts only from the first update on (the method, its beta, the updates per
    rollout; not the staleness, which changes the sampler's stream). A record keeps each
    step's mean reward, so the same first rollout shows as the same first reward."""
    if len(recs_a) != len(recs_b) or len(recs_a) < 2:
        return False
    first = [[(r.get("rewards") or [None])[0] for r in recs] for recs in (recs_a, recs_b)]
    return None not in first[0] and first[0] == first[1]


def problem_scores(recs: list[dict], curve: str = "curve"):
    """(problem ids, scores_SxP): each run's score per held-out problem at its final evaluation
    (greedy 0/1 for "curve", correct / n for "curve_sampled"), or None when a run kept no
    per-problem outcomes. AssertionError for runs scored on other problems."""
    if not recs or not all(r.get("outcomes") for r in recs):
        return None
    ids = recs[0]["outcomes"]["ids"]
    rows = []
    for r in recs:
        o = r["outcomes"]
        assert o["ids"] == ids, "records scored on other problems"
        if curve == "curve":
            rows.append(np.asarray(o["greedy"], np.float64))
        else:
            rows.append(np.asarray(o["correct"], np.float64) / o["n"])
    return ids, np.stack(rows)


def difference(recs_a: list[dict], recs_b: list[dict], curve: str = "curve",
               problems: int | None = None) -> dict | None:  # fmt: skip
    """mean(a) - mean(b) of two cells' final `curve` values (one per run), or None when a cell
    has no run recording it. The one comparison every study's tables show:

    - over seeds: paired by seed when the runs share their first rollouts
      (`shares_first_rollouts`), else Welch's (`stats.seeds_ci95`: "seeds_ci95", "paired"),
      and the seeds per cell that would resolve a real difference of this size at 80% power
      ("seeds_needed", `stats.seeds_needed`);
    - over seeds and problems, when every run kept its per-problem outcomes: the two-stage
      bootstrap ("lo", "hi", `stats.two_stage_interval`) and the problems on which each cell's
      seed-mean score is higher ("a_higher", "b_higher"); else, given the held-out set's size
      `problems`, the binomial interval the finite set adds ("problems_ci95").

    "verdict": "resolved" when the seeds' interval excludes 0 and so does the problems' (the
    two-stage interval, or the binomial one combined with the seeds' by root sum of squares);
    "resolved on these problems" when only the seeds' does; else "not resolved". With neither
    outcomes nor `problems`, the seeds' interval alone decides. With one run in a cell the
    seeds' interval and the seeds needed are nan (no spread measured)."""
    ra, rb = [r for r in recs_a if r.get(curve)], [r for r in recs_b if r.get(curve)]
    if not ra or not rb:
        return None
    xa = np.array([r[curve][-1][1] for r in ra], np.float64)
    xb = np.array([r[curve][-1][1] for r in rb], np.float64)
    paired = shares_first_rollouts(ra, rb)
    if min(len(xa), len(xb)) < 2:
        d, h = float(xa.mean() - xb.mean()), float("nan")
    else:
        d, h = stats.seeds_ci95(xa, xb, paired=paired)
    out = {"diff": d, "seeds_ci95": h, "paired": paired,
           "seeds_needed": stats.seeds_needed(xa, xb, d, paired=paired)}  # fmt: skip
    seeds_resolve = abs(d) > h
    sa, sb = problem_scores(ra, curve), problem_scores(rb, curve)
    if sa is not None and sb is not None:
        assert sa[0] == sb[0], "records scored on other problems"
        _, lo, hi = stats.two_stage_interval(sa[1], sb[1], paired=paired)
        ma, mb = sa[1].mean(axis=0), sb[1].mean(axis=0)
        out.update(lo=lo, hi=hi, a_higher=int((ma > mb).sum()), b_higher=int((mb > ma).sum()))
        problems_resolve = lo > 0 or hi < 0
    elif problems is not None:
        out["problems_ci95"] = stats.problems_ci95(float(xa.mean()), float(xb.mean()), problems)
        problems_resolve = abs(d) > np.hypot(h, out["problems_ci95"])
    else:
        problems_resolve = True
    if seeds_resolve:
        out["verdict"] = "resolved" if problems_resolve else "resolved on these problems"
    else:
        out["verdict"] = "not resolved"
    return out


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
    (`stats.spread_ratio`) and whether 3 seeds resolve it: is one method more stable across
    seeds?"""
    out = []
    for a, b, xa, xb in _recorded_pairs(records, pairs):
        ratio, lo, hi = stats.spread_ratio(xa, xb)
        if not np.isfinite(ratio):
            continue
        verdict = "resolved" if hi < 1 or lo > 1 else "not resolved"
        out.append(f"- {a} / {b}: seed std {np.std(xa, ddof=1):.3f} / {np.std(xb, ddof=1):.3f} "
                   f"= {ratio:.2f} (95% {lo:.2f}-{hi:.2f}, {verdict})")  # fmt: skip
    return out


def diff_lines(records: dict[str, list[dict]], pairs, problems: int | None = None) -> list[str]:
    """Final-accuracy differences of the (first, second) cell `pairs` with at least 2 recorded
    seeds each (greedy and avg@n when recorded), with 95% intervals (`difference`).

    The seeds' interval, "paired" (by seed: the runs share their first rollouts) or "Welch",
    says whether the difference holds for a new seed on the evaluated problems. With
    per-problem outcomes each line also gives the two-stage bootstrap's interval over seeds and
    problems; without them, given `problems` (the held-out set's size), the binomial interval
    the finite set adds. A difference counts as resolved only when both resolve it; one that
    only the seeds resolve is 'resolved on these problems'.
    """
    out = []
    for a, b in pairs:
        parts = []
        for curve, label in CURVES:
            x = difference(records.get(a, []), records.get(b, []), curve, problems)
            if x is None or not np.isfinite(x["seeds_ci95"]):  # fewer than 2 runs in a cell
                continue
            seeds = f"+- {x['seeds_ci95']:.3f} seeds {'paired' if x['paired'] else 'Welch'}"
            if "lo" in x:
                seeds += f", [{x['lo']:+.3f}, {x['hi']:+.3f}] seeds and problems"
            elif "problems_ci95" in x:
                seeds += f", +- {x['problems_ci95']:.3f} problems"
            parts.append(f"{label} {x['diff']:+.3f} {seeds} ({x['verdict']})")
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


def count(n: float, unit: str) -> str:
    """'~n unit', or 'more than MOST_SEEDS unit' past `stats.seeds_needed`'s search."""
    return f"~{n:.0f} {unit}" if np.isfinite(n) else f"more than {stats.MOST_SEEDS:,} {unit}"


def needs_lines(records: dict[str, list[dict]], pairs, problems: int) -> list[str]:
    """For each recorded pair whose greedy difference `diff_lines` does not resolve: the seeds
    and problems `stats.data_to_resolve` says a real difference of that size would need to be
    resolved with 80% power."""
    out = []
    for a, b in pairs:
        x = difference(records.get(a, []), records.get(b, []), "curve", problems)
        if x is None or not np.isfinite(x["seeds_ci95"]) or x["verdict"] == "resolved":
            continue
        xa = [r["curve"][-1][1] for r in records[a] if r.get("curve")]
        xb = [r["curve"][-1][1] for r in records[b] if r.get("curve")]
        d, sd, seeds, probs = stats.data_to_resolve(xa, xb, problems, paired=x["paired"])
        spread = "the seed differences' std" if x["paired"] else "a seed std"
        out.append(f"- {a} - {b}: {d:+.3f} at {spread} of {sd:.3f}: "
                   f"{count(seeds, 'seeds per cell')} and {count(probs, 'problems')}")  # fmt: skip
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
