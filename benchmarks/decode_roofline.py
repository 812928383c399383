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
  4. With `--profile`: one generate of 32 rows at N = 256 under `jax.profiler`, each XLA op of
     the decode loop timed and assigned to a part of the step by the Python function that
     emitted it (the compiled program's stack frames): weight matmuls (projections, MLP, output
     layer), attention over the cache, cache writes, norms / RoPE / activations / residuals,
     sampling, the loop's bookkeeping; and the time between ops (the loop's wall time minus
     the union of its ops' intervals: the runtime's per-op dispatch and waits).
Floors per step: compute 2 x N_w x R FLOP / matmul peak; bandwidth 4 x N_w bytes / read
bandwidth (every fp32 weight streamed once; N_w = `common.matmul_weights`, output layer
included). Reported: ms per step, the share of the compute floor each reaches, and the gap
split into the matmuls' own shortfall (2 against the compute floor) and everything else (3 - 2:
attention over the cache, norms and RoPE, sampling, the loop and cache writes).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

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


def _prompts(model, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Random prompts of PROMPT_LEN tokens for `rows` decode rows (GROUP samples each)."""
    prompts = rows // GROUP
    ids = common.random_prompts(model.config.vocab_size, prompts, PROMPT_LEN)
    return ids, np.full((prompts,), PROMPT_LEN, np.int32)


def decode_step(model, rows: int, repeats: int, short: int, long: int) -> tuple[float, int]:
    """(seconds per decode step, tokens checked) from generate at N = long minus N = short."""
    ids, lens = _prompts(model, rows)
    best = {}
    for n in (short, long):
        settings = sampler.SamplingSettings(max_new_tokens=n, temperature=1.0, group_size=GROUP)

        def call(seed, settings=settings):
            out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(seed))
            return jax.block_until_ready(out)

        out = call(0)
        assert int(np.asarray(out.lengths_B).min()) == n  # EOS off: every row ran to the end
        best[n], _ = common._best_times(lambda call=call: call(1), repeats)
    return (best[long] - best[short]) / (long - short), rows * long


# The decode loop's ops by the innermost function (of the program's stack frames) that names a
# part of the step; ops containing a matmul go by that matmul's frames.
PARTS = (
    ("cache writes", ("_write", "SharedPrefixCache.grow", "KVCache.update")),
    ("attention over the cache", ("attend", "causal", "dense", "_probs", "_prefix_softmax",
                                  "_two_part_softmax", "attention_mask", "visible",
                                  "_per_query_row", "_prefix_queries", "_prefix_rows")),
    ("weight matmuls", ("Attention._project", "Attention._out", "MLP.__call__",
                        "Transformer.unembed")),
    ("norms, RoPE, activation, residual", ("RMSNorm", "rope", "swiglu", "Block.__call__",
                                           "block_forward", "Transformer.hidden")),
    ("sampling", ("candidate_logprobs", "select_tokens", "draw", "_inverse_cdf",
                  "token_keys", "_uniforms", "log_softmax")),
    ("loop bookkeeping", ("static_batch", "generate_split", "_output")),
)  # fmt: skip


NO_SOURCE = "no source line (copies, layout)"


def _hlo_index(text: str) -> tuple[dict, dict, set]:
    """A compiled module's text as (instructions, computations, loop instructions):
    instruction name -> (op, called computations, function chain innermost first);
    computation -> its instruction names; the names of every instruction inside a while loop's
    body (nested computations included)."""
    tables = {}
    for title in ("FunctionNames", "FileLocations", "StackFrames"):
        m = re.search(rf"^{title}\n((?:\d+ .*\n)+)", text, re.M)
        tables[title] = dict(re.findall(r"^(\d+) (.*)$", m.group(1), re.M)) if m else {}
    func = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    loc_func = {k: func.get(re.search(r"function_name_id=(\d+)", v).group(1), "?")
                for k, v in tables["FileLocations"].items()}  # fmt: skip
    frames = {k: (re.search(r"file_location_id=(\d+)", v).group(1),
                  re.search(r"parent_frame_id=(\d+)", v).group(1))
              for k, v in tables["StackFrames"].items()}  # fmt: skip

    def chain(frame):
        out, seen = [], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            loc, parent = frames[frame]
            out.append(loc_func.get(loc, "?"))
            frame = parent
        return tuple(out)

    instrs, comps, bodies, current = {}, collections.defaultdict(list), [], None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
        if not m or current is None:
            continue
        called = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
        bodies += re.findall(r"body=%?([\w.\-]+)", line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        instrs[m.group(1)] = (m.group(2), tuple(called), chain(frame.group(1)) if frame else ())
        comps[current].append(m.group(1))
    return instrs, comps, set(_reachable(bodies, instrs, comps))


def _reachable(computations, instrs: dict, comps: dict) -> list[str]:
    """The instructions of `computations` and of every computation they call, nested."""
    out, stack, seen = [], list(computations), set()
    while stack:
        comp = stack.pop()
        if comp in seen:
            continue
        seen.add(comp)
        for name in comps.get(comp, ()):
            out.append(name)
            stack += instrs[name][1]
    return out


def _part_of(name: str, instrs: dict, comps: dict) -> str:
    """The PARTS name of one executed op (a thunk named after its HLO instruction)."""
    op, called, chain = instrs[name]
    inner = [instrs[n] for n in _reachable(called, instrs, comps)]  # fused / called ops
    dots = [c for o, _, c in [(op, (), chain), *inner] if o in ("dot", "convolution")]
    for c in dots or [chain] + [c for _, _, c in inner]:
        for fn in c:
            for part, keys in PARTS:
                if any(k in fn for k in keys):
                    if dots and part != "attention over the cache":
                        return "weight matmuls"
                    return part
    return NO_SOURCE


def profile_decode(model, rows: int, new_tokens: int) -> dict:
    """Milliseconds per decode step of each part of the step (PARTS), the time between the
    loop's ops, and the loop's wall time, from one profiled generate of `rows` rows."""
    ids, lens = _prompts(model, rows)
    settings = sampler.SamplingSettings(
        max_new_tokens=new_tokens, temperature=1.0, group_size=GROUP
    )
    graphdef, state = nnx.split(model)
    args = (jnp.asarray(ids), jnp.asarray(lens), jax.random.key(2))
    compiled = sampler.generate_split.lower(graphdef, state, *args, settings=settings).compile()
    instrs, comps, in_loop = _hlo_index(compiled.as_text())
    jax.block_until_ready(compiled(state, *args))  # warm
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(compiled(state, *args))
        (path,) = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as fh:
            trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    loop = []  # (start us, end us, part) of every executed op of the decode loop
    for e in events:
        name = e.get("args", {}).get("hlo_op") if isinstance(e.get("args"), dict) else None
        if e.get("ph") == "X" and name in in_loop:
            start = float(e["ts"])
            loop.append((start, start + float(e["dur"]), _part_of(name, instrs, comps)))
    if not loop:
        raise RuntimeError("the profile holds no op of the decode loop")
    loop.sort()
    busy, end = 0.0, -1.0
    per_part = collections.defaultdict(float)
    for s, t, part in loop:
        per_part[part] += t - s
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    wall = loop[-1][1] - loop[0][0]
    out = {part: per_part[part] / 1e3 / new_tokens for part, _ in PARTS}
    out[NO_SOURCE] = per_part[NO_SOURCE] / 1e3 / new_tokens
    out["between ops"] = (wall - busy) / 1e3 / new_tokens
    out["loop wall"] = wall / 1e3 / new_tokens
    out["ops"] = len(loop) / new_tokens
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="bench-45m", choices=("bench-45m", "smollm2"))
    p.add_argument("--profile", action="store_true", help="also split a 32-row step by part")
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
    result = {"peak_flops": peak, "read_bandwidth": bw, "weights": n_w, "rows": rows_out,
              "time": time.time()}  # fmt: skip
    if args.profile:
        rows = ROWS[0]
        prof = profile_decode(model, rows, long)
        floor = rows_out[rows]["compute_floor"]
        print(f"\nOne decode step of {rows} rows by part (profiled generate at N = {long}; "
              f"{prof['ops']:.0f} ops per step; the loop's wall {prof['loop wall']:.2f} "
              f"ms per step):\n")  # fmt: skip
        parts = [p for p, _ in PARTS] + [NO_SOURCE, "between ops"]
        print(common.md_table(
            ("part", "ms per step", "share of the step", "share of the compute floor's time"),
            [[p, f"{prof[p]:.2f}", f"{100 * prof[p] / prof['loop wall']:.0f}%",
              f"{100 * prof[p] / (1e3 * floor):.0f}%"] for p in parts],
        ))  # fmt: skip
        result["profile"] = prof
    result["load"] = os.getloadavg()[0]
    print(f"\nload average {result['load']:.2f} (2 cores: > 2 means a shared machine)")
    common.emit_json("DECODE_ROOFLINE", result)
    return result


if __name__ == "__main__":
    main()
