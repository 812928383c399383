"""Toy study arm: GVPO (`:regime=4mbx2ep,lr=3,beta=0.2,replay=0.5,anchor=ref`; each optional).

    python -m studies.toy.study --only offpolicy       # its cells, at the study's budget
    python -m gvpo_jax.main --config=studies/toy/configs/gvpo.py:regime=4mbx2ep --workdir=DIR

regime: minibatches x epochs per rollout (studies/arms.py REGIMES); lr: a multiple of the base's
learning rate; beta: GVPO's KL strength; replay: share of each update batch from the replay
buffer; anchor: pi_theta' (old | ref).
"""

from studies import arms
from studies.toy.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on", lr=1, beta=0.1, replay=0.0, anchor="old")
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "gvpo"
    arms.set_regime(c, a.regime)
    c.optim.lr = c.optim.lr * a.lr
    c.algo.beta = a.beta
    c.algo.replay_fraction = a.replay
    c.algo.anchor = a.anchor
    return c
