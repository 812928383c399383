"""Part 3 SmolLM2 arm: GRPO on rollouts k updates stale (`:k=4,tis`; each optional; tis: token
weights exp(old - behaviour) truncated at algo.rollout_is_cap).

    python -m studies.stale_smollm2.study --only grpo
    python -m gvpo_jax.main --config=studies/stale_smollm2/configs/grpo.py:k=4,tis --workdir=DIR
"""

from studies.stale_smollm2.configs import base


def get_config(arg=None):
    a, c = base.official(arg, tis=False)
    c.algo.name = "grpo"
    if a.tis:
        c.algo.rollout_correction = "token_tis"
    return c
