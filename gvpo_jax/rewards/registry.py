"""Named rewards and batch scoring: `REWARDS[name]`, `parse_specs`, `score_batch`, `extract_batch`.

A config names rewards and weights, e.g. "math:1,format:0.1". The total reward of a completion is
the weighted sum; a reward that raises, times out or is refused scores 0 and is counted in `info`.
Rewards marked `isolated` (they evaluate arbitrary model text with sympy, which can run for ever
in one C call) run in the worker pool, whose timeout is hard (the worker is killed); by default
(`num_workers=AUTO_WORKERS`) the pool has one worker per core, at most 8. `num_workers=0` scores
them in this process with only the soft SIGALRM deadline and the guard: for debugging, since an
explosive answer the guard misses then stalls the caller. The other rewards (exact match,
format) do no symbolic evaluation and always run in this process.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from gvpo_jax.rewards import verifiers
from gvpo_jax.rewards.pool import get_pool

AUTO_WORKERS = -1  # num_workers value meaning "one per core, at most MAX_AUTO_WORKERS"
MAX_AUTO_WORKERS = 8  # ~1 s for 1024 math answers; more mostly adds idle interpreters

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
register(Reward("last_number", verifiers.last_number_score, verifiers.last_number))


def _lookup(name: str) -> Reward:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {', '.join(REWARDS)}.")
    return REWARDS[name]


def parse_specs(text: str) -> list[tuple[str, float]]:
    """ "math:1,format:0.1" -> [("math", 1.0), ("format", 0.1)]; a name without weight weighs 1.

    Raises ValueError, one sentence naming the registered rewards, for an unknown name, a weight
    that is not a finite number, or a text that names no reward.
    """
    registered = f"registered rewards: {', '.join(REWARDS)}"
    specs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = (x.strip() for x in part.partition(":"))
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r}; {registered}.")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(
                f"the weight {weight!r} of {name} is not a finite number; write name:weight pairs "
                f"such as math:1,format:0.1 ({registered})."
            )
        specs.append((name, value))
    if not specs:
        raise ValueError(f"no reward is named; write name:weight pairs ({registered}).")
    return specs


def default_workers() -> int:
    """The worker count AUTO_WORKERS stands for: the cores this process may use, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_WORKERS))


def resolve_workers(num_workers: int) -> int:
    """num_workers with AUTO_WORKERS replaced by `default_workers()`."""
    if num_workers == AUTO_WORKERS:
        return default_workers()
    if num_workers < 0:
        raise ValueError(f"num_workers is {num_workers}; use {AUTO_WORKERS} (auto), 0 or more.")
    return num_workers


def _run_inline(fn: Callable, args: tuple) -> tuple[str, object]:
    """(status, value): ok / refused (the guard) / timeout (soft deadline) / error (raised)."""
    try:
        return "ok", fn(*args)
    except verifiers.RewardRefused as e:
        return "refused", str(e)
    except verifiers.RewardTimeout:
        return "timeout", None
    except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
        return "error", f"{type(e).__name__}: {e}"


def _run_score(name: str, completion: str, gold: str) -> tuple[str, object]:
    """Worker-side task: the hard timeout of the pool replaces the soft one."""
    return _run_inline(REWARDS[name].fn, (completion, gold, None))


def _run_answer(name: str, completion: str) -> tuple[str, object]:
    return _run_inline(REWARDS[name].answer, (completion, None))


def _inline_with_deadline(inline_fn, args, timeout_s) -> tuple[str, object]:
    """Any in-process reward gets the soft deadline, not only the ones that set their own."""
    try:
        with verifiers.soft_deadline(timeout_s):
            return inline_fn(args)
    except verifiers.RewardTimeout:
        return "timeout", None


def _run_tasks(reward: Reward, worker_fn, inline_fn, args_list, timeout_s, num_workers):
    """(status, value) per task; worker tasks classify their own outcome (see _run_inline),
    the pool adds "timeout" (killed) and "error" (the worker died)."""
    num_workers = resolve_workers(num_workers)
    if reward.isolated and num_workers > 0:
        outcomes = get_pool(num_workers).map(worker_fn, args_list, timeout_s=timeout_s)
        return [value if status == "ok" else (status, value) for status, value in outcomes]
    return [_inline_with_deadline(inline_fn, args, timeout_s) for args in args_list]


def _count(statuses: Sequence[str], info: dict) -> dict:
    """Adds the numbers of timeouts, errors and refusals among `statuses` to `info`.

    A refused answer also counts as a timeout: the guard refuses what could not be evaluated in
    time, so `timeouts` means "not scored in time" whichever layer stopped it.
    """
    counts = {
        "timeouts": statuses.count("timeout") + statuses.count("refused"),
        "errors": statuses.count("error"),
        "refused": statuses.count("refused"),
    }
    for key, n in counts.items():
        info[key] = info.get(key, 0) + n
    return info


def score_batch(
    completions: Sequence[str],
    golds: Sequence[str],
    *,
    reward_specs: Sequence[tuple[str, float]] = (("math", 1.0),),
    timeout_s: float = 5.0,
    num_workers: int = AUTO_WORKERS,
    response_lens: Sequence[int] | np.ndarray | None = None,
    overlong: tuple[int, int, float] | None = None,
) -> tuple[np.ndarray, dict]:
    """Weighted sum of the named rewards for each (completion, gold) pair.

    Returns `(scores_B, info)`: scores float32 [B]; info = {"timeouts": int, "errors": int,
    "refused": int (answers the guard would not evaluate, included in timeouts), "components":
    {name: float32 [B] unweighted}, "overlong": float32 [B] (if used)}. `num_workers`: see the
    module docstring. `overlong=(max_len, cache_len, factor)` adds DAPO's soft overlong penalty
    (`overlong_penalty`) computed from `response_lens` (tokens).
    """
    B = len(completions)
    if len(golds) != B:
        raise ValueError(f"{B} completions but {len(golds)} gold answers; they must pair up.")
    total_B = np.zeros(B, np.float64)
    info: dict = {"timeouts": 0, "errors": 0, "refused": 0, "components": {}}
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
        statuses = []
        for b, (status, value) in enumerate(outcomes):
            if status == "ok" and not (isinstance(value, (int, float)) and math.isfinite(value)):
                status = "error"  # a reward must return a finite number
            if status == "ok":
                values_B[b] = value
            statuses.append(status)
        _count(statuses, info)
        info["components"][name] = values_B.astype(np.float32)
        total_B += weight * values_B
    if overlong is not None:
        if response_lens is None:
            raise ValueError("overlong=(max_len, cache_len, factor) needs response_lens.")
        max_len, cache_len, factor = overlong
        penalty_B = overlong_penalty(
            response_lens, max_len=max_len, cache_len=cache_len, factor=factor
        ).astype(np.float64)
        info["overlong"] = penalty_B.astype(np.float32)
        total_B += penalty_B
    return total_B.astype(np.float32), info


def overlong_penalty(lengths_B, *, max_len: int, cache_len: int, factor: float = 1.0):
    """DAPO's soft overlong punishment on the host, float32 [B] (<= 0), added to the reward: 0
    up to max_len - cache_len tokens, then a ramp to -1 at max_len, -1 beyond; times `factor`.

    The numpy twin of `gvpo_jax.losses.overlong_penalty` (the loss library's, for JAX users),
    with the same float32 values up to the rounding of the division (tested), so the trainer's
    host code needs no jax."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"`cache_len`={cache_len} must be in (0, `max_len`={max_len}].")
    L_B = np.asarray(lengths_B).astype(np.float32)
    start = max_len - cache_len
    ramp_B = -(L_B - start) / cache_len
    penalty_B = np.where(L_B <= start, 0.0, np.where(L_B <= max_len, ramp_B, -1.0))
    return (factor * penalty_B).astype(np.float32)


def extract_batch(
    completions: Sequence[str],
    *,
    reward: str,
    timeout_s: float = 5.0,
    num_workers: int = AUTO_WORKERS,
) -> tuple[list[str | None], dict]:
    """The answer key of each completion under `REWARDS[reward].answer` (None: no answer).

    Returns `(answers, info)` with info = {"timeouts": int, "errors": int, "refused": int}
    (refusals are included in timeouts); failures give None.
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
    return answers, _count([status for status, _ in outcomes], {})
