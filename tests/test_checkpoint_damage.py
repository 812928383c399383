"""A damaged checkpoint never strands a run: the manifest notices damage, the restore falls back
to the newest restorable step (moving the damaged ones aside), and a run resumed that way ends
with the weights of an uninterrupted one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from gvpo_jax import checkpoint
from gvpo_jax.checkpoint import Checkpointer, CheckpointError, restore_newest
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[1]
_ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
ABSTRACT = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=_ONE_DEVICE)}


def _state(step: int) -> dict:
    return {"w": jnp.full((64, 32), float(step), jnp.float32) + jnp.arange(32.0)}


def _largest_tensor_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in p.as_posix()]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir: Path) -> None:
    f = _largest_tensor_file(step_dir)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def _delete(step_dir: Path) -> None:
    _largest_tensor_file(step_dir).unlink()


def _tear_metadata(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").write_text('{"step": ')


def _flip_byte(step_dir: Path) -> None:
    f = _largest_tensor_file(step_dir)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "deleted": _delete, "torn_json": _tear_metadata,
          "flipped_byte": _flip_byte}  # fmt: skip


def _listing(root: Path) -> dict[str, int]:
    return {
        p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()
    }


def _saved(tmp_path: Path, steps=(1, 2, 3)) -> Path:
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, save_every=1, keep=10) as ckpt:
        for step in steps:
            ckpt.save(step, _state(step), meta={"step": step})
    return directory


def _attempt(ckpt):
    return lambda directory, step: ckpt.restore(ABSTRACT, step=step, directory=directory)


# ---------------------------------------------------------------- the manifest


def test_every_committed_step_gets_a_manifest_that_notices_damage(tmp_path):
    directory = _saved(tmp_path)
    for step in (1, 2, 3):
        manifest = json.loads((directory / str(step) / checkpoint.MANIFEST).read_text())
        assert manifest["hash"] == "crc32" and len(manifest["files"]) > 3
        assert checkpoint.check_manifest(directory / str(step), checksums=True) is None
    _truncate(directory / "3")
    assert "bytes where" in checkpoint.check_manifest(directory / "3", checksums=False)
    _delete(directory / "2")
    assert "is missing" in checkpoint.check_manifest(directory / "2", checksums=False)
    _flip_byte(directory / "1")  # same size: only the checksum sees it
    assert checkpoint.check_manifest(directory / "1", checksums=False) is None
    assert "CRC-32" in checkpoint.check_manifest(directory / "1", checksums=True)
    # The checksum work splits over processes: each checks its share of the files.
    shares = [checkpoint.check_manifest(directory / "1", checksums=True, part=(i, 2))
              for i in range(2)]  # fmt: skip
    assert sum(s is not None for s in shares) == 1


# ---------------------------------------------------------------- the fallback


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_restore_falls_back_past_a_damaged_step_and_moves_it_aside(tmp_path, kind):
    directory = _saved(tmp_path)
    DAMAGE[kind](directory / "3")
    lines = []
    with Checkpointer(directory, save_every=1, keep=10, verify=True) as ckpt:
        (state, meta, _), where, step = restore_newest(
            ckpt, None, tmp_path, _attempt(ckpt), log=lines.append
        )
        assert step == 2 and meta == {"step": 2} and where == directory
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(2)["w"]))
        assert len(lines) == 1 and lines[0].startswith("Checkpoint step 3 is damaged (")
        assert lines[0].endswith(f"moved it to {directory / 'damaged-3'} and resuming from step 2.")
        assert (directory / "damaged-3").is_dir() and not (directory / "3").exists()
        # The next save of step 3 does not collide with the damaged one.
        assert ckpt.all_steps() == [1, 2]
        assert ckpt.save(3, _state(30), meta={"step": 3})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]


def test_no_restorable_step_is_an_error_and_nothing_moves(tmp_path):
    directory = _saved(tmp_path, steps=(1, 2))
    _truncate(directory / "2")
    _tear_metadata(directory / "1")
    before = _listing(tmp_path)
    with Checkpointer(directory, save_every=1, keep=10) as ckpt:
        with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be restored \(step 2"):
            restore_newest(ckpt, None, tmp_path, _attempt(ckpt))
    assert _listing(tmp_path) == before


def test_a_damaged_explicit_restore_path_does_not_fall_back(tmp_path):
    directory = _saved(tmp_path)
    _truncate(directory / "3")
    before = _listing(tmp_path)
    with Checkpointer(tmp_path / "other", save_every=1, keep=10) as ckpt:
        with pytest.raises(CheckpointError, match=r"restore_from .*/3 cannot be restored"):
            restore_newest(ckpt, directory / "3", tmp_path / "elsewhere", _attempt(ckpt))
        # A good explicit step restores as before.
        (_, meta, _), _, step = restore_newest(ckpt, directory / "2", tmp_path, _attempt(ckpt))
    assert step == 2 and meta == {"step": 2}
    assert _listing(tmp_path) == before


_KILLED_AT_COMMIT = """
import os, signal, sys
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from gvpo_jax.checkpoint import Checkpointer

real = atomicity.AtomicRenameTemporaryPath.finalize

async def finalize(self):
    if self._final_path.name == "2":  # written, not committed: the process dies here
        os.kill(os.getpid(), signal.SIGKILL)
    return await real(self)

atomicity.AtomicRenameTemporaryPath.finalize = finalize
ckpt = Checkpointer(sys.argv[1], save_every=1, keep=10)
for step in (1, 2):
    ckpt.save(step, {"w": jnp.full((64, 32), float(step)) + jnp.arange(32.0)}, meta={"step": step})
ckpt.wait()
print("not killed")
"""


def test_sigkill_between_writing_and_committing_resumes_from_the_last_complete_step(tmp_path):
    directory = tmp_path / "checkpoints"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_AT_COMMIT), str(directory)],
        env=child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)), cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    assert any("tmp" in n for n in os.listdir(directory))  # step 2's uncommitted directory
    with Checkpointer(directory, save_every=1, keep=10) as ckpt:
        (state, meta, _), _, step = restore_newest(ckpt, None, tmp_path, _attempt(ckpt))
        assert step == 1 and meta == {"step": 1}
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(1)["w"]))
        assert ckpt.save(2, _state(2), meta={"step": 2})  # no collision with the leftover
        ckpt.wait()
    assert not [n for n in os.listdir(directory) if "tmp" in n]


# ---------------------------------------------------------------- the trainer, end to end

RUN_ARGS = [
    "--config=configs/arith_tiny.py", "--config.sft.steps=4", "--config.data.eval_size=8",
    "--config.train.eval_every=0", "--config.train.checkpoint_every=2",
    "--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4",
    "--config.train.plot=False", "--config.train.eval_samples=1",
    "--config.model.overrides.num_layers=1", "--config.train.steps=4",
]  # fmt: skip


def _run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gvpo_jax.main", f"--workdir={workdir}", *RUN_ARGS, *extra]
    return subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A run of 4 RL steps with checkpoints at steps 2 and 4 and its exported weights."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_trainer_resumes_from_the_last_good_step_to_the_uninterrupted_weights(
    straight, tmp_path, kind
):
    """Step 4 damaged: the rerun says so in one line, moves it aside, resumes from step 2 and
    ends with the weights of the uninterrupted run (resume is bit-exact)."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    shutil.rmtree(workdir / "export")
    DAMAGE[kind](workdir / "checkpoints" / "4")
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("Checkpoint step 4 is damaged")]
    assert len(lines) == 1 and lines[0].endswith("and resuming from step 2."), proc.stdout[-2000:]
    assert "Resumed from" in proc.stdout and "at step 2." in proc.stdout
    assert "Traceback" not in proc.stderr
    assert (workdir / "checkpoints" / "damaged-4").is_dir()
    a = load_file(str(straight / "export" / "model.safetensors"))
    b = load_file(str(workdir / "export" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_trainer_with_every_step_damaged_exits_2_in_one_line_and_keeps_the_files(
    straight, tmp_path
):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    _truncate(workdir / "checkpoints" / "4")
    _delete(workdir / "checkpoints" / "2")
    before = _listing(workdir / "checkpoints")
    proc = _run(workdir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("error: no checkpoint in ") and "step 4" in err[-1], err[-3:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    assert _listing(workdir / "checkpoints") == before
    # An explicit restore_from at a damaged step is named, not skipped.
    proc = _run(tmp_path / "other", f"--config.restore_from={workdir / 'checkpoints' / '4'}")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: restore_from ") and "cannot be restored" in last, last
    assert _listing(workdir / "checkpoints") == before
