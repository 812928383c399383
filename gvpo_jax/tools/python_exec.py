"""A Python executor for code a policy writes, which is untrusted.

Each call runs in a fresh process (`python -I -S`: no environment variables, user or site
packages: the standard library only) in its own temporary directory, which is deleted after it,
with limits the kernel enforces (`resource`): address space (`memory_mb`), CPU seconds, the size
of any file written, open files, no core dumps; a wall-clock limit the parent enforces (the
process group is killed) and a cap on what the parent reads of its output (past it the process is
killed and the output cut). Inside, an audit hook (PEP 578) refuses: opening, listing or
changing anything outside the temporary directory (reading the standard library aside), so the
run's files, checkpoints and the host's configuration are out of reach; starting processes,
`os.system`, sockets, and `ctypes` (the usual way around a hook). A hook is not a security
boundary against a determined attacker with a memory-corruption bug in CPython: for that, run
the trainer in a container; it does keep a policy's code from reading or changing what it
should not through the language.

    run_python("print(sum(range(10)))")            # Observation("45\\n")
    run_python("while True: pass", timeout_s=1)    # Observation("Error: timed out ...", ok=False)
"""

from __future__ import annotations

import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

from gvpo_jax.tools.registry import Observation

# The child's own program: install the hook, then run the code read from stdin.
_RUNNER = r"""
import os, sys, traceback
_root = os.path.realpath(sys.argv[1])
_read_roots = tuple(os.path.realpath(p) for p in sys.argv[2:]) + (_root,)
_code = sys.stdin.read()
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _inside(path, roots):
    if isinstance(path, int):
        return True
    p = os.path.realpath(os.fsdecode(path))
    return any(p == r or p.startswith(r + os.sep) for r in roots)

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags & _WRITE)
        if not _inside(path, (_root,) if writes else _read_roots):
            raise PermissionError(f"access outside the tool's directory: {path}")
    elif event in ("os.listdir", "os.scandir", "glob.glob", "os.chdir", "os.remove", "os.rmdir",
                   "os.mkdir", "os.rename", "os.symlink", "os.link", "os.chmod", "os.chown",
                   "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
                   "shutil.copytree", "shutil.move"):
        reads = event in ("os.listdir", "os.scandir", "glob.glob")
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(
                    path, _read_roots if reads else (_root,)):
                raise PermissionError(f"access outside the tool's directory: {path}")
    elif event.startswith(("subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                           "os.system", "os.kill", "os.killpg", "socket.", "ctypes.")) or (
            event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes")):
        raise PermissionError(f"{event} is not allowed in the tool")

sys.addaudithook(_hook)
del _hook
try:
    exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    pass
except BaseException as e:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<tool>"]
    where = f"line {frames[-1].lineno}: " if frames else ""
    print(f"{where}{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(1)
"""


def _limit(pid: int, memory_mb: int, cpu_s: int, file_mb: int) -> None:
    """The kernel's limits on the child, set from outside (`prlimit`: no code runs between
    fork and exec, which a trainer's threads make unsafe) before it reads the code."""
    for limit, value in (
        (resource.RLIMIT_AS, memory_mb << 20),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, file_mb << 20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.prlimit(pid, limit, (value, value))


def _stdlib_roots() -> list[str]:
    """What the child may read besides its directory: the interpreter's standard library."""
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], sys.base_prefix}
    return sorted(os.path.realpath(p) for p in roots)


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    file_mb: int = 8,
    max_output: int = 4000,
) -> Observation:
    """Runs `code` as above; the observation is its stdout and stderr (in order, cut at
    `max_output` characters), or an error saying which limit stopped it. Never raises for
    anything the code does."""
    workdir = tempfile.mkdtemp(prefix="gvpo_tool_")
    cmd = [sys.executable, "-I", "-S", "-c", _RUNNER, workdir, *_stdlib_roots()]
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8"}
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,  # its own process group: killed whole
        )
    except OSError as e:
        shutil.rmtree(workdir, ignore_errors=True)
        return Observation(f"Error: the Python tool could not start ({e}).", False)
    try:
        _limit(proc.pid, memory_mb, int(timeout_s) + 1, file_mb)
        out, stopped = _read(proc, code.encode(), timeout_s, max_output)
    finally:
        _kill(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode("utf-8", "replace")
    if stopped == "timeout":
        return Observation(f"{text}\nError: timed out after {timeout_s:g} s.".lstrip(), False)
    if stopped == "output":
        return Observation(f"{text}\n[output cut at {max_output} characters]", False)
    code_ = proc.returncode
    if code_ and code_ < 0:
        sig = signal.Signals(-code_).name
        why = "CPU time limit" if sig == "SIGXCPU" else f"killed by {sig}"
        return Observation(f"{text}\nError: {why}.".lstrip(), False)
    if code_:
        if "MemoryError" in text:
            text += f"\n(the memory limit is {memory_mb} MB)"
        return Observation(text, False)
    return Observation(text, True)


def _read(proc, stdin: bytes, timeout_s: float, max_output: int) -> tuple[bytes, str | None]:
    """Feeds stdin, reads the output until the process exits, the deadline passes or the output
    exceeds its cap: (output, None | "timeout" | "output")."""
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    deadline = time.monotonic() + timeout_s
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), "timeout"
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:  # end of output: the process is ending
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    return bytes(out), "timeout"
                return bytes(out), None
            out += chunk
            if len(out) > max_output:
                return bytes(out[:max_output]), "output"


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    proc.stdout.close()


def python(code: str) -> Observation:
    """Runs Python code (the standard library only) and returns what it prints.

    Args:
        code: a Python program; print the values you need.
    """
    return run_python(code)
