"""Verifiable rewards: math correctness (math-verify), format, exact match; batch scoring.

from gvpo_jax import rewards
rewards.math_reward("... so the answer is \\boxed{\\frac12}", "0.5")        # -> 1.0
scores_B, info = rewards.score_batch(completions, golds,
    reward_specs=[("math", 1.0), ("format", 0.1)], timeout_s=5.0, num_workers=2)
"""

from gvpo_jax.rewards.extract import (
    boxed_spans,
    gsm8k_final_answer,
    last_boxed,
    strip_calculator_annotations,
)
from gvpo_jax.rewards.pool import WorkerPool, close_pools, get_pool
from gvpo_jax.rewards.registry import REWARDS, Reward, extract_batch, register, score_batch
from gvpo_jax.rewards.verifiers import RewardTimeout, math_answer, math_reward, math_score

__all__ = [
    "REWARDS",
    "Reward",
    "RewardTimeout",
    "WorkerPool",
    "boxed_spans",
    "close_pools",
    "extract_batch",
    "get_pool",
    "gsm8k_final_answer",
    "last_boxed",
    "math_answer",
    "math_reward",
    "math_score",
    "register",
    "score_batch",
    "strip_calculator_annotations",
]
