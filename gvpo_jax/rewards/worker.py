"""Reward worker processes: `python -m gvpo_jax.rewards.worker CONTROL_FD [MODULE ...]`.

What `pool.WorkerPool` starts is a zygote: a fresh interpreter (never the trainer forked: it holds
JAX threads) that imports the given modules once (sympy and math-verify take ~1 s or more on a
busy machine), then forks one worker per request, so a worker, first or replacement, is ready in
milliseconds. A preloaded module's `warm_up()`, where it has one, runs here once after the
imports, so what a module builds lazily on first use is built before any fork, not in every
worker. The zygote is single-threaded, which is what makes forking it safe.

Control socket (datagrams from the parent): b"fork" carrying two fds, the worker's task read end
and result write end; b"kill PID" kills and reaps that worker (reaped only then, so a PID is never
reused while the parent may still name it). Its stdin is a pipe the parent never writes: when it
closes, the parent is gone, and the zygote kills its process group (itself and every worker).

A worker reports `("ready", pid, None)`, then answers `(task_id, fn, args)` messages one at a time
with `(task_id, "ok", value)` or `(task_id, "error", message)`.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import sys
from multiprocessing.connection import Connection


def serve(tasks: Connection, results: Connection) -> None:
    results.send(("ready", os.getpid(), None))
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        if message is None:
            return
        task_id, fn, args = message
        try:
            reply = (task_id, "ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - a reward's failure is data, not a crash
            if isinstance(e, KeyboardInterrupt):
                raise
            reply = (task_id, "error", f"{type(e).__name__}: {e}")
        results.send(reply)


def zygote(control: socket.socket) -> None:
    while True:
        readable, _, _ = select.select([control, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            if os.getpgrp() == os.getpid():  # started in its own session: the group is ours
                os.killpg(0, signal.SIGKILL)
            return
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, 64, 2)
        if message == b"fork" and len(fds) == 2 and os.fork() == 0:
            control.close()
            code = 1
            try:
                serve(Connection(fds[0], writable=False), Connection(fds[1], readable=False))
                code = 0
            finally:
                os._exit(code)  # a worker never returns into the zygote's loop
        if message.startswith(b"kill "):
            _kill_and_reap(int(message[5:]))
        for fd in fds:
            os.close(fd)


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # not a child of this zygote (a stale request)


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[1]))
    for name in argv[2:]:
        module = importlib.import_module(name)
        if callable(getattr(module, "warm_up", None)):
            module.warm_up()  # once here, so every forked worker starts warm
    zygote(control)


if __name__ == "__main__":
    main(sys.argv)
