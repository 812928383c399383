"""Asynchronous rollouts on a fake 4 + 4 CPU mesh: the timeline of one run, and the step-time
model's R (rollout), U (update) and W (weight transfer) measured here.

Run: `XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m
benchmarks.async_timeline [--steps 6] [--out docs/async_timeline.png]` (about 2 minutes on 2
CPU cores; `--quick`: a 1-layer model, 3 steps, no picture).

Workload: a from-scratch 2-layer model (D = 256, char tokenizer), GRPO with token_tis, P = 8
prompts x G = 4, N = 32 new tokens on the arithmetic task. Three runs of `rl_step`, each after
one warm-up step (compiles) on the same run:
  sync 4     staleness 0 on the 4 training devices: R and U of a synchronous step;
  async 4+4  staleness 1, mesh.rollout_devices = 4: the sampler thread on the last 4 devices
             while the update runs on the first 4 (the timeline picture);
  W          `SamplingMesh.send` of the policy (cast + device-to-device copy), blocked on.
All fake devices share the same 2 cores, so the overlap shows in the timeline but does not
shorten the step here: on real chips the two meshes are separate hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax

from benchmarks import common, workers


def build(quick: bool, staleness: int, devices: int, rollout_devices: int):
    from gvpo_jax import assemble
    from gvpo_jax import config as config_lib

    c = config_lib.base_config()
    width = 64 if quick else 256
    c.model.overrides.update(dict(hidden_size=width, num_layers=1 if quick else 2, num_heads=4,
                                  num_kv_heads=2, head_dim=width // 4,
                                  intermediate_size=4 * width))  # fmt: skip
    changes = {
        "algo.name": "grpo", "algo.kl_coef": 0.0, "train.kl_ref_metric": False,
        "rollout.prompts_per_step": 8,
        "rollout.group_size": 4, "rollout.max_new_tokens": 8 if quick else 32,
        "algo.overlong_cache": 2, "data.max_prompt_len": 16, "train.reward_workers": 0,
        "rollout.staleness": staleness, "mesh.num_devices": devices,
        "mesh.rollout_devices": rollout_devices, "mesh.data": -1,
        "algo.rollout_correction": "token_tis",
    }  # fmt: skip
    config_lib.set_fields(c, changes)
    config_lib.validate(c)
    run, state = assemble.assemble(c, workers.scratch_dir("gvpo_async_"))
    return run, state, assemble.start_loop(run)


def run_steps(run, state, loop, steps: int):
    from gvpo_jax.rl_step import rl_step

    rows = []
    for _ in range(steps + 1):  # the first compiles
        t0 = time.time()
        state, m, _, _ = rl_step(run, state, loop, None)
        loop.step += 1
        rows.append({**{k: float(v) for k, v in m.items()}, "step_start": t0,
                     "step_end": time.time()})  # fmt: skip
    return state, rows[1:]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="docs/async_timeline.png")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    steps = 3 if args.quick else args.steps
    result = {"load1_before": common.load1(), "steps": steps}

    run, state, loop = build(args.quick, 0, 4, 0)
    _, sync = run_steps(run, state, loop, steps)
    result["sync"] = {
        "R": statistics.median(r["rollout_time_s"] + r["reward_time_s"] for r in sync),
        "U": statistics.median(r["logprob_time_s"] + r["update_time_s"] for r in sync),
        "step": statistics.median(r["step_end"] - r["step_start"] for r in sync),
    }
    run, state, loop = build(args.quick, 1, 8, 4)
    state, rows = run_steps(run, state, loop, steps)
    send = run.sampling_mesh.send
    jax.block_until_ready(send(state.params))
    w = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(send(state.params))
        w.append(time.perf_counter() - t0)
    overlap = [
        max(0.0, min(r["timeline/sample_end"], r["timeline/update_end"])
            - max(r["timeline/sample_start"], r["timeline/update_start"]))
        for r in rows
    ]  # fmt: skip
    result["async"] = {
        "R": statistics.median(r["timeline/sample_end"] - r["timeline/sample_start"] for r in rows),
        "U": statistics.median(r["timeline/update_end"] - r["timeline/update_start"] for r in rows),
        "W": statistics.median(w),
        "overlap": statistics.median(overlap),
        "step": statistics.median(r["step_end"] - r["step_start"] for r in rows),
        "lag": [r["rollout_lag"] for r in rows],
    }
    result["load1_after"] = common.load1()
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.quick:
        plot(rows, args.out)
    return result


def plot(rows, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = rows[0]["step_start"]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for r in rows:
        ax.barh(1, r["timeline/update_end"] - r["timeline/update_start"],
                left=r["timeline/update_start"] - t0, color="tab:blue", height=0.5)  # fmt: skip
        ax.barh(0, r["timeline/sample_end"] - r["timeline/sample_start"],
                left=r["timeline/sample_start"] - t0, color="tab:orange", height=0.5)  # fmt: skip
        ax.axvline(r["step_start"] - t0, color="0.7", lw=0.8, zorder=0)
    ax.set_yticks([0, 1], ["sampling mesh (4 devices):\nrollout of step t+1",
                           "training mesh (4 devices):\nupdate of step t"])  # fmt: skip
    ax.set_xlabel("seconds (grey lines: step starts)")
    ax.set_title("rollout.staleness = 1, mesh.rollout_devices = 4 (fake CPU devices)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
