"""Decoder-only transformer (Qwen2/Qwen2.5, Llama) in Flax NNX, with a per-layer KV cache."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from gvpo_jax.models.config import ModelConfig

# Logical axis names. Parameters carry them as `out_sharding` metadata (read them with
# `nnx.get_partition_spec(state)` under `nnx.logical_axis_rules(rules)`); activations are
# constrained with them, which is a no-op unless logical axis rules and a mesh are active.
PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm")
ACTIVATION_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")
CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free


def _param(rngs: nnx.Rngs, init, shape, dtype, axes) -> nnx.Param:
    """A Param with logical axis names; eager sharding off so it can be built without a mesh."""
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


_normal = nnx.initializers.normal(0.02)  # transformers' initializer_range
_zeros = lambda key, shape, dtype: jnp.zeros(shape, dtype)
_ones = lambda key, shape, dtype: jnp.ones(shape, dtype)


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

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, _ones, (dim,), dtype, ("norm",))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x = x_BxTxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * x.astype(x_BxTxD.dtype)


def _per_prefix(x_BxKxQxY: jax.Array, prefixes: int) -> jax.Array:
    """[B, K, Q, Y] with rows p*R + r (R = B / P) -> [P, K, R*Q, Y]: a group's rows stacked."""
    b, k, q, y = x_BxKxQxY.shape
    r = b // prefixes
    return (
        x_BxKxQxY.reshape(prefixes, r, k, q, y)
        .transpose(0, 2, 1, 3, 4)
        .reshape(prefixes, k, r * q, y)
    )


def _per_row(x_PxKxRQxY: jax.Array, rows: int) -> jax.Array:
    """Inverse of `_per_prefix`: [P, K, R*Q, Y] -> [B, K, Q, Y] with B = `rows`."""
    p, k, rq, y = x_PxKxRQxY.shape
    r = rows // p
    return (
        x_PxKxRQxY.reshape(p, k, r, rq // r, y)
        .transpose(0, 2, 1, 3, 4)
        .reshape(rows, k, rq // r, y)
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; K key/value heads shared by N/K query heads each."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
        self.num_kv_heads = k
        self.rope_theta = cfg.rope_theta
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
        w = kernel[...]
        y = (x_BxTxD.reshape(b * t, d) @ w.reshape(d, -1)).reshape(b, t, *w.shape[1:])
        if bias is not None:
            y = y + bias[...]
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
        mask_BxTxS = attention_mask(valid_BxS, query_slot_T, key_slot_S)

        n, h = q_BxTxNxH.shape[2:]
        kv = self.num_kv_heads
        g = n // kv
        # The G query heads sharing a key/value head are stacked along the query axis, so the
        # scores and the weighted sum are plain batched matmuls over (B, K): Q = G * T rows.
        q_BxKxQxH = (
            q_BxTxNxH.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
        )
        scale = 1.0 / math.sqrt(h)
        s = k_BxKxSxH.shape[2]
        scores_BxKxQxS = jnp.einsum(
            "bkqh,bksh->bkqs", q_BxKxQxH, k_BxKxSxH, preferred_element_type=jnp.float32
        )
        mask_BxKxQxS = jnp.broadcast_to(mask_BxTxS[:, None, None], (b, kv, g, t, s))
        mask_BxKxQxS = mask_BxKxQxS.reshape(b, kv, g * t, s)
        prefix = layer_cache is not None and "prefix_k" in layer_cache
        if prefix:
            # A shared prefix (the prompt of a group): rows p*R .. p*R + R-1 all attend to the
            # keys of prompt p, stored once. Their queries are stacked per prompt, so each
            # prefix key is read once per prompt instead of once per sample.
            pk_PxKxJxH, pv_PxKxJxH = layer_cache["prefix_k"], layer_cache["prefix_v"]
            p, j = pk_PxKxJxH.shape[0], pk_PxKxJxH.shape[2]
            q_PxKxRQxH = _per_prefix(q_BxKxQxH, p)
            pre_PxKxRQxJ = jnp.einsum(
                "pkqh,pkjh->pkqj", q_PxKxRQxH, pk_PxKxJxH, preferred_element_type=jnp.float32
            )
            pre_BxKxQxJ = _per_row(pre_PxKxRQxJ, b)
            pre_mask_BxKxQxJ = jnp.broadcast_to(
                jnp.repeat(layer_cache["prefix_valid"], b // p, axis=0)[:, None, None, :],
                (b, kv, g * t, j),
            )
            scores_BxKxQxS = jnp.concatenate([pre_BxKxQxJ, scores_BxKxQxS], axis=-1)
            mask_BxKxQxS = jnp.concatenate([pre_mask_BxKxQxJ, mask_BxKxQxS], axis=-1)
        scores_BxKxQxS = jnp.where(mask_BxKxQxS, scores_BxKxQxS * scale, _MASKED)
        probs_BxKxQxS = jax.nn.softmax(scores_BxKxQxS, axis=-1).astype(v_BxKxSxH.dtype)
        if prefix:
            pre_BxKxQxJ, probs_BxKxQxS = probs_BxKxQxS[..., :j], probs_BxKxQxS[..., j:]
            pre_out_PxKxRQxH = jnp.einsum(
                "pkqj,pkjh->pkqh", _per_prefix(pre_BxKxQxJ, p), pv_PxKxJxH
            )
            pre_out_BxKxQxH = _per_row(pre_out_PxKxRQxH, b)
        out_BxKxQxH = jnp.einsum("bkqs,bksh->bkqh", probs_BxKxQxS, v_BxKxSxH)
        if prefix:
            out_BxKxQxH = out_BxKxQxH + pre_out_BxKxQxH
        out_BTxNH = (
            out_BxKxQxH.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b * t, n * h)
        )
        out_BxTxD = (out_BTxNH @ self.o_kernel[...].reshape(n * h, d)).reshape(b, t, d)
        return constrain(out_BxTxD, ("batch", "length", "embed")), layer_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.dtype
        self.gate_kernel = _param(rngs, _normal, (d, f), dt, ("embed", "mlp"))
        self.up_kernel = _param(rngs, _normal, (d, f), dt, ("embed", "mlp"))
        self.down_kernel = _param(rngs, _normal, (f, d), dt, ("mlp", "embed"))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        # 2-D matmuls on [B*T, D]: see Attention._project for why not 3-D einsums.
        b, t, d = x_BxTxD.shape
        x_BTxD = x_BxTxD.reshape(b * t, d)
        gate_BTxF = x_BTxD @ self.gate_kernel[...]
        up_BTxF = x_BTxD @ self.up_kernel[...]
        hidden_BxTxF = (jax.nn.silu(gate_BTxF) * up_BTxF).reshape(b, t, -1)
        hidden_BxTxF = constrain(hidden_BxTxF, ("batch", "length", "mlp"))
        return (hidden_BxTxF.reshape(b * t, -1) @ self.down_kernel[...]).reshape(b, t, d)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, valid_BxT, layer_cache=None, cache_index=None):
        attn_BxTxD, layer_cache = self.attn(
            self.attn_norm(x_BxTxD), positions_BxT, valid_BxT, layer_cache, cache_index
        )
        x_BxTxD = x_BxTxD + attn_BxTxD
        x_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))
        return constrain(x_BxTxD, ("batch", "length", "embed")), layer_cache


def _block_forward(block, x_BxTxD, positions_BxT, valid_BxT):
    return block(x_BxTxD, positions_BxT, valid_BxT)[0]


_block_forward_remat = nnx.remat(_block_forward)


class Transformer(nnx.Module):
    """Token ids -> fp32 logits. See MODEL_API.md for the calling conventions.

    Parameters: `embedding` [V, D], `layers[i]` blocks, `final_norm`, and `lm_head` [V, D] when
    embeddings are untied (tied models unembed with `embedding`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embedding = _param(
            rngs, _normal, (cfg.vocab_size, cfg.hidden_size), cfg.dtype, ("vocab", "embed")
        )
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs, _normal, (cfg.vocab_size, cfg.hidden_size), cfg.dtype, ("vocab", "embed")
            )

    def init_cache(self, batch_size: int, max_len: int) -> list[dict[str, jax.Array]]:
        """Empty KV cache: per layer {'k','v': [B, K, S, H] param dtype, 'valid': bool [B, S]}."""
        cfg = self.config
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        return [
            {
                "k": jnp.zeros(shape, cfg.dtype),
                "v": jnp.zeros(shape, cfg.dtype),
                "valid": jnp.zeros((batch_size, max_len), jnp.bool_),
            }
            for _ in range(cfg.num_layers)
        ]

    def share_prefix_cache(
        self, prefix_cache: list[dict[str, jax.Array]], num_samples: int, max_len: int
    ) -> list[dict[str, jax.Array]]:
        """Decode cache for `num_samples` continuations of each of P prefilled prefixes.

        `prefix_cache` is a filled cache of batch P (e.g. the prompts after prefill). The result
        keeps it once per prefix ('prefix_k', 'prefix_v' [P, K, J, H], 'prefix_valid' [P, J]) and
        adds an empty cache of batch B = P * num_samples and `max_len` slots for the new tokens
        (row p * num_samples + r continues prefix p). Calls then index the new-token slots:
        cache_index 0 is the first token after the prefix. Every prefix slot is in the past of
        every new token, so only 'prefix_valid' masks it.
        """
        rows = prefix_cache[0]["k"].shape[0] * num_samples
        empty = self.init_cache(rows, max_len)
        return [
            {"prefix_k": c["k"], "prefix_v": c["v"], "prefix_valid": c["valid"], **e}
            for c, e in zip(prefix_cache, empty, strict=True)
        ]

    def hidden(
        self, tokens_BxT, positions_BxT=None, mask_BxT=None, *, cache=None, cache_index=None
    ):
        """Final-norm hidden states [B, T, D] (param dtype); with a cache returns (hidden, cache).

        mask_BxT: 1/True for real tokens, 0 for padding (default all real).
        positions_BxT: RoPE positions, default cumsum(mask)-1 clipped at 0; required with a cache.
        cache/cache_index: the T new keys/values go to slots [cache_index, cache_index + T);
          the caller keeps cache_index + T <= S (dynamic_update_slice would clamp the start).
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
        # Gather from a table whole along embed: an FSDP-sharded table would otherwise force XLA
        # into a full rematerialisation of the lookup ("involuntary full rematerialization").
        table_VxD = constrain(self.embedding[...], ("vocab", None))
        x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0, mode="clip")
        x_BxTxD = constrain(x_BxTxD, ("batch", "length", "embed"))
        new_cache = [] if cache is not None else None
        for layer_index, block in enumerate(self.layers):
            if cache is not None:
                x_BxTxD, layer_cache = block(
                    x_BxTxD, positions_BxT, valid_BxT, cache[layer_index], cache_index
                )
                new_cache.append(layer_cache)
            elif cfg.remat:
                x_BxTxD = _block_forward_remat(block, x_BxTxD, positions_BxT, valid_BxT)
            else:
                x_BxTxD = _block_forward(block, x_BxTxD, positions_BxT, valid_BxT)
        hidden_BxTxD = self.final_norm(x_BxTxD)
        return hidden_BxTxD if cache is None else (hidden_BxTxD, new_cache)

    def unembed_matrix(self) -> jax.Array:
        """[V, D] output projection (the embedding when tied)."""
        return (self.embedding if self.lm_head is None else self.lm_head)[...]

    def unembed(self, hidden_xD: jax.Array) -> jax.Array:
        """Hidden states [..., D] -> fp32 logits [..., V] (fp32 accumulation for bf16 params)."""
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
    """The model with ShapeDtypeStruct parameters (no memory): for shape checks and loading."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
