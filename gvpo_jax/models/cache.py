"""Typed KV caches: one small pytree dataclass per layout, with the attention that reads it.

- `KVCache`: every row its own keys and values, [B, K, S, H] (prefill, plain decoding).
- `SharedPrefixCache`: B = P * R rows continuing P prefixes stored once (the G samples of a
  prompt). Two layouts: [.., S, H] for the update's multi-token forward
  (`Transformer.hidden_shared_prefix`) and slot-last [.., H, S] for decode steps (the sampler).
- `SlotCache`: continuous batching's decode slots, each pointing at one of P stored prefixes.
- `PackedPrefixCache`: the update's packed rows, several sequences (segments) behind one prefix.

`Transformer.init_cache`, `share_prefix_cache` and `slot_cache` build them; a layer's
`Attention` hands its new keys and values to `cache.attend(...)`, which writes them and returns
(out [B, T, N, H], the updated cache). The kernels live in `models/attention.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from flax.linen import with_logical_constraint

from gvpo_jax.models import attention as kernels

# Logical axis names of the caches (see `models.transformer` for the parameters' and
# activations'). Decode caches store keys and values slot-last, [.., K, H, S].
CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")
DECODE_CACHE_AXES = ("batch", "kv_heads", "head_dim", "cache_length")


def per_layer(fn, cache):
    """`fn` applied to each layer's cache: a list of per-layer caches (unrolled layers), or one
    cache whose arrays are stacked [L, ...] (`ModelConfig.scan_layers`; `fn` is vmapped)."""
    if isinstance(cache, (list, tuple)):
        return [fn(c) for c in cache]
    return jax.vmap(fn)(cache)


def layer(cache, index: int):
    """Layer `index`'s cache of a list of per-layer caches or of a stacked one."""
    if isinstance(cache, (list, tuple)):
        return cache[index]
    return jax.tree.map(lambda a: a[index], cache)


@struct.dataclass
class KVCache:
    """Keys and values of every row: k, v [B, K, S, H] (compute dtype), valid bool [B, S], and
    each key's position pos int32 [B, S] (what a sliding window measures its distance in)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    pos: jax.Array

    @classmethod
    def empty(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype):
        shape = (batch, num_kv_heads, max_len, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch, max_len), jnp.bool_),
            pos=jnp.zeros((batch, max_len), jnp.int32),
        )

    def attend(
        self,
        impl,
        q_BxTxNxH,
        k_BxKxTxH,
        v_BxKxTxH,
        valid_BxT,
        index,
        window=None,
        positions_BxT=None,
    ):
        """Writes the T new keys/values (and their positions) at slots [index, index + T) and
        attends causally over the cache's S slots with kernel `impl` (a `ModelConfig.attention`
        name); a sliding `window` also masks keys window or more positions before the query
        (the cache keeps every slot: a sliding layer's cache is as long as a full layer's)."""
        b, t, n = q_BxTxNxH.shape[:3]
        i = jnp.asarray(index, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        write = lambda buf, new: jax.lax.dynamic_update_slice(
            buf, new.astype(buf.dtype), (zero, zero, i, zero)
        )
        if positions_BxT is None:  # consecutive slots from `index`
            positions_BxT = jnp.broadcast_to(i + jnp.arange(t, dtype=jnp.int32), (b, t))
        positions_BxT = positions_BxT.astype(jnp.int32)
        cache = KVCache(
            k=write(self.k, k_BxKxTxH),
            v=write(self.v, v_BxKxTxH),
            valid=jax.lax.dynamic_update_slice(self.valid, valid_BxT, (zero, i)),
            pos=jax.lax.dynamic_update_slice(self.pos, positions_BxT, (zero, i)),
        )
        s = cache.k.shape[2]
        impl = kernels.choose(impl, t=t, g=n // cache.k.shape[1], keys=s)
        out_BxTxNxH = kernels.causal(
            impl,
            q_BxTxNxH,
            cache.k,
            cache.v,
            valid_BxT,
            cache.valid,
            i + jnp.arange(t),
            jnp.arange(s),
            cache_index=index,
            window=window,
            positions=None if window is None else (positions_BxT, cache.pos),
        )
        return out_BxTxNxH, cache


# ----------------------------------------------------------------------------------------------
# Shared prefixes


def _two_part_softmax(pre_scores, pre_mask, new_scores, new_mask):
    """Unnormalised softmax weights over two key sets (a shared prefix and a row's own new
    tokens) without concatenating them: masked scores, one max over both, exp, and the shared
    denominator [..., 1]. Returns (pre_weights, new_weights, total)."""
    pre_scores = jnp.where(pre_mask, pre_scores, kernels.MASKED)
    new_scores = jnp.where(new_mask, new_scores, kernels.MASKED)
    top = jnp.maximum(
        jnp.max(pre_scores, axis=-1, keepdims=True), jnp.max(new_scores, axis=-1, keepdims=True)
    )
    pre_weights, new_weights = jnp.exp(pre_scores - top), jnp.exp(new_scores - top)
    total = jnp.sum(pre_weights, axis=-1, keepdims=True) + jnp.sum(
        new_weights, axis=-1, keepdims=True
    )
    return pre_weights, new_weights, total


def _prefix_queries(q_BxTxNxH, p: int, kv: int) -> jax.Array:
    """Queries of B = P * R rows continuing P prefixes as [P, K, R, T * G, H], scaled by
    1/sqrt(H): per prefix and key/value head, each row's T * G query rows (t, then g)."""
    b, t, n, h = q_BxTxNxH.shape
    r, g = b // p, n // kv
    q_PxKxRxQxH = q_BxTxNxH.reshape(p, r, t, kv, g, h).transpose(0, 3, 1, 2, 4, 5)
    return q_PxKxRxQxH.reshape(p, kv, r, t * g, h) * (1.0 / math.sqrt(h))


def _prefix_softmax(
    pre_PxKxRxQxJ,
    new_PxKxRxQxS,
    prefix_valid_PxJ,
    valid_BxS,
    index,
    t: int,
    window=None,
    positions=None,
):
    """`_two_part_softmax` of rows continuing shared prefixes. Every prefix key is in the past
    of every new token, so only its validity masks it; a new slot is seen by query t when it is
    valid and at most slot index + t. A sliding `window` also masks keys window or more
    positions back (`positions` = (query_pos_BxT, prefix_pos_PxJ, key_pos_BxS))."""
    p, _, r, q, s = new_PxKxRxQxS.shape
    g = q // t
    pre_mask = prefix_valid_PxJ[:, None, None, None, :]  # [P, 1, 1, 1, J]
    causal_TxS = jnp.arange(s)[None, :] <= (index + jnp.arange(t))[:, None]
    new_mask_PxRxTxS = valid_BxS.reshape(p, r, 1, s) & causal_TxS
    if window is not None:
        q_pos_BxT, prefix_pos_PxJ, k_pos_BxS = positions
        q_pos_PxRxTx1 = q_pos_BxT.reshape(p, r, t, 1)
        near_PxRxTxJ = q_pos_PxRxTx1 - prefix_pos_PxJ[:, None, None, :] < window
        near_PxRxQxJ = jnp.repeat(near_PxRxTxJ, g, axis=2)  # rows t-major, then g
        pre_mask = pre_mask & near_PxRxQxJ[:, None]  # [P, 1, R, Q, J]
        new_mask_PxRxTxS = new_mask_PxRxTxS & (
            q_pos_PxRxTx1 - k_pos_BxS.reshape(p, r, 1, s) < window
        )
    new_mask_Px1xRxQxS = jnp.broadcast_to(
        new_mask_PxRxTxS[:, None, :, :, None, :], (p, 1, r, t, g, s)
    ).reshape(p, 1, r, q, s)
    return _two_part_softmax(pre_PxKxRxQxJ, pre_mask, new_PxKxRxQxS, new_mask_Px1xRxQxS)


def _prefix_rows(out_PxKxRxQxH, t: int) -> jax.Array:
    """[P, K, R, T * G, H] -> [B, T, N, H] (the inverse of `_prefix_queries`' layout)."""
    p, kv, r, q, h = out_PxKxRxQxH.shape
    g = q // t
    out = out_PxKxRxQxH.reshape(p, kv, r, t, g, h).transpose(0, 2, 3, 1, 4, 5)
    return out.reshape(p * r, t, kv * g, h)


@struct.dataclass
class SharedPrefixCache:
    """Decode cache of B = P * R rows continuing P prefilled prefixes (row p * R + r continues
    prefix p; R is the group size).

    The prefixes are kept once: prefix_k, prefix_v [P, K, J, H], prefix_valid [P, J]; every row
    has its own new-token slots: k, v [P, K, R, S, H] (grouped per prefix, so attention needs no
    transposes), valid [B, S]. Calls index the new-token slots: index 0 is the first token after
    the prefix. Every prefix slot is in the past of every new token, so only prefix_valid masks
    it. With `slot_last` (the sampler's decode layout) keys and values are stored [.., H, J] and
    [.., H, S] instead: see `attend`.
    """

    prefix_k: jax.Array
    prefix_v: jax.Array
    prefix_valid: jax.Array
    prefix_pos: jax.Array  # int32 [P, J]: the prefix keys' positions
    k: jax.Array
    v: jax.Array
    valid: jax.Array
    pos: jax.Array  # int32 [B, S]: the new keys' positions
    slot_last: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def share(cls, prefix: KVCache, group_size: int, max_len: int, *, slot_last: bool = False):
        """`group_size` continuations of each row of a filled `prefix` cache, `max_len` new
        slots each."""
        p, kv, _, h = prefix.k.shape
        dtype = prefix.k.dtype
        if slot_last:
            shape = (p, kv, group_size, h, max_len)
            pk, pv = prefix.k.swapaxes(2, 3), prefix.v.swapaxes(2, 3)
        else:
            shape = (p, kv, group_size, max_len, h)
            pk, pv = prefix.k, prefix.v
        return cls(
            prefix_k=pk,
            prefix_v=pv,
            prefix_valid=prefix.valid,
            prefix_pos=prefix.pos,
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            valid=jnp.zeros((p * group_size, max_len), jnp.bool_),
            pos=jnp.zeros((p * group_size, max_len), jnp.int32),
            slot_last=slot_last,
        )

    def grow(self, slots: int) -> SharedPrefixCache:
        """The same cache with its new-token slots padded to `slots` (empty, invalid)."""
        extra = slots - self.valid.shape[1]
        slot_axis = 4 if self.slot_last else 3
        pad_kv = [(0, 0)] * 5
        pad_kv[slot_axis] = (0, extra)
        return self.replace(
            k=jnp.pad(self.k, pad_kv),
            v=jnp.pad(self.v, pad_kv),
            valid=jnp.pad(self.valid, ((0, 0), (0, extra))),
            pos=jnp.pad(self.pos, ((0, 0), (0, extra))),
        )

    def as_slots(self) -> SlotCache:
        """The same keys and values as a `SlotCache` (slot-last layout only): slot p * R + r
        continues prefix p with row p * R + r's new-token columns and positions, so a decode
        can go on with any subset of the rows (gathered along the slot axis)."""
        if not self.slot_last:
            raise ValueError("as_slots needs the slot-last (decode) layout.")
        p, kv, r, h, s = self.k.shape
        rows = lambda x: x.transpose(0, 2, 1, 3, 4).reshape(p * r, kv, h, s)
        prompt_1xB = (jnp.arange(p * r, dtype=jnp.int32) // r)[None]
        return SlotCache(
            prefix_k=self.prefix_k,
            prefix_v=self.prefix_v,
            prefix_valid=self.prefix_valid,
            prefix_pos=self.prefix_pos,
            prefix_index=prompt_1xB,
            k=rows(self.k),
            v=rows(self.v),
            pos=self.pos,
        )

    def _write(self, k_BxKxTxH, v_BxKxTxH, valid_BxT, index, positions_BxT) -> SharedPrefixCache:
        """Stores T new keys/values (and positions) of the B rows at new-token slot `index`."""
        p = self.prefix_k.shape[0]
        b, kv, t, h = k_BxKxTxH.shape
        r = b // p
        zero = jnp.zeros((), jnp.int32)

        def write(buf, new_BxKxTxH):
            new = new_BxKxTxH.reshape(p, r, kv, t, h).transpose(0, 2, 1, 3, 4)  # [P, K, R, T, H]
            start = (zero, zero, zero, index, zero)
            if self.slot_last:
                new, start = new.swapaxes(3, 4), (zero, zero, zero, zero, index)
            return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), start)

        return self.replace(
            k=write(self.k, k_BxKxTxH),
            v=write(self.v, v_BxKxTxH),
            valid=jax.lax.dynamic_update_slice(self.valid, valid_BxT, (zero, index)),
            pos=jax.lax.dynamic_update_slice(
                self.pos, positions_BxT.astype(jnp.int32), (zero, index)
            ),
        )

    def attend(
        self,
        impl,
        q_BxTxNxH,
        k_BxKxTxH,
        v_BxKxTxH,
        valid_BxT,
        index,
        window=None,
        positions_BxT=None,
    ):
        """Row p * R + r attends to the J keys of prefix p and to its own new-token slots
        (with a sliding `window`, only to the last window of them: `_prefix_softmax`).

        Queries are laid out [P, K, R, Q, H] with the Q = T * G query heads of a key/value head
        as rows, so both score matmuls and both value matmuls are batched over (P, K) or
        (P, K, R) with no transpose of keys or values, and the softmax runs over the two parts
        without concatenating them (fewer kernels per decode step than stacking rows per prefix
        and back; the same speed in CPU A/B runs).

        The slot-last layout is always dense (a decode step has one query per row). There the
        score matmul contracts the head width against [H, S] and the value matmul produces the
        transposed output [H, Q] from [H, S]: both stream the cache in its storage order, which
        on CPU ran 2.1-2.4x faster than the [S, H] layout at S = 2048 (XLA CPU transposes an
        [S, H] operand for these shapes). Same values as the [S, H] layout up to fp32 summation
        order. Returns (out [B, T, N, H], updated cache).
        """
        b, t, n, h = q_BxTxNxH.shape
        p, kv = self.prefix_k.shape[:2]
        j = self.prefix_k.shape[3 if self.slot_last else 2]
        r, g = b // p, n // kv
        i = jnp.asarray(index, jnp.int32)
        if positions_BxT is None:  # consecutive after the prefix slots
            positions_BxT = jnp.broadcast_to(j + i + jnp.arange(t, dtype=jnp.int32), (b, t))
        cache = self._write(k_BxKxTxH, v_BxKxTxH, valid_BxT, i, positions_BxT)
        pk, pv, k, v = cache.prefix_k, cache.prefix_v, cache.k, cache.v
        positions = None
        if window is not None:
            positions = (positions_BxT.astype(jnp.int32), cache.prefix_pos, cache.pos)
        if not self.slot_last:
            impl = kernels.choose(impl, t=t, g=g, keys=j + k.shape[3])
            if impl != "dense":
                out_BxTxNxH = kernels.shared_prefix(
                    impl,
                    q_BxTxNxH,
                    pk,
                    pv,
                    cache.prefix_valid,
                    k,
                    v,
                    valid_BxT,
                    cache.valid,
                    index,
                    window,
                    positions,
                )
                return out_BxTxNxH, cache

        # Einsum letters of the stored layouts: keys/values [.., J, H] and [.., S, H], or
        # slot-last [.., H, J] and [.., H, S].
        pre_kv, new_kv = ("hj", "hs") if self.slot_last else ("jh", "sh")
        q_PxKxRxQxH = _prefix_queries(q_BxTxNxH, p, kv)
        pre_PxKxRxQxJ = jnp.einsum(
            f"pkxh,pk{pre_kv}->pkxj",
            q_PxKxRxQxH.reshape(p, kv, -1, h),
            pk,
            preferred_element_type=jnp.float32,
        ).reshape(p, kv, r, t * g, j)
        new_PxKxRxQxS = jnp.einsum(
            f"pkrqh,pkr{new_kv}->pkrqs", q_PxKxRxQxH, k, preferred_element_type=jnp.float32
        )
        pre_PxKxRxQxJ, new_PxKxRxQxS, total_PxKxRxQx1 = _prefix_softmax(
            pre_PxKxRxQxJ, new_PxKxRxQxS, cache.prefix_valid, cache.valid, i, t, window, positions
        )
        dtype = v.dtype
        pre_w = pre_PxKxRxQxJ.astype(dtype).reshape(p, kv, -1, j)
        new_w = new_PxKxRxQxS.astype(dtype)
        if self.slot_last:
            pre_PxKxHxX = jnp.einsum(
                "pkhj,pkxj->pkhx", pv, pre_w, preferred_element_type=jnp.float32
            )
            new_PxKxRxHxQ = jnp.einsum(
                "pkrhs,pkrqs->pkrhq", v, new_w, preferred_element_type=jnp.float32
            )
            out_PxKxRxHxQ = pre_PxKxHxX.reshape(p, kv, h, r, t * g).transpose(0, 1, 3, 2, 4)
            out_PxKxRxQxH = (out_PxKxRxHxQ + new_PxKxRxHxQ).swapaxes(3, 4)
        else:
            out_PxKxRxQxH = jnp.einsum(
                "pkxj,pkjh->pkxh", pre_w, pv, preferred_element_type=jnp.float32
            ).reshape(p, kv, r, t * g, h) + jnp.einsum(
                "pkrqs,pkrsh->pkrqh", new_w, v, preferred_element_type=jnp.float32
            )
        out_PxKxRxQxH = (out_PxKxRxQxH / total_PxKxRxQx1).astype(dtype)
        return _prefix_rows(out_PxKxRxQxH, t), cache


# ----------------------------------------------------------------------------------------------
# Packed rows


@struct.dataclass
class PackedPrefixCache:
    """The update's packed layout: row r holds the G responses of one prompt back to back
    (segments 1..G, ids non-decreasing, padding last with a larger id) after prefix r, stored
    once: prefix_k, prefix_v [R, K, J, H], prefix_valid [R, J], and `segments` int32 [R, T] of
    the T packed slots. One call attends the whole packed row (index 0, T = the row's width):
    each token sees the prefix and its own segment causally (`kernels.packed_prefix`), and in a
    sliding-window layer only keys less than the window back by position (prefix_pos [R, J]:
    the prefix keys' positions; the row's own from the call); nothing is stored, so the cache
    comes back unchanged.
    """

    prefix_k: jax.Array
    prefix_v: jax.Array
    prefix_valid: jax.Array
    prefix_pos: jax.Array
    segments: jax.Array

    @classmethod
    def share(cls, prefix: KVCache, segments_RxT: jax.Array) -> PackedPrefixCache:
        return cls(prefix.k, prefix.v, prefix.valid, prefix.pos, segments_RxT.astype(jnp.int32))

    def attend(
        self,
        impl,
        q_BxTxNxH,
        k_BxKxTxH,
        v_BxKxTxH,
        valid_BxT,
        index,
        window=None,
        positions_BxT=None,
    ):
        if window is not None and positions_BxT is None:
            raise ValueError("a sliding-window layer of a packed row needs the row's positions.")
        t, n = q_BxTxNxH.shape[1], q_BxTxNxH.shape[2]
        if t != self.segments.shape[1]:
            raise ValueError(
                f"a packed row is attended in one call of {self.segments.shape[1]} tokens, got {t}."
            )
        kv, j = self.prefix_k.shape[1], self.prefix_k.shape[2]
        impl = kernels.choose(impl, t=t, g=n // kv, keys=j + t)
        out = kernels.packed_prefix(
            impl,
            q_BxTxNxH,
            self.prefix_k,
            self.prefix_v,
            self.prefix_valid,
            k_BxKxTxH,
            v_BxKxTxH,
            valid_BxT,
            self.segments,
            window=window,
            positions_RxT=positions_BxT,
            prefix_pos_RxJ=self.prefix_pos,
        )
        return out, self


# ----------------------------------------------------------------------------------------------
# Continuous batching


@struct.dataclass
class SlotCache:
    """Decode cache of B slots that each continue one of P stored prefixes (continuous batching).

    The prefixes are kept once, slot-last: prefix_k, prefix_v [P, K, H, J], prefix_valid [P, J];
    every slot has its own new-token columns k, v [B, K, H, C] but no fixed prefix:
    `prefix_index` (int32 [D, B / D]) says which one it continues (slot d * (B / D) + i continues
    prefix d * (P / D) + prefix_index[d, i]). Prefixes and slots come in D equal queues (a mesh's
    row shards) and a slot only points into its own queue, so no gather crosses shards. Calls
    pass `index` as int32 [B], each slot's own write column; a slot that moves to another prefix
    sets its prefix_index and restarts at column 0.
    """

    prefix_k: jax.Array
    prefix_v: jax.Array
    prefix_valid: jax.Array
    prefix_pos: jax.Array  # int32 [P, J]
    prefix_index: jax.Array
    k: jax.Array
    v: jax.Array
    pos: jax.Array  # int32 [B, C]: each column's key position

    @classmethod
    def share(cls, prefix: KVCache, num_slots: int, max_len: int, queues: int = 1):
        """`num_slots` slots of `max_len` columns over the rows of a filled `prefix` cache, in
        `queues` equal queues (all slots start on their queue's first prefix)."""
        p, kv, _, h = prefix.k.shape
        if p % queues or num_slots % queues:
            raise ValueError(
                f"{p} prefixes and {num_slots} slots must both split into {queues} equal queues."
            )
        shape = (num_slots, kv, h, max_len)
        return cls(
            prefix_k=prefix.k.swapaxes(2, 3),
            prefix_v=prefix.v.swapaxes(2, 3),
            prefix_valid=prefix.valid,
            prefix_pos=prefix.pos,
            prefix_index=jnp.zeros((queues, num_slots // queues), jnp.int32),
            k=jnp.zeros(shape, prefix.k.dtype),
            v=jnp.zeros(shape, prefix.k.dtype),
            pos=jnp.zeros((num_slots, max_len), jnp.int32),
        )

    def attend(
        self,
        impl,
        q_BxTxNxH,
        k_BxKxTxH,
        v_BxKxTxH,
        valid_BxT,
        index_B,
        window=None,
        positions_BxT=None,
    ):
        """Slot b attends to the J keys of the prefix it points at (a gather of [K, H, J] per
        slot from the prefixes stored once) and to its own new-token columns 0 .. index_B[b] + t
        (with a sliding `window`, only keys less than window positions back).

        The T new keys/values of slot b go to its columns [index_B[b], index_B[b] + T): every
        slot writes at its own column, so a slot that takes a new item restarts at column 0,
        and the columns beyond its write index, which hold an earlier item's keys, are masked
        by position (no reset needed). Every slot's tokens are real (`impl` and `valid_BxT` are
        not read: always the dense arithmetic). The softmax runs over the two parts without
        concatenating them, as in `SharedPrefixCache.attend`. Returns (out [B, T, N, H], cache).
        """
        b, t, n, h = q_BxTxNxH.shape
        pk_PxKxHxJ, pv_PxKxHxJ = self.prefix_k, self.prefix_v
        p, kv, _, j = pk_PxKxHxJ.shape
        index_DxS = self.prefix_index
        d = index_DxS.shape[0]
        g = n // kv

        def gather(x_Px):  # [P, ...] -> [B, ...]: each slot's own prefix, within its queue
            x_DxPx = x_Px.reshape(d, p // d, *x_Px.shape[1:])
            return jax.vmap(lambda x, i: x[i])(x_DxPx, index_DxS).reshape(b, *x_Px.shape[1:])

        pk_BxKxHxJ = with_logical_constraint(gather(pk_PxKxHxJ), DECODE_CACHE_AXES)
        pv_BxKxHxJ = with_logical_constraint(gather(pv_PxKxHxJ), DECODE_CACHE_AXES)
        pre_valid_BxJ = gather(self.prefix_valid)
        i_B = jnp.broadcast_to(jnp.asarray(index_B, jnp.int32), (b,))

        def write(buf_BxKxHxC, new_BxKxTxH):
            put = lambda buf, new, i: jax.lax.dynamic_update_slice(buf, new, (0, 0, i))
            new_BxKxHxT = new_BxKxTxH.swapaxes(2, 3).astype(buf_BxKxHxC.dtype)
            return jax.vmap(put)(buf_BxKxHxC, new_BxKxHxT, i_B)

        if positions_BxT is None:  # consecutive after the prefix slots
            positions_BxT = j + i_B[:, None] + jnp.arange(t, dtype=jnp.int32)
        positions_BxT = positions_BxT.astype(jnp.int32)
        put_pos = lambda buf, new, i: jax.lax.dynamic_update_slice(buf, new, (i,))
        cache = self.replace(
            k=write(self.k, k_BxKxTxH),
            v=write(self.v, v_BxKxTxH),
            pos=jax.vmap(put_pos)(self.pos, positions_BxT, i_B),
        )
        k_BxKxHxC, v_BxKxHxC = cache.k, cache.v
        c = k_BxKxHxC.shape[3]

        # Query rows per key/value head in the order of `SharedPrefixCache.attend` (t, then g),
        # so a slot's arithmetic matches the static sampler's step for step.
        q_BxKxQxH = (
            q_BxTxNxH.reshape(b, t, kv, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, h)
        ) * (1.0 / math.sqrt(h))
        pre_BxKxQxJ = jnp.einsum(
            "bkqh,bkhj->bkqj", q_BxKxQxH, pk_BxKxHxJ, preferred_element_type=jnp.float32
        )
        new_BxKxQxC = jnp.einsum(
            "bkqh,bkhc->bkqc", q_BxKxQxH, k_BxKxHxC, preferred_element_type=jnp.float32
        )
        query_BxT = i_B[:, None] + jnp.arange(t)  # the query's column
        seen_BxTxC = kernels.visible(
            query_BxT[:, :, None],
            jnp.arange(c)[None, None, :],
            window,
            positions_BxT[:, :, None],
            cache.pos[:, None, :],
        )
        new_mask_Bx1xQxC = jnp.broadcast_to(
            seen_BxTxC[:, None, :, None, :], (b, 1, t, g, c)
        ).reshape(b, 1, t * g, c)
        pre_mask = pre_valid_BxJ[:, None, None, :]
        if window is not None:  # every prefix key is in the past: only the window masks it
            near_BxTxJ = positions_BxT[:, :, None] - gather(self.prefix_pos)[:, None, :] < window
            near_Bx1xQxJ = jnp.repeat(near_BxTxJ, g, axis=1)[:, None]
            pre_mask = pre_mask & near_Bx1xQxJ
        pre_BxKxQxJ, new_BxKxQxC, total_BxKxQx1 = _two_part_softmax(
            pre_BxKxQxJ, pre_mask, new_BxKxQxC, new_mask_Bx1xQxC
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
