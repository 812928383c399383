"""In-graph batched sampling with a KV cache: one prefill per prompt, decode in a lax.while_loop.

`generate(model, prompt_ids_PxT, prompt_lens_P, settings, rng=...)` runs prefill and the whole
decode loop in one compiled XLA program (no host round-trip per token) and returns a
`SampleOutput` whose rows are grouped contiguously: row `p * G + g` is sample `g` of prompt `p`,
the layout the trainer's batches keep. This module holds the host side (prompts padded to
buckets, the slot count resolved, rows split over the mesh) and the prefill; the decode loops
and the settings they run with (`SamplingSettings`, `SampleOutput`) are in `decode`
(docs/sampler.md describes both).

Compilation: the jitted function is keyed on one static argument, the settings
(`canonical_settings`: settings that sample alike are equal), on the model's graph definition
and on the array shapes. Pad prompts to a few bucket lengths with `pad_prompts` and keep P
fixed; then every later call with the same bucket reuses the compiled program, also after the
parameters change (they are traced arguments, not constants). Calling `generate` on the NNX
module is fine: it splits the module into (graphdef, state) each call, which is cheap and does
not retrace.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gvpo_jax import decode, models, sharding
from gvpo_jax.decode import SampleOutput, SamplingSettings

__all__ = [
    "SampleOutput",
    "SamplingSettings",
    "bucket_length",
    "canonical_settings",
    "decode_slots",
    "generate",
    "generate_sharded",
    "generate_split",
    "pad_prompts",
    "resolve_slots",
    "sample_groups",
]


def bucket_length(n: int, buckets: Sequence[int] = decode.DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n (buckets in any order); raises if n exceeds the largest bucket."""
    fitting = [b for b in buckets if b >= n]
    if not fitting:
        raise ValueError(
            f"prompt length {n} exceeds the largest bucket {max(buckets)}; add a larger bucket "
            "or truncate the prompt."
        )
    return min(fitting)


def pad_prompts(
    prompts: Sequence[Sequence[int]],
    buckets: Sequence[int] = decode.DEFAULT_BUCKETS,
    pad_id: int = 0,
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


def resolve_slots(num_slots: int, rows: int) -> int:
    """The canonical slot count for `rows` = P*G rows: 0 (static batch) when S is 0 or >= rows,
    so that every spelling of the static batch shares one compiled program."""
    return 0 if num_slots <= 0 or num_slots >= rows else int(num_slots)


def canonical_settings(settings: SamplingSettings, rows: int) -> SamplingSettings:
    """The settings as the compiled program for `rows` = P*G rows sees them, so that settings
    which sample alike are equal and compile once: the slot count resolved (`resolve_slots`),
    no shedding under continuous batching, the EOS ids sorted and distinct, the truncations
    argmax ignores reset when greedy, and the host's fields (buckets, eval_num_slots), which
    the program never reads, at their defaults."""
    slots = resolve_slots(settings.num_slots, rows)
    greedy = settings.temperature == 0.0
    return dataclasses.replace(
        settings,
        eos_ids=tuple(sorted(set(settings.eos_ids))),
        num_slots=slots,
        shed=settings.shed if slots == 0 else 0,
        top_k=0 if greedy else settings.top_k,
        top_p=1.0 if greedy else settings.top_p,
        min_p=0.0 if greedy else settings.min_p,
        buckets=decode.DEFAULT_BUCKETS,
        eval_num_slots=0,
    )


def generate(
    model: nnx.Module,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    settings: SamplingSettings,
    *,
    rng: jax.Array,
    max_lengths: jax.Array | None = None,
) -> SampleOutput:
    """Sample `settings.group_size` responses per prompt, all in one compiled graph.

    Args:
      model: a `gvpo_jax.models.Transformer` (or any module with its `hidden`/`unembed`/
        `init_cache`/`share_prefix_cache` API). May be sharded; outputs follow the shardings
        XLA propagates.
      prompt_ids: int32 [P, T], right-padded prompts (T a bucket length, see `pad_prompts`).
      prompt_lens: int32 [P], true lengths, 1 <= len <= T.
      settings: how to sample (`SamplingSettings`: N, G, EOS, temperature and truncations,
        `num_slots` and `shed`). The G samples of a prompt share its prefill, whose keys and
        values are stored once (`model.share_prefix_cache`). `num_slots` = S: 0 or >= P*G, one
        slot per row, the static batch; 1 <= S < P*G, S slots take the P*G (prompt, sample)
        work items in row order, a slot taking the next item as soon as its row ends (EOS or
        length cap), so the new-token KV cache holds S rows instead of P*G. `shed` = L > 0
        (static batch only) halves the decode batch up to L times as rows finish. The output
        is the same for every S and L: token t of row b is drawn with a key of its own,
        `sampling_ops.token_keys(rng, b, t)`.
      rng: PRNG key (typed `jax.random.key` or raw `PRNGKey`); unused when greedy.
      max_lengths: optional int32 [P*G] per-row length caps (clipped to [1, max_new_tokens]):
        row b stops after max_lengths[b] tokens, as at an EOS. None: max_new_tokens for all.

    Returns:
      `SampleOutput` with B = P * G rows (row p*G + g = sample g of prompt p). `logp_BxN` is the
      temperature-1 untruncated policy log-prob (use as pi_old); `sample_logp_BxN` is the log-prob
      under the sampling distribution.
    """
    settings = canonical_settings(settings, prompt_ids.shape[0] * settings.group_size)
    graphdef, state = nnx.split(model)
    # Without caps, call as `generate_split(graphdef, state, ids, lens, rng, settings=...)` does:
    # an explicit None would key another jit cache entry (a program compiled ahead of time with
    # `generate_split.lower(...)` would then compile again).
    caps = () if max_lengths is None else (max_lengths,)
    return generate_split(graphdef, state, prompt_ids, prompt_lens, rng, *caps, settings=settings)


def decode_slots(lengths_B, *, max_new_tokens: int, num_slots: int = 0, shed: int = 0) -> int:
    """Row-steps a decode computes for responses of these lengths (the prefill's first token
    of each row counted once), on the host: the static batch runs every row until the longest
    ends; with `shed` it runs the smallest level that holds the rows still running; with
    `num_slots` = S its S slots run until the queue is empty (the sampler's schedule).
    Divide by sum(lengths) for the decode's computed / real token slots."""
    lengths = np.asarray(lengths_B, np.int64)
    b, n = len(lengths), max_new_tokens
    if 0 < num_slots < b:
        free = [0] * num_slots
        for length in lengths:
            if length > 1:
                heapq.heappush(free, heapq.heappop(free) + int(length) - 1)
        return b + max(free) * num_slots
    levels, level, total = decode.shed_levels(b, shed), 0, b
    for step in range(1, n):
        running = int((lengths > step).sum())
        if not running:
            break
        while level + 1 < len(levels) and running <= levels[level + 1]:
            level += 1
        total += levels[level]
    return total


@functools.partial(
    jax.jit, static_argnames=("graphdef", "settings", "num_queues", "with_iterations")
)
def generate_split(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    rng: jax.Array,
    max_lengths: jax.Array | None = None,
    *,
    settings: SamplingSettings,
    num_queues: int = 1,
    with_iterations: bool = False,
):
    """`generate` on a split model `(graphdef, state) = nnx.split(model)`; `settings` static.

    Use this directly from code that already holds the split model (e.g. inside a trainer's own
    jit). Arguments and result are as in `generate`; pass `canonical_settings(...)` so that
    settings spelled differently share one program. Two more static arguments:
      num_queues: D, the continuous sampler's independent work queues: items, prompts and slots
        split into D equal contiguous parts, and each part's slots only take its own items
        (`generate_sharded` sets D to the mesh's row shards). The output does not depend on it.
      with_iterations: also return the number of decode iterations (model calls after the
        prefill; the static sampler's steps, or the continuous loop's iterations), as
        `(SampleOutput, int32 scalar)`.
    """
    p, t = prompt_ids.shape
    g, n = settings.group_size, settings.max_new_tokens
    b = p * g
    slots = b if settings.num_slots == 0 else min(settings.num_slots, b)
    if p % num_queues or slots % num_queues:
        raise ValueError(
            f"{p} prompts and {slots} slots must both split into num_queues={num_queues} equal "
            "parts; use a multiple of it for both."
        )
    # Decoding runs in the model's compute dtype: cast the (master) parameters once here, in
    # their shards, rather than at every decode step; the KV cache is in that dtype too. Logits,
    # sampling and the returned log-probs stay fp32.
    cfg = nnx.merge(graphdef, state).config
    state = models.cast_floating(state, cfg.compute_dtype)
    model = nnx.merge(graphdef, state)
    if cfg.scan_layers and not cfg.scan_decode:  # stacked blocks sliced once, run unrolled
        model = models.unstacked(model)
        graphdef, state = nnx.split(model)

    # Prefill the P prompts once: slots [0, T), pads invalid; keep the last real token's logits.
    lens_P = prompt_lens.astype(jnp.int32)
    positions_PxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    valid_PxT = positions_PxT < lens_P[:, None]
    cache = model.init_cache(p, t)
    record = settings.record_routes and cfg.moe
    out = model.hidden(
        prompt_ids.astype(jnp.int32),
        positions_PxT,
        valid_PxT,
        cache=cache,
        cache_index=0,
        with_routes=record,
    )
    hidden_PxTxD, cache = out[:2]
    routes_shape = prompt_routes = None
    if record:  # the prompts' routes [M, P, T, K] -> [P, T, M, K], 0 past each prompt
        dtype = decode.routes_dtype(cfg.num_experts)
        experts = jnp.moveaxis(out[2].experts, 0, 2)
        prompt_routes = jnp.where(valid_PxT[..., None, None], experts, 0)
        prompt_routes = prompt_routes.astype(dtype)
        routes_shape = (prompt_routes.shape[2], cfg.num_experts_per_tok, dtype)
    last_PxD = jnp.take_along_axis(hidden_PxTxD, (lens_P - 1)[:, None, None], axis=1)[:, 0]
    logits_PxV = model.unembed(last_PxD)
    caps_B = jnp.full((b,), n, jnp.int32)
    if max_lengths is not None:
        caps_B = jnp.clip(jnp.asarray(max_lengths, jnp.int32).reshape(b), 1, n)

    args = (graphdef, state, cache, logits_PxV, lens_P, caps_B, rng, settings, routes_shape)
    if slots == b:
        out, iterations = decode.static_batch(*args)
    else:
        out, iterations = decode.continuous_batch(*args, slots=slots, queues=num_queues)
    out = out._replace(prompt_routes_PxTxMxK=prompt_routes)
    return (out, iterations) if with_iterations else out


# ----------------------------------------------------------------------------------------------
# The sharded entry point: prompts split by rows over the mesh's data x fsdp shards.


@functools.lru_cache(maxsize=64)
def _jitted_generate(graphdef, mesh, rules, state_shardings: tuple, settings: SamplingSettings):
    """`generate_split` jitted with the state's shardings and rows split over the mesh, one per
    (graph, mesh, rules, shardings, settings). `state_shardings` is (treedef, leaves) of the
    state's shardings, flattened so the cache can hash it."""
    raw = generate_split.__wrapped__  # the undecorated function; jitted here with shardings
    rows = sharding.batch_sharding(mesh)
    queues = sharding.batch_shards(mesh) if settings.num_slots else 1

    def generate(state, prompt_ids, prompt_lens, rng, max_lengths):  # its programs: jit_generate
        with sharding.tracing_mesh(mesh, rules):
            return raw(
                graphdef,
                state,
                prompt_ids,
                prompt_lens,
                rng,
                max_lengths,
                settings=settings,
                num_queues=queues,
            )

    in_state = jax.tree.unflatten(*state_shardings)
    return jax.jit(
        generate,
        in_shardings=(in_state, rows, rows, sharding.replicated(mesh), rows),
        out_shardings=rows,
    )


def generate_sharded(
    model,
    prompt_ids,
    prompt_lens,
    settings: SamplingSettings,
    *,
    mesh,
    rules=sharding.LOGICAL_RULES,
    rng,
    max_lengths=None,
) -> SampleOutput:
    """`generate` jitted with explicit shardings: prompts and outputs split by rows.

    The model stays where it is (its shardings are the in_shardings); the P prompts are split
    over data x fsdp, so P must be divisible by the number of row shards, and the P*G output rows
    come back split the same way (prompt p's samples on the shard that held prompt p). With
    num_slots = S < P*G the slots are split the same way (S must be a multiple of the row
    shards): each shard's S / shards slots take that shard's own items (whole groups), and the
    output equals the one-device output. In multi-process runs pass global arrays
    (`sharding.shard_batch`) and read results with `sharding.local_rows`.
    """
    settings = canonical_settings(settings, prompt_ids.shape[0] * settings.group_size)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, state))
    sharding.check_split(prompt_ids.shape[0], mesh, "prompts", "sample a multiple of that many")
    sharding.check_split(
        settings.num_slots, mesh, "num_slots (decode slots)", "use a multiple of that many slots"
    )
    fn = _jitted_generate(graphdef, mesh, rules, (treedef, tuple(leaves)), settings)
    return fn(state, prompt_ids, prompt_lens, rng, max_lengths)


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
        model, ids["ids"], ids["lens"], settings, mesh=mesh, rules=rules, rng=rng
    )
    return SampleOutput(*(None if x is None else sharding.local_rows(x) for x in out))
