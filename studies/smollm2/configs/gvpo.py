"""Part 2b arm: GVPO on SmolLM2-135M-Instruct (`:regime=4mbx1ep,beta=0.2`; each optional).

    python -m studies.smollm2.study --only gvpo
    python -m gvpo_jax.main --config=studies/smollm2/configs/gvpo.py:regime=4mbx1ep --workdir=DIR

regime "4mbx1ep" is the official GVPO recipe's (4 minibatches x 1 epoch per rollout; a minibatch
is 4 groups = 16 rows, so one micro-batch); "on" one update per rollout.
"""

from studies import arms
from studies.smollm2.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on", beta=0.1)
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "gvpo"
    c.algo.beta = a.beta
    arms.set_regime(c, a.regime)
    if a.regime != "on":
        c.optim.micro_batches = 1
    return c
