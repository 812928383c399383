"""The GVPO paper's setting: Qwen2.5-Math-7B on MATH + GSM8K, for a TPU pod slice or GPU node.

Needs real hardware and the weights on local disk (no hub access at run time):
    python -m gvpo_jax.main --config=configs/qwen_math.py \
        --config.model.hf_dir=/path/to/Qwen2.5-Math-7B --config.data.path=/path/to/math_data \
        --workdir=gs://bucket/runs/qwen_math
On a pod slice run the same command on every worker (launch/tpu_pod.sh does that).
Settings follow the official GVPO script: beta 0.1, k = 4 responses per prompt, lr 1e-6, prompts
and responses up to 1024 tokens, 1024 prompts per rollout split into 4 minibatches, verl's prompts.
Here (CPU only) it is checked by validation with paths skipped and `jax.eval_shape` of the model.
"""

from gvpo_jax.config import base_config


def get_config():
    c = base_config()
    c.seed = 0
    c.model.preset = "qwen2.5-math-7b"  # shapes; the weights come from hf_dir
    c.model.hf_dir = "/data/models/Qwen2.5-Math-7B"  # local Hugging Face directory (override it)
    c.model.param_dtype = "float32"  # fp32 master weights and Adam moments (the official recipe)
    c.model.compute_dtype = "bfloat16"  # forward, backward, sampler and log-probs in bf16
    c.model.remat = True  # recompute activations per layer in the backward pass
    c.model.logprob_chunk = 256  # log-prob blocks hold <= 256 x 152064 fp32 logits (156 MB)

    c.tokenizer.kind = "model"  # the checkpoint's own tokenizer (hf_dir)

    c.data.task = "math"  # MATH (lighteval split) + GSM8K train problems, boxed answers
    c.data.path = "/data/math"  # directory with the published files (layouts: docs/data.md)
    # The official recipe's prompt (verl's MATH / GSM8K preprocessing): the problem, then "Let's
    # think step by step and output the final answer within \boxed{}." (GSM8K: '... after
    # "####".') as the one user message; the same in training and evaluation (docs/eval.md).
    c.data.template = "verl"
    c.data.use_chat_template = True  # Qwen's chat template (its default system message)
    c.data.max_prompt_len = 1024  # prompt tokens
    c.data.on_too_long = "drop"  # drop (and count) longer prompts
    c.data.eval_size = 500  # MATH-500

    c.rollout.prompts_per_step = 1024  # prompts per rollout
    c.rollout.group_size = 4  # k
    c.rollout.max_new_tokens = 1024  # response tokens
    c.rollout.temperature = 1.0

    c.algo.name = "gvpo"
    c.algo.beta = 0.1
    c.algo.anchor = "old"  # the official code's anchor: the policy at the start of the step
    c.algo.num_minibatches = 4  # 256 prompts x 4 responses per update
    c.algo.num_epochs = 1
    c.algo.overlong_cache = 256

    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    c.optim.micro_batches = 8  # 256 groups / (32 row shards x 8) = 1 group per micro-batch
    # Micro-batches and log-prob chunks cut to 256 / 512 / 768 / 1024 response slots by their
    # longest answer (gvpo_jax/buckets.py): the same update on fewer padded slots.
    c.optim.length_buckets = 4

    c.train.steps = 200
    c.train.eval_every = 20
    c.train.eval_samples = 4  # avg@4 on the held-out set
    c.train.checkpoint_every = 10
    c.train.keep_checkpoints = 3
    c.train.reward_timeout_s = 5.0
    c.train.reward_workers = 16
    c.train.kl_ref_metric = False  # no extra 7B copy just for the KL metric (anchor "old")

    # A v5p-64 slice (32 chips) or one 8-GPU node: parameters and optimizer state sharded (FSDP)
    # within a host, data parallel across hosts. -1 takes all remaining devices.
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    return c
