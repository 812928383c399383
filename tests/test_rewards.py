"""Rewards: the math-verify verdict table, format and exact-match rewards, the timeout pool."""

import operator
import os
import time

import numpy as np
import pytest

from gvpo_jax import rewards
from gvpo_jax.rewards import pool as pool_lib
from gvpo_jax.rewards import registry

HUGE_POWER = r"The answer is \boxed{9^{9^{9^{9}}}}."  # sympy would evaluate this for ages

# (model output, gold answer, expected verdict)
MATH_CASES = [
    # fractions vs decimals
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1),
    (r"\boxed{1.5}", r"\frac{3}{2}", 1),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0),
    (r"\boxed{\frac{7}{2}}", "3.5", 1),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1),
    (r"\boxed{\frac{3}{4}}", "0.7", 0),
    # \frac vs \dfrac / \tfrac
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1),
    (r"\boxed{\tfrac{5}{6}}", r"\frac{5}{6}", 1),
    (r"\boxed{\frac12}", r"\dfrac{1}{2}", 1),
    (r"\boxed{\dfrac{1}{3}}", r"\frac{1}{4}", 0),
    # LaTeX wrappers and structured answers
    (r"$\boxed{5}$", "5", 1),
    (r"\[ \boxed{42} \]", "42", 1),
    (r"The final answer is $\boxed{\text{(C)}}$", r"\text{(C)}", 1),
    (r"\boxed{\left( 4, \frac{3\pi}{2} \right)}", r"\left( 4, \frac{3 \pi}{2} \right)", 1),
    (r"\boxed{5\sqrt{2}}", r"\sqrt{50}", 1),
    (r"\boxed{14\pi}", r"14\pi", 1),
    (r"\boxed{\begin{pmatrix} 3 \\ 7 \end{pmatrix}}", r"\begin{pmatrix} 3 \\ 7 \end{pmatrix}", 1),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1),
    (r"\boxed{2^{10}}", "1024", 1),
    (r"\boxed{x = 5}", "5", 1),
    (r"\boxed{7}", r"\boxed{7}", 1),
    # units and text around the answer
    (r"She makes \boxed{18} dollars every day.", "18", 1),
    (r"\boxed{10\text{ cm}}", "10", 1),
    (r"\boxed{10\text{ cm}}", "100", 0),
    (r"\boxed{90^\circ}", "90", 1),
    (r"\boxed{\$18}", "18", 1),
    (r"\boxed{50\%}", "50", 1),
    ("The answer is 7.", "7", 1),
    ("She has 12 apples and gets 7 more, so the answer is 19 apples.", "19", 1),
    (r"The answer is \boxed{6}, since 2^6 = 64.", "6", 1),
    # sets and intervals
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", 1),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", 0),
    (r"\boxed{(1, 3]}", "(1,3]", 1),
    (r"\boxed{[1, 3)}", "(1,3]", 0),
    (r"\boxed{[2,5) \cup (5,\infty)}", r"[2,5) \cup (5,\infty)", 1),
    (r"\boxed{2, 3}", "3, 2", 1),
    (r"\boxed{x \in (1,5)}", "(1,5)", 1),
    (r"\boxed{(-\infty, 2)}", r"(-\infty,2)", 1),
    # negative numbers
    (r"\boxed{-2}", "-2", 1),
    (r"\boxed{2}", "-2", 0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1),
    (r"\boxed{-\frac{1}{2}}", "0.5", 0),
    ("The answer is $-3$.", "-3", 1),
    # thousands separators (plain, LaTeX thin space, LaTeX {,}) and GSM8K '####'
    (r"\boxed{1,000}", "1000", 1),
    (r"\boxed{1000}", "1,000", 1),
    (r"\boxed{1,001}", "1000", 0),
    (r"\boxed{1\,000}", "1000", 1),
    (r"\boxed{1{,}000}", "1000", 1),
    (r"\boxed{1\,000\,000}", "1000000", 1),
    ("She saves 24 * 125 = $3,000.\n#### 3,000", "3000", 1),
    ("#### 1,200", "1200", 1),
    ("She has 5 apples and buys 3 more.\n#### 8", "8", 1),
    ("She has 5 apples and buys 3 more.\n#### 8", "5", 0),
    ("#### 8\nI spent 5 minutes on this.", "8", 1),
    # several boxed answers: read as one set, so hedging fails unless the gold is that set
    (r"\boxed{3} or maybe \boxed{5}", "5", 0),
    (r"\boxed{3} or maybe \boxed{5}", "3, 5", 1),
    # no answer at all
    ("I don't know.", "5", 0),
    ("", "5", 0),
    (r"\boxed{}", "5", 0),
    (r"The answer is \boxed{4", "4", 0),
]


@pytest.mark.parametrize("completion,gold,expected", MATH_CASES)
def test_math_reward_table(completion, gold, expected):
    assert rewards.math_reward(completion, gold) == float(expected)


def test_math_table_is_large_and_covers_both_verdicts():
    verdicts = [e for _, _, e in MATH_CASES]
    assert len(MATH_CASES) >= 40 and verdicts.count(0) >= 10 and verdicts.count(1) >= 30


def test_math_reward_is_registered_and_safe():
    assert rewards.REWARDS["math"](r"\boxed{4}", "4") == 1.0
    assert rewards.REWARDS["math"](None, "4") == 0.0  # raises inside, scores 0


@pytest.mark.parametrize(
    "completion,expected",
    [
        (r"so \boxed{12}", 1.0),
        (r"\boxed{ }", 0.0),
        (r"\boxed{1} and \boxed{2}", 0.0),
        ("12", 0.0),
        (r"\boxed{12", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert rewards.REWARDS["format"](completion, "12") == expected


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<think>2+2 is 4</think> The answer is 4.", 1.0),
        ("<think>2+2 is 4</think>", 0.0),
        ("The answer is 4.", 0.0),
        ("<think>a<think>b</think> 4", 0.0),
    ],
)
def test_think_format_reward(completion, expected):
    assert rewards.REWARDS["think_format"](completion, "4") == expected


@pytest.mark.parametrize(
    "completion,gold,expected",
    [("19", "19", 1.0), (" 19\n", "19", 1.0), ("19 ", " 19", 1.0), ("190", "19", 0.0),
     ("1", "19", 0.0), ("", "19", 0.0), ("-7", "-7", 1.0), ("7", "-7", 0.0)],
)  # fmt: skip
def test_exact_match_reward(completion, gold, expected):
    assert rewards.REWARDS["exact_match"](completion, gold) == expected


def test_boxed_spans_and_gsm8k_answer():
    text = r"\boxed{\frac{1}{2}} then \fbox{x} then \boxed 5$ and \boxed{unclosed"
    assert rewards.boxed_spans(text) == [r"\frac{1}{2}", "x", "5"]
    assert rewards.last_boxed(r"\boxed{1} \boxed{\{2,3\}}") == r"\{2,3\}"
    assert rewards.last_boxed("no box") is None
    assert rewards.gsm8k_final_answer("a\n#### $1,234 \nextra") == "1234"
    assert rewards.gsm8k_final_answer("no marker") is None
    assert rewards.strip_calculator_annotations("2*3=<<2*3=6>>6") == "2*3=6"


def test_registry_rejects_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.score_batch(["1"], ["1"], reward_specs=[("nope", 1.0)])
    with pytest.raises(ValueError, match="already registered"):
        rewards.register(rewards.Reward("math", rewards.math_score))
    with pytest.raises(ValueError, match="pair up"):
        rewards.score_batch(["1", "2"], ["1"])


def test_score_batch_weights_components_and_overlong_inline():
    completions = [r"\boxed{4}", "4", r"\boxed{5}", "nothing"]
    golds = ["4", "4", "4", "4"]
    lens = [5, 7, 8, 12]
    scores, info = rewards.score_batch(
        completions, golds, reward_specs=[("math", 1.0), ("format", 0.5)],
        response_lens=lens, overlong=(10, 4, 2.0),
    )  # fmt: skip
    math_ = np.array([1, 1, 0, 0], np.float64)
    fmt = np.array([1, 0, 1, 0], np.float64)
    # DAPO: start = 10 - 4 = 6; L=5 -> 0, L=7 -> -1/4, L=8 -> -2/4, L=12 > 10 -> -1; times 2.
    overlong = 2.0 * np.array([0.0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(scores, math_ + 0.5 * fmt + overlong, atol=1e-6)
    assert scores.dtype == np.float32 and scores.shape == (4,)
    np.testing.assert_array_equal(info["components"]["math"], math_)
    np.testing.assert_array_equal(info["components"]["format"], fmt)
    assert info["timeouts"] == 0 and info["errors"] == 0


def test_inline_soft_timeout_scores_zero_and_counts():
    t0 = time.perf_counter()
    scores, info = rewards.score_batch([HUGE_POWER, r"\boxed{3}"], ["5", "3"], timeout_s=0.5)
    assert time.perf_counter() - t0 < 5.0
    np.testing.assert_array_equal(scores, [0.0, 1.0])
    assert info["timeouts"] == 1


@pytest.fixture(scope="module")
def warm_pool():
    pool = pool_lib.WorkerPool(2)
    assert pool.map(operator.add, [(1, 2)], timeout_s=60.0) == [("ok", 3)]  # waits for start-up
    yield pool
    pool.close()


def test_pool_runs_tasks_in_order_and_reports_errors_and_crashes(warm_pool):
    out = warm_pool.map(
        operator.truediv, [(1, 2), (1, 0), (3, 4)] + [(float(i), 1.0) for i in range(10)],
        timeout_s=30.0,
    )  # fmt: skip
    assert out[0] == ("ok", 0.5) and out[2] == ("ok", 0.75)
    assert out[1][0] == "error" and "ZeroDivisionError" in out[1][1]
    assert [v for _, v in out[3:]] == [float(i) for i in range(10)]
    crashed = warm_pool.map(os._exit, [(3,)], timeout_s=30.0)
    assert crashed[0][0] == "error" and "exited" in crashed[0][1]
    assert warm_pool.map(operator.mul, [(6, 7)], timeout_s=30.0) == [("ok", 42)]


def test_pool_timeout_kills_hung_worker_quickly(warm_pool):
    restarts = warm_pool.restarts
    t0 = time.perf_counter()
    out = warm_pool.map(time.sleep, [(60,), (0,)], timeout_s=0.5)
    elapsed = time.perf_counter() - t0
    assert out == [("timeout", None), ("ok", None)]
    assert elapsed < 3.0, elapsed
    assert warm_pool.restarts == restarts + 1


def test_pool_reports_workers_that_cannot_start():
    broken = pool_lib.WorkerPool(1, preload=("gvpo_jax.no_such_module",))
    try:
        with pytest.raises(RuntimeError, match="fail to start"):
            broken.map(operator.add, [(1, 2)], timeout_s=5.0)
    finally:
        broken.close()


def test_huge_power_hits_pool_timeout_and_scores_zero_quickly(monkeypatch, warm_pool):
    monkeypatch.setattr(registry, "get_pool", lambda n: warm_pool)
    t0 = time.perf_counter()
    scores, info = rewards.score_batch(
        [HUGE_POWER, r"\boxed{\frac{1}{2}}", "no answer"], ["5", "0.5", "1"],
        timeout_s=1.0, num_workers=2,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    np.testing.assert_array_equal(scores, [0.0, 1.0, 0.0])
    assert info["timeouts"] == 1 and info["errors"] == 0
    assert elapsed < 4.0, elapsed
    # The replacement worker scores the next batch normally.
    scores, info = rewards.score_batch([r"\boxed{7}"] * 4, ["7"] * 4, timeout_s=30.0, num_workers=2)
    np.testing.assert_array_equal(scores, [1.0] * 4)


def test_extract_batch_gives_canonical_answer_keys(monkeypatch, warm_pool):
    monkeypatch.setattr(registry, "get_pool", lambda n: warm_pool)
    completions = [r"\boxed{0.5}", r"\boxed{\frac{1}{2}}", "nothing here", r"\boxed{3}"]
    pooled, info = rewards.extract_batch(completions, reward="math", num_workers=2)
    inline, _ = rewards.extract_batch(completions, reward="math")
    assert pooled == inline
    assert pooled[0] == pooled[1] and pooled[2] is None and pooled[3] == "3"
    assert info == {"timeouts": 0, "errors": 0}
    with pytest.raises(ValueError, match="no answer extractor"):
        rewards.extract_batch(completions, reward="format")
