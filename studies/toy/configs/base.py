"""The toy-task study's base (STUDY.md "Set-up shared by every experiment"): configs/arith_tiny.py
as it was when the study ran (`FIRST_SETUP`: +/- with operands 0-30, P = 32 x G = 8, lr 1e-5),
quiet (the study evaluates and checkpoints itself); `:quick` a 1-layer model at P = 8 x G = 4.
Every arm of studies/toy/configs starts from it. `demo_recipe` is configs/arith_tiny.py as it
is now, quiet: the demo recipe search's and part 3's base."""

from gvpo_jax import config as config_lib
from studies import arms

QUICK = (
    ("model.overrides.num_layers", 1),  # the code paths, not the model: compile time is per layer
    ("rollout.prompts_per_step", 8),
    ("rollout.group_size", 4),
    ("data.eval_size", 16),
    ("sft.steps", 20),
    ("sft.batch_size", 16),
)

# The study's task and RL settings: configs/arith_tiny.py as it was when the study ran; the
# config has since become the demo recipe (addition 0-99, P = 128 x G = 4, lr 1e-4).
FIRST_SETUP = (
    ("data.arith.max_operand", 30),
    ("data.arith.ops", "+-"),
    ("rollout.prompts_per_step", 32),
    ("rollout.group_size", 8),
    ("optim.lr", 1e-5),
    ("optim.warmup_steps", 5),
)


def demo_recipe(quick: bool = False):
    """configs/arith_tiny.py without export, plots, periodic checkpoints or evaluations."""
    c = arms.quiet_config(arms.repo_config("arith_tiny"))
    return config_lib.set_fields(c, QUICK) if quick else c


def get_config(arg=None):
    a = arms.parse(arg, quick=False)
    c = config_lib.set_fields(demo_recipe(), FIRST_SETUP)
    return config_lib.set_fields(c, QUICK) if a.quick else c
