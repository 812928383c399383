"""A process pool with a hard per-task timeout: an overrunning task's worker is killed and replaced.

math-verify's own timeout uses SIGALRM, which works only in a main thread and cannot stop a long
C-level computation (sympy evaluating 9^9^9^9). So rewards run in worker processes fed tasks one
at a time over pipes, and an overrun is answered by SIGKILL. The workers are forked from a zygote
(`rewards.worker`): one fresh interpreter started with `subprocess` (nothing of the parent's JAX
threads or `__main__` is inherited or re-imported) that imports sympy and math-verify once, so a
replacement is ready in milliseconds instead of the 1-3 s of a new interpreter's imports.

Cost of a timeout, measured with 2 workers on the 2-core machine (1 s timeout, batches of 32 math
answers, median of 5): a `map` ends at its overrunning task's deadline, 0.27 s -> 1.08 s with one
such task and 1.66 s with two on different workers, so a timeout costs at most `timeout_s` of wall
time per call and per worker it lands on. Replacing the killed worker adds milliseconds, also
when timeouts come back to back (1.00-1.01 s per 1 s-timeout call; 1.0-4.9 s with a fresh
interpreter per replacement on the loaded machine). Start-up: 0.8-0.9 s, paid once.
"""

from __future__ import annotations

import atexit
import collections
import os
import socket
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
_START_TIMEOUT_S = 120.0  # a worker not ready by then (the zygote's imports take ~1 s) is replaced


class _Zygote:
    """The interpreter that imports the reward modules once and forks workers on request."""

    def __init__(self, preload: Sequence[str]):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(gvpo_jax.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        cmd = [sys.executable, "-m", "gvpo_jax.rewards.worker", str(theirs.fileno()), *preload]
        # Its own session: terminal signals do not reach the workers, and on the parent's exit
        # (its stdin pipe closes) the zygote can kill the whole group, stuck workers included.
        self.proc = subprocess.Popen(
            cmd, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.PIPE, start_new_session=True
        )
        theirs.close()

    def fork(self) -> tuple[Connection, Connection]:
        """A new worker's task and result connections (parent ends); it reports ready itself."""
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        try:
            socket.send_fds(self.control, [b"fork"], [task_r, result_w])
        except OSError:
            pass  # the zygote is gone: the result pipe reads EOF at once, a failed start
        finally:
            os.close(task_r)
            os.close(result_w)
        return Connection(task_w, readable=False), Connection(result_r, writable=False)

    def kill(self, pid: int) -> None:
        try:
            self.control.send(b"kill %d" % pid)
        except OSError:
            pass  # the zygote is gone, and with it its process group

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.stdin.close()  # the zygote kills its group (every worker) and exits
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.control.close()


class _Worker:
    """One forked worker: the two pipe ends the parent holds and its state in `map`."""

    def __init__(self, zygote: _Zygote):
        self.zygote = zygote
        self.tasks, self.results = zygote.fork()
        self.pid: int | None = None  # from its ready message
        self.ready = False
        self.start_deadline = time.monotonic() + _START_TIMEOUT_S
        self.task: tuple[int, float] | None = None  # (task index, deadline) while busy

    def kill(self) -> None:
        if self.pid is not None:
            self.zygote.kill(self.pid)
        self.tasks.close()
        self.results.close()


class WorkerPool:
    """`num_workers` reward processes; `map` runs picklable module-level functions with a deadline.

    Start-up is asynchronous (the zygote takes ~1 s to import math-verify and sympy) and paid
    once: reuse one pool for the whole run (see `get_pool`). Not for concurrent use from several
    threads.
    """

    def __init__(self, num_workers: int, *, preload: Sequence[str] = DEFAULT_PRELOAD):
        if num_workers < 1:
            raise ValueError(f"num_workers is {num_workers}; a pool needs at least one worker.")
        self._preload = tuple(preload)
        self._zygote = _Zygote(self._preload)
        self._workers = [_Worker(self._zygote) for _ in range(num_workers)]
        self._lock = threading.Lock()
        self.restarts = 0

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _restart(self, i: int) -> None:
        self._workers[i].kill()
        if not self._zygote.alive():  # it died (or failed to import): start another
            self._zygote.close()
            self._zygote = _Zygote(self._preload)
        self._workers[i] = _Worker(self._zygote)
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
                        results[w.task[0]] = ("error", f"worker {w.pid} exited")
                    elif not w.ready:
                        failed_starts = self._failed_start(failed_starts)
                    self._restart(i)
                    continue
                if tag == "ready":
                    w.ready, w.pid = True, status
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

    def _failed_start(self, failed_starts: int) -> int:
        if failed_starts + 1 >= _START_ATTEMPTS:
            raise RuntimeError(
                "reward workers fail to start; run `python -c 'import "
                f"{', '.join(self._preload)}'` to see the error."
            )
        return failed_starts + 1

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        if self._workers:
            self._zygote.close()
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
