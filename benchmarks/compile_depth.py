"""Compile time against depth, layers unrolled and under one scan (issue 51).

Run: `.venv/bin/python -m benchmarks.compile_depth [--quick]` (about 8 minutes on 2 CPU cores;
`--quick`: the tiny preset at 2 layers, the log-prob and decode compiles and every program timed).

For each model shape and depth L, with `model.scan_layers` off and on, XLA compiles (from
shapes: nothing is allocated) the trainer's programs and the wall time of `.lower().compile()`
is reported, each program compiled once in a fresh process-wide cache state (no persistent
cache; jax's in-memory caches are keyed on the shapes, which differ per depth):
  - update: the RL update as one program (`plan.compile_train_step`: loss, backward, the
    optimizer step), GRPO, bf16 compute on fp32 masters;
  - logprobs: the log-prob pass over a rollout batch (`train_step.jit_logprobs`);
  - decode: `sampler.generate` of 8 prompts x 4, prompt 64, 128 new tokens.
Shapes: SmolLM2-135M's widths on one device at L in {4, 8, 16, 30}, and Qwen3-1.7B's widths on a
fake 8-device mesh (fsdp 2 x tensor 4; the update only) at L in {4, 8, 16, 28}. Then, on
bench-45m (8 layers) compiled both ways, the time of each program once compiled: the median of
5 calls, the layouts alternating call by call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import common  # noqa: E402
from gvpo_jax import config as config_lib  # noqa: E402
from gvpo_jax import models, plan, sampler, sharding, train_step  # noqa: E402

P, G, PROMPT, NEW = 8, 4, 64, 128


def run_config(preset: str, layers: int, scan: bool, *, quick: bool):
    c = config_lib.base_config()
    c.model.preset = preset
    c.model.overrides.num_layers = layers
    c.model.scan_layers = "true" if scan else "false"
    c.model.compute_dtype = "bfloat16"
    c.algo.name = "grpo"
    p, g, prompt, new = (2, 2, 8, 8) if quick else (P, G, PROMPT, NEW)
    c.rollout.prompts_per_step, c.rollout.group_size = p, g
    c.data.max_prompt_len, c.rollout.max_new_tokens = prompt, new
    return c


def compile_seconds(config, mesh, programs) -> dict[str, float]:
    """Seconds of `.lower().compile()` of each named program for `config` on `mesh`."""
    out = {}
    cfg = plan.model_config(config)
    rules = sharding.logical_rules(mesh, cfg)
    graphdef, params = nnx.split(models.abstract_model(cfg), nnx.Param)
    p, g = config.rollout.prompts_per_step, config.rollout.group_size
    prompt, new = config.data.max_prompt_len, config.rollout.max_new_tokens
    if "update" in programs:
        start = time.perf_counter()
        plan.compile_train_step(config, mesh)
        out["update"] = time.perf_counter() - start
    shards = sharding.param_shardings(params, mesh, rules)
    abstract = sharding.abstract_with_shardings(params, shards)
    rows = sharding.batch_sharding(mesh)
    if "logprobs" in programs:
        fn = train_step.jit_logprobs(
            graphdef, prompt_len=prompt, chunk_size=config.model.logprob_chunk, group_size=g,
            mesh=mesh, param_shardings=shards, rules=rules,
        )  # fmt: skip
        tokens = jax.ShapeDtypeStruct((p * g, prompt + new), jnp.int32, sharding=rows)
        mask = jax.ShapeDtypeStruct((p * g, prompt + new), jnp.bool_, sharding=rows)
        start = time.perf_counter()
        fn.lower(abstract, tokens, mask).compile()
        out["logprobs"] = time.perf_counter() - start
    if "decode" in programs:
        settings = sampler.SamplingSettings(max_new_tokens=new, group_size=g, buckets=(prompt,))
        fn = jax.jit(lambda s, ids, lens, key: sampler.generate(
            nnx.merge(graphdef, s), ids, lens, settings, rng=key))  # fmt: skip
        ids = jax.ShapeDtypeStruct((p, prompt), jnp.int32)
        lens = jax.ShapeDtypeStruct((p,), jnp.int32)
        start = time.perf_counter()
        fn.lower(abstract, ids, lens, jax.random.key(0)).compile()
        out["decode"] = time.perf_counter() - start
    return out


def depth_table(preset, depths, mesh, programs, quick) -> list[list]:
    rows = []
    for layers in depths:
        times = {}
        for scan in (False, True):
            config = run_config(preset, layers, scan, quick=quick)
            times[scan] = compile_seconds(config, mesh, programs)
        row = [preset, layers]
        for name in programs:
            row += [f"{times[False][name]:.1f}", f"{times[True][name]:.1f}"]
        rows.append(row)
        print(
            common.md_table(["shape", "L", *_heads(programs)], [row]).splitlines()[-1], flush=True
        )
    return rows


def _heads(programs) -> list[str]:
    return [f"{name} {kind}" for name in programs for kind in ("unrolled", "scanned")]


def step_times(quick: bool, repeats: int) -> list[list]:
    """Seconds per call of each program on bench-45m once compiled, both layouts alternating."""
    cfg = models.PRESETS["tiny"] if quick else models.PRESETS["bench-45m"]
    p, g, prompt, new = (2, 2, 8, 8) if quick else (P, G, PROMPT, NEW)
    vocab = cfg.vocab_size
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, vocab, (p * g, prompt + new)), jnp.int32)
    ids = jnp.asarray(tokens[::g, :prompt])
    lens = jnp.full((p,), prompt, jnp.int32)
    settings = sampler.SamplingSettings(max_new_tokens=new, group_size=g, buckets=(prompt,))
    calls = {}
    for scan in (False, True):
        model = models.Transformer(cfg.replace(scan_layers=scan), rngs=nnx.Rngs(0))
        loss = lambda m: models.token_logprobs(m, tokens).sum()
        update = jax.jit(nnx.grad(loss))
        logprobs = jax.jit(lambda m: models.token_logprobs(m, tokens))
        decode = jax.jit(lambda m, key: sampler.generate(m, ids, lens, settings, rng=key))
        calls[scan] = dict(
            update=lambda m=model, f=update: f(m),
            logprobs=lambda m=model, f=logprobs: f(m),
            decode=lambda m=model, f=decode: f(m, jax.random.key(1)),
        )
        for fn in calls[scan].values():
            jax.block_until_ready(fn())  # compile
    times = {(scan, name): [] for scan in calls for name in calls[scan]}
    for _ in range(repeats):
        for name in ("update", "logprobs", "decode"):
            for scan in (False, True):
                start = time.perf_counter()
                jax.block_until_ready(calls[scan][name]())
                times[(scan, name)].append(time.perf_counter() - start)
    spread = lambda t: f"{statistics.median(t) * 1e3:.1f} ({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})"
    rows = []
    for name in ("update", "logprobs", "decode"):
        a, b = times[(False, name)], times[(True, name)]
        ratio = statistics.median(b) / statistics.median(a)
        rows.append([name, spread(a), spread(b), f"{ratio:.2f}"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# Compile time against depth\n{common.describe_machine()}\n")
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    every = ("update", "logprobs", "decode")
    quick = ("logprobs", "decode")  # (the update's compile is the planner's, which its tests run)
    if args.quick:
        tables = [depth_table("tiny", (2,), one, quick, True)]
    else:
        eight = sharding.make_mesh(1, 2, 4, devices=jax.devices()[:8])
        tables = [depth_table("smollm2-135m", (4, 8, 16, 30), one, every, False),
                  depth_table("qwen3-1.7b", (4, 8, 16, 28), eight, ("update",), False)]  # fmt: skip
    print()
    for table, programs in zip(
        tables, [quick] if args.quick else [every, ("update",)], strict=True
    ):
        print(common.md_table(["shape", "L", *_heads(programs)], table) + "\n")
    rows = step_times(args.quick, args.repeats)
    shape = "tiny" if args.quick else "bench-45m"
    print(f"Once compiled ({shape}; ms per call, median (min-max) of {args.repeats} calls):\n")
    print(common.md_table(["program", "unrolled", "scanned", "scanned / unrolled"], rows))


if __name__ == "__main__":
    main()
