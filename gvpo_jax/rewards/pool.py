"""A process pool with a hard per-task timeout: an overrunning task's worker is killed and replaced.

math-verify's own timeout uses SIGALRM, which works only in a main thread and cannot stop a long
C-level computation (sympy evaluating 9^9^9^9). So rewards run in separate interpreters started with
`subprocess` (fresh, so nothing of the parent's JAX threads or `__main__` is inherited or
re-imported), fed tasks one at a time over pipes; an overrun is answered by SIGKILL.
"""

from __future__ import annotations

import atexit
import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import gvpo_jax

DEFAULT_PRELOAD = ("gvpo_jax.rewards.verifiers",)
_START_ATTEMPTS = 3  # consecutive workers dying before "ready" means a broken environment
_START_TIMEOUT_S = 120.0  # a worker not ready by then (importing sympy takes ~1 s) is replaced


class _Worker:
    """One worker interpreter and the two pipe ends the parent holds."""

    def __init__(self, preload: Sequence[str]):
        task_r, self._task_w = os.pipe()
        self._result_r, result_w = os.pipe()
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(gvpo_jax.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        cmd = [sys.executable, "-m", "gvpo_jax.rewards.worker", str(task_r), str(result_w)]
        self.proc = subprocess.Popen(
            [*cmd, *preload], pass_fds=(task_r, result_w), env=env, stdin=subprocess.DEVNULL
        )
        os.close(task_r)
        os.close(result_w)
        self.tasks = Connection(self._task_w, readable=False)
        self.results = Connection(self._result_r, writable=False)
        self.ready = False
        self.start_deadline = time.monotonic() + _START_TIMEOUT_S
        self.task: tuple[int, float] | None = None  # (task index, deadline) while busy

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.tasks.close()
        self.results.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        try:
            self.tasks.send(None)
            self.proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class WorkerPool:
    """`num_workers` reward processes; `map` runs picklable module-level functions with a deadline.

    Start-up is asynchronous (a worker takes ~0.5 s to import math-verify and sympy) and paid once:
    reuse one pool for the whole run (see `get_pool`). Not for concurrent use from several threads.
    """

    def __init__(self, num_workers: int, *, preload: Sequence[str] = DEFAULT_PRELOAD):
        if num_workers < 1:
            raise ValueError(f"num_workers is {num_workers}; a pool needs at least one worker.")
        self._preload = tuple(preload)
        self._workers = [_Worker(self._preload) for _ in range(num_workers)]
        self._lock = threading.Lock()
        self.restarts = 0

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _restart(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._preload)
        self.restarts += 1

    def map(
        self, fn: Callable[..., Any], args_list: Sequence[tuple], *, timeout_s: float
    ) -> list[tuple[str, Any]]:
        """Runs `fn(*args)` for each args; returns `(status, value)` per task, in order.

        status is "ok" (value = the return value), "error" (value = message) or "timeout"
        (value = None; the task ran longer than `timeout_s` seconds from its dispatch and its
        worker was killed and replaced).
        """
        with self._lock:
            return self._map(fn, args_list, timeout_s)

    def _map(self, fn, args_list, timeout_s) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any] | None] = [None] * len(args_list)
        pending = collections.deque(range(len(args_list)))
        failed_starts = 0
        while pending or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    j = pending.popleft()
                    w.task = (j, time.monotonic() + timeout_s)
                    try:
                        w.tasks.send((j, fn, args_list[j]))
                    except OSError:  # died while idle: retry the task on its replacement
                        pending.appendleft(j)
                        self._restart(self._workers.index(w))
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            deadlines = [w.task[1] if w.task is not None else w.start_deadline for w in waiting]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            readable = wait([w.results for w in waiting], timeout=wait_s)
            for i, w in enumerate(list(self._workers)):
                if w.results not in readable:
                    continue
                try:
                    tag, status, value = w.results.recv()
                except (EOFError, OSError):
                    if w.task is not None:
                        results[w.task[0]] = ("error", f"worker exited ({w.proc.poll()})")
                    elif not w.ready:
                        failed_starts = self._failed_start(failed_starts)
                    self._restart(i)
                    continue
                if tag == "ready":
                    w.ready = True
                    failed_starts = 0
                else:
                    results[tag] = (status, value)
                    w.task = None
            now = time.monotonic()
            for i, w in enumerate(list(self._workers)):
                if w.task is not None and now >= w.task[1]:
                    results[w.task[0]] = ("timeout", None)
                    self._restart(i)
                elif not w.ready and now >= w.start_deadline:
                    failed_starts = self._failed_start(failed_starts)
                    self._restart(i)
        return results  # type: ignore[return-value]

    @staticmethod
    def _failed_start(failed_starts: int) -> int:
        if failed_starts + 1 >= _START_ATTEMPTS:
            raise RuntimeError(
                "reward workers fail to start; run `python -m gvpo_jax.rewards.worker 0 1 "
                "gvpo_jax.rewards.verifiers` to see the error."
            )
        return failed_starts + 1

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []


_POOLS: dict[int, WorkerPool] = {}


def get_pool(num_workers: int) -> WorkerPool:
    """The process-wide pool of `num_workers` workers, created on first use, closed at exit."""
    if num_workers not in _POOLS:
        _POOLS[num_workers] = WorkerPool(num_workers)
    return _POOLS[num_workers]


@atexit.register
def close_pools() -> None:
    """Stops every pool made by `get_pool` (registered with atexit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
