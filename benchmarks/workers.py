"""Driver side of a benchmark worker: a process (often in a peer library's own virtualenv) that
takes one command per line on stdin and answers each with one line `WORKER {json}`.

Standard library only: the workers' own interpreters (`.venv-trl`, `.venv-tunix`) import it too.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scratch_dir(prefix: str) -> str:
    """A new temporary directory (a run's work directory), removed when the process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class WorkerError(RuntimeError):
    """A worker could not be started or stopped answering; the message says why."""


class LineWorker:
    """Starts `argv` in the repository on the real CPU (the tests' fake devices removed) and
    reads its first answer (`info`: what it loaded). `tail` lines of its stderr, joined by `sep`,
    explain a worker that exits instead of answering."""

    def __init__(self, name: str, argv: list[str], *, env: dict | None = None, tail: int = 4,
                 sep: str = " / "):  # fmt: skip
        self.name, self.tail, self.sep = name, tail, sep
        full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **(env or {}))
        # The real CPU: a fake device count is dropped, other XLA flags (e.g. the test suite's
        # compile flags) are kept.
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       full_env.pop("XLA_FLAGS", "")).strip()  # fmt: skip
        if flags:
            full_env["XLA_FLAGS"] = flags
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True,
        )  # fmt: skip
        self.info = self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("WORKER "):
                return json.loads(line[len("WORKER ") :])
        self.proc.wait()
        self.stderr.seek(0)
        tail = self.sep.join(self.stderr.read().strip().splitlines()[-self.tail :])
        raise WorkerError(f"{self.name} worker exited with {self.proc.returncode}: {tail}")

    def send(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()
