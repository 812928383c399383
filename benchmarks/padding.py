"""What padding costs the update and the log-prob pass: full width vs per-group buckets vs packed.

Run from the repo root: `.venv/bin/python -m benchmarks.padding [--repeats 3] [--quick]`
(bench-45m, 8 prompts x 4 responses, prompt 64, up to 256 response tokens with the long-tailed
length mix of `benchmarks.continuous` (mean ~120 tokens, ~15% of the rows at the cap: the SmolLM2
whole step's), 4 micro-batches; about 15 minutes on 2 cores). Each layout is the trainer's own
(`assemble.step_functions`: the `buckets.Updater` of each layout):
- `full`: every micro-batch spans all 256 response slots (`optim.length_buckets = 0`);
- `buckets`: groups sorted by their longest response, micro-batches cut to 64/128/192/256 slots;
- `packed`: one row per group, its responses back to back behind one prompt copy
  (`optim.pack_groups`), micro-batches cut to one of 16 packed widths (multiples of 64).
`--model smollm2-135m --scan-layers true --layouts packed --algos grpo`: the whole step's
update (`benchmarks.whole_step`) at SmolLM2-135M's shapes with random weights.
Timed round-robin (`common.interleave`) over the same batches (several seeds, compiled in the
warm-up call): one GRPO and one GVPO update per call, and one log-prob pass (forward only).
Also prints each layout's computed response slots per real response token (deterministic), and
that of row-level buckets (rows sorted by length, groups broken: every row then runs its own
prompt copy) with the prompt tokens each layout runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import common, continuous, update_step  # noqa: E402
from gvpo_jax import assemble, buckets, models, sharding, train_step  # noqa: E402
from gvpo_jax import batch as batch_lib  # noqa: E402
from gvpo_jax import config as config_lib  # noqa: E402

FULL = dict(prompts=8, group=4, prompt_len=64, new_tokens=256, micro_batches=4, buckets=4)
QUICK = dict(prompts=4, group=2, prompt_len=8, new_tokens=16, micro_batches=2, buckets=2)
LAYOUTS = ("full", "buckets", "packed")


def make_batches(model, shape: dict, seeds) -> list[dict]:
    """Rollout batches in the trainer's layout with tail-mix response lengths, random tokens,
    random rewards, and old / reference log-probs (the model's own plus noise)."""
    p, g, tp, n = shape["prompts"], shape["group"], shape["prompt_len"], shape["new_tokens"]
    vocab, b = model.config.vocab_size, p * g
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        lengths = continuous.length_mix(b, n, seed=seed, kind="tail")
        mask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
        prompts = common.random_prompts(vocab, p, tp, seed=seed).tolist()
        responses = rng.integers(1, vocab, (b, n)).astype(np.int32)
        batch = batch_lib.layout_batch(prompts, responses, mask, group_size=g, prompt_len=tp,
                                     pad_id=0)  # fmt: skip
        batch["rewards"] = rng.random(b).astype(np.float32)
        noise = rng.standard_normal((b, n)).astype(np.float32)
        batch["old_logp"] = (-2.0 + 0.1 * noise) * mask
        batch["ref_logp"] = (-2.0 + 0.11 * noise) * mask
        out.append(batch)
    return out


def layout_config(algo: str, layout: str, shape: dict):
    c = config_lib.base_config()
    c.algo.name = algo
    if algo != "gvpo":
        c.algo.kl_coef = 0.04
    c.rollout.prompts_per_step, c.rollout.group_size = shape["prompts"], shape["group"]
    c.rollout.max_new_tokens, c.data.max_prompt_len = shape["new_tokens"], shape["prompt_len"]
    c.model.logprob_chunk = 128
    c.optim.lr, c.optim.grad_clip, c.optim.micro_batches = 1e-6, 1.0, shape["micro_batches"]
    c.optim.length_buckets = 0 if layout == "full" else shape["buckets"]
    c.optim.pack_groups = layout == "packed"
    c.train.steps = 10**6
    return c


class Layout:
    """One layout's update and log-prob pass for one algorithm, cycling over the batches."""

    def __init__(self, model, algo: str, layout: str, shape: dict, batches: list[dict]):
        graphdef, params = nnx.split(model, nnx.Param)
        params = jax.tree.map(jnp.copy, params)
        self.config = c = layout_config(algo, layout, shape)
        mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        rules = sharding.logical_rules(mesh, model.config)
        rng = jax.random.key_data(jax.random.key(0))
        tx, _, self.updater = assemble.step_functions(c, graphdef, params, rng, mesh, rules)
        self.state = train_step.init_state_sharded(params, tx, rng, mesh, rules)[0]
        self.batches = [update_step.update_batch(b, self.updater.spec) for b in batches]
        self.mesh, self.i, self.j = mesh, 0, 0

    def update_call(self):
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.state, m = self.updater.update(self.state, batch)
        jax.block_until_ready((self.state, m))

    def logprob_call(self):
        batch = self.batches[self.j % len(self.batches)]
        self.j += 1
        return self.updater.logprobs(self.state.params, batch.tokens, batch.valid)

    def warm(self):
        for _ in self.batches:  # every batch's widths compile here, not while timed
            self.update_call()
            self.logprob_call()


def slot_ratios(batches: list[dict], shape: dict) -> list[list[str]]:
    """Computed response slots per real response token, and prompt slots run, per layout (mean
    over the batches): the update's micro-batches and one log-prob pass (as many chunks)."""
    g, n, tp, m = shape["group"], shape["new_tokens"], shape["prompt_len"], shape["micro_batches"]
    k = shape["buckets"]
    rows = []
    for name, packed, widths, per_row in (
        ("full", False, (n,), False),
        ("per-group buckets", False, buckets.bucket_widths(n, k), False),
        ("packed groups", True, buckets.pack_widths(n, g, k), False),
        ("row-level buckets (groups broken)", False, buckets.bucket_widths(n, k), True),
    ):
        ratio, prompts = [], 0
        for batch in batches:
            real = batch["resp_mask"]
            if per_row:  # each row its own "group": sorted by its own length
                plan = buckets.plan_chunks(real, 1, m, widths)
            else:
                plan = buckets.plan_chunks(real, g, m, widths, packed=packed)
            unit = g if packed else 1
            computed = sum(len(r) // unit * w for r, w in plan)
            ratio.append(computed / real.sum())
            prompts = len(real) * tp if per_row else len(real) // g * tp
        rows.append([name, f"{np.mean(ratio):.3f}", f"{min(ratio):.3f}-{max(ratio):.3f}",
                     str(prompts)])  # fmt: skip
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--seeds", type=int, default=2, help="batches (length draws) cycled")
    parser.add_argument("--algos", default="grpo,gvpo")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes (tests)")
    parser.add_argument(
        "--model",
        default="",
        help="a preset's shapes with random weights, "
        "fp32 (e.g. smollm2-135m: the whole step's model); default bench-45m",
    )
    parser.add_argument("--scan-layers", choices=("preset", "true", "false"), default="preset",
                        help="model.scan_layers of the model timed")  # fmt: skip
    parser.add_argument("--layers", type=int, default=0,
                        help="the model cut to this many layers (0: all)")  # fmt: skip
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    model = common.bench_model(args.quick)
    cfg = model.config
    if args.model and not args.quick:
        cfg = models.PRESETS[args.model].replace(param_dtype="float32", compute_dtype="float32")
    if args.layers and not args.quick:
        cfg = cfg.replace(num_layers=args.layers)
    if args.scan_layers != "preset":
        cfg = cfg.replace(scan_layers=args.scan_layers == "true")
    if cfg != model.config:
        model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    batches = make_batches(model, shape, range(args.seeds))
    name = "quick" if args.quick else (args.model or "bench-45m")
    name += f", {model.config.num_layers} layers"
    print(f"# Padding in the update ({name}, scan_layers={model.config.scan_layers})")
    print(common.describe_machine())
    real = [int(b["resp_mask"].sum()) for b in batches]
    print(f"{shape}; real response tokens per batch: {real}\n")
    print(common.md_table(["layout", "computed / real response slots", "range",
                           "prompt slots run"], slot_ratios(batches, shape)))  # fmt: skip
    benches = {}
    with tempfile.TemporaryDirectory():
        for algo in args.algos.split(","):
            for layout in args.layouts.split(","):
                lay = Layout(model, algo, layout, shape, batches)
                lay.warm()
                benches[f"{algo} update, {layout}"] = common.LocalBench(lay.update_call)
                if algo == args.algos.split(",")[0]:
                    benches[f"log-prob pass, {layout}"] = common.LocalBench(lay.logprob_call)
        rows = common.interleave(benches, args.repeats)
    table = []
    for name, r in rows.items():
        t = common.Timing.from_dict(r["timing"])
        table.append([name, f"{t.best:.2f}", f"{t.median:.2f}", f"{max(t.times_s):.2f}",
                      f"{t.best_cpu:.2f}", common.fmt_recompiles(r),
                      f"{min(t.loads):.1f}-{max(t.loads):.1f}"])  # fmt: skip
    print()
    print(common.md_table(["call", "best s", "median s", "max s", "best CPU s", "recompiles",
                           "load"], table))  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory of this process: {peak:.2f} GiB")
    timing = {k: common.Timing.from_dict(r["timing"]) for k, r in rows.items()}
    summary = {"rows": rows, "slot_ratios": slot_ratios(batches, shape), "model": cfg}
    for prefix in [f"{a} update" for a in args.algos.split(",")] + ["log-prob pass"]:
        base = timing.get(f"{prefix}, full")
        for layout in ("buckets", "packed"):
            t = timing.get(f"{prefix}, {layout}")
            if base and t:
                print(f"{prefix}: {layout} {base.median / t.median:.2f}x full (medians), "
                      f"{base.best_cpu / t.best_cpu:.2f}x in CPU time")  # fmt: skip
        if timing.get(f"{prefix}, buckets") and timing.get(f"{prefix}, packed"):
            b, p = timing[f"{prefix}, buckets"], timing[f"{prefix}, packed"]
            per_round = [x / y for x, y in zip(b.times_s, p.times_s, strict=True)]
            print(f"{prefix}: packed {b.median / p.median:.2f}x per-group buckets (medians; "
                  f"per round {min(per_round):.2f}-{max(per_round):.2f}x)")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
