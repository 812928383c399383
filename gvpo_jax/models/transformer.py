"""Decoder-only transformer (Qwen2/Qwen2.5, Llama) in Flax NNX, with a per-layer KV cache."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from gvpo_jax.models import attention as kernels
from gvpo_jax.models import fused
from gvpo_jax.models.config import ModelConfig

# Logical axis names. Parameters carry them as `out_sharding` metadata (read them with
# `nnx.get_partition_spec(state)` under `nnx.logical_axis_rules(rules)`); activations are
# constrained with them, which is a no-op unless logical axis rules and a mesh are active.
PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm")
ACTIVATION_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")
CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")
# Decode caches store keys and values slot-last, [.., K, H, S] (see `share_prefix_cache`).
DECODE_CACHE_AXES = ("batch", "kv_heads", "head_dim", "cache_length")


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


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names (no-op without axis rules and a mesh)."""
    return with_logical_constraint(x, axes)


def attention_mask(
    valid_BxS: jax.Array, query_slot_T: jax.Array, key_slot_S: jax.Array
) -> jax.Array:
    """bool [B, T, S]: query t sees key s iff key s is valid and not in the future (s <= t).

    The single definition of the mask for both the full forward (slots = 0..T-1) and the cached
    forward (query slots i..i+T-1 against cache slots 0..S-1).
    """
    causal_TxS = key_slot_S[None, :] <= query_slot_T[:, None]
    return valid_BxS[:, None, :] & causal_TxS[None, :, :]


def default_positions(mask_BxT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """int32 [B, T]: cumsum(mask) - 1 clipped at 0 (left or right padding), else arange(T)."""
    if mask_BxT is None:
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1) - 1, 0)


def rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half convention of transformers; angles computed in fp32."""
    head_dim = x_BxTxNxH.shape[-1]
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_F
    angles_BxTx1xH = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BxTx1xH), jnp.sin(angles_BxTx1xH)
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale, normalised in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = eps
        self.compute_dtype = cfg.compute_dtype
        self.scale = _param(rngs, _ones, (dim,), cfg.storage_dtype, ("norm",))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x = x_BxTxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return weight(self.scale, self.compute_dtype) * x.astype(x_BxTxD.dtype)


def _two_part_softmax(pre_scores, pre_mask, new_scores, new_mask):
    """Unnormalised softmax weights over two key sets (a shared prefix and a row's own new
    tokens) without concatenating them: masked scores, one max over both, exp, and the shared
    denominator [..., 1]. Returns (pre_weights, new_weights, total)."""
    pre_scores = jnp.where(pre_mask, pre_scores, fused.MASKED)
    new_scores = jnp.where(new_mask, new_scores, fused.MASKED)
    top = jnp.maximum(
        jnp.max(pre_scores, axis=-1, keepdims=True), jnp.max(new_scores, axis=-1, keepdims=True)
    )
    pre_weights, new_weights = jnp.exp(pre_scores - top), jnp.exp(new_scores - top)
    total = jnp.sum(pre_weights, axis=-1, keepdims=True) + jnp.sum(
        new_weights, axis=-1, keepdims=True
    )
    return pre_weights, new_weights, total


def _write_group_slots(cache, k_BxKxTxH, v_BxKxTxH, valid_BxT, index, p: int, slot_last: bool):
    """Store T new keys/values of B = P * R rows at new-token slot `index` of a shared-prefix
    cache: 'k'/'v' [P, K, R, S, H], or with `slot_last` the decode cache's 'kT'/'vT'
    [P, K, R, H, S]. Also marks the slots' validity ('valid' [B, S]). Returns the cache."""
    b, kv, t, h = k_BxKxTxH.shape
    r = b // p
    zero = jnp.zeros((), jnp.int32)
    names = ("kT", "vT") if slot_last else ("k", "v")

    def write(buf, new_BxKxTxH):
        new = new_BxKxTxH.reshape(p, r, kv, t, h).transpose(0, 2, 1, 3, 4)  # [P, K, R, T, H]
        start = (zero, zero, zero, index, zero)
        if slot_last:
            new, start = new.swapaxes(3, 4), (zero, zero, zero, zero, index)
        return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), start)

    return {
        **cache,
        names[0]: write(cache[names[0]], k_BxKxTxH),
        names[1]: write(cache[names[1]], v_BxKxTxH),
        "valid": jax.lax.dynamic_update_slice(cache["valid"], valid_BxT, (zero, index)),
    }


def _prefix_queries(q_BxTxNxH, p: int, kv: int) -> jax.Array:
    """Queries of B = P * R rows continuing P prefixes as [P, K, R, T * G, H], scaled by
    1/sqrt(H): per prefix and key/value head, each row's T * G query rows (t, then g)."""
    b, t, n, h = q_BxTxNxH.shape
    r, g = b // p, n // kv
    q_PxKxRxQxH = q_BxTxNxH.reshape(p, r, t, kv, g, h).transpose(0, 3, 1, 2, 4, 5)
    return q_PxKxRxQxH.reshape(p, kv, r, t * g, h) * (1.0 / math.sqrt(h))


def _prefix_softmax(pre_PxKxRxQxJ, new_PxKxRxQxS, prefix_valid_PxJ, valid_BxS, index, t: int):
    """`_two_part_softmax` of rows continuing shared prefixes. Every prefix key is in the past
    of every new token, so only its validity masks it; a new slot is seen by query t when it is
    valid and at most slot index + t."""
    p, _, r, q, s = new_PxKxRxQxS.shape
    g = q // t
    pre_mask_Px1x1x1xJ = prefix_valid_PxJ[:, None, None, None, :]
    causal_TxS = jnp.arange(s)[None, :] <= (index + jnp.arange(t))[:, None]
    new_mask_PxRxTxS = valid_BxS.reshape(p, r, 1, s) & causal_TxS
    new_mask_Px1xRxQxS = jnp.broadcast_to(
        new_mask_PxRxTxS[:, None, :, :, None, :], (p, 1, r, t, g, s)
    ).reshape(p, 1, r, q, s)
    return _two_part_softmax(pre_PxKxRxQxJ, pre_mask_Px1x1x1xJ, new_PxKxRxQxS, new_mask_Px1xRxQxS)


def _prefix_rows(out_PxKxRxQxH, t: int) -> jax.Array:
    """[P, K, R, T * G, H] -> [B, T, N, H] (the inverse of `_prefix_queries`' layout)."""
    p, kv, r, q, h = out_PxKxRxQxH.shape
    g = q // t
    out = out_PxKxRxQxH.reshape(p, kv, r, t, g, h).transpose(0, 2, 3, 1, 4, 5)
    return out.reshape(p * r, t, kv * g, h)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; K key/value heads shared by N/K query heads each."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = cfg.storage_dtype
        self.compute_dtype = cfg.compute_dtype
        self.num_kv_heads = k
        self.rope_theta = cfg.rope_theta
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

    def _project(self, x_BxTxD, kernel, bias, axes):
        """x @ kernel [D, N|K, H] -> [B, T, N|K, H], as one 2-D matmul on [B*T, D].

        XLA CPU computes the weight gradient of the 3-D einsum "btd,dnh->btnh" (contracting b
        and t) about 2x slower than the same 2-D dot (measured, see BENCHMARKS.md).
        """
        b, t, d = x_BxTxD.shape
        w = weight(kernel, self.compute_dtype)
        y = (x_BxTxD.reshape(b * t, d) @ w.reshape(d, -1)).reshape(b, t, *w.shape[1:])
        if bias is not None:
            y = y + weight(bias, self.compute_dtype)
        return constrain(y, axes)

    def __call__(self, x_BxTxD, positions_BxT, valid_BxT, layer_cache=None, cache_index=None):
        """Returns (out_BxTxD, new_layer_cache). Without a cache, keys are the T inputs."""
        b, t, d = x_BxTxD.shape
        q_BxTxNxH = self._project(
            x_BxTxD, self.q_kernel, self.q_bias, ("batch", "length", "heads", "head_dim")
        )
        kv_axes = ("batch", "length", "kv_heads", "head_dim")
        k_BxTxKxH = self._project(x_BxTxD, self.k_kernel, self.k_bias, kv_axes)
        v_BxTxKxH = self._project(x_BxTxD, self.v_kernel, self.v_bias, kv_axes)
        q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, self.rope_theta)
        k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, self.rope_theta)
        # Keys and values live head-major, [B, K, S, H] (the cache layout too): each of the K
        # heads is then a contiguous [S, H] matrix for the batched matmuls below, and a decode
        # step transposes only its one new slot, never the whole cache.
        k_BxKxTxH = k_BxTxKxH.transpose(0, 2, 1, 3)
        v_BxKxTxH = v_BxTxKxH.transpose(0, 2, 1, 3)

        if layer_cache is not None and "prefix_index" in layer_cache:
            out_BxTxNxH, layer_cache = self._attend_slots(
                q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, layer_cache, cache_index
            )
            return self._out(out_BxTxNxH), layer_cache
        if layer_cache is not None and "prefix_kT" in layer_cache:
            out_BxTxNxH, layer_cache = self._decode_shared_prefix(
                q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, valid_BxT, layer_cache, cache_index
            )
            return self._out(out_BxTxNxH), layer_cache
        if layer_cache is not None and "prefix_k" in layer_cache:
            out_BxTxNxH, layer_cache = self._attend_shared_prefix(
                q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, valid_BxT, layer_cache, cache_index
            )
            return self._out(out_BxTxNxH), layer_cache
        if layer_cache is None:
            k_BxKxSxH, v_BxKxSxH, valid_BxS = k_BxKxTxH, v_BxKxTxH, valid_BxT
            query_slot_T = key_slot_S = jnp.arange(t)
        else:
            i = jnp.asarray(cache_index, jnp.int32)
            zero = jnp.zeros((), jnp.int32)
            write = lambda buf, new: jax.lax.dynamic_update_slice(
                buf, new.astype(buf.dtype), (zero, zero, i, zero)
            )
            k_BxKxSxH = write(layer_cache["k"], k_BxKxTxH)
            v_BxKxSxH = write(layer_cache["v"], v_BxKxTxH)
            valid_BxS = jax.lax.dynamic_update_slice(layer_cache["valid"], valid_BxT, (zero, i))
            layer_cache = {**layer_cache, "k": k_BxKxSxH, "v": v_BxKxSxH, "valid": valid_BxS}
            query_slot_T = i + jnp.arange(t)
            key_slot_S = jnp.arange(k_BxKxSxH.shape[2])
        n, h = q_BxTxNxH.shape[2:]
        kv = self.num_kv_heads
        g = n // kv
        impl = self._impl(t, g, k_BxKxSxH.shape[2])
        if impl != "dense":
            out_BxTxNxH = kernels.causal(
                impl, q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, valid_BxT, valid_BxS, query_slot_T,
                key_slot_S, cache_index=0 if layer_cache is None else cache_index,
            )  # fmt: skip
            return self._out(out_BxTxNxH), layer_cache
        mask_BxTxS = attention_mask(valid_BxS, query_slot_T, key_slot_S)
        # The G query heads sharing a key/value head are stacked along the query axis, so the
        # scores and the weighted sum are plain batched matmuls over (B, K): Q = G * T rows.
        q_BxKxQxH = (
            q_BxTxNxH.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
        )
        out_BxKxQxH = fused.attention(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS)
        out_BxTxNxH = out_BxKxQxH.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4)
        return self._out(out_BxTxNxH.reshape(b, t, n, h)), layer_cache

    def _impl(self, t: int, g: int, keys: int) -> str:
        """The kernel for T query tokens x `keys` keys: dense for a decode step (T = 1)."""
        if t == 1:
            return "dense"
        return kernels.resolve(self.attention, q_rows=t * g, keys=keys)

    def _out(self, out_BxTxNxH: jax.Array) -> jax.Array:
        """Output projection [B, T, N, H] -> [B, T, D] (one 2-D matmul)."""
        b, t, n, h = out_BxTxNxH.shape
        d = self.o_kernel.shape[-1]
        o_NHxD = weight(self.o_kernel, self.compute_dtype).reshape(n * h, d)
        out_BxTxD = out_BxTxNxH.reshape(b * t, n * h) @ o_NHxD
        return constrain(out_BxTxD.reshape(b, t, d), ("batch", "length", "embed"))

    def _attend_shared_prefix(self, q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, valid_BxT, cache, index):
        """Attention of B = P * R rows that continue P shared prefixes (see `share_prefix_cache`).

        Row p*R + r attends to the J keys of prefix p (stored once, [P, K, J, H]) and to its own
        new-token slots (stored [P, K, R, S, H]). Queries are laid out [P, K, R, Q, H] with the
        Q = T * G query heads of a key/value head as rows, so both score matmuls and both value
        matmuls are batched over (P, K) or (P, K, R) with no transpose of keys or values, and
        the softmax runs over the two parts without concatenating them (fewer kernels per
        decode step than stacking rows per prefix and back; the same speed in CPU A/B runs).
        Returns (out [B, T, N, H], updated cache).
        """
        b, t, n, h = q_BxTxNxH.shape
        pk_PxKxJxH, pv_PxKxJxH = cache["prefix_k"], cache["prefix_v"]
        p, kv, j = pk_PxKxJxH.shape[:3]
        r, g = b // p, n // kv
        i = jnp.asarray(index, jnp.int32)
        cache = _write_group_slots(cache, k_BxKxTxH, v_BxKxTxH, valid_BxT, i, p, slot_last=False)
        k_PxKxRxSxH, v_PxKxRxSxH, valid_BxS = cache["k"], cache["v"], cache["valid"]
        s = k_PxKxRxSxH.shape[3]
        impl = self._impl(t, g, j + s)
        if impl != "dense":
            out_BxTxNxH = kernels.shared_prefix(
                impl, q_BxTxNxH, pk_PxKxJxH, pv_PxKxJxH, cache["prefix_valid"], k_PxKxRxSxH,
                v_PxKxRxSxH, valid_BxT, valid_BxS, index,
            )  # fmt: skip
            return out_BxTxNxH, cache

        q_PxKxRxQxH = _prefix_queries(q_BxTxNxH, p, kv)
        pre_PxKxRxQxJ = jnp.einsum(
            "pkxh,pkjh->pkxj",
            q_PxKxRxQxH.reshape(p, kv, -1, h),
            pk_PxKxJxH,
            preferred_element_type=jnp.float32,
        ).reshape(p, kv, r, t * g, j)
        new_PxKxRxQxS = jnp.einsum(
            "pkrqh,pkrsh->pkrqs", q_PxKxRxQxH, k_PxKxRxSxH, preferred_element_type=jnp.float32
        )
        pre_PxKxRxQxJ, new_PxKxRxQxS, total_PxKxRxQx1 = _prefix_softmax(
            pre_PxKxRxQxJ, new_PxKxRxQxS, cache["prefix_valid"], valid_BxS, i, t
        )
        dtype = v_PxKxRxSxH.dtype
        out_PxKxRxQxH = jnp.einsum(
            "pkxj,pkjh->pkxh",
            pre_PxKxRxQxJ.astype(dtype).reshape(p, kv, -1, j),
            pv_PxKxJxH,
            preferred_element_type=jnp.float32,
        ).reshape(p, kv, r, t * g, h) + jnp.einsum(
            "pkrqs,pkrsh->pkrqh",
            new_PxKxRxQxS.astype(dtype),
            v_PxKxRxSxH,
            preferred_element_type=jnp.float32,
        )
        out_PxKxRxQxH = (out_PxKxRxQxH / total_PxKxRxQx1).astype(dtype)
        return _prefix_rows(out_PxKxRxQxH, t), cache

    def _decode_shared_prefix(self, q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, valid_BxT, cache, index):
        """`_attend_shared_prefix` on a decode cache (`share_prefix_cache(..., decode=True)`):
        keys and values stored slot-last, prefixes [P, K, H, J] and new-token slots
        [P, K, R, H, S]. Always the dense path: a decode step has one query per row.

        At a decode step attention reads the whole cache for a few query rows. With the slots
        last, the score matmul contracts the head width against [H, S] and the value matmul
        produces the transposed output [H, Q] from [H, S]: both stream the cache in its storage
        order, which on CPU ran 2.1-2.4x faster than the [S, H] layout at S = 2048 (XLA CPU
        transposes an [S, H] operand for these shapes). Same values as the [S, H] path up to
        fp32 summation order. Returns (out [B, T, N, H], updated cache).
        """
        b, t, n, h = q_BxTxNxH.shape
        pk_PxKxHxJ, pv_PxKxHxJ = cache["prefix_kT"], cache["prefix_vT"]
        p, kv, _, j = pk_PxKxHxJ.shape
        r, g = b // p, n // kv
        i = jnp.asarray(index, jnp.int32)
        cache = _write_group_slots(cache, k_BxKxTxH, v_BxKxTxH, valid_BxT, i, p, slot_last=True)
        k_PxKxRxHxS, v_PxKxRxHxS, valid_BxS = cache["kT"], cache["vT"], cache["valid"]
        q_PxKxRxQxH = _prefix_queries(q_BxTxNxH, p, kv)
        pre_PxKxRxQxJ = jnp.einsum(
            "pkxh,pkhj->pkxj",
            q_PxKxRxQxH.reshape(p, kv, -1, h),
            pk_PxKxHxJ,
            preferred_element_type=jnp.float32,
        ).reshape(p, kv, r, t * g, j)
        new_PxKxRxQxS = jnp.einsum(
            "pkrqh,pkrhs->pkrqs", q_PxKxRxQxH, k_PxKxRxHxS, preferred_element_type=jnp.float32
        )
        pre_PxKxRxQxJ, new_PxKxRxQxS, total_PxKxRxQx1 = _prefix_softmax(
            pre_PxKxRxQxJ, new_PxKxRxQxS, cache["prefix_valid"], valid_BxS, i, t
        )
        dtype = v_PxKxRxHxS.dtype
        pre_PxKxHxX = jnp.einsum(
            "pkhj,pkxj->pkhx",
            pv_PxKxHxJ,
            pre_PxKxRxQxJ.astype(dtype).reshape(p, kv, -1, j),
            preferred_element_type=jnp.float32,
        )
        new_PxKxRxHxQ = jnp.einsum(
            "pkrhs,pkrqs->pkrhq",
            v_PxKxRxHxS,
            new_PxKxRxQxS.astype(dtype),
            preferred_element_type=jnp.float32,
        )
        out_PxKxRxHxQ = pre_PxKxHxX.reshape(p, kv, h, r, t * g).transpose(0, 1, 3, 2, 4)
        out_PxKxRxQxH = (out_PxKxRxHxQ + new_PxKxRxHxQ).swapaxes(3, 4)
        out_PxKxRxQxH = (out_PxKxRxQxH / total_PxKxRxQx1).astype(dtype)
        return _prefix_rows(out_PxKxRxQxH, t), cache

    def _attend_slots(self, q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, cache, index_B):
        """Attention of B decode slots, each continuing one of P stored prefixes (`slot_cache`).

        Slot b attends to the J keys of the prefix it points at (a gather of [K, H, J] per slot
        from the prefixes stored once, [P, K, H, J]) and to its own new-token columns
        0 .. index_B[b] + t (stored [B, K, H, C]: slot-last, as in `_decode_shared_prefix`).
        The T new keys/values of slot b go to its columns [index_B[b], index_B[b] + T): every
        slot writes at its own column, so a slot that takes a new item restarts at column 0,
        and the columns beyond its write index, which hold an earlier item's keys, are masked
        by position (no reset needed).

        `cache["prefix_index"]` is int32 [D, B / D]: slot d * (B / D) + i continues prefix
        d * (P / D) + prefix_index[d, i]. Prefixes and slots come in D equal groups (a mesh's
        row shards) and a gather never crosses groups, so with the D axis split over the mesh
        each shard reads only its own prefixes. The softmax runs over the two parts without
        concatenating them, as in `_attend_shared_prefix`. Returns (out [B, T, N, H], cache).
        """
        b, t, n, h = q_BxTxNxH.shape
        pk_PxKxHxJ, pv_PxKxHxJ = cache["prefix_kT"], cache["prefix_vT"]
        p, kv, _, j = pk_PxKxHxJ.shape
        index_DxS = cache["prefix_index"]
        d = index_DxS.shape[0]
        g = n // kv

        def gather(x_Px):  # [P, ...] -> [B, ...]: each slot's own prefix, within its group
            x_DxPx = x_Px.reshape(d, p // d, *x_Px.shape[1:])
            return jax.vmap(lambda x, i: x[i])(x_DxPx, index_DxS).reshape(b, *x_Px.shape[1:])

        pk_BxKxHxJ = constrain(gather(pk_PxKxHxJ), DECODE_CACHE_AXES)
        pv_BxKxHxJ = constrain(gather(pv_PxKxHxJ), DECODE_CACHE_AXES)
        pre_valid_BxJ = gather(cache["prefix_valid"])
        i_B = jnp.broadcast_to(jnp.asarray(index_B, jnp.int32), (b,))

        def write(buf_BxKxHxC, new_BxKxTxH):
            put = lambda buf, new, i: jax.lax.dynamic_update_slice(buf, new, (0, 0, i))
            new_BxKxHxT = new_BxKxTxH.swapaxes(2, 3).astype(buf_BxKxHxC.dtype)
            return jax.vmap(put)(buf_BxKxHxC, new_BxKxHxT, i_B)

        k_BxKxHxC = write(cache["kT"], k_BxKxTxH)
        v_BxKxHxC = write(cache["vT"], v_BxKxTxH)
        cache = {**cache, "kT": k_BxKxHxC, "vT": v_BxKxHxC}
        c = k_BxKxHxC.shape[3]

        # Query rows per key/value head in the order of `_decode_shared_prefix` (t, then g), so
        # a slot's arithmetic matches the static sampler's step for step.
        q_BxKxQxH = (
            q_BxTxNxH.reshape(b, t, kv, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, h)
        ) * (1.0 / math.sqrt(h))
        pre_BxKxQxJ = jnp.einsum(
            "bkqh,bkhj->bkqj", q_BxKxQxH, pk_BxKxHxJ, preferred_element_type=jnp.float32
        )
        new_BxKxQxC = jnp.einsum(
            "bkqh,bkhc->bkqc", q_BxKxQxH, k_BxKxHxC, preferred_element_type=jnp.float32
        )
        seen_BxTxC = jnp.arange(c)[None, None, :] <= (i_B[:, None] + jnp.arange(t))[:, :, None]
        new_mask_Bx1xQxC = jnp.broadcast_to(
            seen_BxTxC[:, None, :, None, :], (b, 1, t, g, c)
        ).reshape(b, 1, t * g, c)
        pre_BxKxQxJ, new_BxKxQxC, total_BxKxQx1 = _two_part_softmax(
            pre_BxKxQxJ, pre_valid_BxJ[:, None, None, :], new_BxKxQxC, new_mask_Bx1xQxC
        )
        dtype = v_BxKxHxC.dtype
        out_BxKxHxQ = jnp.einsum(
            "bkhj,bkqj->bkhq",
            pv_BxKxHxJ,
            pre_BxKxQxJ.astype(dtype),
            preferred_element_type=jnp.float32,
        ) + jnp.einsum(
            "bkhc,bkqc->bkhq",
            v_BxKxHxC,
            new_BxKxQxC.astype(dtype),
            preferred_element_type=jnp.float32,
        )
        out_BxKxQxH = (out_BxKxHxQ.swapaxes(2, 3) / total_BxKxQx1).astype(dtype)
        out_BxTxNxH = out_BxKxQxH.reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4)
        return out_BxTxNxH.reshape(b, t, n, h), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.storage_dtype
        self.compute_dtype = cfg.compute_dtype
        self.gate_kernel = _param(rngs, _normal, (d, f), dt, ("embed", "mlp"))
        self.up_kernel = _param(rngs, _normal, (d, f), dt, ("embed", "mlp"))
        self.down_kernel = _param(rngs, _normal, (f, d), dt, ("mlp", "embed"))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        # 2-D matmuls on [B*T, D]: see Attention._project for why not 3-D einsums.
        b, t, d = x_BxTxD.shape
        x_BTxD = x_BxTxD.reshape(b * t, d)
        gate_BTxF = x_BTxD @ weight(self.gate_kernel, self.compute_dtype)
        up_BTxF = x_BTxD @ weight(self.up_kernel, self.compute_dtype)
        hidden_BxTxF = fused.swiglu(gate_BTxF, up_BTxF).reshape(b, t, -1)
        hidden_BxTxF = constrain(hidden_BxTxF, ("batch", "length", "mlp"))
        down_FxD = weight(self.down_kernel, self.compute_dtype)
        return (hidden_BxTxF.reshape(b * t, -1) @ down_FxD).reshape(b, t, d)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, valid_BxT, layer_cache=None, cache_index=None):
        attn_BxTxD, layer_cache = self.attn(
            self.attn_norm(x_BxTxD), positions_BxT, valid_BxT, layer_cache, cache_index
        )
        x_BxTxD = x_BxTxD + attn_BxTxD
        x_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))
        return constrain(x_BxTxD, ("batch", "length", "embed")), layer_cache


def _block_forward(block, x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index):
    return block(x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _block_forward_remat(block, x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index):
    """`_block_forward` recomputed in the backward pass, in layer order.

    Like `nnx.remat`, the forward keeps only the block's inputs. Unlike it, the recomputation
    cannot start before the cotangent of the block's output exists: a zero computed from that
    cotangent is added to the saved inputs and to the parameters before they are used again.
    `jax.checkpoint` orders nothing after the cotangent, and its optimization barriers are
    dropped before XLA CPU schedules: there XLA hoisted every layer's recomputation (and the
    all-gathers of its FSDP-sharded weights) to the start of the backward pass, so remat saved
    nothing (compiled temporaries grew by a whole layer per layer) and each layer's gathered
    weights stayed live from the forward to its backward. A data dependence holds on every
    backend; its cost is one elementwise add over each layer's inputs and local weight shards.
    """
    graphdef, state = nnx.split(block)
    cache_float, cache_rest = _split_floats(layer_cache)
    out = _remat_apply(
        graphdef, state, x_BxTxD, cache_float, (positions_BxT, valid_BxT, cache_rest, cache_index)
    )
    x_BxTxD, new_float, new_rest = out
    return x_BxTxD, _merge_floats(new_float, new_rest)


def _split_floats(tree):
    """(floating leaves, other leaves) of a pytree, each with None in the other's places."""
    if tree is None:
        return None, None
    floats = jax.tree.map(lambda a: a if _is_float(a) else None, tree)
    rest = jax.tree.map(lambda a: None if _is_float(a) else a, tree)
    return floats, rest


def _merge_floats(floats, rest):
    if floats is None:
        return None
    return jax.tree.map(
        lambda f, r: r if f is None else f, floats, rest, is_leaf=lambda a: a is None
    )


def _remat_call(graphdef, state, x_BxTxD, cache_float, aux):
    positions_BxT, valid_BxT, cache_rest, cache_index = aux
    block = nnx.merge(graphdef, state)
    x_BxTxD, cache = block(
        x_BxTxD, positions_BxT, valid_BxT, _merge_floats(cache_float, cache_rest), cache_index
    )
    new_float, new_rest = _split_floats(cache)
    return x_BxTxD, new_float, new_rest


def _after(x, tree):
    """tree + a zero computed from x: its uses cannot be scheduled before x exists."""
    zero = jnp.sum(x[:, :1, :1].astype(jnp.float32)) * 0.0
    return jax.tree.map(lambda a: a + zero.astype(a.dtype), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_apply(graphdef, state, x_BxTxD, cache_float, aux):
    return _remat_call(graphdef, _after(x_BxTxD, state), x_BxTxD, cache_float, aux)


def _remat_fwd(graphdef, state, x_BxTxD, cache_float, aux):
    # The forward's parameters are tied to the block's input as well: XLA CPU otherwise issued
    # every layer's FSDP all-gathers at the start of the step and kept all of them live until
    # their layer ran (+0.76 GiB per layer per device at Qwen2.5-7B width).
    out = _remat_call(graphdef, _after(x_BxTxD, state), x_BxTxD, cache_float, aux)
    return out, (state, x_BxTxD, cache_float, aux)


def _remat_bwd(graphdef, saved, cotangents):
    state, x_BxTxD, cache_float, aux = saved
    d_x, d_cache_float, _ = cotangents
    # The recomputation's inputs are made to depend on the cotangent: a zero computed from it
    # (XLA does not fold x * 0 for floats) is added to every saved input and parameter.
    state, x_BxTxD, cache_float = _after(d_x, (state, x_BxTxD, cache_float))
    _, vjp = jax.vjp(
        lambda s, x, c: _remat_call(graphdef, s, x, c, aux)[:2], state, x_BxTxD, cache_float
    )
    d_state, d_x, d_cache_in = vjp((d_x, d_cache_float))
    return d_state, d_x, d_cache_in, None


_remat_apply.defvjp(_remat_fwd, _remat_bwd)


class Transformer(nnx.Module):
    """Token ids -> fp32 logits. See MODEL_API.md for the calling conventions.

    Parameters: `embedding` [V, D], `layers[i]` blocks, `final_norm`, and `lm_head` [V, D] when
    embeddings are untied (tied models unembed with `embedding`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embedding = _param(
            rngs, _normal, (cfg.vocab_size, cfg.hidden_size), cfg.storage_dtype, ("vocab", "embed")
        )
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs,
                _normal,
                (cfg.vocab_size, cfg.hidden_size),
                cfg.storage_dtype,
                ("vocab", "embed"),
            )

    def init_cache(self, batch_size: int, max_len: int) -> list[dict[str, jax.Array]]:
        """Empty KV cache: per layer {'k','v': [B, K, S, H] compute dtype, 'valid': bool [B, S]}."""
        cfg = self.config
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        return [
            {
                "k": jnp.zeros(shape, cfg.activation_dtype),
                "v": jnp.zeros(shape, cfg.activation_dtype),
                "valid": jnp.zeros((batch_size, max_len), jnp.bool_),
            }
            for _ in range(cfg.num_layers)
        ]

    def share_prefix_cache(
        self,
        prefix_cache: list[dict[str, jax.Array]],
        num_samples: int,
        max_len: int,
        *,
        decode: bool = False,
    ) -> list[dict[str, jax.Array]]:
        """Decode cache for `num_samples` continuations of each of P prefilled prefixes.

        `prefix_cache` is a filled cache of batch P (e.g. the prompts after prefill). The result
        keeps it once per prefix ('prefix_k', 'prefix_v' [P, K, J, H], 'prefix_valid' [P, J]) and
        adds empty new-token slots for B = P * num_samples rows (row p * num_samples + r
        continues prefix p): 'k', 'v' [P, K, R, S, H] with R = num_samples and S = `max_len`
        (grouped per prefix, so attention needs no transposes; see
        `Attention._attend_shared_prefix`), 'valid' [B, S]. Calls then index the new-token
        slots: cache_index 0 is the first token after the prefix. Every prefix slot is in the
        past of every new token, so only 'prefix_valid' masks it.

        decode=True stores keys and values slot-last for decode steps (one query per row):
        'prefix_kT', 'prefix_vT' [P, K, H, J] and 'kT', 'vT' [P, K, R, H, S] (see
        `Attention._decode_shared_prefix`); the sampler uses it, the update's multi-token
        forward (`hidden_shared_prefix`) the default layout.
        """
        cfg = self.config
        p = prefix_cache[0]["k"].shape[0]
        if decode:
            shape = (p, cfg.num_kv_heads, num_samples, cfg.head_dim, max_len)
            return [
                {
                    "prefix_kT": c["k"].swapaxes(2, 3),
                    "prefix_vT": c["v"].swapaxes(2, 3),
                    "prefix_valid": c["valid"],
                    "kT": jnp.zeros(shape, cfg.activation_dtype),
                    "vT": jnp.zeros(shape, cfg.activation_dtype),
                    "valid": jnp.zeros((p * num_samples, max_len), jnp.bool_),
                }
                for c in prefix_cache
            ]
        shape = (p, cfg.num_kv_heads, num_samples, max_len, cfg.head_dim)
        return [
            {
                "prefix_k": c["k"],
                "prefix_v": c["v"],
                "prefix_valid": c["valid"],
                "k": jnp.zeros(shape, cfg.activation_dtype),
                "v": jnp.zeros(shape, cfg.activation_dtype),
                "valid": jnp.zeros((p * num_samples, max_len), jnp.bool_),
            }
            for c in prefix_cache
        ]

    def slot_cache(
        self,
        prefix_cache: list[dict[str, jax.Array]],
        num_slots: int,
        max_len: int,
        groups: int = 1,
    ) -> list[dict[str, jax.Array]]:
        """Decode cache for `num_slots` slots that each continue one of P prefilled prefixes.

        The continuous-batching counterpart of `share_prefix_cache(..., decode=True)`: the
        prefixes are kept once, slot-last ('prefix_kT', 'prefix_vT' [P, K, H, J],
        'prefix_valid' [P, J]) and every slot has its own new-token columns ('kT', 'vT'
        [B, K, H, S] with B = `num_slots`, S = `max_len`) but no
        fixed prefix: 'prefix_index' (int32 [groups, B / groups], initially 0) says which one it
        continues (slot d * (B / groups) + i continues prefix d * (P / groups) + index). Slots
        and prefixes come in `groups` equal groups and a slot only points into its own group
        (a mesh's row shards: no gather crosses shards). Calls pass `cache_index` as int32 [B],
        each slot's own write column; a slot that moves to another prefix sets its index and
        restarts at column 0 (see `Attention._attend_slots`).
        """
        cfg = self.config
        p = prefix_cache[0]["k"].shape[0]
        if p % groups or num_slots % groups:
            raise ValueError(
                f"{p} prefixes and {num_slots} slots must both split into {groups} equal groups."
            )
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim, max_len)
        return [
            {
                "prefix_kT": c["k"].swapaxes(2, 3),
                "prefix_vT": c["v"].swapaxes(2, 3),
                "prefix_valid": c["valid"],
                "prefix_index": jnp.zeros((groups, num_slots // groups), jnp.int32),
                "kT": jnp.zeros(shape, cfg.activation_dtype),
                "vT": jnp.zeros(shape, cfg.activation_dtype),
            }
            for c in prefix_cache
        ]

    def hidden(
        self, tokens_BxT, positions_BxT=None, mask_BxT=None, *, cache=None, cache_index=None
    ):
        """Final-norm hidden states [B, T, D] (compute dtype); with a cache returns (hidden, cache).

        mask_BxT: 1/True for real tokens, 0 for padding (default all real).
        positions_BxT: RoPE positions, default cumsum(mask)-1 clipped at 0; required with a cache.
        cache/cache_index: the T new keys/values go to slots [cache_index, cache_index + T);
          the caller keeps cache_index + T <= S (dynamic_update_slice would clamp the start).
          With a `slot_cache`, cache_index is int32 [B]: each row's own write column.
        """
        cfg = self.config
        b, t = tokens_BxT.shape
        valid_BxT = jnp.ones((b, t), jnp.bool_) if mask_BxT is None else mask_BxT.astype(bool)
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
        x_BxTxD = constrain(x_BxTxD.astype(cfg.activation_dtype), ("batch_data", "length", "embed"))
        x_BxTxD = constrain(x_BxTxD, ("batch", "length", "embed"))
        # remat only matters under differentiation (training); decoding runs the same ops.
        forward = _block_forward_remat if cfg.remat else _block_forward
        new_cache = []
        for layer_index, block in enumerate(self.layers):
            layer_cache = None if cache is None else cache[layer_index]
            x_BxTxD, layer_cache = forward(
                block, x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index
            )
            new_cache.append(layer_cache)
        hidden_BxTxD = self.final_norm(x_BxTxD)
        return hidden_BxTxD if cache is None else (hidden_BxTxD, new_cache)

    def hidden_shared_prefix(self, tokens_BxS, mask_BxS, *, prefix_len: int, group_size: int):
        """`hidden(tokens_BxS, None, mask_BxS)` for rows that share their prefix in groups.

        Rows come in groups of `group_size` consecutive rows whose first `prefix_len` tokens
        and mask entries are identical (the G responses of one prompt, prompt left-padded to
        `prefix_len`). The prefix is run once per group and its keys / values are shared by the
        group's rows, as in sampling (`share_prefix_cache`), so a forward + backward over the
        rollout batch skips (G - 1) / G of the prompt tokens' work; gradients through the
        shared prefix sum over the group. Same values as `hidden` (fp32 rounding aside);
        returns final-norm hidden states [B, S, D], the prefix slots repeated per row.
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
        prefix_PxJxD, cache = self.hidden(
            tokens_BxS[::g, :j],
            positions_BxS[::g, :j],
            valid_BxS[::g, :j],
            cache=self.init_cache(p, j),
            cache_index=0,
        )
        cache = self.share_prefix_cache(cache, g, s - j)
        new_BxNxD, _ = self.hidden(
            tokens_BxS[:, j:], positions_BxS[:, j:], valid_BxS[:, j:], cache=cache, cache_index=0
        )
        return jnp.concatenate([jnp.repeat(prefix_PxJxD, g, axis=0), new_BxNxD], axis=1)

    def unembed_matrix(self) -> jax.Array:
        """[V, D] output projection (the embedding when tied), in the compute dtype."""
        table = self.embedding if self.lm_head is None else self.lm_head
        return weight(table, self.config.compute_dtype)

    def unembed(self, hidden_xD: jax.Array) -> jax.Array:
        """Hidden states [..., D] -> fp32 logits [..., V] (fp32 accumulation in bf16 compute)."""
        logits = jnp.einsum(
            "...d,vd->...v",
            hidden_xD,
            self.unembed_matrix(),
            preferred_element_type=jnp.float32,
        )
        return logits.astype(jnp.float32)

    def __call__(
        self, tokens_BxT, positions_BxT=None, mask_BxT=None, *, cache=None, cache_index=None
    ):
        """fp32 logits [B, T, V]; with a cache returns (logits, updated cache)."""
        out = self.hidden(tokens_BxT, positions_BxT, mask_BxT, cache=cache, cache_index=cache_index)
        if cache is None:
            return constrain(self.unembed(out), ("batch", "length", "vocab"))
        hidden_BxTxD, cache = out
        return constrain(self.unembed(hidden_BxTxD), ("batch", "length", "vocab")), cache

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
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def with_config(model: Transformer, **changes) -> Transformer:
    """The same parameters (shared, not copied) under a config with `changes` to fields that do
    not change parameter shapes (compute_dtype, attention, remat)."""
    cfg = model.config.replace(**changes)
    if cfg == model.config:
        return model
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, nnx.state(model))


def with_compute_dtype(model: Transformer, dtype) -> Transformer:
    """The same parameters (shared, not copied) computing in `dtype`: e.g. a bf16-compute view of
    fp32 masters, for evaluation or for comparing precisions."""
    return with_config(model, compute_dtype=str(jnp.dtype(dtype)))
