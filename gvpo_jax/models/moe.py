"""Mixture-of-experts routing and dispatch (Qwen3-MoE), pure functions of arrays.

`route` picks each token's experts: the router's logits softmaxed in fp32, the top k kept and,
with `norm_topk_prob`, renormalised to sum 1 (transformers' `Qwen3MoeTopKRouter`). Routing is
dropless: every token reaches all k of its experts whatever the load (no capacity factor: a
dropped token would change its log-prob, and RL's ratios and GVPO's implicit reward need
exact ones).

Three dispatches compute the same sum_k w_k * expert_{e_k}(x), to float tolerance:

- `dense`: every expert on every token, weighted by the gates (zero off the top k). Its cost
  scales with E; the reference for tests and tiny models.
- `grouped`: the (token, expert) assignments grouped by expert (a running count up to
  `COUNT_UP_TO_EXPERTS` experts, a sort beyond), each expert's group padded to a whole number
  of blocks, each block through its expert's MLP (from `SCAN_FROM_BLOCKS` blocks one scan,
  a block's three products in one step on the weights read in place; below, three batched
  matmuls on weights gathered per block). Its cost
  scales with N * k, plus at most one partial block per expert: CPU's path (XLA:CPU lowers
  `ragged_dot` to a dense product over all E experts).
- `ragged`: the same sorted assignments through `jax.lax.ragged_dot` (grouped matmul kernels
  on TPU and GPU; no padding).

Shapes: N tokens (batch x length flattened), D model width, E experts, F an expert's width, K
experts per token.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

DISPATCHES = ("dense", "grouped", "ragged")


class Balance(NamedTuple):
    """An MoE layer's load over the real tokens of one call, as sums (so calls and shards add
    up exactly): `tokens` [S] real tokens, `counts` [S, E] the assignments each expert
    received (top-k slots: they sum to k x tokens; no gradient), `probs` [S, E] the router's
    fp32 softmax summed over those tokens (differentiable). S: one entry per batch shard of
    the layer's `shard_map` (1 without). What the load-balancing loss reads (`balance_loss`)."""

    tokens: jax.Array
    counts: jax.Array
    probs: jax.Array


class Routes(NamedTuple):
    """What an MoE layer's router decided for each token: `experts` int32 [..., K], the
    experts it went to (what replay feeds back; the replayed ones where a record was
    replayed), `entropy` fp32 [...], the entropy in nats of the router's softmax over all E
    experts (a metric), `balance` (`Balance`: the call's load, per batch shard) and `drift`
    fp32 [...], 1.0 where a token's recorded experts (`Replay`) differ from the set this router
    picks itself, replayed or not (0 where there is no record).
    `Transformer.hidden(with_routes=True)` stacks them over the MoE layers, [M, B, T, ...] and
    [M, S, ...]."""

    experts: jax.Array
    entropy: jax.Array
    balance: Balance | None = None
    drift: jax.Array | None = None


class Replay(NamedTuple):
    """A recorded routing (routing replay, docs/routing_replay.md): `experts` [M, B, T, K]
    integers, the experts of each token in each of the M MoE layers (layer order); `mask` [B,
    T], True where the record holds (padding, a response's last token the sampler never fed
    back and rows with no record have none); `apply` [B, T], True where the record replaces
    the router's choice (elsewhere the router picks and the record is only compared with it,
    `Routes.drift`)."""

    experts: jax.Array
    mask: jax.Array
    apply: jax.Array


def resolve(dispatch: str, platform: str | None = None) -> str:
    """The dispatch `auto` stands for: ragged_dot on TPU and GPU, the grouped path on CPU."""
    if dispatch != "auto":
        return dispatch
    platform = platform or jax.default_backend()
    return "grouped" if platform == "cpu" else "ragged"


def entropy(logits_NxE: jax.Array) -> jax.Array:
    """The router softmax's entropy per token, fp32 [N] (nats; log E when uniform)."""
    logp_NxE = jax.nn.log_softmax(logits_NxE.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp_NxE) * logp_NxE, axis=-1)


def balance(logits_NxE: jax.Array, experts_NxK: jax.Array, valid_N: jax.Array) -> Balance:
    """One call's `Balance` over its valid tokens (a leading axis of 1: this shard's entry)."""
    e = logits_NxE.shape[-1]
    valid_N = valid_N.astype(jnp.float32)
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    w_NxK = jnp.broadcast_to(valid_N[:, None], experts_NxK.shape)
    counts_E = jnp.zeros((e,), jnp.float32).at[experts_NxK.reshape(-1)].add(w_NxK.reshape(-1))
    return Balance(
        tokens=jnp.sum(valid_N)[None],
        counts=jax.lax.stop_gradient(counts_E)[None],
        probs=jnp.einsum("ne,n->e", probs_NxE, valid_N)[None],
    )


def balance_loss(b: Balance) -> jax.Array:
    """The router's load-balancing loss of stacked layers' `Balance` ([M, S, ...]): per MoE
    layer E * sum_e f_e * P_e, with f_e = the assignments expert e received per real token
    and P_e = its mean router probability over them (the Switch Transformer's loss on
    transformers' scale: f sums to k, so a perfectly balanced layer scores k), then the mean
    over layers. Its gradient reaches the router through P; f is a count."""
    e = b.counts.shape[-1]
    tokens_M = jnp.maximum(jnp.sum(b.tokens, axis=1), 1.0)
    f_MxE = jnp.sum(b.counts, axis=1) / tokens_M[:, None]
    p_MxE = jnp.sum(b.probs, axis=1) / tokens_M[:, None]
    return jnp.mean(e * jnp.sum(f_MxE * p_MxE, axis=-1))


def combine_balance(parts: list[tuple[Balance, float]]) -> Balance:
    """The `Balance` of several calls' tokens ([M, S, ...] each, equal M), each weighted (a
    shared prompt run once for G rows counts G times), summed over their shards."""
    return Balance(*(
        sum(w * jnp.sum(getattr(b, f), axis=1, keepdims=True) for b, w in parts)
        for f in Balance._fields
    ))  # fmt: skip


def route(
    logits_NxE: jax.Array,
    k: int,
    *,
    normalize: bool,
    experts_NxK: jax.Array | None = None,
    replay_N: jax.Array | None = None,
    recorded_N: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(gate weights [N, K] fp32, expert indices [N, K] int32, drift [N] fp32) of the k
    experts of highest router probability per token, the probabilities a softmax in fp32
    (ties: the lower index first, as `lax.top_k`), renormalised over the k when `normalize`.

    Given a record `experts_NxK` (held where `recorded_N`, default everywhere), `drift` is 1.0
    where the record's set of experts differs from the router's own top k (else 0); where
    `replay_N` (default: where recorded) the record's experts are used instead, gated by this
    router's probabilities at them and renormalised the same way, so the router keeps its
    gradient."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    weights_NxK, own_NxK = jax.lax.top_k(probs_NxE, k)
    drift_N = jnp.zeros(own_NxK.shape[:1], jnp.float32)
    if experts_NxK is not None:
        record_NxK = experts_NxK.astype(jnp.int32)
        recorded_N = jnp.ones_like(drift_N, bool) if recorded_N is None else recorded_N
        replay_N = recorded_N if replay_N is None else replay_N & recorded_N
        differs_N = jnp.any(jnp.sort(record_NxK, axis=-1) != jnp.sort(own_NxK, axis=-1), axis=-1)
        drift_N = (differs_N & recorded_N).astype(jnp.float32)
        own_NxK = jnp.where(replay_N[:, None], record_NxK, own_NxK)
        weights_NxK = jnp.take_along_axis(probs_NxE, own_NxK, axis=-1)
    if normalize:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, own_NxK, drift_N


def dense(x_NxD, gate_ExDxF, up_ExDxF, down_ExFxD, weights_NxK, experts_NxK, act):
    """Every expert on every token, combined with the gate weights (0 off the top k)."""
    e = gate_ExDxF.shape[0]
    onehot_NxKxE = jax.nn.one_hot(experts_NxK, e, dtype=x_NxD.dtype)
    combine_NxE = jnp.einsum("nk,nke->ne", weights_NxK.astype(x_NxD.dtype), onehot_NxKxE)
    gate_ExNxF = jnp.einsum("nd,edf->enf", x_NxD, gate_ExDxF)
    up_ExNxF = jnp.einsum("nd,edf->enf", x_NxD, up_ExDxF)
    out_ExNxD = jnp.einsum("enf,efd->end", act(gate_ExNxF, up_ExNxF), down_ExFxD)
    return jnp.einsum("end,ne->nd", out_ExNxD, combine_NxE)


def _sorted(experts_NxK: jax.Array, e: int):
    """The N*K assignments sorted by expert (stably: by token within an expert): (order [NK],
    the original assignment of each sorted one; sizes [E], the tokens per expert)."""
    flat_A = experts_NxK.reshape(-1)
    order_A = jnp.argsort(flat_A, stable=True)
    sizes_E = jnp.bincount(flat_A, length=e).astype(jnp.int32)
    return order_A, sizes_E


def _combine(out_AxD, order_A, weights_NxK):
    """Sorted assignments' outputs back to their tokens, summed with the gate weights."""
    n, k = weights_NxK.shape
    by_assignment_AxD = jnp.zeros_like(out_AxD).at[order_A].set(out_AxD, unique_indices=True)
    by_token_NxKxD = by_assignment_AxD.reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", by_token_NxKxD, weights_NxK.astype(out_AxD.dtype))


# Up to this many experts the grouped path ranks each assignment within its expert by a
# running count over a one-hot [N*K, E] table rather than sorting the N*K assignments:
# XLA:CPU's sort costs 4-5 ms at the small MoE's update shapes, the count 1.6 ms at 8 experts
# and 4.4 ms at 32; from 64 experts the sort is cheaper (BENCHMARKS section 21).
COUNT_UP_TO_EXPERTS = 32


def _padded_rows(experts_NxK: jax.Array, e: int, block: int):
    """The grouped path's layout: (row_A [N*K], each assignment's row once the assignments are
    grouped by expert and each group padded to whole blocks, in the assignments' own order;
    ends_E [E], where each padded group ends). Within a group the assignments keep their
    token order (a stable sort's)."""
    flat_A = experts_NxK.reshape(-1)
    a = flat_A.shape[0]
    if e <= COUNT_UP_TO_EXPERTS:
        onehot_AxE = (flat_A[:, None] == jnp.arange(e, dtype=flat_A.dtype)).astype(jnp.int32)
        count_AxE = jnp.cumsum(onehot_AxE, axis=0)  # each expert's assignments so far
        sizes_E = count_AxE[-1]
        rank_A = jnp.take_along_axis(count_AxE, flat_A[:, None], axis=1)[:, 0] - 1
    else:
        order_A, sizes_E = _sorted(experts_NxK, e)
        group_first_E = jnp.cumsum(sizes_E) - sizes_E  # its first position among the sorted
        rank_S = jnp.arange(a, dtype=jnp.int32) - group_first_E[flat_A[order_A]]
        rank_A = jnp.zeros((a,), jnp.int32).at[order_A].set(rank_S, unique_indices=True)
    padded_E = (sizes_E + block - 1) // block * block
    ends_E = jnp.cumsum(padded_E)
    return (ends_E - padded_E)[flat_A] + rank_A, ends_E


def block_size(assignments: int, experts: int, most: int) -> int:
    """The grouped path's rows per block for N*K `assignments` over E experts: about the mean
    group (N*K / E) rounded up to a power of two, at least 8 and at most `most`. Small blocks
    keep the padding (at most E * (block - 1) rows) in proportion at decode; large ones make
    fewer, larger matmuls."""
    mean = max(assignments // max(experts, 1), 1)
    return int(min(max(8, 1 << (mean - 1).bit_length()), max(most, 1)))


# From this many blocks the grouped path runs `block_mlp`'s scan; below it one
# batched product on the gathered weights (`gathered_matmul`), as fast where the copy is small
# (a decode step's few blocks: BENCHMARKS section 21) and quicker to compile.
SCAN_FROM_BLOCKS = 64


def gathered_matmul(x_BxMxI: jax.Array, w_ExIxO: jax.Array, expert_B: jax.Array) -> jax.Array:
    """Each block of rows times its expert's weights, out[b] = x[b] @ w[expert_B[b]]
    ([B, M, O]), as one batched matmul on a copy of each block's weights."""
    return jnp.einsum("bmi,bio->bmo", x_BxMxI, w_ExIxO[expert_B])


def _varying(a: jax.Array) -> frozenset:
    """The mesh axes `a` varies along inside a `shard_map` (its type's `manual_axis_type`;
    `vma` in older JAX), empty outside one."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def _vary_like(a: jax.Array, like: jax.Array) -> jax.Array:
    """`a` cast to vary along the mesh axes `like` varies along (inside a `shard_map`; outside
    one, and where it already does, `a` itself)."""
    missing = _varying(like) - _varying(a)
    return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a


def block_mlp(x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, act):
    """Each block of rows through its expert's whole MLP: out[b] = act(x[b] @ gate[e],
    x[b] @ up[e]) @ down[e] with e = expert_B[b] ([B, M, D]).

    A scan over the blocks, a block's three products in one step, each expert's weights read in
    place: `gathered_matmul` would first copy a [B, I, O] weight per block (on XLA:CPU that
    copy cost more than the products), and a scan per product takes three times the loop steps
    (XLA:CPU pays per step and runs a loop's small products on one thread: BENCHMARKS.md
    section 25). Its gradient (`_block_mlp`'s rule) is one scan too: dx per block and each
    expert's three weight gradients summed in place in fp32, from the gate and up activations
    the forward keeps.

    Inside a `shard_map` the weights enter whole along the batch's mesh axes while the rows
    vary along them; the weights are cast to the rows' varying axes before the custom rule, so
    the rule's per-device dw has the type of its input and the cast's transpose sums it over
    those axes (as JAX's own rule for the gather would)."""
    gate, up, down = (_vary_like(w, x_BxMxD) for w in (gate_ExDxF, up_ExDxF, down_ExFxD))
    return _block_mlp(x_BxMxD, gate, up, down, expert_B, act)


def _expert(w_ExIxO, e):
    return jax.lax.dynamic_index_in_dim(w_ExIxO, e, keepdims=False)


def _add_to_expert(acc_ExIxO, e, value_IxO):
    return jax.lax.dynamic_update_index_in_dim(acc_ExIxO, _expert(acc_ExIxO, e) + value_IxO, e, 0)


def _block_mlp_scan(x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, act, keep: bool):
    def body(_, inputs):
        x_MxD, e = inputs
        gate_MxF, up_MxF = x_MxD @ _expert(gate_ExDxF, e), x_MxD @ _expert(up_ExDxF, e)
        out_MxD = act(gate_MxF, up_MxF) @ _expert(down_ExFxD, e)
        return None, (out_MxD, gate_MxF, up_MxF) if keep else out_MxD

    return jax.lax.scan(body, None, (x_BxMxD, expert_B))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _block_mlp(x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, act):
    return _block_mlp_scan(x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, act, False)


def _block_mlp_fwd(x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, act):
    weights = (gate_ExDxF, up_ExDxF, down_ExFxD)
    out_BxMxD, gate_BxMxF, up_BxMxF = _block_mlp_scan(x_BxMxD, *weights, expert_B, act, True)
    return out_BxMxD, (x_BxMxD, *weights, expert_B, gate_BxMxF, up_BxMxF)


def _block_mlp_bwd(act, residuals, g_BxMxD):
    x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, gate_BxMxF, up_BxMxF = residuals
    f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)

    def body(dw, inputs):
        dgate_ExDxF, dup_ExDxF, ddown_ExFxD = dw
        x_MxD, g_MxD, gate_MxF, up_MxF, e = inputs
        a_MxF, act_vjp = jax.vjp(act, gate_MxF, up_MxF)
        dgate_MxF, dup_MxF = act_vjp(g_MxD @ _expert(down_ExFxD, e).T)
        dx_MxD = dgate_MxF @ _expert(gate_ExDxF, e).T + dup_MxF @ _expert(up_ExDxF, e).T
        dw = (
            _add_to_expert(dgate_ExDxF, e, f32(x_MxD.T, dgate_MxF)),
            _add_to_expert(dup_ExDxF, e, f32(x_MxD.T, dup_MxF)),
            _add_to_expert(ddown_ExFxD, e, f32(a_MxF.T, g_MxD)),
        )
        return dw, dx_MxD

    weights = (gate_ExDxF, up_ExDxF, down_ExFxD)
    # dw summed in fp32 over the blocks (a bf16 sum over many blocks would round each step)
    dw0 = tuple(_vary_like(jnp.zeros(w.shape, jnp.float32), x_BxMxD) for w in weights)
    g_BxMxD = g_BxMxD.astype(x_BxMxD.dtype)
    dw, dx_BxMxD = jax.lax.scan(body, dw0, (x_BxMxD, g_BxMxD, gate_BxMxF, up_BxMxF, expert_B))
    return dx_BxMxD, *(d.astype(w.dtype) for d, w in zip(dw, weights, strict=True)), None


_block_mlp.defvjp(_block_mlp_fwd, _block_mlp_bwd)


# The grouped path's two moves of [A, D] rows, both ways by gathers. `row_A` (each assignment's
# padded row, token-major) and `src_R` (each padded row's assignment, A for a padding row) are
# inverse permutations, so each move's transpose is the other's gather: JAX's own transposes
# would be a scatter (into the padded rows) and a scatter-add (of the rows read back), which
# XLA:CPU runs several times slower than a gather (BENCHMARKS section 21).


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _to_rows(x_NxD, src_R, row_A, k):
    """Each token's k copies at their padded rows ([R, D]; padding rows zero)."""
    del row_A
    zero_1xD = jnp.zeros((1, x_NxD.shape[1]), x_NxD.dtype)
    return jnp.concatenate([x_NxD, zero_1xD])[src_R // k]


def _to_rows_fwd(x_NxD, src_R, row_A, k):
    return _to_rows(x_NxD, src_R, row_A, k), row_A


def _to_rows_bwd(k, row_A, g_RxD):
    g_AxD = g_RxD[row_A]
    return g_AxD.reshape(-1, k, g_AxD.shape[1]).sum(axis=1), None, None


_to_rows.defvjp(_to_rows_fwd, _to_rows_bwd)


@jax.custom_vjp
def _from_rows(out_RxD, row_A, src_R):
    """The padded rows read back per assignment ([A, D], token-major)."""
    del src_R
    return out_RxD[row_A]


def _from_rows_fwd(out_RxD, row_A, src_R):
    return _from_rows(out_RxD, row_A, src_R), src_R


def _from_rows_bwd(src_R, g_AxD):
    zero_1xD = jnp.zeros((1, g_AxD.shape[1]), g_AxD.dtype)
    return jnp.concatenate([g_AxD, zero_1xD])[src_R], None, None


_from_rows.defvjp(_from_rows_fwd, _from_rows_bwd)


def grouped(x_NxD, gate_ExDxF, up_ExDxF, down_ExFxD, weights_NxK, experts_NxK, act, *, block):
    """The assignments sorted by expert, each expert's group padded to whole blocks of `block`
    rows, each block through its expert's MLP (`block_mlp`). Static shapes: the padded rows
    are at most N*K + E*(block - 1), rounded up to a whole block; blocks past the last group
    compute on zero rows and are never read back."""
    n, k = experts_NxK.shape
    e = gate_ExDxF.shape[0]
    a = n * k
    blocks = -(-(a + e * (block - 1)) // block)
    rows = blocks * block
    # each assignment's padded row, in the assignments' own order (token-major): the rows go
    # out and come back by gathers, no [A, D] permutation between
    row_A, ends_E = _padded_rows(experts_NxK, e, block)
    # and each padded row's assignment (a: a padding row)
    arange_A = jnp.arange(a, dtype=jnp.int32)
    src_R = jnp.full((rows,), a, jnp.int32).at[row_A].set(arange_A, unique_indices=True)
    x_RxD = _to_rows(x_NxD, src_R, row_A, k)
    # expert of each block: the group whose padded rows hold its first row (past the last
    # group: the last expert, on zero rows)
    first_row_B = jnp.arange(blocks, dtype=jnp.int32) * block
    # (a count, not jnp.searchsorted: that one fails to trace inside a shard_map)
    expert_B = jnp.sum(ends_E[None, :] <= first_row_B[:, None], axis=1, dtype=jnp.int32)
    expert_B = jnp.minimum(expert_B, e - 1)
    x_BxMxD = x_RxD.reshape(blocks, block, -1)
    if blocks >= SCAN_FROM_BLOCKS:  # one scan over the blocks, each its expert's whole MLP
        out_BxMxD = block_mlp(x_BxMxD, gate_ExDxF, up_ExDxF, down_ExFxD, expert_B, act)
    else:
        gate_BxMxF = gathered_matmul(x_BxMxD, gate_ExDxF, expert_B)
        up_BxMxF = gathered_matmul(x_BxMxD, up_ExDxF, expert_B)
        out_BxMxD = gathered_matmul(act(gate_BxMxF, up_BxMxF), down_ExFxD, expert_B)
    out_NxKxD = _from_rows(out_BxMxD.reshape(rows, -1), row_A, src_R).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out_NxKxD, weights_NxK.astype(out_NxKxD.dtype))


def ragged(x_NxD, gate_ExDxF, up_ExDxF, down_ExFxD, weights_NxK, experts_NxK, act):
    """The assignments sorted by expert through `jax.lax.ragged_dot` (a grouped matmul)."""
    k = experts_NxK.shape[1]
    order_A, sizes_E = _sorted(experts_NxK, gate_ExDxF.shape[0])
    x_AxD = x_NxD[order_A // k]
    gate_AxF = jax.lax.ragged_dot(x_AxD, gate_ExDxF, sizes_E)
    up_AxF = jax.lax.ragged_dot(x_AxD, up_ExDxF, sizes_E)
    out_AxD = jax.lax.ragged_dot(act(gate_AxF, up_AxF), down_ExFxD, sizes_E)
    return _combine(out_AxD, order_A, weights_NxK)


def routing_sums(routes: Routes, weight_BxS: jax.Array) -> dict[str, jax.Array]:
    """Per MoE layer, sums over the tokens of one forward's `routes` ([M, B, S, ...]) weighted
    by `weight_BxS` (the tokens whose routing the sampler recorded; a shared prompt slot
    weighted by the rows that hold it): `drifted` [M] (`Routes.drift`: 1 where the record's
    expert set differs from the router's own), `entropy` [M] (the router's, nats) and `counts`
    [M, E] (the top-k assignments each expert received, the record's where it was replayed).
    Sums, so micro-batches, shards and updates add up exactly (`routing.metrics` divides)."""
    w_BxS = weight_BxS.astype(jnp.float32)
    m, e = routes.experts.shape[0], routes.balance.counts.shape[-1]
    w_MxBxSxK = jnp.broadcast_to(w_BxS[None, ..., None], routes.experts.shape)
    layer_MxBxSxK = jnp.broadcast_to(
        jnp.arange(m, dtype=jnp.int32).reshape(m, *(1,) * (routes.experts.ndim - 1)),
        routes.experts.shape,
    )
    counts_MxE = (
        jnp.zeros((m, e), jnp.float32)
        .at[layer_MxBxSxK.reshape(-1), routes.experts.reshape(-1)]
        .add(w_MxBxSxK.reshape(-1))
    )
    drift = routes.drift if routes.drift is not None else jnp.zeros_like(routes.entropy)
    return {
        "drifted": jnp.sum(drift * w_BxS[None], axis=(1, 2)),
        "entropy": jnp.sum(routes.entropy * w_BxS[None], axis=(1, 2)),
        "counts": jax.lax.stop_gradient(counts_MxE),
    }


def exchange(x_NxD, gates_NxK, experts_NxK, local, *, axis: str, shards: int, local_experts: int):
    """Expert parallelism, inside a `shard_map` whose `axis` (of `shards` devices) splits the
    experts: device j holds experts [j * local_experts, (j + 1) * local_experts). Each of this
    device's N*k assignments goes to its expert's device and comes back, by two fixed-size
    `all_to_all`s; `local(rows_RxD, experts_Rx1)` runs this device's experts on what it
    received (local expert ids; R = shards * N * k).

    Dropless with static shapes: the send buffer gives every destination room for all N*k of
    this device's assignments (the worst case: every token routed to one device), so it and the
    receive buffer are [shards, N*k, D], shards times the assignments' size, and the experts
    run on all of it (empty rows gated off). That is XLA:CPU's and the fake mesh's exchange,
    which has no `ragged_all_to_all`; a TPU / GPU run would send only the filled rows
    (`jax.lax.ragged_all_to_all`) and run `ragged_dot` on them."""
    n, k = experts_NxK.shape
    a, d = n * k, x_NxD.shape[1]
    flat_A = experts_NxK.reshape(-1)
    dest_A = flat_A // local_experts
    order_A = jnp.argsort(dest_A, stable=True)
    dest_S = dest_A[order_A]  # the sorted assignments' destinations
    counts = jnp.bincount(dest_A, length=shards).astype(jnp.int32)
    pos_S = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest_S]
    send_xD = (
        jnp.zeros((shards, a, d), x_NxD.dtype)
        .at[dest_S, pos_S]
        .set(x_NxD[order_A // k], unique_indices=True)
    )
    send_e = (
        jnp.full((shards, a), -1, jnp.int32)
        .at[dest_S, pos_S]
        .set(flat_A[order_A] % local_experts, unique_indices=True)
    )
    recv_xD = jax.lax.all_to_all(send_xD, axis, 0, 0)  # [j]: what device j sent here
    recv_e = jax.lax.all_to_all(send_e, axis, 0, 0)
    valid_R = (recv_e >= 0).reshape(-1, 1)
    out_RxD = local(recv_xD.reshape(shards * a, d), jnp.maximum(recv_e, 0).reshape(-1, 1))
    out_RxD = jnp.where(valid_R, out_RxD, jnp.zeros((), out_RxD.dtype))
    back_xD = jax.lax.all_to_all(out_RxD.reshape(shards, a, d), axis, 0, 0)
    return _combine(back_xD[dest_S, pos_S], order_A, gates_NxK)
