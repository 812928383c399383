"""The tool task's curves (STUDY.md "Tools"): configs/arith_tools.py over a few seeds.

Run (resumable: each finished seed is a record under studies/tools/results/records.json; writes
results.md and curves.png there, and with --study-md the table into STUDY.md):
    .venv/bin/python -m studies.tools.study --seeds 0,1,2
    .venv/bin/python -m studies.tools.study --report-only --study-md STUDY.md

Each seed runs the config whole (its SFT start, then GVPO with the calculator in the rollout)
and keeps, from its metrics, every held-out evaluation (greedy, avg@8 at T = 1, the calls per
response and the share answered with an error, greedy and sampled) and every RL step's reward
and tool metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from gvpo_jax import train
from gvpo_jax.eval import git_commit
from studies.report import write_results
from studies.stats import ci95

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
EVAL_KEYS = ("eval/greedy", "eval/avg@8", "eval/tools/calls_per_response",
             "eval/tools/failed_frac", "eval/tools/greedy_calls_per_response",
             "eval/tools/greedy_failed_frac")  # fmt: skip
STEP_KEYS = ("reward_mean", "tools/calls_per_response", "tools/failed_frac", "tools/turns_mean",
             "tools/token_share", "response_len_mean")  # fmt: skip


def config(seed: int, steps: int | None = None):
    from configs import arith_tools

    c = arith_tools.get_config()
    c.seed = seed
    if steps is not None:
        c.train.steps = steps
    return c


def record_of(workdir: str, seed: int, seconds: float) -> dict:
    """The seed's evaluations (the last step-0 one is the RL start, after SFT; the first is
    before SFT) and its RL steps, from metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = [
        {"step": r["step"], **{k: r[k] for k in EVAL_KEYS if k in r}}
        for r in rows
        if "eval/greedy" in r
    ]
    steps = [
        {"step": r["step"], **{k: r[k] for k in STEP_KEYS}}
        for r in rows
        if all(k in r for k in STEP_KEYS)
    ]
    return {"seed": seed, "evals": evals, "steps": steps, "seconds": seconds}


def load() -> dict:
    path = os.path.join(RESULTS, "records.json")
    return json.load(open(path)) if os.path.exists(path) else {"records": []}


def save(data: dict) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "records.json"), "w") as f:
        json.dump(data, f, indent=1)


def _mean_sd(values) -> str:
    v = np.asarray(values, float)
    return f"{v.mean():.3f} +- {v.std(ddof=1) if len(v) > 1 else 0:.3f}"


def report(data: dict, study_md: str | None) -> str:
    recs = sorted(data["records"], key=lambda r: r["seed"])
    if not recs:
        return "no records"
    start = [r["evals"][1] for r in recs]  # after SFT: the RL start
    end = [r["evals"][-1] for r in recs]
    lines = [
        f"configs/arith_tools.py, {len(recs)} seeds ({', '.join(str(r['seed']) for r in recs)}), "
        f"{recs[0]['evals'][-1]['step']} RL steps each, at commit {data.get('commit', '?')}; "
        "mean +- sd over seeds.",
        "",
        "| | RL start (after SFT) | end of RL |",
        "|---|---|---|",
    ]
    rows = [
        ("greedy accuracy", "eval/greedy"),
        ("avg@8 accuracy (T = 1)", "eval/avg@8"),
        ("calls per response, greedy", "eval/tools/greedy_calls_per_response"),
        ("calls per response, T = 1", "eval/tools/calls_per_response"),
        ("calls answered with an error, T = 1", "eval/tools/failed_frac"),
    ]
    for name, key in rows:
        lines.append(
            f"| {name} | {_mean_sd([e[key] for e in start])} | {_mean_sd([e[key] for e in end])} |"
        )
    before = [r["evals"][0]["eval/greedy"] for r in recs]
    lines += ["", f"Before SFT (random init): greedy {_mean_sd(before)}."]
    for name, key in rows[:2]:  # the gain, paired by seed (each seed's own start)
        gain = [e[key] - s[key] for s, e in zip(start, end, strict=True)]
        each = ", ".join(f"{g:+.3f}" for g in gain)
        lines.append(
            f"Gain in {name} over each seed's start: {np.mean(gain):+.3f} +- {ci95(gain):.3f} "
            f"(95% t interval over the seeds; per seed {each})."
        )
    text = "\n".join(lines)
    _plot(recs, os.path.join(RESULTS, "curves.png"))
    summary = {"seeds": [r["seed"] for r in recs], "start": start, "end": end}
    write_results(RESULTS, summary, text)
    if study_md:
        md = open(study_md).read()
        a, b = "<!-- tools:begin -->\n", "<!-- tools:end -->"
        if a in md and b in md:
            md = md[: md.index(a) + len(a)] + text + "\n" + md[md.index(b) :]
            open(study_md, "w").write(md)
    return text


def _plot(recs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for r in recs:
        ev = r["evals"][1:]  # from the RL start
        x = [e["step"] for e in ev]
        axes[0].plot(x, [e["eval/greedy"] for e in ev], "o-", label=f"greedy, seed {r['seed']}")
        axes[0].plot(x, [e["eval/avg@8"] for e in ev], "s--", label=f"avg@8, seed {r['seed']}")
        axes[1].plot(x, [e["eval/tools/calls_per_response"] for e in ev], "o-",
                     label=f"seed {r['seed']}")  # fmt: skip
        st = r["steps"]
        axes[2].plot(
            [s["step"] for s in st], [s["reward_mean"] for s in st], label=f"seed {r['seed']}"
        )
    axes[0].set(title="held-out accuracy", xlabel="RL step", ylim=(0, 1))
    axes[1].set(title="calls per response (held-out, T = 1)", xlabel="RL step")
    axes[2].set(title="rollout reward", xlabel="RL step", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--workdir", default="runs/study_tools")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--study-md", default=None)
    args = p.parse_args()
    data = load()
    if not args.report_only:
        data["commit"] = git_commit(HERE)
        done = {r["seed"] for r in data["records"]}
        for seed in (int(s) for s in args.seeds.split(",")):
            if seed in done:
                continue
            workdir = os.path.join(args.workdir, f"s{seed}")
            t0 = time.perf_counter()
            train.run(config(seed, args.steps), workdir)
            data["records"].append(record_of(workdir, seed, time.perf_counter() - t0))
            save(data)
    print(report(data, args.study_md))


if __name__ == "__main__":
    from gvpo_jax import programs

    programs.tune_gc()  # the collector set for tracing, as the CLI sets it
    main()
