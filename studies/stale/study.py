"""Learning study, part 3: GVPO against the clipped methods on stale rollouts (rollout.staleness).

Run (110 runs of the demo recipe, about 80 minutes on a quiet 2-core CPU; resumable: each
finished run is a record under <workdir>/records; writes studies/stale/results/{results.json,
results.md,records.json.gz,stale.png}, and with --study-md the tables into STUDY.md):
    .venv/bin/python -m studies.stale.study --study-md STUDY.md
    .venv/bin/python -m studies.stale.study --only "gvpo,grpo" --seeds 0,1
    .venv/bin/python -m studies.stale.study --report-only --study-md STUDY.md
    .venv/bin/python -m studies.stale.study --quick --out /tmp/st --workdir /tmp/st/runs

Set-up (STUDY.md, "Part 3"): configs/arith_tiny.py (the demo recipe: addition 0-99, 600 SFT
steps, P = 128 x G = 4, lr 1e-4) from one shared cold start, in the official regime (4
minibatches x 1 epoch per rollout), each run training on the same number of rollouts (the
config's 200 steps; a stale run samples k more, which stay in its queue). Cells: staleness k in
{0, 2, 4, 8} x {GVPO, GRPO without correction, GRPO + token_tis, Dr. GRPO + token_tis}, plus
GVPO with the norm clip off at k = 0 and 4, GVPO anchored at the sampling policy
(algo.anchor = "sampler") at k = 2, 4, 8, and Dr. GRPO without the correction at k = 4; each an
arm's config in studies/stale/configs (`grpo.py:k=4,tis`).
Measured: held-out greedy accuracy and avg@16 at T = 1 on the 200 held-out problems at 5 points
of the run, the area under the greedy curve, divergences, KL to the start, and per step GVPO's
variance term over its advantage term (the restoring term's share), corr(rc, a), the lag and
the IS weights.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
import time

import jax
import numpy as np

from studies.report import (
    auc,
    chance_note,
    diff_lines,
    diverged,
    logp_gap,
    write_results,
)
from studies.runs import (
    REPO,
    Cell,
    arm,
    config_key,
    record_path,
    record_tag,
    rl_run,
    save_record,
    sft,
)
from studies.stale.configs import base
from studies.stats import ci95

OUT = os.path.join(REPO, "studies", "stale", "results")
STALENESS = (0, 2, 4, 8)
METHODS = {  # name -> (arm, its arguments besides k): studies/stale/configs
    "gvpo": ("gvpo", {}),
    "grpo": ("grpo", {}),
    "grpo + token_tis": ("grpo", {"tis": True}),
    "dr_grpo + token_tis": ("dr_grpo", {"tis": True}),
}
QUICK_CELLS = ("gvpo k=0", "grpo + token_tis k=2")  # --quick: 2 methods, 2 values of k, 1 seed
# GVPO anchored at the policy that sampled (k updates behind "old"): its restoring term acts
# from a stale rollout's first minibatch on, where anchor "old" makes it zero there.
SAMPLER_K = (2, 4, 8)


def cells(quick: bool) -> list:
    """Each cell an arm of studies/stale/configs at staleness k, in the official regime."""
    out = []
    for k in (0, 2) if quick else STALENESS:
        for name, (algo, args) in METHODS.items():
            if quick and f"{name} k={k}" not in QUICK_CELLS:
                continue
            out.append(Cell("stale", f"{name} k={k}", arm("stale", algo, k=k, **args)))
    for k in () if quick else (0, 4):
        out.append(Cell("noclip", f"gvpo no clip k={k}", arm("stale", "gvpo", k=k, noclip=True)))
    for k in () if quick else SAMPLER_K:
        out.append(Cell("sampler", f"gvpo anchor sampler k={k}",
                        arm("stale", "gvpo", k=k, anchor="sampler")))  # fmt: skip
    for k in () if quick else (4,):  # GVPO's nearest clipped method, without the correction
        out.append(Cell("stale", f"dr_grpo k={k}", arm("stale", "dr_grpo", k=k)))
    return out


def summarise(recs: list[dict], budget: int) -> dict:
    final = np.array([r["curve"][-1][1] for r in recs])
    sampled = np.array([r["curve_sampled"][-1][1] for r in recs if r.get("curve_sampled")])

    def step_mean(key, fn=lambda m: m):
        vals = [fn(s) for r in recs for s in r.get("step_metrics", []) if key in s]
        vals = [v for v in vals if np.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    return {
        "seeds": len(recs),
        "greedy": float(final.mean()), "greedy_ci95": ci95(final),
        "avg16": float(sampled.mean()) if sampled.size else float("nan"),
        "avg16_ci95": ci95(sampled) if sampled.size > 1 else 0.0,
        "auc": float(np.mean([auc(r["curve"], budget) for r in recs])),
        "diverged": int(sum(diverged(r) for r in recs)),
        "kl_start": float(np.nanmean([r["kl_start"] for r in recs])),
        # over the steps whose groups had a reward spread (adv_term > 0): sum var / sum adv
        "restoring_share": _ratio(recs, "var_term", "adv_term"),
        "reward_corr": step_mean("reward_corr", lambda m: m["reward_corr"]),
        "lag": step_mean("rollout_lag", lambda m: m["rollout_lag"]),
        "is_clipped_frac": step_mean("is_clipped_frac", lambda m: m["is_clipped_frac"]),
        "logp_gap": logp_gap(recs),
        "grad_clipped_frac": float(np.mean([np.mean(r["grad_clipped_frac"]) for r in recs])),
        "time_s": float(np.mean([r["time_s"] for r in recs])),
    }  # fmt: skip


def _ratio(recs: list[dict], num: str, den: str) -> float:
    steps = [s for r in recs for s in r.get("step_metrics", []) if s.get(den, 0.0) > 0]
    total = sum(s[den] for s in steps)
    return sum(s[num] for s in steps) / total if total > 0 else float("nan")


def _f(x, spec=".3f"):
    return "-" if not np.isfinite(x) else format(x, spec)


def report(summary: dict) -> str:
    lines = [
        "| cell | seeds | greedy (95% CI) | avg@16 (95% CI) | AUC greedy | diverged | KL to start "
        "| var/adv term | corr(rc, a) | IS clipped | sampler gap | norm-clipped updates |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["cells"].items():
        lines.append(
            f"| {name} | {s['seeds']} | {_f(s['greedy'])} +- {_f(s['greedy_ci95'])} | "
            f"{_f(s['avg16'])} +- {_f(s['avg16_ci95'])} | {_f(s['auc'])} | {s['diverged']} | "
            f"{_f(s['kl_start'], '.4f')} | {_f(s['restoring_share'], '.4f')} | "
            f"{_f(s['reward_corr'])} | {_f(s['is_clipped_frac'], '.4f')} | "
            f"{_f(s['logp_gap'], '.2f')} | {_f(s['grad_clipped_frac'], '.2f')} |"
        )
    return "\n".join(lines)


def pairs() -> list[tuple[str, str]]:
    """The comparisons the study asks about: GVPO against each method at each k, each method
    stale against itself fresh, GRPO with the correction against without, GVPO without the norm
    clip, GVPO anchored at the sampler, Dr. GRPO without the correction."""
    out = [(f"gvpo k={k}", f"{m} k={k}") for k in STALENESS for m in METHODS if m != "gvpo"]
    out += [(f"{m} k={k}", f"{m} k=0") for m in METHODS for k in STALENESS if k]
    out += [(f"grpo + token_tis k={k}", f"grpo k={k}") for k in STALENESS if k]  # the correction
    out += [(f"gvpo no clip k={k}", f"gvpo k={k}") for k in (0, 4)]
    out += [(f"gvpo anchor sampler k={k}", f"gvpo k={k}") for k in SAMPLER_K]
    out += [("gvpo k=4", "dr_grpo k=4"), ("dr_grpo k=4", "dr_grpo + token_tis k=4")]
    return out


LINES = (*METHODS, "dr_grpo", "gvpo no clip", "gvpo anchor sampler")  # the figure's lines


def by_staleness(summary: dict) -> str:
    """Final greedy / avg@16 (seed means) and diverged runs, one row per method, one column
    per k: the figure's numbers."""
    lines = ["| method | " + " | ".join(f"k = {k}" for k in STALENESS) + " |",
             "|---|" + "---|" * len(STALENESS)]  # fmt: skip
    for method in LINES:
        cells_ = [summary["cells"].get(f"{method} k={k}") for k in STALENESS]
        if not any(cells_):
            continue
        row = [f"{c['greedy']:.3f} / {c['avg16']:.3f} ({c['diverged']}/{c['seeds']})" if c
               else "" for c in cells_]  # fmt: skip
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def report_block(summary: dict, records: dict, problems: int) -> str:
    """The tables STUDY.md part 3 shows (between its markers), from the records alone."""
    diffs = diff_lines(records, pairs(), problems=problems)
    return "\n".join([
        "Final greedy / avg@16 accuracy (mean over seeds) and diverged runs out of seeds, by "
        "staleness k:", "", by_staleness(summary), "",
        "Every cell:", "",
        report(summary), "",
        f"Differences of final accuracy (first - second cell; avg@n is avg@{summary['eval_n']} "
        "at T = 1) with 95% intervals (`studies.report.diff_lines`): over seeds, Student's t "
        "paired by seed where the two cells' runs share their first rollouts (the same seed "
        "and start: here every pair at one k), else Welch's; and the interval the "
        f"{problems} held-out problems add, the two-stage bootstrap over seeds and problems "
        "where both cells' runs kept per-problem outcomes, else binomial (no pair here: the "
        "first 80 runs kept none):", "",
        *diffs, "", chance_note(sum(1 + line.count("; ") for line in diffs)),
    ])  # fmt: skip


RECORDS = "records.json.gz"  # {cell: [record per seed]}, beside results.json


def load_records(out: str) -> dict:
    path = os.path.join(out, RECORDS)
    if not os.path.exists(path):
        return {}
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


BEGIN, END = "<!-- part3-toy:begin -->", "<!-- part3-toy:end -->"


def write_block(path: str, block: str, begin: str = BEGIN, end: str = END) -> None:
    """Replaces the text between `begin` and `end` in `path` (STUDY.md) with `block`."""
    with open(path) as fh:
        text = fh.read()
    i, j = text.index(begin) + len(begin), text.index(end)
    with open(path, "w") as fh:
        fh.write(text[:i] + "\n" + block + "\n" + text[j:])


def plot_by_staleness(cells: dict, lines, staleness, panels, out_png: str) -> None:
    """One panel per (key, title) of `panels`: each line's cells "<line> k=<k>" of `cells`
    (summaries with key and key_ci95) against k, with 95% intervals over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for line in lines:
            ks = [k for k in staleness if f"{line} k={k}" in cells]
            if not ks:
                continue
            cells_ = [cells[f"{line} k={k}"] for k in ks]
            ax.errorbar(ks, [c[key] for c in cells_], yerr=[c[f"{key}_ci95"] for c in cells_],
                        marker="o", capsize=3, label=line)  # fmt: skip
        ax.set_xlabel("rollout.staleness k (updates between sampling and training)")
        ax.set_title(title)
        ax.set_xticks(list(staleness))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=OUT)
    p.add_argument("--workdir", default="runs/study_stale")
    p.add_argument("--only", default="", help="comma-separated substrings of cell names")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default 0-4)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--study-md", default="", help="also write the tables into this STUDY.md")
    args = p.parse_args(argv)
    config = base.get_config("quick" if args.quick else None)
    P, G = config.rollout.prompts_per_step, config.rollout.group_size
    steps = 2 if args.quick else config.train.steps
    budget, eval_points, eval_n = steps * P * G, (1 if args.quick else 5), (2 if args.quick else 16)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else (
        [0] if args.quick else [0, 1, 2, 3, 4])  # fmt: skip
    only = [w for w in args.only.split(",") if w]
    todo = [c for c in cells(args.quick) if not only or any(w in c.name for w in only)]
    jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    start_dir = os.path.join(args.workdir, "start")
    meta = os.path.join(start_dir, "start.json")
    if not os.path.exists(meta) and not args.report_only:
        info = sft(config, start_dir, noise=0.0, steps=config.sft.steps, eval_points=2)
        with open(meta, "w") as fh:
            json.dump(info, fh)
    start = json.load(open(meta)) if os.path.exists(meta) else None
    if start is None and args.report_only:  # a fresh clone: the start the results recorded
        kept_results = os.path.join(args.out, "results.json")
        if os.path.exists(kept_results):
            start = json.load(open(kept_results)).get("start")
    records = {}
    # Every recorded run is also kept beside the results (RECORDS, committed), so the report
    # rebuilds from a fresh clone, whose workdir has none.
    kept = load_records(args.out) if args.report_only else {}
    for cell in todo:
        key = config_key(cell, cell.load(args.quick), config)
        for i, seed in enumerate(seeds):
            tag = record_tag(key, budget, seed)
            cached = record_path(args.workdir, key, budget, seed)
            if not os.path.exists(cached):
                if args.report_only:
                    if i < len(kept.get(cell.name, [])):
                        records.setdefault(cell.name, []).append(kept[cell.name][i])
                    continue
                cfg = cell.load(args.quick, seed)
                wd = os.path.join(args.workdir, "runs", tag)
                shutil.rmtree(wd, ignore_errors=True)
                print(f"== {cell.name} / seed {seed}", flush=True)
                rec = rl_run(cfg, wd, start_dir, budget=budget, eval_points=eval_points,
                             start_acc=start["curve"][-1][1], eval_n=eval_n,
                             keep_outcomes=True)  # fmt: skip
                save_record(rec, cell, cached)
                shutil.rmtree(wd, ignore_errors=True)  # the record is what is kept
                greedy, sampled = rec["curve"][-1][1], rec["curve_sampled"][-1][1]
                print(f"   greedy {greedy:.3f}  avg@{eval_n} {sampled:.3f}  {rec['time_s']:.0f}s",
                      flush=True)  # fmt: skip
            with open(cached) as fh:
                records.setdefault(cell.name, []).append(json.load(fh))
    summary = {
        "command": "python -m studies.stale.study " + " ".join(argv or []),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_rollouts": steps, "prompts_per_step": P, "group_size": G, "eval_n": eval_n,
        "start": start and {"curve": start["curve"]},
        "cells": {name: summarise(recs, budget) for name, recs in records.items()},
        "wall_time_s": time.perf_counter() - t0,
    }  # fmt: skip
    with open(os.path.join(args.out, RECORDS), "wb") as raw:  # mtime 0: the same bytes again
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(json.dumps(records, separators=(",", ":")).encode())
    block = report_block(summary, records, config.data.eval_size)
    md = "\n".join([f"# Part 3: stale rollouts ({summary['date']})", "", block, ""])
    write_results(args.out, summary, md)
    if summary["cells"]:
        plot_by_staleness(summary["cells"], LINES, STALENESS,
                          [("avg16", "held-out avg@16 (T = 1)"), ("greedy", "held-out greedy")],
                          os.path.join(args.out, "stale.png"))  # fmt: skip
    if args.study_md:
        write_block(args.study_md, block)
    print(md)
    return summary


if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
