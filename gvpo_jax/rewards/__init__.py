"""Verifiable rewards: math correctness (math-verify), format, exact match; batch scoring.

from gvpo_jax import rewards
rewards.math_reward("... so the answer is \\boxed{\\frac12}", "0.5")        # -> 1.0
scores_B, info = rewards.score_batch(completions, golds,
    reward_specs=rewards.parse_specs("math:1,format:0.1"), timeout_s=5.0)  # pool: one per core
"""

from gvpo_jax.rewards.extract import (
    boxed_spans,
    gsm8k_final_answer,
    last_boxed,
    strip_calculator_annotations,
)
from gvpo_jax.rewards.pool import WorkerPool, close_pools, get_pool
from gvpo_jax.rewards.registry import (
    AUTO_WORKERS,
    REWARDS,
    Reward,
    default_workers,
    extract_batch,
    overlong_penalty,
    parse_specs,
    register,
    score_batch,
)
from gvpo_jax.rewards.verifiers import (
    RewardRefused,
    RewardTimeout,
    math_answer,
    math_reward,
    math_score,
)

__all__ = [
    "AUTO_WORKERS",
    "REWARDS",
    "Reward",
    "RewardRefused",
    "RewardTimeout",
    "WorkerPool",
    "boxed_spans",
    "close_pools",
    "default_workers",
    "extract_batch",
    "get_pool",
    "gsm8k_final_answer",
    "last_boxed",
    "math_answer",
    "math_reward",
    "math_score",
    "overlong_penalty",
    "parse_specs",
    "register",
    "score_batch",
    "strip_calculator_annotations",
]
