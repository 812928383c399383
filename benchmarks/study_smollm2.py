"""Learning study part 2: SmolLM2-135M-Instruct as shipped, the official regime (STUDY.md
"Part 2b"). Run through `python -m benchmarks.learning_study --smollm2`; every run is recorded
beside the results (docs/study/smollm2/records) and skipped when recorded.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import zlib

from benchmarks.study_report import (
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
from benchmarks.study_runs import (
    OFFICIAL,
    Cell,
    config_key,
    held_out_both,
    make_cell,
    quiet_config,
    repo_config,
    rl_run,
    save_record,
    with_overrides,
)
from gvpo_jax import assemble
from gvpo_jax import config as config_lib

SMOL = {  # dotted config fields on configs/smollm2_arith.py (sized in STUDY.md "Part 2")
    "rollout.prompts_per_step": 16,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 32,
    "data.eval_size": 200,
    "train.eval_chunk": 40,
    # On this CPU an update over 16 rows at a time runs ~2x faster than over 64 at once (the
    # same gradient: accumulation is exact); the official regime's minibatches hold 16 rows.
    "optim.micro_batches": 4,
}

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
    official = {k.replace(".", "__"): v for k, v in OFFICIAL.items()}
    out = []
    official["optim__micro_batches"] = 1  # a minibatch is 4 groups = 16 rows already
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(make_cell("smollm2", f"{algo} 4mbx1ep", algo__name=algo, **official))
    for beta in (0.05, 0.2):
        out.append(make_cell("smollm2", f"gvpo beta {beta} 4mbx1ep", algo__name="gvpo",
                             algo__beta=beta, **official))  # fmt: skip
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(make_cell("smollm2", f"{algo} on-policy", algo__name=algo))
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
    """configs/smollm2_arith.py with the study's sizes (quick: a tiny random Llama instead)."""
    c = quiet_config(config_lib.set_fields(repo_config("smollm2_arith"), tuple(SMOL.items())))
    if quick:  # the same code path on a model the test can afford (no GGUF file needed)
        c.model.gguf = ""
        c.model.preset = "tiny"
        c.tokenizer.kind = "char"
        c.data.use_chat_template = False
        c.data.rewards = "exact_match:1"
        c.data.arith.style = "symbolic"
        c.data.max_prompt_len = 16
        c.rollout.prompts_per_step, c.rollout.max_new_tokens = 8, 4
        c.algo.overlong_cache = 2
        c.data.eval_size = 16
        c.train.eval_chunk = 8
    return c


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
        key = config_key(cell, config)
        recs = []
        for seed in seeds:
            tag = f"{zlib.crc32((key + str(budget)).encode()):08x}_s{seed}"
            cached = os.path.join(args.out, "records", f"{tag}.json")
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
            rec = rl_run(with_overrides(config, cell.overrides, seed), wd, None, budget=budget,
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
        "Differences of final accuracy (first - second cell): the 95% Welch interval over seeds "
        f"(does the difference hold on these {config.data.eval_size} problems?) and the 95% "
        "interval the finite problem set adds (binomial, the two cells taken as independent: an "
        "over-estimate, since both are scored on the same problems). 'resolved' = beyond both "
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
        "What would resolve the unresolved greedy differences between methods, if they are real "
        "(`data_to_resolve`: seeds per cell at the observed seed spread and held-out problems at "
        "the observed accuracies, the two sharing the interval equally):",
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
