"""XLA's fp32 matmul against PyTorch's at one model's own shapes, on this machine.

Run from the repo root: `.venv/bin/python -m benchmarks.matmul_shapes [--model smollm2-135m]
[--tokens 1664] [--repeats 15]` (about a minute), or `--quick` (tiny shapes, seconds).

The whole-step ratio to TRL moves from one host to another (BENCHMARKS.md sections 15, 20, 23
and 29) while our code does not, and the square `n x n` peak of `common.measure_peak` does not
say why: the model's matmuls are thin (K = d_model = 576 for SmolLM2) or short (M = 32 decode
rows). This script times each product the model runs, in fp32, in both libraries, each in its own
process, the processes alternating over `--rounds` (as `benchmarks.whole_step` alternates its
workers: one process's OpenMP or Eigen threads would spin on the cores the other's next call
needs), and prints GFLOP/s per library at the median call and the ratio XLA / PyTorch:

- the update's products at M = `--tokens` rows (a packed micro-batch: two groups of 64 + 4 x ~200
  tokens): each layer kernel forward (`x @ W`), its input gradient (`dY @ W^T`) and its weight
  gradient (`X^T @ dY`, contracting the token axis of both), and the output layer's block of
  the vocabulary;
- the decode's products at M = 32, 16 and 8 rows (the shedding decode's widths) against every
  layer kernel and the full output layer.

XLA: one `jax.jit` per product (XLA:CPU picks YNNPACK or Eigen per dot, as in the model's
programs); PyTorch: `torch.matmul` with 2 intra-op threads (TRL's setting on this machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from gvpo_jax.models.config import PRESETS  # noqa: E402
from gvpo_jax.models.logprobs import vocab_block_size  # noqa: E402

DECODE_ROWS = (32, 16, 8)


def products(cfg, tokens: int, decode_rows=DECODE_ROWS, chunk: int = 128) -> list[dict]:
    """(name, kind, M, K, N) of each product the model runs: kind "x@W", "dY@W^T" or "X^T@dY".

    The layer kernels are the attention's q / k / v / o projections and the MLP's gate / up /
    down (gate and up share a shape: one row); the output layer appears against the vocabulary
    block the update's log-probs use at M tokens (`models.logprobs.vocab_block_size` with
    `model.logprob_chunk` = `chunk`) and against the whole vocabulary in the decode."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    kernels = [("q", d, q), ("k / v", d, kv), ("o", q, d), ("gate / up", d, f), ("down", f, d)]
    block = vocab_block_size(tokens, cfg.vocab_size, chunk)
    out = []
    for name, k, n in kernels:
        out.append(dict(name=name, kind="x@W", m=tokens, k=k, n=n))
        out.append(dict(name=name, kind="dY@W^T", m=tokens, k=n, n=k))
        out.append(dict(name=name, kind="X^T@dY", m=k, k=tokens, n=n))
    out.append(dict(name=f"output block ({block})", kind="x@W", m=tokens, k=d, n=block))
    out.append(dict(name=f"output block ({block})", kind="X^T@dY", m=block, k=tokens, n=d))
    for rows in decode_rows:
        for name, k, n in kernels:
            out.append(dict(name=f"decode {name}", kind="x@W", m=rows, k=k, n=n))
        out.append(dict(name="decode output", kind="x@W", m=rows, k=d, n=cfg.vocab_size))
    return out


def operands(p: dict, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The product's two fp32 operands in the layout the model holds them: X^T@dY takes X
    [tokens, M] and dY [tokens, N] (both token-major), the others [M, K] and [K, N]."""
    rng = np.random.default_rng(seed)
    if p["kind"] == "X^T@dY":
        shapes = (p["k"], p["m"]), (p["k"], p["n"])
    else:
        shapes = (p["m"], p["k"]), (p["k"], p["n"])
    return tuple(rng.standard_normal(s, dtype=np.float32) for s in shapes)


def product_fn(p: dict, lib: str, seed: int, threads: int):
    """A blocking zero-argument call of product `p` in `lib` ("xla" or "torch"), and its value."""
    a, b = operands(p, seed)
    if lib == "xla":
        if p["kind"] == "X^T@dY":
            f = jax.jit(lambda a, b: jnp.einsum("tm,tn->mn", a, b))
        else:
            f = jax.jit(jnp.matmul)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        return (lambda: f(ja, jb).block_until_ready()), lambda: np.asarray(f(ja, jb))
    import torch

    torch.set_num_threads(threads)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    g = (lambda: ta.T @ tb) if p["kind"] == "X^T@dY" else (lambda: ta @ tb)
    return g, lambda: g().numpy()


def time_lib(lib: str, cfg, tokens: int, repeats: int, threads: int, decode_rows) -> list[float]:
    """Median seconds of each product's calls in `lib`, after one warm-up (compiling) call."""
    out = []
    for i, p in enumerate(products(cfg, tokens, decode_rows)):
        fn, _ = product_fn(p, lib, i, threads)
        out.append(common.time_calls(fn, repeats)[0].median)
    return out


def check_agree(cfg, tokens: int, decode_rows) -> None:
    """Both libraries compute the same products (to fp32 rounding): the shapes timed are right."""
    for i, p in enumerate(products(cfg, tokens, decode_rows)):
        x, t = (product_fn(p, lib, i, 1)[1]() for lib in ("xla", "torch"))
        scale = max(float(np.abs(t).max()), 1.0)
        if x.shape != t.shape or not np.allclose(x, t, atol=1e-3 * scale, rtol=0):
            raise AssertionError(f"{p['name']} {p['kind']}: XLA and PyTorch disagree")


def measure(args, cfg, tokens: int, decode_rows) -> list[dict]:
    """Each library in its own process, `args.rounds` times, alternating (XLA, PyTorch, XLA,
    ...): in one process, PyTorch's OpenMP threads spin after each call on the cores XLA's next
    call needs, so in-process round-robin times XLA on a busy machine. Per product: the median
    over rounds of each process's median call."""
    times = {"xla": [], "torch": []}
    for _ in range(args.rounds):
        for lib in ("xla", "torch"):
            cmd = [sys.executable, "-m", "benchmarks.matmul_shapes", "--child", lib,
                   "--model", args.model, "--tokens", str(args.tokens), "--repeats",
                   str(args.repeats), "--threads", str(args.threads)]  # fmt: skip
            cmd += ["--quick"] if args.quick else []
            run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
            if run.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
            times[lib].append(common.parse_json("MATMUL_CHILD", run.stdout)["seconds"])
    rows = []
    for i, p in enumerate(products(cfg, tokens, decode_rows)):
        flops = 2.0 * p["m"] * p["k"] * p["n"]
        med = {lib: statistics.median(t[i] for t in times[lib]) for lib in times}
        rows.append(dict(p, flops=flops, xla_gflops=flops / med["xla"] / 1e9,
                         torch_gflops=flops / med["torch"] / 1e9,
                         ratio=med["torch"] / med["xla"]))  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    cells = [[r["name"], r["kind"], f"{r['m']} x {r['k']} x {r['n']}", f"{r['xla_gflops']:.0f}",
              f"{r['torch_gflops']:.0f}", f"{r['ratio']:.2f}x"] for r in rows]  # fmt: skip
    return common.md_table(["product", "form", "M x K x N", "XLA GFLOP/s", "PyTorch GFLOP/s",
                            "XLA / PyTorch speed"], cells)  # fmt: skip


def summary(rows: list[dict]) -> dict:
    """The time-weighted ratio over the update's products and over the decode's: the whole
    group's FLOPs at PyTorch's speed against at XLA's (each product counted once)."""
    out = {}
    for part, pick in (("update", lambda r: not r["name"].startswith("decode")),
                       ("decode", lambda r: r["name"].startswith("decode"))):  # fmt: skip
        sel = [r for r in rows if pick(r)]
        t_xla = sum(r["flops"] / r["xla_gflops"] for r in sel)
        t_torch = sum(r["flops"] / r["torch_gflops"] for r in sel)
        out[part] = t_torch / t_xla
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=1664, help="rows of the update's products")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
    p.add_argument("--rounds", type=int, default=3, help="processes per library, alternating")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the suite's check)")
    p.add_argument("--child", choices=("xla", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg, tokens, rows_ = PRESETS[args.model], args.tokens, DECODE_ROWS
    if args.quick:
        cfg, tokens, rows_ = PRESETS["tiny"], 16, (4,)
    if args.child:
        seconds = time_lib(args.child, cfg, tokens, args.repeats, args.threads, rows_)
        common.emit_json("MATMUL_CHILD", dict(seconds=seconds))
        return dict(seconds=seconds)
    check_agree(cfg, tokens, rows_)
    print(common.describe_machine())
    print(f"# fp32 matmuls of {args.model if not args.quick else 'a tiny model'} "
          f"(update at M = {tokens}): each library in its own process, {args.rounds} "
          f"alternating rounds, median of {args.repeats} calls each")  # fmt: skip
    rows = measure(args, cfg, tokens, rows_)
    print(table(rows))
    s = summary(rows)
    print(f"\nAll the update's products: XLA {s['update']:.2f}x PyTorch's speed; "
          f"all the decode's: {s['decode']:.2f}x")  # fmt: skip
    result = dict(rows=rows, summary=s)
    common.emit_json("MATMUL_SHAPES", result)
    return result


if __name__ == "__main__":
    main()
