"""In-graph batched sampling with a KV cache: one prefill per prompt, decode in a lax.while_loop.

`generate(model, prompt_ids_PxT, prompt_lens_P, ...)` runs prefill and the whole decode loop in
one compiled XLA program (no host round-trip per token) and returns a `SampleOutput` whose rows
are grouped contiguously: row `p * G + g` is sample `g` of prompt `p` (SPEC.md's batch layout).

Compilation: the jitted function is keyed on the static settings (max_new_tokens, group_size,
temperature, top_k, top_p, min_p, eos_ids, pad_id), on the model's graph definition and on the
array shapes. Pad prompts to a few bucket lengths with `pad_prompts` and keep P fixed; then every
later call with the same bucket reuses the compiled program, also after the parameters change
(they are traced arguments, not constants). Calling `generate` on the NNX module is fine: it
splits the module into (graphdef, state) each call, which is cheap and does not retrace.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gvpo_jax import sharding
from gvpo_jax.sampling_ops import select_tokens

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Static settings of a group rollout (hashable: equal settings never retrace)."""

    group_size: int  # G responses per prompt
    max_new_tokens: int  # N
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # prompt-length buckets (one compile per bucket)

    def generate_kwargs(self) -> dict:
        """The static keywords of `generate` / `generate_sharded`."""
        return dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            eos_ids=self.eos_ids,
            group_size=self.group_size,
            pad_id=self.pad_id,
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
    """

    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    mask_BxN: jax.Array
    lengths_B: jax.Array
    sample_logp_BxN: jax.Array


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
    rng: jax.Array  # base key; step n samples with fold_in(rng, n)


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n (buckets in any order); raises if n exceeds the largest bucket."""
    fitting = [b for b in buckets if b >= n]
    if not fitting:
        raise ValueError(
            f"prompt length {n} exceeds the largest bucket {max(buckets)}; add a larger bucket "
            "or truncate the prompt."
        )
    return min(fitting)


def pad_prompts(
    prompts: Sequence[Sequence[int]], buckets: Sequence[int] = DEFAULT_BUCKETS, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to one bucket length: (prompt_ids_PxT int32, prompt_lens_P int32).

    T is the bucket of the longest prompt, so a batch compiles once per bucket, not per length.
    Every prompt needs at least one token (the model conditions on the last prompt token).
    """
    lens_P = np.array([len(p) for p in prompts], np.int32)
    if lens_P.size == 0 or lens_P.min() < 1:
        raise ValueError("pad_prompts needs a non-empty list of prompts with >= 1 token each.")
    t = bucket_length(int(lens_P.max()), buckets)
    ids_PxT = np.full((len(prompts), t), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids_PxT[row, : len(prompt)] = prompt
    return ids_PxT, lens_P


def generate(
    model: nnx.Module,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    *,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    eos_ids: Sequence[int] = (),
    group_size: int = 1,
    pad_id: int = 0,
) -> SampleOutput:
    """Sample `group_size` responses per prompt, all in one compiled graph.

    Args:
      model: a `gvpo_jax.models.Transformer` (or any module with its `hidden`/`unembed`/
        `init_cache`/`share_prefix_cache` API). May be sharded; outputs follow the shardings
        XLA propagates.
      prompt_ids: int32 [P, T], right-padded prompts (T a bucket length, see `pad_prompts`).
      prompt_lens: int32 [P], true lengths, 1 <= len <= T.
      max_new_tokens: N, the number of decode steps at most; output width.
      rng: PRNG key (typed `jax.random.key` or raw `PRNGKey`); unused when greedy.
      temperature: 0.0 is greedy (argmax); otherwise logits / temperature.
      top_k: 0 = off. Applied before top-p, on `lax.top_k` candidates (no vocabulary sort).
      top_p: 1.0 = off. Nucleus on the tempered (and top-k) distribution.
      min_p: 0.0 = off. Keep tokens with p >= min_p * max p.
      eos_ids: a row stops after emitting any of these; () = run to max_new_tokens.
      group_size: G responses per prompt; the prompt is prefilled once and its keys/values
        are stored once and shared by the G samples (`model.share_prefix_cache`).
      pad_id: token written after a row's first EOS.

    Returns:
      `SampleOutput` with B = P * G rows (row p*G + g = sample g of prompt p). `logp_BxN` is the
      temperature-1 untruncated policy log-prob (use as pi_old); `sample_logp_BxN` is the log-prob
      under the sampling distribution.
    """
    settings = canonical_settings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        eos_ids=eos_ids,
        group_size=group_size,
        pad_id=pad_id,
    )
    graphdef, state = nnx.split(model)
    return generate_split(graphdef, state, prompt_ids, prompt_lens, rng, **settings)


def canonical_settings(
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    eos_ids: Sequence[int] | int = (),
    group_size: int = 1,
    pad_id: int = 0,
) -> dict:
    """Validated, canonical static settings for `generate_split` (same meaning as `generate`).

    Canonical types (int, float, sorted tuple of EOS ids) make equal settings hash equal, so
    `generate_split(graphdef, state, ids, lens, rng, **canonical_settings(...))` never retraces
    for settings that only differ in spelling (1 vs 1.0, [2, 1] vs (1, 2)).
    """
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if int(group_size) < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    if float(temperature) < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if int(top_k) < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}.")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}.")
    if not 0.0 <= float(min_p) < 1.0:
        raise ValueError(f"min_p must be in [0, 1) (0 = off), got {min_p}.")
    if isinstance(eos_ids, int):
        eos_ids = (eos_ids,)
    if float(temperature) == 0.0:
        top_k, top_p, min_p = 0, 1.0, 0.0  # irrelevant to argmax: one compiled program
    return dict(
        max_new_tokens=int(max_new_tokens),
        group_size=int(group_size),
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        min_p=float(min_p),
        eos_ids=tuple(sorted({int(e) for e in eos_ids})),
        pad_id=int(pad_id),
    )


def decode_segments(slots: int, max_segments: int = 4, min_segment: int = 16) -> tuple[int, ...]:
    """Cache sizes of the decode segments for `slots` new-token slots, the last one == slots.

    Up to `max_segments` equal segments of at least `min_segment` slots; short generations
    (e.g. a few answer tokens) use one segment. Each segment is one `lax.while_loop` in the same
    compiled program, so more segments mean less attention work but a longer compile.
    """
    count = max(1, min(max_segments, slots // min_segment))
    return tuple(-(-slots * (j + 1) // count) for j in range(count))


def _grow_cache(cache: list[dict[str, jax.Array]], slots: int) -> list[dict[str, jax.Array]]:
    """Pad every layer's new-token slots ('k', 'v' [..., S, H], 'valid' [B, S]) to `slots`."""

    def grow(layer):
        extra = slots - layer["valid"].shape[1]
        pad_kv = [(0, 0)] * (layer["k"].ndim - 2) + [(0, extra), (0, 0)]
        return {
            **layer,
            "k": jnp.pad(layer["k"], pad_kv),
            "v": jnp.pad(layer["v"], pad_kv),
            "valid": jnp.pad(layer["valid"], ((0, 0), (0, extra))),
        }

    return [grow(layer) for layer in cache]


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "max_new_tokens",
        "group_size",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "eos_ids",
        "pad_id",
    ),
)
def generate_split(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    group_size: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    eos_ids: tuple[int, ...],
    pad_id: int,
) -> SampleOutput:
    """`generate` on a split model `(graphdef, state) = nnx.split(model)`; all settings static.

    Use this directly from code that already holds the split model (e.g. inside a trainer's own
    jit). Arguments and result are as in `generate`; pass the settings as
    `**canonical_settings(...)`.
    """
    p, t = prompt_ids.shape
    g, n = group_size, max_new_tokens
    b = p * g
    # Decoding runs in the model's compute dtype: cast the (master) parameters once here, in
    # their shards, rather than at every decode step; the KV cache is in that dtype too. Logits,
    # sampling and the returned log-probs stay fp32.
    dtype = nnx.merge(graphdef, state).config.activation_dtype
    state = jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
    )
    model = nnx.merge(graphdef, state)

    # Prefill the P prompts once: slots [0, T), pads invalid; keep the last real token's logits.
    lens_P = prompt_lens.astype(jnp.int32)
    positions_PxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    valid_PxT = positions_PxT < lens_P[:, None]
    cache = model.init_cache(p, t)
    hidden_PxTxD, cache = model.hidden(
        prompt_ids.astype(jnp.int32), positions_PxT, valid_PxT, cache=cache, cache_index=0
    )
    last_PxD = jnp.take_along_axis(hidden_PxTxD, (lens_P - 1)[:, None, None], axis=1)[:, 0]
    logits_PxV = model.unembed(last_PxD)

    # Share the prefill: every sample of prompt p starts from its logits, and the prompt's keys
    # and values stay stored once per prompt (read once per prompt at every decode step). The
    # last sampled token is never fed back, so the new tokens need N - 1 slots (at least 1).
    logits_BxV = jnp.repeat(logits_PxV, g, axis=0)
    # The new-token slots grow in segments: segment j decodes while its slots suffice, and the
    # cache is then padded to the next size. Each decode step attends over the slots of its
    # segment only, not all N - 1 (about 40% less attention work at N = 128).
    sizes = decode_segments(max(n - 1, 1))
    cache = model.share_prefix_cache(cache, g, sizes[0])
    lens_B = jnp.repeat(lens_P, g)

    select = functools.partial(
        select_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    eos_E = jnp.asarray(eos_ids, jnp.int32)

    def append(s: DecodeState, logits_BxV: jax.Array) -> DecodeState:
        """Sample token `step` of every unfinished row from its logits and record it."""
        tokens_B, logp_B, sample_logp_B = select(logits_BxV, jax.random.fold_in(s.rng, s.step))
        active_B = ~s.done_B
        tokens_B = jnp.where(active_B, tokens_B, pad_id)
        write = lambda buf_BxN, x_B: jax.lax.dynamic_update_slice(
            buf_BxN, x_B[:, None].astype(buf_BxN.dtype), (jnp.zeros((), jnp.int32), s.step)
        )
        is_eos_B = jnp.any(tokens_B[:, None] == eos_E[None, :], axis=-1)
        return s.replace(
            step=s.step + 1,
            done_B=s.done_B | (active_B & is_eos_B),
            lengths_B=s.lengths_B + active_B.astype(jnp.int32),
            tokens_BxN=write(s.tokens_BxN, tokens_B),
            logp_BxN=write(s.logp_BxN, jnp.where(active_B, logp_B, 0.0)),
            sample_logp_BxN=write(s.sample_logp_BxN, jnp.where(active_B, sample_logp_B, 0.0)),
        )

    def keep_going(s: DecodeState, slots: int) -> jax.Array:
        # Step `step` writes slot step - 1, so a segment with `slots` slots ends at step slots.
        return (s.step < n) & (s.step <= slots) & ~jnp.all(s.done_B)

    def decode_step(s: DecodeState) -> DecodeState:
        """Feed token step-1 (new-token slot step-1, position len + step-1); sample token step."""
        fed_B = jax.lax.dynamic_index_in_dim(s.tokens_BxN, s.step - 1, axis=1, keepdims=False)
        # Finished rows hold pad_id, which need not be a vocabulary id: feed token 0 instead.
        fed_B = jnp.where(s.done_B, 0, fed_B)
        positions_Bx1 = (lens_B + s.step - 1)[:, None]
        logits_Bx1xV, cache = nnx.merge(graphdef, state)(
            fed_B[:, None],
            positions_Bx1,
            jnp.ones((b, 1), jnp.bool_),
            cache=s.cache,
            cache_index=s.step - 1,
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
    )
    final = append(start, logits_BxV)
    for j, slots in enumerate(sizes):
        if j:
            final = final.replace(cache=_grow_cache(final.cache, slots))
        final = jax.lax.while_loop(functools.partial(keep_going, slots=slots), decode_step, final)
    mask_BxN = (jnp.arange(n)[None, :] < final.lengths_B[:, None]).astype(jnp.float32)
    return SampleOutput(
        tokens_BxN=final.tokens_BxN,
        logp_BxN=final.logp_BxN,
        mask_BxN=mask_BxN,
        lengths_B=final.lengths_B,
        sample_logp_BxN=final.sample_logp_BxN,
    )


# ----------------------------------------------------------------------------------------------
# The sharded entry point: prompts split by rows over the mesh's data x fsdp shards.


@functools.lru_cache(maxsize=64)
def _jitted_generate(graphdef, mesh, rules, state_shardings, settings: tuple):
    kw = dict(settings)
    raw = generate_split.__wrapped__  # the undecorated function; jitted here with shardings
    rows = sharding.batch_sharding(mesh)

    def fn(state, prompt_ids, prompt_lens, rng):
        with sharding.tracing_mesh(mesh, rules):
            return raw(graphdef, state, prompt_ids, prompt_lens, rng, **kw)

    return jax.jit(
        fn,
        in_shardings=(state_shardings.tree, rows, rows, sharding.replicated(mesh)),
        out_shardings=rows,
    )


def generate_sharded(
    model, prompt_ids, prompt_lens, *, mesh, rules=sharding.LOGICAL_RULES, rng, **settings
) -> SampleOutput:
    """`generate` jitted with explicit shardings: prompts and outputs split by rows.

    `settings` are `generate`'s keywords (max_new_tokens, temperature, top_k, top_p, min_p,
    eos_ids, group_size, pad_id). The model stays where it is (its shardings are the
    in_shardings); the P prompts are split over data x fsdp, so P must be divisible by the
    number of row shards, and the P*G output rows come back split the same way (prompt p's
    samples on the shard that held prompt p). In multi-process runs pass global arrays
    (`sharding.shard_batch`) and read results with `sharding.local_rows`.
    """
    canon = canonical_settings(**settings)
    graphdef, state = nnx.split(model)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    if prompt_ids.shape[0] % sharding.batch_shards(mesh):
        raise sharding.ShardingError(
            f"{prompt_ids.shape[0]} prompts cannot be split over {sharding.batch_shards(mesh)} "
            "data x fsdp shards; sample a multiple of that many prompts."
        )
    fn = _jitted_generate(graphdef, mesh, rules, _Hashable(shardings), tuple(canon.items()))
    return fn(state, prompt_ids, prompt_lens, rng)


class _Hashable:
    """Wraps a sharding pytree for lru_cache (compared by its leaves and structure)."""

    def __init__(self, tree):
        self.tree = tree
        leaves, self.treedef = jax.tree.flatten(tree)
        self.leaves = tuple(leaves)

    def __hash__(self):
        return hash((self.treedef, self.leaves))

    def __eq__(self, other):
        return self.treedef == other.treedef and self.leaves == other.leaves


def sample_groups(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    settings: SamplingSettings,
    rng: jax.Array,
    mesh,
    rules=sharding.LOGICAL_RULES,
) -> SampleOutput:
    """G responses for each of this process's prompts (rows grouped contiguously), as numpy.

    The prompts are padded to a bucket and split by rows over data x fsdp (P, summed over the
    processes, must be a multiple of the row shards); the parameters stay in their shards. In a
    multi-process run `prompts` are this process's rows and so are the returned rows.
    """
    prompt_ids, prompt_lens = pad_prompts(prompts, settings.buckets, settings.pad_id)
    ids = sharding.shard_batch({"ids": prompt_ids, "lens": prompt_lens}, mesh)
    out = generate_sharded(
        model, ids["ids"], ids["lens"], mesh=mesh, rules=rules, rng=rng,
        **settings.generate_kwargs(),
    )  # fmt: skip
    return SampleOutput(*(sharding.local_rows(x) for x in out))
