"""Continuous batching in the sampler: S decode slots return the static batch's samples exactly.

The sampler draws token t of row b with its own key (`sampling_ops.token_keys(rng, b, t)`), so
which slot or iteration computed a row cannot change its tokens; these tests hold the continuous
path (`num_slots` = S < P*G) to the static one (S = P*G) token for token, on one device and on a
4 x 2 mesh, and check the schedule itself (iterations, early exit, no recompiles).

Float rounding: a slot reads its prompt's keys through a per-slot gather and its own new-token
columns, the static batch through the shared-prefix layout, so XLA may round a logit
differently (`test_rounding_differs_but_only_in_the_last_bits` shows the size: ~1e-6 on
log-probs at S = 1, where the matmuls are matrix-vector products, 0 at most other S here). A
sampled token can only change when its uniform lands within that distance of a CDF edge
(probability ~1e-6 per token), so the exact-equality tests use a model with peaked
distributions and also check the strongest property that holds whatever the rounding: every
returned log-prob equals a full forward of the returned tokens.
"""

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gvpo_jax import assemble, data, decode, models, sampler, sharding
from gvpo_jax import config as config_lib
from gvpo_jax import eval as eval_lib
from gvpo_jax.models.cache import layer as layer_cache
from gvpo_jax.models.cache import per_layer
from gvpo_jax.sampler import SamplingSettings
from tests.helpers import scale_matrices

VOCAB = 300  # > 256: both levels of the two-level draw
CFG = models.ModelConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    attention_bias=True,
)
PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13], [99], [250, 3, 4, 4, 4, 60, 61, 62, 63, 1, 2]]
G, N = 3, 16  # B = 12 rows
# Sampling modes: greedy, plain temperature, top-k candidates + sorted nucleus, and the
# full-vocabulary nucleus with min-p.
MODES = {
    "greedy": dict(temperature=0.0),
    "t1": dict(temperature=1.0),
    "topk_topp": dict(temperature=0.8, top_k=20, top_p=0.9),
    "topp_minp": dict(temperature=1.3, top_p=0.7, min_p=0.02),
}
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one per compilation


def _model(scale: float, seed: int = 0, norm: float = 1.0):
    """A random model with weights scaled by `scale` (so greedy paths do not loop) and the final
    norm by `norm` (larger: more peaked next-token distributions)."""
    model = models.Transformer(CFG, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    state = scale_matrices(state, scale, model.config.scan_layers)
    model = nnx.merge(graphdef, state)
    model.final_norm.scale[...] = model.final_norm.scale[...] * norm
    return model


@pytest.fixture(scope="module")
def peaked():
    """Sampled tokens have probability ~0.5-0.7 (median) here: peaked, still random."""
    return _model(12.0, norm=3.0)


def _lengths_with(free_BxN, eos) -> np.ndarray:
    """Row lengths of a run whose rows stop at their first token in `eos` (`free_BxN`: the same
    run without EOS, which agrees with it up to that token)."""
    hit_BxN = np.isin(free_BxN, list(eos))
    return np.where(hit_BxN.any(1), hit_BxN.argmax(1) + 1, free_BxN.shape[1])


def _eos_for_mix(free, distinct: int = 5):
    """EOS ids that end the rows of a run at varied lengths while some rows never end, and the
    lengths: tokens of the run without EOS (`free`, [B, N]) are added while each adds a new
    length and >= 2 rows still run to the cap."""
    free = np.asarray(free)
    n, eos = free.shape[1], set()
    for k in (2, 9, 5, 12, 1, 7, 14, 3, 10):  # positions to end rows at, spread out
        for row in range(free.shape[0]):
            trial = eos | {int(free[row, k])}
            old, new = _lengths_with(free, eos), _lengths_with(free, trial)
            if len(set(new.tolist())) > len(set(old.tolist())) and (new == n).sum() >= 2:
                eos = trial
                break
        if len(set(_lengths_with(free, eos).tolist())) >= distinct:
            break
    return tuple(sorted(eos)), _lengths_with(free, eos)


def _run(model, ids, lens, rng, slots, max_lengths=None, **kw):
    settings = SamplingSettings(group_size=G, num_slots=slots, **kw)
    out = sampler.generate(model, ids, lens, settings, rng=rng, max_lengths=max_lengths)
    return jax.tree.map(np.asarray, out)


def _assert_same(out, ref, atol=1e-5):
    """Tokens, lengths and masks exactly; log-probs to fp32 rounding. The slots' batch shape
    changes the reduction order of the forward's matmuls, so a log-prob of -2.64 can move by
    1.5e-5 (seen once in a loaded run): hence a relative tolerance beside the absolute one."""
    np.testing.assert_array_equal(out.tokens_BxN, ref.tokens_BxN)
    np.testing.assert_array_equal(out.lengths_B, ref.lengths_B)
    np.testing.assert_array_equal(out.mask_BxN, ref.mask_BxN)
    np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(out.sample_logp_BxN, ref.sample_logp_BxN, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("mode", list(MODES))
def test_continuous_equals_static_token_for_token(peaked, mode):
    """S = 1 and 5 (does not divide 12) in every mode, and 2, 8, 11 at T = 1 (the slot count
    is not in the sampling code, so one mode covers the other counts): every output array
    equals the static batch's, with EOS ending rows at varied lengths (slots refill at varied
    iterations)."""
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    kw = dict(max_new_tokens=N, **MODES[mode])
    rng = jax.random.key(11)
    eos, expected = _eos_for_mix(_run(peaked, ids, lens, rng, 0, **kw).tokens_BxN)
    ref = _run(peaked, ids, lens, rng, 0, eos_ids=eos, pad_id=-1, **kw)
    np.testing.assert_array_equal(ref.lengths_B, expected)
    # Greedy rows of one prompt are equal: 4 prompts give at most 4 lengths.
    assert len(set(expected.tolist())) >= (4 if mode == "greedy" else 5), expected
    assert expected.min() <= 3 and (expected == N).sum() >= 2, expected
    for slots in (1, 5) + ((2, 8, 11) if mode == "t1" else ()):
        out = _run(peaked, ids, lens, rng, slots, eos_ids=eos, pad_id=-1, **kw)
        _assert_same(out, ref)


def _recomputed_logp(model, ids, lens, tokens_BxN):
    """log pi(response token) by one full forward (no cache) of prompt + response, per row."""
    b, n = tokens_BxN.shape
    lens_B = np.repeat(lens, G)
    seqs = np.zeros((b, ids.shape[1] + n), np.int32)
    for row in range(b):
        prompt = ids[row // G, : lens_B[row]]
        seqs[row, : lens_B[row] + n] = np.concatenate([prompt, np.maximum(tokens_BxN[row], 0)])
    logits = np.asarray(model(jnp.asarray(seqs)), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    idx = lens_B[:, None] + np.arange(n)[None, :]  # position of response token j
    rows = np.arange(b)[:, None]
    return logp[rows, idx - 1, seqs[rows, idx]]


def test_returned_logps_equal_a_full_forward_of_the_returned_tokens():
    """Whatever the rounding: the continuous sampler's log-probs (S = 5, rows ending at varied
    lengths, slots refilled mid-sequence over stale columns) are the policy's log-probs of its
    own tokens, on a model with spread-out distributions."""
    model = _model(8.0, seed=1)
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    kw = dict(max_new_tokens=N, temperature=1.0, top_k=50)
    rng = jax.random.key(3)
    eos, _ = _eos_for_mix(_run(model, ids, lens, rng, 0, **kw).tokens_BxN)
    out = _run(model, ids, lens, rng, 5, eos_ids=eos, **kw)
    mask = out.mask_BxN > 0
    assert 0.3 < mask.mean() < 0.95  # refills happened
    expected = _recomputed_logp(model, ids, lens, out.tokens_BxN)
    np.testing.assert_allclose(out.logp_BxN[mask], expected[mask], atol=1e-5)
    assert np.all(out.logp_BxN[~mask] == 0) and np.all(out.sample_logp_BxN[~mask] == 0)


def test_rounding_differs_but_only_in_the_last_bits():
    """The slot layout rounds differently from the static one (shown at S = 1, matrix-vector
    products), by ~1e-6 on the log-probs: far below any gap the peaked tests could straddle."""
    model = _model(8.0, seed=1)
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    kw = dict(max_new_tokens=N, temperature=1.0)
    rng = jax.random.key(5)
    ref = _run(model, ids, lens, rng, 0, **kw)
    out = _run(model, ids, lens, rng, 1, **kw)
    np.testing.assert_array_equal(out.tokens_BxN, ref.tokens_BxN)
    diff = np.abs(out.logp_BxN - ref.logp_BxN).max()
    assert diff < 2e-5, diff
    print(f"max |logp(S=1) - logp(static)| = {diff:.2e}")


def _simulated_iterations(lengths_B, slots: int, queues: int = 1) -> int:
    """Iterations of the schedule the sampler promises: each queue's slots take its items in row
    order, an item of length L occupies a slot for L - 1 iterations (token 0 comes from the
    prefill) and a finished slot takes the next item for the very next iteration."""
    rows, per = len(lengths_B) // queues, slots // queues
    worst = 0
    for q in range(queues):
        free = [0] * per
        for length in lengths_B[q * rows : (q + 1) * rows]:
            if length > 1:
                heapq.heappush(free, heapq.heappop(free) + int(length) - 1)
        worst = max(worst, max(free))
    return worst


def test_iterations_follow_the_schedule_and_exit_early(peaked):
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    graphdef, state = nnx.split(peaked)
    rng = jax.random.key(2)
    kw = SamplingSettings(max_new_tokens=N, temperature=1.0, group_size=G)
    free = sampler.generate_split(graphdef, state, ids, lens, rng, settings=kw)
    eos = tuple(int(t) for t in np.asarray(free.tokens_BxN)[[0, 5, 9], [4, 2, 11]])
    kw = dataclasses.replace(kw, eos_ids=tuple(sorted(set(eos))))

    def iterations(slots, max_lengths=None, num_queues=1):
        settings = dataclasses.replace(kw, num_slots=slots)
        out, steps = sampler.generate_split(
            graphdef,
            state,
            ids,
            lens,
            rng,
            max_lengths,
            settings=settings,
            num_queues=num_queues,
            with_iterations=True,
        )
        return jax.tree.map(np.asarray, out), int(steps)

    ref, static_steps = iterations(0)
    lengths = ref.lengths_B
    assert static_steps == lengths.max() - 1
    for slots in (1, 4, 5, 11):
        out, steps = iterations(slots)
        np.testing.assert_array_equal(out.lengths_B, lengths)
        assert steps == _simulated_iterations(lengths, slots), (slots, steps)
    # Two queues (as on a mesh with 2 row shards): each refills from its own half, and keys
    # its rows by their place in the whole batch.
    out, steps = iterations(4, num_queues=2)
    assert steps == _simulated_iterations(lengths, 4, queues=2)
    _assert_same(out, ref)
    # Per-row caps end rows like an EOS; the loop stops as soon as the last item is done.
    caps = np.array([1, 2, 3, 1, 5, 1, 16, 1, 2, 1, 1, 4], np.int32)
    out, steps = iterations(3, caps)
    capped = out.lengths_B
    np.testing.assert_array_equal(capped, np.minimum(caps, lengths))
    assert steps == _simulated_iterations(capped, 3)
    # Every row ends at its first token: no decode iteration at all.
    _, steps = iterations(3, np.ones(len(caps), np.int32))
    assert steps == 0


def test_per_row_caps_equal_between_static_and_continuous(peaked):
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    caps = np.random.default_rng(0).integers(1, N + 4, len(PROMPTS) * G).astype(np.int32)
    kw = dict(max_new_tokens=N, temperature=1.0, top_k=30, max_lengths=caps)
    ref = _run(peaked, ids, lens, jax.random.key(4), 0, **kw)
    np.testing.assert_array_equal(ref.lengths_B, np.clip(caps, 1, N))
    for slots in (1, 7):
        _assert_same(_run(peaked, ids, lens, jax.random.key(4), slots, **kw), ref)


def test_bf16_compute_continuous_equals_static(peaked):
    """bf16 compute (fp32 masters cast in the graph): a bf16 slot cache, and the same tokens."""
    model16 = models.with_compute_dtype(peaked, jnp.bfloat16)
    cache = model16.slot_cache(model16.init_cache(2, 4), 2, 3)
    assert layer_cache(cache, 0).k.dtype == layer_cache(cache, 0).prefix_k.dtype == jnp.bfloat16
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    kw = dict(max_new_tokens=N, temperature=1.0, top_k=20)
    ref = _run(model16, ids, lens, jax.random.key(8), 0, **kw)
    out = _run(model16, ids, lens, jax.random.key(8), 5, **kw)
    assert out.logp_BxN.dtype == np.float32
    np.testing.assert_array_equal(out.tokens_BxN, ref.tokens_BxN)
    np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN, atol=2e-2)


def test_no_recompilation_across_prompts_keys_and_parameters(peaked):
    model = _model(4.0)  # own parameters: they are modified below
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event)

    def call(prompts, seed):
        ids, lens = sampler.pad_prompts(prompts, (8, 16))
        settings = SamplingSettings(
            max_new_tokens=6, top_k=7, group_size=2, eos_ids=(3, 4, 5), num_slots=3
        )
        out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(seed))
        return jax.block_until_ready(out)

    call([[1, 2], [3, 4, 5]], 0)
    new_embedding = model.embedding[...] * 1.01
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        compiles.clear()
        call([[9, 8, 7, 6, 5], [4]], 1)
        model.embedding[...] = new_embedding
        call([[2, 2], [2]], 2)
        n_same = sum(e == LOWERING for e in compiles)
        call([[1] * 12, [2]], 3)  # another bucket compiles: the counter counts
        n_new = sum(e == LOWERING for e in compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert n_same == 0 and n_new >= 1


def test_slot_equal_to_rows_is_the_static_program():
    assert sampler.resolve_slots(0, 12) == 0
    assert sampler.resolve_slots(12, 12) == sampler.resolve_slots(40, 12) == 0
    assert sampler.resolve_slots(5, 12) == 5
    with pytest.raises(ValueError, match="num_slots must be >= 0"):
        SamplingSettings(max_new_tokens=4, num_slots=-1)


def test_slot_cache_attention_equals_the_full_forward():
    """The model's slot path on its own (2 queues of 2 slots over 2 x 2 prefixes): slots that
    switch prefix and restart at column 0 over an earlier item's keys, next to slots that go on
    at their own columns, give the full forward's logits of their current sequences."""
    model = _model(2.0, seed=3)
    rng = np.random.default_rng(0)
    p, j = 4, 6
    lens_P = np.array([6, 3, 5, 1], np.int32)
    prefix_PxJ = rng.integers(1, VOCAB, (p, j)).astype(np.int32)
    cache = model.init_cache(p, j)
    _, cache = model.hidden(
        jnp.asarray(prefix_PxJ),
        jnp.broadcast_to(jnp.arange(j), (p, j)),
        jnp.asarray(np.arange(j)[None] < lens_P[:, None]),
        cache=cache,
        cache_index=0,
    )
    cache = model.slot_cache(cache, 4, 6, queues=2)

    @nnx.jit
    def decode(model, tokens_S, positions_S, cache, columns_S):
        return model(
            tokens_S[:, None], positions_S[:, None], jnp.ones((4, 1), bool),
            cache=cache, cache_index=columns_S,
        )  # fmt: skip

    seqs = [[] for _ in range(4)]  # each slot's continuation tokens so far
    index_DxS = np.array([[0, 1], [1, 0]], np.int32)  # slot -> prefix within its queue
    got, full = [], []

    def step(columns_S):
        nonlocal cache
        prefix_S = (np.arange(2)[:, None] * 2 + index_DxS).reshape(4)
        tokens_S = rng.integers(1, VOCAB, 4)
        layers = per_layer(lambda c: c.replace(prefix_index=jnp.asarray(index_DxS)), cache)
        logits, cache = decode(model, jnp.asarray(tokens_S), jnp.asarray(lens_P[prefix_S] +
                               columns_S), layers, jnp.asarray(columns_S, jnp.int32))  # fmt: skip
        for s in range(4):
            seqs[s] = seqs[s][: columns_S[s]] + [int(tokens_S[s])]
            full.append(list(prefix_PxJ[prefix_S[s], : lens_P[prefix_S[s]]]) + seqs[s])
            got.append(np.asarray(logits)[s, 0])

    for col in range(3):
        step(np.full(4, col))
    index_DxS[0, 0], index_DxS[1, 1] = 1, 1  # slots 0 and 3 take new items (other prompts)
    step(np.array([0, 3, 3, 0]))
    step(np.array([1, 4, 4, 1]))
    # One right-padded full forward of every slot's sequence at every step.
    width = max(map(len, full))
    tokens = np.array([f + [0] * (width - len(f)) for f in full], np.int32)
    mask = np.arange(width)[None] < np.array([len(f) for f in full])[:, None]
    logits = np.asarray(model(jnp.asarray(tokens), mask_BxT=jnp.asarray(mask)))
    last = logits[np.arange(len(full)), [len(f) - 1 for f in full]]
    np.testing.assert_allclose(np.stack(got), last, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# On a mesh, and through the trainer's settings.


def test_sharded_continuous_equals_one_device():
    """A 4 x 2 mesh (rows over data, heads/vocab over tensor): each shard's slots refill from
    its own items; the output equals the one-device static output for S = 4, 8, 12."""
    cfg = CFG
    mesh = sharding.make_mesh(4, 1, 2)
    rules = sharding.logical_rules(mesh, cfg)
    model = sharding.init_sharded(cfg, mesh, seed=1)
    graphdef, state = nnx.split(model)
    state = scale_matrices(state, 12.0, model.config.scan_layers)
    model = nnx.merge(graphdef, state)
    host = nnx.merge(graphdef, jax.device_put(jax.device_get(state), jax.devices()[0]))
    prompts = PROMPTS + [[3, 3], [8, 1, 2, 200], [17], [60, 61, 62]]
    ids, lens = sampler.pad_prompts(prompts, (16,))
    kw = SamplingSettings(max_new_tokens=N, temperature=1.0, top_k=20, group_size=G)
    free = sampler.generate(host, ids, lens, kw, rng=jax.random.key(6))
    eos_ids, expected = _eos_for_mix(free.tokens_BxN)
    kw = dataclasses.replace(kw, eos_ids=eos_ids)
    ref = jax.tree.map(np.asarray, sampler.generate(host, ids, lens, kw, rng=jax.random.key(6)))
    np.testing.assert_array_equal(ref.lengths_B, expected)
    assert len(set(expected.tolist())) >= 5
    for slots in (4, 8, 12):
        out = sampler.generate_sharded(
            model,
            ids,
            lens,
            dataclasses.replace(kw, num_slots=slots),
            mesh=mesh,
            rules=rules,
            rng=jax.random.key(6),
        )
        assert out.tokens_BxN.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
        _assert_same(jax.tree.map(np.asarray, out), ref, atol=1e-4)  # tensor-parallel sums
    # Per-row caps, split over the shards with the rows.
    caps = np.random.default_rng(1).integers(1, N + 1, len(expected)).astype(np.int32)
    ref = sampler.generate(host, ids, lens, kw, rng=jax.random.key(6), max_lengths=caps)
    out = sampler.generate_sharded(
        model,
        ids,
        lens,
        dataclasses.replace(kw, num_slots=8),
        mesh=mesh,
        rules=rules,
        rng=jax.random.key(6),
        max_lengths=caps,
    )
    _assert_same(*(jax.tree.map(np.asarray, x) for x in (out, ref)), atol=1e-4)
    # The shedding static batch (24 -> 12 -> 6 -> 3 rows) on the mesh: the same output.
    out = sampler.generate_sharded(
        model,
        ids,
        lens,
        dataclasses.replace(kw, shed=3),
        mesh=mesh,
        rules=rules,
        rng=jax.random.key(6),
        max_lengths=caps,
    )
    _assert_same(*(jax.tree.map(np.asarray, x) for x in (out, ref)), atol=1e-4)
    with pytest.raises(sharding.ShardingError, match=r"slots\) = 6 cannot be split"):
        sampler.generate_sharded(
            model,
            ids,
            lens,
            dataclasses.replace(kw, num_slots=6),
            mesh=mesh,
            rules=rules,
            rng=jax.random.key(6),
        )


def _config(**changes):
    c = config_lib.base_config()
    c.model.overrides = {"vocab_size": 64, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                         "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 64}  # fmt: skip
    c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens = 8, 4, 8
    return config_lib.set_fields(c, changes)


def test_config_fields_reach_the_sampler_and_the_planner():
    c = _config(**{"rollout.num_slots": 8, "train.eval_num_slots": 4})
    config_lib.validate(c, check_paths=False)
    settings = assemble.sampling_settings(c, data.build_char_tokenizer())
    assert settings.num_slots == 8 and settings.eval_num_slots == 4
    assert sampler.canonical_settings(settings, rows=8 * 4).num_slots == 8

    from gvpo_jax import plan

    cfg = plan.model_config(c)
    sizes = {"data": 2, "fsdp": 1, "tensor": 1}
    static = plan.kv_cache_bytes(cfg, 8, 4, 16, 8, sizes)
    half = plan.kv_cache_bytes(cfg, 8, 4, 16, 8, sizes, num_slots=16)
    per_column = 2 * 1 * 16 * 4  # k + v, one KV head of 16, fp32
    # 16 rows per shard (static) vs 8 slots per shard, 7 new-token columns each.
    assert static - half == 7 * (16 * (per_column + 1) - 8 * per_column)
    c.rollout.num_slots = 6
    notes = plan.plan_memory(c, 4).notes
    assert any("NOT RUNNABLE" in n and "rollout.num_slots (decode slots) = 6" in n for n in notes)


def test_planner_sizes_the_evaluation_kv_cache_from_its_chunk_samples_and_slots():
    c = _config(**{"train.eval_samples": 16, "train.eval_chunk": 4})
    config_lib.validate(c, check_paths=False)
    from gvpo_jax import plan

    cfg = plan.model_config(c)
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    tp, n = c.data.max_prompt_len, c.rollout.max_new_tokens
    report = plan.plan_memory(c, 1)
    assert report.eval_kv_cache == plan.kv_cache_bytes(cfg, 4, 16, tp, n, sizes)
    # 4 prompts x 16 samples = 64 rows against the rollout's 8 x 4 = 32: evaluation is the peak
    assert report.eval_kv_cache > report.kv_cache
    assert report.peak == max(report.update_peak, report.eval_peak)
    assert "KV cache of an evaluation call" in report.table()
    c.train.eval_num_slots = 8
    assert plan.plan_memory(c, 1).eval_kv_cache == plan.kv_cache_bytes(
        cfg, 4, 16, tp, n, sizes, num_slots=8
    )


def test_num_slots_not_splitting_over_the_mesh_is_a_sharding_error():
    c = _config(**{"rollout.num_slots": 6})
    config_lib.validate(c, check_paths=False)
    with pytest.raises(sharding.ShardingError, match=r"rollout.num_slots \(decode slots\) = 6"):
        assemble.check_mesh(c, sharding.make_mesh(4, 1, 1, devices=jax.devices()[:4]))
    c = _config(**{"train.eval_num_slots": 2})
    with pytest.raises(sharding.ShardingError, match=r"eval_num_slots \(decode slots\) = 2"):
        assemble.check_mesh(c, sharding.make_mesh(4, 1, 1, devices=jax.devices()[:4]))
    assemble.check_mesh(_config(**{"rollout.num_slots": 8}), sharding.make_mesh(4, 1, 1,
                        devices=jax.devices()[:4]))  # fmt: skip


def test_evaluation_uses_its_own_slots_and_scores_the_same_samples(monkeypatch):
    """`train.eval_num_slots` reaches the evaluation's sampler calls (capped at their rows:
    the greedy pass has 4 rows, the avg@n pass 16) and changes no completion."""
    c = _config(**{"train.eval_num_slots": 6})
    tok = data.build_char_tokenizer()
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model, tok, rules = assemble.build_model(c, tok, mesh)
    settings = assemble.sampling_settings(c, tok)
    examples = [{"prompt_ids": tok.encode(f"{i}+{i}="), "answer": str(2 * i)} for i in range(6)]
    seen, real = [], sampler.generate_sharded

    def spy(model, ids, lens, settings, **kw):
        seen.append(settings.num_slots)
        return real(model, ids, lens, settings, **kw)

    monkeypatch.setattr(sampler, "generate_sharded", spy)
    kw = dict(tokenizer=tok, mesh=mesh, rules=rules, n=4, chunk=4, seed=0,
              reward_fn=lambda completion, gold: float(len(completion) % 2))  # fmt: skip
    continuous = eval_lib.evaluate_policy(model, examples, settings=settings, **kw)
    assert set(seen) == {6}
    static = eval_lib.evaluate_policy(
        model, examples, settings=dataclasses.replace(settings, eval_num_slots=0), **kw
    )
    assert set(seen[len(seen) // 2 :]) == {0}
    assert continuous == static


def test_benchmark_quick_runs_and_reports_equal_outputs(capsys):
    from benchmarks import continuous

    summary = continuous.main(["--quick", "--repeats", "1", "--orders", "1", "--slots", "16"])
    out = capsys.readouterr().out
    assert "| S = 16 | 16 |" in out and "planner, configs/qwen_math.py" in out
    assert summary["S = 16"]["same"] == "yes" and summary["S = 16"]["recompiles"] == 0
    assert summary["S = 16"]["kv"] * 2 == summary["static"]["kv"]
    assert summary["S = 16"]["iterations"] > summary["static"]["iterations"]


def test_benchmark_length_mixes_have_their_documented_shape():
    """linear: a permutation of N/8..N; tail: N/32 + exponential, capped at N, mean ~118 of 256
    with ~15% at the cap; the schedule of slots beats chunks of equal memory on both."""
    from benchmarks import continuous

    lin = continuous.length_mix(32, 256, seed=3)
    np.testing.assert_array_equal(np.sort(lin), np.round(np.linspace(32, 256, 32)).astype(int))
    tails = np.stack([continuous.length_mix(32, 256, seed=s, kind="tail") for s in range(400)])
    assert tails.min() >= 8 and tails.max() == 256 and tails.dtype == np.int32
    assert 110 < tails.mean() < 126, tails.mean()
    assert 0.12 < (tails == 256).mean() < 0.18, (tails == 256).mean()
    for kind in continuous.MIXES:
        table = {r[0]: float(r[2]) for r in continuous.schedule_table(32, 256, (8,), 200, kind)}
        assert table["S = 8"] < table["chunks of 8"], (kind, table)
    with pytest.raises(ValueError, match="length mix 'uniform'"):
        continuous.length_mix(32, 256, kind="uniform")


# ---------------------------------------------------------------------------------------------
# The shedding static batch: still-running rows compacted into halved batches


def test_shedding_static_batch_equals_the_static_batch(peaked):
    """shed = 3 (12 -> 6 -> 3 -> 2 rows): every output array equals the static batch's, with
    EOS and per-row caps ending rows at varied lengths, so the batch sheds rows three times;
    the decode runs as many iterations as the static batch, computing the row-steps that
    `sampler.decode_slots` counts on the host."""
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    graphdef, state = nnx.split(peaked)
    kw = dict(max_new_tokens=N, **MODES["t1"])
    rng = jax.random.key(11)  # the settings of test_continuous_equals_static_token_for_token
    eos, _ = _eos_for_mix(_run(peaked, ids, lens, rng, 0, **kw).tokens_BxN)
    caps = np.array([16, 3, 12, 2, 5, 16, 4, 9, 2, 7, 3, 14], np.int32)
    ref = _run(peaked, ids, lens, rng, 0, eos_ids=eos, pad_id=-1, max_lengths=caps, **kw)
    lengths = ref.lengths_B
    # the running rows fit 6, then 3, then 2 rows before the last one ends
    assert len(set(lengths.tolist())) >= 6 and (lengths > 9).sum() == 2, lengths
    settings = SamplingSettings(**kw, eos_ids=eos, pad_id=-1, group_size=G, shed=3)
    out, steps = sampler.generate_split(
        graphdef, state, ids, lens, rng, caps, settings=settings, with_iterations=True
    )
    _assert_same(jax.tree.map(np.asarray, out), ref)
    assert int(steps) == lengths.max() - 1
    assert decode.shed_levels(12, 3) == (12, 6, 3, 2) and decode.shed_levels(32, 2) == (32, 16, 8)
    # The host count of the row-steps: the static batch runs all 12 rows to the longest.
    assert sampler.decode_slots(lengths, max_new_tokens=N) == 12 * lengths.max()
    shed_slots = sampler.decode_slots(lengths, max_new_tokens=N, shed=3)
    by_hand = 12 + sum(
        next(k for k in (2, 3, 6, 12) if k >= (lengths > t).sum()) for t in range(1, lengths.max())
    )
    assert shed_slots == by_hand < 12 * lengths.max()


def test_shedding_compiles_once_and_is_off_for_slots():
    """One program per shed setting, reused for new prompts and keys; with decode slots the
    setting is dropped (continuous batching already frees finished rows): the shed=0 program
    runs."""
    model = _model(12.0, norm=3.0)
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    caps = np.array([1, 8, 3, 2, 8, 5, 2, 2, 7, 1, 4, 2], np.int32)
    kw = dict(max_new_tokens=8, temperature=1.0, pad_id=-1)
    _run(model, ids, lens, jax.random.key(0), 0, shed=2, max_lengths=caps, **kw)
    size = sampler.generate_split._cache_size()
    for seed in (1, 2):
        settings = SamplingSettings(group_size=G, shed=2, **kw)
        sampler.generate(
            model,
            ids[::-1].copy(),
            lens[::-1].copy(),
            settings,
            rng=jax.random.key(seed),
            max_lengths=caps,
        )
    assert sampler.generate_split._cache_size() == size
    with pytest.raises(ValueError, match="shed must be >= 0"):
        SamplingSettings(max_new_tokens=4, shed=-1)
    _run(model, ids, lens, jax.random.key(0), 5, max_lengths=caps, **kw)
    _run(model, ids, lens, jax.random.key(0), 5, shed=2, max_lengths=caps, **kw)
    assert sampler.generate_split._cache_size() == size + 1
