"""Learning study, part 3b: where GVPO holds on stale samples, and why it falls (STUDY.md
"Part 3b").

Run (about 110 runs of the demo recipe, 1.5-2 hours on a quiet 2-core CPU; resumable: each
finished run is a record under <workdir>/records; writes studies/regime/results/{results.json,
results.md,records.json.gz,regime.png}, and with --study-md the tables into STUDY.md):
    .venv/bin/python -m studies.regime.study --study-md STUDY.md
    .venv/bin/python -m studies.regime.study --only "lr=3e-5" --seeds 0,1
    .venv/bin/python -m studies.regime.study --report-only --study-md STUDY.md
    .venv/bin/python -m studies.regime.study --quick --out /tmp/rg --workdir /tmp/rg/runs

Set-up: part 3's (the demo recipe, 4 minibatches x 1 epoch per rollout, 200 rollouts per run,
5 seeds from one shared SFT start) at three learning rates, lr in {1e-4 (the recipe's: part 3's
own runs), 3e-5, 1e-5}: at k = 4, GVPO anchor "old", GVPO anchor "sampler", Dr. GRPO without a
correction and Dr. GRPO + token_tis; at k = 0, GVPO and Dr. GRPO (where the others coincide with
them). The mechanism: GVPO anchor "old" with 4 passes over each rollout's minibatches instead of
one (the theorem's regime, the loss minimised further on a fixed stale batch), at k = 4 and
k = 0, at 3e-5 and 1e-5. The lr 1e-4 cells reuse part 3's records (studies/stale/results) when a
rerun of one of them gives the same losses and curve (the numerics check); else they rerun.

Fixed before the runs: GVPO "holds" at a setting when none of its runs diverged and its final
greedy accuracy is above the start by more than the 95% interval over seeds; the samples are
"materially off-policy" when the weight pi_old / mu exceeds token_tis's cap 2 on at least 1% of
the drawn tokens (`sampler_over_cap_frac`, measured in every arm whether or not it corrects).
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

from studies.report import chance_note, diff_lines, write_results
from studies.runs import REPO, Cell, arm, config_key, record_path, rl_run, save_record, sft
from studies.stale import study as part3
from studies.stale.configs import base
from studies.stats import ci95

OUT = os.path.join(REPO, "studies", "regime", "results")
PART3_OUT = os.path.join(REPO, "studies", "stale", "results")
RECIPE_LR = "1e-4"  # configs/arith_tiny.py's own: part 3's runs
LRS = (RECIPE_LR, "3e-5", "1e-5")
K = 4  # the stale cells' staleness; k = 0 the fresh control
EPOCHS = 4  # the mechanism's passes over each rollout's minibatches
STALE = {  # name -> (arm, its arguments besides k and lr): studies/stale/configs
    "gvpo": ("gvpo", {}),
    "gvpo anchor sampler": ("gvpo", {"anchor": "sampler"}),
    "dr_grpo": ("dr_grpo", {}),
    "dr_grpo + token_tis": ("dr_grpo", {"tis": True}),
}
FRESH = ("gvpo", "dr_grpo")  # at k = 0 the sampler anchor and the correction change nothing
MULTI = f"gvpo {EPOCHS} epochs"  # GVPO anchor "old", EPOCHS passes per rollout
MULTI_LRS = ("3e-5", "1e-5")  # at 1e-4 one pass already collapses at k = 4
# the cells at the recipe's lr that part 3 ran, and their names there
PART3 = {f"{m} k={K}": f"{m} k={K}" for m in STALE} | {"gvpo k=0": "gvpo k=0"}
CHECK = "gvpo"  # at k = K: the lr 1e-4 cell rerun at seed 0 to check the numerics are part 3's
QUICK_CELLS = ("dr_grpo k=0 lr=3e-5", f"{MULTI} k={K} lr=3e-5")
SUBSTANTIAL = 0.01  # "materially off-policy": the cap's share of drawn tokens
START_ARCHIVE = "start.tar.gz"  # the SFT start's checkpoint, kept beside the results


def name(method: str, k: int, lr: str) -> str:
    return f"{method} k={k} lr={lr}"


def cells(quick: bool) -> list:
    """Each cell an arm of studies/stale/configs at staleness k and learning rate lr (the
    recipe's own lr leaves the config as part 3 ran it, so their records share a key)."""
    out = []
    for lr in (*LRS[1:], LRS[0]):  # the new rates first
        lr_arg = {} if lr == RECIPE_LR else {"lr": float(lr)}
        for method, (algo, args) in STALE.items():
            out.append(
                Cell("regime", name(method, K, lr), arm("stale", algo, k=K, **lr_arg, **args))
            )
        for method in FRESH:
            out.append(Cell("regime", name(method, 0, lr), arm("stale", method, k=0, **lr_arg)))
        if lr in MULTI_LRS:
            for k in (K, 0):
                out.append(Cell("regime", name(MULTI, k, lr),
                                arm("stale", "gvpo", k=k, epochs=EPOCHS, **lr_arg)))  # fmt: skip
    if quick:
        out = [c for c in out if c.name in QUICK_CELLS]
    return out


def summarise(recs: list[dict], budget: int, start: float) -> dict:
    """Part 3's summary of a cell, with the samples' distance from the policy that trains on
    them, GVPO's covariance share, and whether the cell holds (no run diverged, the greedy gain
    over the start resolved over seeds)."""
    s = part3.summarise(recs, budget)

    def step_mean(key):
        vals = [m[key] for r in recs for m in r.get("step_metrics", []) if key in m]
        vals = [v for v in vals if np.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    final = np.array([r["curve"][-1][1] for r in recs])
    gain, half = float(final.mean() - start), ci95(final)
    s.update(
        log_ratio_abs=step_mean("sampler_logp_gap_mean"),
        over_cap=step_mean("sampler_over_cap_frac"),
        cov_share=part3._ratio(recs, "cov_term", "adv_term"),
        gain=gain,
        gain_ci95=half,
        holds=bool(s["diverged"] == 0 and len(final) > 1 and gain > half),
    )
    return s


def _f(x, spec=".3f"):
    return "-" if x is None or not np.isfinite(x) else format(x, spec)


def every_cell(summary: dict) -> str:
    lines = [
        "| cell | seeds | greedy (95% CI) | avg@16 (95% CI) | gain over start | diverged "
        "| KL to start | mean abs log(pi_old/mu) | weight > 2 | sampler gap | var/adv | cov/adv "
        "| corr(rc, a) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, s in summary["cells"].items():
        lines.append(
            f"| {cell} | {s['seeds']} | {_f(s['greedy'])} +- {_f(s['greedy_ci95'])} | "
            f"{_f(s['avg16'])} +- {_f(s['avg16_ci95'])} | {s['gain']:+.3f} | {s['diverged']} | "
            f"{_f(s['kl_start'], '.4f')} | {_f(s['log_ratio_abs'], '.4f')} | "
            f"{_f(s['over_cap'], '.4f')} | {_f(s['logp_gap'], '.2f')} | "
            f"{_f(s['restoring_share'], '.4f')} | {_f(s['cov_share'], '.4f')} | "
            f"{_f(s['reward_corr'])} |"
        )
    return "\n".join(lines)


def _off_policy(summary: dict, lr: str) -> float:
    """The share of drawn tokens whose weight pi_old / mu exceeds the cap at (lr, k = K), in
    Dr. GRPO + token_tis's runs (part 3's records logged it as its clipped fraction)."""
    s = summary["cells"].get(name("dr_grpo + token_tis", K, lr))
    if s is None:
        return float("nan")
    return s["over_cap"] if np.isfinite(s["over_cap"]) else s["is_clipped_frac"]


def at_a_glance(summary: dict) -> str:
    """One row per lr: final greedy (diverged / seeds) of each arm, the off-policy share, and
    whether GVPO holds with each anchor."""
    cols = [(m, 0) for m in FRESH] + [(m, K) for m in STALE] + [(MULTI, K)]
    lines = ["| lr | " + " | ".join(f"{m} k={k}" for m, k in cols)
             + f" | weight > 2 at k={K} | GVPO holds at k={K}: old / sampler |",
             "|---|" + "---|" * (len(cols) + 2)]  # fmt: skip
    for lr in LRS:
        row = []
        for m, k in cols:
            s = summary["cells"].get(name(m, k, lr))
            row.append(f"{s['greedy']:.3f} ({s['diverged']}/{s['seeds']})" if s else "")
        off = _off_policy(summary, lr)
        holds = [summary["cells"].get(name(m, K, lr)) for m in ("gvpo", "gvpo anchor sampler")]
        verdict = " / ".join("-" if s is None else ("yes" if s["holds"] else "no") for s in holds)
        mark = "" if not np.isfinite(off) else (" (material)" if off >= SUBSTANTIAL else " (not)")
        lines.append(f"| {lr} | " + " | ".join(row) + f" | {_f(off, '.4f')}{mark} | {verdict} |")
    return "\n".join(lines)


def pairs() -> list[tuple[str, str]]:
    """At each lr: GVPO against uncorrected Dr. GRPO (the mechanism: their first-minibatch
    gradients share a direction) and against the corrected one, the sampler anchor against
    "old", the correction's effect, each arm stale against fresh, and more passes per rollout
    against one."""
    out = []
    for lr in LRS:
        n = lambda m, k: name(m, k, lr)  # noqa: E731
        out += [(n("gvpo", K), n("dr_grpo", K)), (n("gvpo", K), n("dr_grpo + token_tis", K)),
                (n("gvpo anchor sampler", K), n("gvpo", K)),
                (n("dr_grpo + token_tis", K), n("dr_grpo", K)),
                (n("gvpo", K), n("gvpo", 0)), (n("dr_grpo", K), n("dr_grpo", 0)),
                (n("gvpo", 0), n("dr_grpo", 0))]  # fmt: skip
        if lr in MULTI_LRS:
            out += [(n(MULTI, K), n("gvpo", K)), (n(MULTI, 0), n("gvpo", 0)),
                    (n(MULTI, K), n(MULTI, 0))]  # fmt: skip
    return out


def report_block(summary: dict, records: dict, problems: int) -> str:
    """The tables STUDY.md part 3b shows (between its markers), from the records alone."""
    diffs = diff_lines(records, pairs(), problems=problems)
    check = summary.get("numerics_check") or {}
    source = {
        True: f"part 3's runs, reused (the numerics check {check.get('text')}: the same)",
        False: f"part 3's cells rerun with this code (the numerics check {check.get('text')}: "
        "changed)",
        None: "part 3's runs (the numerics check did not run)",
    }[check.get("same")]
    return "\n".join([
        f"Final held-out greedy accuracy (mean over seeds; diverged runs / seeds) by learning "
        f"rate; start {summary['start_greedy']:.3f}. The lr {RECIPE_LR} cells are {source}.", "",
        at_a_glance(summary), "",
        "Every cell (step means over every step of every seed; 'weight > 2': the share of "
        "drawn tokens whose weight pi_old / mu exceeds token_tis's cap, what the correction "
        "acts on; 'sampler gap': the median step's largest |log pi_old - log mu|; part 3's "
        "records predate the first two columns):", "",
        every_cell(summary), "",
        "Differences of final accuracy (first - second cell; avg@n is avg@16 at T = 1) with "
        "95% intervals (`studies.report.diff_lines`: paired by seed where the two cells share "
        "their first rollouts, else Welch's; and the two-stage bootstrap over seeds and the "
        f"{problems} held-out problems):", "",
        *diffs, "", chance_note(sum(1 + line.count("; ") for line in diffs)),
    ])  # fmt: skip


def plot(summary: dict, out_png: str) -> None:
    """Final greedy and avg@16 against the learning rate, one line per arm, 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms_ = [(m, K) for m in STALE] + [(m, 0) for m in FRESH] + [(MULTI, K), (MULTI, 0)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    panels = (("greedy", "held-out greedy"), ("avg16", "held-out avg@16 (T = 1)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for m, k in arms_:
            pts = [(float(lr), summary["cells"][name(m, k, lr)]) for lr in LRS
                   if name(m, k, lr) in summary["cells"]]  # fmt: skip
            if not pts:
                continue
            ax.errorbar([p[0] for p in pts], [p[1][key] for p in pts],
                        yerr=[p[1][f"{key}_ci95"] for p in pts], marker="o", capsize=3,
                        linestyle="-" if k else "--", label=f"{m} k={k}")  # fmt: skip
        ax.axhline(summary["start_greedy"] if key == "greedy" else summary["start_avg16"],
                   color="grey", lw=0.8)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def _same_run(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two records of one cell and seed are the same run: equal losses (to 1e-5
    relative) and curves."""
    la, lb = np.asarray(a["losses"], np.float64), np.asarray(b["losses"], np.float64)
    if la.shape != lb.shape:
        return False, f"ran {len(la)} steps against part 3's {len(lb)}"
    worst = float(np.max(np.abs(la - lb) / np.maximum(np.abs(lb), 1e-6)))
    same = worst <= 1e-5 and a["curve"] == b["curve"]
    return same, (f"reran {CHECK} k={K} seed 0: the largest relative loss difference over its "
                  f"{len(la)} steps is {worst:.1e}, final greedy {a['curve'][-1][1]:.3f} against "
                  f"part 3's {b['curve'][-1][1]:.3f}")  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=OUT)
    p.add_argument("--workdir", default="runs/study_regime")
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
    # What earlier sessions kept beside the results (the work directory is not kept): every
    # finished run's record and the SFT start, restored so that no run is repeated and the
    # runs still to come start from the same checkpoint.
    kept = part3.load_records(args.out)
    kept_summary = {}
    if args.report_only and os.path.exists(os.path.join(args.out, "results.json")):
        kept_summary = json.load(open(os.path.join(args.out, "results.json")))
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
    start = json.load(open(meta)) if os.path.exists(meta) else kept_summary.get("start")
    for cell in todo:  # records kept beside the results, back where the runs look for them
        key = config_key(cell, cell.load(args.quick), config)
        for rec in kept.get(cell.name, []):
            path = record_path(args.workdir, key, budget, rec.get("seed", -1))
            if rec.get("seed") in seeds and not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    json.dump(rec, fh)

    def run(cell: Cell, seed: int) -> dict | None:
        """The cell's record at `seed`: recorded, or run now (None when only reporting)."""
        key = config_key(cell, cell.load(args.quick), config)
        cached = record_path(args.workdir, key, budget, seed)
        if not os.path.exists(cached):
            if args.report_only:
                return None
            wd = os.path.join(args.workdir, "runs", os.path.basename(cached)[:-5])
            shutil.rmtree(wd, ignore_errors=True)
            print(f"== {cell.name} / seed {seed}", flush=True)
            rec = rl_run(cell.load(args.quick, seed), wd, start_dir, budget=budget,
                         eval_points=eval_points, start_acc=start["curve"][-1][1],
                         eval_n=eval_n, keep_outcomes=True)  # fmt: skip
            save_record(rec, cell, cached)
            shutil.rmtree(wd, ignore_errors=True)
            greedy, sampled = rec["curve"][-1][1], rec["curve_sampled"][-1][1]
            print(f"   greedy {greedy:.3f}  avg@{eval_n} {sampled:.3f}  {rec['time_s']:.0f}s",
                  flush=True)  # fmt: skip
        with open(cached) as fh:
            rec = json.load(fh)
        rec.setdefault("seed", seed)  # (records kept beside the results are restored by seed)
        return rec

    # The numerics check: part 3's records stand for the recipe's lr when a rerun matches.
    check = kept_summary.get("numerics_check")
    part3_records = part3.load_records(PART3_OUT)
    if not args.quick and not args.report_only:
        cell = next(c for c in cells(False) if c.name == name(CHECK, K, RECIPE_LR))
        rec = run(cell, 0)
        same, text = _same_run(rec, part3_records[f"{CHECK} k={K}"][0])
        check = {"same": same, "text": text}
        print(f"numerics check: {'same' if same else 'changed'}: {text}", flush=True)
    reuse = bool(check and check["same"])
    records = {}
    for cell in todo:
        old = PART3.get(cell.name.removesuffix(f" lr={RECIPE_LR}"))
        if cell.name.endswith(f"lr={RECIPE_LR}") and old and reuse:
            records[cell.name] = part3_records[old][: len(seeds)]
            continue
        for seed in seeds:
            rec = run(cell, seed)
            if rec is not None:
                records.setdefault(cell.name, []).append(rec)
    start_greedy = start["curve"][-1][1] if start else float("nan")
    summary = {
        "command": "python -m studies.regime.study " + " ".join(argv or []),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_rollouts": steps, "prompts_per_step": P, "group_size": G, "eval_n": eval_n,
        "start": start and {"curve": start["curve"]}, "start_greedy": start_greedy,
        "start_avg16": float(np.mean([r["curve_sampled"][0][1] for rs in records.values()
                                      for r in rs])) if records else float("nan"),
        "numerics_check": check,
        "cells": {n: summarise(recs, budget, start_greedy) for n, recs in records.items()},
        "wall_time_s": time.perf_counter() - t0,
    }  # fmt: skip
    with open(os.path.join(args.out, part3.RECORDS), "wb") as raw:  # mtime 0: the same bytes
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(json.dumps(records, separators=(",", ":")).encode())
    block = report_block(summary, records, config.data.eval_size)
    md = "\n".join([f"# Part 3b: where GVPO holds on stale samples ({summary['date']})", "",
                    block, ""])  # fmt: skip
    write_results(args.out, summary, md)
    if summary["cells"]:
        plot(summary, os.path.join(args.out, "regime.png"))
    if args.study_md:
        part3.write_block(args.study_md, block, BEGIN, END)
    print(md)
    return summary


BEGIN, END = "<!-- part3b:begin -->", "<!-- part3b:end -->"

if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
