"""Atomic, async Orbax checkpoints of the train state, data position, replay buffer and config,
with a manifest per step (every file's size and CRC-32) and a restore that falls back past
damaged steps (`restore_newest`)."""

from __future__ import annotations

import errno
import gc
import inspect
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from gvpo_jax.errors import BadInputError, FaultError

CHECKPOINT_SUBDIR = "checkpoints"  # checkpoints of a run live in <workdir>/checkpoints/<step>/


class CheckpointError(BadInputError):
    """A checkpoint cannot be written or read; the message names the path and the fix."""


class CheckpointWriteError(FaultError):
    """The system refused to write a checkpoint (a full disk, a quota, a file size limit). The
    half-written step is removed and the steps before it are intact: a rerun resumes from the
    newest of them once the cause is fixed."""


def checkpoint_dir(workdir: str | os.PathLike) -> Path:
    """Directory that holds the step directories of the run in `workdir`."""
    return Path(workdir) / CHECKPOINT_SUBDIR


def check_directory(directory: str | os.PathLike) -> None:
    """CheckpointError unless `directory` is a directory or absent (Orbax would otherwise fail
    on it in a background thread, with pages of tracebacks, once the run has started)."""
    directory = Path(directory).absolute()
    for path in (directory, *directory.parents):
        if path.exists():
            if not path.is_dir():
                raise CheckpointError(
                    f"{path} is a file where the checkpoint directory {directory} should be; "
                    "move the file away or choose another --workdir."
                )
            return


# ---------------------------------------------------------------- JSON-able metadata


def _encode_json(obj: Any, where: str = "meta") -> Any:
    """Maps numpy scalars to Python; rejects what JSON cannot hold early (bytes included).

    Validating here matters: an object Orbax fails to serialise in its background thread
    leaves a half-written step that blocks later saves of the same step.
    """
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where} has the non-string key {k!r}; use string keys.")
            out[k] = _encode_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, list | tuple):
        return [_encode_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.generic | np.ndarray) and np.ndim(obj) == 0:
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise CheckpointError(
        f"{where} is a {type(obj).__name__}, which JSON cannot hold; convert it to "
        "str/int/float/bool/list/dict before saving."
    )


# ---------------------------------------------------------------- state / replay checks


def _dtype_of(x: Any) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


@jax.jit
def _leaf_is_finite(leaves: list) -> jax.Array:
    """bool[len(leaves)]: whether every element of each leaf is finite (one device round trip)."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaves(state: Any) -> list[str]:
    """Key paths (jax.tree_util.keystr) of floating leaves of `state` holding NaN or +-inf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    floats = [(p, x) for p, x in flat if _is_float(_dtype_of(x))]
    if not floats:
        return []
    ok = np.asarray(jax.device_get(_leaf_is_finite([x for _, x in floats])))
    return [jax.tree_util.keystr(p) for (p, _), good in zip(floats, ok, strict=True) if not good]


def _check_replay(replay: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """Host copies of the replay arrays; numeric or bool dtypes only (tensorstore's types)."""
    out = {}
    for k, v in (replay or {}).items():
        if not isinstance(k, str):
            raise CheckpointError(f"replay has the non-string key {k!r}; use string keys.")
        arr = np.asarray(v)
        if not (
            arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.number) or _is_float(arr.dtype)
        ):
            raise CheckpointError(
                f"replay[{k!r}] has dtype {arr.dtype}; store token ids or numbers, not objects "
                "or strings."
            )
        out[k] = arr
    return out


def _expected_stored_shape(sds: Any) -> tuple[int, ...]:
    """Shape Orbax stores for a leaf: typed PRNG keys are stored as their uint32 key data."""
    if jax.dtypes.issubdtype(sds.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, sds).shape
    return tuple(sds.shape)


# A leaf of a restore target that is not read (Orbax's placeholder): a run that never updates
# restores the parameters of a training checkpoint without its optimizer state (`skipped`).
SKIP = ocp.PLACEHOLDER


def skipped(tree: Any) -> Any:
    """`tree` with every leaf replaced by SKIP: that part of a checkpoint is left on disk."""
    return jax.tree.map(lambda _: SKIP, tree)


def _as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) or x is SKIP:
        return x
    return jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x), sharding=getattr(x, "sharding", None))


def _partial_restore(abstract: Any) -> ocp.args.PyTreeRestore:
    """Restore args that read every leaf of `abstract` onto its sharding, except SKIP leaves."""
    restore_args = jax.tree.map(
        lambda x: (
            x
            if x is SKIP
            else ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)
        ),
        abstract,
    )
    return ocp.args.PyTreeRestore(abstract, restore_args=restore_args)


# ---------------------------------------------------------------- integrity: the manifest

# Written into each step directory after Orbax commits it: {"hash": "crc32", "files": {relative
# path: {"size": bytes, "crc32": hex}}}. Orbax's atomic rename protects a step against a crash
# while it is written, not against damage afterwards (a truncated copy, a full disk, a flipped
# byte); the manifest lets a restore notice that before it trains on.
MANIFEST = "manifest.gvpo.json"
_CHUNK = 1 << 24


def file_crc32(path: Path) -> str:
    """CRC-32 (zlib, stdlib) of a file's bytes as 8 hex digits: 0.25-0.28 s per GB read from
    the page cache on one core of the benchmark machine (0.16 s of it the hash itself)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(step_dir: Path) -> None:
    """Records every file of a committed step directory (size and CRC-32), atomically."""
    files = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            rel = path.relative_to(step_dir).as_posix()
            files[rel] = {"size": path.stat().st_size, "crc32": file_crc32(path)}
    tmp = step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"hash": "crc32", "files": files}))
    os.replace(tmp, step_dir / MANIFEST)


def check_manifest(
    step_dir: Path, *, checksums: bool, part: tuple[int, int] = (0, 1)
) -> str | None:
    """How `step_dir` differs from its manifest, as a phrase naming the file, or None. Sizes are
    always compared, CRC-32s when `checksums` (of the files i with i % part[1] == part[0]: the
    processes of a run share the reading). A step without a manifest (written by an older
    version, or by a process killed before it wrote one) has nothing to compare: None."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest {path} cannot be read ({type(e).__name__})"
    for rel, want in files.items():
        f = step_dir / rel
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} has {size} bytes where {want['size']} were written"
    if checksums:
        for i, (rel, want) in enumerate(files.items()):
            if i % part[1] != part[0]:
                continue
            got = file_crc32(step_dir / rel)
            if got != want["crc32"]:
                return f"{step_dir / rel} has CRC-32 {got} where {want['crc32']} was written"
    return None


# ---------------------------------------------------------------- the checkpointer


def _manager(
    directory: Path, options: ocp.CheckpointManagerOptions, *, partial: bool = False
) -> ocp.CheckpointManager:
    """A manager that knows every item's handler, so a fresh process can read metadata.

    partial: read "state" with the PyTree handler (the format StandardCheckpointHandler writes),
    whose restore takes placeholders (SKIP) for leaves to leave on disk."""
    registry = ocp.handlers.create_default_handler_registry(
        state=ocp.PyTreeCheckpointHandler() if partial else ocp.StandardCheckpointHandler(),
        meta=ocp.JsonCheckpointHandler(),
        replay_spec=ocp.JsonCheckpointHandler(),
        replay=ocp.StandardCheckpointHandler(),
    )
    return ocp.CheckpointManager(directory, options=options, handler_registry=registry)


class Checkpointer:
    """Saves every `save_every` steps, keeps the newest `keep`, writes atomically and async.

    One step directory `<directory>/<step>/` holds the Orbax items
      state        the train-state pytree (StandardSave; sharded arrays, typed PRNG keys ok),
      meta         a JSON dict (config, loop state: step, data position, shuffle stream, ...),
      replay_spec  JSON {name: {shape, dtype}} of the replay arrays (zero-size ones included),
      replay       the non-empty replay arrays (StandardSave of numpy arrays), if any.
    Orbax writes into `<step>.orbax-checkpoint-tmp*` and renames on commit, so a killed
    process never leaves a directory that `latest_step()` lists; such leftovers are removed
    when the next Checkpointer opens the directory. With `async_save`, `save` returns once
    the arrays are copied to host (so donating the state to the next step is safe) and the
    write finishes in a background thread; call `wait()` before exiting or reading back.
    A write the system refuses (a full disk) is CheckpointWriteError at the next `save`, `wait`
    or `close`, the failed step's partial files removed; the Checkpointer then saves no more.
    Replay arrays are numpy (host) data: in a multi-process run only process 0's copy is
    written, so they must be identical on every process.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int,
        keep: int,
        async_save: bool = True,
        verify: bool = True,
    ):
        if save_every < 1:
            raise CheckpointError(f"save_every={save_every} must be >= 1 (steps between saves).")
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be >= 1 (checkpoints to retain).")
        self.directory = Path(directory).absolute()
        check_directory(self.directory)
        options = ocp.CheckpointManagerOptions(
            # Any host receiving a JAX preemption notice makes all hosts save at a common step.
            save_decision_policy=ocm.AnySavePolicy(
                [ocm.FixedIntervalPolicy(save_every), ocm.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=ocm.LatestN(keep),
            enable_async_checkpointing=async_save,
            # A crash mid-save leaves `<step>.orbax-checkpoint-tmp`; re-saving that step after
            # resume would collide with it, so clear leftovers on start.
            cleanup_tmp_directories=True,
        )
        self._manager = _manager(self.directory, options)
        self.verify = verify  # compare CRC-32s at restore (sizes are always compared)
        self._unsigned: list[int] = []  # steps saved here whose manifest is not written yet
        self._signer: threading.Thread | None = None
        self._sign_error: tuple[int, OSError] | None = None  # set by the manifest thread
        self._failure: CheckpointWriteError | None = None  # a save failed: no more saves
        self._quiet = _QuietFailedSave()

    # -- queries
    def should_save(self, step: int) -> bool:
        """True at multiples of save_every (and on a JAX preemption notice) not yet saved."""
        return self._manager.should_save(step)

    def latest_step(self) -> int | None:
        """Newest committed step (an in-flight async save counts), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    # -- save
    def save(
        self,
        step: int,
        state: Any,
        *,
        meta: Mapping[str, Any],
        replay: Mapping[str, np.ndarray] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves if `should_save(step)` or `force`; returns whether a save was started.

        A step that is already saved is never rewritten (returns False), so a final forced
        save at a step that was just saved on schedule is harmless. Raises CheckpointError,
        before anything is written, if a floating leaf of `state` is NaN/inf, if `meta` is
        not JSON-able, or if a replay array has a non-numeric dtype.
        """
        step = int(step)
        if step in self._manager.all_steps():
            return False
        if not force and not self.should_save(step):
            return False
        leaves = jax.tree_util.tree_leaves(state)
        if not leaves or any(np.size(x) == 0 for x in leaves):
            raise CheckpointError(
                f"state for step {step} is empty or has a zero-size leaf; Orbax cannot save it "
                f"to {self.directory}, so drop empty leaves from the train state."
            )
        bad = nonfinite_leaves(state)
        if bad:
            raise CheckpointError(
                f"refusing to save step {step} to {self.directory}: non-finite values in "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; the previous checkpoint "
                "is kept, resume from it (lower the learning rate or skip the bad batch)."
            )
        meta_json = _encode_json(dict(meta))
        replay_np = _check_replay(replay)
        spec = {k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in replay_np.items()}
        items = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave(meta_json),
            "replay_spec": ocp.args.JsonSave(spec),
        }
        nonempty = {k: v for k, v in replay_np.items() if v.size > 0}
        if nonempty:  # Orbax refuses empty items and zero-size arrays; replay_spec rebuilds them
            items["replay"] = ocp.args.StandardSave(nonempty)
        # The previous save has committed once Orbax starts this one: its manifest is written
        # in the background while this step is written (no pause of the training loop).
        self._settle()
        self._sign(background=True)
        self._quiet.open()
        try:
            started = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # what Orbax writes before it returns (directories, metadata)
            self._fail(step, e)
        if started:
            self._unsigned.append(step)
        return started

    def _settle(self) -> None:
        """Waits for the save in flight; a failed one becomes CheckpointWriteError (its half-written
        step removed). Raises the failure again once one happened: Orbax's manager keeps
        re-raising it, so this Checkpointer saves nothing more."""
        if self._failure is not None:
            raise self._failure
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._fail(self._unsigned[-1] if self._unsigned else None, e)
        self._quiet.close()

    def _fail(self, step: int | None, error: BaseException) -> NoReturn:
        """Removes what step `step` wrote and raises CheckpointWriteError naming the cause and the
        newest step that is intact. The quiet window stays open until `close`: writes abandoned
        with the failed one may still report."""
        self._unsigned = [s for s in self._unsigned if s != step]
        if step is not None and jax.process_index() == 0:
            for partial in self.directory.glob(f"{int(step)}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        intact = _steps(self.directory)
        cause, fix = _write_cause(error)
        after = (
            f"step {intact[-1]} is intact: {fix} and rerun to resume from it"
            if intact
            else f"no earlier step was saved: {fix} and rerun"
        )
        self._failure = CheckpointWriteError(
            f"checkpoint step {step} could not be written to {self.directory} ({cause}); its "
            f"partial files were removed and {after}."
        )
        raise self._failure from error

    def _sign(self, *, background: bool) -> None:
        """Writes the manifests of the committed steps this object saved (process 0)."""
        if self._signer is not None:
            self._signer.join()
            self._signer = None
        if self._sign_error is not None:
            (step, error), self._sign_error = self._sign_error, None
            cause, fix = _write_cause(error)
            self._failure = CheckpointWriteError(
                f"the manifest of checkpoint step {step} in {self.directory} could not be written "
                f"({cause}); the step itself is complete and a rerun resumes from it unverified: "
                f"{fix} and rerun."
            )
            raise self._failure from error
        steps, self._unsigned = self._unsigned, []
        if not steps or jax.process_index() != 0:
            return

        def sign():
            for step in steps:
                try:
                    write_manifest(self.directory / str(step))
                except FileNotFoundError:  # removed meanwhile (keep=1): nothing to record
                    pass
                except OSError as e:  # e.g. a full disk: the step is committed, its manifest not
                    (self.directory / str(step) / f".{MANIFEST}.tmp").unlink(missing_ok=True)
                    self._sign_error = (step, e)

        if background:
            self._signer = threading.Thread(target=sign, name="checkpoint-manifest", daemon=True)
            self._signer.start()
        else:
            sign()

    # -- restore
    def restore(
        self,
        abstract_state: Any,
        *,
        step: int | None = None,
        directory: str | os.PathLike | None = None,
    ) -> tuple[Any, dict, dict[str, np.ndarray]]:
        """Returns (state, meta, replay) of `step` (default: latest) onto the target shardings.

        abstract_state: pytree of jax.ShapeDtypeStruct with `.sharding` (or of arrays, whose
          shape/dtype/sharding are used); the checkpoint is resharded onto these shardings,
          so it may have been written from a different mesh. Leaves that are SKIP are not
          read (they come back as SKIP).
        directory: read another run's checkpoints (e.g. `resolve_restore`'s answer) instead
          of this Checkpointer's own directory; saving still goes to the own directory.
        """
        self.wait()
        abstract = jax.tree.map(_as_abstract, abstract_state)
        partial = any(x is SKIP for x in jax.tree.leaves(abstract))
        own = not partial and (directory is None or Path(directory).absolute() == self.directory)
        where = Path(directory).absolute() if directory is not None else self.directory
        manager = (
            self._manager
            if own
            else _manager(where, ocp.CheckpointManagerOptions(read_only=True), partial=partial)
        )
        try:
            steps = manager.all_steps()
            step = manager.latest_step() if step is None else int(step)
            if step is None or step not in steps:
                raise CheckpointError(
                    f"no checkpoint for step {step} in {where} (found steps {sorted(steps)}); "
                    "pass one of those steps or another directory."
                )
            stored = manager.item_metadata(step)
            self._check_shapes(abstract, stored["state"].tree, where / str(step))
            items = {
                "state": _partial_restore(abstract)
                if partial
                else ocp.args.StandardRestore(abstract),
                "meta": ocp.args.JsonRestore(),
                "replay_spec": ocp.args.JsonRestore(),
            }
            if stored.get("replay") is not None:
                items["replay"] = ocp.args.StandardRestore()
            try:
                out = manager.restore(step, args=ocp.args.Composite(**items))
            except ValueError as e:  # structure mismatch Orbax found and we did not name
                raise CheckpointError(
                    f"cannot restore {where / str(step)} into the given abstract state ({e}); "
                    "build the abstract state with the same model/optimizer config as the run."
                ) from e
        finally:
            if not own:
                manager.close()
        stored_replay = dict(out["replay"]) if "replay" in items else {}
        replay = {}
        for k, s in out["replay_spec"].items():
            shape, dtype = tuple(s["shape"]), np.dtype(s["dtype"])
            replay[k] = (
                np.asarray(stored_replay[k]) if k in stored_replay else np.zeros(shape, dtype)
            )
        return out["state"], out["meta"], replay

    @staticmethod
    def _check_shapes(abstract: Any, stored_tree: Any, step_dir: Path) -> None:
        """Names every leaf whose requested shape differs from the stored one."""
        stored = ocp.tree.to_flat_dict(stored_tree)
        flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
        errors = []
        for path, sds in flat:
            if sds is SKIP:
                continue
            meta = stored.get(ocp.utils.tuple_path_from_keypath(path))
            if meta is None:
                errors.append(f"{jax.tree_util.keystr(path)} is not in the checkpoint")
                continue
            want = _expected_stored_shape(sds)
            if tuple(meta.shape) != want:
                errors.append(
                    f"{jax.tree_util.keystr(path)} has shape {tuple(meta.shape)} in the "
                    f"checkpoint but {want} was requested"
                )
        if errors:
            raise CheckpointError(
                f"checkpoint {step_dir} does not match the abstract state: {'; '.join(errors[:5])}"
                f"{' ...' if len(errors) > 5 else ''}; restore with the config that wrote it."
            )

    # -- integrity
    def check(self, step: int, directory: str | os.PathLike | None = None) -> str | None:
        """How step `step` (of `directory`, default the own) differs from its manifest, or None.
        In a multi-process run each process checks every size and its share of the CRC-32s."""
        where = self.directory if directory is None else Path(directory).absolute()
        part = (jax.process_index(), jax.process_count())
        return check_manifest(where / str(int(step)), checksums=self.verify, part=part)

    def move_aside(self, step: int, directory: str | os.PathLike | None = None) -> Path:
        """Renames a damaged step directory to `damaged-<step>` (a name Orbax does not list), so
        the next save of that step cannot collide with it and a person can inspect it. Process 0
        renames; every process then sees the new listing. Returns the new path."""
        where = self.directory if directory is None else Path(directory).absolute()
        aside = where / f"damaged-{int(step)}"
        n = 1
        while aside.exists():  # every process sees the same listing here (no rename yet)
            n += 1
            aside = where / f"damaged-{int(step)}.{n}"
        _sync(f"gvpo_checkpoint_move_{int(step)}")
        if jax.process_index() == 0:
            os.rename(where / str(int(step)), aside)
        _sync(f"gvpo_checkpoint_moved_{int(step)}")
        if where == self.directory:
            self._manager.reload()
        return aside

    # -- lifecycle
    def wait(self) -> None:
        """Blocks until any async save has committed and its manifest is written; raises
        CheckpointWriteError if a save of this Checkpointer failed."""
        self._settle()
        self._sign(background=False)

    def close(self) -> None:
        """Waits for the save in flight (CheckpointWriteError if it failed, unless that was
        raised already) and releases Orbax's threads."""
        try:
            if self._failure is None:
                self.wait()
        finally:
            try:
                self._manager.close()
            except Exception:
                if self._failure is None:
                    raise
                # Orbax re-raises the failed save on every wait; it was reported once already.
            self._quiet.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _steps(directory: Path) -> list[int]:
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


def resolve_restore(
    explicit_path: str | os.PathLike | None, workdir: str | os.PathLike
) -> tuple[Path, int] | None:
    """Where to resume from: explicit path > latest in `<workdir>/checkpoints` > None (init).

    `explicit_path` may be a step directory (`.../checkpoints/1200`), a directory of step
    directories or a run's workdir (their latest committed step is used). Returns (directory
    of step dirs, step), ready for `Checkpointer.restore(..., step=step, directory=directory)`.
    """
    if explicit_path:
        path = Path(explicit_path).absolute()
        if not path.exists():
            raise CheckpointError(
                f"restore path {path} does not exist; fix the path or drop it to resume from "
                "the latest checkpoint in the workdir."
            )
        if path.name.isdigit() and int(path.name) in _steps(path.parent):
            return path.parent, int(path.name)
        for directory in (path, checkpoint_dir(path)):  # ... or another run's workdir
            steps = _steps(directory)
            if steps:
                return directory.absolute(), steps[-1]
        raise CheckpointError(
            f"restore path {path} is not a committed Orbax checkpoint (neither a step directory, "
            "a directory of step directories nor a workdir with checkpoints); point it at e.g. "
            "<workdir>/checkpoints/<step>."
        )
    steps = _steps(checkpoint_dir(workdir))
    return (checkpoint_dir(workdir).absolute(), steps[-1]) if steps else None


def _phrase(error: BaseException) -> str:
    """An exception as a short phrase for a one-line message: the type and first line of its
    root cause (Orbax wraps tensorstore's error, which names the file, in a bare Exception)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > 240:
        text = text[:237] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# Write errors whose fix is room on the disk (or in the quota, or under the file size limit).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_cause(error: BaseException) -> tuple[str, str]:
    """(why a write failed, what to do): the system's reason ("No space left on device") from
    the OSError in the exception's chain or the errno in tensorstore's message, else the root
    cause as a phrase."""
    seen = error
    while seen is not None:
        code = seen.errno if isinstance(seen, OSError) else None
        found = None if code else re.search(r"os_error_code='?(\d+)", str(seen))
        code = int(found.group(1)) if found else code
        if code:
            return os.strerror(code), "free space" if code in _NO_ROOM else "fix that"
        seen = seen.__cause__ or seen.__context__
    return _phrase(error), "fix that"


class _QuietFailedSave:
    """Keeps a failing async save from printing pages of tracebacks while it is in flight.

    Orbax logs the failure from each of its threads (and again when it is waited for), asyncio
    the write tasks abandoned with it, and tensorstore's writes still in flight report to the
    event loop Orbax has closed ("Event loop is closed", as unraisable exceptions). None of it
    is lost: `wait_until_finished` re-raises the failure and `Checkpointer` turns it into one
    sentence. Only those reports are dropped, only while a Checkpointer holds the window open
    (from a save until it is waited for, or after a failure until `close`); the windows of
    several Checkpointers share one set of hooks."""

    _holders = 0
    _previous_hook = _hook = None
    _filter: logging.Filter | None = None

    def __init__(self):
        self._held = False

    def open(self) -> None:
        """Holds the window open (once per instance); the first holder installs the hooks."""
        if self._held:
            return
        self._held = True
        cls = _QuietFailedSave
        cls._holders += 1
        if cls._holders > 1:
            return
        cls._previous_hook = sys.unraisablehook
        orbax_dir = os.path.dirname(ocp.__file__)

        def hook(unraisable):
            closed = isinstance(unraisable.exc_value, RuntimeError) and (
                str(unraisable.exc_value) == "Event loop is closed"
            )
            if not (closed or inspect.iscoroutine(unraisable.object)):
                cls._previous_hook(unraisable)

        class DropOrbaxErrors(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                """False for an error Orbax (or asyncio about Orbax's tasks) logs."""
                return record.levelno < logging.ERROR or not (
                    record.pathname.startswith(orbax_dir) or orbax_dir in record.getMessage()
                )

        sys.unraisablehook = cls._hook = hook
        cls._filter = DropOrbaxErrors()
        for name in ("absl", "asyncio"):  # Orbax logs through absl; asyncio its own logger
            logging.getLogger(name).addFilter(cls._filter)

    def close(self) -> None:
        """Lets go of the window; the last holder restores the previous hooks."""
        if not self._held:
            return
        self._held = False
        cls = _QuietFailedSave
        cls._holders -= 1
        if cls._holders > 0:
            return
        if sys.unraisablehook is cls._hook:  # else someone replaced it since: leave theirs
            sys.unraisablehook = cls._previous_hook
        for name in ("absl", "asyncio"):
            logging.getLogger(name).removeFilter(cls._filter)
        cls._previous_hook = cls._hook = cls._filter = None


def _sync(name: str) -> None:
    """A barrier of every process (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _all_processes(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective in multi-process runs)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


# What a damaged step raises while it is read: anything. Orbax wraps tensorstore's errors for
# truncated or missing data (ValueError: OUT_OF_RANGE ...) in a bare Exception; a torn JSON file
# is json's ValueError, a missing item OSError or KeyError. A step that cannot be read for
# another reason (e.g. the run's config changed its shapes) fails the same way on every step, so
# nothing is moved aside then: "no checkpoint can be restored".
READ_ERRORS = (Exception,)


class _QuietLeftovers:
    """Keeps a failed Orbax read from printing pages of tracebacks: the other array reads,
    abandoned with the failed one, raise again when they are garbage collected ("Exception
    ignored in <coroutine ...>", asyncio's "Task exception was never retrieved"). They are
    collected on exit, inside the window, where those reports go nowhere. (What tensorstore
    finishes after the process decided to exit is skipped by `main.bad_input`'s exit.)"""

    def __enter__(self):
        self._previous = sys.unraisablehook
        self._asyncio = logging.getLogger("asyncio")
        self._level = self._asyncio.level

        def hook(unraisable):
            if not inspect.iscoroutine(unraisable.object):
                self._previous(unraisable)

        sys.unraisablehook = hook
        self._asyncio.setLevel(logging.CRITICAL + 1)
        return self

    def __exit__(self, *exc):
        gc.collect()
        sys.unraisablehook = self._previous
        self._asyncio.setLevel(self._level)


def restore_newest(ckpt: Checkpointer, explicit_path, workdir, attempt, *, log=print):
    """Resume point with fallback: `attempt(directory, step)` on the newest restorable step.

    The step comes from `resolve_restore` (explicit path > latest in `<workdir>/checkpoints`).
    A step is damaged when it differs from its manifest (`Checkpointer.check`) or `attempt`
    raises one of READ_ERRORS. Without an explicit path the next newest step is tried; the
    damaged ones are then moved aside (`Checkpointer.move_aside`) with one line each naming the
    step, why and the step the run resumes from. With an explicit path there is no silent
    fallback: CheckpointError. If no step can be restored: CheckpointError, nothing moved or
    deleted. Every process takes the same decision: each checks the manifest (sizes, and its
    share of the CRC-32s) and the verdicts are all-gathered before anything is read. Returns
    (attempt's result, directory, step), or None when there is nothing to resume from.
    """
    found = resolve_restore(explicit_path, workdir)
    if found is None:
        return None
    directory, newest = found
    candidates = [newest] if explicit_path else sorted(_steps(directory), reverse=True)
    damaged: list[tuple[int, str]] = []
    for step in candidates:
        problem = ckpt.check(step, directory)
        if not _all_processes(problem is None):  # the decision is taken together, before reading
            problem = problem or "another process found it differs from its manifest"
        else:
            result = None
            try:
                with _QuietLeftovers():
                    result = attempt(directory, step)
            except READ_ERRORS as e:
                problem = _phrase(e)
                if jax.process_count() > 1:
                    # A read error only this process saw cannot be agreed on: Orbax's restore
                    # ends at a barrier the other processes wait at. The manifest check above is
                    # the multi-process fallback; this stops the run instead of diverging.
                    raise CheckpointError(
                        f"process {jax.process_index()} cannot read {directory / str(step)} "
                        f"({problem}) though its manifest, if it has one, matches; repair or "
                        "remove that step."
                    ) from e
        if problem is None:
            break
        if explicit_path:
            raise CheckpointError(
                f"restore_from {directory / str(step)} cannot be restored ({problem}); "
                "repair it or point restore_from at another checkpoint."
            )
        damaged.append((step, problem))
    else:
        listing = "; ".join(f"step {s}: {p}" for s, p in damaged)
        raise CheckpointError(
            f"no checkpoint in {directory} can be restored ({listing}); nothing was moved or "
            "deleted: repair or remove those steps, or set restore_from to a good checkpoint."
        )
    for bad, problem in damaged:
        aside = ckpt.move_aside(bad, directory)
        if jax.process_index() == 0:
            log(
                f"Checkpoint step {bad} is damaged ({problem}); moved it to {aside} and "
                f"resuming from step {step}."
            )
    return result, directory, step


class PreemptionGuard:
    """Turns SIGTERM/SIGINT into a request to checkpoint at the next step boundary.

    TPU VMs and SLURM send SIGTERM before preemption. The first signal only sets
    `.requested`; the train loop checks `should_stop()` after each step, saves with
    `force=True`, waits for the save and exits 0. A second signal exits at once with
    `os._exit(1)`: this cannot corrupt anything because Orbax commits a step by renaming a
    finished temporary directory, so the newest committed checkpoint stays intact.
    Previous handlers are restored on exit. Must be entered from the main thread.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.requested:
            os.write(2, f"PreemptionGuard: second signal {signum}, exiting now.\n".encode())
            os._exit(1)
        self.requested, self.signum = True, signum
        # os.write, not logging: a handler may interrupt code that holds logging's locks.
        os.write(2, f"PreemptionGuard: signal {signum}, saving at the next step.\n".encode())

    def should_stop(self) -> bool:
        """Whether any process got a signal (a collective in multi-process runs: call on all)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.requested))
        return bool(np.any(flags))

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be entered from the main thread.")
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
