"""Memory-efficient token log-probs: vocabulary-blocked with a custom VJP, never [B,T,V] logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gvpo_jax.models.transformer import Transformer

_MIN_BLOCK = 512


def vocab_block_size(num_tokens: int, vocab: int, chunk_size: int) -> int:
    """Rows of the unembedding per block so that one block's logits hold <= chunk_size * V floats.

    A block's logits are [M, Vb] for all M tokens at once, so the peak is set by `chunk_size`
    (tokens' worth of full-vocabulary logits) and does not grow with the batch. Blocks have at
    least min(V, 512) rows.
    """
    budget = (chunk_size * vocab) // max(num_tokens, 1)
    # A floor keeps small-vocabulary models from looping over a handful of rows per block.
    return max(min(vocab, _MIN_BLOCK), min(vocab, budget))


def _as_bits(unembed_VxD):
    """The unembedding as raw bits when it is bf16 (a view for the loops; see `_slice_rows`)."""
    if unembed_VxD.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(unembed_VxD, jnp.uint16)
    return unembed_VxD


def _slice_rows(unembed_bits_VxD, start, block):
    """Rows [start, start + block) of the unembedding (given as `_as_bits`), in its own dtype.

    XLA CPU has no bf16 arithmetic and widens a bf16 loop operand to fp32 for the whole loop:
    a full fp32 copy of the [V, D] matrix (+0.5 GiB at V = 151936, D = 896), the very buffer the
    blocking exists to avoid. Integer bits are left alone; each block is turned back into bf16.
    """
    rows = jax.lax.dynamic_slice_in_dim(unembed_bits_VxD, start, block, 0)
    if rows.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(rows, jnp.bfloat16)
    return rows


def _over_blocks(visit, carry, unembed_VxD, block: int):
    """Fold `visit(carry, rows_BvxD, start) -> carry` over the vocabulary in blocks of `block` rows.

    The full blocks run in one `lax.scan` (rows sliced from the `_as_bits` view inside the loop);
    a last partial block, if any, is visited once after it with a static slice.
    """
    full, tail = divmod(unembed_VxD.shape[0], block)
    bits_VxD = _as_bits(unembed_VxD)

    def step(carry, i):
        start = i * block
        return visit(carry, _slice_rows(bits_VxD, start, block), start), None

    carry, _ = jax.lax.scan(step, carry, jnp.arange(full))
    if tail:
        carry = visit(carry, unembed_VxD[full * block :], full * block)
    return carry


def _block_logits(hidden_MxD, unembed_BvxD):
    return jnp.einsum(
        "md,vd->mv", hidden_MxD, unembed_BvxD, preferred_element_type=jnp.float32
    ).astype(jnp.float32)


def _forward(hidden_MxD, unembed_VxD, targets_M, block, with_entropy: bool = False):
    """(logp_M, lse_M, entropy_M or None): an online log-sum-exp over vocabulary blocks, fp32.

    with_entropy also carries `sum_v exp(l_v - max) l_v` through the same sweep, so the entropy
    `H = lse - E_p[l]` costs one multiply-add per logit and no second pass.
    """
    m, _ = hidden_MxD.shape

    def visit(carry, unembed_BvxD, start):
        max_M, sum_M, target_M, dot_M = carry
        logits_MxBv = _block_logits(hidden_MxD, unembed_BvxD)
        new_max_M = jnp.maximum(max_M, jnp.max(logits_MxBv, axis=-1))
        rescale_M = jnp.exp(max_M - new_max_M)
        exp_MxBv = jnp.exp(logits_MxBv - new_max_M[:, None])
        sum_M = sum_M * rescale_M + jnp.sum(exp_MxBv, axis=-1)
        if with_entropy:
            dot_M = dot_M * rescale_M + jnp.sum(exp_MxBv * logits_MxBv, axis=-1)
        local_M = targets_M - start
        hit_M = (local_M >= 0) & (local_M < unembed_BvxD.shape[0])
        picked_M = jnp.take_along_axis(
            logits_MxBv, jnp.clip(local_M, 0, unembed_BvxD.shape[0] - 1)[:, None], axis=-1
        )[:, 0]
        return new_max_M, sum_M, target_M + jnp.where(hit_M, picked_M, 0.0), dot_M

    zeros = jnp.zeros((m,), jnp.float32)
    carry = (jnp.full((m,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    max_M, sum_M, target_M, dot_M = _over_blocks(visit, carry, unembed_VxD, block)
    lse_M = max_M + jnp.log(sum_M)
    entropy_M = lse_M - dot_M / sum_M if with_entropy else None
    return target_M - lse_M, lse_M, entropy_M


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked_logprobs(hidden_MxD, unembed_VxD, targets_M, block):
    return _forward(hidden_MxD, unembed_VxD, targets_M, block)[0]


def _blocked_fwd(hidden_MxD, unembed_VxD, targets_M, block):
    logp_M, lse_M, _ = _forward(hidden_MxD, unembed_VxD, targets_M, block)
    return logp_M, (hidden_MxD, unembed_VxD, targets_M, lse_M, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked_logprobs_entropy(hidden_MxD, unembed_VxD, targets_M, block):
    logp_M, _, entropy_M = _forward(hidden_MxD, unembed_VxD, targets_M, block, True)
    return logp_M, entropy_M


def _blocked_entropy_fwd(hidden_MxD, unembed_VxD, targets_M, block):
    logp_M, lse_M, entropy_M = _forward(hidden_MxD, unembed_VxD, targets_M, block, True)
    mean_logit_M = lse_M - entropy_M  # E_p[l], what the entropy's gradient needs
    return (logp_M, entropy_M), (hidden_MxD, unembed_VxD, targets_M, lse_M, mean_logit_M)


def _blocked_bwd(block, residuals, cotangents):
    """d logp_m / d logits_mv = onehot(y_m)_v - p_mv and d H_m / d logits_mv = -p_mv (l_mv -
    E_p[l_m]), recomputed block by block.

    The unembedding gradient of a block depends only on that block's logits, so each block's
    rows are written once into the output (in the parameter dtype): no [V, D] accumulator and no
    per-block [V, D] product, just the [M, Vb] logits of one block and the [M, D] hidden gradient.
    """
    hidden_MxD, unembed_VxD, targets_M, lse_M, mean_logit_M = residuals
    if mean_logit_M is None:
        g_M, h_M = cotangents, None
    else:
        g_M, h_M = cotangents
        h_M = h_M.astype(jnp.float32)
    g_M = g_M.astype(jnp.float32)
    # The two gradient products run in the compute dtype (the hidden states'), accumulating in
    # fp32 at least, like the forward's logits: with bf16 compute both stay bf16 matmuls.
    compute = jnp.promote_types(hidden_MxD.dtype, unembed_VxD.dtype)
    acc = jnp.promote_types(compute, jnp.float32)

    def visit(carry, unembed_BvxD, start):
        dh_MxD, dw_bits_VxD = carry
        logits_MxBv = _block_logits(hidden_MxD, unembed_BvxD)
        probs_MxBv = jnp.exp(logits_MxBv - lse_M[:, None])
        local_M = targets_M - start
        onehot_MxBv = local_M[:, None] == jnp.arange(unembed_BvxD.shape[0])[None, :]
        dlogits_MxBv = g_M[:, None] * (onehot_MxBv.astype(jnp.float32) - probs_MxBv)
        if h_M is not None:
            centred_MxBv = logits_MxBv - mean_logit_M[:, None]
            dlogits_MxBv = dlogits_MxBv - h_M[:, None] * probs_MxBv * centred_MxBv
        dlogits_MxBv = dlogits_MxBv.astype(compute)
        dh_MxD = dh_MxD + jnp.matmul(
            dlogits_MxBv, unembed_BvxD.astype(compute), preferred_element_type=acc
        )
        dw_BvxD = jnp.matmul(
            dlogits_MxBv.T, hidden_MxD.astype(compute), preferred_element_type=acc
        ).astype(unembed_VxD.dtype)
        dw_bits_VxD = jax.lax.dynamic_update_slice_in_dim(
            dw_bits_VxD, _as_bits(dw_BvxD), start, axis=0
        )
        return dh_MxD, dw_bits_VxD

    # The gradient is built in the `_as_bits` view too, for the same reason as the operand.
    dw_bits_VxD = jnp.zeros(unembed_VxD.shape, _as_bits(unembed_VxD).dtype)
    carry = (jnp.zeros(hidden_MxD.shape, acc), dw_bits_VxD)
    dh_MxD, dw_VxD = _over_blocks(visit, carry, unembed_VxD, block)
    if dw_VxD.dtype != unembed_VxD.dtype:
        dw_VxD = jax.lax.bitcast_convert_type(dw_VxD, unembed_VxD.dtype)
    return dh_MxD.astype(hidden_MxD.dtype), dw_VxD, None


_blocked_logprobs.defvjp(_blocked_fwd, _blocked_bwd)
_blocked_logprobs_entropy.defvjp(_blocked_entropy_fwd, _blocked_bwd)


def chunked_logprobs(
    hidden_BxTxD: jax.Array,
    unembed_VxD: jax.Array,
    targets_BxT: jax.Array,
    *,
    chunk_size: int,
    with_entropy: bool = False,
):
    """fp32 [B, T]: log softmax(hidden[b, t] @ unembed.T)[targets[b, t]]; with_entropy=True
    returns (logp, entropy), entropy[b, t] = -sum_v p log p of the same distribution.

    The B*T tokens are taken together and the vocabulary is cut into blocks of Vb rows
    (`vocab_block_size`): the forward keeps an online log-sum-exp over the blocks (and, for the
    entropy, the running `sum exp(l) l`), and the custom backward recomputes one block's logits
    at a time. At most chunk_size * V fp32 logits live at once, whatever B and T are; the
    unembedding gradient is written block by block in the parameter dtype, so there is no fp32
    [V, D] accumulator either. Values and gradients equal `naive_logprobs` (fp32 rounding aside).
    """
    b, t, d = hidden_BxTxD.shape
    vocab = unembed_VxD.shape[0]
    block = vocab_block_size(b * t, vocab, chunk_size)
    args = (hidden_BxTxD.reshape(b * t, d), unembed_VxD, targets_BxT.reshape(b * t), block)
    if with_entropy:
        logp_M, entropy_M = _blocked_logprobs_entropy(*args)
        return logp_M.reshape(b, t), entropy_M.reshape(b, t)
    return _blocked_logprobs(*args).reshape(b, t)


def naive_logprobs(
    hidden_BxTxD: jax.Array,
    unembed_VxD: jax.Array,
    targets_BxT: jax.Array,
    *,
    with_entropy: bool = False,
):
    """Reference for `chunked_logprobs`: materialises the full fp32 [B, T, V] logits."""
    logits_BxTxV = jnp.einsum(
        "btd,vd->btv", hidden_BxTxD, unembed_VxD, preferred_element_type=jnp.float32
    ).astype(jnp.float32)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    if with_entropy:
        return logp_BxT, -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)
    return logp_BxT


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
