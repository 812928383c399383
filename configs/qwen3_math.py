"""Today's RL base model on the GVPO paper's recipe: Qwen3-1.7B-Base on MATH + GSM8K.

Needs real hardware and the weights on local disk (no hub access at run time):
    python -m gvpo_jax.main --config=configs/qwen3_math.py \
        --config.model.hf_dir=/path/to/Qwen3-1.7B-Base --config.data.path=/path/to/math_data \
        --workdir=gs://bucket/runs/qwen3_math
Planned for a TPU v5e-8 (8 chips x 16 GiB, FSDP) and for one 80 GB GPU by
    python -m gvpo_jax.plan --config=configs/qwen3_math.py --num_devices=8   (or 1)
(the tables are in the README). The recipe is configs/qwen_math.py's (the official GVPO script:
beta 0.1, k = 4, lr 1e-6, 1024 + 1024 tokens, updates of 256 prompts x 4 responses, verl's
prompt) on Qwen3's QK-norm architecture, with one change that a v5e-8 needs: a rollout samples
256 prompts (one update) instead of 1024 (four updates of 256), since every prompt of a rollout
keeps its 1024-token KV prefix (1024 prompts: 15 GiB per chip before any response token).
Responses are decoded in 256 continuous-batching slots. One 80 GB GPU:
    --config.optim.micro_batches=32 --config.rollout.num_slots=128 --config.train.eval_num_slots=128
"""

from configs import qwen_math


def get_config():
    c = qwen_math.get_config()
    c.model.preset = "qwen3-1.7b"  # shapes (Qwen3-1.7B and -Base share them); weights: hf_dir
    c.model.hf_dir = "/data/models/Qwen3-1.7B-Base"  # local Hugging Face directory (override it)
    c.model.logprob_chunk = 256  # log-prob blocks hold <= 256 x 151936 fp32 logits (156 MB)
    c.rollout.prompts_per_step = 256  # one update of 256 groups per rollout (see above)
    c.algo.num_minibatches = 1
    c.rollout.num_slots = 256  # continuous batching: 256 rows decode at a time
    c.train.eval_num_slots = 256
    # 256 groups in 8 micro-batches: 4 groups per micro-batch on each of 8 chips.
    c.optim.micro_batches = 8
    return c
