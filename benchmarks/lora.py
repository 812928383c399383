"""LoRA (rank 16) against full fine-tuning on `configs/smollm2_arith.py` (BENCHMARKS.md "LoRA").

    python -m benchmarks.lora --seeds=0,1,2 --workdir=runs/lora_bench     # the comparison
    python -m benchmarks.lora --report --workdir=runs/lora_bench          # its table
    python -m benchmarks.lora --sampler                                   # adapters vs merged
    python -m benchmarks.lora --quick --workdir=/tmp/lora                 # tiny model, 2 steps

The comparison runs the config as it is (20 GVPO steps) and its LoRA variant (the command-line
override documented in the config) for each seed, each run in its own process, interleaved
(full s0, lora s0, full s1, ...), each through `train.run`, and records per run: the mean update
time of steps 2.. (step 1 compiles), the process's peak RSS, XLA's compiled memory of the update
(arguments + temporaries + outputs of the jitted step, compiled from shapes by
`plan.compile_train_step` after the run), and held-out greedy accuracy at the start and the
end. Records go to `<workdir>/records/<arm>_s<seed>.json` as each run ends; a recorded run is
skipped, so the script continues where it stopped.

`--report` prints the table of BENCHMARKS.md from the records (per arm, over seeds: the median
update time of each run, peak RSS, the compiled update's memory, greedy accuracy start -> end).

`--sampler` times one rollout of the config with the adapters applied in every decode step
against the same adapters merged into the weights once before the rollout (the merge included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The LoRA variant documented in configs/smollm2_arith.py (--config.lora.enabled=True
# --config.optim.lr=2e-4): rank 16, alpha 32, every projection, 40x full fine-tuning's rate.
LORA_OVERRIDES = {"lora.enabled": True, "optim.lr": 2e-4}
ARMS = {"full": {}, "lora": LORA_OVERRIDES}
# Not in the default run (--arms=...): the same LoRA at 10x full fine-tuning's rate.
EXTRA_ARMS = {"lora_lr5e-5": {"lora.enabled": True, "optim.lr": 5e-5}}
CONFIG = "configs/smollm2_arith.py"
# --quick: the same code paths on a tiny random model with the character tokenizer, 2 steps.
QUICK = {
    "model.gguf": "", "model.preset": "tiny", "tokenizer.kind": "char",
    "data.use_chat_template": False, "data.arith.style": "symbolic", "data.max_prompt_len": 16,
    "data.rewards": "exact_match:1", "data.eval_size": 8, "rollout.max_new_tokens": 4,
    "algo.overlong_cache": 2, "train.steps": 2, "train.eval_every": 0, "lora.rank": 4,
}  # fmt: skip


def load_config(overrides: dict, quick: bool = False):
    import importlib.util

    from gvpo_jax import config as config_lib

    spec = importlib.util.spec_from_file_location("smollm2_arith", os.path.join(REPO, CONFIG))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = config_lib.set_fields(module.get_config(), {**(QUICK if quick else {}), **overrides})
    config_lib.validate(c)
    return c


def child(arm: str, seed: int, workdir: str, quick: bool = False) -> None:
    """One run in this process (`train.run`, each step's update time taken by its `on_step`),
    then XLA's memory analysis of the same update compiled from shapes (`plan`)."""
    import jax
    import numpy as np

    from gvpo_jax import plan, sharding, train

    extra = {"seed": seed, "train.plot": False, "train.export": False}
    c = load_config({**{**ARMS, **EXTRA_ARMS}[arm], **extra}, quick)
    update_times = {}

    def on_step(step, state, m) -> bool:
        update_times[step] = float(m["update_time_s"])
        return False

    t0 = time.time()
    summary = train.run(c, workdir, on_step=on_step)
    wall = time.time() - t0
    mesh = sharding.make_mesh(*plan.resolve_mesh(c, jax.device_count()))
    mem = plan.compile_train_step(c, mesh).memory_analysis()
    compiled = dict(
        argument_bytes=mem.argument_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        output_bytes=mem.output_size_in_bytes,
    )
    updates = [t for step, t in update_times.items() if step > 1]  # step 1 compiles
    record = {
        "arm": arm,
        "seed": seed,
        "overrides": {**ARMS, **EXTRA_ARMS}[arm],
        "steps": len(update_times),
        "update_time_s": float(np.mean(updates)),
        "update_time_median_s": float(np.median(updates)),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "compiled_update_gib": {k: v / 2**30 for k, v in compiled.items()},
        "greedy_start": summary.get("eval_start"),
        "greedy_end": summary.get("eval_end"),
        "wall_s": wall,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),  # fmt: skip
    }
    print("RECORD " + json.dumps(record), flush=True)


def sampler_timing(quick: bool = False) -> dict:
    """One rollout of the LoRA config: adapters applied in every step vs merged once."""
    import statistics

    import jax
    from flax import nnx

    from benchmarks import workers
    from gvpo_jax import assemble, rollout, sampler
    from gvpo_jax.models import lora

    c = load_config(LORA_OVERRIDES, quick)
    run_, state = assemble.assemble(c, workers.scratch_dir("lora_sampler_"))
    loop = assemble.start_loop(run_)
    examples = rollout.next_examples(run_.task, run_.mesh, loop, c.rollout.prompts_per_step)
    prompts = [ex["prompt_ids"] for ex in examples]

    def rollout(model, seed):
        out = sampler.sample_groups(
            model, prompts, settings=run_.sampling, rng=jax.random.key(seed), mesh=run_.mesh,
            rules=run_.rules,
        )  # fmt: skip
        return jax.block_until_ready(out.tokens_BxN)

    times = {"applied": [], "merged": [], "merge_only": []}
    for i in range(3 if quick else 11):  # the first of each compiles; alternated (load drifts)
        t0 = time.perf_counter()
        rollout(run_.model(state.params), i)
        times["applied"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        merged = lora.merged(run_.model(state.params))
        jax.block_until_ready(nnx.state(merged))
        times["merge_only"].append(time.perf_counter() - t0)
        rollout(merged, i)
        times["merged"].append(time.perf_counter() - t0)
    run_.writer.close()
    run_.task.close()
    run_.ckpt.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    result = {"median_s": med, "all_s": {k: [round(t, 3) for t in v] for k, v in times.items()}}
    print(json.dumps(result))
    return result


def report(root: str) -> str:
    """The markdown table of the recorded runs (update time: each run's median over its steps,
    read from its metrics, then mean +- std over seeds); printed and returned."""
    import glob
    import statistics as st

    from gvpo_jax import metrics

    records = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(root, "records", "*")))]
    lines = [
        "| arm | lr | seeds | update (s, median per run) | peak RSS (GiB) | compiled update: "
        "arguments + temporaries (GiB) | greedy start -> end (each seed) | mean end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in sorted({r["arm"] for r in records}, key=lambda a: (a != "full", a)):
        rs = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["seed"])
        med = []
        for r in rs:
            rows = metrics.read_jsonl(os.path.join(root, f"{arm}_s{r['seed']}", "metrics.jsonl"))
            med.append(st.median(x["update_time_s"] for x in rows
                                 if "update_time_s" in x and x["step"] > 1))  # fmt: skip
        sd = lambda xs: f" +- {st.stdev(xs):.2f}" if len(xs) > 1 else ""  # noqa: E731
        mem = rs[0]["compiled_update_gib"]
        ends = [r["greedy_end"] for r in rs]
        lr = rs[0]["overrides"].get("optim.lr", 5e-6)
        lines.append(f"| {arm} | {lr:g} | {len(rs)} | {st.mean(med):.2f}{sd(med)} | "
                     f"{st.mean(r['peak_rss_gib'] for r in rs):.2f} | "
                     f"{mem['argument_bytes']:.3f} + {mem['temp_bytes']:.3f} | "
                     + ", ".join(f"{r['greedy_start']:.3f} -> {r['greedy_end']:.3f}" for r in rs)
                     + f" | {st.mean(ends):.3f}{sd(ends)} |")  # fmt: skip
    print("\n".join(lines))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/lora_bench", help="records and each run's workdir")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join({**ARMS, **EXTRA_ARMS})}")
    p.add_argument("--report", action="store_true", help="the table of the recorded runs")
    p.add_argument("--sampler", action="store_true", help="adapters applied vs merged")
    p.add_argument("--quick", action="store_true", help="a tiny random model, 2 steps (tests)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # arm,seed,workdir
    args = p.parse_args(argv)
    if args.child:
        arm, seed, workdir = args.child.split(",")
        child(arm, int(seed), workdir, args.quick)
        return
    if args.report:
        report(args.workdir)
        return
    if args.sampler:
        sampler_timing(args.quick)
        return
    os.makedirs(os.path.join(args.workdir, "records"), exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            path = os.path.join(args.workdir, "records", f"{arm}_s{seed}.json")
            if os.path.exists(path):
                continue
            workdir = os.path.join(args.workdir, f"{arm}_s{seed}")
            cmd = [sys.executable, "-m", "benchmarks.lora", f"--child={arm},{seed},{workdir}"]
            out = subprocess.run(cmd + ["--quick"] * args.quick, capture_output=True, text=True,
                                 cwd=REPO)  # fmt: skip
            lines = [x for x in out.stdout.splitlines() if x.startswith("RECORD ")]
            if out.returncode or not lines:
                print(out.stdout[-2000:], out.stderr[-4000:], flush=True)
                raise SystemExit(f"{arm} seed {seed} failed (exit {out.returncode})")
            record = json.loads(lines[-1][len("RECORD ") :])
            with open(path, "w") as f:
                json.dump(record, f, indent=2)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
