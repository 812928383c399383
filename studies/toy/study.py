"""Learning study: GVPO vs the GRPO family where the claims bite (off-policy, replay, lr, beta).

Run (66 runs, about an hour on a 2-core CPU; writes studies/toy/results/{results.json,results.md,
*.png}):
    .venv/bin/python -m studies.toy.study
    .venv/bin/python -m studies.toy.study --quick --out /tmp/s --workdir /tmp/s/runs
    .venv/bin/python -m studies.toy.study --only offpolicy,replay --seeds 0,1

Each cell is an arm's config in studies/toy/configs (one per method, the swept setting its
argument, e.g. `grpo.py:regime=4mbx2ep,lr=3`) on the study's base (`configs/base.py`).

Every RL run starts from one shared cold-start checkpoint (SFT on the arithmetic task, made once
in <workdir>/start and reused) and runs until it has sampled the same number of responses (the
rollout budget), whatever its replay fraction or dynamic-sampling rounds. Held-out greedy
accuracy is measured at fixed budget fractions; KL(pi_final || pi_start) is a per-token k3
estimate on fresh samples of the final policy. A run diverges when its loss is non-finite, an
update is skipped, the trainer stops, or its final accuracy falls below half the start's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import time
import zlib

import jax

from studies.report import cell_summary, demo_table, plot, table
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
    with_overrides,
)
from studies.toy.configs import base

STUDY_DIR = os.path.join(REPO, "studies", "toy", "results")
NOISE_FRAC = 0.3  # share of SFT demonstrations with a wrong answer (experiment "noisy")
NOISY_SFT_MULT = 2.5  # the noisy start gets 2.5x the clean start's SFT steps (its plateau)


def cells() -> list[Cell]:
    """The study's cells, each an arm's config (studies/toy/configs); identical configurations in
    several experiments run once."""

    def cell(exp, name, algo, start="clean", **args):
        return Cell(exp, name, arm("toy", algo, **args), start)

    out = []
    for algo in ("gvpo", "grpo", "dr_grpo", "gspo"):
        out.append(cell("offpolicy", f"{algo} 4mbx2ep", algo, regime="4mbx2ep"))
    for f in (0.0, 0.5, 0.75):
        out.append(cell("replay", f"gvpo replay {f}", "gvpo", replay=f))
    for algo in ("gvpo", "grpo"):
        for mult in (1, 3, 10):
            out.append(cell("stability", f"{algo} lr x{mult} 4mbx2ep", algo, regime="4mbx2ep",
                            lr=mult))  # fmt: skip
    # On-policy with anchor "old", beta only scales the gradient (Adam undoes it): a control.
    # Off-policy (later minibatches see logp != anchor) is where beta shapes the update.
    for beta in (0.05, 0.1, 0.2):
        out.append(cell("beta", f"gvpo beta {beta}", "gvpo", beta=beta))
    for beta in (0.05, 0.1, 0.2):
        out.append(cell("beta", f"gvpo beta {beta} 4mbx2ep", "gvpo", regime="4mbx2ep", beta=beta))
    out.append(cell("noisy", "gvpo from noisy SFT", "gvpo", start="noisy"))
    out.append(cell("noisy", "gvpo from noisy SFT lr x3", "gvpo", start="noisy", lr=3))
    for anchor in ("old", "ref"):
        out.append(cell("anchor", f"gvpo anchor {anchor}", "gvpo", anchor=anchor))
    for algo in ("gvpo", "grpo", "dr_grpo", "dapo", "gspo"):  # one update per rollout
        out.append(cell("baselines", algo, algo))
    # Part 2's controls (STUDY.md "Part 2"): the official regime, GVPO's restoring term made
    # active by a large beta, Dr. GRPO without its trust region, GRPO without its KL penalty.
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(cell("official", f"{algo} 4mbx1ep", algo, regime="4mbx1ep"))
    for beta in (1.0, 10.0):
        out.append(cell("bigbeta", f"gvpo beta {beta:g} 4mbx2ep", "gvpo", regime="4mbx2ep",
                        beta=beta))  # fmt: skip
    out.append(cell("bigbeta", "gvpo 4mbx2ep", "gvpo", regime="4mbx2ep"))
    out.append(cell("noclip", "dr_grpo eps 1e3 4mbx2ep", "dr_grpo", regime="4mbx2ep", eps=1e3))
    for algo in ("gvpo", "dr_grpo"):
        out.append(cell("noclip", f"{algo} 4mbx2ep", algo, regime="4mbx2ep"))
    for mult in (1, 3, 10):
        out.append(cell("nokl", f"grpo no KL lr x{mult} 4mbx2ep", "grpo", regime="4mbx2ep",
                        lr=mult, nokl=True))  # fmt: skip
        out.append(cell("nokl", f"grpo lr x{mult} 4mbx2ep", "grpo", regime="4mbx2ep", lr=mult))
        out.append(cell("nokl", f"gvpo lr x{mult} 4mbx2ep", "gvpo", regime="4mbx2ep", lr=mult))
    return out


# ----------------------------------------------------------------------------------------------
# The demo recipe search (STUDY.md, "The demo recipe"): end-to-end seeds, greedy and avg@n


@dataclasses.dataclass(frozen=True)
class DemoTrial:
    """A demo-recipe candidate: `start` overrides (task + SFT: one cold start per seed) and `rl`
    overrides (dotted config fields); RL runs `steps` rollouts (0: the config's train.steps)."""

    name: str
    start: tuple = ()
    rl: tuple = ()
    steps: int = 0


_OLD_TASK = (("data.arith.max_operand", 30), ("data.arith.ops", "+-"))
_P32G8 = (("rollout.prompts_per_step", 32), ("rollout.group_size", 8), ("optim.warmup_steps", 5))
DEMO_TRIALS = (
    DemoTrial("demo recipe (configs/arith_tiny.py)"),
    DemoTrial(
        "previous default: +- 0-30, P32 G8, lr 1e-5",
        _OLD_TASK,
        (*_P32G8, ("optim.lr", 1e-5)),
        steps=100,
    ),  # fmt: skip
    DemoTrial("+ 0-99, P32 G8, lr 2e-5", (), (*_P32G8, ("optim.lr", 2e-5)), steps=100),
)


def demo_search(trials, seeds, *, workdir: str, out: str, eval_n: int, eval_points: int = 6):
    """Each trial x seed: SFT from scratch with that seed (cached per start + seed), then RL from
    it with the same seed; greedy and avg@eval_n held-out accuracy along the RL run."""
    recipe = base.demo_recipe()
    records = {}
    for trial in trials:
        for seed in seeds:
            start_cfg = with_overrides(recipe, trial.start, seed)
            key = json.dumps([sorted(trial.start), seed, start_cfg.sft.steps])
            start_dir = os.path.join(workdir, "starts", f"{zlib.crc32(key.encode()):08x}")
            meta = os.path.join(start_dir, "start.json")
            if not os.path.exists(meta):
                info = sft(start_cfg, start_dir, noise=0.0, steps=start_cfg.sft.steps,
                           eval_points=5)  # fmt: skip
                with open(meta, "w") as fh:
                    json.dump(info, fh)
            with open(meta) as fh:
                start = json.load(fh)
            cfg = with_overrides(start_cfg, trial.rl, seed)
            P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
            steps = trial.steps or cfg.train.steps
            # The whole resolved config: a changed default (e.g. the config's lr) is a new run.
            rl_key = json.dumps([cfg.to_dict(), steps], sort_keys=True, default=str)
            tag = f"{zlib.crc32(rl_key.encode()):08x}"
            cached = os.path.join(workdir, "records", f"{tag}_s{seed}.json")
            if not os.path.exists(cached):
                wd = os.path.join(workdir, "runs", f"{tag}_s{seed}")
                shutil.rmtree(wd, ignore_errors=True)
                print(f"== demo / {trial.name} / seed {seed}", flush=True)
                rec = rl_run(cfg, wd, start_dir, budget=steps * P * G,
                             eval_points=eval_points, start_acc=start["curve"][-1][1],
                             eval_n=eval_n)  # fmt: skip
                rec.update(sft_time_s=start["time_s"], sft_cpu_s=start.get("cpu_s", float("nan")))
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                with open(cached, "w") as fh:
                    json.dump(rec, fh)
            with open(cached) as fh:
                records.setdefault(trial.name, []).append(json.load(fh))
    md = demo_table(records, eval_n)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "demo_search.json"), "w") as fh:
        json.dump({"seeds": list(seeds), "eval_n": eval_n, "records": records}, fh, indent=1)
    with open(os.path.join(out, "demo_search.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    return records


# ----------------------------------------------------------------------------------------------
# The study


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run (one seed, few cells)")
    p.add_argument("--out", default=STUDY_DIR, help="results.json, results.md and PNGs")
    p.add_argument("--workdir", default="runs/study", help="checkpoints and per-run metrics")
    p.add_argument("--only", default="", help="comma-separated experiments (default: all)")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--budget", type=int, default=0, help="sampled responses per run")
    p.add_argument("--eval-points", type=int, default=0, help="evaluations along the budget")
    p.add_argument(
        "--jax-cache",
        default="",
        help="compile cache (default $JAX_COMPILATION_CACHE_DIR, else <workdir>/jax_cache)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="tables and plots from the runs already recorded; runs nothing",
    )
    p.add_argument("--demo", action="store_true",
                   help="the demo recipe search (DEMO_TRIALS) instead of the study")  # fmt: skip
    p.add_argument("--eval-n", type=int, default=16, help="--demo: samples for avg@n")
    args = p.parse_args(argv)

    quick = args.quick
    if args.demo:
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [0, 1, 2]
        only = [w for w in args.only.split(",") if w]
        trials = [t for t in DEMO_TRIALS if not only or any(w in t.name for w in only)]
        return demo_search(trials, seeds, workdir=args.workdir, out=args.out,
                           eval_n=args.eval_n)  # fmt: skip
    config = base.get_config("quick" if quick else None)
    P, G = config.rollout.prompts_per_step, config.rollout.group_size
    budget = args.budget or (2 * P * G if quick else 30 * P * G)
    eval_points = args.eval_points or (1 if quick else 6)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if quick else [0, 1, 2])
    only = set(filter(None, args.only.split(",")))
    todo = [c for c in cells() if not only or c.exp in only]
    if quick and not only:  # one cell per experiment kind that exercises a distinct code path
        keep = {"grpo 4mbx2ep", "gvpo replay 0.5", "gvpo anchor ref", "gvpo from noisy SFT",
                "dr_grpo eps 1e3 4mbx2ep"}  # fmt: skip
        todo = [c for c in todo if c.name in keep]
    os.makedirs(args.out, exist_ok=True)
    # Every run re-traces the same functions; the persistent cache skips their XLA compiles.
    cache = (args.jax_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
             or os.path.join(args.workdir, "jax_cache"))  # fmt: skip
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    t_start = time.perf_counter()

    results_path = os.path.join(args.out, "results.json")
    starts = {}
    sft_points = 2 if quick else 10

    def get_start(kind: str) -> dict:
        """The cold start of this kind: made once (SFT), then reused by every invocation."""
        if kind in starts:
            return starts[kind]
        wd = os.path.join(args.workdir, f"start_{kind}")
        meta = os.path.join(wd, "start.json")
        if os.path.exists(meta):
            with open(meta) as fh:
                starts[kind] = json.load(fh)
            return starts[kind]
        # The noisy start trains longer (to its plateau), then shows it: more SFT at lr / 10.
        noise = NOISE_FRAC if kind == "noisy" else 0.0
        steps = int(NOISY_SFT_MULT * config.sft.steps) if kind == "noisy" else config.sft.steps
        extra = steps // 3 if kind == "noisy" else 0
        info = sft(config, wd, noise=noise, steps=steps, eval_points=sft_points, extra=extra)
        info["dir"] = wd
        with open(meta, "w") as fh:
            json.dump(info, fh)
        starts[kind] = info
        return info

    records: dict[str, list[dict]] = {}
    done = {}
    for cell in todo:
        key = config_key(cell, cell.load(quick), config)
        if key in done:
            records[cell.name] = done[key]
            continue
        recs = []
        for seed in seeds:
            cfg = cell.load(quick, seed)
            cached = record_path(args.workdir, key, budget, seed)
            if os.path.exists(cached):  # an interrupted study resumes at the first missing run
                with open(cached) as fh:
                    recs.append(json.load(fh))
                continue
            if args.report_only:
                continue
            start = get_start(cell.start)
            wd = os.path.join(args.workdir, "runs", record_tag(key, budget, seed))
            if os.path.exists(wd):
                shutil.rmtree(wd)
            print(f"== {cell.exp} / {cell.name} / seed {seed}", flush=True)
            rec = rl_run(
                cfg,
                wd,
                start["dir"],
                budget=budget,
                eval_points=eval_points,
                start_acc=start["curve"][-1][1],
            )
            recs.append(save_record(rec, cell, cached))
            print(
                f"   final {rec['curve'][-1][1]:.3f}  kl {rec['kl_start']:.4f}  "
                f"{rec['time_s']:.0f}s",
                flush=True,
            )
        done[key] = recs
        if recs:
            records[cell.name] = recs

    summary = {
        "command": "python -m studies.toy.study " + " ".join(argv or []),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}",
        "budget_responses": budget,
        "prompts_per_step": P,
        "group_size": G,
        "seeds": seeds,
        "starts": {
            k: {"curve": v["curve"], "extra_curve": v["extra_curve"]} for k, v in starts.items()
        },
        "cells": {},
        "wall_time_s": time.perf_counter() - t_start,
        # Compute actually spent on RL runs (also right for --report-only and resumed studies).
        "rl_run_time_s": sum(
            r["time_s"] for recs in {id(v): v for v in records.values()}.values() for r in recs
        ),
    }
    md = [
        f"# Learning study results ({summary['date']})",
        "",
        f"Budget: {budget} sampled responses per run (P={P}, G={G}); seeds {seeds}; "
        f"machine: {summary['machine']}; RL run time summed over runs "
        f"{summary['rl_run_time_s'] / 60:.1f} min; this invocation "
        f"{summary['wall_time_s'] / 60:.1f} min.",
        "",
    ]
    todo = [c for c in todo if c.name in records]  # --report-only: what has run so far
    for exp in dict.fromkeys(c.exp for c in todo):
        exp_cells = [c for c in todo if c.exp == exp]
        start_acc = get_start(exp_cells[0].start)["curve"][-1][1]
        rows = [(c.name, cell_summary(records[c.name], budget)) for c in exp_cells]
        for (name, s), c in zip(rows, exp_cells, strict=True):
            summary["cells"][name] = {
                "exp": exp,
                **s,
                "curves": [r["curve"] for r in records[c.name]],
            }
        md += [f"## {exp}", "", table(rows, start_acc), "", f"![{exp}]({exp}.png)", ""]
        extra = None
        if exp == "noisy":
            extra = [
                ("clean SFT", starts["clean"]["curve"]),
                ("noisy SFT (30% wrong)", starts["noisy"]["curve"]),
                ("noisy SFT, continued", starts["noisy"]["extra_curve"]),
            ]
            md += [
                "SFT held-out accuracy (step, acc): clean "
                + ", ".join(f"({s}, {a:.3f})" for s, a in starts["clean"]["curve"])
                + "; noisy "
                + ", ".join(f"({s}, {a:.3f})" for s, a in starts["noisy"]["curve"])
                + "; noisy continued "
                + ", ".join(f"({s}, {a:.3f})" for s, a in starts["noisy"]["extra_curve"]),
                "",
            ]
        plot(
            exp,
            [(c.name, records[c.name]) for c in exp_cells],
            os.path.join(args.out, f"{exp}.png"),
            extra=extra,
        )
    with open(results_path, "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
