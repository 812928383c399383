"""Scaling of the update step and of rollout with group size G and response length N (bench-45m).

Run from the repo root: `.venv/bin/python -m benchmarks.scaling [--repeats 2] [--quick]`
(about 10 minutes on 2 cores, a third of it compiling one program per shape).
Four sweeps around the base point (2 prompts, G = 4, prompt 64, N = 128):
  update  vs G in 2, 4, 8, 16 (B = 2G sequences)      expected: linear in G, ~zero intercept
  update  vs N in 64, 128, 256, 512 (B = 8)           expected: linear in N plus a small N^2
                                                        attention term (12*L*d*B*T^2)
  rollout vs G in 2, 4, 8, 16                          expected: affine in G (each decode step
                                                        reads all weights once, whatever B)
  rollout vs N in 64, 128, 256, 512                    expected: linear in N (+ small N^2)
Each sweep prints its times, then a least-squares line time = a + b*x with its R^2 and the
slope b per unit (seconds per extra response per prompt, or per extra token), and the time per
convention FLOP (constant when time follows the FLOP model).

`--long` instead measures long responses per attention kernel (`--attention dense,blocked`):
update vs N in 128 .. 2048 (prompt 64, plus prompt 512 at N = 1024) with seconds per TFLOP, its
ratio to N = 128, and XLA's compiled memory (arguments + temporaries; a shape whose compile
needs more than --max-gib is reported and not run), and rollout vs N with seconds per generated
token and per TFLOP:
    .venv/bin/python -m benchmarks.scaling --long --attention dense,blocked --repeats 2
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from benchmarks import common, tunix_rollout, update_step  # noqa: E402

FULL = dict(prompts=2, group=4, prompt_len=64, new_tokens=128, model="bench-45m",
            groups=(2, 4, 8, 16), lengths=(64, 128, 256, 512))  # fmt: skip
QUICK = dict(prompts=1, group=2, prompt_len=8, new_tokens=8, model="tiny, 1 layer",
             groups=(2, 4), lengths=(8, 16))  # fmt: skip


def fit_line(x, y) -> dict:
    """Least squares y = a + b x: {'slope', 'intercept', 'r2'} (r2 = 1 - SS_res / SS_tot)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    b, a = np.polyfit(x, y, 1)
    ss_res = float(np.sum((y - (a + b * x)) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return dict(slope=float(b), intercept=float(a), r2=r2)


def time_update(model, *, prompts, group, prompt_len, new_tokens, repeats, chunk=128,
                max_bytes=None):  # fmt: skip
    """(Timing, FLOPs), or (Timing, FLOPs, compiled bytes) with max_bytes; Timing is None when
    the compiled update would need more than max_bytes (then it is not run)."""
    batch = update_step.make_batch(
        model, prompts=prompts, group=group, prompt_len=prompt_len, new_tokens=new_tokens,
        chunk=chunk,
    )  # fmt: skip
    bench = update_step.ours_bench(
        model, batch, "gvpo", group=group, prompt_len=prompt_len, new_tokens=new_tokens,
        chunk=chunk,
    )  # fmt: skip
    flops = common.update_flops(
        common.dims_of(model.config), prompts * group, prompt_len + new_tokens
    )
    if max_bytes is not None:
        mem = bench.memory()
        used = mem.argument_size_in_bytes + mem.temp_size_in_bytes
        if used > max_bytes:
            return None, flops, used
    r = common.interleave({"update": bench}, repeats)["update"]
    timing = common.Timing.from_dict(r["timing"])
    return (timing, flops) if max_bytes is None else (timing, flops, used)


def time_rollout(model, *, prompts, group, prompt_len, new_tokens, repeats):
    ids = common.random_prompts(model.config.vocab_size, prompts, prompt_len)
    bench = tunix_rollout.ours_bench(model, ids, samples=group, new_tokens=new_tokens)
    timing = common.Timing.from_dict(
        common.interleave({"rollout": bench}, repeats)["rollout"]["timing"]
    )
    flops = common.generation_flops(
        common.dims_of(model.config), prompts * group, prompt_len, new_tokens
    )
    return timing, flops


def sweep(name, unit, xs, run, base: dict, key: str, cache: dict) -> dict:
    """Times run(**base with key=x) for each x (shapes already timed are reused from cache)."""
    points = []
    for x in xs:
        shape = dict(base, **{key: x})
        tag = (run.__name__, tuple(sorted(shape.items())))
        if tag not in cache:
            cache[tag] = run(**shape)
        timing, flops = cache[tag]
        points.append((x, timing, flops))
    fit = fit_line([p[0] for p in points], [p[1].best for p in points])
    cpu_fit = fit_line([p[0] for p in points], [p[1].best_cpu for p in points])
    rows = [
        [x, f"{t.best:.3f}", f"{t.median:.3f}", f"{t.best_cpu:.3f}", f"{flops / 1e9:.1f}",
         f"{flops / t.best / 1e9:.1f}", f"{1e12 * t.best / flops:.2f}", f"{t.compile_s:.1f}",
         f"{t.load:.1f}"]
        for x, t, flops in points
    ]  # fmt: skip
    headers = [
        key, "best s", "median s", "best CPU s", "GFLOP", "GFLOP/s", "s per TFLOP", "compile s",
        "load",
    ]  # fmt: skip
    print(f"\n## {name}\n")
    print(common.md_table(headers, rows))
    print(
        f"\nfit: time = {fit['intercept']:.3f} s + {fit['slope']:.4f} s per {unit}; "
        f"R^2 = {fit['r2']:.4f} (CPU time: {cpu_fit['intercept']:.3f} + {cpu_fit['slope']:.4f} "
        f"CPU-s per {unit}, R^2 = {cpu_fit['r2']:.4f})"
    )
    return dict(fit=fit, cpu_fit=cpu_fit, points=[(x, t.as_dict(), f) for x, t, f in points])


LONG = dict(lengths=(128, 256, 512, 1024, 2048), long_prompt=(512, 1024))
LONG_QUICK = dict(lengths=(8, 16), long_prompt=(16, 8))


def long_sweeps(args, base_model, cfg) -> dict:
    """Update and rollout vs N per attention kernel (see the module docstring)."""
    from gvpo_jax import models

    spec = LONG_QUICK if args.quick else LONG
    shapes = [(cfg["prompt_len"], n) for n in spec["lengths"]] + [spec["long_prompt"]]
    max_bytes = int(args.max_gib * 2**30)
    out = {}
    for impl in args.attention.split(","):
        model = models.with_config(base_model, attention=impl)
        rows, ref, ref_needed = [], None, None
        for prompt_len, n in shapes if args.only != "rollout" else ():
            timing, flops, used = time_update(
                model, prompts=cfg["prompts"], group=cfg["group"], prompt_len=prompt_len,
                new_tokens=n, repeats=args.repeats, max_bytes=max_bytes,
            )  # fmt: skip
            needed = common.update_flops_shared(
                common.dims_of(model.config), cfg["prompts"], cfg["group"], prompt_len, n
            )
            per_tflop = None if timing is None else 1e12 * timing.median / flops
            per_needed = None if timing is None else 1e12 * timing.median / needed
            if ref is None and per_tflop is not None:
                ref, ref_needed = per_tflop, per_needed  # the first (shortest) prompt-64 point
            rows.append(dict(prompt=prompt_len, n=n, flops=flops, bytes=used,
                             timing=None if timing is None else timing.as_dict(),
                             s_per_tflop=per_tflop,
                             ratio=None if per_tflop is None else per_tflop / ref,
                             needed_flops=needed, s_per_needed_tflop=per_needed,
                             needed_ratio=None if per_needed is None else per_needed / ref_needed,
                             ))  # fmt: skip
            cell = "not run" if timing is None else f"{timing.median:.2f} s"
            print(f"[{impl}] update prompt {prompt_len} N {n}: {cell}, {used / 2**30:.2f} GiB",
                  flush=True)  # fmt: skip
        gen_rows, gen_ref = [], None
        for n in spec["lengths"] if args.only != "update" else ():
            timing, flops = time_rollout(
                model, prompts=cfg["prompts"], group=cfg["group"],
                prompt_len=cfg["prompt_len"], new_tokens=n, repeats=args.repeats,
            )  # fmt: skip
            per_token = timing.median / (cfg["prompts"] * cfg["group"] * n)
            gen_ref = gen_ref or per_token
            gen_rows.append(dict(n=n, flops=flops, timing=timing.as_dict(), s_per_token=per_token,
                                 ratio=per_token / gen_ref,
                                 s_per_tflop=1e12 * timing.median / flops))  # fmt: skip
            print(f"[{impl}] rollout N {n}: {timing.median:.2f} s", flush=True)
        out[impl] = dict(update=rows, rollout=gen_rows)
        print(f"\n## Update vs N, attention={impl} (median of {args.repeats})\n")
        print(common.md_table(
            ["prompt", "N", "median s", "GFLOP", "s per TFLOP", "x N=128", "needed GFLOP",
             "s per needed TFLOP", "x N=128", "XLA GiB (args+temps)"],
            [[r["prompt"], r["n"],
              "-" if r["timing"] is None else f"{common.Timing.from_dict(r['timing']).median:.2f}",
              f"{r['flops'] / 1e9:.0f}",
              "-" if r["s_per_tflop"] is None else f"{r['s_per_tflop']:.2f}",
              "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
              f"{r['needed_flops'] / 1e9:.0f}",
              "-" if r["s_per_needed_tflop"] is None else f"{r['s_per_needed_tflop']:.2f}",
              "-" if r["needed_ratio"] is None else f"{r['needed_ratio']:.2f}",
              f"{r['bytes'] / 2**30:.2f}"]
             for r in rows]))  # fmt: skip
        print(f"\n## Rollout vs N, attention={impl}\n")
        print(common.md_table(
            ["N", "median s", "ms per token", "x N=128", "s per TFLOP"],
            [[r["n"], f"{common.Timing.from_dict(r['timing']).median:.2f}",
              f"{1e3 * r['s_per_token']:.3f}", f"{r['ratio']:.2f}", f"{r['s_per_tflop']:.2f}"]
             for r in gen_rows]))  # fmt: skip
    common.emit_json("SCALING_LONG", out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per shape")
    parser.add_argument("--quick", action="store_true", help="tiny model, two points per sweep")
    parser.add_argument("--only", choices=["update", "rollout"], help="run one half")
    parser.add_argument("--long", action="store_true", help="long responses per kernel")
    parser.add_argument("--attention", default="dense,blocked", help="--long: kernels to compare")
    parser.add_argument("--max-gib", type=float, default=16.0,
                        help="--long: skip update shapes whose compile needs more")  # fmt: skip
    args = parser.parse_args(argv)
    if args.long:
        cfg = QUICK if args.quick else FULL
        print(common.describe_machine())
        return long_sweeps(args, common.bench_model(args.quick), cfg)

    cfg = QUICK if args.quick else FULL
    model = common.bench_model(args.quick)
    base = {k: cfg[k] for k in ("prompts", "group", "prompt_len", "new_tokens")}
    base["repeats"] = args.repeats
    print(f"# Scaling ({cfg['model']}, {base['prompts']} prompts, prompt {base['prompt_len']})")
    print(common.describe_machine())
    results, cache = {}, {}
    upd = lambda **kw: time_update(model, **kw)
    upd.__name__ = "update"
    gen = lambda **kw: time_rollout(model, **kw)
    gen.__name__ = "rollout"
    sweeps = [
        ("update vs G", "response per prompt", cfg["groups"], upd, "group"),
        ("update vs N", "response token", cfg["lengths"], upd, "new_tokens"),
        ("rollout vs G", "response per prompt", cfg["groups"], gen, "group"),
        ("rollout vs N", "response token", cfg["lengths"], gen, "new_tokens"),
    ]
    for name, unit, xs, run, key in sweeps:
        if args.only and not name.startswith(args.only):
            continue
        results[name] = sweep(name, unit, xs, run, base, key, cache)

    print("\n## Linear fits\n")
    rows = [
        [name, f"{r['fit']['slope']:.4f}", f"{r['fit']['intercept']:.3f}", f"{r['fit']['r2']:.4f}",
         f"{r['cpu_fit']['slope']:.4f}", f"{r['cpu_fit']['r2']:.4f}"]
        for name, r in results.items()
    ]  # fmt: skip
    headers = ["sweep", "slope s/unit", "intercept s", "R^2", "CPU-s/unit", "R^2 (CPU time)"]
    print(common.md_table(headers, rows))
    common.emit_json("SCALING", {k: [v["fit"], v["cpu_fit"]] for k, v in results.items()})
    return results


if __name__ == "__main__":
    main()
