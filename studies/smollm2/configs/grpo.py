"""Part 2b arm: GRPO on SmolLM2-135M-Instruct (`:regime=4mbx1ep`; optional).

python -m studies.smollm2.study --only grpo
python -m gvpo_jax.main --config=studies/smollm2/configs/grpo.py:regime=4mbx1ep --workdir=DIR
"""

from studies import arms
from studies.smollm2.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on")
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "grpo"
    arms.set_regime(c, a.regime)
    if a.regime != "on":
        c.optim.micro_batches = 1  # a minibatch is 4 groups = 16 rows
    return c
