"""Learning study part 2b: SmolLM2-135M-Instruct as shipped, the official regime (STUDY.md
"Part 2b"); every run is recorded beside the results (studies/smollm2/results/records) and
skipped when recorded.

    .venv/bin/python -m studies.smollm2.study --workdir runs/study_smollm2
    .venv/bin/python -m studies.smollm2.study --report-only
    .venv/bin/python -m studies.smollm2.study --quick --out /tmp/s --workdir /tmp/s/w

Each cell is an arm's config in studies/smollm2/configs (`gvpo.py:regime=4mbx1ep,beta=0.2`) on
the study's base (`configs/base.py`: configs/smollm2_arith.py at the study's sizes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time

import jax

from gvpo_jax import assemble
from studies.report import (
    cell_summary,
    chance_note,
    diff_lines,
    needs_lines,
    plot_panels,
    runs_table,
    sampled_table,
    spread_lines,
    table,
    write_results,
)
from studies.runs import (
    REPO,
    Cell,
    arm,
    config_key,
    held_out_both,
    record_path,
    record_tag,
    rl_run,
    save_record,
)
from studies.smollm2.configs import base
from studies.smollm2.configs.base import SMOL

OUT = os.path.join(REPO, "studies", "smollm2", "results")

SMOL_STEPS = 15  # rollouts per run: budget = 15 x 16 x 4 = 960 sampled responses
SMOL_EVAL_N = 8  # avg@8 at the rollout temperature (with greedy) at the start and the end
SMOL_EVAL_POINTS = 5  # greedy at every 1/5 of the budget
# The method comparisons the study asks about: in each regime, and each method across regimes.
SMOL_PAIRS = [
    *[(f"{a} {r}", f"{b} {r}") for r in ("4mbx1ep", "on-policy")
      for a, b in (("gvpo", "grpo"), ("gvpo", "dr_grpo"), ("grpo", "dr_grpo"))],
    *[(f"{a} 4mbx1ep", f"{a} on-policy") for a in ("gvpo", "grpo", "dr_grpo")],
    ("gvpo 4mbx1ep", "gvpo beta 0.05 4mbx1ep"), ("gvpo 4mbx1ep", "gvpo beta 0.2 4mbx1ep"),
]  # fmt: skip


def smol_cells() -> list[Cell]:
    """The part 2b cells: each method in the official regime and on-policy, GVPO's beta."""
    out = []
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(Cell("smollm2", f"{algo} 4mbx1ep", arm("smollm2", algo, regime="4mbx1ep")))
    for beta in (0.05, 0.2):
        out.append(Cell("smollm2", f"gvpo beta {beta} 4mbx1ep",
                        arm("smollm2", "gvpo", regime="4mbx1ep", beta=beta)))  # fmt: skip
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(Cell("smollm2", f"{algo} on-policy", arm("smollm2", algo)))
    return out


def smol_panels(records: dict[str, list[dict]]) -> list[tuple[str, list]]:
    """The part-2 figure's panels, one per question, each with the recorded cells it compares:
    the methods in the official regime, GVPO's beta there, the methods on-policy."""
    panels = [
        ("official regime (4 minibatches x 1 epoch)",
         [(f"{a} 4mbx1ep", f"{a} 4mbx1ep") for a in ("gvpo", "grpo", "dr_grpo")]),
        ("GVPO's beta, official regime",
         [("gvpo beta 0.05 4mbx1ep", "beta 0.05"), ("gvpo 4mbx1ep", "beta 0.1"),
          ("gvpo beta 0.2 4mbx1ep", "beta 0.2")]),
        ("on-policy (one update per rollout)",
         [(f"{a} on-policy", f"{a} on-policy") for a in ("gvpo", "grpo", "dr_grpo")]),
    ]  # fmt: skip
    out = []
    for title, cells_ in panels:
        series = [(label, records[name]) for name, label in cells_ if name in records]
        if series:
            out.append((f"SmolLM2-135M: {title}", series))
    return out


def smol_config(quick: bool):
    """The study's base: configs/smollm2_arith.py at its sizes (quick: a tiny random Llama)."""
    return base.get_config("quick" if quick else None)


def smol_study(args) -> dict:
    """Part 2: every cell x seed from the model as shipped, each run recorded and skipped when
    recorded; then tables (greedy and avg@8, 95% intervals) and PNGs in args.out."""
    quick = args.quick
    config = smol_config(quick)
    P, G = config.rollout.prompts_per_step, config.rollout.group_size
    steps = 2 if quick else SMOL_STEPS
    budget = steps * P * G
    eval_points = 1 if quick else SMOL_EVAL_POINTS
    eval_n = 2 if quick else SMOL_EVAL_N
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if quick else [0, 1, 2])
    only = [w for w in args.only.split(",") if w]
    todo = [c for c in smol_cells() if not only or any(w in c.name for w in only)]
    if quick and not only:
        todo = [c for c in todo if c.name in ("gvpo 4mbx1ep", "grpo on-policy")]
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    # The start (the same weights for every run) is evaluated once: greedy and avg@n use fixed
    # evaluation seeds, so every run would measure the same numbers. It and every finished run's
    # record live beside the results (committed), so a fresh checkout resumes where the last
    # session stopped; args.workdir holds only scratch (checkpoints, compilation cache).
    meta = os.path.join(args.out, "start.json")
    if os.path.exists(meta):
        with open(meta) as fh:
            start = json.load(fh)
    elif args.report_only:
        start = None
    else:
        t0 = time.perf_counter()
        run_, state = assemble.assemble(config.copy_and_resolve_references(),
                                        os.path.join(args.workdir, "start"))  # fmt: skip
        try:
            greedy, sampled = held_out_both(run_, state.params, step=0, n=eval_n)
        finally:
            run_.writer.close()
            run_.task.close()
            run_.ckpt.close()
        start = {"greedy": greedy, "sampled": sampled, "time_s": time.perf_counter() - t0}
        with open(meta, "w") as fh:
            json.dump(start, fh)

    records: dict[str, list[dict]] = {}
    runs: list[tuple[str, int, dict]] = []  # (cell, seed, record) for the per-run table
    for cell in todo:
        key = config_key(cell, cell.load(quick), config)
        recs = []
        for seed in seeds:
            tag = record_tag(key, budget, seed)
            cached = record_path(args.out, key, budget, seed)
            if os.path.exists(cached):
                with open(cached) as fh:
                    recs.append(json.load(fh))
                runs.append((cell.name, seed, recs[-1]))
                continue
            if args.report_only:
                continue
            wd = os.path.join(args.workdir, "runs", tag)
            shutil.rmtree(wd, ignore_errors=True)
            print(f"== smollm2 / {cell.name} / seed {seed}", flush=True)
            rec = rl_run(cell.load(quick, seed), wd, None, budget=budget,
                         eval_points=eval_points, start_acc=start["greedy"], eval_n=eval_n,
                         sampled_at_ends_only=True, start_sampled=start["sampled"])  # fmt: skip
            recs.append(save_record(rec, cell, cached))
            runs.append((cell.name, seed, rec))
            # The per-step metrics (e.g. GVPO's loss terms) stay beside the record: the
            # scratch directory goes.
            os.makedirs(os.path.join(args.out, "metrics"), exist_ok=True)
            shutil.copyfile(os.path.join(wd, "metrics.jsonl"),
                            os.path.join(args.out, "metrics", f"{tag}.jsonl"))  # fmt: skip
            shutil.rmtree(wd, ignore_errors=True)
            print(f"   greedy {rec['curve'][-1][1]:.3f}  avg@{eval_n} "
                  f"{rec['curve_sampled'][-1][1]:.3f}  kl {rec['kl_start']:.4f}  "
                  f"{rec['time_s']:.0f}s", flush=True)  # fmt: skip
        if recs:
            records[cell.name] = recs
    if start is None or not records:
        print("nothing recorded yet")
        return {}
    cells_done = [c for c in todo if c.name in records]
    rows = [(c.name, cell_summary(records[c.name], budget)) for c in cells_done]
    diffs = diff_lines(records, SMOL_PAIRS, problems=config.data.eval_size)
    spreads = spread_lines(records, SMOL_PAIRS)
    md = [
        f"# Learning study part 2: SmolLM2-135M-Instruct "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Budget {budget} sampled responses per run ({steps} rollouts of P={P} x G={G}, up to "
        f"{config.rollout.max_new_tokens} new tokens); {config.data.eval_size} held-out "
        f"problems; start: greedy {start['greedy']:.3f}, avg@{eval_n} "
        f"{start['sampled']:.3f}. RL compute summed over runs: "
        f"{sum(r['time_s'] for v in records.values() for r in v) / 3600:.2f} h wall, "
        f"{sum(r.get('cpu_s', 0.0) for v in records.values() for r in v) / 3600:.2f} h of CPU "
        "(s/run below is wall time: it includes other jobs on the cores and any pause; CPU s "
        "is the run's own).",
        "",
        "Greedy (every 1/5 of the budget; AUC from these):",
        "",
        table(rows, start["greedy"], "the instruction model as shipped"),
        "",
        f"avg@{eval_n} at temperature {config.rollout.temperature:g} (start and end):",
        "",
        sampled_table([(c.name, records[c.name]) for c in cells_done]),
        "",
        "Differences of final accuracy (first - second cell): the 95% t interval over seeds, "
        "paired by seed (every cell's seed i drew the same first rollout from the same start: "
        "`studies.report.shares_first_rollouts`; Welch's where not), which asks whether the "
        f"difference holds for a new seed on these {config.data.eval_size} problems, and the "
        "95% interval the finite problem set adds (binomial, the two cells taken as "
        "independent: an over-estimate, since both are scored on the same problems; these runs "
        "kept no per-problem outcomes for the two-stage bootstrap). 'resolved' = beyond both "
        "combined; 'resolved on these problems' = beyond the seeds' interval only.",
        "",
        *diffs,
        "",
        chance_note(sum(1 + line.count("; ") for line in diffs)),  # greedy; avg@n per line
        "",
        "Stability across seeds: the ratio of two cells' seed standard deviations of final "
        "greedy accuracy, with its 95% interval (F distribution; 'resolved' when it excludes 1):",
        "",
        *spreads,
        "",
        chance_note(len(spreads)),
        "",
        "What would resolve the unresolved greedy differences, if they are real, with 80% "
        "power (`studies.stats.data_to_resolve`: seeds per cell at the observed seed spread, "
        "paired where the differences above are, and held-out problems at the observed "
        "accuracies, the two sharing the combined interval equally):",
        "",
        *needs_lines(records, SMOL_PAIRS, config.data.eval_size),
        "",
        f"Every run: greedy accuracy at each 1/{eval_points} of the budget, avg@{eval_n} at the "
        "start and the end, KL to the start, and the run's CPU time:",
        "",
        runs_table(runs),
        "",
        "![smollm2](smollm2.png)",
    ]
    plot_panels(smol_panels(records), os.path.join(args.out, "smollm2.png"))
    summary = {
        "budget_responses": budget,
        "start": start,
        "seeds": seeds,
        "settings": {**SMOL, "steps": steps, "eval_n": eval_n, "eval_points": eval_points},
        "cells": {c.name: {**dict(rows)[c.name], "records": records[c.name]} for c in cells_done},
        "wall_time_s": time.perf_counter() - t_start,
    }
    write_results(args.out, summary, "\n".join(md))
    print("\n".join(md))
    return summary


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run (one seed, two cells)")
    p.add_argument("--out", default=OUT, help="records, results.json, results.md and the PNG")
    p.add_argument("--workdir", default="runs/study_smollm2", help="scratch: checkpoints, cache")
    p.add_argument("--only", default="", help="comma-separated substrings of cell names")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--jax-cache", default="",
                   help="compile cache (default $JAX_COMPILATION_CACHE_DIR, else "
                   "<workdir>/jax_cache)")  # fmt: skip
    p.add_argument("--report-only", action="store_true",
                   help="tables and plots from the recorded runs; runs nothing")  # fmt: skip
    args = p.parse_args(argv)
    cache = (args.jax_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
             or os.path.join(args.workdir, "jax_cache"))  # fmt: skip
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return smol_study(args)


if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
