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


def time_update(model, *, prompts, group, prompt_len, new_tokens, repeats, chunk=128):
    batch = update_step.make_batch(
        model, prompts=prompts, group=group, prompt_len=prompt_len, new_tokens=new_tokens,
        chunk=chunk,
    )  # fmt: skip
    bench = update_step.ours_bench(
        model, batch, "gvpo", group=group, prompt_len=prompt_len, new_tokens=new_tokens,
        chunk=chunk,
    )  # fmt: skip
    r = common.interleave({"update": bench}, repeats)["update"]
    flops = common.update_flops(
        common.dims_of(model.config), prompts * group, prompt_len + new_tokens
    )
    return common.Timing.from_dict(r["timing"]), flops


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per shape")
    parser.add_argument("--quick", action="store_true", help="tiny model, two points per sweep")
    parser.add_argument("--only", choices=["update", "rollout"], help="run one half")
    args = parser.parse_args(argv)

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
