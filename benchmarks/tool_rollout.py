"""The cost of tools in the rollout: a policy token with tools against one without, and the
time the device waits on tools.

Run: `.venv/bin/python -m benchmarks.tool_rollout [--repeats 5] [--workdir runs/study_tools/s0]`
or `--quick` (a 1-layer model, a few rows: the same code paths in seconds).

Workload: configs/arith_tools.py's model and task (64 prompts "417*286=" x 4 samples, N = 28,
the bracket calculator). With `--workdir`, the trained policy of that run (its checkpoint:
every row calls once and answers), else random weights (calls at random). Arms, timed
round-robin (`common.interleave`), each the whole rollout of one batch:
  plain         the single-turn sampler (`sampler.sample_groups`, static batch) on the same
                prompts and settings: no call is answered;
  tools         the multi-turn rollout with the calculator (microseconds per call), decode
                chunks of 32 steps (the default);
  tools+20ms    the same with every answer 20 ms late (a tool as slow as a small Python call),
                chunks of 32: the other rows decode meanwhile;
  tools+20ms/0  the same without chunks: every call of a turn waits for the turn's last row.
Columns: median and spread of the rollout's wall time, the policy's tokens and the answers'
tokens in it, seconds per policy token, the ratio to plain's per-token cost (the issue's
target: <= 1.3 with the calculator), and the share of the rollout the device sat idle on tools
(target: < 10% with the 20 ms tool and chunks).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common, workers  # noqa: E402
from gvpo_jax import assemble, resume, sampler  # noqa: E402
from gvpo_jax import config as config_lib  # noqa: E402


def setup(quick: bool, workdir: str | None):
    from configs import arith_tools

    c = arith_tools.get_config()
    c.sft.steps, c.train.steps = 0, 1
    if quick:
        c.model.overrides.num_layers = 1
        c.rollout.prompts_per_step = 4
        c.mesh.num_devices = 1  # one device, as on a plain CPU (the suite fakes eight)
    if workdir:  # its newest checkpoint, read into a scratch run directory
        c.restore_from = os.path.join(os.path.abspath(workdir), "checkpoints")
    config_lib.validate(c)
    run, state = assemble.assemble(c, workers.scratch_dir("gvpo_tool_bench_"))
    if workdir:
        state = resume.restore(run, state, assemble.start_loop(run))[0]
    examples, _ = run.task.next_train(c.rollout.prompts_per_step, run.task.start)
    return run, state, [ex["prompt_ids"] for ex in examples]


def arms(run, params, prompts, rng):
    model = run.rollout_model(params)
    out = {}

    def plain():
        o = sampler.sample_groups(
            model, prompts, settings=run.sampling, rng=rng, mesh=run.mesh, rules=run.rules
        )
        out["plain"] = (int(np.sum(o.lengths_B)), 0, 0.0, 0.0)

    def tools(name, late_s=0.0, chunk=None):
        t = run.tools
        if chunk is not None:
            t = dataclasses.replace(t, settings=dataclasses.replace(t.settings, chunk=chunk))
        if late_s:
            answer = t.format.answer

            class Slow:  # the format with every answer late_s seconds late
                def __getattr__(self, k):
                    return getattr(t.format, k)

                def answer(self, text, room):
                    time.sleep(late_s)
                    return answer(text, room)

            t = dataclasses.replace(t, format=Slow())

        def fn():
            t0 = time.perf_counter()
            o = t.sample(model, prompts, tokenizer=run.tokenizer, rng=rng, mesh=run.mesh,
                         rules=run.rules)  # fmt: skip
            wall = time.perf_counter() - t0
            out[name] = (int(o.policy_BxN.sum()), int(o.tool_tokens_B.sum()), o.tool_wait_s / wall,
                         o.tool_wait_s)  # fmt: skip

        return fn

    benches = {
        "plain": plain,
        "tools": tools("tools"),
        "tools+20ms": tools("tools+20ms", 0.02),
        "tools+20ms/0": tools("tools+20ms/0", 0.02, chunk=0),
    }
    return benches, out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", default=None, help="a run of configs/arith_tools.py to load")
    args = p.parse_args(argv)
    run, state, prompts = setup(args.quick, args.workdir)
    fns, counts = arms(run, state.params, prompts, jax.random.key(0))
    repeats = 1 if args.quick else args.repeats
    results = common.interleave({k: common.LocalBench(f) for k, f in fns.items()}, repeats)
    base = None
    rows = []
    for name, r in results.items():
        timing = common.Timing.from_dict(r["timing"])
        policy, answers, wait, _ = counts[name]
        per_token = timing.median / max(policy, 1)
        base = per_token if name == "plain" else base
        spread = f"{min(timing.times_s):.3f}-{max(timing.times_s):.3f}"
        rows.append([name, f"{timing.median:.3f}", spread, policy, answers,
                     f"{per_token * 1e6:.1f}", f"{per_token / base:.2f}x",
                     "-" if name == "plain" else f"{wait:.1%}", len(r["recompiled"])])  # fmt: skip
    print(common.describe_machine())
    print(common.md_table(["arm", "median s", "spread s", "policy tokens", "answer tokens",
                           "us / policy token", "vs plain", "device idle on tools",
                           "recompiles"], rows))  # fmt: skip
    # The last call's counts per arm, unformatted: tokens, answers, seconds idle on tools.
    last = {
        k: dict(zip(("policy", "answers", "idle_frac", "wait_s"), v, strict=True))
        for k, v in counts.items()
    }
    result = {"rows": rows, "last": last, "machine": common.machine_info()}
    common.emit_json("tool_rollout", result)
    run.task.close()
    run.writer.close()
    return result


if __name__ == "__main__":
    main()
