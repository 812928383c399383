"""Part 3 arm: GVPO on rollouts k updates stale (`:k=4,anchor=sampler,noclip`; each optional;
anchor sampler: pi_theta' is the policy that sampled; noclip: no gradient-norm clip).

    python -m studies.stale.study --only gvpo
    python -m gvpo_jax.main --config=studies/stale/configs/gvpo.py:k=4 --workdir=DIR
"""

from studies.stale.configs import base


def get_config(arg=None):
    a, c = base.official(arg, anchor="old", noclip=False)
    c.algo.name = "gvpo"
    c.algo.anchor = a.anchor
    if a.noclip:
        c.optim.grad_clip = 0.0
    return c
