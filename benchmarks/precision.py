"""Mixed precision: fp32 vs bf16 compute on this CPU (speed), and the update's compiled memory.

Run from the repo root:
    .venv/bin/python -m benchmarks.precision speed [--repeats 5] [--quick]
    .venv/bin/python -m benchmarks.precision memory [--layers 2] [--devices 8] [--quick]

speed: the bench-45m update step (the trainer's jitted GVPO update, one-device mesh, 8 prompts x 4
responses of 64 + 128 tokens, as benchmarks/update_step.py) and the rollout (sampler.generate,
8 x 4, 64 prompt + 128 new tokens, EOS off, as benchmarks/rollout.py), each with fp32 masters
computing in fp32 and in bf16, timed round-robin in one process (common.interleave). Both
variants share the same fp32 parameters; only `ModelConfig.compute_dtype` differs.

memory: XLA's memory analysis of the compiled RL update (`plan.compile_train_step`) for
configs/qwen_math.py cut to `--layers` layers (full width, 1024 + 1024 tokens) on `--devices` fake
CPU devices (FSDP), fp32 vs bf16 compute, next to the planner's estimate of the same step
(`--quick`: the tiny preset, 1 layer, 16 + 16 tokens: the same code path in seconds).
"""

from __future__ import annotations

import argparse
import os
import sys

if "memory" in sys.argv:  # fake devices must be set before jax is imported
    n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), "8")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.update_step import FULL, QUICK, make_batch, ours_bench  # noqa: E402
from gvpo_jax import models, plan, sampler, sharding  # noqa: E402

GiB = 2**30
DTYPES = ("float32", "bfloat16")


def rollout_bench(model, prompts, group, prompt_len, new_tokens) -> common.LocalBench:
    prompt_ids = common.random_prompts(model.config.vocab_size, prompts, prompt_len)
    lens = np.full((prompts,), prompt_len, np.int32)
    settings = sampler.SamplingSettings(
        max_new_tokens=new_tokens, temperature=1.0, group_size=group
    )
    seed = [0]

    def call():
        seed[0] += 1
        out = sampler.generate(model, prompt_ids, lens, settings, rng=jax.random.key(seed[0]))
        jax.block_until_ready(out)
        assert int(out.lengths_B.min()) == new_tokens  # EOS off: every row runs to the end

    return common.LocalBench(call)


def speed(args) -> dict:
    shape = QUICK if args.quick else FULL
    base = common.bench_model(quick=args.quick)
    chunk = 128
    batch = make_batch(base, chunk=chunk, **shape)
    benches = {}
    for dtype in DTYPES:
        model = models.with_compute_dtype(base, dtype)
        benches[f"update {dtype}"] = ours_bench(
            model, batch, "gvpo", chunk=chunk,
            **{k: shape[k] for k in ("group", "prompt_len", "new_tokens")},
        )  # fmt: skip
    for dtype in DTYPES:
        model = models.with_compute_dtype(base, dtype)
        benches[f"rollout {dtype}"] = rollout_bench(
            model, shape["prompts"], shape["group"], shape["prompt_len"], shape["new_tokens"]
        )
    print(common.describe_machine())
    results = common.interleave(benches, args.repeats)
    rows = []
    for name, r in results.items():
        t = common.Timing.from_dict(r["timing"])
        rows.append(
            [
                name,
                f"{t.first_s:.1f}",
                f"{t.compile_s:.1f}",
                f"{min(t.times_s):.3f}",
                f"{float(np.median(t.times_s)):.3f}",
                f"{max(t.times_s):.3f}",
                f"{float(np.median(t.cpu_s)):.3f}",
                f"{float(np.mean(t.loads)):.2f}",
            ]
        )
    print(
        common.md_table(
            [
                "step",
                "first call s",
                "compile s",
                "best s",
                "median s",
                "worst s",
                "median CPU s",
                "load",
            ],
            rows,
        )
    )
    for kind in ("update", "rollout"):
        t32, t16 = (common.Timing.from_dict(results[f"{kind} {d}"]["timing"]) for d in DTYPES)
        per_round = [b / a for a, b in zip(t32.times_s, t16.times_s, strict=True)]
        print(f"{kind}: bf16 / fp32 time per round: median {np.median(per_round):.2f} "
              f"(min {min(per_round):.2f}, max {max(per_round):.2f})")  # fmt: skip
    common.emit_json("precision_speed", results)
    return results


def memory(args) -> list:
    from configs import qwen_math

    rows = []
    for dtype in DTYPES:
        c = qwen_math.get_config()
        c.model.hf_dir = ""  # shapes from the preset
        c.model.overrides.num_layers = args.layers  # on top of the preset, full width
        if args.quick:
            c.model.preset, c.model.overrides.num_layers = "tiny", 1
            c.data.max_prompt_len = c.rollout.max_new_tokens = 16
            c.model.logprob_chunk = 16
        c.model.compute_dtype = dtype
        c.mesh.fsdp = -1
        c.rollout.prompts_per_step = args.prompts
        c.algo.num_minibatches = 1
        c.optim.micro_batches = args.micro_batches
        c.model.attention = args.attention
        estimate = plan.plan_memory(c, args.devices)
        mesh = sharding.make_mesh(*plan.resolve_mesh(c, args.devices))
        mem = plan.compile_train_step(c, mesh).memory_analysis()
        xla = mem.argument_size_in_bytes + mem.temp_size_in_bytes
        rows.append([
            dtype, f"{estimate.params / GiB:.3f}", f"{estimate.opt_state / GiB:.3f}",
            f"{estimate.compute_copy / GiB:.3f}", f"{estimate.gathered / GiB:.3f}",
            f"{estimate.gradients / GiB:.3f}",
            f"{estimate.activations / GiB:.3f}", f"{estimate.update_peak / GiB:.3f}",
            f"{mem.argument_size_in_bytes / GiB:.3f}", f"{mem.temp_size_in_bytes / GiB:.3f}",
            f"{xla / GiB:.3f}", f"{estimate.update_peak / xla:.2f}",
        ])  # fmt: skip
        print(rows[-1], flush=True)
    print(
        ("the tiny preset, 1 layer, 16 + 16 tokens: " if args.quick else "")
        + f"configs/qwen_math.py, {args.layers} layers at full width, {args.prompts} prompts x 4 "
        f"responses of 1024 + 1024 tokens in one minibatch of {args.micro_batches} "
        f"micro-batches, {args.devices} fake CPU devices (FSDP), attention={args.attention}; "
        "GiB per device"
    )
    print(
        common.md_table(
            [
                "compute",
                "masters",
                "Adam",
                "cast copy",
                "gathered layer",
                "grads",
                "activations",
                "planner peak",
                "XLA arguments",
                "XLA temporaries",
                "XLA args + temps",
                "planner / XLA",
            ],
            rows,
        )
    )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["speed", "memory"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a one-layer tiny model")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--micro_batches", type=int, default=1)
    parser.add_argument("--attention", default="auto", help="memory: model.attention")
    args = parser.parse_args(argv)
    return speed(args) if args.what == "speed" else memory(args)


if __name__ == "__main__":
    main()
