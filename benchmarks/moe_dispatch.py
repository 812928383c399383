"""The MoE layer's three dispatches against a dense MLP of the same active width.

Run: `.venv/bin/python -m benchmarks.moe_dispatch [--smoke]` (`--smoke`: tiny sizes, seconds;
the full run compiles 40 programs of a few seconds each and times them, minutes on 2 CPU cores).

The layer is `models.transformer.MoE` (router, fp32 softmax, top-k renormalised, SwiGLU
experts) with `model.moe_dispatch` set to each of `models.moe.DISPATCHES`:
  - dense: every expert on every token (E / k times the active FLOPs);
  - grouped: the assignments sorted by expert, padded to whole blocks, one batched matmul
    (CPU's path under `auto`);
  - ragged: `jax.lax.ragged_dot` (TPU's and GPU's path; XLA:CPU lowers it to a dense product
    over all E experts, so on CPU it costs what `dense` does).
For E in {4, 8, 16, 32, 64} experts at top-k 2 on N = 8192 tokens, D = 512, F = 256 (flags),
each dispatch's forward and forward + backward (gradients of sum(y^2) with respect to the
weights and the input), and the baseline: the dense SwiGLU MLP (`models.transformer.MLP`) of
width F * k, the FLOPs a token's experts do. Each variant is compiled once ahead
(`.lower().compile()`, the seconds reported), then the variants of one E, baseline included,
are timed round-robin (`common.interleave`: each call exposed to the same load): median
(min-max) ms over `--repeats` calls, and the median over the baseline's. The computed / active
FLOP ratio of each dispatch (grouped: padded rows / N*k) says what the time should be on a
machine that runs each matmul at one speed. Every dispatch's output is checked against the
dense one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from gvpo_jax import models
from gvpo_jax.models import moe as moe_lib
from gvpo_jax.models.transformer import MLP, MoE

PASSES = ("forward", "forward+backward")


def layer_config(experts: int, args) -> models.ModelConfig:
    """tiny-moe widened to the benchmark's sizes (one MoE layer's fields are all that count)."""
    return models.PRESETS["tiny-moe"].replace(
        hidden_size=args.hidden,
        moe_intermediate_size=args.width,
        intermediate_size=args.width * args.top_k,  # the baseline MLP: the active width
        num_experts=experts,
        num_experts_per_tok=args.top_k,
        moe_block=args.block,
        param_dtype=args.dtype,
        compute_dtype=args.dtype,
    )


def _output(y):
    """The layer's output [B, T, D] (the MoE layer may also return its routing)."""
    return y[0] if isinstance(y, tuple) else y


def programs(module: nnx.Module, x_1xNxD: jax.Array) -> dict[str, tuple]:
    """{pass: (compiled program, its arguments, compile seconds)} for one layer."""
    graphdef, state = nnx.split(module)

    def forward(state, x):
        return _output(nnx.merge(graphdef, state)(x))

    def loss(state, x):
        return jnp.sum(forward(state, x).astype(jnp.float32) ** 2)

    out = {}
    for name, fn in (("forward", forward), ("forward+backward", jax.grad(loss, (0, 1)))):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(state, x_1xNxD).compile()
        out[name] = (compiled, (state, x_1xNxD), time.perf_counter() - start)
    return out


def computed_ratio(dispatch: str, tokens: int, experts: int, args) -> float:
    """Expert FLOPs computed / the active ones (N * k rows of the three matmuls)."""
    assignments = tokens * args.top_k
    if dispatch == "dense":
        return experts / args.top_k
    if dispatch == "grouped":
        block = moe_lib.block_size(assignments, experts, args.block)
        blocks = -(-(assignments + experts * (block - 1)) // block)
        return blocks * block / assignments
    return 1.0  # ragged (on TPU and GPU; XLA:CPU computes as dense)


def run_experts(experts: int, args) -> dict:
    """One E: compile every variant, check values, time them round-robin."""
    cfg = layer_config(experts, args)
    rng = np.random.default_rng(experts)
    x = jnp.asarray(rng.standard_normal((1, args.tokens, args.hidden)), cfg.compute_dtype)
    layers = {"dense MLP": MLP(cfg, nnx.Rngs(0))}
    for dispatch in moe_lib.DISPATCHES:  # the same weights (seed 0) for every dispatch
        layers[dispatch] = MoE(cfg.replace(moe_dispatch=dispatch), nnx.Rngs(0))
    compiled = {name: programs(layer, x) for name, layer in layers.items()}
    reference = np.asarray(compiled["dense"]["forward"][0](*compiled["dense"]["forward"][1]))
    scale = float(np.max(np.abs(reference))) or 1.0
    errors = {}
    for name in moe_lib.DISPATCHES:
        fn, fn_args, _ = compiled[name]["forward"]
        errors[name] = float(np.max(np.abs(np.asarray(fn(*fn_args)) - reference))) / scale
    benches = {}
    for name, per_pass in compiled.items():
        for p, (fn, fn_args, _) in per_pass.items():
            benches[(name, p)] = common.LocalBench(
                lambda fn=fn, fn_args=fn_args: jax.block_until_ready(fn(*fn_args))
            )
    timed = common.interleave(benches, args.repeats)
    rows = {}
    for (name, p), result in timed.items():
        times = result["timing"]["times_s"]
        rows[f"{name} {p}"] = dict(
            compile_s=compiled[name][p][2],
            median_s=statistics.median(times),
            min_s=min(times),
            max_s=max(times),
            times_s=times,
            recompiles=result["recompiles"],
        )
    ratios = {d: computed_ratio(d, args.tokens, experts, args) for d in moe_lib.DISPATCHES}
    return dict(experts=experts, rows=rows, rel_err_vs_dense=errors, computed_vs_active=ratios)


def _ms(row: dict) -> str:
    return f"{row['median_s'] * 1e3:.2f} ({row['min_s'] * 1e3:.2f}-{row['max_s'] * 1e3:.2f})"


def tables(results: list[dict]) -> str:
    """Per pass: one row per E, each variant's ms and its median over the baseline's."""
    out = []
    names = ("dense MLP", *moe_lib.DISPATCHES)
    for p in PASSES:
        heads = ["E", *(f"{n} ms" for n in names), *(f"{d} / MLP" for d in moe_lib.DISPATCHES)]
        rows = []
        for r in results:
            cells = {n: r["rows"][f"{n} {p}"] for n in names}
            base = cells["dense MLP"]["median_s"]
            ratios = [f"{cells[d]['median_s'] / base:.2f}" for d in moe_lib.DISPATCHES]
            rows.append([r["experts"], *(_ms(cells[n]) for n in names), *ratios])
        out.append(f"## {p}: median (min-max) ms\n\n" + common.md_table(heads, rows))
    heads = ["E", *(f"{n} compile s ({p})" for n in names for p in PASSES)]
    rows = [[r["experts"], *(f"{r['rows'][f'{n} {p}']['compile_s']:.2f}" for n in names
                             for p in PASSES)] for r in results]  # fmt: skip
    out.append("## compile seconds\n\n" + common.md_table(heads, rows))
    heads = ["E", *(f"{d} computed / active" for d in moe_lib.DISPATCHES),
             *(f"{d} max err vs dense" for d in moe_lib.DISPATCHES[1:])]  # fmt: skip
    rows = [[r["experts"], *(f"{r['computed_vs_active'][d]:.2f}" for d in moe_lib.DISPATCHES),
             *(f"{r['rel_err_vs_dense'][d]:.1e}" for d in moe_lib.DISPATCHES[1:])]
            for r in results]  # fmt: skip
    out.append("## expert FLOPs computed / active, and values\n\n" + common.md_table(heads, rows))
    return "\n\n".join(out)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", "--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--tokens", type=int, default=8192, help="N: tokens through the layer")
    parser.add_argument("--hidden", type=int, default=512, help="D: the model width")
    parser.add_argument("--width", type=int, default=256, help="F: an expert's MLP width")
    parser.add_argument("--top-k", type=int, default=2, help="k: experts per token")
    parser.add_argument("--experts", default="4,8,16,32,64", help="E values, comma-separated")
    parser.add_argument("--block", type=int, default=64, help="the grouped path's largest block")
    parser.add_argument("--dtype", default="float32", help="parameters and compute")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.width = 256, 32, 16
        args.experts = ",".join(e for e in args.experts.split(",") if int(e) <= 8) or "4"
        args.repeats = min(args.repeats, 2)
    experts = [int(e) for e in args.experts.split(",")]
    print(f"# MoE dispatch: N={args.tokens}, D={args.hidden}, F={args.width}, k={args.top_k}, "
          f"E in {experts}, {args.dtype}\n{common.describe_machine()}\n", flush=True)  # fmt: skip
    results = []
    for e in experts:
        results.append(run_experts(e, args))
        print(f"E={e} done", flush=True)
    print("\n" + tables(results) + "\n")
    summary = dict(settings=vars(args), machine=common.machine_info(), results=results)
    common.emit_json("MOE_DISPATCH", summary)
    return summary


if __name__ == "__main__":
    main()
