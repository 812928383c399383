"""The run's compiled programs: compiled ahead in background threads (`Ahead`), and counted
where a step meets them (`Counter`).

A run knows the shapes its update and log-prob passes will take before it takes them (one per
response width, `buckets.Updater`), so the trainer (`train.compile_ahead`) hands them to `Ahead`
at the start of the RL phase: they are lowered and compiled in background threads while the
first evaluation and rollout run, and each call of a program still compiling waits for it
instead of compiling it again. A program XLA compiled once stays in its jit's cache, so the
later call runs it without tracing, lowering or compiling. `Counter` gives the step metrics
`new_programs` (programs lowered during the step outside those threads: met for the first time)
and `compile_time_s`, which should be 0 after the warm-up.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import threading
from collections.abc import Callable, Hashable

import jax

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # once per program met
COMPILE_EVENTS = "/jax/core/compile/"  # trace, lower and compile durations

_thread = threading.local()  # .ahead: True in Ahead's threads, whose programs Counter skips


# Python's cyclic collector runs its youngest generation every 700 net container allocations
# by default; tracing and lowering a program allocate millions of short-lived ones.
GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> None:
    """Python's cyclic garbage collector set for a process that traces and compiles programs.

    What is alive now (the imported modules, the config) is frozen out of every later
    collection (`gc.freeze`), and the youngest generation is collected every 50,000 container
    allocations instead of 700 (`GC_THRESHOLDS`). Called by the CLI and the studies' entry
    points after their imports, never by a library function (it sets the whole interpreter's
    collector). Measured on the 2-core machine: a 4-step run of the tiny demo model on one
    layer spent 1.0 s of ~10 s in collections at Python's defaults and 0.15 s with these
    thresholds (0.2 s at 10,000 and at 200,000), with the same peak resident memory; the
    continuous-batching tests' process spent 5.1 s and 2.0 s (BENCHMARKS section 9).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def default_threads() -> int:
    """Compile threads for a host: a quarter of its cores, 1 to 4 (the rest sample and feed)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _mark_ahead() -> None:
    _thread.ahead = True


class Ahead:
    """Programs compiled in background threads, each under a key.

    `submit(key, compile_fn)` queues `compile_fn()` (e.g. `jitted.lower(*args).compile()`).
    `ready(key)` goes before a call that would compile that program: it waits while the compile
    runs, drops it when it has not started (the call compiles it itself, counted in
    `reached_first`: how many depends on the host's speed), and returns at once
    when it is done or was never submitted. A compile that fails is recorded in `failed` and
    left to the call, which compiles again and raises the error where it belongs.
    """

    def __init__(self, threads: int | None = None):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads or default_threads(),
            thread_name_prefix="compile-ahead",
            initializer=_mark_ahead,
        )
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # programs compiled ahead
        self.reached_first = 0  # programs a call reached before their compile started
        self.failed: list[str] = []

    def submit(self, key: Hashable, compile_fn: Callable[[], object]) -> None:
        with self._lock:
            self._futures[key] = self._pool.submit(self._compile, key, compile_fn)

    def _compile(self, key: Hashable, compile_fn: Callable[[], object]) -> None:
        try:
            compile_fn()
        except Exception as e:  # the call compiles it again and raises it there
            with self._lock:
                self.failed.append(f"{key}: {type(e).__name__}: {e}")
            return
        with self._lock:
            self.compiled += 1

    def ready(self, key: Hashable) -> None:
        with self._lock:
            future = self._futures.pop(key, None)
        if future is None:
            return
        if future.cancel():
            with self._lock:
                self.reached_first += 1
        else:
            future.result()

    def pending(self) -> int:
        """Programs submitted and not yet compiled (nor taken by `ready`)."""
        with self._lock:
            return sum(not f.done() for f in self._futures.values())

    def close(self, wait: bool = False) -> None:
        """Drops the programs not started (`wait`: compiles them all first, and waits)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)


class Counter:
    """Programs met (lowered) outside `Ahead`'s threads and the seconds spent tracing, lowering
    and compiling them, since the last `take()`. A context manager: jax's monitoring listeners
    are registered inside it only."""

    def __init__(self):
        self._lock = threading.Lock()
        self._programs, self._seconds = 0, 0.0

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        if getattr(_thread, "ahead", False) or not event.startswith(COMPILE_EVENTS):
            return
        with self._lock:
            self._programs += event == LOWERED
            self._seconds += seconds

    def __enter__(self) -> Counter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def take(self) -> dict[str, float]:
        """{"new_programs", "compile_time_s"} since the last call, and a fresh count."""
        with self._lock:
            out = {"new_programs": float(self._programs), "compile_time_s": self._seconds}
            self._programs, self._seconds = 0, 0.0
        return out
