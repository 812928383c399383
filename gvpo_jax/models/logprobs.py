"""Memory-efficient token log-probs: chunked over time and rematerialised, never [B,T,V] logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gvpo_jax.models.transformer import Transformer


def chunked_logprobs(
    hidden_BxTxD: jax.Array, unembed_VxD: jax.Array, targets_BxT: jax.Array, *, chunk_size: int
) -> jax.Array:
    """fp32 [B, T]: log softmax(hidden[b, t] @ unembed.T)[targets[b, t]].

    Time is cut into ceil(T / chunk_size) chunks processed by `lax.map`; each chunk's logits
    [B, C, V] are built in fp32, reduced to one log-prob per token and dropped. The chunk
    function is `jax.checkpoint`ed, so the backward pass recomputes a chunk's logits instead of
    storing them: peak memory holds O(B * C * V) logits, never O(B * T * V).
    """
    b, t, d = hidden_BxTxD.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    hidden_BxTxD = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    hidden_NxBxCxD = hidden_BxTxD.reshape(b, n, c, d).transpose(1, 0, 2, 3)
    targets_NxBxC = targets_BxT.reshape(b, n, c).transpose(1, 0, 2)

    @jax.checkpoint
    def chunk(unembed_VxD, hidden_BxCxD, targets_BxC):
        logits_BxCxV = jnp.einsum(
            "bcd,vd->bcv", hidden_BxCxD, unembed_VxD, preferred_element_type=jnp.float32
        ).astype(jnp.float32)
        lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        target_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
        return target_BxC - lse_BxC

    logp_NxBxC = jax.lax.map(lambda xs: chunk(unembed_VxD, *xs), (hidden_NxBxCxD, targets_NxBxC))
    return logp_NxBxC.transpose(1, 0, 2).reshape(b, n * c)[:, :t]


def naive_logprobs(
    hidden_BxTxD: jax.Array, unembed_VxD: jax.Array, targets_BxT: jax.Array
) -> jax.Array:
    """Reference for `chunked_logprobs`: materialises the full fp32 [B, T, V] logits."""
    logits_BxTxV = jnp.einsum(
        "btd,vd->btv", hidden_BxTxD, unembed_VxD, preferred_element_type=jnp.float32
    ).astype(jnp.float32)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]


def token_logprobs(
    model: Transformer,
    tokens_BxT: jax.Array,
    mask_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    chunk_size: int = 128,
) -> jax.Array:
    """fp32 [B, T]: logp[b, t] = log p(tokens[b, t] | tokens[b, :t]) for t >= 1; logp[:, 0] = 0.

    Differentiable w.r.t. the model parameters, same values and gradients as gathering from
    `log_softmax(model(tokens))`. With a mask, logp[b, t] is 0 unless both tokens t-1 and t are
    real (a pad token predicts nothing and is never predicted); positions default as in the model.
    """
    hidden_BxTxD = model.hidden(tokens_BxT, positions_BxT, mask_BxT)
    logp_BxTm1 = chunked_logprobs(
        hidden_BxTxD[:, :-1], model.unembed_matrix(), tokens_BxT[:, 1:], chunk_size=chunk_size
    )
    if mask_BxT is not None:
        real_BxT = mask_BxT.astype(bool)
        logp_BxTm1 = jnp.where(real_BxT[:, 1:] & real_BxT[:, :-1], logp_BxTm1, 0.0)
    return jnp.pad(logp_BxTm1, ((0, 0), (1, 0)))
