"""Toy study arm: GSPO (`:regime=4mbx2ep`; optional).

python -m studies.toy.study --only baselines,offpolicy
"""

from studies import arms
from studies.toy.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on")
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "gspo"
    arms.set_regime(c, a.regime)
    return c
