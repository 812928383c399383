"""Learning study, part 4: does GSPO's MoE claim hold here? (STUDY.md "Part 4")

Run (a pilot, then 6 cells x 5 seeds of configs/moe_arith.py's RL from one shared SFT start;
resumable: each finished run is a record under <workdir>/records; writes
studies/moe/results/{pilot.json,results.json,results.md,records.json.gz}, and with --study-md
the tables into STUDY.md):
    .venv/bin/python -m studies.moe.study --pilot
    .venv/bin/python -m studies.moe.study --study-md STUDY.md
    .venv/bin/python -m studies.moe.study --only "grpo + R3" --seeds 0,1
    .venv/bin/python -m studies.moe.study --report-only --study-md STUDY.md
    .venv/bin/python -m studies.moe.study --quick --out /tmp/moe --workdir /tmp/moe/runs

Set-up (studies/moe/configs): the small Qwen3-MoE of configs/moe_arith.py (3 layers, 8 experts,
top-2) from its SFT start, 4 minibatches x 1 epoch per rollout (the regime where token ratios
matter), the sampler in bf16 and the update in fp32 (`rollout.compute_dtype`), 200 rollouts
of 128 x 4 responses per run (equal sampled responses in every cell): GRPO, GRPO + R2, GRPO +
R3, GSPO, GSPO + R3 and GVPO (`algo.routing_replay`, docs/routing_replay.md). Arms with the
same seed share their first rollout (same start, same sampler key), so their differences pair
by seed.

The pilot comes first (fixed before the runs): without replay, at least 1% of the (token,
layer) routings must differ between the sampler and the updates (`moe/update_routing_drift`,
mean over a short GRPO run's steps); the first setting of `configs.base.SETTINGS` that meets it
is the study's, and the pilot says which and what each one measured.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
import tarfile
import time

import jax
import numpy as np

from studies.moe.configs import base
from studies.report import chance_note, diff_lines, diverged, needs_lines, write_results
from studies.runs import REPO, Cell, arm, config_key, record_path, rl_run, save_record, sft
from studies.stale import study as part3
from studies.stats import ci95

OUT = os.path.join(REPO, "studies", "moe", "results")
CELLS = {  # name -> (arm, its routing replay)
    "grpo": ("grpo", "none"),
    "grpo + R2": ("grpo", "r2"),
    "grpo + R3": ("grpo", "r3"),
    "gspo": ("gspo", "none"),
    "gspo + R3": ("gspo", "r3"),
    "gvpo": ("gvpo", "none"),
}
QUICK_CELLS = ("grpo", "grpo + R3")
PAIRS = (  # (first, second): what replay does for each ratio, and the methods against each other
    ("grpo + R2", "grpo"), ("grpo + R3", "grpo"), ("grpo + R3", "grpo + R2"),
    ("gspo + R3", "gspo"), ("gspo", "grpo"), ("gspo", "grpo + R3"), ("gvpo", "grpo"),
    ("gvpo", "gspo"),
)  # fmt: skip
DRIFT = 0.01  # the pilot's threshold: the share of (token, layer) routings that must drift
PILOT_ROLLOUTS = 40  # the pilot's run length (rollouts)
START_ARCHIVE = "start.tar.gz"  # the SFT start's checkpoint, kept beside the results
PILOT = "pilot.json"


def cells(setting: str, quick: bool) -> list[Cell]:
    out = []
    for name, (algo, replay) in CELLS.items():
        args = {"replay": replay} if replay != "none" else {}
        out.append(Cell("moe", name, arm("moe", algo, setting=setting, **args)))
    return [c for c in out if c.name in QUICK_CELLS] if quick else out


def step_mean(recs: list[dict], key: str) -> float:
    vals = [m[key] for r in recs for m in r.get("step_metrics", []) if key in m]
    vals = [v for v in vals if np.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


def summarise(recs: list[dict], start: float) -> dict:
    final = np.array([r["curve"][-1][1] for r in recs])
    sampled = np.array([r["curve_sampled"][-1][1] for r in recs if r.get("curve_sampled")])
    clip = [v for r in recs for v in r.get("clip_frac", []) if np.isfinite(v)]
    return {
        "seeds": len(recs),
        "greedy": float(final.mean()), "greedy_ci95": ci95(final),
        "avg16": float(sampled.mean()) if sampled.size else float("nan"),
        "avg16_ci95": ci95(sampled) if sampled.size > 1 else 0.0,
        "gain": float(final.mean() - start),
        "diverged": int(sum(diverged(r) for r in recs)),
        "kl_start": float(np.nanmean([r["kl_start"] for r in recs])),
        # the training-inference gap: mean |log pi_old - log mu| over the sampled tokens
        "gap": step_mean(recs, "sampler_logp_gap_mean"),
        "gap_max": step_mean(recs, "sampler_logp_gap_max"),
        # (token, layer) routings: sampler vs the update's router (replayed or not), and vs an
        # unreplayed forward at the step's start parameters
        "update_drift": step_mean(recs, "moe/update_routing_drift"),
        "start_drift": step_mean(recs, "moe/routing_drift"),
        "clip_frac": float(np.mean(clip)) if clip else float("nan"),
        "time_s": float(np.mean([r["time_s"] for r in recs])),
    }  # fmt: skip


def _f(x, spec=".3f"):
    return "-" if x is None or not np.isfinite(x) else format(x, spec)


def every_cell(summary: dict) -> str:
    lines = [
        "| cell | seeds | greedy (95% CI) | avg@16 (95% CI) | gain over start | diverged "
        "| KL to start | gap mean / max | drift at the updates | drift at the step's start "
        "| clipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, s in summary["cells"].items():
        lines.append(
            f"| {cell} | {s['seeds']} | {_f(s['greedy'])} +- {_f(s['greedy_ci95'])} | "
            f"{_f(s['avg16'])} +- {_f(s['avg16_ci95'])} | {s['gain']:+.3f} | {s['diverged']} | "
            f"{_f(s['kl_start'], '.4f')} | {_f(s['gap'], '.4f')} / {_f(s['gap_max'], '.3f')} | "
            f"{_f(s['update_drift'], '.4f')} | {_f(s['start_drift'], '.4f')} | "
            f"{_f(s['clip_frac'], '.4f')} |"
        )
    return "\n".join(lines)


def pilot_lines(pilot: dict) -> list[str]:
    out = [
        f"Pilot (GRPO without replay, seed 0, {pilot['rollouts']} rollouts; threshold "
        f"{DRIFT:.0%} of the (token, layer) routings):",
        "",
        "| setting | drift at the updates | drift at the step's start | gap mean | meets it |",
        "|---|---|---|---|---|",
    ]
    for name, m in pilot["settings"].items():
        out.append(
            f"| {name} | {_f(m['update_drift'], '.4f')} | {_f(m['start_drift'], '.4f')} | "
            f"{_f(m['gap'], '.4f')} | {'yes' if m['update_drift'] >= DRIFT else 'no'} |"
        )
    chosen = pilot.get("chosen")
    out += ["", f"The study's setting: {chosen}." if chosen else "No setting met it."]
    return out


def report_block(summary: dict, records: dict, problems: int) -> str:
    pairs = [p for p in PAIRS if p[0] in records and p[1] in records]
    diffs = diff_lines(records, pairs, problems=problems)
    needs = needs_lines(records, pairs, problems)
    return "\n".join([
        *pilot_lines(summary["pilot"]), "",
        f"Every cell (setting {summary['setting']}; start greedy {summary['start_greedy']:.3f}; "
        "step means over every step of every seed; 'gap': |log pi_old - log mu| over the "
        "sampled tokens, the training-inference gap; 'drift at the updates': the share of "
        "recorded (token, layer) routings the updates' router picks differently from the "
        "sampler's, replayed or not; 'clipped': the ratio clip's share, tokens for GRPO, "
        "sequences for GSPO):", "",
        every_cell(summary), "",
        "Differences of final accuracy (first - second cell; avg@n is avg@16 at T = 1) with 95% "
        "intervals (paired by seed where the cells share their first rollouts; the two-stage "
        f"bootstrap over seeds and the {problems} held-out problems):", "",
        *diffs, "", chance_note(sum(1 + line.count("; ") for line in diffs)), "",
        "What would resolve what stays unresolved (80% power, `studies.stats`):", "",
        *(needs or ["- (none: every difference on show is resolved, or no cell has 2 seeds)"]),
    ])  # fmt: skip


def run_pilot(args, config, start_dir: str, start_acc: float) -> dict:
    """GRPO without replay at each setting in order until one drifts enough; the records."""
    path = os.path.join(args.out, PILOT)
    pilot = json.load(open(path)) if os.path.exists(path) else {"settings": {}}
    rollouts = 2 if args.quick else PILOT_ROLLOUTS
    pilot["rollouts"] = rollouts
    for setting in base.SETTINGS:
        if setting not in pilot["settings"]:
            cell = Cell("moe", f"pilot {setting}", arm("moe", "grpo", setting=setting))
            c = cell.load(args.quick, 0)
            budget = rollouts * c.rollout.prompts_per_step * c.rollout.group_size
            wd = os.path.join(args.workdir, "pilot", setting)
            shutil.rmtree(wd, ignore_errors=True)
            print(f"== pilot: {setting}", flush=True)
            rec = rl_run(c, wd, start_dir, budget=budget, eval_points=1, start_acc=start_acc)
            shutil.rmtree(wd, ignore_errors=True)
            pilot["settings"][setting] = {
                "update_drift": step_mean([rec], "moe/update_routing_drift"),
                "start_drift": step_mean([rec], "moe/routing_drift"),
                "gap": step_mean([rec], "sampler_logp_gap_mean"),
                "greedy": rec["curve"][-1][1],
                "diverged": diverged(rec),
            }
            with open(path, "w") as fh:
                json.dump(pilot, fh, indent=1)
        m = pilot["settings"][setting]
        print(f"   {setting}: drift at the updates {m['update_drift']:.4f}", flush=True)
        if m["update_drift"] >= DRIFT or args.quick:
            pilot["chosen"] = setting
            break
    with open(path, "w") as fh:
        json.dump(pilot, fh, indent=1)
    return pilot


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pilot", action="store_true", help="run the pilot only")
    p.add_argument("--out", default=OUT)
    p.add_argument("--workdir", default="runs/study_moe")
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
    jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    kept = part3.load_records(args.out)
    # The shared SFT start, restored from beside the results when an earlier session made it.
    start_dir = os.path.join(args.workdir, "start")
    meta = os.path.join(start_dir, "start.json")
    archive = os.path.join(args.out, START_ARCHIVE)
    if not os.path.exists(meta) and os.path.exists(archive) and not args.quick:
        with tarfile.open(archive) as tar:
            tar.extractall(start_dir, filter="data")
    if not os.path.exists(meta) and not args.report_only:
        info = sft(config, start_dir, noise=0.0, steps=config.sft.steps, eval_points=2)
        with open(meta, "w") as fh:
            json.dump(info, fh)
        if not args.quick:
            with tarfile.open(archive, "w:gz") as tar:
                for item in ("start.json", "checkpoints"):
                    tar.add(os.path.join(start_dir, item), arcname=item)
    start = json.load(open(meta)) if os.path.exists(meta) else None
    start_greedy = start["curve"][-1][1] if start else float("nan")
    pilot_path = os.path.join(args.out, PILOT)
    if args.report_only:
        pilot = json.load(open(pilot_path)) if os.path.exists(pilot_path) else {"settings": {}}
    else:
        pilot = run_pilot(args, config, start_dir, start_greedy)
    setting = pilot.get("chosen")
    if args.pilot or setting is None:
        print("\n".join(pilot_lines(pilot)))
        return pilot
    todo = [c for c in cells(setting, args.quick) if not only or any(w in c.name for w in only)]

    def run(cell: Cell, seed: int) -> dict | None:
        """The cell's record at `seed`: recorded, or run now (None when only reporting)."""
        key = config_key(cell, cell.load(args.quick), config)
        cached = record_path(args.workdir, key, budget, seed)
        if not os.path.exists(cached):
            restored = [r for r in kept.get(cell.name, []) if r.get("seed") == seed]
            if restored:
                save_record(restored[0], cell, cached)
        if not os.path.exists(cached):
            if args.report_only:
                return None
            wd = os.path.join(args.workdir, "runs", os.path.basename(cached)[:-5])
            shutil.rmtree(wd, ignore_errors=True)
            print(f"== {cell.name} / seed {seed}", flush=True)
            rec = rl_run(cell.load(args.quick, seed), wd, start_dir, budget=budget,
                         eval_points=eval_points, start_acc=start_greedy, eval_n=eval_n,
                         keep_outcomes=True)  # fmt: skip
            rec["seed"] = seed
            save_record(rec, cell, cached)
            shutil.rmtree(wd, ignore_errors=True)
            greedy, sampled = rec["curve"][-1][1], rec["curve_sampled"][-1][1]
            print(f"   greedy {greedy:.3f}  avg@{eval_n} {sampled:.3f}  {rec['time_s']:.0f}s",
                  flush=True)  # fmt: skip
        with open(cached) as fh:
            rec = json.load(fh)
        rec.setdefault("seed", seed)
        return rec

    records = {}
    for seed in seeds:  # seed-major: every cell gets its first seeds before any gets a fifth
        for cell in todo:
            rec = run(cell, seed)
            if rec is not None:
                records.setdefault(cell.name, []).append(rec)
    records = {c.name: records[c.name] for c in todo if c.name in records}
    summary = {
        "command": "python -m studies.moe.study " + " ".join(argv or []),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "setting": setting, "pilot": pilot, "budget_rollouts": steps,
        "prompts_per_step": P, "group_size": G, "eval_n": eval_n,
        "start": start and {"curve": start["curve"]}, "start_greedy": start_greedy,
        "cells": {n: summarise(recs, start_greedy) for n, recs in records.items()},
        "wall_time_s": time.perf_counter() - t0,
    }  # fmt: skip
    with open(os.path.join(args.out, part3.RECORDS), "wb") as raw:  # mtime 0: the same bytes
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(json.dumps(records, separators=(",", ":")).encode())
    block = report_block(summary, records, config.data.eval_size)
    md = "\n".join([f"# Part 4: GSPO's MoE claim on a small MoE ({summary['date']})", "",
                    block, ""])  # fmt: skip
    write_results(args.out, summary, md)
    if args.study_md:
        part3.write_block(args.study_md, block, BEGIN, END)
    print(md)
    return summary


BEGIN, END = "<!-- part4:begin -->", "<!-- part4:end -->"

if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
