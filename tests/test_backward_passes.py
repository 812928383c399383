"""The hand-written backward passes (dense attention, SwiGLU, RMSNorm, the gated MLP's output):
values and gradients against float64 references and autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax.models import attention as kernels
from gvpo_jax.models.transformer import glu_down, rms_norm, swiglu

B, K, G, T, H = 2, 2, 3, 5, 4


def _inputs(seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, K, G * T, H)).astype(dtype)
    k = rng.normal(size=(B, K, T, H)).astype(dtype)
    v = rng.normal(size=(B, K, T, H)).astype(dtype)
    # Causal, row 1 has two padding keys at the front (left padding): its first two queries
    # see no key at all (fully masked rows stay finite and attend uniformly).
    valid = np.ones((B, T), bool)
    valid[1, :2] = False
    mask = valid[:, None, :] & (np.arange(T)[None, :] <= np.arange(T)[:, None])[None]
    return q, k, v, mask


def _attention_np(q, k, v, mask):
    """Independent float64 reference: per (b, kv head, query head g, t) softmax over keys."""
    out = np.zeros_like(q)
    for b in range(B):
        for kh in range(K):
            for row in range(G * T):
                t = row % T  # rows are head-major: g * T + t
                s = q[b, kh, row] @ k[b, kh].T / np.sqrt(H)
                s = np.where(mask[b, t], s, kernels.MASKED)
                w = np.exp(s - s.max())
                out[b, kh, row] = (w / w.sum()) @ v[b, kh]
    return out


def _loss_np(q, k, v, mask, cot):
    return float(np.sum(_attention_np(q, k, v, mask) * cot))


def test_attention_matches_float64_reference():
    q, k, v, mask = _inputs(0)
    with jax.enable_x64(True):
        out = np.asarray(kernels.dense(q, k, v, jnp.asarray(mask)))
    np.testing.assert_allclose(out, _attention_np(q, k, v, mask), rtol=0, atol=1e-12)


def test_attention_gradients_match_finite_differences_float64():
    q, k, v, mask = _inputs(1)
    cot = np.random.default_rng(2).normal(size=q.shape)
    with jax.enable_x64(True):
        loss = lambda q, k, v: jnp.sum(kernels.dense(q, k, v, jnp.asarray(mask)) * cot)
        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    eps = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads, strict=True)):
        rng = np.random.default_rng(10 + which)
        for idx in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(12)]:
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd = (_loss_np(*plus, mask, cot) - _loss_np(*minus, mask, cot)) / (2 * eps)
            assert abs(float(np.asarray(g)[idx]) - fd) < 1e-7, (which, idx)


def test_attention_gradients_equal_autodiff_of_the_plain_formula():
    """Every entry of dq, dk, dv (incl. fully masked padding rows) equals JAX's autodiff of the
    same masked softmax written plainly, in float64."""
    q, k, v, mask = _inputs(3)
    cot = np.random.default_rng(4).normal(size=q.shape)

    def plain(q, k, v):
        s = jnp.einsum("bkqh,bksh->bkqs", q, k) / np.sqrt(H)
        m = jnp.broadcast_to(mask[:, None, None], (B, K, G, T, T)).reshape(B, K, G * T, T)
        p = jax.nn.softmax(jnp.where(m, s, kernels.MASKED), axis=-1)
        return jnp.einsum("bkqs,bksh->bkqh", p, v)

    with jax.enable_x64(True):
        ours = jax.grad(lambda *a: jnp.sum(kernels.dense(*a, mask) * cot), (0, 1, 2))(q, k, v)
        ref = jax.grad(lambda *a: jnp.sum(plain(*a) * cot), (0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-12)


def test_attention_keeps_bf16_inputs_in_bf16_and_close_to_fp32():
    q, k, v, mask = _inputs(5, np.float32)
    cot = np.random.default_rng(6).normal(size=q.shape).astype(np.float32)
    loss = lambda *a: jnp.sum(kernels.dense(*a, mask).astype(jnp.float32) * cot)
    g32 = jax.grad(loss, (0, 1, 2))(q, k, v)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    assert kernels.dense(*bf, mask).dtype == jnp.bfloat16
    g16 = jax.grad(loss, (0, 1, 2))(*bf)
    for a, b in zip(g16, g32, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_swiglu_value_and_gradients_match_float64_reference(dtype):
    rng = np.random.default_rng(7)
    gate, up, d = (rng.normal(scale=3.0, size=(4, 6)) for _ in range(3))
    sig = 1.0 / (1.0 + np.exp(-gate))
    ref_out = gate * sig * up
    ref_dgate = d * up * (sig + gate * sig * (1.0 - sig))  # d/dx x*sigmoid(x), written out
    ref_dup = d * gate * sig
    with jax.enable_x64(dtype == np.float64):
        g, u = jnp.asarray(gate, dtype), jnp.asarray(up, dtype)
        out, vjp = jax.vjp(swiglu, g, u)
        dgate, dup = vjp(jnp.asarray(d, dtype))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(dgate), ref_dgate, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(dup), ref_dup, rtol=tol, atol=tol)
    if dtype == np.float64:  # and the derivative by central differences
        eps = 1e-6
        loss = lambda g_, u_: float(np.sum(g_ / (1 + np.exp(-g_)) * u_ * d))
        fd = (loss(gate + eps, up) - loss(gate - eps, up)) / (2 * eps)
        assert abs(float(np.sum(dgate)) - fd) < 1e-6


def _rms_norm_plain(x, scale, eps, offset, compute_dtype):
    """The norm written plainly (autodiff differentiates it): what `rms_norm` must equal."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    n = x.astype(acc) * jax.lax.rsqrt(jnp.mean(x.astype(acc) ** 2, -1, keepdims=True) + eps)
    if offset:
        return (n * (1.0 + scale.astype(acc))).astype(x.dtype)
    return scale.astype(compute_dtype) * n.astype(x.dtype)


@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma3"])
def test_rms_norm_gradients_match_finite_differences_float64(offset):
    rng = np.random.default_rng(8)
    x, cot = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 6))
    scale, eps = rng.normal(size=6), 1e-5

    def ref(x, scale):  # numpy, float64
        n = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
        return float(np.sum(n * ((1.0 + scale) if offset else scale) * cot))

    with jax.enable_x64(True):
        loss = lambda x, s: jnp.sum(rms_norm(x, s, eps, offset, jnp.dtype("float64")) * cot)
        value, (dx, dscale) = jax.value_and_grad(loss, (0, 1))(x, scale)
    assert abs(float(value) - ref(x, scale)) < 1e-12
    h = 1e-6
    for idx in [(0, 0, 0), (1, 2, 5), (0, 1, 3), (1, 0, 2)]:
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        assert abs(float(dx[idx]) - (ref(plus, scale) - ref(minus, scale)) / (2 * h)) < 1e-7
    for j in range(6):
        plus, minus = scale.copy(), scale.copy()
        plus[j] += h
        minus[j] -= h
        assert abs(float(dscale[j]) - (ref(x, plus) - ref(x, minus)) / (2 * h)) < 1e-7


@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_equals_autodiff_of_the_plain_norm(offset, dtype):
    """Values and both gradients as autodiff gives them for the plain formula, casts included
    (bf16 activations with an fp32 scale: a bf16 model's masters)."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(3, 5, 16)), dtype)
    scale = jnp.asarray(rng.normal(size=16), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
    args = (1e-6, offset, jnp.dtype(dtype))
    outs = []
    for norm in (rms_norm, _rms_norm_plain):
        loss = lambda x, s, norm=norm: jnp.sum(norm(x, s, *args).astype(jnp.float32) * cot)
        outs.append((norm(x, scale, *args), *jax.grad(loss, (0, 1))(x, scale)))
    tol = 1e-5 if dtype == "float32" else 2e-2
    for got, want in zip(*outs, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
def test_glu_down_value_and_gradients_equal_autodiff_float64(gelu):
    """act(gate) * up @ down with the activation recomputed in the backward pass: values and
    the three gradients equal autodiff of the plain product in float64."""
    rng = np.random.default_rng(10)
    gate, up = rng.normal(scale=2.0, size=(6, 8)), rng.normal(size=(6, 8))
    down, cot = rng.normal(size=(8, 5)), rng.normal(size=(6, 5))

    def plain(g, u, w):
        act = jax.nn.gelu(g, approximate=True) if gelu else g * jax.nn.sigmoid(g)
        return (act * u) @ w

    with jax.enable_x64(True):
        outs = []
        for f in (lambda g, u, w: glu_down(g, u, w, gelu, (2, 3)), plain):
            loss = lambda g, u, w, f=f: jnp.sum(f(g, u, w) * cot)
            outs.append((f(gate, up, down), *jax.grad(loss, (0, 1, 2))(gate, up, down)))
    for got, want in zip(*outs, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_glu_down_keeps_bf16_in_bf16():
    rng = np.random.default_rng(11)
    g, u = (jnp.asarray(rng.normal(size=(4, 8)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(8, 3)), jnp.bfloat16)
    out, vjp = jax.vjp(lambda *a: glu_down(*a, False, (2, 2)), g, u, w)
    assert out.dtype == jnp.bfloat16
    assert [d.dtype for d in vjp(jnp.ones_like(out))] == [jnp.bfloat16] * 3
