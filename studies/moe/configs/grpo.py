"""Part 4 arm: GRPO on the small MoE (`:replay=r3,setting=bf16`; each optional; replay:
none | r2 | r3, `algo.routing_replay`).

    python -m studies.moe.study --only "grpo"
    python -m gvpo_jax.main --config=studies/moe/configs/grpo.py:replay=r3 --workdir=DIR
"""

from studies.moe.configs import base


def get_config(arg=None):
    _, c = base.arm(arg)
    c.algo.name = "grpo"
    return c
