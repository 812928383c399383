"""Rewards: the math-verify verdict table, format and exact-match rewards, the guard against
explosive answers, the timeout pool, reward specs."""

import functools
import json
import operator
import os
import signal
import time

import numpy as np
import pytest

from gvpo_jax import rewards
from gvpo_jax.rewards import guard, registry, verifiers
from gvpo_jax.rewards import pool as pool_lib

HUGE_POWER = r"The answer is \boxed{9^{9^{9^{9}}}}."  # sympy would evaluate this for ages
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

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
        response_lens=lens, overlong=(10, 4, 2.0), num_workers=0,
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


def test_inline_soft_deadline_stops_a_python_level_reward(slow_reward):
    t0 = time.perf_counter()
    scores, info = rewards.score_batch(
        ["1", "2"], ["1", "2"], reward_specs=[(slow_reward, 1.0)], timeout_s=0.3, num_workers=0
    )
    assert time.perf_counter() - t0 < 2.0
    np.testing.assert_array_equal(scores, [0.0, 0.0])
    assert info["timeouts"] == 2 and info["errors"] == 0


@pytest.fixture
def slow_reward():
    def slow(completion, gold, timeout_s=None):
        time.sleep(30)  # interruptible by the soft deadline's signal, unlike a C-level pow
        return 1.0

    rewards.register(rewards.Reward("test_slow", slow))
    yield "test_slow"
    rewards.REWARDS.pop("test_slow")


# Answers whose exact evaluation explodes, from sympy's `pow` / factorial / expansion loops.
EXPLOSIVE = [
    HUGE_POWER,
    r"\boxed{9^{9^9}}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{1000000000^{1000000000}}",
    r"\boxed{10^{-9^{9^9}}}",
    r"\boxed{\frac{9^{9^9}}{9^{9^9}}}",
    r"\boxed{\sqrt{9^{9^9}}}",
    r"\boxed{\left(9^{9}\right)^{9^{9}}}",
    r"\boxed{99999999999!}",
    r"\boxed{(10^{10})!}",
    r"\boxed{9!!!!}",
    r"\boxed{\binom{1000000000}{500000000}}",  # latex2sympy evaluates binomials while parsing
    r"\boxed{\prod_{i=1}^{1000000000} i}",
    r"\boxed{\sum_{i=1}^{100000} \sin(i)}",
    r"\boxed{(x+1)^{100000}}",
    r"\boxed{(x+y+z)^{30}}",
    r"\boxed{x = 9^{9^9}}",
    r"\boxed{\{1, 9^{9^9}\}}",
    r"\boxed{\begin{pmatrix} 9^{9^9} \\ 1 \end{pmatrix}}",
    "so the answer is 9^9^9^9",
]


@pytest.mark.parametrize("completion", EXPLOSIVE)
def test_guard_refuses_explosive_answers_from_the_parsed_expression(completion):
    parsed = verifiers.parse_prediction(completion)  # evaluation off: returns at once
    assert any(not isinstance(p, str) for p in parsed), parsed
    assert guard.refusal(parsed) is not None, parsed
    with pytest.raises(rewards.RewardRefused, match="refused unevaluated"):
        rewards.math_score(completion, "5")


def test_guard_passes_every_graded_answer_of_the_tests():
    """The held-out grading cases: the verdict table and the dataset fixtures' own solutions."""
    texts = [c for c, _, _ in MATH_CASES] + [rf"\boxed{{{g}}}" for _, g, _ in MATH_CASES]
    for name in ("math500/test.jsonl", "gsm8k/train.jsonl", "gsm8k/test.jsonl"):
        for line in open(os.path.join(FIXTURES, name)):
            ex = json.loads(line)
            texts += [ex.get("solution") or ex["answer"], rf"\boxed{{{ex.get('answer')}}}"]
    assert len(texts) > 150
    refused = [(t, guard.refusal(verifiers.parse_prediction(t))) for t in texts]
    assert [r for r in refused if r[1] is not None] == []


def test_guard_limits_sit_above_real_answers_and_below_slow_ones():
    ok = [r"\boxed{2^{2023}}", r"\boxed{100!}", r"\boxed{(x+1)^{10}}", r"\boxed{\binom{100}{50}}",
          r"\boxed{\sum_{k=1}^{100} k}", r"\boxed{10^{-30}}", r"\boxed{x^{2016}}"]  # fmt: skip
    for text in ok:
        assert guard.refusal(verifiers.parse_prediction(text)) is None, text
    assert rewards.math_reward(r"\boxed{2^{2023}}", r"2^{2023}") == 1.0


def test_explosive_answers_score_zero_counted_as_refused_by_default(warm_pool):
    # Every answer came back refused (counted as a timeout too) well before its 1 s deadline.
    scores, info = rewards.score_batch(EXPLOSIVE + [r"\boxed{3}"], ["5"] * len(EXPLOSIVE) + ["3"],
                                       timeout_s=1.0)  # fmt: skip
    assert scores.tolist() == [0.0] * len(EXPLOSIVE) + [1.0]
    assert info["refused"] == info["timeouts"] == len(EXPLOSIVE) and info["errors"] == 0
    answers, info = rewards.extract_batch([HUGE_POWER, r"\boxed{3}"], reward="math")
    assert answers == [None, "3"] and info["refused"] == info["timeouts"] == 1


def test_tower_scored_200_times_in_a_warm_process_returns_within_2x_timeout(warm_pool):
    timeout_s, worst = 1.0, 0.0
    for _ in range(200):
        t0 = time.perf_counter()
        scores, info = rewards.score_batch([HUGE_POWER], ["5"], timeout_s=timeout_s)
        worst = max(worst, time.perf_counter() - t0)
        assert scores.tolist() == [0.0]
        assert info["timeouts"] == 1 and info["errors"] == 0, info
    assert worst < 2 * timeout_s, worst


def test_default_worker_count_follows_the_machine():
    assert 1 <= rewards.default_workers() <= registry.MAX_AUTO_WORKERS
    assert rewards.default_workers() <= (os.cpu_count() or 1)
    assert registry.resolve_workers(rewards.AUTO_WORKERS) == rewards.default_workers()
    assert registry.resolve_workers(0) == 0


def test_parse_specs_names_the_registered_rewards():
    assert rewards.parse_specs("math:1, format:0.1,exact_match") == [
        ("math", 1.0), ("format", 0.1), ("exact_match", 1.0)]  # fmt: skip
    for text, message in [("nosuch:1", "unknown reward 'nosuch'"), ("math:abc", "'abc' of math"),
                          ("math:inf", "not a finite number"), (",", "no reward")]:  # fmt: skip
        with pytest.raises(ValueError, match=message) as err:
            rewards.parse_specs(text)
        assert "registered rewards: math, format" in str(err.value)


@pytest.fixture(scope="module")
def warm_pool():
    """The process-wide pool that score_batch's default settings use, started and waited for."""
    pool = pool_lib.get_pool(registry.default_workers())
    assert pool.map(operator.add, [(1, 2)], timeout_s=60.0) == [("ok", 3)]  # waits for start-up
    yield pool
    pool_lib.close_pools()


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


def test_pool_workers_are_forked_warm():
    """The zygote runs verifiers.warm_up once, so a new worker's parser and caches are built
    before its first task (cold, the first math task took ~10x a warm one)."""
    probe = "__import__('gvpo_jax.rewards.verifiers', fromlist=['_']).parse_gold.cache_info()[:]"
    pool = pool_lib.WorkerPool(1)
    try:
        [(status, info)] = pool.map(eval, [(probe,)], timeout_s=60.0)  # (hits, misses, max, size)
    finally:
        pool.close()
    assert status == "ok" and info[0] == 0 and info[3] >= 1, info


def test_the_trainer_imports_sympy_and_math_verify_only_when_it_scores_in_its_own_process():
    """A trainer process scores math answers in the pool (whose zygote imports sympy and
    math-verify), so importing the trainer leaves them out (~0.4 s a process); scoring in the
    process itself loads them on first use."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gvpo_jax import rewards, train\n"
        "heavy = ('sympy', 'math_verify', 'gvpo_jax.rewards.guard')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "print(rewards.math_reward(r'so \\boxed{\\frac{1}{2}}', '0.5'), 'sympy' in sys.modules)\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "1.0 True"], out.stdout


def test_pool_kills_workers_stuck_in_sympy_and_each_call_returns_within_2x_timeout(warm_pool):
    """Without the guard the tower reaches sympy's C-level pow, which no signal interrupts: the
    pool kills the worker at the deadline and swaps in its started spare, call after call."""
    unguarded = functools.partial(rewards.math_score, guarded=False)
    restarts, timeout_s = warm_pool.restarts, 0.5
    for _ in range(3):
        t0 = time.perf_counter()
        out = warm_pool.map(unguarded, [(r"\boxed{7}", "7", None), (HUGE_POWER, "5", None)],
                            timeout_s=timeout_s)  # fmt: skip
        assert time.perf_counter() - t0 < 2 * timeout_s
        assert out == [("ok", 1.0), ("timeout", None)]
    assert warm_pool.restarts == restarts + 3
    # The replacements score the next batch normally.
    scores, info = rewards.score_batch([r"\boxed{7}"] * 4, ["7"] * 4, timeout_s=30.0)
    assert scores.tolist() == [1.0] * 4 and info["timeouts"] == 0


def test_extract_batch_gives_canonical_answer_keys(warm_pool):
    completions = [r"\boxed{0.5}", r"\boxed{\frac{1}{2}}", "nothing here", r"\boxed{3}"]
    pooled, info = rewards.extract_batch(completions, reward="math")
    inline, _ = rewards.extract_batch(completions, reward="math", num_workers=0)
    assert pooled == inline
    assert pooled[0] == pooled[1] and pooled[2] is None and pooled[3] == "3"
    assert info == {"timeouts": 0, "errors": 0, "refused": 0}
    with pytest.raises(ValueError, match="no answer extractor"):
        rewards.extract_batch(completions, reward="format")


def test_soft_deadline_shares_sigalrm_with_an_outer_alarm():
    """pytest-timeout's signal method (the test command's per-test timeout) arms SIGALRM too: a
    reward deadline inside a test must neither cancel nor swallow it."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        with pytest.raises(rewards.RewardTimeout):
            with verifiers.soft_deadline(0.1):
                time.sleep(5)
        assert not fired and 0.3 < signal.getitimer(signal.ITIMER_REAL)[0] < 0.6  # re-armed
        t0 = time.monotonic()
        with verifiers.soft_deadline(5.0):  # the outer alarm comes first and runs its handler
            time.sleep(1.0)
        assert len(fired) == 1 and fired[0] - t0 < 0.8
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        (" 19 marbles", "19", 1.0),
        (" 13 + 13 = 26\n", "26", 1.0),
        (" 13 + 13 = <b><i><b>", "26", 0.0),  # what math-verify rewards: the unevaluated sum
        ("It is -4.", "-4", 1.0),
        ("1,024 bytes", "1024", 1.0),
        ("2.50 dollars", "2.5", 1.0),
        ("no number", "3", 0.0),
        ("7 or 8", "7", 0.0),
    ],
)
def test_last_number_reward_reads_the_last_written_number(completion, gold, expected):
    assert verifiers.last_number_score(completion, gold) == expected
    assert registry.REWARDS["last_number"](completion, gold) == expected


def test_math_verify_rewards_an_unevaluated_expression_which_last_number_does_not():
    """The reward hacking seen with Gemma 3 270M on arithmetic word problems (STUDY.md)."""
    assert verifiers.math_score(" 13 + 13 = <b><i><b>", "26") == 1.0
    assert verifiers.last_number_score(" 13 + 13 = <b><i><b>", "26") == 0.0
