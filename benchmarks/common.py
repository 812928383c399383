"""Shared benchmark helpers: bench-45m shapes, FLOP conventions, matmul peak, timing, tables.

Imports only the standard library, numpy and jax at module level, so the tunix worker (which runs
in .venv-tunix, without torch or gvpo_jax's other dependencies) can use it too; torch and
gvpo_jax are imported inside the functions that need them.

FLOP conventions (the issue's, so utilisation compares across tools): N = all matmul weights,
including the (tied) output layer; d = heads * head_dim (the attention width); L layers.
  update step:  6*N*B*T + 12*L*d*B*T^2
  generation:   2*N*B*(P+G) + 4*L*d*B*sum_{c=1..P+G} c
MFU = achieved FLOP/s / the best fp32 matmul throughput measured in the same run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# bench-45m: Qwen2 layout, tied embeddings (= models.PRESETS["bench-45m"], checked in main venv).
BENCH_45M = dict(
    vocab=32768, d_model=512, layers=8, heads=8, kv_heads=2, head_dim=64, mlp=1408, tied=True
)
# The workload: 8 prompts x 4 samples, prompt 64 (left-padded), 128 new tokens.
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 8, 4, 64, 128
PEAK_SIZES = (1024, 2048, 4096)


# ----------------------------------------------------------------------------- FLOP conventions


def matmul_weights(
    *, vocab, d_model, layers, heads, kv_heads, head_dim, mlp, tied=True, **_
) -> int:
    """N: q/k/v/o, gate/up/down of every layer plus the output layer (counted even when tied)."""
    attn = d_model * heads * head_dim + 2 * d_model * kv_heads * head_dim
    attn += heads * head_dim * d_model
    per_layer = attn + 3 * d_model * mlp
    return layers * per_layer + vocab * d_model


def update_flops(dims: dict, batch: int, length: int) -> float:
    """6*N*B*T + 12*L*d*B*T^2 for one forward+backward over B sequences of T tokens."""
    n, d = matmul_weights(**dims), dims["heads"] * dims["head_dim"]
    return 6.0 * n * batch * length + 12.0 * dims["layers"] * d * batch * length * length


def update_flops_shared(dims: dict, prompts: int, group: int, prompt_len: int, new_tokens: int
                        ) -> float:  # fmt: skip
    """The FLOPs the shared-prompt update needs: `update_flops` with each group's prompt through
    the layers once (not once per row) and the output layer on the response tokens only (the
    update needs their log-probs alone); the attention term stays the convention's 12*L*d*B*T^2.

    `update_flops` counts every row's prompt and every position's logits, which the update does
    not compute: at prompt 64 + N = 128 (G = 4) that is 30% of its count, at N = 2048 2%, so
    seconds per `update_flops` TFLOP rise with N even when every matmul runs at the same speed.
    Equal to `update_flops` when prompt_len = 0."""
    n, d = matmul_weights(**dims), dims["heads"] * dims["head_dim"]
    head = dims["vocab"] * dims["d_model"]
    rows, length = prompts * group, prompt_len + new_tokens
    linear = 6.0 * (n - head) * (rows * new_tokens + prompts * prompt_len)
    linear += 6.0 * head * rows * new_tokens
    return linear + 12.0 * dims["layers"] * d * rows * length * length


def generation_flops(dims: dict, batch: int, prompt: int, new: int) -> float:
    """2*N*B*(P+G) + 4*L*d*B*sum_{c=1..P+G} c (every row pays its prompt, shared or not)."""
    n, d = matmul_weights(**dims), dims["heads"] * dims["head_dim"]
    total = prompt + new
    return 2.0 * n * batch * total + 4.0 * dims["layers"] * d * batch * total * (total + 1) / 2


def dims_of(cfg) -> dict:
    """BENCH_45M-style dims of a gvpo_jax ModelConfig."""
    return dict(
        vocab=cfg.vocab_size,
        d_model=cfg.hidden_size,
        layers=cfg.num_layers,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        mlp=cfg.intermediate_size,
        tied=cfg.tie_word_embeddings,
    )


# ----------------------------------------------------------------------------- timing


def load1() -> float:
    """1-minute load average: > cores means other processes shared the CPU during the figure."""
    return os.getloadavg()[0]


@dataclasses.dataclass
class Timing:
    """Wall and CPU times of repeated calls (seconds) after a first, compiling call.

    cpu_s is the process CPU time (all threads) of each call: on a shared machine, where other
    processes take cores away, wall time grows but CPU time (the work done) barely moves, so
    FLOP per CPU-second gives a load-robust utilisation next to the wall-clock one.
    """

    first_s: float  # the first call: trace + compile + one run
    compile_s: float  # XLA trace/lower/compile time inside the first call (0 for eager torch)
    times_s: list[float]
    loads: list[float]  # load1() after each timed call
    cpu_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.times_s)

    @property
    def best_cpu(self) -> float:
        return min(self.cpu_s) if self.cpu_s else float("nan")

    @property
    def median(self) -> float:
        return statistics.median(self.times_s)

    @property
    def load(self) -> float:
        return statistics.mean(self.loads)

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), best=self.best, median=self.median, load=self.load)

    @classmethod
    def from_dict(cls, d: dict) -> Timing:
        return cls(
            d["first_s"], d["compile_s"], list(d["times_s"]), list(d["loads"]), list(d["cpu_s"])
        )


class CompileLog:
    """Counts and times JAX compilations (jax.monitoring events) from every thread of the process.

    `mark()` returns a snapshot; `since(mark)` gives (names of the programs XLA compiled, seconds
    spent tracing + lowering + compiling) after it. Registered once per process (listeners cannot
    be scoped).
    """

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )
    _instance: CompileLog | None = None

    def __init__(self):
        self._lock = threading.Lock()
        self.compiled: list[str] = []
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    @classmethod
    def get(cls) -> CompileLog:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event in self.EVENTS:
            with self._lock:
                self.seconds += duration
                if event == self.EVENTS[-1]:
                    self.compiled.append(str(kwargs.get("fun_name", "?")))

    def mark(self) -> tuple[int, float]:
        with self._lock:
            return len(self.compiled), self.seconds

    def since(self, mark: tuple[int, float]) -> tuple[list[str], float]:
        with self._lock:
            return self.compiled[mark[0] :], self.seconds - mark[1]


class LocalBench:
    """A blocking zero-argument callable to time in this process (see `interleave`).

    `extras` is called once at the end for implementation-specific results (e.g. the loss of
    the first step); `recompiled` names the programs XLA compiled during the timed (not the
    first) calls: empty means no recompilation after the first step.
    """

    def __init__(self, fn: Callable[[], object], extras: Callable[[], dict] | None = None):
        self.fn, self.extras, self.recompiled = fn, extras or dict, []

    def first(self) -> tuple[float, float]:
        """(wall seconds, seconds spent tracing/lowering/compiling) of the first call."""
        log = CompileLog.get()
        mark = log.mark()
        start = time.perf_counter()
        self.fn()
        elapsed = time.perf_counter() - start
        return elapsed, log.since(mark)[1]

    def step(self) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one call."""
        log = CompileLog.get()
        mark = log.mark()
        start, cpu = time.perf_counter(), time.process_time()
        self.fn()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.recompiled += log.since(mark)[0]
        return elapsed, cpu

    def close(self) -> dict:
        return dict(self.extras(), recompiles=len(self.recompiled), recompiled=self.recompiled)


def interleave(benches: dict, repeats: int) -> dict[str, dict]:
    """Times several implementations round-robin: first calls, then `repeats` rounds.

    On a shared machine the load drifts; alternating the implementations call by call exposes
    them to the same conditions, so their ratios are fairer than back-to-back blocks. Each bench
    has first() -> (first_s, compile_s), step() -> (wall s, CPU s), close() -> dict (LocalBench,
    or the tunix worker proxy). Returns {name: close() | {'timing': Timing.as_dict()}}.
    """
    firsts = {name: b.first() for name, b in benches.items()}
    times, cpus, loads = ({name: [] for name in benches} for _ in range(3))
    for _ in range(repeats):
        for name, b in benches.items():
            wall, cpu = b.step()
            times[name].append(wall)
            cpus[name].append(cpu)
            loads[name].append(load1())
    out = {}
    for name, b in benches.items():
        timing = Timing(firsts[name][0], firsts[name][1], times[name], loads[name], cpus[name])
        out[name] = dict(b.close(), timing=timing.as_dict())
    return out


def time_calls(fn: Callable[[], object], repeats: int) -> tuple[Timing, int]:
    """Calls `fn` (which must block until its result is ready) 1 + repeats times.

    Returns the Timing and the number of XLA compilations during the timed (not the first)
    calls: 0 means no recompilation after the first step.
    """
    r = interleave({"fn": LocalBench(fn)}, repeats)["fn"]
    return Timing.from_dict(r["timing"]), r["recompiles"]


# ----------------------------------------------------------------------------- matmul peak


def _best_times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds) over `repeats` calls after a warm-up."""
    fn()  # warm-up (and compile)
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, c = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


def matmul_peak_jax(sizes: Sequence[int] = PEAK_SIZES, repeats: int = 3) -> dict:
    """{n: (FLOP/s, FLOP per CPU-second)} of fp32 jnp.dot [n,n]@[n,n] (XLA default precision)."""
    out = {}
    dot = jax.jit(jnp.dot)
    for n in sizes:
        a = jax.random.normal(jax.random.key(n), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(n + 1), (n, n), jnp.float32)
        wall, cpu = _best_times(lambda a=a, b=b: dot(a, b).block_until_ready(), repeats)
        out[n] = (2.0 * n**3 / wall, 2.0 * n**3 / cpu)
    return out


def matmul_peak_torch(
    sizes: Sequence[int] = PEAK_SIZES, repeats: int = 3, threads: int = 2
) -> dict:
    """{n: (FLOP/s, FLOP per CPU-second)} of fp32 torch.mm with `threads` intra-op threads."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=gen)
        b = torch.randn(n, n, generator=gen)
        wall, cpu = _best_times(lambda a=a, b=b: torch.mm(a, b), repeats)
        out[n] = (2.0 * n**3 / wall, 2.0 * n**3 / cpu)
    return out


@dataclasses.dataclass
class Peak:
    """The machine's measured fp32 matmul throughput: the best over sizes and libraries.

    per_lib: {library: {n: (FLOP/s, FLOP per CPU-second)}}. `flops` (wall clock) is the MFU
    denominator of the issue; `cpu_flops` is the denominator of the load-robust CPU-time MFU.
    """

    per_lib: dict[str, dict[int, tuple[float, float]]]

    @property
    def flops(self) -> float:
        return max(v[0] for d in self.per_lib.values() for v in d.values())

    @property
    def cpu_flops(self) -> float:
        return max(v[1] for d in self.per_lib.values() for v in d.values())

    def describe(self) -> str:
        parts = []
        for lib, d in self.per_lib.items():
            sizes = ", ".join(f"{n}: {v[0] / 1e9:.0f}" for n, v in sorted(d.items()))
            parts.append(f"{lib} ({sizes})")
        return (
            f"fp32 matmul peak {self.flops / 1e9:.0f} GFLOP/s wall (best of "
            + "; ".join(parts)
            + f"); {self.cpu_flops / 1e9:.0f} GFLOP per CPU-second"
        )

    def merge(self, other: Peak) -> Peak:
        """Best of two measurements (e.g. at the start and the end of a run)."""
        libs = {}
        for lib in set(self.per_lib) | set(other.per_lib):
            a, b = self.per_lib.get(lib, {}), other.per_lib.get(lib, {})
            libs[lib] = {}
            for n in set(a) | set(b):
                (wa, ca), (wb, cb) = a.get(n, (0.0, 0.0)), b.get(n, (0.0, 0.0))
                libs[lib][n] = (max(wa, wb), max(ca, cb))
        return Peak(libs)


def measure_peak(sizes: Sequence[int] = PEAK_SIZES, torch: bool = True, repeats: int = 3) -> Peak:
    """jnp.dot (and torch.mm) at each size; MFU divides by the best of all of them."""
    libs = {"jnp.dot": matmul_peak_jax(sizes, repeats)}
    if torch:
        libs["torch.mm"] = matmul_peak_torch(sizes, repeats)
    return Peak(libs)


def utilisation(flops: float, timing: Timing, peak: Peak) -> tuple[float, float]:
    """(wall MFU, CPU-time MFU) of the best call: achieved / measured matmul peak."""
    return flops / timing.best / peak.flops, flops / timing.best_cpu / peak.cpu_flops


# ----------------------------------------------------------------------------- reporting


def machine_info() -> dict:
    """CPU model, cores, memory, load, date and library versions, for BENCHMARKS.md headers."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    return dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=cpu,
        cores=os.cpu_count(),
        mem_gib=round(mem_gib, 1),
        load=[round(x, 2) for x in os.getloadavg()],
        python=platform.python_version(),
        jax=jax.__version__,
        numpy=np.__version__,
    )


def describe_machine(info: dict | None = None) -> str:
    info = info or machine_info()
    return (
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; "
        f"load {info['load'][0]:.2f}/{info['load'][1]:.2f}/{info['load'][2]:.2f}; "
        f"python {info['python']}, jax {info['jax']}"
    )


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are printed as given (format them before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


PERF_HEADERS = (
    "first call s", "compile s", "best s", "median s", "tokens/s", "GFLOP/s", "MFU",
    "best CPU s", "CPU-time MFU", "recompiles", "load",
)  # fmt: skip


def perf_cells(row: dict, *, flops: float, tokens: int, peak: Peak) -> list[str]:
    """The PERF_HEADERS cells of one `interleave` result row (tokens and FLOPs per call)."""
    t = Timing.from_dict(row["timing"])
    mfu, cpu_mfu = utilisation(flops, t, peak)
    return [
        f"{t.first_s:.1f}", f"{t.compile_s:.1f}", f"{t.best:.2f}", f"{t.median:.2f}",
        f"{tokens / t.best:.0f}", f"{flops / t.best / 1e9:.1f}", f"{100 * mfu:.1f}%",
        f"{t.best_cpu:.2f}", f"{100 * cpu_mfu:.1f}%", fmt_recompiles(row), f"{t.load:.1f}",
    ]  # fmt: skip


def fmt_recompiles(row: dict) -> str:
    """'0', or the count and the compiled programs, e.g. '1 (jit(_train_step))'."""
    names = row.get("recompiled", [])
    if not row["recompiles"]:
        return "0"
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    listed = ", ".join(n if c == 1 else f"{n} x{c}" for n, c in counts.items())
    return f"{row['recompiles']} ({listed})"


def ratio_line(name: str, value: float, target: float, higher_is_better: bool = True) -> str:
    """'name: 1.23x (target >= 1.5x): MISS' style line for the targets summary."""
    ok = value >= target if higher_is_better else value <= target
    op = ">=" if higher_is_better else "<="
    return f"{name}: {value:.2f} (target {op} {target:g}): {'met' if ok else 'MISS'}"


def emit_json(tag: str, payload: dict) -> None:
    """One machine-readable line (`tag {json}`) after the human tables, for run_all / workers."""
    print(f"{tag} {json.dumps(payload, default=float)}", flush=True)


def parse_json(tag: str, text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    raise ValueError(f"no '{tag}' line in the output:\n{text[-2000:]}")


# ----------------------------------------------------------------------------- bench model


def bench_model(quick: bool = False, seed: int = 0):
    """bench-45m (gvpo_jax, float32, random init with `seed`), checked against BENCH_45M.

    quick: the 'tiny' preset cut to one layer (vocab 256, D 64), so --quick runs compile in
    about a second each; the code paths are the same.
    """
    from flax import nnx

    from gvpo_jax import models

    if quick:
        cfg = models.PRESETS["tiny"].replace(num_layers=1)
    else:
        cfg = models.PRESETS["bench-45m"]
        if dims_of(cfg) != BENCH_45M:
            raise AssertionError(f"PRESETS['bench-45m'] {dims_of(cfg)} differs from {BENCH_45M}")
    return models.Transformer(cfg, rngs=nnx.Rngs(seed))


def random_prompts(vocab: int, prompts: int, length: int, seed: int = 0) -> np.ndarray:
    """int32 [P, length] ids in [1, vocab): 0 stays free as the pad id."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, (prompts, length)).astype(np.int32)
