"""Tests for gvpo_jax.checkpoint: round trips, retention, resharding, refusals, kills, SIGTERM."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gvpo_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    PreemptionGuard,
    checkpoint_dir,
    resolve_restore,
)
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[1]
_ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _state(seed: int = 0, step: int = 3):
    """A tiny train state: params, optimizer moments, a step counter and both key kinds."""
    r = np.random.default_rng(seed)
    return {
        "params": {
            "w_DxF": jnp.asarray(r.normal(size=(4, 8)), jnp.float32),
            "b_F": jnp.asarray(r.normal(size=(8,)), jnp.bfloat16),
        },
        "opt": {"mu": [jnp.asarray(r.normal(size=(4, 8)), jnp.float32), jnp.zeros((), jnp.int32)]},
        "step": jnp.int32(step),
        "rng": jax.random.key(seed),
        "rng_raw": jax.random.PRNGKey(seed + 1),
    }


def _abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _bits(x):
    """Raw bytes + dtype + shape, so equality means bit-identical (NaN payloads and -0 too)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return a.dtype.str, a.shape, a.tobytes()


def _assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        assert _bits(x) == _bits(y)


def test_round_trip_state_meta_replay_is_bit_identical(tmp_path):
    state = _state()
    meta = {
        "config": {"algo": {"name": "gvpo", "beta": 0.1}, "mesh": [1, 8], "tag": None},
        "epoch": np.int64(2),
    }
    replay = {
        "tokens_BxT": np.arange(12, dtype=np.int32).reshape(3, 4),
        "rewards_B": np.array([0.5, np.nan, -0.0], np.float32),
        "logp_BxT": np.random.default_rng(1).normal(size=(3, 4)),  # float64 stays float64
        "done_B": np.array([True, False, True]),
        "empty_0xT": np.zeros((0, 4), np.int32),  # an empty buffer round-trips too
    }
    with Checkpointer(tmp_path, save_every=1, keep=3, async_save=True) as ckpt:
        assert ckpt.save(5, state, meta=meta, replay=replay)
        ckpt.wait()
        got_state, got_meta, got_replay = ckpt.restore(_abstract(state))
    _assert_bit_identical(state, got_state)
    assert got_meta == {**meta, "epoch": 2}
    assert set(got_replay) == set(replay)
    for k, v in replay.items():
        assert isinstance(got_replay[k], np.ndarray)
        assert _bits(got_replay[k]) == _bits(v), k


def test_no_replay_restores_empty_dict(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, save_every=1, keep=1, async_save=False) as ckpt:
        ckpt.save(1, state, meta={})
        _, meta, replay = ckpt.restore(_abstract(state))
    assert meta == {} and replay == {}


def test_keep_last_k_latest_step_and_save_every(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
        assert ckpt.latest_step() is None
        assert [ckpt.should_save(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
        saved = [s for s in range(1, 9) if ckpt.save(s, state, meta={"s": s})]
        assert saved == [2, 4, 6, 8]
        assert ckpt.latest_step() == 8
        assert not ckpt.should_save(8)  # already saved
        assert not ckpt.save(8, state, meta={}, force=True)  # never rewritten
        assert ckpt.save(9, state, meta={"s": 9}, force=True)  # final save off schedule
        ckpt.wait()
        assert ckpt.all_steps() == [8, 9]
        assert ckpt.restore(_abstract(state), step=8)[1] == {"s": 8}
    on_disk = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
    assert on_disk == [8, 9]
    with Checkpointer(tmp_path, save_every=2, keep=2) as reopened:
        assert reopened.latest_step() == 9


def test_restore_onto_different_mesh_gives_requested_shardings(tmp_path):
    assert len(jax.devices()) == 8
    mesh8 = jax.make_mesh((8,), ("data",))
    r = np.random.default_rng(0)
    w = r.normal(size=(8, 16)).astype(np.float32)
    v = r.normal(size=(16,)).astype(np.float32)
    state = {
        "w": jax.device_put(w, NamedSharding(mesh8, P("data", None))),
        "v": jax.device_put(v, NamedSharding(mesh8, P())),  # replicated
    }
    with Checkpointer(tmp_path, save_every=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        mesh24 = jax.make_mesh((2, 4), ("data", "fsdp"))
        target = {
            "w": jax.ShapeDtypeStruct(
                w.shape, w.dtype, sharding=NamedSharding(mesh24, P("fsdp", "data"))
            ),
            "v": jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh24, P("fsdp"))),
        }
        got, _, _ = ckpt.restore(target)
    for k, ref in (("w", w), ("v", v)):
        assert got[k].sharding == target[k].sharding
        np.testing.assert_array_equal(np.asarray(got[k]), ref)
    # each device holds the block its new sharding asks for
    shard = got["w"].addressable_shards[0]
    np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
    assert shard.data.shape == (2, 8)


def test_shape_mismatch_names_leaf_and_both_shapes(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, save_every=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        bad = _abstract(state)
        sd = bad["params"]["w_DxF"]
        bad["params"]["w_DxF"] = jax.ShapeDtypeStruct((4, 9), sd.dtype, sharding=sd.sharding)
        with pytest.raises(CheckpointError) as e:
            ckpt.restore(bad)
        msg = str(e.value)
        assert "['params']['w_DxF']" in msg and "(4, 8)" in msg and "(4, 9)" in msg
        assert str(tmp_path) in msg
        extra = {**_abstract(state), "value_head": jax.ShapeDtypeStruct((2,), jnp.float32)}
        with pytest.raises(CheckpointError, match=r"\['value_head'\] is not in the checkpoint"):
            ckpt.restore(extra)
        with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
            ckpt.restore(_abstract(state), step=7)


def test_resolve_restore_order_and_invalid_explicit_paths(tmp_path):
    state = _state()
    workdir, other = tmp_path / "run", tmp_path / "other_run"
    assert resolve_restore(None, workdir) is None  # nothing anywhere -> init
    with Checkpointer(checkpoint_dir(other), save_every=1, keep=5) as ckpt:
        for s in (3, 6):
            ckpt.save(s, _state(step=s), meta={"from": "other", "s": s})
    assert resolve_restore(None, workdir) is None  # another run's checkpoints don't count
    with Checkpointer(checkpoint_dir(workdir), save_every=1, keep=5) as ckpt:
        for s in (10, 20):
            ckpt.save(s, _state(step=s), meta={"from": "run", "s": s})
    wd_ckpts = checkpoint_dir(workdir).absolute()
    other_ckpts = checkpoint_dir(other).absolute()
    assert resolve_restore(None, workdir) == (wd_ckpts, 20)  # latest in workdir
    assert resolve_restore("", workdir) == (wd_ckpts, 20)
    # explicit beats the workdir: a step directory, or a directory of step directories
    assert resolve_restore(other_ckpts / "3", workdir) == (other_ckpts, 3)
    assert resolve_restore(str(other_ckpts), workdir) == (other_ckpts, 6)
    assert resolve_restore(other, workdir) == (other_ckpts, 6)  # or another run's workdir
    for bad in (tmp_path / "missing", tmp_path, other_ckpts / "4"):
        with pytest.raises(CheckpointError, match=str(bad)):
            resolve_restore(bad, workdir)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a committed Orbax checkpoint"):
        resolve_restore(tmp_path / "file.txt", workdir)
    # restoring another run's checkpoint through our own Checkpointer, which keeps saving at home
    directory, step = resolve_restore(other_ckpts / "3", workdir)
    with Checkpointer(checkpoint_dir(workdir), save_every=1, keep=5) as ckpt:
        got, meta, _ = ckpt.restore(_abstract(state), step=step, directory=directory)
        assert meta == {"from": "other", "s": 3} and int(got["step"]) == 3
        assert ckpt.all_steps() == [10, 20]
    assert ocp.utils.checkpoint_steps(other_ckpts) and sorted(
        ocp.utils.checkpoint_steps(other_ckpts)
    ) == [3, 6]


def test_nonfinite_state_refuses_to_save_and_keeps_previous(tmp_path):
    good = _state(step=2)
    with Checkpointer(tmp_path, save_every=2, keep=1) as ckpt:
        assert ckpt.save(2, good, meta={"s": 2})
        for leaf, value in ((("params", "w_DxF"), jnp.nan), (("params", "b_F"), jnp.inf)):
            bad = _state(step=4)
            bad[leaf[0]][leaf[1]] = bad[leaf[0]][leaf[1]].at[1, ...].set(value)
            with pytest.raises(CheckpointError, match=rf"\['{leaf[0]}'\]\['{leaf[1]}'\]"):
                ckpt.save(4, bad, meta={"s": 4})
        ckpt.wait()
        assert ckpt.all_steps() == [2]
        got, meta, _ = ckpt.restore(_abstract(good))
    _assert_bit_identical(good, got)
    assert meta == {"s": 2}
    assert [p.name for p in tmp_path.iterdir() if p.name != "_ROOT_METADATA"] == ["2"]


def test_invalid_meta_or_replay_is_refused_before_writing(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, save_every=1, keep=2) as ckpt:
        with pytest.raises(CheckpointError, match=r"meta\['cfg'\]\['f'\]"):
            ckpt.save(1, state, meta={"cfg": {"f": object()}})
        with pytest.raises(CheckpointError, match=r"meta\['data'\] is a bytes"):
            ckpt.save(1, state, meta={"data": b"\x00\xff"})  # JSON holds no bytes
        with pytest.raises(CheckpointError, match=r"replay\['text'\]"):
            ckpt.save(1, state, meta={}, replay={"text": np.array(["a", "b"])})
        assert ckpt.latest_step() is None
        assert ckpt.save(1, state, meta={"ok": True})  # the manager is still usable
        ckpt.wait()
        assert ckpt.all_steps() == [1]


_SAVE_LOOP = """
import sys, jax, jax.numpy as jnp
from gvpo_jax.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], save_every=1, keep=1000, async_save=True)
for step in range(1, 100000):
    w = jnp.full((512, 1024), float(step), jnp.float32)  # 2 MiB so a kill lands mid-write
    ckpt.save(step, {"w": w, "step": jnp.int32(step)}, meta={"step": step},
              replay={"r": jnp.full((64,), step, jnp.int32)})
"""


def _python(script: str, *args: str, **kw) -> subprocess.Popen:
    # one device is enough in the child and starts faster
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=REPO, **kw
    )


def test_sigkill_mid_save_lists_only_restorable_checkpoints(tmp_path):
    proc = _python(_SAVE_LOOP, str(tmp_path), stderr=subprocess.DEVNULL)
    saw_tmp = False
    deadline = time.time() + 60
    try:  # kill while a temporary (uncommitted) step directory exists, after >= 3 commits
        while time.time() < deadline and proc.poll() is None:
            names = os.listdir(tmp_path) if tmp_path.exists() else []
            if sum(n.isdigit() for n in names) >= 3 and any("tmp" in n for n in names):
                saw_tmp = True
                break
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert saw_tmp, "the save loop never exposed a temporary directory"
    names = os.listdir(tmp_path)
    listed = sorted(ocp.utils.checkpoint_steps(tmp_path))
    assert len(listed) >= 3
    assert not any(n in {str(s) for s in listed} for n in names if "tmp" in n)
    abstract = {
        "w": jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=_ONE_DEVICE),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=_ONE_DEVICE),
    }
    with Checkpointer(tmp_path, save_every=1, keep=1000) as ckpt:
        assert ckpt.all_steps() == listed
        for s in listed:
            state, meta, replay = ckpt.restore(abstract, step=s)
            assert int(state["step"]) == s and meta == {"step": s}
            assert np.all(np.asarray(state["w"]) == s) and np.all(replay["r"] == s)
        # the step that was being written when killed can be saved again after resuming
        nxt = listed[-1] + 1
        assert ckpt.save(nxt, {"w": jnp.zeros((512, 1024)), "step": jnp.int32(nxt)}, meta={})
        ckpt.wait()
        assert ckpt.latest_step() == nxt
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]


_GUARDED_LOOP = """
import sys, time, jax.numpy as jnp
from gvpo_jax.checkpoint import Checkpointer, PreemptionGuard
mode = sys.argv[2]
ckpt = Checkpointer(sys.argv[1], save_every=1000, keep=2)
with PreemptionGuard() as guard:
    for step in range(1, 100000):
        state = {"w": jnp.full((4,), float(step)), "step": jnp.int32(step)}
        time.sleep(0.01)  # "train step"
        if step == 1:
            ckpt.save(step, state, meta={"step": step}, force=True)
            ckpt.wait()
            print("ready", flush=True)
        if mode == "obey" and guard.should_stop():
            ckpt.save(step, state, meta={"step": step}, force=True)
            ckpt.wait()
            print("saved", step, flush=True)
            break
ckpt.close()
sys.exit(0)
"""


def _ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.strip() == "ready", line


def test_preemption_guard_sigterm_saves_at_step_boundary_and_exits_0(tmp_path):
    proc = _python(_GUARDED_LOOP, str(tmp_path), "obey", stdout=subprocess.PIPE, text=True)
    _ready(proc)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    step = int(out.split()[-1])
    assert out.split()[-2] == "saved" and step > 1
    assert sorted(ocp.utils.checkpoint_steps(tmp_path)) == [1, step]
    abstract = {
        "w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=_ONE_DEVICE),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=_ONE_DEVICE),
    }
    with Checkpointer(tmp_path, save_every=1000, keep=2) as ckpt:
        state, meta, _ = ckpt.restore(abstract)
    assert int(state["step"]) == step and meta == {"step": step}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4,), float(step)))


def test_preemption_guard_second_signal_exits_at_once_keeping_checkpoints(tmp_path):
    proc = _python(_GUARDED_LOOP, str(tmp_path), "ignore", stdout=subprocess.PIPE, text=True)
    _ready(proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert proc.poll() is None  # the first signal only requests a save
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert ocp.utils.checkpoint_steps(tmp_path) == [1]


def test_preemption_guard_restores_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with PreemptionGuard() as guard:
            assert not guard.should_stop()
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.requested and guard.signum == signal.SIGTERM and guard.should_stop()
            assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_invalid_options_are_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match="save_every=0"):
        Checkpointer(tmp_path, save_every=0, keep=1)
    with pytest.raises(CheckpointError, match="keep=0"):
        Checkpointer(tmp_path, save_every=1, keep=0)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_new_families_train_state_round_trips_bit_identical(tmp_path, arch):
    """A Qwen3 / Gemma 3 train state (fp32 masters, AdamW moments, QK-norm and sandwich-norm
    scales) after one update restores bit for bit: the families add parameters, not a format."""
    import optax
    from flax import nnx

    from gvpo_jax import models, train_step

    cfg = models.PRESETS["tiny"].replace(
        architecture=arch, qk_norm=True, attention_bias=False, num_layers=2,
        **({"layer_types": ("sliding", "full"), "sliding_window": 3} if arch == "gemma3" else {}),
    )  # fmt: skip
    _, params = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(1e-2)
    state = train_step.init_state(params, tx, jax.random.key(0))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1), params)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    state = state.replace(params=optax.apply_updates(params, updates), opt_state=opt_state)
    with Checkpointer(tmp_path, save_every=1, keep=1, async_save=False) as ckpt:
        assert ckpt.save(1, state, meta={"step": 1})
        got, _, _ = ckpt.restore(_abstract(state))
    _assert_bit_identical(state, got)
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(got.params)}
    assert "layers/0/attn/q_norm/scale" in names
    assert ("layers/1/post_mlp_norm/scale" in names) == (arch == "gemma3")
