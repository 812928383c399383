"""Part 2b's base (STUDY.md "Part 2b"): configs/smollm2_arith.py (SmolLM2-135M-Instruct as
shipped) at the study's sizes, quiet (the study evaluates and checkpoints itself); `:quick` a
tiny random Llama with the character tokenizer on the same code path (no GGUF file needed).
Every arm of studies/smollm2/configs starts from it."""

from gvpo_jax import config as config_lib
from studies import arms

SMOL = {  # dotted config fields on configs/smollm2_arith.py (sized in STUDY.md "Part 2")
    "rollout.prompts_per_step": 16,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 32,
    "data.eval_size": 200,
    "train.eval_chunk": 40,
    # On this CPU an update over 16 rows at a time runs ~2x faster than over 64 at once (the
    # same gradient: accumulation is exact); the official regime's minibatches hold 16 rows.
    "optim.micro_batches": 4,
}


def get_config(arg=None):
    a = arms.parse(arg, quick=False)
    c = arms.quiet_config(config_lib.set_fields(arms.repo_config("smollm2_arith"),
                                                tuple(SMOL.items())))  # fmt: skip
    if a.quick:  # the same code path on a model the test can afford (no GGUF file needed)
        c.model.gguf = ""
        c.model.preset = "tiny"
        c.tokenizer.kind = "char"
        c.data.use_chat_template = False
        c.data.rewards = "exact_match:1"
        c.data.arith.style = "symbolic"
        c.data.max_prompt_len = 16
        c.rollout.prompts_per_step, c.rollout.max_new_tokens = 8, 4
        c.algo.overlong_cache = 2
        c.data.eval_size = 16
        c.train.eval_chunk = 8
    return c
