"""Named rewards and batch scoring: `REWARDS[name]`, `score_batch`, `extract_batch`.

A config names rewards and weights, e.g. `[("math", 1.0), ("format", 0.1)]`. The total reward of a
completion is the weighted sum; a reward that raises or times out scores 0 and is counted in `info`.
Rewards marked `isolated` (they parse arbitrary model text with sympy and can hang) run in the
worker pool when `num_workers > 0`, with a hard per-sample timeout; otherwise in this process with
the soft SIGALRM deadline (main thread only).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from gvpo_jax.rewards import verifiers
from gvpo_jax.rewards.pool import get_pool

ScoreFn = Callable[[str, str, "float | None"], float]
AnswerFn = Callable[[str, "float | None"], "str | None"]


@dataclasses.dataclass(frozen=True)
class Reward:
    """A named reward. `fn(completion, gold, timeout_s) -> float` may raise; calling the Reward
    itself, `reward(completion, gold)`, never does (errors and timeouts give 0.0).

    `answer(completion, timeout_s) -> str | None` gives the answer key that maj@k votes on.
    """

    name: str
    fn: ScoreFn
    answer: AnswerFn | None = None
    isolated: bool = False
    default_timeout_s: float = 5.0

    def __call__(self, completion: str, gold: str) -> float:
        try:
            value = float(self.fn(completion, gold, self.default_timeout_s))
        except (Exception, verifiers.RewardTimeout):
            return 0.0
        return value if math.isfinite(value) else 0.0


REWARDS: dict[str, Reward] = {}


def register(reward: Reward) -> Reward:
    """Adds a reward to REWARDS (new name); returns it. Workers see the ones made at import."""
    if reward.name in REWARDS:
        raise ValueError(f"reward {reward.name!r} is already registered.")
    REWARDS[reward.name] = reward
    return reward


register(Reward("math", verifiers.math_score, verifiers.math_answer, isolated=True))
register(Reward("format", verifiers.format_score))
register(Reward("think_format", verifiers.think_format_score))
register(Reward("exact_match", verifiers.exact_match_score, verifiers.stripped_answer))


def _lookup(name: str) -> Reward:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {', '.join(REWARDS)}.")
    return REWARDS[name]


def _run_score(name: str, completion: str, gold: str) -> float:
    """Worker-side task: the hard timeout of the pool replaces the soft one."""
    return float(REWARDS[name].fn(completion, gold, None))


def _run_answer(name: str, completion: str) -> str | None:
    return REWARDS[name].answer(completion, None)


def _run_inline(fn: Callable, args: tuple) -> tuple[str, object]:
    try:
        return "ok", fn(*args)
    except verifiers.RewardTimeout:
        return "timeout", None
    except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
        return "error", f"{type(e).__name__}: {e}"


def _inline_with_deadline(inline_fn, args, timeout_s) -> tuple[str, object]:
    """Any in-process reward gets the soft deadline, not only the ones that set their own."""
    try:
        with verifiers.soft_deadline(timeout_s):
            return inline_fn(args)
    except verifiers.RewardTimeout:
        return "timeout", None


def _run_tasks(reward: Reward, worker_fn, inline_fn, args_list, timeout_s, num_workers):
    if reward.isolated and num_workers > 0:
        return get_pool(num_workers).map(worker_fn, args_list, timeout_s=timeout_s)
    return [_inline_with_deadline(inline_fn, args, timeout_s) for args in args_list]


def score_batch(
    completions: Sequence[str],
    golds: Sequence[str],
    *,
    reward_specs: Sequence[tuple[str, float]] = (("math", 1.0),),
    timeout_s: float = 5.0,
    num_workers: int = 0,
    response_lens: Sequence[int] | np.ndarray | None = None,
    overlong: tuple[int, int, float] | None = None,
) -> tuple[np.ndarray, dict]:
    """Weighted sum of the named rewards for each (completion, gold) pair.

    Returns `(scores_B, info)`: scores float32 [B]; info = {"timeouts": int, "errors": int,
    "components": {name: float32 [B] unweighted}, "overlong": float32 [B] (if used)}.
    `overlong=(max_len, cache_len, factor)` adds DAPO's soft overlong penalty
    (`gvpo_jax.losses.overlong_penalty`) computed from `response_lens` (tokens).
    """
    B = len(completions)
    if len(golds) != B:
        raise ValueError(f"{B} completions but {len(golds)} gold answers; they must pair up.")
    total_B = np.zeros(B, np.float64)
    info: dict = {"timeouts": 0, "errors": 0, "components": {}}
    for name, weight in reward_specs:
        reward = _lookup(name)
        args_list = [(name, c, g) for c, g in zip(completions, golds, strict=True)]
        outcomes = _run_tasks(
            reward,
            _run_score,
            lambda a, fn=reward.fn: _run_inline(fn, (a[1], a[2], timeout_s)),
            args_list,
            timeout_s,
            num_workers,
        )
        values_B = np.zeros(B, np.float64)
        for b, (status, value) in enumerate(outcomes):
            if status == "ok" and isinstance(value, (int, float)) and math.isfinite(value):
                values_B[b] = value
            elif status == "timeout":
                info["timeouts"] += 1
            else:
                info["errors"] += 1
        info["components"][name] = values_B.astype(np.float32)
        total_B += weight * values_B
    if overlong is not None:
        if response_lens is None:
            raise ValueError("overlong=(max_len, cache_len, factor) needs response_lens.")
        from gvpo_jax import losses  # lazy: keeps jax out of the reward workers

        max_len, cache_len, factor = overlong
        penalty_B = np.asarray(
            losses.overlong_penalty(
                np.asarray(response_lens), max_len=max_len, cache_len=cache_len, factor=factor
            ),
            np.float64,
        )
        info["overlong"] = penalty_B.astype(np.float32)
        total_B += penalty_B
    return total_B.astype(np.float32), info


def extract_batch(
    completions: Sequence[str], *, reward: str, timeout_s: float = 5.0, num_workers: int = 0
) -> tuple[list[str | None], dict]:
    """The answer key of each completion under `REWARDS[reward].answer` (None: no answer).

    Returns `(answers, info)` with info = {"timeouts": int, "errors": int}; failures give None.
    """
    r = _lookup(reward)
    if r.answer is None:
        raise ValueError(f"reward {reward!r} has no answer extractor; majority voting needs one.")
    outcomes = _run_tasks(
        r,
        _run_answer,
        lambda a, fn=r.answer: _run_inline(fn, (a[1], timeout_s)),
        [(reward, c) for c in completions],
        timeout_s,
        num_workers,
    )
    answers = [value if status == "ok" else None for status, value in outcomes]
    info = {
        "timeouts": sum(status == "timeout" for status, _ in outcomes),
        "errors": sum(status == "error" for status, _ in outcomes),
    }
    return answers, info
