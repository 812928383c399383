"""Toy study arm: GRPO (`:regime=4mbx2ep,lr=3,nokl`; each optional; nokl: no KL penalty).

python -m studies.toy.study --only nokl
python -m gvpo_jax.main --config=studies/toy/configs/grpo.py:regime=4mbx2ep,nokl --workdir=DIR
"""

from studies import arms
from studies.toy.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on", lr=1, nokl=False)
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "grpo"
    arms.set_regime(c, a.regime)
    c.optim.lr = c.optim.lr * a.lr
    if a.nokl:
        c.algo.kl_coef = 0.0
    return c
