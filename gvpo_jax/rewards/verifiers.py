"""Verifiable rewards on text: math correctness (math-verify), boxed / think format, exact match.

Every function here has the reward signature `fn(completion, gold, timeout_s) -> float` and may
raise; `RewardTimeout` means the soft (signal) deadline expired, `RewardRefused` that the answer
was refused unevaluated by `rewards.guard` (its exact evaluation could explode). `timeout_s` is
honoured only in a main thread (SIGALRM), and cannot interrupt a long C call (e.g. a huge
big-integer power): the worker pool of `gvpo_jax.rewards.pool` is the hard guarantee and calls
these with `timeout_s=None`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import signal
import threading
import time

from gvpo_jax.rewards.extract import boxed_spans, gsm8k_final_answer

# sympy, math-verify (with latex2sympy's parser) and `rewards.guard` are imported where they
# are first used (~0.4 s): the trainer's process scores math answers in the worker pool, whose
# zygote imports them once (`warm_up`), so a run that never scores in its own process does not
# import them at all.

# math-verify warns once per process that its own timeouts are off; ours replace them.
logging.getLogger("math_verify").setLevel(logging.ERROR)
# "1\,000" and "1{,}000" are LaTeX thousands separators that math-verify reads as a product.
_LATEX_THOUSANDS_RE = re.compile(r"(\d)(?:\\,|\{,\})(\d{3})(?!\d)")
_THINK_RE = re.compile(r"\s*<think>(?:(?!</?think>).)+</think>\s*\S.*", re.DOTALL)


class RewardTimeout(BaseException):
    """A reward overran its deadline (BaseException, so math-verify cannot swallow it)."""


class RewardRefused(ValueError):
    """The answer was not evaluated: `rewards.guard` found that its evaluation could explode."""


@contextlib.contextmanager
def soft_deadline(timeout_s: float | None):
    """Raises RewardTimeout in the body after `timeout_s` seconds (main thread only, else no-op).

    Shares SIGALRM with an alarm armed outside (pytest-timeout's signal method, a caller's own
    deadline): the earlier deadline is armed; if the outer one comes first its handler runs, and
    on exit the outer alarm is re-armed with the time it has left (not cancelled).
    """
    if not timeout_s or threading.current_thread() is not threading.main_thread():
        yield
        return
    start = time.monotonic()
    outer_s, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_at = start + outer_s if outer_s > 0 else math.inf
    previous = signal.getsignal(signal.SIGALRM)
    outer_fired = False

    def _expire(signum, frame):
        nonlocal outer_fired
        now = time.monotonic()
        if now >= outer_at and callable(previous) and not outer_fired:
            outer_fired = True
            previous(signum, frame)  # usually raises; if it returns, our own deadline still holds
            signal.setitimer(signal.ITIMER_REAL, max(start + timeout_s - now, 1e-6))
            return
        raise RewardTimeout(f"reward exceeded {timeout_s} s")

    signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, min(timeout_s, outer_s) if outer_s > 0 else timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_at < math.inf and not outer_fired:
            left = max(outer_at - time.monotonic(), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def normalize_completion(text: str) -> str:
    """Rewrites spellings math-verify misreads: LaTeX thousands separators, a bare GSM8K '####'."""
    previous = None
    while previous != text:
        previous, text = text, _LATEX_THOUSANDS_RE.sub(r"\1\2", text)
    if not boxed_spans(text):
        final = gsm8k_final_answer(text)
        if final is not None:
            # GSM8K-style output: the number after '####' is the answer, not the last number seen.
            text = f"{text}\n\\boxed{{{final}}}"
    return text


@functools.cache
def _extraction_configs() -> tuple[tuple, tuple]:
    """math-verify's extraction settings for (predictions, gold answers): in a prediction a
    boxed answer wins over "the answer is ..." phrases and over bare numbers in the text."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (
        (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()),
        (LatexExtractionConfig(), ExprExtractionConfig()),
    )


@functools.lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """The gold answer as math-verify objects; a bare answer string is read as boxed LaTeX."""
    from math_verify import parse

    _, config = _extraction_configs()
    gold = gold.strip()
    text = gold if "\\boxed" in gold else f"\\boxed{{{gold}}}"
    parsed = parse(text, extraction_config=config, parsing_timeout=None)
    if not parsed:
        parsed = parse(gold, extraction_config=config, parsing_timeout=None)
    return tuple(parsed)


def parse_prediction(completion: str) -> list:
    """The model's final answer as math-verify objects (empty list: no answer found).

    Parsed with sympy's evaluation off: latex2sympy evaluates some nodes as it builds them (a
    `\\binom` of huge numbers would be computed right here), and the guard must see the
    expression before anything is computed. Verdicts on the test tables are unchanged.
    """
    import sympy
    from math_verify import parse

    config, _ = _extraction_configs()
    with sympy.evaluate(False):
        return parse(
            normalize_completion(completion), extraction_config=config, parsing_timeout=None
        )


def guarded_prediction(completion: str) -> list:
    """`parse_prediction`, refused (RewardRefused) when evaluating the answer could explode."""
    from gvpo_jax.rewards import guard

    parsed = parse_prediction(completion)
    reason = guard.refusal(parsed)
    if reason is not None:
        raise RewardRefused(f"answer refused unevaluated: {reason}")
    return parsed


def math_score(
    completion: str, gold: str, timeout_s: float | None = None, *, guarded: bool = True
) -> float:
    """1.0 iff the final answer of `completion` equals `gold` mathematically, else 0.0.

    Several boxed answers are read together as one set (math-verify's rule), so hedging with
    multiple candidates scores 0 unless the gold answer is that set. May raise RewardTimeout
    and RewardRefused (gold answers come from the dataset and are not guarded). `guarded=False`
    evaluates any answer, explosive or not: only for tests of the pool's hard timeout.
    """
    from math_verify import verify

    with soft_deadline(timeout_s):
        gold_parsed = parse_gold(gold)
        pred_parsed = guarded_prediction(completion) if guarded else parse_prediction(completion)
        if not gold_parsed or not pred_parsed:
            return 0.0
        return 1.0 if verify(list(gold_parsed), pred_parsed, timeout_seconds=None) else 0.0


def math_answer(completion: str, timeout_s: float | None = None) -> str | None:
    """A canonical string of the final answer (for majority voting), or None if there is none."""
    import sympy

    with soft_deadline(timeout_s):
        parsed = guarded_prediction(completion)
        if not parsed:
            return None
        expr = parsed[0]
        if isinstance(expr, sympy.Float):
            expr = sympy.nsimplify(expr, rational=True)
        return str(expr)


def warm_up() -> None:
    """Scores and reads one answer, so latex2sympy's parser and sympy's caches are built.

    The reward pool's zygote calls this once after its imports (`rewards.worker`): every worker
    forked from it then starts warm. Measured on the 2-core machine, a forked worker's first
    three math tasks took 0.15-0.17 s cold and 0.013-0.016 s warm; a cold first task on a loaded
    machine could overrun a short timeout, on the first worker and on each replacement.
    """
    math_score(r"so it is $\boxed{\frac{1}{2}}$", r"\frac13")
    math_answer(r"\boxed{0.5}")


def math_reward(completion: str, gold: str, *, timeout_s: float | None = 5.0) -> float:
    """Math answer correctness on its own: 1.0 correct, 0.0 otherwise (errors, timeouts too)."""
    try:
        return math_score(completion, gold, timeout_s)
    except (Exception, RewardTimeout):
        return 0.0


def format_score(completion: str, gold: str, timeout_s: float | None = None) -> float:
    """1.0 iff the completion has exactly one `\\boxed{...}` answer and it is not empty."""
    del gold, timeout_s
    spans = boxed_spans(completion)
    return 1.0 if len(spans) == 1 and spans[0].strip() else 0.0


def think_format_score(completion: str, gold: str, timeout_s: float | None = None) -> float:
    """1.0 iff the completion is `<think>...</think>` followed by a non-empty answer (R1 style)."""
    del gold, timeout_s
    return 1.0 if _THINK_RE.fullmatch(completion) else 0.0


def exact_match_score(completion: str, gold: str, timeout_s: float | None = None) -> float:
    """1.0 iff the completion equals the gold string after stripping outer whitespace."""
    del timeout_s
    return 1.0 if completion.strip() == gold.strip() else 0.0


def stripped_answer(completion: str, timeout_s: float | None = None) -> str | None:
    """The whole stripped completion as the answer key (exact-match tasks); None if empty."""
    del timeout_s
    return completion.strip() or None


# A written number: optional sign, digits with thousands commas, an optional decimal part.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(completion: str, timeout_s: float | None = None) -> str | None:
    """The last number written in the completion, without commas ("1,024" -> "1024"), or None."""
    del timeout_s
    found = _NUMBER.findall(completion)
    return found[-1].replace(",", "").rstrip(".") if found else None


def last_number_score(completion: str, gold: str, timeout_s: float | None = None) -> float:
    """1.0 iff the last number written in the completion equals the (numeric) gold answer.

    Stricter than `math` for short numeric answers: math-verify evaluates an expression, so a
    reply that writes "13 + 13 =" and never the sum scores as 26 there (a policy trained on it
    learns exactly that); here its last number is 13.
    """
    answer = last_number(completion)
    if answer is None:
        return 0.0
    try:
        return 1.0 if float(answer) == float(gold.replace(",", "").strip()) else 0.0
    except ValueError:
        return 0.0
