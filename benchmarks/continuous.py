"""Continuous batching in the sampler: static batch vs S decode slots on a variable-length rollout.

Run: `.venv/bin/python -m benchmarks.continuous [--repeats 2] [--orders 3] [--slots 16,8]`
(11 minutes on 2 CPU cores: 3 passes over 5 programs x 3 rollouts) or `--quick` (a 1-layer
tiny model, N = 32: about 15 s, the same code paths).

Workload: bench-45m (models.PRESETS["bench-45m"], fp32), P = 8 prompts x G = 4 samples = 32
rows, prompt 64 tokens, N = 256 new tokens at T = 1, EOS enabled (`eos_ids` set, checked every
step). The length mix is controlled with the sampler's per-row length caps (`max_lengths`): the
32 rows get lengths evenly spaced from N/8 to N (32, 39, ..., 256 at N = 256: spread 8x, mean
144), assigned to rows in a seeded random order; a timed round runs `--orders` rollouts, one per
order (seeds 0, 1, ...), since the schedule's tail depends on where the long rows fall. A row
that reaches its cap ends exactly as if it had emitted an EOS there (same `ended` test, same
mask and slot refill); the model, the sampling and the cost of every decode step are untouched.
A random-init model emits no EOS of its own at a controlled position, so without the caps every
row would run to N (the static sampler's best case) or end at random lengths; the caps give the
same length mix to every variant. (A row may still end earlier at a sampled EOS token, about one
chance in 32768 per token; the table reports the realised token count.)

Variants, all one compiled `sampler.generate_split` program each (compiled ahead of time, so
XLA's memory analysis and the timed executable are the same program):
  static        the P*G = 32 rows hold their slots until the longest row ends (num_slots = 0);
  S = 16, 8     continuous batching: S slots refill from the 32 work items (same output, tested
                here token for token against the static output);
  chunks of S   the equal-memory baseline: the static batch cut into 32 / S sequential calls of
                S rows (S / G prompts each), what a memory-bound user does today.
Columns: decode iterations (model calls after the prefill, summed over the calls of a round),
wall time of a round (best / median of --repeats rounds, timed round-robin with
`common.interleave`), the
new-token KV cache (formula: L x 2 x S x (N - 1) x K x H x 4 bytes; the prompts' cache, P x 64
slots, is the same for all and listed apart), and XLA's temp allocation of the compiled program
(`memory_analysis().temp_size_in_bytes`: cache + activations + buffers, per call).

Afterwards, on the host: the schedule alone over 1000 random row orders (median iterations and
row-iterations, i.e. the time on a compute-bound accelerator where a step costs in proportion to
its rows), for this workload and for one device of configs/qwen_math.py (128 rows, N = 1024);
and the planner's (`plan.plan_memory`, shapes only) rollout KV cache per device of qwen_math
(the paper's setting: 1024 prompts x 4, 1024 + 1024 tokens) on 32 devices at S = P*G and below.

The machine may be shared: the load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import common  # noqa: E402
from gvpo_jax import decode, sampler  # noqa: E402

PROMPTS, SAMPLES = 8, 4
MiB = 2**20


MIXES = ("linear", "tail")


def length_mix(rows: int, new_tokens: int, seed: int = 0, kind: str = "linear") -> np.ndarray:
    """int32 [rows] length caps. "linear": evenly spaced from N/8 to N, in a seeded random row
    order. "tail": long-tailed like real answers, N/32 + an exponential length with mean
    N * 130/256, capped at N (N = 256: mean 118 tokens, as the SmolLM2 whole step's 3857 tokens
    per 32 rows, and about 15% of the rows at the cap)."""
    rng = np.random.default_rng(seed)
    if kind == "tail":
        drawn = np.round(rng.exponential(new_tokens * 130 / 256, rows)) + new_tokens // 32
        return np.minimum(drawn, new_tokens).astype(np.int32)
    if kind != "linear":
        raise ValueError(f"length mix {kind!r}: use one of {MIXES}.")
    lengths = np.round(np.linspace(new_tokens / 8, new_tokens, rows)).astype(np.int32)
    return rng.permutation(lengths).astype(np.int32)


def new_token_kv_bytes(cfg, rows: int, new_tokens: int) -> int:
    """Keys + values of `rows` rows x max(N - 1, 1) new-token columns over all layers."""
    per_column = 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    return cfg.num_layers * rows * max(new_tokens - 1, 1) * per_column


def simulated_iterations(lengths_B, slots: int) -> int:
    """Decode iterations of the continuous schedule (the sampler's rule, on the host): slots
    take the rows in order, a row of length L holds its slot for L - 1 iterations (token 0
    comes from the prefill), a free slot takes the next row for the next iteration."""
    free = [0] * slots
    for length in lengths_B:
        if length > 1:
            heapq.heappush(free, heapq.heappop(free) + int(length) - 1)
    return max(free)


def chunked_iterations(lengths_B, rows: int) -> int:
    """Decode iterations of the static batch cut into sequential chunks of `rows` rows."""
    return sum(
        max(int(x) for x in lengths_B[i : i + rows]) - 1 for i in range(0, len(lengths_B), rows)
    )


def schedule_table(
    rows: int, new_tokens: int, slot_counts, orders: int = 1000, kind: str = "linear"
) -> list[list]:
    """Median decode iterations and row-iterations (iterations x rows per iteration: the time on
    a compute-bound accelerator, where a step costs in proportion to its rows) over random row
    orders of the length mix, for the static batch, S slots and chunks of S rows."""
    rng = np.random.default_rng(1)
    mixes = [length_mix(rows, new_tokens, int(rng.integers(1 << 30)), kind) for _ in range(orders)]
    out = [["static", rows, new_tokens - 1, rows * (new_tokens - 1), "1.00"]]
    static_work = rows * (new_tokens - 1)
    for s in slot_counts:
        for name, fn in (
            (f"S = {s}", simulated_iterations),
            (f"chunks of {s}", chunked_iterations),
        ):
            its = float(np.median([fn(m, s) for m in mixes]))
            out.append([name, s, f"{its:.0f}", f"{its * s:.0f}", f"{its * s / static_work:.2f}"])
    return out


class Variant:
    """One compiled program, called on consecutive chunks of `chunk_rows` rows of each rollout
    (one rollout per row order of the length mix)."""

    def __init__(self, model, prompt_ids, caps_KxB, *, slots, chunk_rows, settings, key, shed=0):
        graphdef, self.state = nnx.split(model)
        self.slots, self.chunk_rows, self.shed = slots, chunk_rows, shed
        g = settings.group_size
        self.parts = []
        for caps_B in caps_KxB:
            for start in range(0, len(caps_B), chunk_rows):
                ids = prompt_ids[start // g : (start + chunk_rows) // g]
                lens = np.full((len(ids),), ids.shape[1], np.int32)
                self.parts.append((ids, lens, caps_B[start : start + chunk_rows]))
        self.calls = len(self.parts) // len(caps_KxB)
        settings = dataclasses.replace(settings, num_slots=slots, shed=shed)
        ids, lens, caps = self.parts[0]
        t0 = time.perf_counter()
        lowered = sampler.generate_split.lower(
            graphdef, self.state, ids, lens, key, caps, settings=settings, with_iterations=True
        )
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - t0
        self.temp_bytes = self.compiled.memory_analysis().temp_size_in_bytes
        self.key = key

    def __call__(self):
        outs = [
            self.compiled(self.state, ids, lens, self.key, caps) for ids, lens, caps in self.parts
        ]
        return jax.block_until_ready(outs)

    def result(self):
        """(SampleOutput of all rows of all rollouts as numpy, decode iterations summed)."""
        outs = self()
        joined = sampler.SampleOutput(
            *(np.concatenate([np.asarray(o[0][i]) for o in outs]) for i in range(5))
        )
        return joined, sum(int(o[1]) for o in outs)


def planner_kv(slot_fractions=(1, 2, 4, 8), num_devices: int = 32) -> list[list[str]]:
    """Rollout KV cache per device of configs/qwen_math.py at S = P*G / f (planner estimate)."""
    from configs import qwen_math
    from gvpo_jax import plan

    rows = []
    config = qwen_math.get_config()
    full = config.rollout.prompts_per_step * config.rollout.group_size
    for f in slot_fractions:
        config.rollout.num_slots = 0 if f == 1 else full // f
        p = plan.plan_memory(config, num_devices)
        rows.append(
            [
                f"{full // f}" + (" (static)" if f == 1 else ""),
                f"{p.kv_cache / 2**30:.2f}",
                f"{p.rollout_peak / 2**30:.2f}",
                f"{p.update_peak / 2**30:.2f}",
                f"{p.peak / 2**30:.2f}",
            ]
        )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny 1-layer model, N = 32")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds")
    parser.add_argument("--orders", type=int, default=3, help="rollouts (row orders) per round")
    parser.add_argument("--slots", default="16,8", help="slot counts S to compare ('': none)")
    parser.add_argument("--shed", default="", help="shedding static batches to compare, e.g. 1,2")
    parser.add_argument("--mix", choices=MIXES, default="linear",
                        help="row length caps: linear N/8..N, or tail (long-tailed)")  # fmt: skip
    args = parser.parse_args(argv)

    model = common.bench_model(quick=args.quick)
    cfg = model.config
    n, prompt_len = (32, 16) if args.quick else (256, 64)
    rows = PROMPTS * SAMPLES
    prompt_ids = common.random_prompts(cfg.vocab_size, PROMPTS, prompt_len)
    caps_KxB = np.stack([length_mix(rows, n, seed, args.mix) for seed in range(args.orders)])
    eos = cfg.vocab_size - 1
    settings = sampler.SamplingSettings(
        max_new_tokens=n, temperature=1.0, group_size=SAMPLES, eos_ids=(eos,)
    )
    key = jax.random.key(0)
    slot_counts = [int(s) for s in args.slots.split(",") if s]
    sheds = [int(x) for x in args.shed.split(",") if x]
    print(
        f"{'tiny (1 layer)' if args.quick else 'bench-45m'}: {PROMPTS} prompts x {SAMPLES} "
        f"samples, prompt {prompt_len}, N = {n}, T = 1, EOS id {eos}; {args.mix} row length caps "
        f"{caps_KxB.min()}..{caps_KxB.max()} (mean {caps_KxB.mean():.0f}); {args.orders} "
        f"rollouts (row orders, seeds 0..{args.orders - 1}) per timed round"
    )
    print(common.describe_machine())

    variants = {}
    for name, slots, chunk in (
        [("static", 0, rows)]
        + [(f"S = {s}", s, rows) for s in slot_counts]
        + [(f"static chunks of {s}", 0, s) for s in slot_counts]
    ):
        variants[name] = Variant(
            model, prompt_ids, caps_KxB, slots=slots, chunk_rows=chunk, settings=settings, key=key
        )
    for level in sheds:  # the static batch halving up to `level` times as rows end
        sizes = " -> ".join(map(str, decode.shed_levels(rows, level)))
        variants[f"static, shed {sizes}"] = Variant(
            model, prompt_ids, caps_KxB, slots=0, chunk_rows=rows, settings=settings, key=key,
            shed=level,
        )  # fmt: skip

    results = {name: v.result() for name, v in variants.items()}
    ref, _ = results["static"]
    load_before = os.getloadavg()
    timed = common.interleave({k: common.LocalBench(v) for k, v in variants.items()}, args.repeats)
    load_after = os.getloadavg()

    prompt_kv = new_token_kv_bytes(cfg, PROMPTS, prompt_len + 1)  # P x prompt_len slots
    static_best = common.Timing.from_dict(timed["static"]["timing"]).best
    table, summary = [], {}
    for name, v in variants.items():
        out, iterations = results[name]
        t = common.Timing.from_dict(timed[name]["timing"])
        cache_rows = v.slots or v.chunk_rows
        # row-steps computed per generated token (the host count of the sampler's schedule)
        slot_ratio = sum(
            sampler.decode_slots(c, max_new_tokens=n, num_slots=v.slots, shed=v.shed)
            for c in np.asarray(out.lengths_B).reshape(len(caps_KxB), -1)
        ) / max(int(out.lengths_B.sum()), 1)
        kv = new_token_kv_bytes(cfg, cache_rows, n)
        same = "other keys"  # a chunk's rows are numbered from 0: other draws
        if "chunks" not in name:
            diff = int(np.sum(out.tokens_BxN != ref.tokens_BxN))
            same = "yes" if diff == 0 else f"NO ({diff} tokens differ)"
        summary[name] = dict(
            iterations=iterations, best=t.best, median=t.median, kv=kv, temp=v.temp_bytes,
            tokens=int(out.lengths_B.sum()), same=same, compile_s=v.compile_s,
            recompiles=timed[name]["recompiles"], load=t.load,
        )  # fmt: skip
        table.append(
            [
                name,
                cache_rows,
                v.calls,
                iterations,
                f"{1000 * t.best / iterations:.1f}" if iterations else "-",
                f"{t.best:.2f}",
                f"{t.median:.2f}",
                f"{t.best / static_best:.2f}x",
                f"{kv / MiB:.1f}",
                f"{v.temp_bytes / MiB:.1f}",
                int(out.lengths_B.sum()),
                f"{slot_ratio:.2f}" if "chunks" not in name else "-",
                same,
                f"{v.compile_s:.1f}",
            ]
        )
    headers = (
        "variant", "slots", "calls per rollout", "decode iterations", "ms / iteration", "best s",
        "median s", "vs static", "new-token KV MiB", "XLA temp MiB", "tokens",
        "computed / real decode slots", "same output as static", "compile s",
    )  # fmt: skip
    print(f"\nprompt KV cache (all variants): {prompt_kv / MiB:.1f} MiB\n")
    print(common.md_table(headers, table))
    print(
        f"\nload average before timing {load_before[0]:.2f}/{load_before[1]:.2f}, after "
        f"{load_after[0]:.2f}/{load_after[1]:.2f} (2 cores: > 2 means a shared machine)"
    )
    lines = []
    if 16 in slot_counts:
        s16 = summary["S = 16"]
        lines.append(common.ratio_line("S = 16 wall / static", s16["best"] / static_best, 1.15,
                                       higher_is_better=False))  # fmt: skip
        lines.append(
            f"S = 16 new-token KV / static: {s16['kv'] / summary['static']['kv']:.2f} (target ~0.5)"
        )
    for s in slot_counts:
        c, cont = summary[f"static chunks of {s}"], summary[f"S = {s}"]
        lines.append(common.ratio_line(f"chunks of {s} / S = {s} (equal memory)",
                                       c["best"] / cont["best"], 1.5))  # fmt: skip
    print("\n" + "\n".join(lines))

    print(
        f"\nthe schedule alone, over 1000 random draws of this length mix ({rows} rows, "
        f"N = {n}); row-iterations = time on a compute-bound accelerator, relative to static:\n"
    )
    headers = ("schedule", "rows per iteration", "median iterations", "row-iterations", "vs static")
    print(common.md_table(headers, schedule_table(rows, n, slot_counts, kind=args.mix)))
    paper_rows = 4096 // 32  # qwen_math: 1024 prompts x 4 over 32 devices
    print(
        f"\nthe same for one device of configs/qwen_math.py ({paper_rows} rows, N = 1024, the "
        f"same {args.mix} length mix):\n"
    )
    print(common.md_table(headers, schedule_table(paper_rows, 1024, (64, 32), kind=args.mix)))

    plan_rows = planner_kv()
    print(
        "\nplanner, configs/qwen_math.py on 32 devices (1024 prompts x 4, prompt 1024, N 1024, "
        "bf16 compute), GiB per device:\n"
    )
    print(
        common.md_table(
            ("num_slots", "rollout KV cache", "rollout peak", "update peak", "peak"), plan_rows
        )
    )
    common.emit_json("CONTINUOUS", summary)
    return summary


if __name__ == "__main__":
    main()
