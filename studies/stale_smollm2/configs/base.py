"""Part 3 on SmolLM2's base (STUDY.md "Part 3 on SmolLM2-135M-Instruct"): part 2b's base
(studies/smollm2/configs/base.py) with replies that end: the `brief_boxed` prompt and a cap of
CAP new tokens (`:template=plain,cap=32`: a `--calibrate` candidate instead); `:quick` part 2b's
tiny random Llama. Every arm of studies/stale_smollm2/configs starts from it."""

from gvpo_jax import config as config_lib
from studies import arms
from studies.smollm2.configs import base as smollm2

# New tokens in training and evaluation: `--calibrate` measured 7.3% of the start's sampled
# replies reaching 128 with `brief_boxed` (9.8% at 96, a margin too thin; 90% at part 2b's 32).
CAP = 128
SETTINGS = {  # dotted config fields on top of part 2b's sizes
    "data.template": "brief_boxed",
    "data.max_prompt_len": 96,
    "rollout.max_new_tokens": CAP,
    "algo.overlong_cache": 8,
    # Speed only (the same samples and gradients): a decode that sheds ended rows, updates cut
    # to their replies' lengths, evaluation with refilled decode slots.
    "rollout.shed": 2,
    "optim.length_buckets": 4,
    "optim.pack_groups": True,
    "train.eval_num_slots": 80,
}


def get_config(arg=None):
    a = arms.parse(arg, quick=False, template="", cap=0)
    c = smollm2.get_config("quick" if a.quick else None)
    if a.quick:  # the tiny random model's shapes; the same code path
        settings = {k: v for k, v in SETTINGS.items() if k.startswith(("rollout.shed", "optim."))}
        settings["train.eval_num_slots"] = 8
    else:
        settings = dict(SETTINGS)
        if a.template:
            settings["data.template"], settings["rollout.max_new_tokens"] = a.template, a.cap
    config_lib.set_fields(c, tuple(settings.items()))
    config_lib.validate(c)
    return c


def official(arg, **defaults):
    """(parsed argument, the base in the official regime at staleness k): the arms' common part."""
    a = arms.parse(arg, quick=False, k=0, **defaults)
    c = get_config("quick" if a.quick else None)
    arms.set_regime(c, "4mbx1ep")
    c.optim.micro_batches = 1  # a minibatch is 4 groups = 16 rows
    c.rollout.staleness = a.k
    return a, c
