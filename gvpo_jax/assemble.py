"""One assembly: a config becomes a frozen `Run` (model, tokenizer, task, mesh, jitted functions,
checkpoints, writer) and its first `TrainState`; `start_loop` gives the run's first loop state.

    run, state = assemble.assemble(config, workdir)
    loop = assemble.start_loop(run)  # data position, shuffle stream, replay buffer

The trainer, `plan --compile` (through `step_functions`), the learning studies, the benchmarks and
the tests all build their runs here; nothing assigns fields on a `Run` afterwards (use
`dataclasses.replace` for a variant). The config is read here and in the trainer's loop only:
the step (`rl_step.StepSettings`), the sampler (`sampler.SamplingSettings`) and the task take
explicit settings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from gvpo_jax import (
    buckets,
    checkpoint,
    decode,
    losses,
    metrics,
    models,
    multiturn,
    rollout_queue,
    sampler,
    sharding,
    tasks,
    train_step,
)
from gvpo_jax import config as config_lib
from gvpo_jax.batch import BatchSpec
from gvpo_jax.buckets import Updater
from gvpo_jax.models import lora
from gvpo_jax.replay import ReplayBuffer
from gvpo_jax.rl_step import LoopState, StepSettings


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything of one run that never changes; built once by `assemble`. What changes is in
    the `TrainState` (device arrays) and the `rl_step.LoopState` (host side)."""

    config: ml_collections.ConfigDict  # read by the trainer's loop only
    workdir: str
    mesh: jax.sharding.Mesh  # always a mesh: 1 x 1 x 1 on one device
    rules: tuple  # logical-axis rules of the model on the mesh
    graphdef: nnx.GraphDef
    tokenizer: object
    task: tasks.Task
    sampling: sampler.SamplingSettings  # the rollout's sampler settings
    settings: StepSettings  # what one RL step does (the algorithm, the reference, the layout)
    writer: metrics.MetricWriter
    ckpt: checkpoint.Checkpointer
    tx: optax.GradientTransformation  # the RL optimizer
    state_shardings: train_step.TrainState  # NamedShardings of the train state
    updater: Updater  # the RL update and log-prob passes (full width, buckets or packed)
    # mesh.rollout_devices > 0: the devices that only sample (rollout_queue.SamplingMesh)
    sampling_mesh: rollout_queue.SamplingMesh | None = None
    lora: lora.LoRASpec | None = None  # config.lora.enabled: the adapters on a frozen base
    # rollout.compute_dtype other than the model's: the policy's graph computing in that dtype
    rollout_graphdef: nnx.GraphDef | None = None
    tools: multiturn.Tools | None = None  # config.tools: multi-turn rollouts with tool calls

    @property
    def algorithm(self) -> losses.Algorithm:
        """The run's algorithm, resolved once from the config (`config.algorithm`)."""
        return self.settings.algorithm

    @property
    def reference(self) -> train_step.Reference:
        """Where the reference log-probs come from (a frozen copy, the adapters off, none)."""
        return self.settings.reference

    def model(self, params) -> models.Transformer:
        return nnx.merge(self.graphdef, params)

    def rollout_model(self, params) -> models.Transformer:
        """The policy as the rollout samples it: in `rollout.compute_dtype` (the same
        parameters), or as `model` when that is the model's own."""
        return nnx.merge(self.rollout_graphdef or self.graphdef, params)


def rollout_graphdef(config: ml_collections.ConfigDict, cfg: models.ModelConfig):
    """The policy's graph definition computing in `rollout.compute_dtype` (LoRA adapters
    included), or None when that is the model's own dtype."""
    dtype = config.rollout.compute_dtype
    if not dtype or dtype == cfg.compute_dtype:
        return None
    cfg = cfg.replace(compute_dtype=dtype)
    spec = lora_spec(config)
    abstract = lora.abstract_lora_model(cfg, spec) if spec else models.abstract_model(cfg)
    return nnx.split(abstract, nnx.Param)[0]


# ----------------------------------------------------------------------------------------------
# Config -> settings (pure functions of the config; the planner uses them too)


def trains(config: ml_collections.ConfigDict) -> bool:
    """Whether the run updates the policy. mode=eval and mode=export only read the parameters:
    they build no optimizer state and keep no reference copy."""
    return config.mode not in ("eval", "export")


def lora_spec(config: ml_collections.ConfigDict) -> lora.LoRASpec | None:
    """The run's adapters (None: full fine-tuning)."""
    c = config.lora
    if not c.enabled:
        return None
    targets = config_lib.lora_targets(config)
    return lora.LoRASpec(
        rank=c.rank, alpha=float(c.alpha), targets=targets, rslora=c.rslora, experts=c.experts
    )


def base_dtype(config: ml_collections.ConfigDict) -> str:
    """Storage of the model's own weights: the masters' param_dtype, or with LoRA the compute
    dtype (the base is frozen and only ever cast to it)."""
    return config.model.compute_dtype if config.lora.enabled else config.model.param_dtype


def check_lora(config: ml_collections.ConfigDict, cfg: models.ModelConfig) -> None:
    """LoRA settings that need the model's shapes or the reference rule (ConfigError)."""
    spec = lora_spec(config)
    if spec is None:
        return
    widths = {
        "q_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        "k_proj": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim),
        "v_proj": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim),
        "o_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
    }
    # the MLP targets adapt the dense MLP layers, and with lora.experts each expert's MLP
    mlp = [cfg.intermediate_size] if not all(map(cfg.moe_layer, range(cfg.num_layers))) else []
    mlp += [cfg.moe_intermediate_size] if spec.experts and cfg.moe else []
    for name in ("gate_proj", "up_proj", "down_proj"):
        widths[name] = (cfg.hidden_size, *mlp)
    for name in spec.targets:
        width = min(widths[name])
        if spec.rank > width:
            config_lib.fail(
                f"config.lora.rank is {spec.rank} but {name} is only {width} wide in this model "
                f"(a rank above the layer width adds nothing); set lora.rank <= {width}."
            )
    if config.mode in ("train", "sft") and config.sft.steps and reference(config).kind != "none":
        config_lib.fail(
            "config.lora.enabled with sft.steps > 0 and a reference: LoRA's reference is the base "
            "with the adapters off, not the SFT result; set sft.steps=0 or drop the reference "
            "(algo.anchor=old, no KL, train.kl_ref_metric=False)."
        )


def reference(config: ml_collections.ConfigDict) -> train_step.Reference:
    """Where the run's reference log-probs come from: a frozen copy of the start policy, the
    LoRA policy with its adapters off, or none. One is needed by the algorithm (GVPO's anchor
    "ref", a KL penalty in the loss or the reward) or by the KL-to-start metric, and only by a
    run that trains."""
    wanted = config_lib.algorithm(config).needs_reference or config.train.kl_ref_metric
    if not (wanted and trains(config)):
        return train_step.Reference("none")
    return train_step.Reference("adapters_off" if config.lora.enabled else "copy")


def rl_updates(config: ml_collections.ConfigDict) -> int:
    """Optimizer updates of the whole RL phase (the learning-rate schedule's length)."""
    return config.algo.num_epochs * config.algo.num_minibatches * max(config.train.steps, 1)


def optimizer(config: ml_collections.ConfigDict, total_updates: int):
    """(tx, lr_fn): the config's AdamW, schedule and clipping over `total_updates` updates."""
    c = config.optim
    return train_step.make_optimizer(
        lr=c.lr,
        total_updates=total_updates,
        warmup_steps=c.warmup_steps,
        schedule=c.schedule,
        weight_decay=c.weight_decay,
        b1=c.b1,
        b2=c.b2,
        grad_clip=c.grad_clip,
    )


def rl_loss_fn(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef, *, moe: bool = False):
    """`train_step.rl_loss` with the run's algorithm, batch spec and layout bound (`moe`: the
    policy has MoE layers)."""
    c = config
    return functools.partial(
        train_step.rl_loss,
        graphdef=graphdef,
        algorithm=config_lib.algorithm(c),
        spec=batch_spec(c, moe=moe),
        group_size=c.rollout.group_size,
        prompt_len=c.data.max_prompt_len,
        chunk_size=c.model.logprob_chunk,
    )


def step_settings(
    config: ml_collections.ConfigDict, model_cfg: models.ModelConfig | None = None
) -> StepSettings:
    """The step's settings from the config (and the built model's config: an MoE policy's
    routing record shape)."""
    c = config
    record, moe_layers = (), ()
    if model_cfg is not None and model_cfg.moe:
        moe_layers = tuple(i for i in range(model_cfg.num_layers) if model_cfg.moe_layer(i))
        dtype = np.dtype(decode.routes_dtype(model_cfg.num_experts)).name
        record = (len(moe_layers), model_cfg.num_experts_per_tok, dtype)
    return StepSettings(
        algorithm=config_lib.algorithm(c),
        reference=reference(c),
        spec=batch_spec(c, moe=bool(model_cfg and model_cfg.moe)),
        prompts_per_step=c.rollout.prompts_per_step,
        group_size=c.rollout.group_size,
        prompt_len=c.data.max_prompt_len,
        num_epochs=c.algo.num_epochs,
        num_minibatches=c.algo.num_minibatches,
        micro_batches=c.optim.micro_batches,
        replay_fraction=c.algo.replay_fraction,
        max_extra_rounds=c.algo.max_extra_rounds,
        demo_slot=bool(c.algo.demo_slot),
        max_bad_steps=c.train.max_bad_steps,
        grad_clip=c.optim.grad_clip,
        staleness=c.rollout.staleness,
        routing_metrics=bool(c.train.routing_metrics),
        routing_replay=c.algo.routing_replay,
        record=record,
        moe_layers=moe_layers,
    )


def stop_token_ids(config: ml_collections.ConfigDict, tokenizer) -> tuple[int, ...]:
    """The ids of `rollout.stop` (comma-separated strings, each one token of the tokenizer, such
    as a newline: a base model's answer ends at the end of its line)."""
    ids = []
    for text in [t for t in config.rollout.stop.split(",") if t]:
        text = text.encode().decode("unicode_escape")  # "\n" in a config or flag is a newline
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            config_lib.fail(
                f"config.rollout.stop holds {text!r}, which the tokenizer splits into {len(got)} "
                "tokens; give strings of one token each."
            )
        ids.append(int(got[0]))
    return tuple(ids)


def sampling_settings(
    config: ml_collections.ConfigDict, tokenizer, *, moe: bool = False
) -> sampler.SamplingSettings:
    """The rollout's sampler settings; an MoE policy's rollouts record their routing (the
    routing-drift metrics and replay read it)."""
    eos = tasks.eos_ids(tokenizer)
    eos = eos + tuple(i for i in stop_token_ids(config, tokenizer) if i not in eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return sampler.SamplingSettings(
        group_size=config.rollout.group_size,
        max_new_tokens=config.rollout.max_new_tokens,
        eos_ids=eos,
        pad_id=int(pad),
        temperature=config.rollout.temperature,
        top_k=config.rollout.top_k,
        top_p=config.rollout.top_p,
        buckets=(config.data.max_prompt_len,),
        num_slots=config.rollout.num_slots,
        eval_num_slots=config.train.eval_num_slots,
        shed=config.rollout.shed,
        record_routes=moe,
    )


def tool_run(config: ml_collections.ConfigDict, tokenizer, sampling) -> multiturn.Tools | None:
    """The run's tools (config.tools), or None for single-turn rollouts. The chat format uses
    the tokenizer's own chat template when it has one (checked to hold the tool protocol), else
    Qwen3's (`tools.formats.QWEN3_TEMPLATE`)."""
    from gvpo_jax import tools
    from gvpo_jax.tools import formats

    names = config_lib.tool_names(config)
    if not names:
        return None
    if jax.process_count() > 1:
        config_lib.fail(
            f"config.tools.names is set in a run of {jax.process_count()} processes, but tool "
            "rollouts run in one process for now (each process would decide its own turns); "
            "run on one host."
        )
    registry, t = tools.builtin(names), config.tools
    if t.format == "bracket":
        params = registry.schemas()[0]["function"]["parameters"]
        fmt = formats.BracketFormat(
            tokenizer, registry, tool=names[0], argument=params["required"][0], truncate=t.truncate
        )
    else:
        template = getattr(tokenizer, "chat_template", None) or formats.QWEN3_TEMPLATE
        try:
            fmt = formats.ChatFormat(tokenizer, registry, template=template, truncate=t.truncate)
        except ValueError:
            config_lib.fail(
                "config.tools.format is chat but the tokenizer's chat template does not write a "
                "tool call as <tool_call>..</tool_call> followed by its answer; use a tokenizer "
                "with Qwen3's tool protocol."
            )
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template  # prompts are rendered with it (with the tools)
    settings = multiturn.TurnSettings(
        sampling=sampling, stop_ids=fmt.stop_ids, max_tool_tokens=t.max_tokens, chunk=t.decode_chunk
    )
    return multiturn.Tools(
        settings=settings, format=fmt, max_turns=t.max_turns, timeout_s=t.timeout_s
    )


def start_loop(run: Run) -> LoopState:
    """The loop state of a run's start: step 0, the start of the task's stream, the shuffle
    stream seeded from the config's seed, an empty replay buffer (when the config has one)."""
    return LoopState(
        step=0,
        data=run.task.start,
        np_rng=np.random.default_rng(run.config.seed + 1),
        replay=make_replay(run.config),
    )


def make_replay(config: ml_collections.ConfigDict) -> ReplayBuffer | None:
    """GVPO's replay buffer (an off-policy loss and algo.replay_fraction > 0), else None."""
    if config_lib.algorithm(config).off_policy and config.algo.replay_fraction > 0:
        return ReplayBuffer(
            config.algo.replay_capacity, mode=config.algo.replay_mode, seed=config.seed
        )
    return None


# ----------------------------------------------------------------------------------------------
# The pieces


def build_tokenizer(config: ml_collections.ConfigDict, workdir: str):
    """The run's tokenizer; the character tokenizer is saved as a normal HF directory in workdir."""
    from gvpo_jax import data

    kind = config.tokenizer.kind
    if kind == "char":
        chars = data.char_tokenizer.CHARS
        if config_lib.tool_names(config) and config.tools.format == "bracket":
            chars += "[]"  # the calls' brackets
        tok = data.char_tokenizer.build_char_tokenizer(chars)
        if sharding.is_primary():  # one writer: the workdir may be shared by all processes
            tok.save_pretrained(os.path.join(workdir, "tokenizer"))
        return tok
    import transformers

    field = "tokenizer.path" if kind == "hf" else "model.hf_dir"
    path = config.tokenizer.path if kind == "hf" else config.model.hf_dir
    if not path:
        return None  # kind == "model" with a GGUF: from_gguf returns its tokenizer
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - `tokenizers` raises bare Exceptions on damaged files
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0].rstrip('.')}"
        config_lib.fail(
            f"the tokenizer in config.{field} {path!r} could not be loaded "
            f"({reason}); save it again with tokenizer.save_pretrained."
        )


def build_model(config: ml_collections.ConfigDict, tokenizer, mesh):
    """The policy in its shards: HF directory > GGUF file > preset / overrides with random init.

    Parameters are created or loaded straight into their shards under the logical axis rules.
    Returns (model, tokenizer, rules).
    """
    c = config.model
    param_dtype = base_dtype(config)
    if c.hf_dir:
        cfg = models.hf_model_config(c.hf_dir, param_dtype, c.compute_dtype)
        config_lib.check_vocab(config, cfg.vocab_size, tokenizer)  # before the weights load
        cfg = cfg.replace(remat=c.remat, scan_layers=config_lib.scan_layers(config, model=cfg))
        rules = sharding.logical_rules(mesh, cfg)
        shardings = sharding.param_shardings(models.abstract_model(cfg), mesh, rules)
        model = models.from_pretrained(
            c.hf_dir,
            param_dtype,
            c.compute_dtype,
            remat=c.remat,
            scan_layers=cfg.scan_layers,
            shardings=shardings,
        )
        model = models.with_config(
            model, attention=c.attention, scan_decode=config_lib.scan_decode(config)
        )
        return model, tokenizer, rules
    if c.gguf:
        from gvpo_jax.config import resolve_gguf

        path = resolve_gguf(c.gguf)
        cfg = models.gguf_config(path, param_dtype, c.compute_dtype)
        model, gguf_tok = models.from_gguf(
            path,
            param_dtype,
            c.compute_dtype,
            scan_layers=config_lib.scan_layers(config, model=cfg),
        )
        config_lib.check_vocab(config, model.config.vocab_size, tokenizer or gguf_tok)
        model = models.with_config(
            model,
            remat=c.remat,
            attention=c.attention,
            scan_decode=config_lib.scan_decode(config),
        )
        rules = sharding.logical_rules(mesh, model.config)
        return sharding.shard_model(model, mesh, rules), tokenizer or gguf_tok, rules
    base = models.PRESETS[c.preset] if c.preset else None
    fields = dict(c.overrides.to_dict())
    if tokenizer is not None and "vocab_size" not in fields and base is None:
        fields["vocab_size"] = len(tokenizer)
    fields.setdefault("param_dtype", param_dtype)
    fields.setdefault("compute_dtype", c.compute_dtype)
    fields.setdefault("remat", c.remat)
    fields.setdefault("scan_decode", config_lib.scan_decode(config))
    fields.setdefault("attention", c.attention)
    scan = fields.pop("scan_layers", None)
    cfg = base.replace(**fields) if base is not None else models.ModelConfig(**fields)
    cfg = cfg.replace(
        scan_layers=config_lib.scan_layers(config, model=cfg) if scan is None else scan
    )
    config_lib.check_vocab(config, cfg.vocab_size, tokenizer)
    rules = sharding.logical_rules(mesh, cfg)
    return sharding.init_sharded(cfg, mesh, config.seed, rules), tokenizer, rules


def check_mesh(config: ml_collections.ConfigDict, mesh) -> None:
    """Batch shapes the mesh can split into whole groups (ShardingError otherwise): the
    trainer's check before anything compiles, and the planner's verdict on a mesh."""
    c = config
    P, G = c.rollout.prompts_per_step, c.rollout.group_size
    sharding.check_batch((P // c.algo.num_minibatches) * G, G, mesh, c.optim.micro_batches)
    fresh = P - int(round(c.algo.replay_fraction * P))
    fix = "change prompts_per_step (or replay_fraction) or config.mesh"
    sizes = [("config.rollout.prompts_per_step", P), ("fresh groups per step", fresh)]
    if c.train.eval_chunk:
        sizes.append(("config.train.eval_chunk", c.train.eval_chunk))
    if c.sft.steps:
        sizes.append(("config.sft.batch_size", c.sft.batch_size))
    for name, n in sizes:
        sharding.check_split(n, mesh, name, fix)
    # Each row shard refills its own decode slots.
    for name in ("rollout.num_slots", "train.eval_num_slots"):
        slots = c.rollout.num_slots if name == "rollout.num_slots" else c.train.eval_num_slots
        sharding.check_split(
            slots, mesh, f"config.{name} (decode slots)", "use a multiple, or 0 for one per row"
        )


def attach_lora(config: ml_collections.ConfigDict, model, mesh, rules):
    """The model with the config's fresh adapters, in their shards (unchanged without LoRA)."""
    spec = lora_spec(config)
    if spec is None:
        return model
    check_lora(config, model.config)
    return sharding.shard_model(lora.attach(model, spec, seed=config.seed), mesh, rules)


def batch_spec(config: ml_collections.ConfigDict, *, moe: bool = False) -> BatchSpec:
    """The optional fields every update batch of the run carries, from its algorithm, its
    reference and the step's layout (`batch.BatchSpec`); an MoE policy's (`moe`) carry its
    routing record when the step replays it or measures its drift (`train.routing_metrics`)."""
    c, algo = config, config_lib.algorithm(config)
    replay = c.algo.routing_replay != "none"
    single_update = c.algo.num_epochs * c.algo.num_minibatches == 1
    # one loss call over all rows: the loss computes whole-batch statistics itself
    whole = single_update and c.optim.micro_batches == 1 and not c.optim.length_buckets
    return BatchSpec(
        old_logp=not single_update,
        ref_logp=reference(c).present,
        behaviour_logp=algo.correction is not None,
        sampler_logp=algo.anchor == "sampler" or single_update,
        advantages=algo.batch_statistics and not whole,
        packed=bool(c.optim.pack_groups),
        routing=moe and (replay or bool(c.train.routing_metrics)),
        replay=moe and replay,
    )


def step_functions(
    config: ml_collections.ConfigDict, graphdef, params, rng, mesh, rules
) -> tuple[optax.GradientTransformation, train_step.TrainState, Updater]:
    """The RL update and log-prob passes for `mesh` (`buckets.Updater`: full width, length
    buckets or packed groups), with the state's shardings.

    `params` and `rng` may be concrete or abstract (the planner compiles full-size configs from
    shapes). With LoRA the log-prob passes also run with the adapters off (`reference=True`).
    Returns (tx, state_shardings, updater).
    """
    c = config
    tx, lr_fn = optimizer(config, rl_updates(config))
    shardings = train_step.train_state_shardings(params, tx, rng, mesh, rules)
    n, G, K = c.rollout.max_new_tokens, c.rollout.group_size, c.optim.length_buckets
    off = lora.with_adapters(graphdef, params, False)  # LoRA's base: the adapters off
    kw = dict(
        prompt_len=c.data.max_prompt_len,
        chunk_size=c.model.logprob_chunk,
        mesh=mesh,
        param_shardings=shardings.params,
        rules=rules,
        reference_graphdef=off,
    )
    if c.optim.pack_groups:  # one row per group: its prompt, then its G responses back to back
        widths = buckets.pack_widths(n, G, K)
        logprobs = train_step.jit_packed_logprobs(graphdef, group_size=G, **kw)
    else:
        widths = buckets.bucket_widths(n, K) if K else (n,)  # no buckets: full width
        logprobs = train_step.jit_logprobs(graphdef, group_size=G, **kw)
    moe = nnx.merge(graphdef, params).config.moe
    spec = batch_spec(c, moe=moe)
    updater = Updater(
        rl_loss_fn(config, graphdef, moe=moe),
        tx,
        lr_fn,
        logprobs,
        micro_batches=c.optim.micro_batches,
        chunks=c.algo.num_minibatches * c.optim.micro_batches,
        widths=widths,
        prompt_len=c.data.max_prompt_len,
        group_size=G,
        token_weighted=config_lib.algorithm(c).token_weighted,
        mesh=mesh,
        state_shardings=shardings,
        spec=spec,
        rules=rules,
    )
    return tx, shardings, updater


def split_devices(config: ml_collections.ConfigDict, devices: list) -> tuple[list, list]:
    """(training devices, sampling devices): the last mesh.rollout_devices of `devices` only
    sample. One process only: a sampling thread's host gathers would interleave with the
    training mesh's collectives across processes (docs/async.md has the multi-host plan)."""
    n = config.mesh.rollout_devices
    if not n or not trains(config):
        return devices, []
    if n >= len(devices):
        raise sharding.ShardingError(
            f"config.mesh.rollout_devices is {n} but the mesh has {len(devices)} devices, "
            "which leaves none to train on; use fewer."
        )
    if jax.process_count() > 1:
        raise sharding.ShardingError(
            f"config.mesh.rollout_devices is {n} in a {jax.process_count()}-process run; a "
            "separate sampling mesh runs in one process only: use rollout_devices=0 (the lag "
            "without overlap) on several hosts."
        )
    return devices[: len(devices) - n], devices[len(devices) - n :]


def sampling_mesh(
    config: ml_collections.ConfigDict, devices: list, graphdef, params
) -> rollout_queue.SamplingMesh | None:
    """The sampling mesh over `devices` (data x tensor, the tensor axis as training's), with
    the policy's shardings there; None without sampling devices."""
    if not devices:
        return None
    c = config
    mesh = sharding.make_mesh(-1, 1, c.mesh.tensor, devices=devices)
    fix = "use mesh.rollout_devices / mesh.tensor that divide it"
    sharding.check_split(
        c.rollout.prompts_per_step,
        mesh,
        "config.rollout.prompts_per_step (on the sampling mesh)",
        fix,
    )
    sharding.check_split(
        c.rollout.num_slots, mesh, "config.rollout.num_slots (on the sampling mesh)", fix
    )
    cfg = nnx.merge(graphdef, params).config
    rules = sharding.logical_rules(mesh, cfg)
    shardings = sharding.param_shardings(jax.eval_shape(lambda p: p, params), mesh, rules)
    dtype = c.rollout.compute_dtype or cfg.compute_dtype  # what the sampler computes in
    return rollout_queue.SamplingMesh(mesh, rules, shardings, dtype)


def prepare_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Fails early on an unusable workdir or restore path, before anything is written there."""
    if config.restore_from:  # a bad explicit path fails before anything is written
        checkpoint.resolve_restore(config.restore_from, workdir)
    checkpoint.check_directory(checkpoint.checkpoint_dir(workdir))
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_test.{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise checkpoint.CheckpointError(
            f"workdir {workdir!r} is not writable ({e.strerror}); choose another --workdir."
        ) from e


def record_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes the run's config.json (process 0), once the assembly has succeeded: a config
    refused at assembly (a tokenizer larger than the model, a malformed data file) leaves a
    resumed workdir's record of its own config as it was."""
    if sharding.is_primary():
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))


def assemble(config: ml_collections.ConfigDict, workdir: str) -> tuple[Run, train_step.TrainState]:
    """Everything a run needs, before any step runs: returns (Run, the initial TrainState)."""
    prepare_workdir(config, workdir)
    m = config.mesh
    devices = jax.devices() if m.num_devices == -1 else jax.devices()[: m.num_devices]
    if m.num_devices > len(jax.devices()):
        raise sharding.ShardingError(
            f"config.mesh.num_devices is {m.num_devices} but {len(jax.devices())} devices are "
            "available; use -1 (every device) or a smaller count."
        )
    devices, sampling_devices = split_devices(config, devices)
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices, expert=m.expert)
    check_mesh(config, mesh)
    tokenizer = build_tokenizer(config, workdir)
    model, tokenizer, rules = build_model(config, tokenizer, mesh)
    config_lib.check_model_fields(config, model.config)
    model = attach_lora(config, model, mesh, rules)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = jax.random.key_data(jax.random.key(config.seed))
    tx, shardings, updater = step_functions(config, graphdef, params, rng, mesh, rules)
    if trains(config):
        state, _ = train_step.init_state_sharded(params, tx, rng, mesh, rules)
    else:
        state = train_step.params_only_state(params, tx, rng, shardings)
    moe, model_cfg = model.config.moe, model.config
    del model, params  # the state holds the parameters now; a restore may replace them
    sampling = sampling_settings(config, tokenizer, moe=moe)
    tools = tool_run(config, tokenizer, sampling)
    chat_tools = tools is not None and config.tools.format == "chat"
    task = tasks.build_task(
        config,
        tokenizer,
        shard=sharding.data_shard(mesh),
        allgather=sharding.host_allgather,
        tools=tools.format.registry.schemas() if chat_tools else None,
    )
    run = Run(
        config=config,
        workdir=workdir,
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        tokenizer=tokenizer,
        task=task,
        sampling=sampling,
        settings=step_settings(config, model_cfg),
        writer=metrics.MetricWriter(
            workdir,
            wandb_project=config.train.wandb_project,
            wandb_config=json.loads(config.to_json_best_effort()),
        ),
        ckpt=checkpoint.Checkpointer(
            checkpoint.checkpoint_dir(workdir),
            save_every=config.train.checkpoint_every,
            keep=config.train.keep_checkpoints,
            verify=config.train.verify_checkpoints,
        ),
        tx=tx,
        state_shardings=shardings,
        updater=updater,
        sampling_mesh=sampling_mesh(config, sampling_devices, graphdef, state.params),
        lora=lora_spec(config),
        rollout_graphdef=rollout_graphdef(config, model_cfg),
        tools=tools,
    )
    record_config(config, workdir)
    if sharding.is_primary():
        adapters = nnx.state(state.params, nnx.LoRAParam)
        lora_note = f" ({models.param_count(adapters) / 1e6:.3f}M in LoRA adapters)"
        print(
            f"model: {models.param_count(run.model(state.params)) / 1e6:.2f}M parameters"
            f"{lora_note if config.lora.enabled else ''}; "
            f"{jax.device_count()} {jax.devices()[0].platform} devices; mesh "
            + " x ".join(f"{k}={v}" for k, v in sharding.mesh_sizes(mesh).items())
        )
    return run, state
