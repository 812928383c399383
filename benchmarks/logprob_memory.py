"""Peak memory of naive vs chunked token log-probs (value and gradient) at Qwen's vocabulary.

Run from the repo root: .venv/bin/python -m benchmarks.logprob_memory [--batch 4 --chunk 128]
Compiles both versions of `value_and_grad(sum(logp))` w.r.t. (hidden, unembedding) and prints
XLA's compiled memory analysis (nothing is executed unless --run). Takes ~10 s on 2 CPU cores.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from gvpo_jax import models


def _loss(logprob_fn, hidden_BxTxD, unembed_VxD, targets_BxT):
    return jnp.sum(logprob_fn(hidden_BxTxD, unembed_VxD, targets_BxT))


def peak_bytes(logprob_fn, hidden, unembed, targets) -> tuple[int, int, jax.stages.Compiled]:
    """(temporary bytes, temp + arguments + outputs - aliased) of the compiled gradient step."""
    step = jax.jit(jax.value_and_grad(functools.partial(_loss, logprob_fn), argnums=(0, 1)))
    compiled = step.lower(hidden, unembed, targets).compile()
    mem = compiled.memory_analysis()
    total = (
        mem.temp_size_in_bytes
        + mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
    )
    return mem.temp_size_in_bytes, total, compiled


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896)  # Qwen2.5-0.5B
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen2 / Qwen2.5
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--run", action="store_true", help="also execute both and compare")
    args = parser.parse_args(argv)

    b, t, d, v = args.batch, args.length, args.hidden, args.vocab
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.dtype(args.dtype))
    unembed = jax.ShapeDtypeStruct((v, d), jnp.dtype(args.dtype))
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    chunked = functools.partial(models.chunked_logprobs, chunk_size=args.chunk)
    logits_bytes = b * t * v * 4
    gib = lambda x: f"{x / 2**30:7.3f} GiB"
    print(f"B={b} T={t} D={d} V={v} params {args.dtype}; one fp32 [B,T,V] = {gib(logits_bytes)}")
    results = {}
    for name, fn in [("naive", models.naive_logprobs), (f"chunked(C={args.chunk})", chunked)]:
        temp, total, compiled = peak_bytes(fn, hidden, unembed, targets)
        results[name] = (total, compiled)
        print(f"{name:>14}: temp {gib(temp)}   peak (temp+args+out) {gib(total)}")
    (naive_total, naive_c), (chunk_total, chunk_c) = results.values()
    print(f"reduction: {naive_total / chunk_total:.1f}x lower peak memory")
    summary = {"naive": naive_total, "chunked": chunk_total, "logits_bytes": logits_bytes}
    if args.run:
        keys = jax.random.split(jax.random.key(0), 3)
        h = jax.random.normal(keys[0], hidden.shape, hidden.dtype)
        w = (0.02 * jax.random.normal(keys[1], unembed.shape)).astype(unembed.dtype)
        y = jax.random.randint(keys[2], targets.shape, 0, v)
        (va, ga), (vb, gb) = naive_c(h, w, y), chunk_c(h, w, y)
        diff = max(float(jnp.max(jnp.abs(x - z))) for x, z in zip(ga, gb, strict=True))
        print(f"value naive {float(va):.4f} chunked {float(vb):.4f}; max grad diff {diff:.2e}")
        summary.update(values=(float(va), float(vb)), grad_diff=diff)
    return summary


if __name__ == "__main__":
    main()
