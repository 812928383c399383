"""models.attention: the blocked kernel against float64 references and finite differences; dense,
blocked, xla and splash (Pallas interpret mode) through the model, the sampler and the update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from gvpo_jax import models, sampler
from gvpo_jax.models import attention as kernels

KERNELS = ("blocked", "xla", "splash")


def _reference(q, k, v, q_slot, k_slot, k_valid, window=None):
    """float64 numpy: softmax over visible keys (masked scores at kernels.MASKED, as dense);
    with a window W, a key is visible only within W - 1 slots before the query."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bkqh,bksh->bkqs", q, k) / np.sqrt(q.shape[-1])
    gap = np.asarray(q_slot)[:, :, None].astype(np.int64) - np.asarray(k_slot)[:, None, :]
    near = gap < window if window is not None else True
    seen = (np.asarray(k_valid)[:, None, :] & (gap >= 0) & near)[:, None]
    s = np.where(seen, s, kernels.MASKED)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    out = np.einsum("bkqs,bksh->bkqh", e / e.sum(-1, keepdims=True), v)
    return out, (m + np.log(e.sum(-1, keepdims=True)))[..., 0]


def _case(seed, b=2, kv=2, t=23, g=3, s=23, h=8, offset=0, dtype=np.float64):
    """Random q/k/v, causal slots (query slot offset + t, rows position-major x G heads),
    ragged key validity: row 0 left-padded by 4, row 1 right-padded after 17 keys."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, kv, t * g, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, kv, s, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, kv, s, h)), dtype)
    q_slot = jnp.asarray(np.repeat(offset + np.arange(t), g)[None].repeat(b, 0), jnp.int32)
    k_slot = jnp.asarray(np.arange(s)[None].repeat(b, 0), jnp.int32)
    valid = np.ones((b, s), bool)
    valid[0, :4] = False
    valid[1 % b, 17:] = False
    return q, k, v, q_slot, k_slot, jnp.asarray(valid)


def _rows_with_a_visible_key(q_slot, k_slot, k_valid, window=None):
    gap = np.asarray(q_slot)[:, :, None].astype(np.int64) - np.asarray(k_slot)[:, None, :]
    seen = np.asarray(k_valid)[:, None, :] & (gap >= 0) & (gap < (window or np.inf))
    return seen.any(-1)[:, None, :]  # [B, 1, Q]


@pytest.mark.parametrize("blocks", [(8, 8), (16, 5), (512, 512), (9, 64)])
@pytest.mark.parametrize("offset", [0, 6])
def test_blocked_values_and_lse_match_float64_reference(blocks, offset):
    """Blocks that do and do not divide Q and S; a query offset (prefill into a partly filled
    cache: S = offset + T keys). Rows with no visible key are padding and left out."""
    with jax.enable_x64(True):
        args = _case(0, s=23 + offset, offset=offset)
        out, lse = kernels.blocked(*args, *blocks)
        ref_out, ref_lse = _reference(*args)
        rows = _rows_with_a_visible_key(*args[3:])
        np.testing.assert_allclose(np.where(rows[..., None], out, 0),
                                   np.where(rows[..., None], ref_out, 0), atol=1e-12)  # fmt: skip
        np.testing.assert_allclose(np.where(rows, lse, 0), np.where(rows, ref_lse, 0), atol=1e-12)


@pytest.mark.parametrize("blocks", [(8, 8), (16, 5), (9, 64)])
@pytest.mark.parametrize("window", [1, 4, 11])
def test_blocked_sliding_window_matches_float64_reference_and_skips_old_blocks(blocks, window):
    """A sliding window W: values, log-denominators and gradients equal the float64 reference
    (rows with no visible key left out), and a query block visits only the key blocks that
    reach into its window (the first blocks are skipped once the queries are W past them)."""
    with jax.enable_x64(True):
        args = _case(5, t=40, s=40)
        out, lse = kernels.blocked(*args, *blocks, window)
        ref_out, ref_lse = _reference(*args, window=window)
        rows = _rows_with_a_visible_key(*args[3:], window)
        np.testing.assert_allclose(np.where(rows[..., None], out, 0),
                                   np.where(rows[..., None], ref_out, 0), atol=1e-12)  # fmt: skip
        np.testing.assert_allclose(np.where(rows, lse, 0), np.where(rows, ref_lse, 0), atol=1e-12)
        q, k, v, q_slot, k_slot, valid = args
        d_out = jnp.asarray(np.random.default_rng(6).normal(size=q.shape)) * rows[..., None]

        def loss(fn):
            return lambda q, k, v: jnp.sum(fn(q, k, v)[0] * d_out)

        def dense(q, k, v):
            s = jnp.einsum("bkqh,bksh->bkqs", q, k) / np.sqrt(q.shape[-1])
            seen = valid[:, None, :] & kernels.visible(q_slot[:, :, None], k_slot[:, None, :],
                                                       window)  # fmt: skip
            s = jnp.where(seen[:, None], s, kernels.MASKED)
            return (jnp.einsum("bkqs,bksh->bkqh", jax.nn.softmax(s, -1), v),)

        blocked = lambda q, k, v: kernels.blocked(q, k, v, q_slot, k_slot, valid, *blocks, window)
        got = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-11)
    # The block ranges: with W = 4 and 8 x 8 blocks (rows are 3 query heads per position),
    # the last query block (positions 37-39) starts at key block 4 (keys 32-39), not 0.
    _, bounds = kernels._layout(*args, 8, 8, 4)
    bq, bk, nq, nk, need_q, first_q, start_q, last_q = bounds
    if blocks == (8, 8) and window == 4:
        assert int(start_q[-1]) == 4 and int(need_q[-1]) == 5
        # Key block 0 (keys 0-7) reaches positions <= 10 only: query blocks 0-4 (of 15).
        assert int(last_q[0]) == 5 and nq == 15


def test_blocked_non_causal_rows_see_every_valid_key():
    with jax.enable_x64(True):
        q, k, v, _, k_slot, valid = _case(1)
        every = jnp.full(q.shape[::2][:1] + (q.shape[2],), kernels.NO_SLOT, jnp.int32)
        out, lse = kernels.blocked(q, k, v, every, k_slot, valid, 16, 8)
        ref_out, ref_lse = _reference(q, k, v, every, k_slot, valid)
        np.testing.assert_allclose(out, ref_out, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_blocked_gradients_match_autodiff_of_the_reference_and_finite_differences():
    """Cotangents on both outputs (out and lse: the shared-prefix merge differentiates lse)."""
    with jax.enable_x64(True):
        q, k, v, q_slot, k_slot, valid = _case(2)
        rows = jnp.asarray(_rows_with_a_visible_key(q_slot, k_slot, valid))
        rng = np.random.default_rng(3)
        d_out = jnp.asarray(rng.normal(size=q.shape)) * rows[..., None]
        d_lse = jnp.asarray(rng.normal(size=q.shape[:3])) * rows

        def dense(q, k, v):
            s = jnp.einsum("bkqh,bksh->bkqs", q, k) / np.sqrt(q.shape[-1])
            seen = (valid[:, None, :] & (k_slot[:, None, :] <= q_slot[:, :, None]))[:, None]
            s = jnp.where(seen, s, kernels.MASKED)
            return jnp.einsum("bkqs,bksh->bkqh", jax.nn.softmax(s, -1), v), jax.nn.logsumexp(s, -1)

        def loss(fn):
            def f(q, k, v):
                out, lse = fn(q, k, v)
                return jnp.sum(out * d_out) + jnp.sum(lse * d_lse)

            return f

        blocked = lambda q, k, v: kernels.blocked(q, k, v, q_slot, k_slot, valid, 16, 8)
        got = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-11)
        small = [x[:1, :1, :12] for x in (q, k, v)]
        tiny = lambda q, k, v: kernels.blocked(
            q, k, v, q_slot[:1, :12], k_slot[:1, :12], valid[:1, :12], 4, 4
        )
        check_grads(tiny, small, order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_merge_of_two_key_sets_equals_attention_over_their_union():
    with jax.enable_x64(True):
        q, k, v, _, k_slot, valid = _case(4)
        every = jnp.full((q.shape[0], q.shape[2]), kernels.NO_SLOT, jnp.int32)
        a = kernels.blocked(q, k[:, :, :10], v[:, :, :10], every, k_slot[:, :10], valid[:, :10])
        b = kernels.blocked(q, k[:, :, 10:], v[:, :, 10:], every, k_slot[:, 10:], valid[:, 10:])
        out, lse = kernels.merge(*a, *b)
        ref_out, ref_lse = _reference(q, k, v, every, k_slot, valid)
        np.testing.assert_allclose(out, ref_out, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_blocked_gradient_holds_no_score_matrix():
    """Forward + backward at T = 2048 (one head, 4 query heads per KV head): XLA's temporaries
    for the dense kernel hold [Q, S] fp32 scores (Q = 4 T), the blocked kernel's stay O(T)."""
    b, kv, g, t, h = 1, 1, 4, 2048, 64
    shapes = [jax.ShapeDtypeStruct((b, kv, t * g, h), jnp.float32)] + [
        jax.ShapeDtypeStruct((b, kv, t, h), jnp.float32)
    ] * 2
    q_slot = jnp.repeat(jnp.arange(t, dtype=jnp.int32), g)[None]
    k_slot = jnp.arange(t, dtype=jnp.int32)[None]
    valid = jnp.ones((b, t), bool)

    def temp_bytes(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    mask = (k_slot[:, None, :] <= jnp.arange(t)[None, :, None]) & valid[:, None, :]
    dense = temp_bytes(lambda q, k, v: kernels.dense(q, k, v, mask))
    blocked = temp_bytes(lambda q, k, v: kernels.blocked(q, k, v, q_slot, k_slot, valid)[0])
    scores = b * kv * g * t * t * 4
    assert dense > scores  # the dense path keeps [Q, S] fp32 weights for its backward
    assert blocked < scores / 8, (blocked, scores)
    # O(T): q/k/v-sized accumulators and a few 512 x 512 blocks
    assert blocked < 16 * b * kv * g * t * h * 4 + 8 * 512 * 512 * 4, blocked


# ----------------------------------------------------------------------------------------------
# Through the model


CFG = models.ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64)  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    return models.Transformer(CFG, rngs=nnx.Rngs(0))


def _grouped_batch(p=2, g=2, j=7, n=9, seed=0):
    """P prompts x G rows: prompt p left-padded by p + 1, ragged responses (right padding)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, size=(p * g, j + n))
    tokens[:, :j] = np.repeat(tokens[::g, :j], g, axis=0)
    mask = np.ones((p * g, j + n), bool)
    for i in range(p):
        mask[i * g : (i + 1) * g, : i + 1] = False
    mask[1, j + 5 :] = False
    mask[2, j + 3 :] = False
    return jnp.asarray(tokens), jnp.asarray(mask), j, g


def _masked_max_abs(x, mask):
    return float(jnp.max(jnp.abs(jnp.where(mask[..., None], x, 0))))


@pytest.mark.parametrize("impl", KERNELS)
def test_kernels_match_dense_through_the_model_values_and_gradients(tiny, impl):
    """Plain causal forward (ragged, left-padded), the update's shared-prefix forward and its
    gradient: values to 1e-5 and gradients to 1e-4 of the largest gradient, fp32."""
    tokens, mask, j, g = _grouped_batch()
    results = {}
    for name in ("dense", impl):
        model = models.with_config(tiny, attention=name)
        graphdef = nnx.graphdef(model)

        def run(state, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            shared = lambda m: m.hidden_shared_prefix(tokens, mask, prefix_len=j, group_size=g)
            loss = lambda s: jnp.sum(
                jnp.where(mask[..., None], shared(nnx.merge(graphdef, s)), 0.0) ** 2
            )
            return m.hidden(tokens, None, mask), shared(m), jax.grad(loss)(state)

        # Under jit: op by op, the kernels' loops dispatch every step (45 s against 5 s).
        results[name] = jax.jit(run)(nnx.state(model))
    (d_plain, d_shared, d_grad), (k_plain, k_shared, k_grad) = results["dense"], results[impl]
    assert _masked_max_abs(k_plain - d_plain, mask) < 1e-5
    assert _masked_max_abs(k_shared - d_shared, mask) < 1e-5
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(d_grad))
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(k_grad), jax.tree.leaves(d_grad), strict=True))  # fmt: skip
    assert err < 1e-4 * scale, (err, scale)


def test_blocked_kernel_really_runs_in_the_model(tiny, monkeypatch):
    """The switch reaches the kernels: blocked calls for the prefill-style forward (one per
    layer traced: once for the scanned layers, which trace one body) and two per layer for the
    shared-prefix forward (prompt part + own part)."""
    calls = []
    real = kernels.blocked

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "blocked", spy)
    tokens, mask, j, g = _grouped_batch()

    def trace(model, f):  # calls happen at trace time: shapes only, nothing runs
        graphdef = nnx.graphdef(model)
        jax.eval_shape(lambda s: f(nnx.merge(graphdef, s)), nnx.state(model))

    model = models.with_config(tiny, attention="blocked")
    traced = 1 if CFG.scan_layers else CFG.num_layers  # layer bodies traced
    trace(model, lambda m: m.hidden(tokens, None, mask))
    assert len(calls) == traced
    calls.clear()
    trace(model, lambda m: m.hidden_shared_prefix(tokens, mask, prefix_len=j, group_size=g))
    # prompts: one causal pass per layer; responses: prompt part + own part per layer
    assert len(calls) == 3 * traced
    calls.clear()
    trace(models.with_config(tiny, attention="dense"), lambda m: m.hidden(tokens, None, mask))
    assert not calls


@pytest.mark.parametrize("impl", ["blocked", "splash"])
def test_sampler_gives_the_same_samples_with_dense_and_kernels(tiny, impl):
    """Prefill goes through the kernel (decode steps are dense either way): the same tokens
    for the same key, log-probs to 1e-5."""
    rng = np.random.default_rng(5)
    prompts = jnp.asarray(rng.integers(3, CFG.vocab_size, size=(3, 6)), jnp.int32)
    lengths = jnp.asarray([6, 4, 2], jnp.int32)
    outs = {}
    for name in ("dense", impl):
        model = models.with_config(tiny, attention=name)
        settings = sampler.SamplingSettings(max_new_tokens=7, eos_ids=(1,), group_size=2)
        outs[name] = sampler.generate(model, prompts, lengths, settings, rng=jax.random.key(0))
    a, b = outs["dense"], outs[impl]
    np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN)
    np.testing.assert_allclose(a.logp_BxN, b.logp_BxN, atol=1e-5)


def test_auto_picks_per_platform_and_length():
    r = lambda platform, q, s: kernels.resolve("auto", q_rows=q, keys=s, platform=platform)
    assert r("tpu", 64, 64) == "splash" and r("gpu", 64, 64) == "xla"
    assert r("cpu", 64, 64) == "dense"
    assert r("cpu", 4 * 1024, 1024) == "blocked"
    assert kernels.resolve("dense", q_rows=10**6, keys=10**6) == "dense"
    with pytest.raises(ValueError, match="ModelConfig.attention='flash'"):
        CFG.replace(attention="flash")


def test_with_config_shares_the_parameters(tiny):
    other = models.with_config(tiny, attention="blocked")
    assert other.config.attention == "blocked" and tiny.config.attention == "auto"
    assert other.embedding[...] is tiny.embedding[...]
    assert models.with_config(tiny, attention="auto") is tiny


def test_update_step_same_with_dense_and_blocked():
    """One RL update of a tiny run: the same loss, and parameters within 1% of one Adam step
    (lr 3e-3; Adam's first step is about lr x sign(g), so a near-zero gradient entry's fp32
    rounding moves its parameter by a few 1e-6)."""
    from gvpo_jax.rl_step import rl_step
    from tests.test_train import make_run, toy_config

    results = {}
    for name in ("dense", "blocked"):
        run, state, loop, ref = make_run(toy_config("gvpo", **{"model.attention": name}))
        state, metrics, _, _ = rl_step(run, state, loop, ref)
        results[name] = (metrics["loss"], jax.tree.leaves(state.params))
    assert abs(results["dense"][0] - results["blocked"][0]) < 1e-5
    for a, b in zip(results["dense"][1], results["blocked"][1], strict=True):
        np.testing.assert_allclose(a, b, atol=3e-5)


@pytest.mark.parametrize("impl", ["blocked", "splash"])
def test_kernels_in_bf16_compute_agree_with_dense_bf16(tiny, impl):
    """fp32 masters computing in bf16: the kernels keep bf16 matmul operands (weights rounded
    to bf16 before the weighted sum, fp32 softmax statistics) and agree with the dense bf16 path
    to bf16 precision; gradients reach the fp32 masters finite."""
    tokens, mask, j, g = _grouped_batch()
    outs = {}
    for name in ("dense", impl):
        model = models.with_config(tiny, attention=name, compute_dtype="bfloat16")
        graphdef = nnx.graphdef(model)

        def run(state, graphdef=graphdef):
            def shared(s):
                return nnx.merge(graphdef, s).hidden_shared_prefix(
                    tokens, mask, prefix_len=j, group_size=g
                )

            loss = lambda s: jnp.sum(
                jnp.where(mask[..., None], shared(s).astype(jnp.float32), 0.0) ** 2
            )
            return shared(state), jax.grad(loss)(state)

        h, grads = jax.jit(run)(nnx.state(model))
        assert h.dtype == jnp.bfloat16
        assert all(x.dtype == jnp.float32 and bool(jnp.isfinite(x).all())
                   for x in jax.tree.leaves(grads))  # fmt: skip
        outs[name] = h.astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(outs["dense"])))
    assert _masked_max_abs(outs[impl] - outs["dense"], mask) < 3e-2 * scale
