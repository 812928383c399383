"""The sampler's decode loops and the settings they run with.

After the prefill (`sampler.generate_split`), one of two loops decodes, each a `lax.while_loop`
(or a few) inside the same compiled program, reading `SamplingSettings`, the one static
argument that keys the program:

* `static_batch`: every one of the P * G rows keeps its decode slot until the last row ends;
  with `shed` the rows still running are compacted into halved batches as the others end
  (`_shed_batch`).
* `continuous_batch`: S < P * G slots take the P * G work items in row order, a slot moving to
  the next item in the same iteration as its row ends (`SlotState`).

Token t of row b is always drawn with its own key, `fold_in(fold_in(rng, b), t)`
(`sampling_ops.token_keys`), so both loops return the same output for every S and every shed
level (up to float rounding that depends on the batch shape). docs/sampler.md has the details.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from gvpo_jax.models.cache import per_layer
from gvpo_jax.sampling_ops import select_tokens, token_keys

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a group rollout is sampled: frozen and hashable, the sampler's one static argument
    (equal settings never retrace; `sampler.canonical_settings` maps settings that sample alike
    to one). Checked on construction: a bad value raises ValueError naming the field."""

    max_new_tokens: int  # N: decode steps at most, the output width
    group_size: int = 1  # G responses per prompt; the prompt is prefilled and stored once
    eos_ids: tuple[int, ...] = ()  # a row stops after emitting any of these; (): runs to N
    pad_id: int = 0  # token written after a row's first EOS
    temperature: float = 1.0  # 0.0 is greedy (argmax); otherwise logits / temperature
    top_k: int = 0  # 0: off; on `lax.top_k` candidates (no vocabulary sort), before top-p
    top_p: float = 1.0  # 1.0: off; nucleus on the tempered (and top-k) distribution
    min_p: float = 0.0  # 0.0: off; keeps tokens with p >= min_p * max p
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # prompt-length buckets (one compile per bucket)
    num_slots: int = 0  # decode slots S (continuous batching); 0 or >= P*G: one per row
    eval_num_slots: int = 0  # the same for evaluation calls (capped at their rows)
    shed: int = 0  # static batch: halvings of its rows as rows finish (`shed_levels`); 0: off
    # An MoE policy: also return the experts every prompt and response token was routed to
    # (`SampleOutput.prompt_routes_PxTxMxK`, `routes_BxNxMxK`), for routing replay and drift.
    record_routes: bool = False

    def __post_init__(self):
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if int(self.group_size) < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}.")
        if float(self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if int(self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        if not 0.0 <= float(self.min_p) < 1.0:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}.")
        if int(self.num_slots) < 0:
            raise ValueError(
                f"num_slots must be >= 0 (0 = one slot per row), got {self.num_slots}."
            )
        if int(self.shed) < 0:
            raise ValueError(f"shed must be >= 0 (0 = off), got {self.shed}.")
        eos = (self.eos_ids,) if isinstance(self.eos_ids, int) else self.eos_ids
        # Canonical types (int, float, tuples), so settings spelled 1 or 1.0, [1] or (1,) are
        # equal and hash equal. The EOS order is kept: eos_ids[0] is the one SFT appends.
        normal = dict(
            max_new_tokens=int(self.max_new_tokens),
            group_size=int(self.group_size),
            eos_ids=tuple(int(e) for e in eos),
            pad_id=int(self.pad_id),
            temperature=float(self.temperature),
            top_k=int(self.top_k),
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            buckets=tuple(int(b) for b in self.buckets),
            num_slots=int(self.num_slots),
            eval_num_slots=int(self.eval_num_slots),
            shed=int(self.shed),
            record_routes=bool(self.record_routes),
        )
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    def select(self, logits_BxV: jax.Array, keys_B: jax.Array):
        """One decode step's choice of token for every row: (tokens_B, logp_B, sample_logp_B)
        (`sampling_ops.select_tokens` with these settings)."""
        return select_tokens(
            logits_BxV,
            keys_B,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )


class SampleOutput(NamedTuple):
    """Generated responses; B = P * G rows, row p*G + g is sample g of prompt p; N new tokens.

    tokens_BxN: int32 response tokens; `pad_id` after the first EOS and after early exit.
    logp_BxN: float32 log pi(y_t | x, y_<t) at temperature 1, untruncated (log_softmax of the raw
      logits): the policy's own log-prob, i.e. pi_old for the trainer. 0 where mask is 0.
    mask_BxN: float32 1.0 on response tokens up to and including the first EOS, 0.0 after.
    lengths_B: int32 number of response tokens (= mask.sum(-1)), EOS included.
    sample_logp_BxN: float32 log q(y_t) under the distribution actually sampled from (tempered,
      top-k/top-p/min-p truncated, renormalised); 0 when greedy and where mask is 0.
    With `SamplingSettings.record_routes` (an MoE policy; else None), the experts each token
    went to as the sampler computed it, in each of the M MoE layers (`routes_dtype`):
    prompt_routes_PxTxMxK: the prompts' tokens in the prefill (T the padded prompt length; 0
      past a prompt's length).
    routes_BxNxMxK: response token t as the model read it (fed back at decode step t + 1), for
      t < length - 1; the last token of a row is never fed back (nothing reads its routing:
      no later token of the row exists), and there, and past it, the record is 0.
    """

    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    mask_BxN: jax.Array
    lengths_B: jax.Array
    sample_logp_BxN: jax.Array
    prompt_routes_PxTxMxK: jax.Array | None = None
    routes_BxNxMxK: jax.Array | None = None


def routes_dtype(num_experts: int):
    """The compact integer a routing record is kept in: uint8 up to 256 experts, else int16."""
    return jnp.uint8 if num_experts <= 256 else jnp.int16


def _routes_of(routes, dtype) -> jax.Array:
    """One decode step's experts (`moe.Routes`, [M, B, 1, K]) as [B, M, K] in the record's
    dtype."""
    return jnp.swapaxes(routes.experts[:, :, 0], 0, 1).astype(dtype)


@flax.struct.dataclass
class DecodeState:
    """Carry of the decode loop. Tokens [0, step) are sampled; token step-1 is fed next."""

    step: jax.Array  # int32 scalar
    done_B: jax.Array  # bool: row has emitted an EOS
    lengths_B: jax.Array  # int32: tokens emitted before (and including) the first EOS
    tokens_BxN: jax.Array  # int32, pad_id where not yet sampled / finished
    logp_BxN: jax.Array  # float32
    sample_logp_BxN: jax.Array  # float32
    cache: Any  # the prompts once (P x T slots) + the new tokens (B x max(N - 1, 1) slots)
    rng: jax.Array  # base key; token t of row b is drawn with `token_keys(rng, b, t)`
    routes_BxNxMxK: Any = None  # record_routes: the experts of each fed token (else None)


def shed_levels(rows: int, shed: int) -> tuple[int, ...]:
    """The decode batch sizes of a shedding static batch: `rows`, then up to `shed` halvings
    (rounded up), e.g. (32, 16, 8) for shed = 2; (rows,) when shed is 0."""
    levels = [rows]
    for _ in range(shed):
        half = -(-levels[-1] // 2)
        if half == levels[-1]:
            break
        levels.append(half)
    return tuple(levels)


def decode_segments(slots: int, max_segments: int = 4, min_segment: int = 16) -> tuple[int, ...]:
    """Cache sizes of the decode segments for `slots` new-token slots, the last one == slots.

    Up to `max_segments` equal segments of at least `min_segment` slots; short generations
    (e.g. a few answer tokens) use one segment. Each segment is one `lax.while_loop` in the same
    compiled program, so more segments mean less attention work but a longer compile.
    """
    count = max(1, min(max_segments, slots // min_segment))
    return tuple(-(-slots * (j + 1) // count) for j in range(count))


def _is_eos(tokens_xB: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    eos_E = jnp.asarray(eos_ids, jnp.int32)
    return jnp.any(tokens_xB[..., None] == eos_E, axis=-1)


def static_batch(
    graphdef,
    state,
    cache,
    logits_PxV,
    lens_P,
    caps_B,
    rng,
    settings: SamplingSettings,
    routes_shape=None,
) -> tuple[SampleOutput, jax.Array]:
    """The static batch: every one of the B = P * G rows keeps its decode slot until the last
    row ends (with `settings.shed`: until the rows still running fit the next smaller batch, see
    `_shed_batch`). `cache` holds the P prompts' keys and values (the prefill's), `logits_PxV`
    the prefill's logits at each prompt's last token, `caps_B` each row's length cap.
    `routes_shape` (M, K, dtype) records the fed tokens' routes (`settings.record_routes`).
    Returns (SampleOutput, decode iterations)."""
    p, g, n = logits_PxV.shape[0], settings.group_size, settings.max_new_tokens
    eos_ids, pad_id, select = settings.eos_ids, settings.pad_id, settings.select
    b = p * g
    # Share the prefill: every sample of prompt p starts from its logits, and the prompt's keys
    # and values stay stored once per prompt (read once per prompt at every decode step). The
    # last sampled token is never fed back, so the new tokens need N - 1 slots (at least 1).
    logits_BxV = jnp.repeat(logits_PxV, g, axis=0)
    # The new-token slots grow in segments: segment j decodes while its slots suffice, and the
    # cache is then padded to the next size. Each decode step attends over the slots of its
    # segment only, not all N - 1 (about 40% less attention work at N = 128).
    sizes = decode_segments(max(n - 1, 1))
    model = nnx.merge(graphdef, state)
    cache = model.share_prefix_cache(cache, g, sizes[0], decode=True)
    lens_B = jnp.repeat(lens_P, g)
    rows_B = jnp.arange(b, dtype=jnp.int32)

    def append(s: DecodeState, logits_BxV: jax.Array) -> DecodeState:
        """Sample token `step` of every unfinished row from its logits and record it."""
        keys_B = token_keys(s.rng, rows_B, jnp.broadcast_to(s.step, (b,)))
        tokens_B, logp_B, sample_logp_B = select(logits_BxV, keys_B)
        active_B = ~s.done_B
        tokens_B = jnp.where(active_B, tokens_B, pad_id)
        write = lambda buf_BxN, x_B: jax.lax.dynamic_update_slice(
            buf_BxN, x_B[:, None].astype(buf_BxN.dtype), (jnp.zeros((), jnp.int32), s.step)
        )
        ends_B = _is_eos(tokens_B, eos_ids) | (s.step + 1 >= caps_B)
        return s.replace(
            step=s.step + 1,
            done_B=s.done_B | (active_B & ends_B),
            lengths_B=s.lengths_B + active_B.astype(jnp.int32),
            tokens_BxN=write(s.tokens_BxN, tokens_B),
            logp_BxN=write(s.logp_BxN, jnp.where(active_B, logp_B, 0.0)),
            sample_logp_BxN=write(s.sample_logp_BxN, jnp.where(active_B, sample_logp_B, 0.0)),
        )

    levels = shed_levels(b, settings.shed)

    def keep_going(s: DecodeState, slots: int) -> jax.Array:
        # Step `step` writes slot step - 1, so a segment with `slots` slots ends at step slots.
        go = (s.step < n) & (s.step <= slots) & ~jnp.all(s.done_B)
        if len(levels) > 1:  # hand over to the smaller batch once the running rows fit it
            go &= jnp.sum(~s.done_B) > levels[1]
        return go

    def decode_step(s: DecodeState) -> DecodeState:
        """Feed token step-1 (new-token slot step-1, position len + step-1); sample token step."""
        fed_B = jax.lax.dynamic_index_in_dim(s.tokens_BxN, s.step - 1, axis=1, keepdims=False)
        # Finished rows hold pad_id, which need not be a vocabulary id: feed token 0 instead.
        fed_B = jnp.where(s.done_B, 0, fed_B)
        positions_Bx1 = (lens_B + s.step - 1)[:, None]
        out = nnx.merge(graphdef, state)(
            fed_B[:, None],
            positions_Bx1,
            jnp.ones((b, 1), jnp.bool_),
            cache=s.cache,
            cache_index=s.step - 1,
            with_routes=routes_shape is not None,
        )
        logits_Bx1xV, cache = out[:2]
        if routes_shape is not None:  # token step - 1 of each running row: its routes
            x_BxMxK = _routes_of(out[2], routes_shape[2])
            old_BxMxK = jax.lax.dynamic_index_in_dim(
                s.routes_BxNxMxK, s.step - 1, axis=1, keepdims=False
            )
            x_BxMxK = jnp.where(s.done_B[:, None, None], old_BxMxK, x_BxMxK)
            s = s.replace(
                routes_BxNxMxK=jax.lax.dynamic_update_index_in_dim(
                    s.routes_BxNxMxK, x_BxMxK, s.step - 1, axis=1
                )
            )
        return append(s.replace(cache=cache), logits_Bx1xV[:, 0])

    start = DecodeState(
        step=jnp.zeros((), jnp.int32),
        done_B=jnp.zeros((b,), jnp.bool_),
        lengths_B=jnp.zeros((b,), jnp.int32),
        tokens_BxN=jnp.full((b, n), pad_id, jnp.int32),
        logp_BxN=jnp.zeros((b, n), jnp.float32),
        sample_logp_BxN=jnp.zeros((b, n), jnp.float32),
        cache=cache,
        rng=rng,
        routes_BxNxMxK=None
        if routes_shape is None
        else jnp.zeros((b, n, routes_shape[0], routes_shape[1]), routes_shape[2]),
    )
    final = append(start, logits_BxV)
    for j, slots in enumerate(sizes):
        if j:
            final = final.replace(cache=per_layer(lambda c, n=slots: c.grow(n), final.cache))
        final = jax.lax.while_loop(functools.partial(keep_going, slots=slots), decode_step, final)
    if len(levels) > 1:
        final = _shed_batch(graphdef, state, final, lens_B, caps_B, settings, levels)
    out = _output(final.tokens_BxN, final.logp_BxN, final.sample_logp_BxN, final.lengths_B)
    return out._replace(routes_BxNxMxK=final.routes_BxNxMxK), final.step - 1


def _shed_batch(
    graphdef, state, s: DecodeState, lens_B, caps_B, settings: SamplingSettings, levels
) -> DecodeState:
    """The static batch's decode after its rows thinned out: at each of `levels[1:]` (a
    halving each), the rows still running are compacted into a batch of that size, and decode
    goes on there until the running rows fit the next one (or all end). `s` is the static
    loop's state on its exit, its cache grown to all N - 1 slots (`SharedPrefixCache`, slot
    last). The compacted rows keep their new-token columns and point at their prompt in the
    prefixes stored once (`cache.SlotCache`, one queue, every row at the same column); tokens
    are drawn with each row's own key (`token_keys(rng, row, step)`) and written to its own
    output row, so the output is the static batch's. A compacted step attends over all N - 1
    columns (masked by position), not over its segment's."""
    b, n, g = levels[0], settings.max_new_tokens, settings.group_size
    eos_ids, select = settings.eos_ids, settings.select
    layers = per_layer(lambda c: c.as_slots(), s.cache)  # slot b continues prompt b // G
    row_K = jnp.arange(b, dtype=jnp.int32)  # the output row of each compacted slot (b: none)
    done_K = s.done_B
    s = s.replace(cache=None)  # the static rows' cache is not carried on

    def step(carry):
        s, row_K, done_K, layers = carry
        k = row_K.shape[0]
        safe_K = jnp.minimum(row_K, b - 1)
        fed_K = jax.lax.dynamic_index_in_dim(
            s.tokens_BxN[safe_K], s.step - 1, axis=1, keepdims=False
        )
        fed_K = jnp.where(done_K, 0, fed_K)
        positions_Kx1 = (lens_B[safe_K] + s.step - 1)[:, None]
        recording = s.routes_BxNxMxK is not None
        out = nnx.merge(graphdef, state)(
            fed_K[:, None],
            positions_Kx1,
            jnp.ones((k, 1), jnp.bool_),
            cache=layers,
            cache_index=jnp.broadcast_to(s.step - 1, (k,)),
            with_routes=recording,
        )
        logits_Kx1xV, layers = out[:2]
        tokens_K, logp_K, sample_logp_K = select(
            logits_Kx1xV[:, 0], token_keys(s.rng, safe_K, jnp.broadcast_to(s.step, (k,)))
        )
        active_K = ~done_K
        # Each running slot's values go to its output row's column `step`, through a [K, B]
        # one-hot (no scatter: out-of-range "write nothing" indices are not dropped reliably
        # once XLA partitions a scatter over a data x tensor mesh).
        hit_KxB = active_K[:, None] & (row_K[:, None] == jnp.arange(b, dtype=jnp.int32))
        hit_B = jnp.any(hit_KxB, axis=0)

        def put(buf_BxN, x_K, column=s.step):
            """buf[row_K, column] = x_K for the running slots (trailing dims carried along)."""
            extra = (None,) * (x_K.ndim - 1)
            hit = hit_KxB[(..., *extra)]
            x_B = jnp.sum(jnp.where(hit, x_K[:, None], 0), axis=0).astype(buf_BxN.dtype)
            old_B = jax.lax.dynamic_index_in_dim(buf_BxN, column, axis=1, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(
                buf_BxN, jnp.where(hit_B[(..., *extra)], x_B, old_B), column, axis=1
            )

        ends_K = _is_eos(tokens_K, eos_ids) | (s.step + 1 >= caps_B[safe_K])
        s = s.replace(
            step=s.step + 1,
            lengths_B=s.lengths_B + hit_B.astype(jnp.int32),
            tokens_BxN=put(s.tokens_BxN, tokens_K),
            logp_BxN=put(s.logp_BxN, logp_K),
            sample_logp_BxN=put(s.sample_logp_BxN, sample_logp_K),
        )
        if recording:  # token step - 1 of each running slot's row: its routes
            routes_KxMxK = _routes_of(out[2], s.routes_BxNxMxK.dtype)
            s = s.replace(routes_BxNxMxK=put(s.routes_BxNxMxK, routes_KxMxK, s.step - 2))
        return s, row_K, done_K | (active_K & ends_K), layers

    for j, size in enumerate(levels[1:], start=1):
        # Compact: the first `size` running slots (every running one: the loop before ended
        # when they fit), then empty slots (output row b, done). The few indices are kept
        # replicated (a data x tensor mesh otherwise partitioned them into wrong picks).
        done_K = with_logical_constraint(done_K, (None,))
        row_K = with_logical_constraint(row_K, (None,))
        pick_K = jnp.nonzero(~done_K, size=size, fill_value=done_K.shape[0])[0]
        valid_K = pick_K < done_K.shape[0]
        pick_K = jnp.minimum(pick_K, done_K.shape[0] - 1)
        row_K = jnp.where(valid_K, row_K[pick_K], b)
        done_K = ~valid_K
        prefix_1xK = (jnp.minimum(row_K, b - 1) // g)[None]
        layers = per_layer(
            lambda c: c.replace(
                k=c.k[pick_K], v=c.v[pick_K], pos=c.pos[pick_K], prefix_index=prefix_1xK
            ),
            layers,
        )
        nxt = levels[j + 1] if j + 1 < len(levels) else 0

        def go(carry, nxt=nxt):
            s, _, done_K, _ = carry
            return (s.step < n) & (jnp.sum(~done_K) > nxt)

        s, row_K, done_K, layers = jax.lax.while_loop(go, step, (s, row_K, done_K, layers))
    return s


def _output(tokens_BxN, logp_BxN, sample_logp_BxN, lengths_B) -> SampleOutput:
    n = tokens_BxN.shape[1]
    mask_BxN = (jnp.arange(n)[None, :] < lengths_B[:, None]).astype(jnp.float32)
    return SampleOutput(
        tokens_BxN=tokens_BxN,
        logp_BxN=logp_BxN,
        mask_BxN=mask_BxN,
        lengths_B=lengths_B,
        sample_logp_BxN=sample_logp_BxN,
    )


@flax.struct.dataclass
class SlotState:
    """Carry of the continuous decode loop: D queues x S slots (per queue), R items per queue.

    Slot (d, s) works on item `item_DxS[d, s]` of queue d (R: idle, the queue is empty), whose
    tokens [0, pos) are sampled: the next iteration feeds token pos - 1 (`fed_DxS`) at its
    new-token column pos - 1 and samples token pos. `head_D` counts the items each queue has
    handed out; outputs are kept per item, [D, R, N] (item d * R + r is output row d * R + r).
    """

    iteration: jax.Array  # int32 scalar: model calls so far
    item_DxS: jax.Array  # int32 in [0, R]
    pos_DxS: jax.Array  # int32 in [1, N)
    fed_DxS: jax.Array  # int32 token to feed
    head_D: jax.Array  # int32
    tokens_DxRxN: jax.Array
    logp_DxRxN: jax.Array
    sample_logp_DxRxN: jax.Array
    lengths_DxR: jax.Array
    cache: Any  # `Transformer.slot_cache`: the prompts once + S x max(N - 1, 1) columns
    routes_DxRxNxMxK: Any = None  # record_routes: the experts of each fed token (else None)


def continuous_batch(
    graphdef,
    state,
    cache,
    logits_PxV,
    lens_P,
    caps_B,
    rng,
    settings: SamplingSettings,
    routes_shape=None,
    *,
    slots: int,
    queues: int,
) -> tuple[SampleOutput, jax.Array]:
    """Continuous batching: `slots` decode slots fed from the queue of B = P * G work items.

    Every item's first token comes from its prompt's prefill logits (sampled here for all items,
    one prompt at a time); the slots then take the items that did not end at that token, in row
    order. An iteration feeds every busy slot's last token, samples its next one, and a slot
    whose item emits an EOS or reaches its length cap takes the next waiting item at once: it
    points at that item's prompt in the prefix cache (prefilled once per prompt) and restarts
    its own new-token columns, with no new prefill. With D = `queues` > 1, items, prompts and
    slots are split into D contiguous parts and each part's slots serve its own items only.
    Tokens are keyed by (item, position), so the output equals `static_batch`'s.
    Returns (SampleOutput, decode iterations).
    """
    p, g, n = logits_PxV.shape[0], settings.group_size, settings.max_new_tokens
    eos_ids, pad_id, select = settings.eos_ids, settings.pad_id, settings.select
    b, d = p * g, queues
    r, s_per, p_per = b // d, slots // d, p // d
    columns = max(n - 1, 1)
    model = nnx.merge(graphdef, state)
    cache = model.slot_cache(cache, slots, columns, queues=d)

    # Token 0 of every item, one prompt of each queue (D x G rows) at a time: the [B, V] logits
    # of the static sampler are never held, and the loop runs along the queues' prompts, not
    # across the (sharded) queue axis.
    vocab = logits_PxV.shape[-1]

    def first(args):
        j, logits_DxV = args  # prompt j of every queue
        prompts_D = jnp.arange(d, dtype=jnp.int32) * p_per + j
        rows_DG = (prompts_D[:, None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(d * g)
        keys_DG = token_keys(rng, rows_DG, jnp.zeros((d * g,), jnp.int32))
        logits_DGxV = jnp.broadcast_to(logits_DxV[:, None], (d, g, vocab)).reshape(d * g, vocab)
        return select(logits_DGxV, keys_DG)

    per_prompt = jax.lax.map(
        first,
        (jnp.arange(p_per, dtype=jnp.int32), logits_PxV.reshape(d, p_per, vocab).swapaxes(0, 1)),
    )
    # [P / D, D * G] -> [D, R]: item r of queue d is sample r % G of its prompt r // G.
    tokens0_DxR, logp0_DxR, slogp0_DxR = (
        x.reshape(p_per, d, g).swapaxes(0, 1).reshape(d, r) for x in per_prompt
    )
    caps_DxR = caps_B.reshape(d, r)
    ended0_DxR = _is_eos(tokens0_DxR, eos_ids) | (caps_DxR <= 1)
    lens_DxP = lens_P.reshape(d, p_per)
    # Each queue's waiting items in row order, then R (none) as filler.
    queue_DxR = jax.vmap(lambda w: jnp.nonzero(w, size=r, fill_value=r)[0])(~ended0_DxR)
    queue_DxR = queue_DxR.astype(jnp.int32)
    waiting_D = jnp.sum(~ended0_DxR, axis=1, dtype=jnp.int32)

    def first_columns(x_DxR, dtype, fill):
        buf = jnp.full((d, r, n), fill, dtype)
        return buf.at[:, :, 0].set(x_DxR.astype(dtype))

    def refill(st: SlotState, free_DxS: jax.Array) -> SlotState:
        """Free slots take the next waiting items of their queue (in slot order)."""
        rank_DxS = jnp.cumsum(free_DxS, axis=1, dtype=jnp.int32) - 1
        at_DxS = st.head_D[:, None] + rank_DxS
        taken_DxS = jnp.take_along_axis(queue_DxR, jnp.minimum(at_DxS, r - 1), axis=1)
        new_DxS = jnp.where(at_DxS < waiting_D[:, None], taken_DxS, r)
        item_DxS = jnp.where(free_DxS, new_DxS, st.item_DxS)
        first_DxS = jnp.take_along_axis(tokens0_DxR, jnp.minimum(item_DxS, r - 1), axis=1)
        return st.replace(
            item_DxS=item_DxS,
            pos_DxS=jnp.where(free_DxS, 1, st.pos_DxS),
            fed_DxS=jnp.where(free_DxS, first_DxS, st.fed_DxS),
            head_D=jnp.minimum(st.head_D + jnp.sum(free_DxS, axis=1, dtype=jnp.int32), waiting_D),
        )

    def put(buf_DxRxN, item_DxS, pos_DxS, x_DxS):
        """buf[d, item, pos] = x per slot; idle slots (item R) write nothing."""
        set_row = lambda buf, i, j, x: buf.at[i, j].set(x.astype(buf.dtype), mode="drop")
        return jax.vmap(set_row)(buf_DxRxN, item_DxS, pos_DxS, x_DxS)

    def busy(st: SlotState) -> jax.Array:
        return jnp.any(st.item_DxS < r)

    def step(st: SlotState) -> SlotState:
        active_DxS = st.item_DxS < r
        item_DxS = jnp.minimum(st.item_DxS, r - 1)  # a safe index for idle slots
        prompt_DxS = item_DxS // g
        positions_DxS = jnp.take_along_axis(lens_DxP, prompt_DxS, axis=1) + st.pos_DxS - 1
        column_S = jnp.clip(st.pos_DxS - 1, 0, columns - 1).reshape(slots)
        layers = per_layer(lambda c: c.replace(prefix_index=prompt_DxS), st.cache)
        out = nnx.merge(graphdef, state)(
            jnp.where(active_DxS, st.fed_DxS, 0).reshape(slots, 1),
            positions_DxS.reshape(slots, 1),
            jnp.ones((slots, 1), jnp.bool_),
            cache=layers,
            cache_index=column_S,
            with_routes=routes_shape is not None,
        )
        logits_Sx1xV, layers = out[:2]
        rows_DxS = jnp.arange(d, dtype=jnp.int32)[:, None] * r + item_DxS  # output row
        keys_S = token_keys(rng, rows_DxS.reshape(slots), st.pos_DxS.reshape(slots))
        tokens_S, logp_S, sample_logp_S = select(logits_Sx1xV[:, 0], keys_S)
        tokens_DxS = tokens_S.reshape(d, s_per)
        write_DxS = jnp.where(active_DxS, item_DxS, r)
        cap_DxS = jnp.take_along_axis(caps_DxR, item_DxS, axis=1)
        ended_DxS = active_DxS & (_is_eos(tokens_DxS, eos_ids) | (st.pos_DxS + 1 >= cap_DxS))
        lengths_DxR = jax.vmap(lambda buf, i, x: buf.at[i].set(x, mode="drop"))(
            st.lengths_DxR, jnp.where(ended_DxS, item_DxS, r), st.pos_DxS + 1
        )
        st = st.replace(
            iteration=st.iteration + 1,
            pos_DxS=st.pos_DxS + 1,
            fed_DxS=tokens_DxS,
            tokens_DxRxN=put(st.tokens_DxRxN, write_DxS, st.pos_DxS, tokens_DxS),
            logp_DxRxN=put(st.logp_DxRxN, write_DxS, st.pos_DxS, logp_S.reshape(d, s_per)),
            sample_logp_DxRxN=put(
                st.sample_logp_DxRxN, write_DxS, st.pos_DxS, sample_logp_S.reshape(d, s_per)
            ),
            lengths_DxR=lengths_DxR,
            cache=layers,
        )
        if routes_shape is not None:  # token pos - 1 of each busy slot's item: its routes
            x_SxMxK = _routes_of(out[2], routes_shape[2])
            x_DxSxMxK = x_SxMxK.reshape(d, s_per, *x_SxMxK.shape[1:])
            st = st.replace(
                routes_DxRxNxMxK=put(st.routes_DxRxNxMxK, write_DxS, st.pos_DxS - 2, x_DxSxMxK)
            )
        return refill(st, ended_DxS | ~active_DxS)

    start = SlotState(
        iteration=jnp.zeros((), jnp.int32),
        item_DxS=jnp.full((d, s_per), r, jnp.int32),
        pos_DxS=jnp.ones((d, s_per), jnp.int32),
        fed_DxS=jnp.zeros((d, s_per), jnp.int32),
        head_D=jnp.zeros((d,), jnp.int32),
        tokens_DxRxN=first_columns(tokens0_DxR, jnp.int32, pad_id),
        logp_DxRxN=first_columns(logp0_DxR, jnp.float32, 0.0),
        sample_logp_DxRxN=first_columns(slogp0_DxR, jnp.float32, 0.0),
        lengths_DxR=jnp.where(ended0_DxR, 1, 0).astype(jnp.int32),
        cache=cache,
        routes_DxRxNxMxK=None
        if routes_shape is None
        else jnp.zeros((d, r, n, routes_shape[0], routes_shape[1]), routes_shape[2]),
    )
    start = refill(start, jnp.ones((d, s_per), jnp.bool_))
    final = jax.lax.while_loop(busy, step, start)
    out = _output(
        final.tokens_DxRxN.reshape(b, n),
        final.logp_DxRxN.reshape(b, n),
        final.sample_logp_DxRxN.reshape(b, n),
        final.lengths_DxR.reshape(b),
    )
    if routes_shape is not None:
        routes = final.routes_DxRxNxMxK.reshape(b, n, routes_shape[0], routes_shape[1])
        out = out._replace(routes_BxNxMxK=routes)
    return out, final.iteration
