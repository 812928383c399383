"""LoRA adapters on the transformer's projections: attach, switch off, merge, PEFT export.

An adapter adds `scale * (x @ A) @ B` to one projection `x @ W` (arXiv 2106.09685), with A
[in, r] drawn as PEFT draws it (uniform in +-1/sqrt(in)) and B [r, out] zero, so a model with
fresh adapters computes exactly what its base computes. `scale` is alpha / r, or alpha / sqrt(r)
with rank-stabilised scaling (rsLoRA, arXiv 2312.03732).

A and B are `nnx.LoRAParam`s (a subclass of `nnx.Param`): `nnx.split(model, nnx.Param)` keeps
them in the policy's parameters, and `split_trainable` cuts those into the adapters (trained,
fp32 masters with their Adam moments) and the frozen base (in the compute dtype, never in the
optimizer). They carry the logical axes of the weight they adapt (`embed`, `heads`, `mlp`, ...)
on their in / out dimensions and none on the rank, so the mesh rules shard them as the base.

With `LoRASpec.experts` an MoE layer's experts get adapters too (`ExpertAdapter`: per-expert A
[E, in, r] and B [E, r, out] on the MLP targets, applied as merged weights W + scale A B).

Switching the adapters off (`with_adapters(graphdef, False)`) changes the graph, not the
parameters: the reference policy of a LoRA run is the same parameters run without the adapter
branch, so no second copy of the weights exists. Why a hand-written adapter and not
`nnx.LoRALinear`: docs/lora.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gvpo_jax.models import safetensors_io
from gvpo_jax.models.transformer import (
    KeyStream,
    MoE,
    Transformer,
    abstract_model,
    stack_blocks,
)

# Target name (as PEFT and transformers name the modules) -> (sub-module, attribute stem).
TARGETS = {
    "q_proj": ("attn", "q"),
    "k_proj": ("attn", "k"),
    "v_proj": ("attn", "v"),
    "o_proj": ("attn", "o"),
    "gate_proj": ("mlp", "gate"),
    "up_proj": ("mlp", "up"),
    "down_proj": ("mlp", "down"),
}
_HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """Rank, alpha, the target projections and the scaling rule of a run's adapters."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(TARGETS)
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    experts: bool = False  # the MLP targets of an MoE layer adapt its experts (ExpertAdapter)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class Adapter(nnx.Module):
    """`scale * (x @ A) @ B` for one projection whose kernel is [*in_shape, *out_shape].

    A is [*in_shape, r], B [r, *out_shape] (fp32 masters); the branch runs in the compute
    dtype, like the base weight. `enabled` is static: turning it off changes the graph.
    """

    def __init__(
        self, in_shape, out_shape, in_axes, out_axes, *, rank: int, scale: float, rngs: nnx.Rngs
    ):
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound)
        self.a = nnx.LoRAParam(a, out_sharding=(*in_axes, None), eager_sharding=False)
        b = jnp.zeros((rank, *out_shape), jnp.float32)
        self.b = nnx.LoRAParam(b, out_sharding=(None, *out_axes), eager_sharding=False)
        self.scale = scale
        self.enabled = True

    def __call__(self, x_MxI: jax.Array, dtype) -> jax.Array:
        """x [M, prod(in_shape)] -> [M, prod(out_shape)] in `dtype`."""
        r = self.a.shape[-1]
        a_IxR = self.a[...].astype(dtype).reshape(-1, r)
        b_RxO = self.b[...].astype(dtype).reshape(r, -1)
        return ((x_MxI @ a_IxR) * jnp.asarray(self.scale, dtype)) @ b_RxO

    def delta(self) -> jax.Array:
        """fp32 scale * A @ B in the kernel's own shape [*in_shape, *out_shape]."""
        return self.product(self.a[...], self.b[...], self.scale)

    @staticmethod
    def product(a, b, scale) -> jax.Array:
        return scale * jnp.tensordot(a, b, axes=1)


class ExpertAdapter(nnx.Module):
    """Per-expert LoRA on an MoE layer's stacked expert kernel [E, in, out]: A [E, in, r] (uniform
    in +-1/sqrt(in), as `Adapter`), B [E, r, out] zero, fp32 masters. The layer uses it as the
    merged weight W + `delta()` (`MoE.__call__`), so every dispatch and the expert-parallel
    exchange see plain [E, ...] weights. `enabled` is static, as for `Adapter`.
    """

    def __init__(self, experts, d_in, d_out, axes, *, rank: int, scale: float, rngs: nnx.Rngs):
        """`axes`: the kernel's logical axes (expert, in, out), which A and B take over."""
        expert_axis, in_axis, out_axis = axes
        bound = 1.0 / math.sqrt(d_in)
        a = jax.random.uniform(rngs.params(), (experts, d_in, rank), jnp.float32, -bound, bound)
        self.a = nnx.LoRAParam(a, out_sharding=(expert_axis, in_axis, None), eager_sharding=False)
        b = jnp.zeros((experts, rank, d_out), jnp.float32)
        self.b = nnx.LoRAParam(b, out_sharding=(expert_axis, None, out_axis), eager_sharding=False)
        self.scale = scale
        self.enabled = True

    def delta(self) -> jax.Array:
        """fp32 scale * A @ B per expert, [E, in, out]."""
        return self.product(self.a[...], self.b[...], self.scale)

    @staticmethod
    def product(a, b, scale) -> jax.Array:
        return scale * jnp.einsum("edr,erf->edf", a, b, preferred_element_type=jnp.float32)

    def merge(self, w_ExIxO: jax.Array, dtype) -> jax.Array:
        """The kernel W + delta, summed in fp32 and stored in `dtype` (as `merged` writes it)."""
        return (w_ExIxO.astype(jnp.float32) + self.delta()).astype(dtype)


def _kernel(module, stem: str):
    return getattr(module, f"{stem}_kernel")


def _axes(param) -> tuple:
    return tuple(param.get_metadata().get("out_sharding") or (None,) * param.ndim)


def _input_dims(stem: str) -> int:
    """How many leading kernel dims are inputs: o_kernel is [N, H, D], every other one [in, ...]."""
    return 2 if stem == "o" else 1


def attach(model: Transformer, spec: LoRASpec, *, seed: int) -> Transformer:
    """Adds fresh adapters (B = 0) to `spec.targets` of every layer, in place; returns `model`.

    Their A matrices come from their own stream (`seed`), so the base is untouched and equal to
    the model built without LoRA. On an MoE layer the MLP targets adapt the experts
    (`ExpertAdapter`) with `spec.experts`, and are skipped without it.
    """
    # not the base's stream; the draws of nnx.Rngs(params=that key), without its state
    rngs = KeyStream(jax.random.fold_in(jax.random.key(seed), 0x10A))
    stacked = model.config.scan_layers  # one Block of stacked [L, ...] kernels
    blocks = [model.layers] * model.config.num_layers if stacked else list(model.layers)
    made = {name: [] for name in spec.targets}
    for block in blocks:  # layer by layer, target by target: the same draws either way
        for name in spec.targets:
            part, stem = TARGETS[name]
            module = getattr(block, part)
            kernel = _kernel(module, stem)
            k, axes = _input_dims(stem) + stacked, _axes(kernel)[stacked:]
            if isinstance(module, MoE):  # the experts' kernels [E, in, out]: only with `experts`
                if not spec.experts:
                    continue
                adapter = ExpertAdapter(
                    *kernel.shape[stacked:], axes, rank=spec.rank, scale=spec.scale, rngs=rngs
                )
            else:
                adapter = Adapter(
                    kernel.shape[stacked:k],
                    kernel.shape[k:],
                    axes[: k - stacked],
                    axes[k - stacked :],
                    rank=spec.rank,
                    scale=spec.scale,
                    rngs=rngs,
                )
            made[name].append(adapter)
            if not stacked:
                setattr(module, f"{stem}_lora", adapter)
    if stacked:  # each target's adapters stacked like the kernels they adapt
        for name, per_layer in made.items():
            if not per_layer:  # an MLP target of an all-MoE model without `experts`
                continue
            part, stem = TARGETS[name]
            setattr(getattr(model.layers, part), f"{stem}_lora", stack_blocks(per_layer))
    return model


def abstract_lora_model(cfg, spec: LoRASpec) -> Transformer:
    """`attach` on a model of ShapeDtypeStructs (no memory): for the planner and shape checks.
    A new module per call; the traced structure is cached per (config, spec)."""
    return nnx.merge(*_abstract_split(cfg, spec))


@functools.lru_cache(maxsize=16)
def _abstract_split(cfg, spec: LoRASpec):
    return nnx.split(
        nnx.eval_shape(
            lambda: attach(Transformer(cfg, rngs=KeyStream(jax.random.key(0))), spec, seed=0)
        )
    )


def adapters(model: Transformer) -> list[tuple[int | None, str, Adapter | ExpertAdapter]]:
    """(layer, target name, adapter) of every adapter attached to `model` (an MoE layer's MLP
    targets: `ExpertAdapter`s); with `scan_layers` one adapter per target whose A and B are
    stacked [L, ...], and layer None."""
    out = []
    stacked = model.config.scan_layers
    for i, block in [(None, model.layers)] if stacked else enumerate(model.layers):
        for name, (part, stem) in TARGETS.items():
            adapter = getattr(getattr(block, part), f"{stem}_lora", None)
            if adapter is not None:
                out.append((i, name, adapter))
    return out


def with_adapters(graphdef: nnx.GraphDef, params, enabled: bool) -> nnx.GraphDef:
    """The graph definition of the same model with every adapter on or off (parameters shared:
    an adapter that is off keeps its A and B, the forward just skips its branch)."""
    model = nnx.merge(graphdef, params)
    for _, _, adapter in adapters(model):
        adapter.enabled = enabled
    return nnx.split(model, nnx.Param)[0]


def has_adapters(params) -> bool:
    return bool(jax.tree.leaves(nnx.state(params, nnx.LoRAParam)))


def split_trainable(params):
    """(trained, frozen) parts of a policy's parameters (an nnx.State, or shardings shaped like
    one): with adapters, (the adapters, the rest: the frozen base); without, (params, empty)."""
    if not has_adapters(params):
        return params, nnx.State({})
    return nnx.split_state(params, nnx.LoRAParam, ...)


def join(trained, frozen):
    """The inverse of `split_trainable`."""
    if not jax.tree.leaves(frozen):
        return trained
    return nnx.merge_state(trained, frozen)


def merged(model: Transformer, dtype=None) -> Transformer:
    """A plain model (no adapters) whose kernels are W + scale * A @ B (per expert on an MoE
    layer), summed in fp32 and stored in `dtype` (default: the base's dtype). Adapters that are
    off are not merged."""
    graphdef, _ = nnx.split(abstract_model(model.config), nnx.Param)
    state = nnx.state(model, nnx.Param)
    state = nnx.split_state(state, nnx.LoRAParam, ...)[1] if has_adapters(state) else state
    flat = dict(nnx.to_flat_state(state))
    for i, name, adapter in adapters(model):
        if not adapter.enabled:
            continue
        part, stem = TARGETS[name]
        path = (
            ("layers", part, f"{stem}_kernel")
            if i is None
            else ("layers", i, part, f"{stem}_kernel")
        )
        w = flat[path].get_value()
        delta = (  # an MoE layer's kernels (the same paths) take their ExpertAdapter's product
            adapter.delta()
            if i is not None
            else jax.vmap(type(adapter).product, (0, 0, None))(
                adapter.a[...], adapter.b[...], adapter.scale
            )
        )
        out = (w.astype(jnp.float32) + delta).astype(dtype or w.dtype)
        flat[path] = flat[path].replace(out)
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))


def save_peft(model: Transformer, out_dir, spec: LoRASpec, *, base_model: str = "") -> Path:
    """The adapters in PEFT's format: adapter_config.json + adapter_model.safetensors, which
    `peft.PeftModel.from_pretrained(<the transformers base model>, out_dir)` loads.

    PEFT's lora_A.weight is [r, in_features] and lora_B.weight [out_features, r], with the
    features flattened as transformers' Linear weights are (q_proj out = heads x head_dim).
    Adapters on MoE experts (`ExpertAdapter`) are not written (transformers 5 fuses the experts
    into 3-D parameters, not the Linear modules `target_modules` names); a note printed once
    says so, and the merged export (`merged`) carries them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = []
    per_layer = []  # (layer, name, A shape, B shape, A, B): A [*in, r], B [r, *out] on demand
    skipped = sorted(
        {name for _, name, adapter in adapters(model) if isinstance(adapter, ExpertAdapter)},
        key=list(TARGETS).index,
    )
    if skipped:
        print(
            f"PEFT export: the adapters on the MoE experts ({', '.join(skipped)}) are not "
            f"written to {out_dir} (transformers 5 fuses the experts into 3-D parameters, not "
            "the Linear modules PEFT's target_modules name); the merged export carries them."
        )
    for i, name, adapter in adapters(model):
        if isinstance(adapter, ExpertAdapter):
            continue
        a_shape, b_shape = adapter.a.shape[i is None :], adapter.b.shape[i is None :]
        if i is not None:
            per_layer.append((i, name, a_shape, b_shape, adapter.a.get_value, adapter.b.get_value))
            continue
        stacked_a, stacked_b = _host_once(adapter.a), _host_once(adapter.b)  # [L, ...]
        for j in range(model.config.num_layers):
            per_layer.append((j, name, a_shape, b_shape, lambda j=j, x=stacked_a: x()[j],
                              lambda j=j, x=stacked_b: x()[j]))  # fmt: skip
    order = lambda x: (x[0], list(TARGETS).index(x[1]))
    for i, name, a_shape, b_shape, get_a, get_b in sorted(per_layer, key=order):
        part, _ = TARGETS[name]
        prefix = f"base_model.model.model.layers.{i}.{_HF_PARENT[part]}.{name}"
        r = a_shape[-1]
        a = lambda get_a=get_a, r=r: np.asarray(get_a()).reshape(-1, r).T
        b = lambda get_b=get_b, r=r: np.asarray(get_b()).reshape(r, -1).T
        a_shape, b_shape = (r, math.prod(a_shape[:-1])), (math.prod(b_shape[1:]), r)
        sources.append((f"{prefix}.lora_A.weight", a_shape, np.dtype(np.float32), a))
        sources.append((f"{prefix}.lora_B.weight", b_shape, np.dtype(np.float32), b))
    safetensors_io.write_file(out_dir / "adapter_model.safetensors", sources)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "use_rslora": spec.rslora,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _host_once(param):
    """A function returning `param`'s value as one host array, fetched at its first call."""
    return functools.cache(lambda: np.asarray(jax.device_get(param.get_value())))


def fingerprint(params) -> float:
    """A number that identifies the frozen base (the parameters outside the adapters): the fp32
    sums of every base weight and of its square, weighted by its position in the tree. LoRA
    checkpoints store it, so a resume onto another base fails instead of silently pairing the
    adapters with the wrong weights."""
    base = split_trainable(params)[1] if has_adapters(params) else params
    return float(_weighted_sums(jax.tree.leaves(base)))


@jax.jit
def _weighted_sums(leaves):
    """sum_i i * (sum(x_i) + sum(x_i^2)) over the leaves, in fp32 (compiled once per layout)."""
    sums = [
        jnp.sum(x.astype(jnp.float32)) + jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves
    ]
    return jnp.sum(jnp.stack(sums) * jnp.arange(1, len(sums) + 1, dtype=jnp.float32))
