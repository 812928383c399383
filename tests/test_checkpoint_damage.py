"""A damaged checkpoint never strands a run: the manifest notices damage, the restore falls back
to the newest restorable step (moving the damaged ones aside), and a run resumed that way ends
with the weights of an uninterrupted one. A full disk while saving ends the run in one sentence
with the step before intact, and damaged weight files are named in one sentence."""

import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from gvpo_jax import checkpoint, errors, models
from gvpo_jax.checkpoint import Checkpointer, CheckpointError, CheckpointWriteError, restore_newest
from gvpo_jax.models import safetensors_io
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


# ---------------------------------------------------------------- a full disk


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes of this process past `nbytes` fail with EFBIG (RLIMIT_FSIZE), as writes to a full
    disk fail with ENOSPC: the same error path through tensorstore and Orbax, nothing mounted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _noise(step: int) -> dict:
    """256 KiB that zstd cannot shrink under the limit."""
    w = np.random.default_rng(step).normal(size=(256, 256))
    return {"w": jnp.asarray(w, jnp.float32, device=_ONE_DEVICE)}


def test_a_full_disk_fails_the_save_in_one_sentence_and_keeps_the_step_before(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    ckpt = Checkpointer(directory, save_every=1, keep=1)  # keep=1: the step before must stay
    ckpt.save(1, _noise(1), meta={"step": 1})
    ckpt.wait()
    before = _listing(directory)
    caplog.clear()
    with _file_size_limit(64 * 1024):
        assert ckpt.save(2, _noise(2), meta={"step": 2})  # async: it fails in the background,
        with pytest.raises(CheckpointWriteError) as failed:  # seen by the next save
            ckpt.save(3, _noise(3), meta={"step": 3})
    assert isinstance(failed.value, errors.FaultError)  # the CLI's exit status 1, not 2
    assert str(failed.value) == (
        f"checkpoint step 2 could not be written to {directory} (File too large); its partial "
        "files were removed and step 1 is intact: free space and rerun to resume from it."
    )
    ckpt.close()  # reported once: closing does not raise it again
    assert _listing(directory) == before  # step 1 untouched, nothing of step 2 left
    # Orbax's pages of tracebacks about it (one per thread, logged at ERROR) are not printed.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]
    # With room again a rerun resumes from step 1 and saves step 2.
    with Checkpointer(directory, save_every=1, keep=1) as ckpt:
        abstract = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=_ONE_DEVICE)}
        (state, meta, _), _, step = restore_newest(
            ckpt, None, tmp_path, lambda d, s: ckpt.restore(abstract, step=s, directory=d)
        )
        assert step == 1 and meta == {"step": 1}
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_noise(1)["w"]))
        assert ckpt.save(2, _noise(2), meta={"step": 2})
    assert checkpoint.check_manifest(directory / "2", checksums=True) is None
    assert sorted(os.listdir(directory)) == ["2"]


def test_a_weight_file_the_disk_refuses_is_one_sentence_and_no_partial_file(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = [("w", (256, 256), np.float32, lambda: _noise(0)["w"])]
    with _file_size_limit(64 * 1024), pytest.raises(errors.FaultError) as failed:
        safetensors_io.write_file(path, tensors)
    assert str(failed.value) == (
        f"{path} could not be written (File too large); free space (or fix the directory's "
        "permissions) and rerun."
    )
    assert not path.exists()


# ---------------------------------------------------------------- damaged weight files


def _hf_dir(path: Path) -> Path:
    """A Hugging Face directory of a tiny model: config.json and model.safetensors of zeros."""
    cfg = models.PRESETS["tiny"].replace(num_layers=1)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(models.config_to_hf(cfg)))
    tensors = [(m.hf_name, m.hf_shape, np.float32, lambda m=m: np.zeros(m.hf_shape, np.float32))
               for m in models.hf.tensor_maps(cfg)]  # fmt: skip
    safetensors_io.write_file(path / "model.safetensors", tensors)
    return path


def _header(entries) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


# Damage to a weight file of a Hugging Face directory: name -> (file, new bytes from the old).
DAMAGED_WEIGHTS = {
    "garbage": ("model.safetensors", lambda b: bytes(range(256)) * 2),
    "four_bytes": ("model.safetensors", lambda b: b[:4]),
    "truncated_header": ("model.safetensors", lambda b: b[:40]),
    "truncated_data": ("model.safetensors", lambda b: b[: len(b) - 100]),
    "header_not_an_object": ("model.safetensors", lambda b: _header([1, 2])),
    "entry_without_offsets": ("model.safetensors",
                              lambda b: _header({"model.norm.weight": {"dtype": "F32"}})),
    "index_not_json": ("model.safetensors.index.json", lambda b: b"\xff{"),
    "index_a_list": ("model.safetensors.index.json", lambda b: b"[1]"),
    "index_map_of_numbers": ("model.safetensors.index.json", lambda b: b'{"weight_map": {"a": 3}}'),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(DAMAGED_WEIGHTS))
def test_a_damaged_weight_file_is_named_in_one_sentence(tmp_path, kind):
    hf_dir = _hf_dir(tmp_path / "hf")
    name, damage = DAMAGED_WEIGHTS[kind]
    path = hf_dir / name
    path.write_bytes(damage(path.read_bytes() if path.exists() else b""))
    for load in (models.hf.check_files, models.from_pretrained):
        with pytest.raises(models.CheckpointError) as e:
            load(hf_dir)
        sentence = str(e.value)
        assert sentence.startswith(str(path)) and "\n" not in sentence, sentence
        assert sentence.endswith(("re-download or re-export it.", "the checkpoint.")), sentence


# ---------------------------------------------------------------- the trainer, end to end

RUN_ARGS = [
    "--config=configs/arith_tiny.py", "--config.sft.steps=4", "--config.data.eval_size=8",
    "--config.train.eval_every=0", "--config.train.checkpoint_every=2",
    "--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4",
    "--config.train.plot=False", "--config.train.eval_samples=1",
    "--config.model.overrides.num_layers=1", "--config.train.steps=4",
]  # fmt: skip


def _run(workdir: Path, *extra: str, file_size_limit: int | None = None):
    """The trainer CLI on RUN_ARGS; `file_size_limit`: its writes past that many bytes fail
    (EFBIG, the error path of a full disk's ENOSPC), and it writes no compilation cache entries
    (they would fail too, with warnings on stderr; it still reads them)."""
    cmd = [sys.executable, "-m", "gvpo_jax.main", f"--workdir={workdir}", *RUN_ARGS, *extra]
    env = child_env()
    if file_size_limit is not None:  # set by a launcher that execs the CLI (no fork of pytest)
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = str(2**62)
        cmd = [sys.executable, "-c", _LIMITED.format(limit=file_size_limit), *cmd]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# An ignored SIGXFSZ and the limit both survive the exec.
_LIMITED = """import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
os.execv(sys.argv[1], sys.argv[1:])"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A run of 4 RL steps with checkpoints at steps 2 and 4 and its exported weights."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return workdir


@pytest.mark.slow
def test_trainer_resumes_from_the_last_good_step_to_the_uninterrupted_weights(straight, tmp_path):
    """Step 4 damaged: the rerun says so in one line, moves it aside, resumes from step 2 and
    ends with the weights of the uninterrupted run (resume is bit-exact). The damage is the kind
    only the checksums see (a flipped byte); every kind goes through `restore_newest` above, the
    trainer's path after it is the same, and the size check meets the trainer in the test
    after this one."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    shutil.rmtree(workdir / "export")
    _flip_byte(workdir / "checkpoints" / "4")
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


@pytest.mark.slow
def test_a_full_disk_at_the_final_save_exits_1_in_one_sentence_and_the_rerun_resumes(
    straight, tmp_path
):
    """Steps 3-4 rerun from step 2 on a "full" disk: the save of step 4 fails (so does the
    export), the run ends with one sentence and exit status 1, step 4's partial files are gone
    and step 2 is untouched; with room again the rerun ends with the uninterrupted weights."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")
    shutil.rmtree(workdir / "export")
    before = _listing(workdir / "checkpoints")
    proc = _run(workdir, file_size_limit=256 * 1024)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: checkpoint step 4 could not be written to {workdir / 'checkpoints'} (File too "
        "large); its partial files were removed and step 2 is intact: free space and rerun to "
        "resume from it."
    ], proc.stderr[-3000:]
    assert _listing(workdir / "checkpoints") == before
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {workdir / 'checkpoints'} at step 2." in proc.stdout
    a = load_file(str(straight / "export" / "model.safetensors"))
    b = load_file(str(workdir / "export" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_damaged_weight_files_and_a_checkpoints_file_exit_2_in_one_sentence(tmp_path):
    """Through the CLI, before anything is written: a GGUF file with a valid header and garbage
    after it, damaged safetensors of a Hugging Face directory, a workdir whose `checkpoints` is
    a file."""
    gguf_file = tmp_path / "garbled.gguf"
    gguf_file.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(range(7, 250)))
    truncated = _hf_dir(tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    index = _hf_dir(tmp_path / "index") / "model.safetensors.index.json"
    index.write_text('{"weight_map": ["model.safetensors"]}')
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "checkpoints").write_text("not a directory")
    cases = [  # (workdir, override, the start of the sentence)
        (tmp_path / "w0", f"--config.model.gguf={gguf_file}",
         f"error: {gguf_file} is not a valid GGUF file (IndexError: "),
        (tmp_path / "w1", f"--config.model.hf_dir={truncated}",
         f"error: {weights} is not a valid safetensors file (tensor "),
        (tmp_path / "w2", f"--config.model.hf_dir={index.parent}",
         f"error: {index}: 'weight_map' must map tensor names to shard file names;"),
        (taken, "--config.train.steps=4",
         f"error: {taken / 'checkpoints'} is a file where the checkpoint directory "),
    ]  # fmt: skip
    before = _listing(tmp_path)
    procs = [  # in parallel: each spends its ~2 s importing
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gvpo_jax.main",
                "--config=configs/arith_tiny.py",
                f"--workdir={workdir}",
                override,
            ],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for workdir, override, _ in cases
    ]
    for proc, (_, override, start) in zip(procs, cases, strict=True):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (override, err[-3000:])
        assert err.startswith(start) and err.count("\n") == 1, (override, err[-3000:])
        assert err[len("error: ") :].count(". ") == 0, err
    assert _listing(tmp_path) == before, "nothing may be written"
    assert not [w for w, _, _ in cases[:3] if w.exists()], "not even the workdir"
