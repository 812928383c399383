"""Rollout throughput: gvpo_jax.sampler.generate vs transformers generate on the bench-45m model.

Run: `.venv/bin/python -m benchmarks.rollout [--repeats 3] [--hf-repeats 2] [--skip-hf]`
(about 2 minutes on 2 CPU cores, most of it in transformers; `--quick`: a 1-layer tiny model,
prompt 16, 8 new tokens, the same code paths in seconds). Prints a markdown table: wall time,
tokens/s, model FLOP/s and utilisation of the machine's measured fp32 matmul throughput, plus
the compile time of `generate` separately. Shape: 8 prompts x 4 samples, prompt 64 tokens,
128 new tokens, sampling at T=1 with EOS disabled so every row runs to the end.

FLOP convention (per generate call, counting the prompt for every sample as a non-shared
implementation would): 2*N*B*(P+G) + 4*L*d*B*sum_{c=1..P+G} c, with N all matmul weights
including the tied output layer, B rows, P prompt length, G generated length, L layers,
d = heads * head_dim. The machine may be shared: take the best of several runs.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gvpo_jax import models, sampler  # noqa: E402

FULL = dict(prompts=8, samples=4, prompt_len=64, new_tokens=128, matmul=2048)
QUICK = dict(prompts=2, samples=2, prompt_len=16, new_tokens=8, matmul=256)
_square = jax.jit(lambda x: x @ x)


def matmul_flops_per_s(size: int = 2048, repeats: int = 5) -> float:
    """Best fp32 [size x size] @ [size x size] throughput of this machine under XLA, FLOP/s."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    jax.block_until_ready(_square(a))
    best = min(_timed(lambda: jax.block_until_ready(_square(a))) for _ in range(repeats))
    return 2 * size**3 / best


def timed_runs(fn, repeats: int, size: int = 2048) -> list[tuple[float, float]]:
    """(seconds, matmul FLOP/s measured just before) per run: the machine's load drifts."""
    runs = []
    for i in range(repeats):
        peak = matmul_flops_per_s(size)
        runs.append((_timed(lambda i=i: fn(i)), peak))
    return runs


def generation_flops(cfg: models.ModelConfig, b: int, p: int, g: int) -> float:
    """The FLOP convention of the module docstring."""
    d, h, n, k, f = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
    )
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    weights = cfg.vocab_size * d + cfg.num_layers * per_layer
    context = (p + g) * (p + g + 1) // 2
    return 2 * weights * b * (p + g) + 4 * cfg.num_layers * n * h * b * context


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_jax(model, prompt_ids, repeats: int, shape: dict) -> dict:
    """Trace and XLA-compile times (ahead of time), then best/median of timed generate calls."""
    lens = np.full((shape["prompts"],), shape["prompt_len"], np.int32)
    settings = sampler.canonical_settings(
        sampler.SamplingSettings(
            max_new_tokens=shape["new_tokens"], temperature=1.0, group_size=shape["samples"]
        ),
        rows=shape["prompts"] * shape["samples"],
    )
    graphdef, state = nnx.split(model)
    start = time.perf_counter()
    lowered = sampler.generate_split.lower(
        graphdef, state, prompt_ids, lens, jax.random.key(0), settings=settings
    )
    traced = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter()

    def call(seed):
        out = sampler.generate(model, prompt_ids, lens, settings, rng=jax.random.key(seed))
        return jax.block_until_ready(out)

    first = _timed(lambda: call(0))  # the jit cache may or may not reuse the AOT compile
    # EOS disabled: every row ran to the end
    assert int(call(0).lengths_B.min()) == shape["new_tokens"]
    runs = timed_runs(lambda i: call(i + 1), repeats, shape["matmul"])
    return dict(runs=runs, trace=traced - start, compile=compiled - traced, first=first)


def bench_hf(hf_dir: str, prompt_ids, repeats: int, shape: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.tensor(prompt_ids, dtype=torch.long)
    kwargs = dict(
        attention_mask=torch.ones_like(x),
        do_sample=True,
        temperature=1.0,
        top_k=0,  # transformers' default is 50; the JAX run samples the full distribution
        top_p=1.0,
        num_return_sequences=shape["samples"],
        eos_token_id=None,
        pad_token_id=0,
    )

    def call(n):
        with torch.no_grad():
            out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)
        assert out.shape == (shape["prompts"] * shape["samples"], shape["prompt_len"] + n)

    call(8)  # warm-up
    return dict(runs=timed_runs(lambda i: call(shape["new_tokens"]), repeats, shape["matmul"]))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed gvpo_jax calls")
    parser.add_argument("--hf-repeats", type=int, default=2, help="timed transformers calls")
    parser.add_argument("--skip-hf", action="store_true", help="only time gvpo_jax")
    parser.add_argument("--quick", action="store_true", help="tiny 1-layer model, short rollout")
    args = parser.parse_args(argv)

    shape = QUICK if args.quick else FULL
    p, g, t, n = shape["prompts"], shape["samples"], shape["prompt_len"], shape["new_tokens"]
    cfg = (
        models.PRESETS["tiny"].replace(num_layers=1) if args.quick else models.PRESETS["bench-45m"]
    )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    prompt_ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (p, t)).astype(np.int32)
    tokens = p * g * n
    flops = generation_flops(cfg, p * g, t, n)
    print(
        f"{'tiny (1 layer)' if args.quick else 'bench-45m'}: "
        f"{models.param_count(model) / 1e6:.1f}M params; {p} prompts x {g} samples, prompt {t}, "
        f"{n} new tokens, T=1, no EOS"
    )
    print(f"FLOPs per generate call (convention): {flops / 1e9:.1f} GFLOP")

    rows = [("gvpo_jax generate", bench_jax(model, prompt_ids, args.repeats, shape))]
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as hf_dir:
            models.save_pretrained(model, hf_dir)
            hf = bench_hf(hf_dir, prompt_ids, args.hf_repeats, shape)
            rows.append(("transformers generate", hf))
    peaks = [peak for _, r in rows for _, peak in r["runs"]]
    size = shape["matmul"]
    print(f"machine fp32 matmul ({size}^3, XLA): best {max(peaks) / 1e9:.0f} GFLOP/s, ", end="")
    print(f"worst {min(peaks) / 1e9:.0f} GFLOP/s over the run\n")

    print("| implementation | best s | median s | tokens/s | GFLOP/s | % of matmul peak |")
    print("|---|---|---|---|---|---|")
    summary = {"rows": {}, "flops": flops, "tokens": tokens}
    for name, r in rows:
        times = [t for t, _ in r["runs"]]
        best = min(times)
        # Utilisation of each run against the matmul throughput measured just before it.
        util = max(flops / t / peak for t, peak in r["runs"])
        summary["rows"][name] = dict(best=best, median=float(np.median(times)), util=util)
        print(
            f"| {name} | {best:.2f} | {np.median(times):.2f} | {tokens / best:.0f} | "
            f"{flops / best / 1e9:.0f} | {100 * util:.0f}% |"
        )
    j = rows[0][1]
    print(
        f"\ngvpo_jax compile: trace+lower {j['trace']:.1f} s, XLA compile {j['compile']:.1f} s; "
        f"first generate call (incl. any compile) {j['first']:.1f} s"
    )
    if len(rows) == 2:
        best = [min(t for t, _ in r["runs"]) for _, r in rows]
        summary["speedup"] = best[1] / best[0]
        print(f"speed-up over transformers (best vs best): {best[1] / best[0]:.2f}x")
    return summary


if __name__ == "__main__":
    main()
