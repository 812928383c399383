"""Part 4's base (STUDY.md "Part 4"): configs/moe_arith.py (a 3-layer, 8-expert, top-2
Qwen3-MoE trained from scratch: SFT, then RL), quiet, with several updates per rollout (4
minibatches x 1 epoch: the regime where ratios matter) and the sampler in bf16 while the update
and its log-prob passes stay in fp32 (`rollout.compute_dtype`: the engine / trainer split that
makes the sampler's routing and log-probs differ from the update's); `:quick` the smoke-test
sizes. Every arm of studies/moe/configs starts from it and sets its routing replay."""

from gvpo_jax import config as config_lib
from studies import arms

QUICK = (  # the smoke test's sizes (studies/toy/configs/base.py's): the code paths, not the model
    ("model.overrides.num_layers", 1),
    ("rollout.prompts_per_step", 8),
    ("rollout.group_size", 4),
    ("data.eval_size", 16),
    ("sft.steps", 20),
    ("sft.batch_size", 16),
)
# The pilot's ladder (`studies.moe.study --pilot`): the first setting in which at least 1% of
# the (token, layer) routings drift between sampling and update without replay is the study's.
SETTINGS = {
    "bf16": {},  # bf16 sampling, 4 minibatches x 1 epoch, the recipe's lr 1e-4
    "bf16-lr3e-4": {"optim.lr": 3e-4},
    "bf16-lr3e-4-2ep": {"optim.lr": 3e-4, "algo.num_epochs": 2},
}


def get_config(arg=None):
    a = arms.parse(arg, quick=False, setting="bf16")
    return moe_recipe(a.quick, a.setting)


def moe_recipe(quick: bool = False, setting: str = "bf16"):
    c = arms.quiet_config(arms.repo_config("moe_arith"))
    arms.set_regime(c, "4mbx1ep")
    c.rollout.compute_dtype = "bfloat16"
    c = config_lib.set_fields(c, SETTINGS[setting])
    return config_lib.set_fields(c, QUICK) if quick else c


def arm(arg, **defaults):
    """(parsed argument, the base at its setting with `replay`): the arms' common part."""
    a = arms.parse(arg, quick=False, setting="bf16", replay="none", **defaults)
    c = moe_recipe(a.quick, a.setting)
    c.algo.routing_replay = a.replay
    return a, c
