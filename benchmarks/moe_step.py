"""A whole RL step of the small MoE (configs/moe_arith.py) against a dense model of the same
active size, and the MoE's step across dispatches and expert counts.

Run: `.venv/bin/python -m benchmarks.moe_step [--rounds 6] [--quick]` (about 6 minutes on 2
CPU cores; `--quick`: 2 rounds of small steps, for the tests).

Variants, each a run assembled from configs/moe_arith.py (random start, no SFT: the step's cost
does not depend on what the weights say, only on the lengths they sample, which are reported):
  - dense: Qwen3 layers with a dense SwiGLU MLP of width k x F = 192, the MoE's active width;
  - moe E=8 grouped: the config as it is (8 experts of width 96, top-2; CPU's grouped path);
  - moe E=8 dense-dispatch: every expert on every token (the reference path);
  - moe E=32 grouped: 32 experts of the same width at top-2 (4x the expert weights, the same
    active FLOPs): the grouped path's cost should stay flat in E;
  - a variant name may add "block=N" (the grouped path's largest block, `moe_block`) and
    "no-metrics" (`train.routing_metrics=false`: no routing record from the sampler, no
    moe/* metrics from the update's forward).
One GVPO step each: the rollout (128 prompts x 4 samples, up to 5 new tokens), rewards, the
old-policy log-prob pass and the update (for the MoE runs the update's forward also sums the
routing metrics, `gvpo_jax.routing`). The variants step round-robin (one step of each per
round, so a drifting load hits them alike); the first round (compilation) is reported apart.
Per variant: the median (min-max) step seconds, each stage's median seconds, response tokens
per second of the rollout and of the update, and the first step's seconds (compile included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from benchmarks import common, workers  # noqa: E402
from gvpo_jax import assemble, resume  # noqa: E402
from gvpo_jax.rl_step import rl_step  # noqa: E402

STAGES = ("rollout_time_s", "reward_time_s", "logprob_time_s", "update_time_s")


def config(variant: str, quick: bool):
    """configs/moe_arith.py as one of the variants, RL only, nothing logged or saved."""
    from configs import moe_arith

    c = moe_arith.get_config()
    o = c.model.overrides
    if variant == "dense":
        o.architecture = "qwen3"
        o.intermediate_size = o.num_experts_per_tok * o.moe_intermediate_size
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
        ):
            del o[name]
    elif variant.startswith("moe"):
        _, experts, dispatch, *extras = variant.split()
        o.num_experts = int(experts.removeprefix("E="))
        o.moe_dispatch = {"grouped": "grouped", "dense-dispatch": "dense"}[dispatch]
        for extra in extras:  # "block=N": the grouped path's largest block; "no-metrics"
            if extra.startswith("block="):
                o.moe_block = int(extra.removeprefix("block="))
            else:
                assert extra == "no-metrics", extra
                c.train.routing_metrics = False
    c.sft.steps = 0
    c.train.eval_every = 0
    c.train.sample_log_every = 0
    c.train.log_every = 10**6
    c.train.checkpoint_every = 10**9
    c.train.compile_ahead = "false"
    if quick:
        c.rollout.prompts_per_step = 8
    return c


VARIANTS = (
    "dense",
    "moe E=8 grouped",
    "moe E=8 grouped no-metrics",
    "moe E=8 dense-dispatch",
    "moe E=32 grouped",
)


class Stepper:
    """One assembled run, stepping once per call; the step's metrics kept."""

    def __init__(self, variant: str, quick: bool):
        c = config(variant, quick)
        self.run, self.state = assemble.assemble(c, workers.scratch_dir("moe_step_"))
        self.loop = assemble.start_loop(self.run)
        self.ref = None
        if self.run.reference.kind == "copy":
            self.ref = resume.reference_copy(self.run, self.state.params)
        self.rows = c.rollout.prompts_per_step * c.rollout.group_size
        self.params = self.run.model(self.state.params).num_params()
        self.steps: list[dict] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.state, m, _, _ = rl_step(self.run, self.state, self.loop, self.ref)
        jax.block_until_ready(self.state.params)
        tokens = m["response_len_mean"] * self.rows
        self.steps.append(dict(step_s=time.perf_counter() - start, tokens=tokens,
                               **{k: m[k] for k in STAGES}))  # fmt: skip


def _spread(xs: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    return (f"{statistics.median(xs) * scale:{fmt}} ({min(xs) * scale:{fmt}}-"
            f"{max(xs) * scale:{fmt}})")  # fmt: skip


def summarise(steppers: dict[str, Stepper]) -> tuple[str, dict]:
    heads = ["variant", "params", "first step s", "step s median (min-max)",
             *(s.removesuffix("_time_s") + " s" for s in STAGES), "rollout tok/s",
             "update tok/s", "step / dense"]  # fmt: skip
    rows, out = [], {}
    base = statistics.median(x["step_s"] for x in steppers["dense"].steps[1:])
    for name, st in steppers.items():
        timed = st.steps[1:]
        step = [x["step_s"] for x in timed]
        stages = {s: statistics.median(x[s] for x in timed) for s in STAGES}
        roll = statistics.median(x["tokens"] / x["rollout_time_s"] for x in timed)
        upd = statistics.median(x["tokens"] / x["update_time_s"] for x in timed)
        rows.append([name, f"{st.params / 1e6:.2f}M", f"{st.steps[0]['step_s']:.1f}",
                     _spread(step), *(f"{stages[s]:.3f}" for s in STAGES), f"{roll:,.0f}",
                     f"{upd:,.0f}", f"{statistics.median(step) / base:.2f}"])  # fmt: skip
        out[name] = dict(
            params=st.params, steps=st.steps, step_over_dense=statistics.median(step) / base
        )
    return common.md_table(heads, rows), out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="steps per variant, the first apart")
    parser.add_argument("--quick", action="store_true", help="small steps, 2 rounds (tests)")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma list of variants")
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    names = [v.strip() for v in args.only.split(",")]
    if "dense" not in names:
        names.insert(0, "dense")
    print(f"# MoE step vs dense, {rounds} rounds\n{common.describe_machine()}\n", flush=True)
    steppers = {name: Stepper(name, args.quick) for name in names}
    for r in range(rounds):
        for st in steppers.values():
            st.step()
        print(f"round {r + 1} done", flush=True)
    table, results = summarise(steppers)
    print("\n" + table + "\n")
    summary = dict(rounds=rounds, machine=common.machine_info(), results=results)
    common.emit_json("MOE_STEP", summary)
    return summary


if __name__ == "__main__":
    main()
