"""Toy study arm: DAPO (`:regime=4mbx2ep`; optional), one of part 1's on-policy baselines.

python -m studies.toy.study --only baselines
"""

from studies import arms
from studies.toy.configs import base


def get_config(arg=None):
    a = arms.parse(arg, quick=False, regime="on")
    c = base.get_config("quick" if a.quick else None)
    c.algo.name = "dapo"
    arms.set_regime(c, a.regime)
    return c
