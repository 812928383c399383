"""A reward can never stall a run: a power-tower completion scores 0, counted, in bounded time."""

import json
import time

import numpy as np
import pytest
import transformers

from gvpo_jax import config as config_lib
from gvpo_jax import data, rewards, tasks, train
from gvpo_jax.rewards import pool as pool_lib

TOWER = r"The answer is \boxed{9^{9^{9^{9}}}}."  # sympy would compute 9^387420489 first
TIMEOUT_S = 1.0


def _math_config(**changes):
    """A tiny arith run scored by math-verify (so the sympy path and its pool are in play), with
    every other setting at its default, reward_workers included."""
    c = config_lib.base_config()
    c.model.overrides.update(dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  head_dim=16, intermediate_size=64))  # fmt: skip
    c.data.rewards = "math:1"
    c.data.max_prompt_len = 8
    c.data.eval_size = 8
    c.rollout.prompts_per_step = 8
    c.mesh.num_devices = 1  # the rewards are the point here, not the mesh: one-device compiles
    c.rollout.group_size = 2
    c.rollout.max_new_tokens = 4
    c.algo.overlong_cache = 2
    c.train.reward_timeout_s = TIMEOUT_S
    config_lib.set_fields(c, changes)
    config_lib.validate(c)
    return c


def test_tower_scored_200_times_through_the_task_returns_within_2x_timeout():
    task = tasks.build_task(_math_config(), data.build_char_tokenizer())
    try:
        scores, _ = task.score([r"\boxed{7}"], ["7"])  # starts the default pool (not timed)
        assert scores.tolist() == [1.0]
        worst = 0.0
        for _ in range(200):
            t0 = time.perf_counter()
            scores, info = task.score([TOWER], ["5"])
            worst = max(worst, time.perf_counter() - t0)
            assert scores.tolist() == [0.0]
            assert info["timeouts"] == 1 and info["errors"] == 0, info
        assert worst < 2 * TIMEOUT_S, worst
        assert pool_lib._POOLS, "math rewards must be scored in the worker pool by default"
    finally:
        task.close()


@pytest.fixture
def tower_rows(monkeypatch):
    """Every third decoded completion (training, evaluation, sample logs) becomes the tower, and
    every score_batch call is recorded with its duration."""
    decode = transformers.PreTrainedTokenizerFast.decode
    calls = {"decoded": 0, "batches": []}

    def forced_decode(self, ids, *args, **kwargs):
        calls["decoded"] += 1
        return TOWER if calls["decoded"] % 3 == 0 else decode(self, ids, *args, **kwargs)

    score_batch = rewards.score_batch

    def timed_score_batch(completions, golds, **kwargs):
        t0 = time.perf_counter()
        scores, info = score_batch(completions, golds, **kwargs)
        calls["batches"].append((list(completions), scores, info, time.perf_counter() - t0))
        return scores, info

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "decode", forced_decode)
    monkeypatch.setattr(rewards, "score_batch", timed_score_batch)
    return calls


@pytest.mark.slow
def test_run_whose_sampler_emits_towers_finishes_with_those_rows_at_zero(tmp_path, tower_rows):
    c = _math_config(**{
        "sft.steps": 0, "train.steps": 2, "train.eval_every": 0, "train.export": False,
        "train.plot": False, "train.kl_ref_metric": False, "train.sample_log_every": 100,
    })  # fmt: skip
    t0 = time.perf_counter()
    train.run(c, str(tmp_path))
    elapsed = time.perf_counter() - t0
    batches = tower_rows["batches"]
    assert len(batches) >= 2, "the training steps score through rewards.score_batch"
    towers = 0
    for completions, scores, info, seconds in batches:
        rows = [i for i, text in enumerate(completions) if text == TOWER]
        towers += len(rows)
        assert all(scores[i] == 0.0 for i in rows)
        assert info["timeouts"] == len(rows) and info["errors"] == 0, info
        assert seconds < 2 * TIMEOUT_S * max(len(rows), 1), seconds
    assert towers >= 8
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rl = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2] and all(np.isfinite(r["loss"]) for r in rl)
    assert elapsed < 300, elapsed
