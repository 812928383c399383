"""Where a decode step's time goes, against the machine's two floors (issue 40's rollout target).

Run: `.venv/bin/python -m benchmarks.decode_roofline [--repeats 5] [--model bench-45m|smollm2]`
(about 3 minutes on 2 CPU cores) or `--quick` (a 1-layer tiny model: seconds, same code paths).

For R rows per step in {32, 16, 8} (the static batch and its two shed levels) it measures:
  1. The machine: fp32 matmul throughput (`common.matmul_peak_jax`, the best size) and memory
     read bandwidth (a jitted sum over a 1 GiB fp32 array: bytes read per second).
  2. Weights only: one jitted call that takes an [R, D] activation through every weight matrix
     of the model in the decode's order (q, k, v, o, gate, up, down of each layer, then the
     output layer) with nothing else: what the decode step's matmuls alone cost at these
     shapes on this machine (XLA's matmul at M = R).
  3. The decode step: `sampler.generate` of R rows (R / 4 prompts x 4, prompt 64, T = 1, EOS
     off) at N = 128 and N = 256 new tokens; the difference over 128 steps is one decode step
     (prefill and call overhead cancel), attending over 192-320 cached positions.
Floors per step: compute 2 x N_w x R FLOP / matmul peak; bandwidth 4 x N_w bytes / read
bandwidth (every fp32 weight streamed once; N_w = `common.matmul_weights`, output layer
included). Reported: ms per step, the share of the compute floor each reaches, and the gap
split into the matmuls' own shortfall (2 against the compute floor) and everything else (3 - 2:
attention over the cache, norms and RoPE, sampling, the loop and cache writes).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from gvpo_jax import models, sampler  # noqa: E402

GROUP, PROMPT_LEN = 4, 64
ROWS = (32, 16, 8)


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a jitted fp32 sum over `gib` GiB (read once per call)."""
    n = int(gib * 2**30 / 4)
    x = jnp.ones((n,), jnp.float32)
    total = jax.jit(jnp.sum)
    wall, _ = common._best_times(lambda: total(x).block_until_ready(), repeats)
    return n * 4 / wall


def weight_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight of one decode step, in order (`matmul_weights`'s set)."""
    d, h = cfg.hidden_size, cfg.head_dim
    per_layer = [(d, cfg.num_heads * h), (d, cfg.num_kv_heads * h), (d, cfg.num_kv_heads * h),
                 (cfg.num_heads * h, d), (d, cfg.intermediate_size),
                 (d, cfg.intermediate_size), (cfg.intermediate_size, d)]  # fmt: skip
    return per_layer * cfg.num_layers + [(d, cfg.vocab_size)]


def weights_only_step(shapes, rows: int, repeats: int) -> float:
    """Best seconds of one call through every weight: [R, D] -> each matmul in turn (a layer's
    q / k / v and gate / up read the same input; o and down return to D)."""
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) * 0.02
          for i, s in enumerate(shapes)]  # fmt: skip

    def step(x, ws):
        outs = []
        for w in ws:
            src = x if w.shape[0] == x.shape[1] else outs[-1]
            y = src @ w
            outs.append(y)
            if w.shape[1] == x.shape[1]:  # o / down: the residual stream goes on
                x = x + y
        return x, outs[-1]

    f = jax.jit(step)
    x = jax.random.normal(key, (rows, shapes[0][0]), jnp.float32)
    wall, _ = common._best_times(lambda: jax.block_until_ready(f(x, ws)), repeats)
    return wall


def decode_step(model, rows: int, repeats: int, short: int, long: int) -> tuple[float, int]:
    """(seconds per decode step, tokens checked) from generate at N = long minus N = short."""
    cfg = model.config
    prompts = rows // GROUP
    ids = common.random_prompts(cfg.vocab_size, prompts, PROMPT_LEN)
    lens = np.full((prompts,), PROMPT_LEN, np.int32)
    best = {}
    for n in (short, long):
        settings = sampler.canonical_settings(max_new_tokens=n, temperature=1.0,
                                              group_size=GROUP)  # fmt: skip

        def call(seed, settings=settings):
            out = sampler.generate(model, ids, lens, rng=jax.random.key(seed), **settings)
            return jax.block_until_ready(out)

        out = call(0)
        assert int(np.asarray(out.lengths_B).min()) == n  # EOS off: every row ran to the end
        best[n], _ = common._best_times(lambda call=call: call(1), repeats)
    return (best[long] - best[short]) / (long - short), rows * long


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="bench-45m", choices=("bench-45m", "smollm2"))
    args = p.parse_args(argv)
    if args.quick:
        model, short, long, gib = common.bench_model(quick=True), 8, 16, 1 / 64
    elif args.model == "smollm2":
        from flax import nnx

        model = models.Transformer(models.PRESETS["smollm2-135m"], rngs=nnx.Rngs(0))
        short, long, gib = 128, 256, 1.0
    else:
        model, short, long, gib = common.bench_model(), 128, 256, 1.0
    cfg = model.config
    n_w = common.matmul_weights(**common.dims_of(cfg))
    print(f"{args.model if not args.quick else 'tiny'}: {n_w / 1e6:.1f}M matmul weights "
          f"(output layer included); {common.describe_machine()}")  # fmt: skip
    sizes = (256,) if args.quick else common.PEAK_SIZES
    peak = max(v[0] for v in common.matmul_peak_jax(sizes, repeats=args.repeats).values())
    bw = read_bandwidth(gib, args.repeats)
    bw_floor = 4.0 * n_w / bw
    print(f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; read bandwidth {bw / 1e9:.1f} GB/s; "
          f"streaming the weights once takes {1e3 * bw_floor:.1f} ms\n")  # fmt: skip
    shapes = weight_shapes(cfg)
    assert sum(a * b for a, b in shapes) == n_w
    rows_out, table = {}, []
    for rows in ROWS:
        compute_floor = 2.0 * n_w * rows / peak
        w = weights_only_step(shapes, rows, args.repeats)
        d, tokens = decode_step(model, rows, args.repeats, short, long)
        rows_out[rows] = dict(compute_floor=compute_floor, bandwidth_floor=bw_floor,
                              weights_only=w, decode=d, tokens=tokens)  # fmt: skip
        table.append([
            rows, f"{1e3 * compute_floor:.1f}", f"{1e3 * bw_floor:.1f}", f"{1e3 * w:.1f}",
            f"{100 * compute_floor / w:.0f}%", f"{1e3 * d:.1f}", f"{100 * compute_floor / d:.0f}%",
            f"{100 * w / d:.0f}% / {100 * (d - w) / d:.0f}%",
        ])  # fmt: skip
    headers = ("rows", "compute floor ms", "bandwidth floor ms", "weights only ms",
               "weights only: share of compute floor", "decode step ms",
               "decode: share of compute floor", "decode = matmuls / the rest")  # fmt: skip
    print(common.md_table(headers, table))
    print(f"\nload average {os.getloadavg()[0]:.2f} (2 cores: > 2 means a shared machine)")
    result = {"peak_flops": peak, "read_bandwidth": bw, "weights": n_w, "rows": rows_out,
              "load": os.getloadavg()[0], "time": time.time()}  # fmt: skip
    common.emit_json("DECODE_ROOFLINE", result)
    return result


if __name__ == "__main__":
    main()
