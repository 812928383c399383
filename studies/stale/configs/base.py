"""Part 3's base (STUDY.md "Part 3"): the demo recipe (configs/arith_tiny.py, quiet) in the
official regime, 4 minibatches x 1 epoch per rollout; `:quick` the toy study's smoke-test sizes.
Every arm of studies/stale/configs starts from it and sets the staleness k."""

from studies import arms
from studies.toy.configs.base import demo_recipe


def get_config(arg=None):
    a = arms.parse(arg, quick=False)
    return demo_recipe(a.quick)


def official(arg, **defaults):
    """(parsed argument, the base in the official regime at staleness k): the arms' common part.
    `lr=3e-5` replaces the recipe's learning rate and `epochs=4` passes over each rollout's 4
    minibatches that many times (part 3b); unset, neither changes the config."""
    a = arms.parse(arg, quick=False, k=0, lr=0.0, epochs=1, **defaults)
    c = demo_recipe(a.quick)
    arms.set_regime(c, "4mbx1ep")
    c.rollout.staleness = a.k
    if a.lr:
        c.optim.lr = a.lr
    c.algo.num_epochs = a.epochs
    return a, c
