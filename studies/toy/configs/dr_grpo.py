"""Toy study arm: Dr. GRPO (`:regime=4mbx2ep,eps=1000.0`; each optional; eps: the ratio clip's
range on both sides, 1e3 so wide that it never acts).

    python -m studies.toy.study --only noclip
    python -m gvpo_jax.main --config=studies/toy/configs/dr_grpo.py:regime=4mbx2ep --workdir=DIR
"""

from studies import arms
from studies.toy.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on", eps=None)
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "dr_grpo"
    arms.set_regime(c, a.regime)
    if a.eps is not None:
        c.algo.eps_low = c.algo.eps_high = float(a.eps)
    return c
