"""The built-in default: a tiny from-scratch Qwen2-architecture model learns arithmetic with GVPO.

Run (from a fresh clone, sets everything up):   make demo
or, with the environment installed:
    python -m gvpo_jax.main --config=configs/arith_tiny.py --workdir=runs/arith_tiny

A character-level tokenizer is built in code and saved in the workdir; problems like "13+7=" are
generated on the fly with a fixed held-out set. A short cold-start SFT phase lifts the random model
off zero reward, then GVPO (beta 0.1, k = 8, anchor = rollout policy) trains on exact-match reward.
Expect on a 2-core CPU: a few minutes in all; the end prints held-out accuracy before SFT (~0),
after SFT / at the start of RL, and at the end, writes metrics.jsonl, curves.png, a checkpoint and
the exported Hugging Face directory (see README for the measured numbers).
"""

from gvpo_jax.config import base_config


def get_config():
    c = base_config()
    c.seed = 0

    # A ~0.6M-parameter Qwen2-architecture decoder; vocab_size comes from the tokenizer.
    c.model.overrides.architecture = "qwen2"  # q/k/v bias, RoPE, RMSNorm, SwiGLU
    c.model.overrides.hidden_size = 128  # model width D
    c.model.overrides.num_layers = 3  # decoder blocks
    c.model.overrides.num_heads = 4  # query heads
    c.model.overrides.num_kv_heads = 2  # grouped-query attention: 2 key/value heads
    c.model.overrides.head_dim = 32  # per-head width
    c.model.overrides.intermediate_size = 384  # SwiGLU hidden width
    c.model.overrides.tie_word_embeddings = True  # output layer shares the embedding
    c.model.overrides.max_position_embeddings = 64  # longest prompt + response
    c.model.logprob_chunk = 32  # sequence chunk of the token log-probs

    c.tokenizer.kind = "char"  # built in code, saved to <workdir>/tokenizer

    c.data.task = "arith"  # synthetic problems "a+b=" / "a-b=" with integer answers
    c.data.arith.max_operand = 30  # operands in [0, 30]
    c.data.arith.ops = "+-"  # addition and subtraction
    c.data.max_prompt_len = 8  # "<bos>30+30=" fits
    c.data.eval_size = 200  # held-out problems, disjoint from training

    c.rollout.prompts_per_step = 32  # P
    c.rollout.group_size = 8  # G (k)
    c.rollout.max_new_tokens = 5  # answers of <= 3 characters + EOS, with one spare slot
    c.rollout.temperature = 1.0  # sample the policy as it is

    c.algo.name = "gvpo"  # --config.algo.name=grpo|dr_grpo|dapo|gspo|gspo_token for baselines
    c.algo.beta = 0.1  # GVPO's beta (the official script's value)
    c.algo.anchor = "old"  # pi_theta' = the rollout policy
    c.algo.overlong_cache = 2  # DAPO overlong window when algo.name=dapo

    c.optim.lr = 1e-5  # RL learning rate (AdamW); 1e-4 and up undoes the SFT (measured)
    c.optim.warmup_steps = 5  # linear warm-up updates
    c.optim.grad_clip = 1.0  # global norm clip

    c.sft.steps = 600  # cold-start SFT steps (cross-entropy on prompt -> answer)
    c.sft.batch_size = 64  # SFT pairs per step
    c.sft.lr = 1e-3  # SFT peak learning rate (cosine decay)
    c.sft.warmup_steps = 10

    c.train.steps = 100  # RL steps
    c.train.eval_every = 25  # held-out greedy accuracy every 25 steps
    c.train.sample_log_every = 10  # log a few completions as text
    c.train.checkpoint_every = 50  # checkpoint every 50 RL steps (and at the end)
    return c
