"""Sampler tests: HF greedy parity, exact sampling distributions, log-probs, EOS, no recompiles."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
import transformers
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from gvpo_jax import decode, models, sampler, sampling_ops
from gvpo_jax.models.cache import layer as layer_cache
from gvpo_jax.sampler import SamplingSettings

VOCAB = 300  # > 256, not a multiple of it: exercises both levels and the padding of `draw`
P_VALUE = 1e-3  # chi-square tests reject the sampler's distribution below this p-value


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    """A tiny random Qwen2 in transformers and the same weights in gvpo_jax."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # Larger than the default 0.02 so logits are spread out: greedy has clear winners and
        # the sampling distributions are far from uniform.
        initializer_range=0.1,
    )
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen2_tiny")
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path)


PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13], [99], [250, 3, 4, 4, 4, 60, 61, 62, 63, 1, 2]]


def _hf_greedy(hf, prompt, max_new_tokens, eos_id):
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_pad_prompts_and_bucket_length():
    assert sampler.bucket_length(1, (8, 16)) == 8
    assert sampler.bucket_length(8, (16, 8)) == 8
    assert sampler.bucket_length(9, (8, 16)) == 16
    with pytest.raises(ValueError, match="largest bucket"):
        sampler.bucket_length(17, (8, 16))
    ids, lens = sampler.pad_prompts([[1, 2, 3], [4] * 9], (8, 16, 32), pad_id=7)
    assert ids.shape == (2, 16) and ids.dtype == np.int32
    np.testing.assert_array_equal(lens, [3, 9])
    np.testing.assert_array_equal(ids[0], [1, 2, 3] + [7] * 13)
    np.testing.assert_array_equal(ids[1], [4] * 9 + [7] * 7)
    with pytest.raises(ValueError, match=">= 1 token"):
        sampler.pad_prompts([[1], []], (8,))


def test_invalid_settings_raise_and_equal_settings_are_canonical():
    for bad in (
        dict(max_new_tokens=0),
        dict(max_new_tokens=4, temperature=-1.0),
        dict(max_new_tokens=4, top_k=-1),
        dict(max_new_tokens=4, top_p=0.0),
        dict(max_new_tokens=4, min_p=1.0),
        dict(max_new_tokens=4, group_size=0),
    ):
        with pytest.raises(ValueError, match=next(iter(bad.keys() - {"max_new_tokens"}), "max_")):
            SamplingSettings(**bad)

    def canonical(**kw):
        return sampler.canonical_settings(SamplingSettings(**kw), rows=1)

    a = canonical(max_new_tokens=4, temperature=1, eos_ids=[3, 1, 3])
    b = canonical(max_new_tokens=4.0, temperature=1.0, eos_ids=(1, 3))
    assert a == b and hash(a) == hash(b)
    assert canonical(max_new_tokens=4, temperature=0, top_k=5) == (
        canonical(max_new_tokens=4, temperature=0.0)
    )


def test_greedy_matches_transformers_generate(hf_and_model):
    hf, model = hf_and_model
    n = 40  # 39 new-token slots: two decode segments (20 + 19), the cache grows in between
    assert len(decode.decode_segments(n - 1)) == 2
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    greedy = SamplingSettings(max_new_tokens=n, temperature=0.0)
    out = sampler.generate(model, ids, lens, greedy, rng=jax.random.key(0))
    expected = [_hf_greedy(hf, p, n, None) for p in PROMPTS]
    np.testing.assert_array_equal(np.asarray(out.tokens_BxN), expected)
    np.testing.assert_array_equal(np.asarray(out.lengths_B), [n] * len(PROMPTS))

    # With an EOS: take a token greedy emits mid-way in row 0; rows stop at its first occurrence.
    eos = expected[0][4]
    out = sampler.generate(
        model,
        ids,
        lens,
        SamplingSettings(max_new_tokens=n, temperature=0.0, eos_ids=[eos]),
        rng=jax.random.key(0),
    )
    for row, prompt in enumerate(PROMPTS):
        ref = _hf_greedy(hf, prompt, n, eos)  # transformers stops after the EOS it emits
        got = np.asarray(out.tokens_BxN[row])
        assert int(out.lengths_B[row]) == len(ref)
        np.testing.assert_array_equal(got[: len(ref)], ref)
        assert np.all(got[len(ref) :] == 0)


def test_bf16_greedy_matches_transformers_in_bf16(hf_and_model):
    """bf16 compute (fp32 masters cast in the graph, bf16 KV cache): greedy tokens equal
    transformers' bf16 greedy where no step is a near tie, and the log-probs stay fp32."""
    hf, model = hf_and_model
    model16 = models.with_compute_dtype(model, jnp.bfloat16)
    n = 12
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    greedy = SamplingSettings(max_new_tokens=n, temperature=0.0)
    out = sampler.generate(model16, ids, lens, greedy, rng=jax.random.key(0))
    assert out.logp_BxN.dtype == jnp.float32
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)  # the fixture's fp32 model stays intact
    expected = [_hf_greedy(hf16, p, n, None) for p in PROMPTS]
    # Greedy paths may part at a near tie, where bf16 rounding (ours or torch's) decides. Each
    # row is compared up to its first step whose best-vs-second logit gap is under twice that
    # step's largest bf16-vs-fp32 logit difference; most of the tokens must be compared.
    got, compared = np.asarray(out.tokens_BxN), 0
    seqs = [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    width = max(map(len, seqs))
    batch = jnp.asarray([x + [0] * (width - len(x)) for x in seqs])  # right pads: causal, unseen
    forward = jax.jit(lambda m, x: m(x))
    logits32, logits16 = np.asarray(forward(model, batch)), np.asarray(forward(model16, batch))
    for row, prompt in enumerate(PROMPTS):
        path = slice(len(prompt) - 1, len(seqs[row]) - 1)
        logits = logits32[row, path]
        noise = np.abs(logits16[row, path] - logits).max(-1)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * noise
        k = n if clear.all() else int(np.argmin(clear))
        np.testing.assert_array_equal(got[row, :k], expected[row][:k], err_msg=f"row {row}")
        compared += k
    assert compared >= n * len(PROMPTS) // 2, compared
    # The bf16 cache really is bf16 (half the memory of the fp32 one).
    cache = model16.init_cache(1, 4)
    assert layer_cache(cache, 0).k.dtype == jnp.bfloat16


def _reference_dist(logits_V, temperature, top_k, top_p, min_p):
    """float64 numpy: temperature -> top-k -> top-p -> min-p, each renormalised (HF order)."""
    z = logits_V.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    if top_p < 1.0:
        sorted_p = p[order]
        mass_before = np.cumsum(sorted_p) - sorted_p
        p[order[mass_before >= top_p]] = 0.0
        p /= p.sum()
    if min_p > 0.0:
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def _chi_square_pvalue(counts, probs):
    """Pearson chi-square p-value; bins with expected count < 5 are pooled into one bin."""
    expected = probs * counts.sum()
    assert np.all(counts[probs == 0] == 0), "sampled a token outside the support"
    small = (expected < 5) & (probs > 0)
    obs = np.append(counts[expected >= 5], counts[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    if exp[-1] < 5:  # fold a still-too-small pool into the smallest regular bin
        i = np.argmin(exp[:-1])
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


SAMPLING_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=12, top_p=0.8),  # top-k candidates, sorted nucleus
    dict(temperature=1.3, top_p=0.6, min_p=0.05),  # full-vocabulary bisection nucleus
]


@pytest.mark.parametrize("num_slots", [0, 1500], ids=["static", "continuous"])
@pytest.mark.parametrize("settings", SAMPLING_CASES, ids=lambda s: str(sorted(s.items())))
def test_first_and_second_token_distributions(hf_and_model, settings, num_slots):
    """Empirical frequencies of tokens 1 and 2 over 6000 draws match the exact distributions,
    for the static batch and for 1500 continuous-batching slots (4 refills of every slot)."""
    _, model = hf_and_model
    prompt = [5, 17, 42]
    g = 6000
    ids, lens = sampler.pad_prompts([prompt], (8,))
    sampling = SamplingSettings(max_new_tokens=2, group_size=g, num_slots=num_slots, **settings)
    out = sampler.generate(model, ids, lens, sampling, rng=jax.random.key(3))
    tokens = np.asarray(out.tokens_BxN)
    ref = dict(settings, top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0))
    ref.setdefault("min_p", 0.0)

    # Exact first-token distribution q1, and q2[y1] for every possible first token y1.
    seqs = np.array([prompt + [y] for y in range(VOCAB)], np.int32)
    logits = np.asarray(model(jnp.asarray(seqs)), np.float64)
    q1 = _reference_dist(logits[0, len(prompt) - 1], **ref)
    q2 = np.stack([_reference_dist(logits[y, len(prompt)], **ref) for y in range(VOCAB)])

    assert np.all(q1[tokens[:, 0]] > 0), "first token outside the truncated set"
    assert np.all(q2[tokens[:, 0], tokens[:, 1]] > 0), "second token outside the truncated set"
    counts1 = np.bincount(tokens[:, 0], minlength=VOCAB)
    counts2 = np.bincount(tokens[:, 1], minlength=VOCAB)
    assert _chi_square_pvalue(counts1, q1) > P_VALUE
    assert _chi_square_pvalue(counts2, q1 @ q2) > P_VALUE  # marginal of the second token


# On these logits the 64 most likely tokens hold 47% of the mass at T=1.3 (top-p 0.6 takes the
# bisection branch of `_nucleus_threshold`) and 97% at T=0.5 (top-p 0.9 reads the top 64).
OPS_LOGITS_V = np.random.default_rng(0).normal(size=1000).astype(np.float32) * 2.0
MIN_P_CASE = dict(temperature=1.0, min_p=0.1)  # min-p alone, cutting most of the vocabulary
OPS_CASES = [*SAMPLING_CASES, dict(temperature=0.5, top_p=0.9), MIN_P_CASE]


def test_ops_cases_cover_both_nucleus_branches():
    def top64_mass(temperature):
        q = _reference_dist(OPS_LOGITS_V, temperature, 0, 1.0, 0.0)
        return np.sort(q)[::-1][:64].sum()

    assert top64_mass(1.3) < 0.6 and top64_mass(0.5) > 0.9


def test_min_p_case_cuts_tokens():
    """In MIN_P_CASE min-p removes tokens holding much of the mass, so a sampler that ignored
    min_p would draw outside the support in `test_select_tokens_distribution_and_logps`."""
    kept = _reference_dist(OPS_LOGITS_V, 1.0, 0, 1.0, MIN_P_CASE["min_p"])
    full = _reference_dist(OPS_LOGITS_V, 1.0, 0, 1.0, 0.0)
    assert 0 < np.sum(kept > 0) < 100
    assert full[kept == 0].sum() > 0.3  # 20000 draws hit the cut tokens thousands of times


@pytest.mark.parametrize("settings", OPS_CASES, ids=lambda s: str(sorted(s.items())))
def test_select_tokens_distribution_and_logps(settings):
    """Token selection alone on fixed logits: 20000 draws, chi-square, and both log-probs."""
    logits_V = OPS_LOGITS_V  # 1000 tokens: 4 blocks of the 2-level draw
    b = 20000
    logits_BxV = jnp.broadcast_to(jnp.asarray(logits_V), (b, 1000))
    tokens, logp, sample_logp = jax.jit(lambda x, k: sampling_ops.select_tokens(x, k, **settings))(
        logits_BxV, jax.random.key(1)
    )
    tokens = np.asarray(tokens)
    ref = dict(settings, top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0))
    ref.setdefault("min_p", 0.0)
    q = _reference_dist(logits_V, **ref)
    assert _chi_square_pvalue(np.bincount(tokens, minlength=1000), q) > P_VALUE
    policy = logits_V.astype(np.float64) - np.log(np.sum(np.exp(logits_V.astype(np.float64))))
    np.testing.assert_allclose(np.asarray(logp), policy[tokens], atol=1e-5)
    np.testing.assert_allclose(np.asarray(sample_logp), np.log(q[tokens]), atol=1e-5)


def test_draw_never_picks_zero_weight_entries():
    """Inverse-CDF edges: u -> 1 and zero-weight tails/blocks are never selected."""
    w = np.zeros((4, 700), np.float32)
    w[:, [3, 300, 301]] = [0.2, 0.5, 0.3]  # two whole blocks of zeros, zero tail
    u = jnp.asarray([[0.0, 0.0], [1 - 2**-24, 1 - 2**-24], [0.2, 0.999], [0.7, 0.4]])
    picks = np.asarray(sampling_ops.draw(jnp.asarray(w), u))
    assert set(picks.tolist()) <= {3, 300, 301}
    assert picks[0] == 3 and picks[1] == 301


def _recomputed_logp(model, ids, lens, out, group_size):
    """log pi(response token) by a full forward (no cache) of prompt + response, per row."""
    b, n = out.tokens_BxN.shape
    lens_B = np.repeat(lens, group_size)
    seqs = np.zeros((b, ids.shape[1] + n), np.int32)
    for row in range(b):
        prompt = ids[row // group_size, : lens_B[row]]
        seqs[row, : lens_B[row] + n] = np.concatenate([prompt, np.asarray(out.tokens_BxN[row])])
    seqs = np.where(seqs < 0, 0, seqs)
    logits = np.asarray(model(jnp.asarray(seqs)), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    idx = lens_B[:, None] + np.arange(n)[None, :]  # position of response token j
    rows = np.arange(b)[:, None]
    return logp[rows, idx - 1, seqs[rows, idx]], logits, idx


def test_decode_segments_cover_the_slots():
    assert decode.decode_segments(4) == (4,)  # short answers: one loop
    assert decode.decode_segments(127) == (32, 64, 96, 127)
    assert decode.decode_segments(39) == (20, 39)
    for slots in range(1, 300):
        sizes = decode.decode_segments(slots)
        assert sizes[-1] == slots and list(sizes) == sorted(set(sizes)) and len(sizes) <= 4


def test_returned_logps_equal_recomputed(hf_and_model):
    _, model = hf_and_model
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    settings = dict(temperature=0.8, top_k=20, top_p=0.9)
    g = 3
    out = sampler.generate(
        model,
        ids,
        lens,
        SamplingSettings(
            max_new_tokens=36,  # two decode segments
            group_size=g,
            eos_ids=(3, 4),
            **settings,
        ),
        rng=jax.random.key(7),
    )
    mask = np.asarray(out.mask_BxN) > 0
    expected, logits, idx = _recomputed_logp(model, ids, lens, out, g)
    np.testing.assert_allclose(np.asarray(out.logp_BxN)[mask], expected[mask], atol=1e-5)
    assert np.all(np.asarray(out.logp_BxN)[~mask] == 0)
    # The sampling-distribution log-prob, from an independent float64 truncation.
    tokens = np.asarray(out.tokens_BxN)
    for row, col in zip(*np.nonzero(mask), strict=True):
        q = _reference_dist(logits[row, idx[row, col] - 1], 0.8, 20, 0.9, 0.0)
        assert abs(np.log(q[tokens[row, col]]) - out.sample_logp_BxN[row, col]) < 1e-5


def test_eos_mask_lengths_and_padding(hf_and_model):
    """Rows stop at their first EOS (any of several), then hold pad_id with mask 0."""
    _, model = hf_and_model
    n = 10
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    kw = dict(max_new_tokens=n, temperature=0.0)
    key = jax.random.key(0)
    free = np.asarray(
        sampler.generate(model, ids, lens, SamplingSettings(**kw), rng=key).tokens_BxN
    )
    eos_ids = (int(free[0, 2]), int(free[1, 0]))  # row 0 ends by step 3, row 1 at step 1
    settings = SamplingSettings(eos_ids=eos_ids, pad_id=-1, **kw)
    out = sampler.generate(model, ids, lens, settings, rng=key)
    tokens, mask = np.asarray(out.tokens_BxN), np.asarray(out.mask_BxN)
    assert mask.dtype == np.float32 and out.lengths_B.dtype == np.int32
    for row in range(len(PROMPTS)):
        hits = np.nonzero(np.isin(free[row], eos_ids))[0]
        length = hits[0] + 1 if hits.size else n
        assert int(out.lengths_B[row]) == length
        np.testing.assert_array_equal(mask[row], np.arange(n) < length)
        np.testing.assert_array_equal(tokens[row, :length], free[row, :length])
        assert np.all(tokens[row, length:] == -1)
        assert np.all(np.asarray(out.logp_BxN)[row, length:] == 0)
    assert out.lengths_B[0] <= 3 and out.lengths_B[1] == 1 and out.lengths_B.max() > 3

    # Every row ends at its first token: the loop exits early and all later columns are padding.
    first = tuple(int(t) for t in free[:, 0])
    settings = SamplingSettings(eos_ids=first, pad_id=-1, **kw)
    out = sampler.generate(model, ids, lens, settings, rng=key)
    np.testing.assert_array_equal(np.asarray(out.lengths_B), [1] * len(PROMPTS))
    assert np.all(np.asarray(out.tokens_BxN)[:, 1:] == -1)


def test_group_samples_share_the_prompt(hf_and_model):
    """G samples differ when sampling and equal the G=1 greedy rows when greedy."""
    _, model = hf_and_model
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    g, key = 4, jax.random.key(5)

    def generate(ids, lens, **kw):
        return sampler.generate(model, ids, lens, SamplingSettings(max_new_tokens=8, **kw), rng=key)

    greedy1 = np.asarray(generate(ids, lens, temperature=0.0).tokens_BxN)
    greedy = np.asarray(generate(ids, lens, temperature=0.0, group_size=g).tokens_BxN)
    np.testing.assert_array_equal(greedy, np.repeat(greedy1, g, axis=0))

    sampled = generate(ids, lens, group_size=g)
    groups = np.asarray(sampled.tokens_BxN).reshape(len(PROMPTS), g, -1)
    for group in groups:
        assert len({tuple(r) for r in group}) == g
    # Sharing the prefill is invisible: same draws as prefilling G copies of every prompt.
    copies = generate(np.repeat(ids, g, 0), np.repeat(lens, g))
    np.testing.assert_array_equal(np.asarray(copies.tokens_BxN), np.asarray(sampled.tokens_BxN))
    np.testing.assert_allclose(copies.logp_BxN, sampled.logp_BxN, atol=1e-5)


# Every compilation starts by lowering to MLIR, also when the persistent compilation cache then
# supplies the executable (the suite runs with one), so lowerings count compilations.
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def test_no_recompilation_with_same_bucket(hf_and_model):
    _, model = hf_and_model
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event)

    def call(prompts, seed):
        ids, lens = sampler.pad_prompts(prompts, (8, 16))
        settings = SamplingSettings(max_new_tokens=5, top_k=7, group_size=2)
        out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(seed))
        return jax.block_until_ready(out)

    call([[1, 2], [3, 4, 5]], 0)  # compiles (or reuses an earlier compile)
    old_embedding = model.embedding[...]
    new_embedding = old_embedding * 1.01  # eager op: compiled before the counting starts
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        compiles.clear()
        call([[9, 8, 7, 6, 5], [4]], 1)  # other prompts and lengths, same bucket, other key
        # New parameter values of the same shapes (a training step) must not retrace either.
        model.embedding[...] = new_embedding
        call([[2, 2], [2]], 2)
        n_same = sum(e == LOWERING for e in compiles)
        call([[1] * 12, [2]], 3)  # another bucket compiles once: the counter does count
        n_new = sum(e == LOWERING for e in compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        model.embedding[...] = old_embedding
    assert n_same == 0
    assert n_new >= 1


def test_generate_on_a_mesh_matches_one_device(hf_and_model):
    """Prompts split over `data`, parameters over `model`: same greedy output as unsharded."""
    _, model = hf_and_model
    ids, lens = sampler.pad_prompts(PROMPTS, (16,))
    kw = dict(
        settings=SamplingSettings(max_new_tokens=6, temperature=0.0, group_size=2),
        rng=jax.random.key(0),
    )
    ref = sampler.generate(model, ids, lens, **kw)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    graphdef, state = nnx.split(model)

    def place(x):
        spec = PS(*([None] * (x.ndim - 1)), "model") if x.ndim and x.shape[-1] % 2 == 0 else PS()
        return jax.device_put(x, NamedSharding(mesh, spec))

    sharded = nnx.merge(graphdef, jax.tree.map(place, state))
    data = NamedSharding(mesh, PS("data"))
    out = sampler.generate(sharded, jax.device_put(ids, data), jax.device_put(lens, data), **kw)
    assert len(out.tokens_BxN.sharding.device_set) > 1
    np.testing.assert_array_equal(np.asarray(out.tokens_BxN), np.asarray(ref.tokens_BxN))
    np.testing.assert_allclose(np.asarray(out.logp_BxN), np.asarray(ref.logp_BxN), atol=1e-5)
