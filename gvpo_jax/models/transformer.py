"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama, Gemma 3) in Flax NNX: norms, RoPE,
attention projections (with per-head QK-norm), SwiGLU / GeGLU MLP, the block and `Transformer`.

The KV caches and the attention that reads them are in `models/cache.py`, the attention kernels
in `models/attention.py`, the ordered per-block rematerialisation in `models/remat.py`.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from gvpo_jax.models import attention as kernels
from gvpo_jax.models import cache as caches
from gvpo_jax.models import moe as moe_lib
from gvpo_jax.models.config import ModelConfig
from gvpo_jax.models.remat import block_forward, block_forward_remat

# Logical axis names. Parameters carry them as `out_sharding` metadata (read them with
# `nnx.get_partition_spec(state)` under `nnx.logical_axis_rules(rules)`); activations are
# constrained with them, which is a no-op unless logical axis rules and a mesh are active.
PARAM_AXES = (
    "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers", "expert",
    "expert_mlp", "router",
)  # fmt: skip
ACTIVATION_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")


class KeyStream:
    """`nnx.Rngs(params=key)` as the model's constructors use it (`.params()`), without its
    state: call i returns `fold_in(key, i)`, the key that `Rngs.params()` returns at its i-th
    call, and no Variable is updated. Inside `nnx.eval_shape` each update of an Rngs' counter
    costs time that grows with the trace (flax 0.12 asks the traced value for its sharding,
    which builds an error message over the whole trace): ~25 ms a draw for Qwen3-30B-A3B's
    LoRA adapters, 20 s in all."""

    def __init__(self, key: jax.Array):
        self._key, self._count = key, 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self._key, self._count)
        self._count += 1
        return key


def _param(rngs: nnx.Rngs, init, shape, dtype, axes) -> nnx.Param:
    """A Param with logical axis names; eager sharding off so it can be built without a mesh."""
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


_normal = nnx.initializers.normal(0.02)  # transformers' initializer_range
_zeros = lambda key, shape, dtype: jnp.zeros(shape, dtype)
_ones = lambda key, shape, dtype: jnp.ones(shape, dtype)


def weight(param: nnx.Param, dtype) -> jax.Array:
    """A parameter's value in the compute dtype: the cast is part of the graph, so the forward
    pass runs in `dtype` and the gradient reaches the master copy in its own (storage) dtype."""
    return param[...].astype(dtype)


def adapted(y_MxO: jax.Array, x_MxI: jax.Array, adapter) -> jax.Array:
    """y + a LoRA adapter's branch on x (`models/lora.py`), when one is attached and on.
    y [M, out] is the projection x [M, in] @ W in the compute dtype."""
    if adapter is None or not adapter.enabled:
        return y_MxO
    return y_MxO + adapter(x_MxI, y_MxO.dtype)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names (no-op without axis rules and a mesh)."""
    return with_logical_constraint(x, axes)


def default_positions(mask_BxT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """int32 [B, T]: cumsum(mask) - 1 clipped at 0 (left or right padding), else arange(T)."""
    if mask_BxT is None:
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1) - 1, 0)


def rope(
    x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float, scaling: float = 1.0
) -> jax.Array:
    """Rotary embedding, rotate-half convention of transformers; angles computed in fp32.
    `scaling` > 1 is transformers' "linear" RoPE scaling (frequencies divided by it)."""
    head_dim = x_BxTxNxH.shape[-1]
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling != 1.0:
        inv_freq_F = inv_freq_F / scaling
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_F
    angles_BxTx1xH = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BxTx1xH), jnp.sin(angles_BxTx1xH)
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def rms_norm(x_xD, scale_D, eps: float, offset: bool, compute_dtype):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, normalised in fp32; `offset`
    (Gemma 3): * (1 + scale), the product taken in fp32 before the cast back. The backward pass
    keeps only x (a residual the layer keeps anyway: the block's input or the attention's sum)
    and the [..., 1] inverse RMS, and recomputes the normalised x from them. Autodiff would keep
    the normalised x as well, one more [T, D] buffer per norm, which a layer scan stacks."""
    return _rms_norm_fwd(x_xD, scale_D, eps, offset, compute_dtype)[0]


def _norm_dtype(x_xD):
    return jnp.promote_types(x_xD.dtype, jnp.float32)  # fp32; fp64 stays fp64 (tests)


def _rms_norm_fwd(x_xD, scale_D, eps, offset, compute_dtype):
    x = x_xD.astype(_norm_dtype(x_xD))
    inv_x1 = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * inv_x1
    if offset:
        y = (normed * (1.0 + scale_D.astype(x.dtype))).astype(x_xD.dtype)
    else:
        y = scale_D.astype(compute_dtype) * normed.astype(x_xD.dtype)
    return y, (x_xD, scale_D, inv_x1)


def _rms_norm_bwd(eps, offset, compute_dtype, res, dy):
    x_xD, scale_D, inv_x1 = res
    acc = inv_x1.dtype
    normed = x_xD.astype(acc) * inv_x1
    dy = dy.astype(acc)
    axes = tuple(range(dy.ndim - 1))
    if offset:
        dnormed = dy * (1.0 + scale_D.astype(acc))
        dscale = jnp.sum(dy * normed, axis=axes)
    else:
        # The forward's casts round the normalised x and the scale: their derivatives are
        # identities, as autodiff's are, and the scale's gradient reads the rounded values.
        dnormed = dy * scale_D.astype(compute_dtype).astype(acc)
        dscale = jnp.sum(dy * normed.astype(x_xD.dtype).astype(acc), axis=axes)
    dx = inv_x1 * (dnormed - normed * jnp.mean(dnormed * normed, axis=-1, keepdims=True))
    return dx.astype(x_xD.dtype), dscale.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale, normalised in fp32 as transformers does (`rms_norm`).

    Gemma 3 (`cfg.gemma`): `* (1 + scale)` with scale initialised at 0, the product taken in
    fp32 before the cast back (transformers' Gemma3RMSNorm; the others cast, then multiply).
    """

    def __init__(self, dim: int, eps: float, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = eps
        self.compute_dtype = cfg.compute_dtype
        self.offset = cfg.gemma
        init = _zeros if cfg.gemma else _ones
        self.scale = _param(rngs, init, (dim,), cfg.param_dtype, ("norm",))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        return rms_norm(
            x_BxTxD, self.scale[...], self.eps, self.offset, jnp.dtype(self.compute_dtype)
        )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; K key/value heads shared by N/K query heads each.

    With `cfg.qk_norm` (Qwen3), each head of q and of k is RMS-normalised over head_dim (scales
    `q_norm`, `k_norm` [H], shared by all heads) after the projection and before RoPE, as
    transformers' Qwen3Attention does; the caches then hold normalised, rotated keys.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = cfg.param_dtype
        self.compute_dtype = cfg.compute_dtype
        self.num_kv_heads = k
        self.rope_theta, self.rope_scaling = cfg.rope(layer)
        self.window = cfg.window(layer)  # None: full causal attention
        # Under a layer scan over several kinds of layer (`layer_kind`), the kinds' (window,
        # (RoPE base, scaling)); the call's `kind` picks one (`Transformer._scan_layers`).
        self.kinds = None
        # The kernels scale scores by H^-1/2; Gemma 3's query_pre_attn_scalar^-1/2 differs
        # when that scalar is not H, and is folded into the queries.
        self.query_scale = cfg.score_scale() * math.sqrt(h)
        self.attention = cfg.attention
        self.q_kernel = _param(rngs, _normal, (d, n, h), dt, ("embed", "heads", "head_dim"))
        self.k_kernel = _param(rngs, _normal, (d, k, h), dt, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = _param(rngs, _normal, (d, k, h), dt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = _param(rngs, _normal, (n, h, d), dt, ("heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias = _param(rngs, _zeros, (n, h), dt, ("heads", "head_dim"))
            self.k_bias = _param(rngs, _zeros, (k, h), dt, ("kv_heads", "head_dim"))
            self.v_bias = _param(rngs, _zeros, (k, h), dt, ("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        # LoRA adapters (models/lora.py attaches them; None: the plain projection).
        self.q_lora = self.k_lora = self.v_lora = self.o_lora = nnx.data(None)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, cfg, rngs)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, cfg, rngs)
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x_BTxD, b, t, kernel, bias, axes, adapter=None):
        """x [B*T, D] @ kernel [D, N|K, H] -> [B, T, N|K, H], one matmul contracting D.

        x comes flattened to [B*T, D] once for q, k and v: XLA CPU computes the weight gradient
        of the 3-D einsum "btd,dnh->btnh" (contracting b and t) about 2x slower than the same
        2-D dot (measured, see BENCHMARKS.md), and one flattened x is one residual for the
        backward pass where three reshapes of it would be three (a layer scan stacks each).
        The kernel is contracted in its own shape, so the backward pass keeps the parameter
        itself rather than a reshaped copy of it.
        """
        w = weight(kernel, self.compute_dtype)
        y_BTxNxH = jnp.einsum("md,dnh->mnh", x_BTxD, w)
        y = adapted(y_BTxNxH.reshape(b * t, -1), x_BTxD, adapter).reshape(b, t, *w.shape[1:])
        if bias is not None:
            y = y + weight(bias, self.compute_dtype)
        return constrain(y, axes)

    def __call__(
        self, x_BxTxD, positions_BxT, valid_BxT, layer_cache=None, cache_index=None, kind=None
    ):
        """Returns (out_BxTxD, new_layer_cache). Without a cache, keys are the T inputs. `kind`
        (a traced index into `self.kinds`, under a layer scan over several kinds of layer)
        picks the window and RoPE by `lax.switch` over the rotary embedding and the attention
        alone: the projections and their weights stay outside the switch, whose linearisation
        would otherwise return them (and every other residual of each branch) as stacked
        copies for the backward pass."""
        b, t, d = x_BxTxD.shape
        x_BTxD = x_BxTxD.reshape(b * t, d)
        q_axes = ("batch", "length", "heads", "head_dim")
        q_BxTxNxH = self._project(x_BTxD, b, t, self.q_kernel, self.q_bias, q_axes, self.q_lora)
        kv_axes = ("batch", "length", "kv_heads", "head_dim")
        k_BxTxKxH = self._project(x_BTxD, b, t, self.k_kernel, self.k_bias, kv_axes, self.k_lora)
        v_BxTxKxH = self._project(x_BTxD, b, t, self.v_kernel, self.v_bias, kv_axes, self.v_lora)
        if self.q_norm is not None:  # QK-norm: per head over H, before RoPE
            q_BxTxNxH = self.q_norm(q_BxTxNxH)
            k_BxTxKxH = self.k_norm(k_BxTxKxH)
        if kind is None:
            settings = (self.window, (self.rope_theta, self.rope_scaling))
            out_BxTxNxH, layer_cache = self._attend(
                settings, positions_BxT, valid_BxT, cache_index,
                q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer_cache,
            )  # fmt: skip
        else:
            branches = [
                functools.partial(self._attend, settings, positions_BxT, valid_BxT, cache_index)
                for settings in self.kinds
            ]
            out_BxTxNxH, layer_cache = jax.lax.switch(
                kind, branches, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer_cache
            )
        return self._out(out_BxTxNxH), layer_cache

    def _attend(
        self, settings, positions_BxT, valid_BxT, cache_index, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
        layer_cache,
    ):  # fmt: skip
        """RoPE and attention of one kind of layer, `settings` = (window, (base, scaling)):
        (out [B, T, N, H], the updated layer cache)."""
        window, (theta, scaling) = settings
        t = q_BxTxNxH.shape[1]
        q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, theta, scaling)
        k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, theta, scaling)
        if self.query_scale != 1.0:
            q_BxTxNxH = q_BxTxNxH * jnp.asarray(self.query_scale, q_BxTxNxH.dtype)
        # Keys and values live head-major, [B, K, S, H] (the cache layout too): each of the K
        # heads is then a contiguous [S, H] matrix for the batched matmuls below, and a decode
        # step transposes only its one new slot, never the whole cache.
        k_BxKxTxH = k_BxTxKxH.transpose(0, 2, 1, 3)
        v_BxKxTxH = v_BxTxKxH.transpose(0, 2, 1, 3)

        if layer_cache is None:  # keys are the T inputs: causal over slots 0..T-1
            slots_T = jnp.arange(t)
            impl = kernels.choose(
                self.attention, t=t, g=q_BxTxNxH.shape[2] // self.num_kv_heads, keys=t
            )
            # A window is measured in positions (equal to slot distances for a row's real
            # tokens, which are consecutive here: left or right padding only).
            out_BxTxNxH = kernels.causal(
                impl,
                q_BxTxNxH,
                k_BxKxTxH,
                v_BxKxTxH,
                valid_BxT,
                valid_BxT,
                slots_T,
                slots_T,
                window=window,
                positions=None if window is None else (positions_BxT, positions_BxT),
            )
        else:  # the cache stores the new keys / values in its layout and reads them back
            out_BxTxNxH, layer_cache = layer_cache.attend(
                self.attention,
                q_BxTxNxH,
                k_BxKxTxH,
                v_BxKxTxH,
                valid_BxT,
                cache_index,
                window=window,
                positions_BxT=positions_BxT,
            )
        return out_BxTxNxH, layer_cache

    def _out(self, out_BxTxNxH: jax.Array) -> jax.Array:
        """Output projection [B, T, N, H] -> [B, T, D] (one matmul contracting N and H)."""
        b, t, n, h = out_BxTxNxH.shape
        d = self.o_kernel.shape[-1]
        o_NxHxD = weight(self.o_kernel, self.compute_dtype)  # contracted in its own shape
        out_BTxNxH = out_BxTxNxH.reshape(b * t, n, h)
        out_BTxD = jnp.einsum("mnh,nhd->md", out_BTxNxH, o_NxHxD)
        out_BxTxD = adapted(out_BTxD, out_BTxNxH.reshape(b * t, n * h), self.o_lora)
        return constrain(out_BxTxD.reshape(b, t, d), ("batch", "length", "embed"))


@jax.custom_vjp
def swiglu(gate_xF, up_xF):
    """silu(gate) * up (elementwise). The backward reads only gate and up (one fused pass):
    d gate = d * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))), d up = d * silu(gate)."""
    return jax.nn.silu(gate_xF) * up_xF


def _swiglu_fwd(gate_xF, up_xF):
    return jax.nn.silu(gate_xF) * up_xF, (gate_xF, up_xF)


def _swiglu_bwd(res, d_xF):
    gate_xF, up_xF = res
    dtype = gate_xF.dtype
    acc = jnp.promote_types(dtype, jnp.float32)  # fp64 stays fp64 (tests)
    gate, up, d = gate_xF.astype(acc), up_xF.astype(acc), d_xF.astype(acc)
    sig = jax.nn.sigmoid(gate)
    d_gate = d * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d * gate * sig
    return d_gate.astype(dtype), d_up.astype(up_xF.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _gelu_glu(gate_xF, up_xF):
    return jax.nn.gelu(gate_xF, approximate=True) * up_xF


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def glu_down(gate_BTxF, up_BTxF, down_FxD, gelu: bool, rows: tuple[int, int]):
    """act(gate) * up @ down: the gated MLP's activation and output projection, [B*T, D] from
    gate and up [B*T, F] (`rows` = (B, T); the activation is constrained as [B, T, F]).

    The backward pass keeps gate, up and down, and recomputes the activation (one elementwise
    pass) for the down weight's gradient: autodiff would keep the [B*T, F] activation as well,
    one more buffer per layer, which a layer scan stacks and copies. act: silu (`swiglu`),
    or gelu_tanh (Gemma 3's GeGLU)."""
    return _glu_down_fwd(gate_BTxF, up_BTxF, down_FxD, gelu, rows)[0]


def _glu_hidden(gate_BTxF, up_BTxF, gelu: bool, rows: tuple[int, int]):
    """act(gate) * up [B*T, F], constrained as [B, T, F]."""
    hidden_BTxF = (_gelu_glu if gelu else swiglu)(gate_BTxF, up_BTxF)
    hidden_BxTxF = constrain(hidden_BTxF.reshape(*rows, -1), ("batch", "length", "mlp"))
    return hidden_BxTxF.reshape(hidden_BTxF.shape)


def _glu_down_fwd(gate_BTxF, up_BTxF, down_FxD, gelu, rows):
    hidden_BTxF = _glu_hidden(gate_BTxF, up_BTxF, gelu, rows)
    return hidden_BTxF @ down_FxD, (gate_BTxF, up_BTxF, down_FxD)


def _glu_down_bwd(gelu, rows, res, d_BTxD):
    gate_BTxF, up_BTxF, down_FxD = res
    hidden_BTxF, act_vjp = jax.vjp(lambda g, u: _glu_hidden(g, u, gelu, rows), gate_BTxF, up_BTxF)
    d_BTxD = d_BTxD.astype(hidden_BTxF.dtype)
    d_down_FxD = hidden_BTxF.T @ d_BTxD
    d_hidden_BxTxF = constrain((d_BTxD @ down_FxD.T).reshape(*rows, -1), ("batch", "length", "mlp"))
    d_gate_BTxF, d_up_BTxF = act_vjp(d_hidden_BxTxF.reshape(hidden_BTxF.shape))
    return d_gate_BTxF, d_up_BTxF, d_down_FxD.astype(down_FxD.dtype)


glu_down.defvjp(_glu_down_fwd, _glu_down_bwd)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)); Gemma 3's GeGLU: gelu_tanh instead of silu."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.compute_dtype = cfg.compute_dtype
        self.gelu = cfg.gemma
        self.gate_kernel = _param(rngs, _normal, (d, f), dt, ("embed", "mlp"))
        self.up_kernel = _param(rngs, _normal, (d, f), dt, ("embed", "mlp"))
        self.down_kernel = _param(rngs, _normal, (f, d), dt, ("mlp", "embed"))
        self.gate_lora = self.up_lora = self.down_lora = nnx.data(None)  # LoRA (models/lora.py)
        # Under the layer scan the activation is recomputed in the backward pass (`glu_down`):
        # there every kept buffer is stacked and copied. Unrolled, keeping it costs nothing and
        # recomputing it costs an elementwise pass per layer (~2% of SmolLM2's update here).
        self.recompute_activation = bool(cfg.scan_layers)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        # 2-D matmuls on [B*T, D]: see Attention._project for why not 3-D einsums.
        b, t, d = x_BxTxD.shape
        x_BTxD = x_BxTxD.reshape(b * t, d)
        gate_BTxF = adapted(
            x_BTxD @ weight(self.gate_kernel, self.compute_dtype), x_BTxD, self.gate_lora
        )
        up_BTxF = adapted(x_BTxD @ weight(self.up_kernel, self.compute_dtype), x_BTxD, self.up_lora)
        down_FxD = weight(self.down_kernel, self.compute_dtype)
        plain = self.down_lora is None or not self.down_lora.enabled  # LoRA reads the hidden
        if plain and self.recompute_activation:
            return glu_down(gate_BTxF, up_BTxF, down_FxD, self.gelu, (b, t)).reshape(b, t, d)
        hidden_BTxF = _glu_hidden(gate_BTxF, up_BTxF, self.gelu, (b, t))
        return adapted(hidden_BTxF @ down_FxD, hidden_BTxF, self.down_lora).reshape(b, t, d)


class MoE(nnx.Module):
    """Qwen3-MoE's sparse MLP (`models/moe.py`): a router [D, E] and E SwiGLU experts whose
    weights are stacked [E, ...] (gate and up [E, D, F], down [E, F, D]). Each token goes to its
    top-k experts, weighted by the router's fp32 softmax (renormalised with norm_topk_prob);
    `cfg.moe_dispatch` picks how the tokens reach them (the same values to float tolerance)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, e, dt = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.param_dtype
        self.compute_dtype = cfg.compute_dtype
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.dispatch, self.block = cfg.moe_dispatch, cfg.moe_block
        self.router_kernel = _param(rngs, _normal, (d, e), dt, ("embed", "router"))
        self.gate_kernel = _param(rngs, _normal, (e, d, f), dt, ("expert", "embed", "expert_mlp"))
        self.up_kernel = _param(rngs, _normal, (e, d, f), dt, ("expert", "embed", "expert_mlp"))
        self.down_kernel = _param(rngs, _normal, (e, f, d), dt, ("expert", "expert_mlp", "embed"))
        # LoRA on the experts (models/lora.py ExpertAdapter, `lora.experts`)
        self.gate_lora = self.up_lora = self.down_lora = nnx.data(None)

    def __call__(
        self, x_BxTxD: jax.Array, valid_BxT=None, routing=None
    ) -> tuple[jax.Array, moe_lib.Routes]:
        """(output [B, T, D], the router's decisions: `moe.Routes` of [B, T, K] experts, [B, T]
        entropies and the load over the real tokens (`valid_BxT`, default all) per batch
        shard). `routing` = (experts [B, T, K], mask [B, T], apply [B, T]) is a recorded
        routing (where mask), replayed where apply: those experts, gated by this router's
        probabilities at them (renormalised as the model does), so the router keeps its
        gradient; elsewhere only compared with the router's choice (`Routes.drift`).

        Under a mesh whose batch axes split the rows, each batch shard routes and dispatches
        its own tokens (`shard_map` over those axes; the expert weights enter whole along them,
        as an FSDP layer gathers its weights): sorting the assignments of the global batch
        would gather every token onto every device."""
        cdt = self.compute_dtype
        # Expert LoRA as merged weights W + scale A B per expert (summed in fp32, then cast):
        # exact, and every dispatch, the shard_map and the expert axis see plain [E, ...]
        # weights. It costs E*D*r*F FLOPs per projection, small against the tokens' N*k*D*F
        # in an update (N*k >> E*r); a decode step's few tokens pay it at every step.
        kernels = (
            (self.gate_kernel, self.gate_lora),
            (self.up_kernel, self.up_lora),
            (self.down_kernel, self.down_lora),
        )
        weights = (weight(self.router_kernel, cdt),) + tuple(
            weight(p, cdt) if lo is None or not lo.enabled else lo.merge(p[...], cdt)
            for p, lo in kernels
        )
        routing = () if routing is None else tuple(routing)
        if valid_BxT is None:
            valid_BxT = jnp.ones(x_BxTxD.shape[:2], jnp.bool_)
        axes = _batch_mesh_axes(x_BxTxD.shape[0])
        experts = _expert_shards(axes)
        local = functools.partial(self._local, replay=bool(routing), expert_shards=experts)
        if axes:
            P = jax.sharding.PartitionSpec
            rows, whole = P(axes), P()
            split = P("expert") if experts > 1 else whole  # the experts' [E, ...] over `expert`
            local = jax.shard_map(
                local,
                in_specs=(rows, rows, (whole, split, split, split), (rows,) * len(routing)),
                out_specs=(
                    rows,
                    moe_lib.Routes(rows, rows, moe_lib.Balance(rows, rows, rows), rows),
                ),
                axis_names=set(axes),
            )
        out_BxTxD, routes = local(x_BxTxD, valid_BxT, weights, routing)
        return constrain(out_BxTxD, ("batch", "length", "embed")), routes

    def _local(self, x_BxTxD, valid_BxT, weights, routing, *, replay: bool, expert_shards: int = 1):
        """The routing and dispatch of these rows' tokens (one batch shard's, under a mesh).
        With `expert_shards` > 1 `weights` hold this device's share of the experts, and the
        assignments travel to their experts' devices and back (`moe.exchange`)."""
        router_DxE, *experts = weights
        b, t, d = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(b * t, d)
        # the router's logits in the compute dtype (as transformers), its softmax in fp32
        logits_NxE = x_NxD @ router_DxE
        record, mask, apply = (
            (routing[0].reshape(b * t, -1), *(r.reshape(b * t).astype(bool) for r in routing[1:]))
            if replay
            else (None, None, None)
        )
        gates_NxK, experts_NxK, drift_N = moe_lib.route(
            logits_NxE,
            self.top_k,
            normalize=self.normalize,
            experts_NxK=record,
            replay_N=apply,
            recorded_N=mask,
        )
        gates_NxK = gates_NxK.astype(x_NxD.dtype)
        if expert_shards > 1:
            run = functools.partial(self._dispatch, experts)
            y_NxD = moe_lib.exchange(
                x_NxD,
                gates_NxK,
                experts_NxK,
                lambda rows_RxD, ids_Rx1: run(
                    rows_RxD, jnp.ones(ids_Rx1.shape, x_NxD.dtype), ids_Rx1
                ),
                axis="expert",
                shards=expert_shards,
                local_experts=experts[0].shape[0],
            )
        else:
            y_NxD = self._dispatch(experts, x_NxD, gates_NxK, experts_NxK)
        routes = moe_lib.Routes(
            experts_NxK.reshape(b, t, -1),
            moe_lib.entropy(logits_NxE).reshape(b, t),
            moe_lib.balance(logits_NxE, experts_NxK, valid_BxT.reshape(b * t)),
            drift_N.reshape(b, t),
        )
        return y_NxD.reshape(b, t, d), routes

    def _dispatch(self, experts, x_NxD, gates_NxK, experts_NxK):
        """`cfg.moe_dispatch` of these tokens to `experts` (gate, up, down: [E, ...])."""
        dispatch = moe_lib.resolve(self.dispatch)
        if dispatch == "dense":
            return moe_lib.dense(x_NxD, *experts, gates_NxK, experts_NxK, swiglu)
        if dispatch == "ragged":
            return moe_lib.ragged(x_NxD, *experts, gates_NxK, experts_NxK, swiglu)
        n, k = experts_NxK.shape
        block = moe_lib.block_size(n * k, experts[0].shape[0], self.block)
        return moe_lib.grouped(x_NxD, *experts, gates_NxK, experts_NxK, swiglu, block=block)


def _expert_shards(axes: tuple[str, ...]) -> int:
    """The size of the `expert` mesh axis when it is among the shard_map's `axes`, else 1."""
    if "expert" not in axes:
        return 1
    return jax.sharding.get_abstract_mesh().shape["expert"]


def _batch_mesh_axes(rows: int) -> tuple[str, ...]:
    """The mesh axes the logical axis "batch" splits rows over, in the mesh being traced
    under (`sharding.tracing_mesh`), when they split `rows` evenly into more than one shard;
    () otherwise (no mesh, one shard, or rows that do not divide)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    target = dict(nn.get_logical_axis_rules()).get("batch")
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a in mesh.axis_names)
    split = math.prod(mesh.shape[a] for a in axes)
    return axes if split > 1 and rows % split == 0 else ()


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). Gemma 3 also
    normalises each branch's output: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(d, eps, cfg, rngs)
        self.attn = Attention(cfg, rngs, layer)
        self.post_attn_norm = RMSNorm(d, eps, cfg, rngs) if cfg.gemma else None
        self.mlp_norm = RMSNorm(d, eps, cfg, rngs)
        self.mlp = MoE(cfg, rngs) if cfg.moe_layer(layer) else MLP(cfg, rngs)
        self.post_mlp_norm = RMSNorm(d, eps, cfg, rngs) if cfg.gemma else None

    def __call__(
        self,
        x_BxTxD,
        positions_BxT,
        valid_BxT,
        layer_cache=None,
        cache_index=None,
        routing=None,
        kind=None,
    ):
        """(x [B, T, D], the updated layer cache, the router's `moe.Routes` or None in a dense
        layer); `routing` (experts [B, T, K], mask [B, T], apply [B, T]): an MoE layer's
        recorded experts, replayed where apply (`MoE`); `kind`: the attention's kind of layer
        under a scan over several (`Attention.__call__`)."""
        attn_BxTxD, layer_cache = self.attn(
            self.attn_norm(x_BxTxD), positions_BxT, valid_BxT, layer_cache, cache_index, kind
        )
        if self.post_attn_norm is not None:
            attn_BxTxD = self.post_attn_norm(attn_BxTxD)
        x_BxTxD = x_BxTxD + attn_BxTxD
        routes_BxTxK = None
        if isinstance(self.mlp, MoE):
            mlp_BxTxD, routes_BxTxK = self.mlp(self.mlp_norm(x_BxTxD), valid_BxT, routing)
        else:
            mlp_BxTxD = self.mlp(self.mlp_norm(x_BxTxD))
        if self.post_mlp_norm is not None:
            mlp_BxTxD = self.post_mlp_norm(mlp_BxTxD)
        x_BxTxD = x_BxTxD + mlp_BxTxD
        return constrain(x_BxTxD, ("batch", "length", "embed")), layer_cache, routes_BxTxK


def _join_routes(prefix, rest, *, repeat: int = 1, weight: int | None = None):
    """The routes of a prefix pass ([M, P, J, ...]) and of the pass that continues it
    ([M, B, N, ...]) as one pass over [prefix, continuation] would give them: the prefix's rows
    repeated `repeat` times, and its load counted `weight` times (default `repeat`). None
    without MoE layers."""
    if prefix is None:
        return None
    tile = functools.partial(jnp.repeat, repeats=repeat, axis=1)
    return moe_lib.Routes(
        experts=jnp.concatenate([tile(prefix.experts), rest.experts], axis=2),
        entropy=jnp.concatenate([tile(prefix.entropy), rest.entropy], axis=2),
        balance=moe_lib.combine_balance(
            [(prefix.balance, repeat if weight is None else weight), (rest.balance, 1)]
        ),
        drift=jnp.concatenate([tile(prefix.drift), rest.drift], axis=2),
    )


def _split_replay(routing, prefix_len: int, rows=slice(None)):
    """A `moe.Replay` ([M, B, S, K], [B, S], [B, S]) cut into its prefix's (the given rows'
    first `prefix_len` slots) and the rest's; (None, None) without one."""
    if routing is None:
        return None, None
    experts, mask, apply = routing
    j = prefix_len
    return (
        moe_lib.Replay(experts[:, rows, :j], mask[rows, :j], apply[rows, :j]),
        moe_lib.Replay(experts[:, :, j:], mask[:, j:], apply[:, j:]),
    )


def layer_kind(cfg: ModelConfig, layer: int) -> tuple:
    """What makes a layer attend differently from another: its sliding window and RoPE."""
    return cfg.window(layer), cfg.rope(layer)


def as_layer(block: Block, cfg: ModelConfig, layer: int) -> Block:
    """`block` (one layer's parameters, merged inside the scan) attending as `layer`: its
    static sliding window and RoPE base (the only per-layer settings of a block)."""
    block.attn.window = cfg.window(layer)
    block.attn.rope_theta, block.attn.rope_scaling = cfg.rope(layer)
    return block


def _stack(trees: list):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose parameters are the blocks' stacked along a new leading axis [L, ...],
    named `layers` in their sharding metadata (never split: `sharding.LOGICAL_RULES`)."""
    graphdef, _ = nnx.split(blocks[0])
    state = _stack([nnx.state(b) for b in blocks])
    for _, variable in nnx.to_flat_state(state):
        axes = variable.get_metadata().get("out_sharding")
        if axes is not None:
            variable.set_metadata(out_sharding=("layers", *axes))
    return nnx.merge(graphdef, state)


def unstack_blocks(block: Block, cfg: ModelConfig) -> nnx.List:
    """The L blocks of a stacked one (`stack_blocks`' inverse): layer i's slice of every
    parameter (copies, where a jitted caller takes them), attending as layer i."""
    graphdef, state = nnx.split(block)
    blocks = []
    for i in range(cfg.num_layers):
        layer_state = jax.tree.map(lambda a, i=i: a[i], state)
        for _, variable in nnx.to_flat_state(layer_state):
            axes = variable.get_metadata().get("out_sharding")
            if axes is not None and axes[:1] == ("layers",):
                variable.set_metadata(out_sharding=tuple(axes[1:]))
        blocks.append(as_layer(nnx.merge(graphdef, layer_state), cfg, i))
    return nnx.List(blocks)


class Transformer(nnx.Module):
    """Token ids -> fp32 logits. docs/models.md tabulates the calling conventions.

    Parameters: `embedding` [V, D], `layers[i]` blocks, `final_norm`, and `lm_head` [V, D] when
    embeddings are untied (tied models unembed with `embedding`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embedding = _param(
            rngs, _normal, (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype, ("vocab", "embed")
        )
        blocks = [Block(cfg, rngs, i) for i in range(cfg.num_layers)]
        # scan_layers: one Block whose parameters are stacked [L, ...] (the same values as the
        # unrolled blocks, drawn in the same order), run by one `lax.scan` (`_scan_layers`).
        self.layers = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs,
                _normal,
                (cfg.vocab_size, cfg.hidden_size),
                cfg.param_dtype,
                ("vocab", "embed"),
            )

    def init_cache(self, batch_size: int, max_len: int):
        """An empty `KVCache` per layer: k, v [B, K, S, H] in the compute dtype, valid [B, S];
        with `scan_layers` one `KVCache` whose arrays are stacked [L, ...] (`caches.per_layer`
        maps a function over either form)."""
        cfg = self.config
        empty = lambda: caches.KVCache.empty(
            batch_size, max_len, cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype
        )
        if cfg.scan_layers:
            return jax.tree.map(lambda a: jnp.zeros((cfg.num_layers, *a.shape), a.dtype), empty())
        return [empty() for _ in range(cfg.num_layers)]

    def share_prefix_cache(
        self,
        prefix_cache: list[caches.KVCache],
        group_size: int,
        max_len: int,
        *,
        decode: bool = False,
    ) -> list[caches.SharedPrefixCache]:
        """Decode cache for `group_size` continuations of each of P prefilled prefixes.

        `prefix_cache` is a filled cache of batch P (e.g. the prompts after prefill); row
        p * group_size + r of the result continues prefix p, with `max_len` new-token slots
        (`cache.SharedPrefixCache`). decode=True stores keys and values slot-last for decode
        steps (the sampler's layout); the update's multi-token forward (`hidden_shared_prefix`)
        uses the default one.
        """
        share = lambda c: caches.SharedPrefixCache.share(c, group_size, max_len, slot_last=decode)
        return caches.per_layer(share, prefix_cache)

    def slot_cache(
        self, prefix_cache: list[caches.KVCache], num_slots: int, max_len: int, queues: int = 1
    ) -> list[caches.SlotCache]:
        """Decode cache for `num_slots` continuous-batching slots that each continue one of P
        prefilled prefixes, in `queues` equal queues (`cache.SlotCache`). Calls pass
        `cache_index` as int32 [B], each slot's own write column."""
        share = lambda c: caches.SlotCache.share(c, num_slots, max_len, queues)
        return caches.per_layer(share, prefix_cache)

    def hidden(
        self,
        tokens_BxT,
        positions_BxT=None,
        mask_BxT=None,
        *,
        cache=None,
        cache_index=None,
        routing=None,
        with_routes=False,
    ):
        """Final-norm hidden states [B, T, D] (compute dtype); with a cache returns (hidden, cache).

        mask_BxT: 1/True for real tokens, 0 for padding (default all real).
        positions_BxT: RoPE positions, default cumsum(mask)-1 clipped at 0; required with a cache.
        cache/cache_index: the T new keys/values go to slots [cache_index, cache_index + T);
          the caller keeps cache_index + T <= S (dynamic_update_slice would clamp the start).
          With a `slot_cache`, cache_index is int32 [B]: each row's own write column.
        routing: a recorded routing (`MoE`): `moe.Replay` (experts int [M, B, T, K] of each
          token in each of the M MoE layers, in layer order, the mask [B, T] of the tokens it
          holds for and where it replaces the router's choice), or the experts alone (replayed
          at every token); None routes.
        with_routes: also return the routers' decisions, `moe.Routes` of experts int32
          [M, B, T, K] and entropies fp32 [M, B, T] (None for a model without MoE layers), as
          the last element of a tuple.
        """
        cfg = self.config
        b, t = tokens_BxT.shape
        valid_BxT = jnp.ones((b, t), jnp.bool_) if mask_BxT is None else mask_BxT.astype(bool)
        if routing is not None and not isinstance(routing, moe_lib.Replay):
            every = jnp.ones((b, t), jnp.bool_)
            routing = moe_lib.Replay(routing, every, every)
        if positions_BxT is None:
            if cache is not None:
                raise ValueError("positions_BxT is required with a KV cache (per-row positions).")
            positions_BxT = default_positions(mask_BxT, b, t)
        if cache is not None and cache_index is None:
            raise ValueError("cache_index is required with a KV cache.")
        # mode="clip": out-of-range pad ids (e.g. -1) must not turn into NaN rows, since a NaN
        # value at a masked key would still poison the attention output through 0 * NaN.
        # The lookup stays on each device's slice of the table (FSDP splits it along embed):
        # the token ids (small) are gathered over the fsdp shards, each shard takes its D/fsdp
        # columns of every row, and an all-to-all turns that into batch-split activations. The
        # gradient is the reverse: a scatter-add into the local slice of the master table. No
        # device ever holds the whole [V, D] table or its gradient (constraining the table
        # whole along embed did both: 3 x V x D x 4 bytes of transients at Qwen2.5-7B shapes).
        # Rows are cast after the gather: no compute-dtype copy of [V, D] is made.
        ids_BxT = constrain(tokens_BxT, ("batch_data", "length"))
        x_BxTxD = jnp.take(self.embedding[...], ids_BxT, axis=0, mode="clip")
        x_BxTxD = x_BxTxD.astype(cfg.compute_dtype)
        if cfg.gemma:  # Gemma scales embeddings by sqrt(D), the factor rounded to the dtype
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(cfg.hidden_size), cfg.compute_dtype)
        x_BxTxD = constrain(x_BxTxD, ("batch_data", "length", "embed"))
        x_BxTxD = constrain(x_BxTxD, ("batch", "length", "embed"))
        # remat only matters under differentiation (training); decoding runs the same ops.
        if cfg.scan_layers:
            x_BxTxD, (new_cache, routes) = self._scan_layers(
                x_BxTxD, positions_BxT, valid_BxT, cache, cache_index, routing
            )
        else:
            forward = block_forward_remat if cfg.remat else block_forward
            new_cache, routes, m = [], [], 0
            for layer_index, block in enumerate(self.layers):
                layer_cache = None if cache is None else cache[layer_index]
                replay = None
                if routing is not None and cfg.moe_layer(layer_index):
                    replay, m = (routing.experts[m], routing.mask, routing.apply), m + 1
                x_BxTxD, layer_cache, layer_routes = forward(
                    block, x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index, replay
                )
                new_cache.append(layer_cache)
                if layer_routes is not None:
                    routes.append(layer_routes)
            routes = jax.tree.map(lambda *xs: jnp.stack(xs), *routes) if routes else None
        hidden_BxTxD = self.final_norm(x_BxTxD)
        out = (hidden_BxTxD,) if cache is None else (hidden_BxTxD, new_cache)
        if with_routes:
            out = (*out, routes)
        return out[0] if len(out) == 1 else out

    def _scan_layers(self, x_BxTxD, positions_BxT, valid_BxT, cache, cache_index, routing=None):
        """The stacked blocks over x by one `lax.scan` over the layers (a stacked cache [L, ...]
        scanned alongside, the updated one returned stacked; None without a cache). Layers of
        several kinds (`layer_kind`: Gemma 3's sliding and full layers) share one body: a
        scanned index picks each layer's window and RoPE base by `lax.switch` inside the
        attention, around the rotary embedding and the attention alone (`Attention.__call__`),
        each kind's code there with its static window and base; the scan still slices the
        stacked parameters and cache layer by layer. (A switch around the whole layer would
        return its weights, and the union of both kinds' residuals, as stacked copies for the
        backward pass; a body over a period of layers would index its slice of them, and the
        backward pass would keep those copies of the parameters.)

        `remat`: the body is a `jax.checkpoint`, so the backward pass keeps each layer's inputs
        alone (slices of the scan's own inputs and carry: no copies) and recomputes the layer
        in its iteration of the backward loop; a loop iteration cannot be hoisted, so the
        ordering `models/remat.py` needs for unrolled layers holds by construction."""
        cfg = self.config
        graphdef, state = nnx.split(self.layers)
        layers = range(cfg.num_layers)
        kinds = list(dict.fromkeys(layer_kind(cfg, i) for i in layers))
        kind_L = jnp.asarray([kinds.index(layer_kind(cfg, i)) for i in layers], jnp.int32)

        masks = None if routing is None else (routing.mask, routing.apply)  # every layer's

        def body(x_BxTxD, xs):
            kind, layer_state, layer_cache, replay = xs
            block = nnx.merge(graphdef, layer_state)
            if len(kinds) == 1:
                block, kind = as_layer(block, cfg, 0), None
            else:
                block.attn.kinds = tuple(kinds)
            replay = None if replay is None else (replay, *masks)
            x_BxTxD, layer_cache, routes = block(
                x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index, replay, kind
            )
            return x_BxTxD, (layer_cache, routes)

        if cfg.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        # (every layer is an MoE layer or none is: a mixed pattern is not scanned)
        experts = None if routing is None else routing.experts
        return jax.lax.scan(body, x_BxTxD, (kind_L, state, cache, experts))

    def hidden_shared_prefix(
        self,
        tokens_BxS,
        mask_BxS,
        *,
        prefix_len: int,
        group_size: int,
        routing=None,
        with_routes=False,
    ):
        """`hidden(tokens_BxS, None, mask_BxS)` for rows that share their prefix in groups.

        Rows come in groups of `group_size` consecutive rows whose first `prefix_len` tokens
        and mask entries are identical (the G responses of one prompt, prompt left-padded to
        `prefix_len`). The prefix is run once per group and its keys / values are shared by the
        group's rows, as in sampling (`share_prefix_cache`), so a forward + backward over the
        rollout batch skips (G - 1) / G of the prompt tokens' work; gradients through the
        shared prefix sum over the group. Same values as `hidden` (fp32 rounding aside);
        returns final-norm hidden states [B, S, D], the prefix slots repeated per row.
        `routing`: a `moe.Replay` of the whole rows, as `hidden`'s (each group's prefix
        replayed from its first row).
        `with_routes`: (hidden, routes) with the routes laid out as `hidden`'s would be (the
        prefix's repeated per row, its load counted once per row); routes is None without
        MoE layers.
        """
        b, s = tokens_BxS.shape
        g, j = group_size, prefix_len
        if b % g or not 0 < j < s:
            raise ValueError(
                f"hidden_shared_prefix needs rows in whole groups of {g} (got {b}) and "
                f"0 < prefix_len < {s} (got {j})."
            )
        positions_BxS = default_positions(mask_BxS, b, s)
        valid_BxS = mask_BxS.astype(bool)
        p = b // g
        prefix_replay, rest_replay = _split_replay(routing, j, slice(None, None, g))
        prefix_PxJxD, cache, *prefix_routes = self.hidden(
            tokens_BxS[::g, :j],
            positions_BxS[::g, :j],
            valid_BxS[::g, :j],
            cache=self.init_cache(p, j),
            cache_index=0,
            routing=prefix_replay,
            with_routes=with_routes,
        )
        cache = self.share_prefix_cache(cache, g, s - j)
        new_BxNxD, _, *new_routes = self.hidden(
            tokens_BxS[:, j:],
            positions_BxS[:, j:],
            valid_BxS[:, j:],
            cache=cache,
            cache_index=0,
            routing=rest_replay,
            with_routes=with_routes,
        )
        hidden_BxSxD = jnp.concatenate([jnp.repeat(prefix_PxJxD, g, axis=0), new_BxNxD], axis=1)
        if not with_routes:
            return hidden_BxSxD
        return hidden_BxSxD, _join_routes(prefix_routes[0], new_routes[0], repeat=g)

    def hidden_packed(
        self,
        tokens_RxS,
        mask_RxS,
        positions_RxS,
        segments_RxW,
        *,
        prefix_len: int,
        prefix_copies: int = 1,
        routing=None,
        with_routes=False,
    ):
        """Final-norm hidden states [R, S, D] of packed rows: row r is a prefix of
        `prefix_len` slots (left-padded) followed by several continuations back to back, each
        with its own segment id (`segments_RxW`, W = S - prefix_len, ids non-decreasing along
        the row, padding last with the largest id) and its own RoPE positions (given: each
        continuation restarts after the prefix). Each continuation sees the prefix and itself
        only (`cache.PackedPrefixCache`), so a token's hidden state is the one it has in an
        unpacked row [prefix, its continuation] (fp32 rounding aside): the update runs a
        group's G responses behind one copy of its prompt with no padding between them.
        `routing`: a `moe.Replay` in the packed layout ([M, R, S, K], [R, S]).
        `with_routes`: (hidden, routes) in the packed layout, the prefix's load counted
        `prefix_copies` times (G: as often as the unpacked rows hold it).
        """
        j = prefix_len
        r = tokens_RxS.shape[0]
        valid_RxS = mask_RxS.astype(bool)
        prefix_replay, rest_replay = _split_replay(routing, j)
        prefix_RxJxD, cache, *prefix_routes = self.hidden(
            tokens_RxS[:, :j],
            positions_RxS[:, :j],
            valid_RxS[:, :j],
            cache=self.init_cache(r, j),
            cache_index=0,
            routing=prefix_replay,
            with_routes=with_routes,
        )
        packed = caches.per_layer(lambda c: caches.PackedPrefixCache.share(c, segments_RxW), cache)
        new_RxWxD, _, *new_routes = self.hidden(
            tokens_RxS[:, j:],
            positions_RxS[:, j:],
            valid_RxS[:, j:],
            cache=packed,
            cache_index=0,
            routing=rest_replay,
            with_routes=with_routes,
        )
        hidden_RxSxD = jnp.concatenate([prefix_RxJxD, new_RxWxD], axis=1)
        if not with_routes:
            return hidden_RxSxD
        routes = _join_routes(prefix_routes[0], new_routes[0], weight=prefix_copies)
        return hidden_RxSxD, routes

    def unembed_matrix(self) -> jax.Array:
        """[V, D] output projection (the embedding when tied), in the compute dtype."""
        table = self.embedding if self.lm_head is None else self.lm_head
        return weight(table, self.config.compute_dtype)

    def unembed(self, hidden_xD: jax.Array) -> jax.Array:
        """Hidden states [..., D] -> fp32 logits [..., V] (fp32 accumulation in bf16 compute)."""
        logits = jnp.einsum(
            "...d,vd->...v", hidden_xD, self.unembed_matrix(), preferred_element_type=jnp.float32
        )
        return logits.astype(jnp.float32)

    def __call__(
        self,
        tokens_BxT,
        positions_BxT=None,
        mask_BxT=None,
        *,
        cache=None,
        cache_index=None,
        routing=None,
        with_routes=False,
    ):
        """fp32 logits [B, T, V]; with a cache returns (logits, updated cache); `routing` and
        `with_routes` as `hidden`'s (the routes appended last)."""
        out = self.hidden(
            tokens_BxT,
            positions_BxT,
            mask_BxT,
            cache=cache,
            cache_index=cache_index,
            routing=routing,
            with_routes=with_routes,
        )
        out = out if isinstance(out, tuple) else (out,)
        logits = constrain(self.unembed(out[0]), ("batch", "length", "vocab"))
        return logits if len(out) == 1 else (logits, *out[1:])

    def num_params(self) -> int:
        """Total number of parameters (tied embeddings counted once)."""
        return param_count(self)


def param_count(model: nnx.Module) -> int:
    """Number of scalars in the model's nnx.Param variables (works on abstract models too)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(x.shape) for x in leaves)


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct parameters (no memory): for shape checks and loading.
    Each call returns a new module; the traced structure is cached per config (tracing the
    constructor of a 28-layer 7B model takes ~2 s, and the planner asks for it several times)."""
    graphdef, state = _abstract_split(cfg)
    return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=32)
def _abstract_split(cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=KeyStream(jax.random.key(0)))))


def unstacked(model: Transformer) -> Transformer:
    """A model with stacked blocks (`scan_layers`) as the same model with L separate blocks
    (`scan_layers=False`): the same function, run unrolled. The sampler calls it once per call
    when `scan_decode` is off, before its decode loop, so the slices are taken once rather than
    at every decode step (XLA CPU copies a scan's dynamic slice of each layer's weights and
    cache before its matmuls: 1.3x bench-45m's decode, 2-3x SmolLM2's rollout). The caller's
    model is not changed; LoRA adapters are sliced with their kernels."""
    cfg = model.config
    if not cfg.scan_layers:
        return model
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    copy.layers = unstack_blocks(copy.layers, cfg)
    copy.config = cfg.replace(scan_layers=False)
    return copy


def with_config(model: Transformer, **changes) -> Transformer:
    """The same parameters (shared, not copied) under a config with `changes` to fields that do
    not change parameter shapes (compute_dtype, attention, remat, scan_decode)."""
    cfg = model.config.replace(**changes)
    if cfg == model.config:
        return model
    if cfg.scan_layers != model.config.scan_layers:
        raise ValueError(
            "with_config cannot change scan_layers (the parameters' layout); build or load the "
            "model with the layout wanted (from_pretrained / from_gguf take scan_layers)."
        )
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, nnx.state(model))


def cast_floating(tree, dtype):
    """Every floating leaf of `tree` (parameters) cast to `dtype`; other leaves as they are. What
    the sampler does to the masters before decoding, and what a copy in the compute dtype is."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def with_compute_dtype(model: Transformer, dtype) -> Transformer:
    """The same parameters (shared, not copied) computing in `dtype`: e.g. a bf16-compute view of
    fp32 masters, for evaluation or for comparing precisions."""
    return with_config(model, compute_dtype=str(jnp.dtype(dtype)))
