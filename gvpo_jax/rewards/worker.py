"""Reward worker process: `python -m gvpo_jax.rewards.worker TASK_FD RESULT_FD [MODULE ...]`.

Imports the given modules, reports ready, then runs `(task_id, fn, args)` messages one at a time
and answers `(task_id, "ok", value)` or `(task_id, "error", message)`. Started by `pool.WorkerPool`
as a fresh interpreter (never forked from a process that holds JAX threads), killed on timeout.
"""

from __future__ import annotations

import importlib
import os
import sys
from multiprocessing.connection import Connection


def main(argv: list[str]) -> None:
    task_fd, result_fd = int(argv[1]), int(argv[2])
    for module in argv[3:]:
        importlib.import_module(module)
    tasks = Connection(task_fd, writable=False)
    results = Connection(result_fd, readable=False)
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


if __name__ == "__main__":
    main(sys.argv)
