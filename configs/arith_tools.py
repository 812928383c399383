"""Tools in the rollout: the demo's tiny from-scratch model learns to multiply 3-digit numbers
with a calculator it calls, which it cannot do in its head.

    python -m gvpo_jax.main --config=configs/arith_tools.py --workdir=runs/arith_tools

Problems "417*286=" (operands in [0, 999]: a million problems, 200 held out). The policy calls
the calculator in the bracket format: it writes "[417*286]", its row stops at "]", the host
computes the product exactly and the policy reads "=119262 " (tokens it sees but is never
trained on), then writes its answer "119262" and EOS; the task scores that last turn. SFT
shows the call on 30% of its demonstrations (`sft.tool_demos`) and the bare answer on the
rest, so the start calls the tool on some problems and guesses on the others; GVPO then raises
the share of calls and held-out accuracy. docs/tools.md; the record in STUDY.md ("Tools").
"""

from gvpo_jax.config import base_config


def get_config():
    c = base_config()
    c.seed = 0

    # The demo's ~0.6M-parameter Qwen2-architecture decoder.
    c.model.overrides.architecture = "qwen2"
    c.model.overrides.hidden_size = 128
    c.model.overrides.num_layers = 3
    c.model.overrides.num_heads = 4
    c.model.overrides.num_kv_heads = 2
    c.model.overrides.head_dim = 32
    c.model.overrides.intermediate_size = 384
    c.model.overrides.tie_word_embeddings = True
    c.model.overrides.max_position_embeddings = 64
    c.model.logprob_chunk = 32

    c.tokenizer.kind = "char"  # with "[" and "]" for the calls

    c.data.task = "arith"
    c.data.arith.max_operand = 999  # 3-digit operands: products of up to 6 digits
    c.data.arith.ops = "*"
    c.data.max_prompt_len = 10  # "<bos>999*999="
    c.data.eval_size = 200

    c.tools.names = "calculator"
    c.tools.format = "bracket"  # "[417*286]" -> "=119262 "
    c.tools.max_turns = 2  # one call is all a problem needs; a second is allowed
    c.tools.max_tokens = 10  # "=998001 " and room to spare

    c.rollout.prompts_per_step = 64
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 28  # "[999*999]" + "=998001 " + "998001" + EOS = 24 tokens
    c.rollout.temperature = 1.0

    c.algo.name = "gvpo"
    c.algo.beta = 0.1
    c.algo.anchor = "old"

    c.optim.lr = 1e-4
    c.optim.warmup_steps = 10
    c.optim.grad_clip = 1.0

    c.sft.steps = 600
    c.sft.batch_size = 64
    c.sft.lr = 1e-3
    c.sft.warmup_steps = 10
    c.sft.tool_demos = 0.3  # demonstrations that call the calculator

    c.train.steps = 100
    c.train.eval_every = 25
    c.train.eval_samples = 8
    c.train.sample_log_every = 25
    c.train.checkpoint_every = 50
    return c
