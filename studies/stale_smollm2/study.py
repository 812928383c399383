"""Learning study, part 3 on SmolLM2-135M-Instruct: GVPO against GRPO + token_tis on rollouts
sampled k updates before they are trained on (STUDY.md "Part 3", the real model).

Run (16 runs, each recorded beside the results and skipped when recorded, so it resumes where
it stopped; writes studies/stale_smollm2/results/{results.json,results.md,stale_smollm2.png}):
    .venv/bin/python -m studies.stale_smollm2.study --calibrate   # replies that finish
    .venv/bin/python -m studies.stale_smollm2.study               # the study
    .venv/bin/python -m studies.stale_smollm2.study --report-only
    .venv/bin/python -m studies.stale_smollm2.study --quick --out /tmp/s --workdir /tmp/s/w

Set-up: part 2b's (configs/smollm2_arith.py as shipped, P = 16 x G = 4, 15 rollouts = 960
sampled responses per run, lr 5e-6, the official regime of 4 minibatches x 1 epoch) with
replies that end: the `brief_boxed` prompt (one short sentence, the number in \\boxed{}) and a
cap of CAP new tokens in training and evaluation, chosen by `--calibrate` on the start policy
(part 2b's 32-token cap cut 50-98% of replies). Cells: k in {0, 4} x {GVPO, GRPO + token_tis},
4 seeds; each an arm's config in studies/stale_smollm2/configs (`grpo.py:k=4,tis`). Measured
on 200 held-out problems: greedy every 1/5 of the budget, avg@8 at T = 1 and greedy at the
start and the end with per-problem outcomes, so every difference is given twice
(`studies.report.difference`): over seeds (t, paired by seed where the cells' runs share their
first rollouts) and over seeds and problems (a two-stage bootstrap of the outcomes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time

import numpy as np

from gvpo_jax import assemble
from studies import stats
from studies.report import (
    chance_note,
    count,
    difference,
    diverged,
    logp_gap,
    runs_table,
    write_results,
)
from studies.runs import (
    REPO,
    Cell,
    arm,
    config_key,
    held_out_both,
    problem_outcomes,
    record_path,
    rl_run,
    save_record,
)
from studies.smollm2.study import SMOL_EVAL_N, SMOL_EVAL_POINTS, SMOL_STEPS
from studies.stale.study import plot_by_staleness, write_block
from studies.stale_smollm2.configs import base
from studies.stale_smollm2.configs.base import CAP, SETTINGS  # noqa: F401  (the study's settings)
from studies.stats import ci95

OUT = os.path.join(REPO, "studies", "stale_smollm2", "results")
STALENESS = (0, 4)
METHODS = {  # name -> (arm, its arguments besides k): studies/stale_smollm2/configs
    "gvpo": ("gvpo", {}),
    "grpo + token_tis": ("grpo", {"tis": True}),
}
SEEDS = (0, 1, 2, 3)
# (template, cap) candidates `--calibrate` measures on the start policy.
CANDIDATES = (("plain", 32), ("plain", 96), ("brief_boxed", 64), ("brief_boxed", 96),
              ("brief_boxed", 128))  # fmt: skip


def study_config(quick: bool, template: str | None = None, cap: int | None = None):
    """The study's base (studies/stale_smollm2/configs/base.py), or a calibration candidate's."""
    args = ["quick"] if quick else []
    if template is not None:
        args.append(f"template={template},cap={cap}")
    return base.get_config(",".join(args) or None)


def cells(quick: bool) -> list:
    """Each cell an arm of studies/stale_smollm2/configs at staleness k (official regime)."""
    return [Cell("stale_smollm2", f"{name} k={k}", arm("stale_smollm2", algo, k=k, **args))
            for k in STALENESS for name, (algo, args) in METHODS.items()]  # fmt: skip


def _evaluate_start(config, workdir: str, n: int) -> dict:
    """The start policy's greedy and avg@n with per-problem outcomes (fixed evaluation seeds)."""
    t0 = time.perf_counter()
    run_, state = assemble.assemble(config.copy_and_resolve_references(), workdir)
    try:
        greedy, sampled = held_out_both(run_, state.params, step=0, n=n)
        outcomes = problem_outcomes(run_.workdir, 0)
    finally:
        run_.writer.close()
        run_.task.close()
        run_.ckpt.close()
    return {"greedy": greedy, "sampled": sampled, "outcomes": outcomes,
            "time_s": time.perf_counter() - t0}  # fmt: skip


def truncation(outcomes: dict) -> dict:
    """Share of the sampled (and greedy) replies that reached the cap, and their mean length."""
    samples = outcomes["n"] * len(outcomes["ids"])
    return {
        "sampled_truncated": sum(outcomes["truncated"]) / max(samples, 1),
        "greedy_truncated": float(np.mean(outcomes["greedy_truncated"])),
        "mean_length": sum(outcomes["length_sum"]) / max(samples, 1),
    }


def calibrate(args) -> list[dict]:
    """Each (template, cap) candidate on the start policy: avg@4 on 100 held-out problems and
    the share of replies reaching the cap; written to calibration.json (kept, committed)."""
    rows = []
    for template, cap in CANDIDATES:
        c = study_config(False, template, cap)
        c.data.eval_size = 100
        c.train.eval_chunk, c.train.eval_num_slots = 25, 100
        wd = os.path.join(args.workdir, "calibrate", f"{template}_{cap}")
        shutil.rmtree(wd, ignore_errors=True)
        start = _evaluate_start(c, wd, n=4)
        rows.append({"template": template, "cap": cap, "problems": 100, "n": 4,
                     "greedy": start["greedy"], "avg@4": start["sampled"],
                     **truncation(start["outcomes"]), "time_s": start["time_s"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "calibration.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return rows


CALIBRATION_BEGIN = "<!-- part3-smollm2-calibration:begin -->"
CALIBRATION_END = "<!-- part3-smollm2-calibration:end -->"


def calibration_table(rows: list[dict]) -> str:
    lines = ["| prompt | cap | replies at the cap (T = 1) | greedy at the cap | mean length "
             "| avg@4 | greedy |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['template']} | {r['cap']} | {100 * r['sampled_truncated']:.1f}% | "
                     f"{100 * r['greedy_truncated']:.1f}% | {r['mean_length']:.1f} | "
                     f"{r['avg@4']:.3f} | {r['greedy']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def end_values(recs: list[dict], metric: str) -> np.ndarray:
    curve = "curve" if metric == "greedy" else "curve_sampled"
    return np.array([r[curve][-1][1] for r in recs], np.float64)


def compare_cells(records: dict, a: str, b: str) -> dict:
    """a - b at the end, greedy and avg@n (`studies.report.difference`): over seeds (paired by
    seed where the two cells' runs share their first rollouts, else Welch), over seeds and
    problems (the two-stage bootstrap of the per-problem outcomes), and the seeds per cell at
    which a real difference of the measured size is resolved over seeds with 80% power."""
    out = {"a": a, "b": b}
    for curve, metric in (("curve", "greedy"),
                          ("curve_sampled", f"avg@{records[a][0]['outcomes']['n']}")):  # fmt: skip
        out[metric] = difference(records[a], records[b], curve)
    return out


def summarise(recs: list[dict]) -> dict:
    greedy, sampled = end_values(recs, "greedy"), end_values(recs, "avg")
    trunc = [truncation(r["outcomes"]) for r in recs]
    steps = [s for r in recs for s in r.get("step_metrics", [])]

    def mean_of(key):
        vals = [s[key] for s in steps if key in s and np.isfinite(s[key])]
        return float(np.mean(vals)) if vals else float("nan")

    adv = sum(s["adv_term"] for s in steps if s.get("adv_term", 0) > 0)
    return {
        "seeds": len(recs),
        "greedy": float(greedy.mean()), "greedy_ci95": ci95(greedy),
        "avg": float(sampled.mean()), "avg_ci95": ci95(sampled),
        "truncated_end": float(np.mean([t["sampled_truncated"] for t in trunc])),
        "length_end": float(np.mean([t["mean_length"] for t in trunc])),
        "diverged": int(sum(diverged(r) for r in recs)),
        "kl_start": float(np.nanmean([r["kl_start"] for r in recs])),
        "restoring_share": (sum(s["var_term"] for s in steps if s.get("adv_term", 0) > 0) / adv
                            if adv > 0 else float("nan")),
        "reward_corr": mean_of("reward_corr"), "is_clipped_frac": mean_of("is_clipped_frac"),
        "logp_gap": logp_gap(recs),
        "grad_clipped_frac": float(np.mean([np.mean(r["grad_clipped_frac"]) for r in recs])),
        "cpu_s": float(np.mean([r.get("cpu_s", np.nan) for r in recs])),
    }  # fmt: skip


def _f(x, spec=".3f"):
    return "-" if x is None or not np.isfinite(x) else format(x, spec)


def cell_table(summary: dict, n: int) -> str:
    lines = [f"| cell | seeds | greedy end (95% CI) | avg@{n} end (95% CI) | replies at the cap "
             "| mean length | KL to start | var/adv term | corr(rc, a) | IS clipped | sampler gap "
             "| norm-clipped updates | diverged | CPU min |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['seeds']} | {_f(s['greedy'])} +- {_f(s['greedy_ci95'])} | "
            f"{_f(s['avg'])} +- {_f(s['avg_ci95'])} | {100 * s['truncated_end']:.1f}% | "
            f"{s['length_end']:.1f} | {_f(s['kl_start'], '.4f')} | "
            f"{_f(s['restoring_share'], '.4f')} | {_f(s['reward_corr'])} | "
            f"{_f(s['is_clipped_frac'], '.4f')} | {_f(s['logp_gap'], '.2f')} | "
            f"{_f(s['grad_clipped_frac'], '.2f')} | "
            f"{s['diverged']} | {_f(s['cpu_s'] / 60, '.0f')} |"
        )
    return "\n".join(lines)


def diff_table(diffs: list[dict]) -> str:
    """A row per (pair, metric): the difference over seeds (95% t, paired or Welch's) and over
    seeds and problems (95% two-stage bootstrap), each with its verdict, and the problems on
    which each cell's seed-mean score is higher."""
    lines = ["| first - second | metric | over seeds (95% t, paired by seed or Welch's) | over "
             "seeds and problems (95% two-stage bootstrap) | problems higher (first / second) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for d in diffs:
        for metric in [k for k in d if k not in ("a", "b")]:
            x = d[metric]
            if not np.isfinite(x["seeds_ci95"]):
                seeds = "one seed in a cell"
            else:
                seeds = "resolved" if abs(x["diff"]) > x["seeds_ci95"] else "not resolved"
            boot = "resolved" if x["lo"] > 0 or x["hi"] < 0 else "not resolved"
            lines.append(
                f"| {d['a']} - {d['b']} | {metric} | {x['diff']:+.3f} +- {_f(x['seeds_ci95'])} "
                f"{'paired' if x['paired'] else 'Welch'} ({seeds}) | [{x['lo']:+.3f}, "
                f"{x['hi']:+.3f}] ({boot}) | {x['a_higher']} / {x['b_higher']} |"
            )
    return "\n".join(lines)


PAIRS = [  # (first, second): the difference first - second
    *[(f"gvpo k={k}", f"grpo + token_tis k={k}") for k in STALENESS],
    *[(f"{m} k=4", f"{m} k=0") for m in METHODS],
]
BEGIN, END = "<!-- part3-smollm2:begin -->", "<!-- part3-smollm2:end -->"
WHAT_WOULD_RESOLVE = (
    "What would resolve the rest over seeds, if the differences are real and the seeds spread "
    "as they did here: the seeds per cell at which the t interval resolves a difference of "
    "this size with 80% power (`studies.stats.seeds_needed`):"
)


def needs_lines(diffs: list[dict]) -> list[str]:
    """For each difference the seeds' t interval leaves unresolved, the seeds per cell
    `compare_cells` says a real difference of its size would need at the spread measured."""
    out = []
    for d in diffs:
        for metric in [k for k in d if k not in ("a", "b")]:
            x = d[metric]
            if abs(x["diff"]) > x["seeds_ci95"] or np.isnan(x["seeds_needed"]):
                continue
            out.append(f"- {d['a']} - {d['b']}, {metric} {x['diff']:+.3f}: "
                       f"{count(x['seeds_needed'], 'seeds per cell')}")  # fmt: skip
    return out


def cell_record_path(out: str, cell, config, budget: int, seed: int, quick: bool = False) -> str:
    """Where a (cell, seed) run's record lives (`studies.runs.record_path`): its tag hashes the
    cell's resolved config and the budget, so a record from other settings is never mistaken
    for this study's."""
    return record_path(out, config_key(cell, cell.load(quick), config), budget, seed)


def load_records(
    out: str, config, todo, seeds, budget: int, quick: bool = False
) -> tuple[dict, list]:
    """The recorded runs of `todo` x `seeds` under out/records: ({cell: [record per seed]},
    [(cell, seed, record)])."""
    records, runs = {}, []
    for cell in todo:
        for seed in seeds:
            path = cell_record_path(out, cell, config, budget, seed, quick)
            if os.path.exists(path):
                with open(path) as fh:
                    rec = json.load(fh)
                records.setdefault(cell.name, []).append(rec)
                runs.append((cell.name, seed, rec))
    return records, runs


def report_block(records: dict, runs: list, n: int) -> tuple[dict, list, str]:
    """(cell summaries, differences, the markdown STUDY.md part 3 shows for SmolLM2): every
    number in it is computed here from the records."""
    summary = {name: summarise(recs) for name, recs in records.items()}
    diffs = [compare_cells(records, a, b) for a, b in PAIRS if a in records and b in records]
    shown = 2 * sum(len(d) - 2 for d in diffs)  # each metric row has two intervals
    needs = needs_lines(diffs)
    block = [
        "Cells at the end of the budget (mean over seeds, 95% t interval over seeds):",
        "",
        cell_table(summary, n),
        "",
        "Differences at the end (first - second cell): over seeds, Student's t paired by seed "
        "where the two cells' runs share their first rollouts (the same seed and start, "
        "`studies.report.shares_first_rollouts`: the methods at one k), else Welch's; and over "
        "seeds and problems, the two-stage bootstrap of the per-problem outcomes "
        f"({stats.RESAMPLES:,} resamples of the seeds, then of the problems; "
        "`studies.stats.two_stage_interval`), which speaks about a new seed on new problems:",
        "",
        diff_table(diffs) if diffs else "(no pair recorded yet)",
        "",
        chance_note(shown) if diffs else "",
        "",
        *([WHAT_WOULD_RESOLVE, "", *needs, ""] if needs else []),
        "Every run:",
        "",
        runs_table(runs),
    ]
    return summary, diffs, "\n".join(block)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--out", default=OUT)
    p.add_argument("--workdir", default="runs/study_stale_smollm2")
    p.add_argument("--only", default="", help="comma-separated substrings of cell names")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default 0-3)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--study-md", default="", help="also write the tables into this STUDY.md")
    args = p.parse_args(argv)
    calib_path = os.path.join(args.out, "calibration.json")
    if args.calibrate:
        rows = calibrate(args)
        if args.study_md:  # between its markers (STUDY.md part 3)
            write_block(args.study_md, calibration_table(rows), CALIBRATION_BEGIN,
                        CALIBRATION_END)  # fmt: skip
        return {"calibration": rows}
    config = study_config(args.quick)
    P, G = config.rollout.prompts_per_step, config.rollout.group_size
    steps = 2 if args.quick else SMOL_STEPS
    budget = steps * P * G
    eval_points, n = (1, 2) if args.quick else (SMOL_EVAL_POINTS, SMOL_EVAL_N)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else (
        [0] if args.quick else list(SEEDS))  # fmt: skip
    only = [w for w in args.only.split(",") if w]
    todo = [c for c in cells(args.quick) if not only or any(w in c.name for w in only)]
    os.makedirs(args.out, exist_ok=True)
    meta = os.path.join(args.out, "start.json")
    if not os.path.exists(meta) and not args.report_only:
        start = _evaluate_start(config, os.path.join(args.workdir, "start"), n)
        with open(meta, "w") as fh:
            json.dump(start, fh)
    start = json.load(open(meta)) if os.path.exists(meta) else None
    for cell in todo:
        for seed in seeds:
            cached = cell_record_path(args.out, cell, config, budget, seed, args.quick)
            if os.path.exists(cached) or args.report_only:
                continue
            wd = os.path.join(args.workdir, "runs", os.path.basename(cached)[:-5])
            shutil.rmtree(wd, ignore_errors=True)
            print(f"== smollm2 / {cell.name} / seed {seed}", flush=True)
            rec = rl_run(cell.load(args.quick, seed), wd, None,
                         budget=budget, eval_points=eval_points, start_acc=start["greedy"],
                         eval_n=n, sampled_at_ends_only=True,
                         start_sampled=start["sampled"], keep_outcomes=True)  # fmt: skip
            save_record(rec, cell, cached)
            shutil.rmtree(wd, ignore_errors=True)
            end = f"greedy {rec['curve'][-1][1]:.3f}  avg@{n} {rec['curve_sampled'][-1][1]:.3f}"
            print(f"   {end}  {rec['time_s']:.0f}s", flush=True)
    records, runs = load_records(args.out, config, todo, seeds, budget, args.quick)
    if start is None or not records:
        print("nothing recorded yet")
        return {}
    summary, diffs, block = report_block(records, runs, n)
    calib = json.load(open(calib_path)) if os.path.exists(calib_path) else []
    start_trunc = truncation(start["outcomes"])
    md = [
        f"# Part 3 on SmolLM2-135M-Instruct: stale rollouts "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Budget {budget} sampled responses per run ({steps} rollouts of P={P} x G={G}), prompt "
        f"`{config.data.template}`, up to {config.rollout.max_new_tokens} new tokens in training "
        f"and evaluation; {len(start['outcomes']['ids'])} held-out problems. Start: greedy "
        f"{start['greedy']:.3f}, avg@{n} {start['sampled']:.3f}; "
        f"{100 * start_trunc['sampled_truncated']:.1f}% of its sampled replies and "
        f"{100 * start_trunc['greedy_truncated']:.1f}% of its greedy ones reach the cap (mean "
        f"length {start_trunc['mean_length']:.1f} tokens).",
        "",
        *(
            [
                "Calibration (the start policy, 100 held-out problems, 4 samples at T = 1 each):",
                "",
                calibration_table(calib),
                "",
            ]
            if calib
            else []
        ),  # fmt: skip
        block,
        "",
        "![stale smollm2](stale_smollm2.png)",
    ]
    plot_by_staleness(summary, METHODS, STALENESS,
                      [("avg", f"SmolLM2-135M: held-out avg@{n} (T = 1)"),
                       ("greedy", "SmolLM2-135M: held-out greedy")],
                      os.path.join(args.out, "stale_smollm2.png"))  # fmt: skip
    # The runs themselves are the records/ files beside this (written once, as they finish).
    out = {"budget_responses": budget, "settings": SETTINGS, "start": start,
           "calibration": calib, "cells": summary, "diffs": diffs}  # fmt: skip
    write_results(args.out, out, "\n".join(md))
    if args.study_md:  # the tables between their markers in STUDY.md part 3
        if calib:
            write_block(args.study_md, calibration_table(calib), CALIBRATION_BEGIN,
                        CALIBRATION_END)  # fmt: skip
        write_block(args.study_md, block, BEGIN, END)
    print("\n".join(md))
    return out


if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
