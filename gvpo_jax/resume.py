"""Resume: a run's checkpoint written (`save`) and read back (`restore`), with the frozen
reference and the LoRA layout checks.

Resume order: `config.restore_from` > the latest checkpoint in the workdir > a fresh start. A
checkpoint holds the train state, the frozen reference (when the run keeps one) and the loop
state (`rl_step.LoopState`: step, data position, shuffle stream, replay buffer, queued rollouts),
so a resumed run continues bit for bit. A LoRA run's checkpoint holds the adapters and their
optimizer state, not the frozen base: the run reloads that from its source and checks it against
the checkpoint's fingerprint of it (`models.lora.fingerprint`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from gvpo_jax import assemble, checkpoint, sharding, train_step
from gvpo_jax.models import lora
from gvpo_jax.rl_step import LoopState


@struct.dataclass
class StepNamedState:
    """A train state as checkpoints written before `TrainState.updates` hold it: the count of
    optimizer updates was named `step`, which is the RL step's name now. `restore` reads such a
    checkpoint into this layout and converts it (`current`)."""

    step: Any
    params: Any
    opt_state: Any
    rng: Any
    bad_steps: Any

    @classmethod
    def of(cls, state: train_step.TrainState) -> StepNamedState:
        return cls(
            step=state.updates,
            params=state.params,
            opt_state=state.opt_state,
            rng=state.rng,
            bad_steps=state.bad_steps,
        )

    def current(self) -> train_step.TrainState:
        return train_step.TrainState(
            updates=self.step,
            params=self.params,
            opt_state=self.opt_state,
            rng=self.rng,
            bad_steps=self.bad_steps,
        )


def reference_copy(run_: assemble.Run, params):
    """The frozen reference / anchor "ref": a copy of the policy in the compute dtype.

    It is never updated and only enters forward passes, which cast every weight to the compute
    dtype anyway: storing it cast gives bit-identical log-probs at half the memory in bf16.
    """
    dtype = jnp.dtype(run_.config.model.compute_dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else jnp.copy(x), params)


def restore(run_: assemble.Run, state, loop: LoopState):
    """Resume order: config.restore_from > latest in workdir > nothing; `loop` is set to the
    checkpoint's (untouched when there is none). A damaged newest step in the workdir is moved
    aside and the next newest restorable one is used; a damaged explicit restore_from is an
    error (`checkpoint.restore_newest`).

    Returns (state, ref, resumed); ref is the frozen reference (None when the run keeps none,
    or has not made it yet).
    """
    # A checkpoint may or may not hold a reference copy (an SFT start has none, a GRPO run has
    # one); the run may or may not need one. Try the run's own layout first, then the other.
    # A run that never updates reads the parameters alone: moments and reference stay on disk.
    ref_layout = jax.eval_shape(lambda p: reference_copy(run_, p), state.params)
    if not assemble.trains(run_.config):
        state = state.replace(opt_state=checkpoint.skipped(state.opt_state))
        ref_layout = checkpoint.skipped(ref_layout)
    layouts = [ref_layout, None] if run_.reference.kind == "copy" else [None, ref_layout]

    def attempt(directory, step):
        first_error = None
        # The checkpoint's layers layout (read off its names): the other layout's is read as
        # it was written and converted after (`relayout`).
        other = held_layout(directory, step) not in (None, scanned)
        # the run's own layout first; then a checkpoint written before `TrainState.updates`
        for form in (lambda s: s, StepNamedState.of):
            for ref_layout in layouts:
                try:
                    target = abstract_target(run_, state, ref_layout, form)
                    if other:
                        target = relayout(target, stacked=not scanned, layers=num_layers)
                    return run_.ckpt.restore(target, step=step, directory=directory)
                except checkpoint.CheckpointError as e:
                    first_error = first_error or e
        raise first_error

    model_cfg = run_.model(state.params).config
    scanned, num_layers = model_cfg.scan_layers, model_cfg.num_layers
    newest = checkpoint.resolve_restore(run_.config.restore_from or None, run_.workdir)
    if newest is not None:
        check_lora_layout(run_, *newest)
    found = checkpoint.restore_newest(
        run_.ckpt,
        run_.config.restore_from or None,
        run_.workdir,
        attempt,
        log=lambda line: print(line, flush=True),
    )
    if found is None:
        return state, None, False
    (restored, meta, replay), directory, step = found
    if held_layout(directory, step) not in (None, scanned):  # to the run's layout, in its shards
        restored = relayout(restored, stacked=scanned, layers=num_layers)
        own = abstract_target(run_, state, ref_layout if restored["ref"] is not None else None)
        restored = {k: _placed(v, own[k]) for k, v in restored.items()}
        if sharding.is_primary():
            held = "one block per layer" if scanned else "stacked blocks"
            print(f"Converted the checkpoint's {held} to this run's layout.", flush=True)
    if isinstance(restored["state"], StepNamedState):
        restored = {**restored, "state": restored["state"].current()}
    if run_.lora is not None:  # the checkpoint's adapters on the base this run loaded
        check_base(run_, state.params, meta, directory)
        base = lora.split_trainable(state.params)[1]
        adapted = lora.join(restored["state"].params, base)
        restored = {**restored, "state": restored["state"].replace(params=adapted)}
    ref = None
    if run_.reference.kind == "copy":  # start of RL from a checkpoint without reference: freeze now
        ref = (
            restored["ref"]
            if restored["ref"] is not None
            else reference_copy(run_, restored["state"].params)
        )
    loop.load_state_dict(meta, replay)
    # The queued rollouts to this run's rollout.staleness (their prompts served again if dropped).
    note = loop.fit_queue(run_.settings.staleness) if assemble.trains(run_.config) else None
    if sharding.is_primary():
        print(f"Resumed from {directory} at step {step}.", flush=True)
        if note:
            print(note, flush=True)
    return restored["state"], ref, True


def save(run_: assemble.Run, state, loop: LoopState, ref) -> None:
    """Checkpoint `state`, `ref` and `loop` as step `loop.step`."""
    meta = loop.state_dict() | {"config": json.loads(run_.config.to_json_best_effort())}
    if run_.lora is not None:
        meta["lora_base"] = lora.fingerprint(state.params)
    stored = {"state": stored_state(run_, state), "ref": ref}
    run_.ckpt.save(loop.step, stored, meta=meta, replay=loop.arrays(), force=True)


def stored_state(run_: assemble.Run, state):
    """What a checkpoint holds of a train state (or of its shardings): all of it, or with LoRA
    all but the frozen base."""
    if run_.lora is None:
        return state
    return state.replace(params=lora.split_trainable(state.params)[0])


def abstract_target(run_: assemble.Run, state, ref, form=lambda s: s):
    """Restore target: shapes, dtypes and the run's shardings; `form` lays a train state out as
    the checkpoint holds it (`StepNamedState.of` for one written before the rename)."""
    shard = run_.state_shardings
    state, shard = form(state), form(shard)

    def keep(x, s):
        return x if x is checkpoint.SKIP else jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)

    return {
        "state": jax.tree.map(keep, stored_state(run_, state), stored_state(run_, shard)),
        "ref": None if ref is None else jax.tree.map(keep, ref, shard.params),
    }


def check_lora_layout(run_: assemble.Run, directory, step: int) -> None:
    """A LoRA checkpoint needs a LoRA run and the other way round (CheckpointError, raised before
    any read, so a mismatch is not taken for damage). The checkpoint's meta says which it is
    (`lora_base`)."""
    try:
        meta = json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return  # unreadable: the restore itself reports it
    if ("lora_base" in meta) == (run_.lora is not None):
        return
    if run_.lora is None:
        raise checkpoint.CheckpointError(
            f"the checkpoint {Path(directory) / str(step)} holds LoRA adapters; set "
            "--config.lora.enabled=True with its lora settings to resume or evaluate it."
        )
    raise checkpoint.CheckpointError(
        f"the checkpoint {Path(directory) / str(step)} holds a fully trained model, not LoRA "
        "adapters; set --config.lora.enabled=False to resume or evaluate it."
    )


def held_layout(directory, step: int) -> bool | None:
    """Whether a checkpoint's blocks are stacked [L, ...] (`model.scan_layers`: True) or one
    per layer (False), read off the names in its tree metadata; None when it holds no blocks
    or the metadata is unreadable (the restore itself reports that)."""
    path = Path(directory) / str(step) / "state" / "_METADATA"
    try:
        names = json.loads(path.read_text())["tree_metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    layered = [n for n in names if "'layers'" in n]
    if not layered:
        return None
    return not any("'layers', '0'," in n for n in layered)


def _placed(values, target):
    """`values` (arrays) in the structure and shardings of `target` (same leaves, in order)."""
    if values is None:
        return None
    leaves, want = jax.tree.leaves(values), jax.tree.leaves(target)
    if len(leaves) != len(want):
        raise checkpoint.CheckpointError(
            f"a converted checkpoint has {len(leaves)} arrays where the run has {len(want)}."
        )
    placed = [
        jax.device_put(v, t.sharding) if hasattr(t, "sharding") else v  # (skipped: as it is)
        for v, t in zip(leaves, want, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(target), placed)


def relayout(tree, *, stacked: bool, layers: int):
    """`tree` (a restore target or restored values: the train state, its moments, the
    reference) with every parameter tree's blocks in the other layout: stacked [L, ...] from one
    per layer (`stacked`), or one per layer from stacked. Abstract leaves (ShapeDtypeStruct)
    get the shapes and shardings of that layout (the layers axis is never split); arrays are
    stacked or sliced. Trees without blocks pass through."""

    def sliced(x, i):  # layer i of a stacked leaf
        if isinstance(x, jax.ShapeDtypeStruct):
            spec = tuple(x.sharding.spec)[1:]
            named = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(*spec))
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=named)
        return x[i] if hasattr(x, "shape") else x  # (a skipped leaf stays as it is)

    def stack(*xs):  # the layers' leaves as one stacked leaf
        x = xs[0]
        if isinstance(x, jax.ShapeDtypeStruct):
            spec = (None, *x.sharding.spec)
            named = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(*spec))
            return jax.ShapeDtypeStruct((layers, *x.shape), x.dtype, sharding=named)
        return jnp.stack(xs) if hasattr(x, "shape") else x

    def convert(state):
        if not isinstance(state, nnx.State) or "layers" not in state:
            return state
        blocks = state["layers"]
        if stacked:
            new = jax.tree.map(stack, *[blocks[i] for i in range(layers)])
        else:
            new = nnx.State(
                {i: jax.tree.map(lambda x, i=i: sliced(x, i), blocks) for i in range(layers)}
            )
        out = nnx.State(dict(state.items()))
        out["layers"] = new
        return out

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, nnx.State))


def check_base(run_: assemble.Run, params, meta: dict, directory) -> None:
    """A LoRA checkpoint resumes only onto the base it was trained on (CheckpointError)."""
    saved, ours = meta.get("lora_base"), lora.fingerprint(params)
    # fp32 sums: the reduction order (the mesh) may change the last digits, another base more
    if saved is None or abs(saved - ours) > 1e-5 * abs(ours) + 1e-6:
        raise checkpoint.CheckpointError(
            f"the LoRA checkpoint in {directory} was trained on another base model (fingerprint "
            f"{saved} != {ours} of this run's); point config.model at the base it was trained "
            "on (its config.json in the checkpoint names it) or use another workdir."
        )
