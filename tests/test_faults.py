"""Faults inside a run: non-finite steps are skipped and counted, a run that never trained stops
without exporting (one sentence, exit status 1), bad rewards score 0 and go on."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gvpo_jax import checkpoint, rewards, train
from gvpo_jax import eval as eval_lib
from gvpo_jax.errors import FaultError
from gvpo_jax.rl_step import TrainingError, rl_step
from tests.conftest import child_env
from tests.test_train import _flat, make_run, toy_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nan_at(task, calls_to_poison):
    """Wraps task.score so the given call numbers return NaN rewards."""
    score = task.score

    def poisoned(completions, golds):
        r, info = score(completions, golds)
        if task.calls in calls_to_poison:
            r = np.full_like(r, np.nan)
        return r, info

    task.score = poisoned


def test_nan_step_is_skipped_counted_and_training_continues():
    c = toy_config("gvpo")
    run, state, loop, ref = make_run(c)
    _nan_at(run.task, {2})
    history = []
    for _ in range(3):
        before = _flat(state.params)
        state, metrics, _, _ = rl_step(run, state, loop, ref)
        history.append((before, _flat(state.params), metrics))
    (_, _, m1), (b2, a2, m2), (b3, a3, m3) = history
    assert m1["skipped_updates"] == 0 and m3["skipped_updates"] == 0
    assert m2["skipped_updates"] == 1 and not np.isfinite(m2["loss"])
    np.testing.assert_array_equal(a2, b2)  # the poisoned step changed nothing
    assert np.abs(a3 - b3).max() > 0  # and training went on
    assert int(state.updates) == 2 and int(state.bad_steps) == 0
    assert checkpoint.nonfinite_leaves(state) == []  # what a checkpoint would save is finite


def test_consecutive_nan_steps_stop_the_run():
    c = toy_config("gvpo", **{"train.max_bad_steps": 2})
    run, state, loop, ref = make_run(c)
    _nan_at(run.task, set(range(1, 100)))
    state, m, _, _ = rl_step(run, state, loop, ref)
    assert m["skipped_updates"] == 1
    with pytest.raises(TrainingError, match="2 consecutive non-finite updates"):
        rl_step(run, state, loop, ref)


def test_a_run_whose_every_update_was_skipped_stops_without_exporting(monkeypatch):
    """Fewer steps than train.max_bad_steps, every one non-finite: the run used to end as if it
    had trained (exit 0, the start policy exported); now it stops with a TrainingError (a
    FaultError: one sentence, exit status 1) before the export, and its checkpoint stays."""
    c = toy_config("gvpo", **{"train.steps": 2, "train.checkpoint_every": 1, "train.plot": False})
    run, state, loop, ref = make_run(c)
    _nan_at(run.task, set(range(1, 100)))
    monkeypatch.setattr(
        eval_lib, "evaluate_held_out", lambda *a, **k: {"accuracy": 0.0, "greedy": 0.0}
    )
    with pytest.raises(TrainingError) as err:
        train.train_rl(run, state, loop, ref, {})
    assert isinstance(err.value, FaultError)
    assert str(err.value).startswith(
        "every RL update of the run (2 steps) was non-finite and skipped, so the policy never "
        "changed and nothing was exported"
    ), str(err.value)
    run.ckpt.wait()
    assert run.ckpt.all_steps() == [1, 2]  # the checkpoints written before stay
    assert not os.path.exists(os.path.join(run.workdir, "export"))


def test_a_fault_ends_the_cli_with_one_sentence_and_status_1(tmp_path):
    """A FaultError (here the trainer's TrainingError) is the input's fault no more than a full
    disk is: `error: <sentence>` and exit status 1, no traceback."""
    code = (
        "import sys\n"
        "from absl import app\n"
        "from gvpo_jax import main, train\n"
        "def run(config, workdir):\n"
        "    raise train.TrainingError('every RL update of the run (2 steps) was non-finite')\n"
        "train.run = run\n"
        f"sys.argv = ['main', '--config=configs/arith_tiny.py', '--workdir={tmp_path}']\n"
        "app.run(main.main, flags_parser=main.parse_flags)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("error: every RL update of the run (2 steps) was non-finite"), (
        proc.stderr[-3000:]
    )


@pytest.fixture
def bad_rewards():
    def sleepy(completion, gold, timeout_s=None):
        time.sleep(5)
        return 1.0

    def broken(completion, gold, timeout_s=None):
        raise RuntimeError("verifier crashed")

    added = []
    for name, fn in (("test_sleepy", sleepy), ("test_broken", broken)):
        if name not in rewards.REWARDS:
            rewards.register(rewards.Reward(name, fn))
            added.append(name)
    yield
    for name in added:
        rewards.REWARDS.pop(name)


def test_reward_timeouts_and_errors_score_zero_and_the_run_goes_on(bad_rewards):
    from gvpo_jax import tasks

    c = toy_config("gvpo", **{"train.reward_timeout_s": 0.2})
    run, state, loop, ref = make_run(c)
    real = tasks.Task.score
    specs = [("test_sleepy", 1.0), ("test_broken", 1.0)]

    class Shim:  # tasks.Task.score on the toy task's settings
        reward_specs, timeout_s, num_workers = specs, 0.2, 0

    run.task.score = lambda comp, golds: real(Shim, comp, golds)
    t0 = time.perf_counter()
    before = _flat(state.params)
    state, m, _, _ = rl_step(run, state, loop, ref)
    elapsed = time.perf_counter() - t0
    B = c.rollout.prompts_per_step * c.rollout.group_size
    assert m["reward/timeouts"] == B and m["reward/errors"] == B
    assert m["reward_mean"] == 0.0
    assert elapsed < 0.2 * B + 20  # each sleeper is cut at its 0.2 s deadline, not 30 s
    state, m, _, _ = rl_step(run, state, loop, ref)  # the run goes on
    assert np.isfinite(_flat(state.params)).all() and _flat(state.params).shape == before.shape
    jax.block_until_ready(state.params)
