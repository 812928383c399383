"""Part 3 arm: Dr. GRPO on rollouts k updates stale (`:k=4,tis`; each optional; tis: token weights
exp(old - behaviour) truncated at algo.rollout_is_cap, `algo.rollout_correction=token_tis`).

    python -m studies.stale.study --only dr_grpo
    python -m gvpo_jax.main --config=studies/stale/configs/dr_grpo.py:k=4,tis --workdir=DIR
"""

from studies.stale.configs import base


def get_config(arg=None):
    a, c = base.official(arg, tis=False)
    c.algo.name = "dr_grpo"
    if a.tis:
        c.algo.rollout_correction = "token_tis"
    return c
