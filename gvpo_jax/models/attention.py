"""The attention kernels behind `ModelConfig.attention`: dense, blocked (flash-style), XLA's,
Pallas splash, and the one entry point (`causal`) that the model and the caches call.

`Attention` (models/transformer.py) computes q, k, v; the caches (models/cache.py) store keys
and values in their layouts; this module holds the arithmetic. Decode steps (one query token)
always use the dense path: their scores are [1, S] per head (`choose`).

- `dense`: one [Q, S] score matrix per key/value head, with a hand-written backward.

- `blocked`: an online softmax over key blocks with a hand-written backward (FlashAttention-2's
  recurrences in plain JAX loops): O(block_q x block_k) scores live at a time instead of
  O(T x S), and key blocks wholly in a query block's future are skipped. Any platform.
- `xla`: `jax.nn.dot_product_attention` (cuDNN's fused kernel on GPU where it applies, XLA's
  own otherwise).
- `splash`: the Pallas TPU splash-attention kernel (causal mask + segment ids for padding).
  TPU only; on CPU it runs in Pallas interpret mode, which the tests use on tiny shapes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gvpo_jax.models.config import ATTENTION_IMPLEMENTATIONS

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "MASKED",
    "attention_mask",
    "blocked",
    "causal",
    "choose",
    "dense",
    "merge",
    "packed_prefix",
    "resolve",
    "shared_prefix",
]

# Finite, so a fully masked row (a padding query) stays NaN-free: it attends uniformly.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)

BLOCK_Q = 512  # query rows per block (rows = positions x the G query heads of a KV head)
BLOCK_K = 512  # keys per block
# `auto` on CPU: dense below this many query rows x keys per KV head, blocked from it up
# (BENCHMARKS.md section 8: below, the two tie within run-to-run noise and dense keeps the
# measured short-sequence path; from here on blocked is no slower and needs 40-80% less memory).
AUTO_CPU_BLOCKED_MIN = 1024 * 1024
NO_SLOT = np.iinfo(np.int32).max // 2  # a query slot that sees every valid key (non-causal)


def resolve(impl: str, *, q_rows: int, keys: int, platform: str | None = None) -> str:
    """The implementation `auto` stands for, for Q query rows x S keys per KV head.

    TPU: splash (the fused kernel MaxText and tunix use). GPU: xla (`jax.nn.dot_product_attention`,
    cuDNN flash attention where it supports the shapes). CPU: blocked once Q x S reaches
    AUTO_CPU_BLOCKED_MIN, dense below (measured on this project's 2-core CPU).
    """
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda", "rocm"):
        return "xla"
    return "blocked" if q_rows * keys >= AUTO_CPU_BLOCKED_MIN else "dense"


def choose(impl: str, *, t: int, g: int, keys: int) -> str:
    """The kernel for T query tokens (G query heads per key/value head) x `keys` keys: dense for
    a decode step (T = 1), else what `impl` resolves to."""
    if t == 1:
        return "dense"
    return resolve(impl, q_rows=t * g, keys=keys)


def visible(query_slot, key_slot, window: int | None, query_pos=None, key_pos=None):
    """Visibility of a key to a query (broadcasting): causal by slot (s <= t), and with a
    sliding window W also within W - 1 positions before the query (transformers' sliding-window
    mask: the query and the W - 1 tokens before it). Positions default to the slots, which is
    exact for a row whose real tokens sit in consecutive slots; caches pass the positions they
    store, since a right-padded prompt followed by decode slots is not consecutive."""
    seen = key_slot <= query_slot
    if window is not None:
        if query_pos is None:
            query_pos, key_pos = query_slot, key_slot
        seen = seen & (query_pos - key_pos < window)
    return seen


def attention_mask(
    valid_BxS: jax.Array,
    query_slot_T: jax.Array,
    key_slot_S: jax.Array,
    window=None,
    positions=None,
) -> jax.Array:
    """bool [B, T, S]: query t sees key s iff key s is valid and not in the future (s <= t),
    and with a sliding `window` within it (`visible`; `positions` = (query_pos_BxT, key_pos_BxS)
    or None for the slots).

    The single definition of the mask for both the full forward (slots = 0..T-1) and the cached
    forward (query slots i..i+T-1 against cache slots 0..S-1).
    """
    q_pos, k_pos = (None, None) if positions is None else positions
    causal_BxTxS = visible(
        query_slot_T[None, :, None],
        key_slot_S[None, None, :],
        window,
        None if q_pos is None else q_pos[:, :, None],
        None if k_pos is None else k_pos[:, None, :],
    )
    return valid_BxS[:, None, :] & causal_BxTxS


def _acc(dtype) -> jnp.dtype:
    """Accumulation / softmax dtype: fp32 for bf16 and fp32 inputs, fp64 for fp64 (tests)."""
    return jnp.promote_types(dtype, jnp.float32)


# ----------------------------------------------------------------------------------------------
# Dense attention


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
def dense(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS):
    """softmax(q k^T / sqrt(H) masked) v for grouped queries: [B, K, Q, H] -> [B, K, Q, H].

    q holds the G query heads of each of the K key/value heads stacked as Q = G * T rows
    (head-major: row g * T + t); `mask_BxTxS` (bool) says which key each query position sees
    and is shared by the G heads. The weights are rounded to v's dtype before the weighted sum
    (bf16 models keep bf16 matmuls). The backward pass uses the saved weights P and
    dS = P * (dP - rowsum(dO * O)) (rowsum over H, not S), and plain batched matmuls for
    dq, dk, dv. XLA's own derivative of the masked softmax fuses a longer quotient-rule chain
    (two [B, K, Q, S] reductions) into the dO @ v^T matmul; this one and `transformer.swiglu`
    together
    make the bench-45m update step ~9% faster on CPU (A/B runs in BENCHMARKS.md). A fully
    masked query row (padding) attends uniformly and gets no gradient, as with autodiff.
    """
    return _dense_fwd(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS)[0]


def _dense_fwd(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS):
    probs_BxKxQxS = _probs(q_BxKxQxH, k_BxKxSxH, mask_BxTxS).astype(v_BxKxSxH.dtype)
    out_BxKxQxH = jnp.einsum("bkqs,bksh->bkqh", probs_BxKxQxS, v_BxKxSxH)
    return out_BxKxQxH, (q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS, probs_BxKxQxS, out_BxKxQxH)


def _dense_bwd(res, dout_BxKxQxH):
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


dense.defvjp(_dense_fwd, _dense_bwd)


# ----------------------------------------------------------------------------------------------
# Blocked attention


def _pad_to(x, axis: int, multiple: int, value):
    n = x.shape[axis]
    pad = -n % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _block_scores(
    q_blk,
    k_blk,
    q_slot_blk,
    k_slot_blk,
    k_valid_blk,
    k_real_blk,
    scale,
    window,
    q_pos_blk,
    k_pos_blk,
):
    """Masked scores [B, K, bq, bk] (fp32 or fp64) and the visibility mask [B, 1, bq, bk]."""
    acc = _acc(q_blk.dtype)
    s = jnp.einsum("bkqh,bksh->bkqs", q_blk, k_blk, preferred_element_type=acc) * scale
    seen = k_valid_blk[:, None, :] & visible(
        q_slot_blk[:, :, None],
        k_slot_blk[:, None, :],
        window,
        q_pos_blk[:, :, None],
        k_pos_blk[:, None, :],
    )
    seen = seen[:, None]
    # Padding keys added to fill the last block count for nothing (weight 0 below); masked
    # real keys get the dense path's finite MASKED, so a query row with no visible key attends
    # uniformly to the real keys of the blocks it visits, as the dense path does to all keys.
    return jnp.where(seen, s, MASKED), seen, k_real_blk[:, None, None, :]


def _layout(
    q, k, v, q_slot, k_slot, k_valid, block_q, block_k, window=None, q_pos=None, k_pos=None
):
    """Pads Q and S to whole blocks; returns the padded arrays and the block ranges each pass
    visits (see below). Positions (for a window) default to the slots."""
    b, kv, q_rows, h = q.shape
    s = k.shape[2]
    bq, bk = min(block_q, q_rows), min(block_k, s)
    q = _pad_to(q, 2, bq, 0)
    k = _pad_to(k, 2, bk, 0)
    v = _pad_to(v, 2, bk, 0)
    q_pos = q_slot if q_pos is None else q_pos
    k_pos = k_slot if k_pos is None else k_pos
    q_slot = _pad_to(q_slot.astype(jnp.int32), 1, bq, -1)  # padded rows see nothing real
    big = jnp.iinfo(jnp.int32).max
    q_pos = _pad_to(q_pos.astype(jnp.int32), 1, bq, -1)
    k_pos = _pad_to(k_pos.astype(jnp.int32), 1, bk, big)
    k_slot = _pad_to(k_slot.astype(jnp.int32), 1, bk, big)
    k_real = _pad_to(jnp.ones((b, s), jnp.bool_), 1, bk, False)
    k_valid = _pad_to(k_valid.astype(jnp.bool_), 1, bk, False)
    nq, nk = q.shape[2] // bq, k.shape[2] // bk
    # Slots are non-decreasing along rows and keys (positions in order), so the key blocks a
    # query block needs are a prefix 0 .. need_q[i] - 1, and the query blocks that see key
    # block j a suffix from first_q[j].
    q_max = jnp.max(q_slot.reshape(b, nq, bq), axis=(0, 2))
    k_min = jnp.min(k_slot.reshape(b, nk, bk), axis=(0, 2))
    need_q = jnp.sum(k_min[None, :] <= q_max[:, None], axis=1).astype(jnp.int32)
    first_q = jnp.sum(q_max[None, :] < k_min[:, None], axis=1).astype(jnp.int32)
    if window is None:
        start_q, last_q = jnp.zeros((nq,), jnp.int32), jnp.full((nk,), nq, jnp.int32)
    else:
        # A sliding window also skips key blocks wholly before every query's window: a prefix
        # 0 .. start_q[i] - 1 of the key blocks (key positions are non-decreasing), and for key
        # block j the query blocks from last_q[j] on: after the last one that sees it, which
        # also holds when query positions restart along the row (packed segments against
        # their shared prompt). Padding rows / keys are left out of the bounds (their slots
        # are -1 / int32 max).
        q_lo = jnp.min(jnp.where(q_slot >= 0, q_pos, big).reshape(b, nq, bq), axis=(0, 2))
        k_hi = jnp.max(jnp.where(k_slot < big, k_pos, -1).reshape(b, nk, bk), axis=(0, 2))
        too_old = k_hi[None, :] <= q_lo[:, None] - window  # [nq, nk]
        start_q = jnp.sum(too_old, axis=1).astype(jnp.int32)
        after = jnp.arange(1, nq + 1, dtype=jnp.int32)[:, None]
        last_q = jnp.max(jnp.where(too_old, 0, after), axis=0).astype(jnp.int32)
    bounds = (bq, bk, nq, nk, need_q, first_q, start_q, last_q)
    return (q, k, v, q_slot, k_slot, k_valid, k_real, q_pos, k_pos), bounds


def _zero_from(x):
    """A scalar 0 computed from x (XLA does not fold x * 0 for floats). Loop accumulators start
    from it, so they cannot be created before x exists: XLA CPU otherwise materialised every
    layer's zero-filled accumulators at the start of the update and kept them all live."""
    return (x.reshape(-1)[0] * 0).astype(_acc(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def blocked(
    q,
    k,
    v,
    q_slot,
    k_slot,
    k_valid,
    block_q=BLOCK_Q,
    block_k=BLOCK_K,
    window=None,
    q_pos=None,
    k_pos=None,
):
    """Flash-style attention: (out [B, K, Q, H], lse [B, K, Q]) without [Q, S] score matrices.

    q [B, K, Q, H]: the query rows of each of the K key/value heads (e.g. positions x the G
    query heads sharing it, position-major). k, v [B, K, S, H]. Query row q sees key s iff
    `k_valid[b, s]` and `k_slot[b, s] <= q_slot[b, q]` (int32 slots, non-decreasing along rows
    and along keys: causal order; a q_slot of NO_SLOT sees every valid key), and with a sliding
    `window` W also q_pos - k_pos < W (positions default to the slots; key blocks wholly
    outside every window of a query block are skipped, in both passes, as future blocks are;
    NO_SLOT then sees nothing). Scores are scaled by 1/sqrt(H), accumulated in fp32 (fp64 for
    fp64 inputs); the weights are rounded to v's dtype before the weighted sum, as in the dense
    path. `lse` is the log of each row's softmax denominator: two calls over disjoint key sets
    merge exactly with `merge` (the update's shared prompt and each row's own tokens). Both
    outputs are differentiable.
    """
    return _blocked_fwd(q, k, v, q_slot, k_slot, k_valid, block_q, block_k, window, q_pos, k_pos)[0]


def _blocked_fwd(
    q, k, v, q_slot, k_slot, k_valid, block_q, block_k, window=None, q_pos=None, k_pos=None
):
    b, kv, q_rows, h = q.shape
    acc = _acc(q.dtype)
    scale = 1.0 / math.sqrt(h)
    arrays, (bq, bk, nq, nk, need_q, _, start_q, _) = _layout(
        q, k, v, q_slot, k_slot, k_valid, block_q, block_k, window, q_pos, k_pos
    )
    qp, kp, vp, q_slot_p, k_slot_p, k_valid_p, k_real_p, q_pos_p, k_pos_p = arrays

    def query_block(i, carry):
        out_acc, m_acc, l_acc, e_acc = carry
        q_blk = jax.lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=2)
        qs_blk = jax.lax.dynamic_slice_in_dim(q_slot_p, i * bq, bq, axis=1)
        qpos_blk = jax.lax.dynamic_slice_in_dim(q_pos_p, i * bq, bq, axis=1)

        def key_block(j, state):
            m, l, o = state
            sl = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=axis)
            s, _, real = _block_scores(
                q_blk,
                sl(kp, 2),
                qs_blk,
                sl(k_slot_p, 1),
                sl(k_valid_p, 1),
                sl(k_real_p, 1),
                scale,
                window,
                qpos_blk,
                sl(k_pos_p, 1),
            )
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None]) * real
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "bkqs,bksh->bkqh", p.astype(v.dtype), sl(vp, 2), preferred_element_type=acc
            )
            return m_new, l, o * corr[..., None] + pv

        zero = _zero_from(q_blk)
        init = (
            jnp.full((b, kv, bq), -jnp.inf, acc) + zero,
            jnp.zeros((b, kv, bq), acc) + zero,
            jnp.zeros((b, kv, bq, h), acc) + zero,
        )
        m, l, o = jax.lax.fori_loop(start_q[i], need_q[i], key_block, init)
        # Rows that visited no key block (padding, or every key block skipped: all before a
        # sliding window) have out 0; their lse is MASKED, so a merge gives them no weight.
        empty = ~jnp.isfinite(m)
        l = jnp.where(l > 0, l, 1.0)
        m = jnp.where(empty, 0.0, m)
        out_blk = (o / l[..., None]).astype(q.dtype)
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, i * bq, axis=2)
        return put(out_acc, out_blk), put(m_acc, m), put(l_acc, l), put(e_acc, empty)

    zero = _zero_from(q)
    init = (
        (jnp.zeros(qp.shape, acc) + zero).astype(q.dtype),
        jnp.zeros(qp.shape[:3], acc) + zero,
        jnp.ones(qp.shape[:3], acc) + zero,
        jnp.zeros(qp.shape[:3], jnp.bool_),
    )
    out_p, m_p, l_p, e_p = jax.lax.fori_loop(0, nq, query_block, init)
    out, m, l = out_p[:, :, :q_rows], m_p[:, :, :q_rows], l_p[:, :, :q_rows]
    lse = jnp.where(e_p[:, :, :q_rows], jnp.asarray(MASKED, acc), m + jnp.log(l))
    # The backward recomputes the weights as exp(s - m) / l, not exp(s - lse): for a row with
    # no visible key m is the finite MASKED value, and MASKED + log(l) rounds to MASKED.
    return (out, lse), (q, k, v, q_slot, k_slot, k_valid, q_pos, k_pos, out, m, l)


def _blocked_bwd(block_q, block_k, window, res, cotangents):
    q, k, v, q_slot, k_slot, k_valid, q_pos, k_pos, out, m, l = res
    dout, dlse = cotangents
    b, kv, q_rows, h = q.shape
    s_len = k.shape[2]
    acc = _acc(q.dtype)
    scale = 1.0 / math.sqrt(h)
    arrays, (bq, bk, nq, nk, _, first_q, _, last_q) = _layout(
        q, k, v, q_slot, k_slot, k_valid, block_q, block_k, window, q_pos, k_pos
    )
    qp, kp, vp, q_slot_p, k_slot_p, k_valid_p, k_real_p, q_pos_p, k_pos_p = arrays
    # d lse / d score = softmax weight, so lse's cotangent enters as -dlse in FlashAttention's
    # D = rowsum(dO * O): dS = P * (dP - D + dlse).
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1) - dlse.astype(acc)
    dout_p = _pad_to(dout.astype(q.dtype), 2, bq, 0)
    delta_p = _pad_to(delta, 2, bq, 0)
    m_p = _pad_to(m, 2, bq, 0)
    l_p = _pad_to(l, 2, bq, 1)

    def key_block(j, carry):
        dq_acc, dk_acc, dv_acc = carry
        sl_k = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=axis)
        k_blk, v_blk = sl_k(kp, 2), sl_k(vp, 2)
        ks, kval, kreal = sl_k(k_slot_p, 1), sl_k(k_valid_p, 1), sl_k(k_real_p, 1)
        kpos = sl_k(k_pos_p, 1)

        def query_block(i, state):
            dq_acc, dk_blk, dv_blk = state
            sl_q = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=axis)
            q_blk, do_blk = sl_q(qp, 2), sl_q(dout_p, 2)
            s, seen, real = _block_scores(
                q_blk,
                k_blk,
                sl_q(q_slot_p, 1),
                ks,
                kval,
                kreal,
                scale,
                window,
                sl_q(q_pos_p, 1),
                kpos,
            )
            p = jnp.exp(s - sl_q(m_p, 2)[..., None]) / sl_q(l_p, 2)[..., None] * real
            dv_blk = dv_blk + jnp.einsum(
                "bkqs,bkqh->bksh", p.astype(v.dtype), do_blk, preferred_element_type=acc
            )
            dp = jnp.einsum("bkqh,bksh->bkqs", do_blk, v_blk, preferred_element_type=acc)
            ds = p * (dp - sl_q(delta_p, 2)[..., None])
            ds = (jnp.where(seen, ds, 0.0) * scale).astype(q.dtype)  # masked scores: constants
            dq_blk = jnp.einsum("bkqs,bksh->bkqh", ds, k_blk, preferred_element_type=acc)
            dq_acc = jax.lax.dynamic_update_slice_in_dim(
                dq_acc, sl_q(dq_acc, 2) + dq_blk, i * bq, axis=2
            )
            dk_blk = dk_blk + jnp.einsum("bkqs,bkqh->bksh", ds, q_blk, preferred_element_type=acc)
            return dq_acc, dk_blk, dv_blk

        zeros = jnp.zeros((b, kv, bk, h), acc) + _zero_from(k_blk)
        dq_acc, dk_blk, dv_blk = jax.lax.fori_loop(
            first_q[j], last_q[j], query_block, (dq_acc, zeros, zeros)
        )
        dk_acc = jax.lax.dynamic_update_slice_in_dim(dk_acc, dk_blk, j * bk, axis=2)
        dv_acc = jax.lax.dynamic_update_slice_in_dim(dv_acc, dv_blk, j * bk, axis=2)
        return dq_acc, dk_acc, dv_acc

    zero = _zero_from(dout)  # after the cotangent, like the rest of the backward
    init = (
        jnp.zeros(qp.shape, acc) + zero,
        jnp.zeros(kp.shape, acc) + zero,
        jnp.zeros(vp.shape, acc) + zero,
    )
    dq, dk, dv = jax.lax.fori_loop(0, nk, key_block, init)
    return (
        dq[:, :, :q_rows].astype(q.dtype),
        dk[:, :, :s_len].astype(k.dtype),
        dv[:, :, :s_len].astype(v.dtype),
        None,
        None,
        None,
        None,
        None,
    )


blocked.defvjp(_blocked_fwd, _blocked_bwd)


def merge(out_a, lse_a, out_b, lse_b):
    """Softmax attention over the union of two disjoint key sets from the two parts' outputs and
    log-denominators (all differentiable): out = w_a out_a + w_b out_b, w = exp(lse - lse_ab)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a = jnp.exp(lse_a - lse)[..., None]
    w_b = jnp.exp(lse_b - lse)[..., None]
    out = w_a * out_a.astype(lse.dtype) + w_b * out_b.astype(lse.dtype)
    return out.astype(out_a.dtype), lse


# ----------------------------------------------------------------------------------------------
# The entry points of the model and the caches


def _rows_t_major(q_BxTxNxH, kv: int):
    """[B, T, N, H] -> [B, K, T * G, H] with row t * G + g (slots non-decreasing along rows)."""
    b, t, n, h = q_BxTxNxH.shape
    return q_BxTxNxH.reshape(b, t, kv, n // kv, h).transpose(0, 2, 1, 3, 4).reshape(b, kv, -1, h)


def _from_rows_t_major(out_BxKxQxH, t: int):
    b, kv, q, h = out_BxKxQxH.shape
    g = q // t
    return out_BxKxQxH.reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, kv * g, h)


def _static_int(x) -> int | None:
    try:
        return int(x)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None


def causal(
    impl,
    q_BxTxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    valid_q_BxT,
    valid_BxS,
    query_slot_T,
    key_slot_S,
    *,
    cache_index=0,
    window=None,
    positions=None,
):
    """Attention of T query tokens at slots `query_slot_T` to S keys at `key_slot_S` (query t
    sees valid keys at slots <= its own, and with a sliding `window` W only those less than W
    positions back: `visible`; `positions` = (query_pos_BxT, key_pos_BxS), default the slots),
    with `impl` in dense | blocked | xla | splash (see `choose`). Returns [B, T, N, H]. Rows of
    padding queries (valid_q False) are unspecified: no loss reads them.
    """
    b, t, n, h = q_BxTxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    if impl == "dense":
        mask_BxTxS = attention_mask(valid_BxS, query_slot_T, key_slot_S, window, positions)
        # The G query heads sharing a key/value head are stacked along the query axis, so the
        # scores and the weighted sum are plain batched matmuls over (B, K): Q = G * T rows.
        q_BxKxQxH = (
            q_BxTxNxH.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
        )
        out_BxKxQxH = dense(q_BxKxQxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS)
        out_BxTxNxH = out_BxKxQxH.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4)
        return out_BxTxNxH.reshape(b, t, n, h)
    if impl == "splash":
        offset = _static_int(cache_index)
        # Splash's window mask is static and by slot: used where slots are positions (no cache,
        # or a prefill at slot 0); otherwise the blocked kernel reads the positions.
        by_slot = window is None or positions is None or offset == 0
        if offset is not None and offset + t <= s and by_slot:
            keys = offset + t  # later cache slots are in every query's future
            return _splash(
                q_BxTxNxH,
                k_BxKxSxH[:, :, :keys],
                v_BxKxSxH[:, :, :keys],
                valid_q_BxT,
                valid_BxS[:, :keys],
                offset,
                window,
            )
        impl = "blocked"  # the splash mask is static: a traced write index cannot be one
    if impl == "xla":
        mask_BxTxS = attention_mask(valid_BxS, query_slot_T, key_slot_S, window, positions)
        return jax.nn.dot_product_attention(
            q_BxTxNxH,
            k_BxKxSxH.transpose(0, 2, 1, 3),
            v_BxKxSxH.transpose(0, 2, 1, 3),
            mask=mask_BxTxS[:, None],
        ).astype(q_BxTxNxH.dtype)
    if impl != "blocked":
        raise ValueError(f"attention implementation {impl!r}; use dense, blocked, xla or splash.")
    q_slot = jnp.broadcast_to(jnp.repeat(query_slot_T.astype(jnp.int32), g)[None], (b, t * g))
    k_slot = jnp.broadcast_to(key_slot_S.astype(jnp.int32)[None], (b, s))
    q_pos = k_pos = None
    if window is not None and positions is not None:
        q_pos = jnp.repeat(positions[0].astype(jnp.int32), g, axis=1)  # rows t-major, as q_slot
        k_pos = positions[1].astype(jnp.int32)
    out, _ = blocked(
        _rows_t_major(q_BxTxNxH, kv),
        k_BxKxSxH,
        v_BxKxSxH,
        q_slot,
        k_slot,
        valid_BxS,
        BLOCK_Q,
        BLOCK_K,
        window,
        q_pos,
        k_pos,
    )
    return _from_rows_t_major(out, t)


def _prefix_pass(
    q_PxKxQxH,
    pk_PxKxJxH,
    pv_PxKxJxH,
    prefix_valid_PxJ,
    window=None,
    q_pos_PxQ=None,
    prefix_pos_PxJ=None,
):
    """The blocked pass of the Q query rows of each prefix p over its J keys, for
    `shared_prefix` and `packed_prefix`: every prefix key precedes the queries (no causality);
    with a sliding `window` a key W or more positions before the query's is hidden (the query
    rows' positions [P, Q], the keys' [P, J]). Returns blocked's (out, log-denominator)."""
    p, _, q = q_PxKxQxH.shape[:3]
    j = pk_PxKxJxH.shape[2]
    prefix_slot = jnp.broadcast_to(jnp.arange(j, dtype=jnp.int32)[None], (p, j))
    if window is None:
        every_key = jnp.full((p, q), NO_SLOT, jnp.int32)
        return blocked(q_PxKxQxH, pk_PxKxJxH, pv_PxKxJxH, every_key, prefix_slot, prefix_valid_PxJ)
    after_prefix = jnp.full((p, q), j, jnp.int32)  # the queries sit at slot J, past every key
    return blocked(
        q_PxKxQxH,
        pk_PxKxJxH,
        pv_PxKxJxH,
        after_prefix,
        prefix_slot,
        prefix_valid_PxJ,
        BLOCK_Q,
        BLOCK_K,
        window,
        q_pos_PxQ,
        prefix_pos_PxJ,
    )


def shared_prefix(
    impl,
    q_BxTxNxH,
    pk_PxKxJxH,
    pv_PxKxJxH,
    prefix_valid_PxJ,
    k_PxKxRxSxH,
    v_PxKxRxSxH,
    valid_q_BxT,
    valid_BxS,
    index,
    window=None,
    positions=None,
):
    """Attention of B = P * R rows continuing P shared prefixes (`cache.SharedPrefixCache`
    layout): row p * R + r sees prefix p's valid keys and its own valid new keys at slots <=
    index + t. blocked: one pass over the prefixes for all R rows of a prompt at once (the
    prefix is read once per prompt, as in the dense path) and one over each row's own keys,
    merged through their log-denominators, a sliding `window` tested in both passes by
    position (`positions` = (query_pos_BxT, prefix_pos_PxJ, key_pos_BxS)); xla / splash: the
    prefix keys are repeated per row and joined to the row's own, one causal call with the
    prefix as a past of J slots (prefix slot j is slot j, new slot s is slot J + s: the row's
    own sequence)."""
    b, t, n, h = q_BxTxNxH.shape
    p, kv, j = pk_PxKxJxH.shape[:3]
    r, s = b // p, k_PxKxRxSxH.shape[3]
    g = n // kv
    k_BxKxSxH = k_PxKxRxSxH.transpose(0, 2, 1, 3, 4).reshape(b, kv, s, h)
    v_BxKxSxH = v_PxKxRxSxH.transpose(0, 2, 1, 3, 4).reshape(b, kv, s, h)
    if impl in ("xla", "splash"):
        rows = lambda x: jnp.repeat(x, r, axis=0)
        keys = jnp.concatenate([rows(pk_PxKxJxH), k_BxKxSxH], axis=2)
        values = jnp.concatenate([rows(pv_PxKxJxH), v_BxKxSxH], axis=2)
        valid = jnp.concatenate([rows(prefix_valid_PxJ), valid_BxS], axis=1)
        i = jnp.asarray(index, jnp.int32)
        joined = None
        if positions is not None:
            q_pos, prefix_pos, k_pos = positions
            joined = (q_pos, jnp.concatenate([rows(prefix_pos), k_pos], axis=1))
        return causal(
            impl,
            q_BxTxNxH,
            keys,
            values,
            valid_q_BxT,
            valid,
            j + i + jnp.arange(t),
            jnp.arange(j + s),
            cache_index=j + index if _static_int(index) is not None else j + i,
            window=window,
            positions=joined,
        )
    if impl != "blocked":
        raise ValueError(f"attention implementation {impl!r}; use dense, blocked, xla or splash.")
    if window is not None and positions is None:
        raise ValueError("a sliding window needs positions (query, prefix key, key).")
    # The prefix part: the R * T * G query rows of prompt p against its J keys (no causality).
    q_PxKxRTGxH = (
        q_BxTxNxH.reshape(p, r, t, kv, g, h).transpose(0, 3, 1, 2, 4, 5).reshape(p, kv, -1, h)
    )
    if window is None:
        pre_out, pre_lse = _prefix_pass(q_PxKxRTGxH, pk_PxKxJxH, pv_PxKxJxH, prefix_valid_PxJ)
    else:  # the query rows of prompt p in their (row, position, head) order
        q_pos, prefix_pos, k_pos = (x.astype(jnp.int32) for x in positions)
        pre_out, pre_lse = _prefix_pass(
            q_PxKxRTGxH,
            pk_PxKxJxH,
            pv_PxKxJxH,
            prefix_valid_PxJ,
            window,
            jnp.repeat(q_pos.reshape(p, r * t), g, axis=1),
            prefix_pos,
        )
    per_row = lambda x: (
        x.reshape(p, kv, r, t * g, *x.shape[3:]).swapaxes(1, 2).reshape(b, kv, t * g, *x.shape[3:])
    )
    pre_out, pre_lse = per_row(pre_out), per_row(pre_lse)
    # Each row's own part: causal over its new-token slots.
    i = jnp.asarray(index, jnp.int32)
    q_slot = jnp.broadcast_to(jnp.repeat(i + jnp.arange(t, dtype=jnp.int32), g)[None], (b, t * g))
    k_slot = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    own = () if window is None else (BLOCK_Q, BLOCK_K, window, jnp.repeat(q_pos, g, axis=1), k_pos)
    new_out, new_lse = blocked(
        _rows_t_major(q_BxTxNxH, kv), k_BxKxSxH, v_BxKxSxH, q_slot, k_slot, valid_BxS, *own
    )
    out, _ = merge(pre_out, pre_lse, new_out, new_lse)
    return _from_rows_t_major(out, t)


# Positions of consecutive segments in the packed own pass are this far apart (more than any
# row's span of positions plus a window: 2^20 tokens; seg ids stay far below 2^11).
SEGMENT_STRIDE = 1 << 20


def packed_prefix(
    impl,
    q_RxTxNxH,
    pk_RxKxJxH,
    pv_RxKxJxH,
    prefix_valid_RxJ,
    k_RxKxTxH,
    v_RxKxTxH,
    valid_RxT,
    segments_RxT,
    window=None,
    positions_RxT=None,
    prefix_pos_RxJ=None,
):
    """Attention of packed rows: row r holds several sequences (segments, ids non-decreasing
    along the row, padding last with the largest id) that all continue prefix r. Token t sees
    the prefix's valid keys and the valid keys of its own segment at slots <= t; other
    segments are invisible. dense / xla: the prefix and own keys joined under one mask;
    blocked (also for splash, whose static masks cannot hold per-row segments next to a shared
    prefix): one pass over the prefix and one causal pass over the row, where a segment test
    in the kernel's window form (`visible` with positions = segment ids and window 1: a key of
    an earlier segment is "too far back") also skips key blocks of earlier segments; the two
    are merged through their log-denominators.

    A sliding `window` W (with the row's RoPE positions [R, T] and the prefix keys' [R, J]) also
    hides keys W or more positions before the query, in the prefix and in its own segment. In
    the blocked form the own pass's positions become seg * SEGMENT_STRIDE + position, so one
    window test is both: same segment, distance in positions; earlier segment, at least
    SEGMENT_STRIDE - (a row's span of positions) >= W back. Returns [R, T, N, H]."""
    r, t, n, h = q_RxTxNxH.shape
    kv, j = pk_RxKxJxH.shape[1], pk_RxKxJxH.shape[2]
    g = n // kv
    seg = segments_RxT.astype(jnp.int32)
    impl = "blocked" if impl == "splash" else impl
    if window is not None:
        pos = positions_RxT.astype(jnp.int32)
        pre_pos = prefix_pos_RxJ.astype(jnp.int32)
    if impl in ("dense", "xla"):
        own_RxTxT = (
            valid_RxT[:, None, :]
            & (jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :])
            & (seg[:, :, None] == seg[:, None, :])
        )
        pre_RxTxJ = jnp.broadcast_to(prefix_valid_RxJ[:, None, :], (r, t, j))
        if window is not None:
            own_RxTxT = own_RxTxT & (pos[:, :, None] - pos[:, None, :] < window)
            pre_RxTxJ = pre_RxTxJ & (pos[:, :, None] - pre_pos[:, None, :] < window)
        mask_RxTxS = jnp.concatenate([pre_RxTxJ, own_RxTxT], axis=2)
        keys = jnp.concatenate([pk_RxKxJxH, k_RxKxTxH], axis=2)
        values = jnp.concatenate([pv_RxKxJxH, v_RxKxTxH], axis=2)
        if impl == "xla":
            return jax.nn.dot_product_attention(
                q_RxTxNxH,
                keys.transpose(0, 2, 1, 3),
                values.transpose(0, 2, 1, 3),
                mask=mask_RxTxS[:, None],
            ).astype(q_RxTxNxH.dtype)
        q_RxKxQxH = (
            q_RxTxNxH.reshape(r, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(r, kv, g * t, h)
        )
        out = dense(q_RxKxQxH, keys, values, mask_RxTxS)
        return out.reshape(r, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(r, t, n, h)
    if impl != "blocked":
        raise ValueError(f"attention implementation {impl!r}; use dense, blocked, xla or splash.")
    q_rows = _rows_t_major(q_RxTxNxH, kv)  # [R, K, T * G, H]
    if window is None:
        pre_out, pre_lse = _prefix_pass(q_rows, pk_RxKxJxH, pv_RxKxJxH, prefix_valid_RxJ)
    else:
        pre_out, pre_lse = _prefix_pass(
            q_rows,
            pk_RxKxJxH,
            pv_RxKxJxH,
            prefix_valid_RxJ,
            window,
            jnp.repeat(pos, g, axis=1),
            pre_pos,
        )
    slots = jnp.arange(t, dtype=jnp.int32)
    q_slot = jnp.broadcast_to(jnp.repeat(slots, g)[None], (r, t * g))
    k_slot = jnp.broadcast_to(slots[None], (r, t))
    # One window test: same segment within `window` positions (or, without a window, the
    # segment ids as positions with window 1: the same segment only).
    own_pos = seg if window is None else seg * SEGMENT_STRIDE + pos
    new_out, new_lse = blocked(
        q_rows,
        k_RxKxTxH,
        v_RxKxTxH,
        q_slot,
        k_slot,
        valid_RxT,
        BLOCK_Q,
        BLOCK_K,
        1 if window is None else window,
        jnp.repeat(own_pos, g, axis=1),
        own_pos,
    )
    out, _ = merge(pre_out, pre_lse, new_out, new_lse)
    return _from_rows_t_major(out, t)


def _splash_blocks(length: int) -> int:
    return next(bl for bl in (512, 256, 128) if length % bl == 0)


def _splash(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, valid_q_BxT, valid_BxS, offset: int, window=None):
    """The Pallas splash kernel (MQA form, vmapped over batch rows and KV heads): query t sees
    key s iff s <= t + offset (and t + offset - s < window: a LocalMask, whose empty blocks
    the kernel skips) and both are valid tokens (segment ids 0; padding tokens are
    segment 1 and see only padding, so no row is empty). Lengths are padded to multiples of
    128 (segment 2). On a platform other than TPU the kernel runs in interpret mode."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, n, h = q_BxTxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    tp, sp = t + (-t % 128), s + (-s % 128)
    q = _rows_head_major(q_BxTxNxH * (1.0 / math.sqrt(h)), kv)  # [B, K, G, T, H]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, tp - t), (0, 0)))
    k = jnp.pad(k_BxKxSxH, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
    v = jnp.pad(v_BxKxSxH, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
    seg_q = jnp.pad(jnp.where(valid_q_BxT, 0, 1), ((0, 0), (0, tp - t)), constant_values=2)
    seg_k = jnp.pad(jnp.where(valid_BxS, 0, 1), ((0, 0), (0, sp - s)), constant_values=2)
    bq, bk = _splash_blocks(tp), _splash_blocks(sp)
    sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    if window is None:
        one = sa.CausalMask((tp, sp), offset=offset)
    else:
        one = sa.LocalMask((tp, sp), window_size=(window - 1, 0), offset=offset)
    mask = sa.MultiHeadMask([one for _ in range(g)])
    kernel = sa.make_splash_mqa_single_device(
        mask, block_sizes=sizes, interpret=jax.default_backend() != "tpu"
    )

    def one_row(q_KxGxTxH, k_KxSxH, v_KxSxH, seg_q_T, seg_k_S):
        ids = sa.SegmentIds(q=seg_q_T, kv=seg_k_S)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(
            q_KxGxTxH, k_KxSxH, v_KxSxH
        )

    out = jax.vmap(one_row)(q, k, v, seg_q, seg_k)[:, :, :, :t]  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


def _rows_head_major(q_BxTxNxH, kv: int):
    """[B, T, N, H] -> [B, K, G, T, H]."""
    b, t, n, h = q_BxTxNxH.shape
    return q_BxTxNxH.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)
