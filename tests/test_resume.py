"""Exact resume after SIGKILL, SIGTERM preemption, and bad inputs through the command line."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from tests.conftest import child_env
from tests.helpers import PROGRAM_COUNTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Volatile metrics: wall-clock times differ between runs; everything else must be identical.
VOLATILE = ("time", "tokens_per_s", "tools/wait_frac", *PROGRAM_COUNTS)
RUN_ARGS = [
    "--config=configs/arith_tiny.py", "--config.sft.steps=10", "--config.data.eval_size=16",
    "--config.train.eval_every=0", "--config.train.checkpoint_every=2",
    "--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4",
    "--config.algo.replay_fraction=0.5",
    "--config.algo.replay_capacity=6", "--config.train.plot=False",
    "--config.train.eval_samples=1",  # greedy only: one sampler program less to compile
    "--config.model.overrides.num_layers=1",  # compile time grows with the layer count
]  # fmt: skip


def _env():
    return child_env()  # one CPU device: resume is not about the mesh, and it is faster


def _start(workdir, *extra):
    cmd = [sys.executable, "-m", "gvpo_jax.main", f"--workdir={workdir}", *RUN_ARGS, *extra]
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _run(workdir, *extra, timeout=300):
    proc = _start(workdir, *extra)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _committed(workdir):
    ckpts = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpts):
        return []
    return sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())


def _rl_rows(workdir):
    """Per-step RL metrics; for a step written twice (before a kill and after resume) the last."""
    rows = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        row = json.loads(line)
        if "reward_mean" in row:
            rows[row["step"]] = {
                k: v for k, v in row.items() if not k.endswith("_s") and k not in VOLATILE
            }
    return rows


def _state_dtypes(workdir, step):
    """{"params" | "opt_state" | "ref": set of dtype names} of a checkpoint, from its metadata."""
    meta = ocp.StandardCheckpointer().metadata(workdir / "checkpoints" / str(step) / "state")
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    floats = lambda t: {str(x.dtype) for x in jax.tree.leaves(t) if "float" in str(x.dtype)}
    return {
        "params": floats(tree["state"]["params"]),
        "opt_state": floats(tree["state"]["opt_state"]),
        "ref": floats(tree.get("ref")),
    }


def _wait_for(predicate, proc, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    """With mixed precision (fp32 masters, bf16 compute) and the calculator in the rollout (a
    deterministic tool): resume is bit-exact, the checkpoint holds the fp32 masters and
    moments, and the export is in the compute dtype."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    mixed = ["--config.model.compute_dtype=bfloat16", "--config.tools.names=calculator",
             "--config.tools.format=bracket", "--config.tools.max_tokens=3",
             "--config.rollout.max_new_tokens=10"]  # fmt: skip
    code, out, err = _run(straight, "--config.train.steps=4", *mixed)
    assert code == 0, err[-3000:]

    proc = _start(killed, "--config.train.steps=4", *mixed)
    assert _wait_for(lambda: 2 in _committed(killed), proc), "no checkpoint appeared"
    proc.kill()  # SIGKILL: no handler runs, whatever was being written is abandoned
    proc.wait()
    assert 4 not in _committed(killed)
    resume_from = max(_committed(killed))
    code, out, err = _run(killed, "--config.train.steps=4", *mixed)
    assert code == 0, err[-3000:]
    assert "Resumed from" in out and f"at step {resume_from}" in out
    saved = _state_dtypes(killed, 4)
    assert saved["params"] == {"float32"} and saved["opt_state"] == {"float32"}, saved
    assert saved["ref"] == {"bfloat16"}, saved  # the frozen reference, stored for compute

    a = load_file(str(straight / "export" / "model.safetensors"))
    b = load_file(str(killed / "export" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == ml_dtypes.bfloat16, name  # train.export_dtype "" = compute
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    rows_a, rows_b = _rl_rows(straight), _rl_rows(killed)
    assert sorted(rows_a) == sorted(rows_b) == [1, 2, 3, 4]
    for step in range(resume_from + 1, 5):
        assert rows_a[step] == rows_b[step], step
    assert rows_a[4]["replayed_groups"] == 4.0  # replay was in play across the resume
    assert sum(rows_a[t]["tools/calls_per_response"] for t in (3, 4)) > 0  # and the tool


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_0(tmp_path):
    workdir = tmp_path / "run"
    proc = _start(workdir, "--config.train.steps=200")

    def rl_started():
        path = workdir / "metrics.jsonl"
        return path.exists() and "reward_mean" in path.read_text()

    assert _wait_for(rl_started, proc), "training did not start"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("Preempted: saved step"))
    step = int(line.split("saved step ")[1].split()[0])
    assert step in _committed(workdir)
    assert step < 200


BAD_INPUTS = [
    (["--config.restore_from=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["--config.model.hf_dir=/nonexistent/model"], "config.model.hf_dir"),
    (["--config.data.task=jsonl", "--config.data.path=tests/fixtures/broken.jsonl"], "line 2"),
    (["--config.data.task=jsonl", "--config.data.path=tests/fixtures/empty.jsonl"], "empty"),
    (["--config.data.on_too_long=error", "--config.data.max_prompt_len=3"], "max_prompt_len=3"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_exits_2_with_one_sentence(tmp_path, args, message):
    code, out, err = _run(tmp_path / "run", "--config.train.steps=2", *args, timeout=180)
    assert code == 2, (out[-2000:], err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert "Traceback" not in err
