"""Attention core and SwiGLU with hand-written backward passes (cheaper than autodiff's)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Finite, so a fully masked row (a padding query) stays NaN-free: it attends uniformly.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def _acc(dtype) -> jnp.dtype:
    """Accumulation / softmax dtype: fp32 for bf16 and fp32 inputs, fp64 for fp64 (tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def _per_query_row(mask_BxTxS, kv: int, rows: int) -> jax.Array:
    """The [B, T, S] mask for the Q = G * T query rows of each key/value head: [B, K, Q, S]."""
    b, t, s = mask_BxTxS.shape
    mask_BxKxGxTxS = jnp.broadcast_to(mask_BxTxS[:, None, None], (b, kv, rows // t, t, s))
    return mask_BxKxGxTxS.reshape(b, kv, rows, s)


def _probs(q_BxKxQxH, k_BxKxSxH, mask_BxTxS):
    """Softmax weights [B, K, Q, S] (fp32; fp64 for fp64 inputs), Q = G * T query rows."""
    b, kv, q, h = q_BxKxQxH.shape
    scores_BxKxQxS = jnp.einsum(
        "bkqh,bksh->bkqs", q_BxKxQxH, k_BxKxSxH, preferred_element_type=_acc(q_BxKxQxH.dtype)
    )
    mask_BxKxQxS = _per_query_row(mask_BxTxS, kv, q)
    scores_BxKxQxS = jnp.where(mask_BxKxQxS, scores_BxKxQxS * (1.0 / math.sqrt(h)), MASKED)
    return jax.nn.softmax(scores_BxKxQxS, axis=-1)


@jax.custom_vjp
def attention(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS):
    """softmax(q k^T / sqrt(H) masked) v for grouped queries: [B, K, Q, H] -> [B, K, Q, H].

    q holds the G query heads of each of the K key/value heads stacked as Q = G * T rows
    (head-major: row g * T + t); `mask_BxTxS` (bool) says which key each query position sees
    and is shared by the G heads. The weights are rounded to v's dtype before the weighted sum
    (bf16 models keep bf16 matmuls). The backward pass uses the saved weights P and
    dS = P * (dP - rowsum(dO * O)) (rowsum over H, not S), and plain batched matmuls for
    dq, dk, dv. XLA's own derivative of the masked softmax fuses a longer quotient-rule chain
    (two [B, K, Q, S] reductions) into the dO @ v^T matmul; this one and `swiglu` together
    make the bench-45m update step ~9% faster on CPU (A/B runs in BENCHMARKS.md). A fully
    masked query row (padding) attends uniformly and gets no gradient, as with autodiff.
    """
    return _attention_fwd(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS)[0]


def _attention_fwd(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS):
    probs_BxKxQxS = _probs(q_BxKxQxH, k_BxKxSxH, mask_BxTxS).astype(v_BxKxSxH.dtype)
    out_BxKxQxH = jnp.einsum("bkqs,bksh->bkqh", probs_BxKxQxS, v_BxKxSxH)
    return out_BxKxQxH, (q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS, probs_BxKxQxS, out_BxKxQxH)


def _attention_bwd(res, dout_BxKxQxH):
    q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS, probs_BxKxQxS, out_BxKxQxH = res
    acc = _acc(q_BxKxQxH.dtype)
    dv_BxKxSxH = jnp.einsum(
        "bkqs,bkqh->bksh", probs_BxKxQxS, dout_BxKxQxH, preferred_element_type=acc
    )
    dprobs_BxKxQxS = jnp.einsum(
        "bkqh,bksh->bkqs", dout_BxKxQxH, v_BxKxSxH, preferred_element_type=acc
    )
    # sum_s P * dP = sum_h dO * O, since O = P v: an [B, K, Q] reduction over H instead of S.
    rowsum_BxKxQx1 = jnp.sum(
        dout_BxKxQxH.astype(acc) * out_BxKxQxH.astype(acc), axis=-1, keepdims=True
    )
    scale = 1.0 / math.sqrt(q_BxKxQxH.shape[-1])
    dscores_BxKxQxS = (probs_BxKxQxS.astype(acc) * (dprobs_BxKxQxS - rowsum_BxKxQx1)) * scale
    # Masked scores are constants: no gradient. This only matters for a fully masked (padding)
    # query row, whose uniform weights are not 0 at its masked keys.
    mask_BxKxQxS = _per_query_row(mask_BxTxS, q_BxKxQxH.shape[1], q_BxKxQxH.shape[2])
    dscores_BxKxQxS = jnp.where(mask_BxKxQxS, dscores_BxKxQxS, 0.0)
    dscores_BxKxQxS = dscores_BxKxQxS.astype(q_BxKxQxH.dtype)
    dq_BxKxQxH = jnp.einsum(
        "bkqs,bksh->bkqh", dscores_BxKxQxS, k_BxKxSxH, preferred_element_type=acc
    )
    dk_BxKxSxH = jnp.einsum(
        "bkqs,bkqh->bksh", dscores_BxKxQxS, q_BxKxQxH, preferred_element_type=acc
    )
    return (
        dq_BxKxQxH.astype(q_BxKxQxH.dtype),
        dk_BxKxSxH.astype(k_BxKxSxH.dtype),
        dv_BxKxSxH.astype(v_BxKxSxH.dtype),
        None,
    )


attention.defvjp(_attention_fwd, _attention_bwd)


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
    acc = _acc(dtype)
    gate, up, d = gate_xF.astype(acc), up_xF.astype(acc), d_xF.astype(acc)
    sig = jax.nn.sigmoid(gate)
    d_gate = d * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d * gate * sig
    return d_gate.astype(dtype), d_up.astype(up_xF.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
