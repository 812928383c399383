"""Part 3 SmolLM2 arm: GVPO on rollouts k updates stale (`:k=4`; optional).

python -m studies.stale_smollm2.study --only gvpo
python -m gvpo_jax.main --config=studies/stale_smollm2/configs/gvpo.py:k=4 --workdir=DIR
"""

from studies.stale_smollm2.configs import base


def get_config(arg=None):
    _, c = base.official(arg)
    c.algo.name = "gvpo"
    return c
