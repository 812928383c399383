"""gvpo_jax.losses against float64 numpy references, finite differences and the SPEC invariants."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import losses

P, G, T = 3, 4, 6
B = P * G
BETA = 0.3


# ----------------------------------------------------------------------------- hand-made batch


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """3 groups of 4: ragged lengths (one fully padded row), a degenerate all-equal-reward group,
    log-ratios placed well away from every clip boundary, and garbage values on padding."""
    rng = np.random.default_rng(seed)
    lengths = np.array([6, 4, 1, 3, 5, 6, 2, 6, 3, 0, 6, 2])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    rewards = np.array([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.7])
    logp = -rng.uniform(0.1, 3.0, (B, T))
    # log(rho): inside (0.8, 1.2) / (0.8, 1.28), outside, and beyond the dual clip c = 3.
    log_ratio = rng.choice([-0.9, -0.5, -0.3, -0.1, 0.05, 0.1, 0.15, 0.3, 0.5, 1.3], (B, T))
    old_logp = logp - log_ratio
    ref_logp = logp + rng.normal(0.0, 0.4, (B, T))
    # GSPO's eps are ~3e-4: give each sequence an exact mean log-ratio c_b on either side of them.
    c_B = rng.choice([-2e-3, -5e-4, -1e-4, 1e-4, 2e-4, 6e-4, 3e-3], B)
    noise = rng.normal(0.0, 0.05, (B, T)) * mask
    noise -= mask * noise.sum(1, keepdims=True) / np.maximum(lengths, 1)[:, None]
    old_logp_gspo = logp - (c_B[:, None] + noise)
    token_adv = rng.normal(0.0, 1.0, (B, T))
    pad = mask == 0
    for x, junk in ((logp, 50.0), (old_logp, -70.0), (ref_logp, 9.0), (old_logp_gspo, -33.0)):
        x[pad] = junk  # must never reach the loss
    return dict(
        logp=logp,
        old_logp=old_logp,
        old_logp_gspo=old_logp_gspo,
        ref_logp=ref_logp,
        mask=mask,
        rewards=rewards,
        adv=np_group_advantages(rewards, G, "group"),
        token_adv=token_adv,
    )


# ----------------------------------------------------------------------------- numpy references


def np_group_advantages(r, g, scale, eps=1e-6):
    r_PxG = r.reshape(-1, g)
    a = r_PxG - r_PxG.mean(1, keepdims=True)
    if scale == "group":
        a = a / (r_PxG.std(1, ddof=1, keepdims=True) + eps)
    elif scale == "batch":
        a = a / (r.std(ddof=1) + eps)
    return a.ravel()


def np_gvpo(logp, anchor, rewards, mask, g, beta):
    """Value and d loss / d logp of GVPO, float64."""
    on = mask > 0
    seq = np.where(on, logp, 0).sum(1) - np.where(on, anchor, 0).sum(1)
    r = (beta * seq).reshape(-1, g)
    a = rewards.reshape(-1, g) - rewards.reshape(-1, g).mean(1, keepdims=True)
    d = (r - r.mean(1, keepdims=True)) - a
    n_groups = r.shape[0]
    value = np.mean([0.5 / (g - 1) * np.sum(d_g**2) for d_g in d])
    grad = mask * (beta * d.ravel() / ((g - 1) * n_groups))[:, None]
    return value, grad


def np_agg_weights(mask, agg, max_tokens=None):
    """w[b, t] such that loss = sum(w * per_token_loss)."""
    lengths = mask.sum(1)
    n_seq = np.sum(lengths > 0)
    if agg == "token-mean":
        return mask / mask.sum()
    if agg == "seq-mean-token-mean":
        return mask / (np.maximum(lengths, 1) * n_seq)[:, None]
    if agg == "seq-mean-token-sum":
        return mask / n_seq
    assert agg == "seq-mean-token-sum-norm"
    return mask / (max_tokens * n_seq)


def np_grpo(
    logp,
    old,
    adv,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.2,
    dual_clip=None,
    kl_coef=0.0,
    ref_logp=None,
    kl_estimator="k3",
    agg="seq-mean-token-mean",
    max_tokens=None,
):
    """Value and d loss / d logp of the clipped loss, float64 (test data avoid the clamps)."""
    on = mask > 0
    logp, old = np.where(on, logp, 0), np.where(on, old, 0)
    A = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    rho = np.exp(logp - old)
    plain, clipped = -A * rho, -A * np.clip(rho, 1 - eps_low, 1 + eps_high)
    l = np.maximum(plain, clipped)
    dl = np.where(plain >= clipped, -A * rho, 0.0)  # drho/dlogp = rho; the clipped branch is flat
    if dual_clip is not None:
        bounded = (A < 0) & (-A * dual_clip < l)
        l, dl = np.where(bounded, -A * dual_clip, l), np.where(bounded, 0.0, dl)
    if ref_logp is not None:
        x = logp - np.where(on, ref_logp, 0)  # log pi / pi_ref
        k3 = np.exp(-x) + x - 1
        kl, dkl = {
            "k1": (x, np.ones_like(x)),
            "k2": (0.5 * x**2, x),
            "k3": (k3, 1 - np.exp(-x)),
            "k3+": (k3, x),
        }[kl_estimator]
        l, dl = l + kl_coef * kl, dl + kl_coef * dkl
    w = np_agg_weights(mask, agg, max_tokens)
    return np.sum(w * l), w * dl


def np_gspo(logp, old, adv, mask, *, eps_low=3e-4, eps_high=4e-4, token_level=False):
    """Value and d loss / d logp of GSPO / GSPO-token, float64."""
    on = mask > 0
    lengths = mask.sum(1)
    valid = lengths > 0
    log_s = np.where(on, logp - old, 0).sum(1) / np.maximum(lengths, 1)
    s = np.exp(log_s)[:, None]
    A = adv[:, None] if adv.ndim == 1 else adv
    plain, clipped = -A * s, -A * np.clip(s, 1 - eps_low, 1 + eps_high)
    l = np.maximum(plain, clipped)
    dl_dlogs = np.where(plain >= clipped, -A * s, 0.0)
    if not token_level:  # d log s_i / d logp_t = m_t / L_i
        value = l[valid, 0].mean()
        grad = dl_dlogs * mask / np.maximum(lengths, 1)[:, None] / valid.sum()
        return value, grad
    w = np_agg_weights(mask, "seq-mean-token-mean")  # d log s_it / d logp_t' = [t == t']
    return np.sum(w * l), w * dl_dlogs


# ----------------------------------------------------------------------------- the case table

AGGS = losses.AGG_MODES
CASES = {
    "gvpo-beta0.3": ("gvpo", dict(beta=BETA)),
    "gvpo-beta2": ("gvpo", dict(beta=2.0)),
    **{f"grpo-{a}": ("grpo", dict(eps_high=0.28, agg=a, max_tokens=8)) for a in AGGS},
    **{f"grpo-kl-{e}": ("grpo", dict(kl_coef=0.1, kl_estimator=e, ref=True)) for e in ("k1", "k2")},
    **{
        f"grpo-kl-{e}": ("grpo", dict(kl_coef=0.1, kl_estimator=e, ref=True)) for e in ("k3", "k3+")
    },
    "grpo-dual-clip": ("grpo", dict(dual_clip=3.0, agg="token-mean")),
    "grpo-token-adv": ("grpo", dict(token_adv=True, agg="seq-mean-token-sum")),
    "grpo-kl-sum-norm": ("grpo", dict(kl_coef=0.5, ref=True, agg=AGGS[3], max_tokens=T)),
    "gspo": ("gspo", dict()),
    "gspo-wide-eps": ("gspo", dict(eps_low=0.05, eps_high=0.08, ratio="grpo")),
    "gspo-token": ("gspo", dict(token_level=True, token_adv=True)),
}


def case_fns(case, data):
    """(jax loss as a function of logp, numpy (value, grad) reference) for one case."""
    kind, kw = CASES[case]
    kw = dict(kw)
    adv = data["token_adv"] if kw.pop("token_adv", False) else data["adv"]
    if kind == "gvpo":
        args = (data["logp"], data["ref_logp"], data["rewards"], data["mask"])
        jfn = lambda x: losses.gvpo_loss(x, *map(jnp.asarray, args[1:]), group_size=G, **kw)[0]
        return jfn, np_gvpo(*args, G, kw["beta"])
    if kind == "grpo":
        if kw.pop("ref", False):
            kw["ref_logp"] = data["ref_logp"]
        args = (data["logp"], data["old_logp"], adv, data["mask"])
        jkw = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        jfn = lambda x: losses.grpo_loss(x, *map(jnp.asarray, args[1:]), **jkw)[0]
        return jfn, np_grpo(*args, **kw)
    old = data["old_logp"] if kw.pop("ratio", None) == "grpo" else data["old_logp_gspo"]
    args = (data["logp"], old, adv, data["mask"])
    jfn = lambda x: losses.gspo_loss(x, *map(jnp.asarray, args[1:]), **kw)[0]
    return jfn, np_gspo(*args, **kw)


@pytest.fixture(scope="module")
def data():
    return make_batch()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_value_and_gradient_match_float64_numpy_reference(case, data):
    with jax.enable_x64(True):
        jfn, (ref_value, ref_grad) = case_fns(case, data)
        logp = jnp.asarray(data["logp"])
        value, grad = jax.jit(jax.value_and_grad(jfn))(logp)
        assert value.dtype == jnp.float64
        np.testing.assert_allclose(value, ref_value, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert np.all(np.asarray(grad)[data["mask"] == 0] == 0)
        assert np.any(np.abs(ref_grad) > 1e-6), "the case must have a non-trivial gradient"


# k3+ and GSPO-token are straight-through by design (their gradient is not the derivative of their
# value); the numpy reference and the k3+ / GSPO-equivalence tests below cover their gradients.
STRAIGHT_THROUGH = ("grpo-kl-k3+", "gspo-token")


@pytest.mark.parametrize("case", [c for c in CASES if c not in STRAIGHT_THROUGH])
def test_gradient_matches_central_finite_differences(case, data):
    h = 1e-6
    with jax.enable_x64(True):
        jfn, _ = case_fns(case, data)
        logp = jnp.asarray(data["logp"])
        eye = jnp.eye(B * T, dtype=jnp.float64).reshape(B * T, B, T) * h
        f = jax.jit(jax.vmap(jfn))
        fd = (f(logp + eye) - f(logp - eye)).reshape(B, T) / (2 * h)
        np.testing.assert_allclose(jax.grad(jfn)(logp), fd, rtol=1e-6, atol=1e-8)


def test_clip_cases_exercise_clipped_and_unclipped_tokens(data):
    """Guards the data of the table above: both branches of every clip actually occur."""
    m = data["mask"] > 0
    rho = np.exp(data["logp"] - data["old_logp"])[m]
    A = np.broadcast_to(data["adv"][:, None], m.shape)[m]
    assert np.sum((A > 0) & (rho > 1.28)) and np.sum((A < 0) & (rho < 0.8))
    assert np.sum((np.abs(A) > 0) & (rho > 0.8) & (rho < 1.2)) and np.sum((A < 0) & (rho > 3))
    lengths = np.maximum(data["mask"].sum(1), 1)
    s = np.exp(np.where(m, data["logp"] - data["old_logp_gspo"], 0).sum(1) / lengths)
    s, a = s[data["mask"].sum(1) > 0], data["adv"][data["mask"].sum(1) > 0]
    assert np.sum((a > 0) & (s > 1 + 4e-4)) and np.sum((a < 0) & (s < 1 - 3e-4))
    assert np.sum((a != 0) & (s > 1 - 3e-4) & (s < 1 + 4e-4))


@pytest.mark.parametrize("scale", losses.ADV_SCALES)
def test_group_advantages_match_numpy(scale, data):
    adv = losses.group_advantages(jnp.asarray(data["rewards"], jnp.float32), G, scale=scale)
    np.testing.assert_allclose(adv, np_group_advantages(data["rewards"], G, scale), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[4:8], 0.0)  # the degenerate group


def test_gspo_token_equals_gspo_with_sequence_advantages(data):
    with jax.enable_x64(True):
        args = [jnp.asarray(data[k]) for k in ("old_logp_gspo", "adv", "mask")]
        for eps in (dict(), dict(eps_low=0.05, eps_high=0.08)):
            seq = lambda x: losses.gspo_loss(x, *args, **eps)[0]
            tok = lambda x: losses.gspo_loss(x, *args, token_level=True, **eps)[0]
            (v1, g1), (v2, g2) = (
                jax.value_and_grad(f)(jnp.asarray(data["logp"])) for f in (seq, tok)
            )
            np.testing.assert_allclose(v2, v1, rtol=1e-13)
            np.testing.assert_allclose(g2, g1, rtol=1e-12, atol=1e-15)
            assert np.abs(np.asarray(g1)).max() > 1e-3


def test_k3_plus_has_k3_value_and_k2_gradient(data):
    with jax.enable_x64(True):
        args = [jnp.asarray(data[k]) for k in ("old_logp", "adv", "mask")]
        zero_adv = [args[0], jnp.zeros_like(args[1]), args[2]]
        ref = jnp.asarray(data["ref_logp"])
        f = lambda est, a: (
            lambda x: losses.grpo_loss(x, *a, kl_coef=1.0, ref_logp=ref, kl_estimator=est)[0]
        )
        logp = jnp.asarray(data["logp"])
        np.testing.assert_allclose(f("k3+", args)(logp), f("k3", args)(logp), rtol=1e-14)
        g_plus, g_k2, g_k3 = (jax.grad(f(e, zero_adv))(logp) for e in ("k3+", "k2", "k3"))
        np.testing.assert_allclose(g_plus, g_k2, rtol=1e-13, atol=1e-16)
        assert np.abs(np.asarray(g_plus - g_k3)).max() > 1e-3


def test_clip_loss_aux_metrics_match_numpy(data):
    m = data["mask"] > 0
    lr = (data["logp"] - data["old_logp"])[m]
    rho, A = np.exp(lr), np.broadcast_to(data["adv"][:, None], m.shape)[m]
    x = (data["logp"] - data["ref_logp"])[m]
    plain, clipped = -A * rho, -A * np.clip(rho, 0.8, 1.28)
    args = [jnp.asarray(data[k], jnp.float32) for k in ("logp", "old_logp", "adv", "mask")]
    _, aux = losses.grpo_loss(*args, eps_high=0.28, dual_clip=3.0, kl_coef=0.1,
                              ref_logp=jnp.asarray(data["ref_logp"], jnp.float32))  # fmt: skip
    expected = {
        "clip_frac_high": np.mean((A > 0) & (rho > 1.28)),
        "clip_frac_low": np.mean((A < 0) & (rho < 0.8)),
        "clip_frac": np.mean(((A > 0) & (rho > 1.28)) | ((A < 0) & (rho < 0.8))),
        "dual_clip_frac": np.mean((A < 0) & (-3.0 * A < np.maximum(plain, clipped))),
        "ratio_mean": rho.mean(),
        "ratio_min": rho.min(),
        "ratio_max": rho.max(),
        "kl": np.mean(np.exp(-x) + x - 1),
        "kl_old": np.mean(rho - 1 - lr),
        "adv_abs_mean": np.abs(A).mean(),
    }
    for k, v in expected.items():
        np.testing.assert_allclose(aux[k], v, rtol=1e-5, err_msg=k)
    assert aux["dual_clip_frac"] > 0 and aux["clip_frac_low"] > 0 and aux["clip_frac_high"] > 0
    np.testing.assert_allclose(aux["pg_loss"] + aux["kl_loss"], aux["loss"], rtol=1e-6)

    args[1] = jnp.asarray(data["old_logp_gspo"], jnp.float32)
    _, aux = losses.gspo_loss(*args)
    valid = m.any(1)
    s = np.exp(
        (np.where(m, data["logp"] - data["old_logp_gspo"], 0).sum(1))[valid] / m.sum(1)[valid]
    )
    a = data["adv"][valid]
    np.testing.assert_allclose(aux["seq_ratio_mean"], s.mean(), rtol=1e-6)
    np.testing.assert_allclose([aux["seq_ratio_min"], aux["seq_ratio_max"]], [s.min(), s.max()])
    clipped = ((a > 0) & (s > 1 + 4e-4)) | ((a < 0) & (s < 1 - 3e-4))
    np.testing.assert_allclose(aux["clip_frac"], clipped.mean(), rtol=1e-6)


# ----------------------------------------------------------------------------- GVPO invariants


def gvpo_value_and_grad(logp, anchor, rewards, mask, beta=BETA):
    with jax.enable_x64(True):
        f = lambda x: losses.gvpo_loss(x, anchor, rewards, mask, group_size=G, beta=beta)
        return jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))


def test_gvpo_gradient_per_sequence_is_beta_d_over_G_minus_1_over_groups(data):
    (_, aux), grad = gvpo_value_and_grad(
        data["logp"], data["ref_logp"], data["rewards"], data["mask"]
    )
    m = data["mask"]
    seq = lambda x: np.where(m > 0, x, 0).sum(1).reshape(P, G)
    r_theta = BETA * (seq(data["logp"]) - seq(data["ref_logp"]))
    a = data["rewards"].reshape(P, G) - data["rewards"].reshape(P, G).mean(1, keepdims=True)
    d = (r_theta - r_theta.mean(1, keepdims=True) - a).ravel()
    expected_B = BETA * d / (G - 1) / P
    grad = np.asarray(grad)
    # Every token of a sequence gets the sequence's gradient; padding gets none.
    np.testing.assert_allclose(grad, m * expected_B[:, None], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(aux["d_abs_mean"], np.abs(d).mean(), rtol=1e-6)


def test_gvpo_gradient_is_minus_beta_a_over_G_minus_1_when_logp_equals_anchor(data):
    _, grad = gvpo_value_and_grad(data["logp"], data["logp"], data["rewards"], data["mask"])
    a = data["rewards"].reshape(P, G) - data["rewards"].reshape(P, G).mean(1, keepdims=True)
    expected_B = -BETA * a.ravel() / (G - 1) / P
    np.testing.assert_allclose(grad, data["mask"] * expected_B[:, None], rtol=1e-12, atol=1e-15)


def test_gvpo_gradient_on_equal_reward_group_is_nonzero_off_anchor_and_zero_on_it(data):
    group1 = slice(G, 2 * G)  # rewards all 1.0
    _, grad = gvpo_value_and_grad(data["logp"], data["ref_logp"], data["rewards"], data["mask"])
    assert np.abs(np.asarray(grad)[group1]).max() > 1e-3
    anchor = data["ref_logp"].copy()
    anchor[group1] = data["logp"][group1]
    _, grad = gvpo_value_and_grad(data["logp"], anchor, data["rewards"], data["mask"])
    np.testing.assert_allclose(np.asarray(grad)[group1], 0.0, atol=1e-15)


def test_gvpo_invariant_to_adding_a_per_prompt_constant_to_rewards(data):
    shifted = data["rewards"] + np.repeat([3.0, -7.5, 100.0], G)
    (v1, _), g1 = gvpo_value_and_grad(data["logp"], data["ref_logp"], data["rewards"], data["mask"])
    (v2, _), g2 = gvpo_value_and_grad(data["logp"], data["ref_logp"], shifted, data["mask"])
    np.testing.assert_allclose(v2, v1, rtol=1e-12)
    np.testing.assert_allclose(g2, g1, rtol=1e-10, atol=1e-15)


def test_gvpo_aux_terms_decompose_the_loss(data):
    (loss, aux), _ = gvpo_value_and_grad(
        data["logp"], data["ref_logp"], data["rewards"], data["mask"]
    )
    total = aux["adv_term"] + aux["var_term"] + aux["cov_term"]
    np.testing.assert_allclose(total, loss, rtol=1e-5)
    r = data["rewards"].reshape(P, G)
    np.testing.assert_allclose(aux["adv_term"], 0.5 * r.var(1, ddof=1).mean(), rtol=1e-6)
    seq = lambda x: np.where(data["mask"] > 0, x, 0).sum(1).reshape(P, G)
    log_ratio = seq(data["logp"]) - seq(data["ref_logp"])
    var_term = 0.5 * BETA**2 * log_ratio.var(1, ddof=1).mean()
    np.testing.assert_allclose(aux["var_term"], var_term, rtol=1e-5)
    assert aux["degenerate_frac"] == pytest.approx(1 / 3)
    assert all(v.dtype == jnp.float32 and v.shape == () for v in aux.values())


# ----------------------------------------------------------------------------- DAPO helpers


def test_overlong_penalty_follows_dapo_soft_punishment():
    lengths = jnp.array([0, 15, 16, 18, 20, 21, 40])
    penalty = losses.overlong_penalty(lengths, max_len=20, cache_len=5, factor=0.5)
    np.testing.assert_allclose(penalty, 0.5 * np.array([0, 0, -0.2, -0.6, -1.0, -1.0, -1.0]))


def test_the_hosts_numpy_twins_give_the_loss_librarys_values():
    """The trainer's host code scores in numpy (rewards.overlong_penalty,
    batch.informative_groups); the loss library keeps the jax versions for JAX users."""
    from gvpo_jax import batch as batch_lib
    from gvpo_jax import rewards

    lengths = np.arange(0, 45, dtype=np.int32)
    for max_len, cache_len, factor in ((20, 5, 0.5), (32, 8, 1.0), (7, 7, 0.3)):
        kw = dict(max_len=max_len, cache_len=cache_len, factor=factor)
        host = rewards.overlong_penalty(lengths, **kw)
        assert host.dtype == np.float32
        # float32 either way; XLA may turn the division by the constant cache_len into a
        # product with its reciprocal (1 ulp apart), numpy divides
        np.testing.assert_allclose(
            host, np.asarray(losses.overlong_penalty(lengths, **kw)), rtol=3e-7, atol=0
        )
    with pytest.raises(ValueError, match="cache_len"):
        rewards.overlong_penalty(lengths, max_len=8, cache_len=16)
    r = np.random.default_rng(0).integers(0, 2, 60).astype(np.float32)
    np.testing.assert_array_equal(
        batch_lib.informative_groups(r, 3), np.asarray(losses.informative_groups(r, 3))
    )
    with pytest.raises(ValueError, match="whole groups of 7"):
        batch_lib.informative_groups(r, 7)


def test_informative_groups_flags_groups_whose_rewards_differ(data):
    flags = losses.informative_groups(jnp.asarray(data["rewards"]), G)
    np.testing.assert_array_equal(flags, [True, False, True])
    assert losses.informative_groups(jnp.zeros(6), 3).tolist() == [False, False]


# ----------------------------------------------------------------------------- token log-probs


def test_token_logprobs_from_logits_match_numpy_log_softmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    x = logits.astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    ref = np.take_along_axis(ref, targets[..., None], -1)[..., 0] * mask
    out = losses.token_logprobs_from_logits(jnp.asarray(logits), jnp.asarray(targets), mask)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    out16 = losses.token_logprobs_from_logits(jnp.asarray(logits, jnp.bfloat16), targets)
    assert out16.dtype == jnp.float32
    np.testing.assert_allclose(out16 * mask, ref, atol=0.1)


# ----------------------------------------------------------------------------- presets


SPEC_PRESETS = {
    "gvpo": ("gvpo", "none", dict(beta=0.1), False, False),
    "grpo": ("clip", "group", dict(eps_low=0.2, eps_high=0.2, kl_coef=0.04, kl_estimator="k3",
                                   agg="seq-mean-token-mean"), False, False),
    "dr_grpo": ("clip", "none", dict(kl_coef=0.0, agg="seq-mean-token-sum-norm"), False, False),
    "dapo": ("clip", "group", dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, agg="token-mean"),
             True, True),
    "gspo": ("gspo", "group", dict(eps_low=3e-4, eps_high=4e-4, token_level=False), False, False),
    "gspo_token": ("gspo", "group", dict(eps_low=3e-4, eps_high=4e-4, token_level=True), False,
                   False),
    "cispo": ("cispo", "group", dict(eps_low=1.0, eps_high=4.0, kl_coef=0.0, agg="token-mean"),
              False, False),
    "gmpo": ("gmpo", "group", dict(eps_low=0.4, eps_high=0.4), False, False),
    "rloo": ("rloo", "none", dict(eps_low=0.2, eps_high=0.2, kl_coef=0.05), False, False),
    "reinforce_pp": ("clip", "batch", dict(eps_low=0.2, eps_high=0.2, kl_coef=0.0,
                                           agg="token-mean"), False, False),
    "reinforce_pp_baseline": ("clip", "batch", dict(eps_low=0.2, eps_high=0.2, kl_coef=0.001,
                                                    kl_estimator="k2", agg="token-mean"),
                              False, False),
}  # fmt: skip
# REINFORCE++'s advantage estimator and its settings (SPEC: KL in the reward at 0.01 without a
# baseline; group-mean baseline with the KL in the loss instead).
SPEC_ADVANTAGES = {
    "reinforce_pp": dict(baseline=False, reward_kl_coef=0.01),
    "reinforce_pp_baseline": dict(baseline=True, reward_kl_coef=0.0),
}


@pytest.mark.parametrize("name", list(SPEC_PRESETS))
def test_preset_carries_spec_defaults(name):
    kind, adv_scale, kwargs, dynamic, overlong = SPEC_PRESETS[name]
    p = losses.LOSSES[name]
    assert (p.name, p.kind, p.adv_scale) == (name, kind, adv_scale)
    assert {k: p.kwargs[k] for k in kwargs} == kwargs
    assert (p.dynamic_sampling, p.overlong_penalty, p.uses_old_logp) == (dynamic, overlong, True)
    assert dict(p.adv_kwargs) == SPEC_ADVANTAGES.get(name, {})
    assert p.adv_estimator == ("reinforce_pp" if name in SPEC_ADVANTAGES else "group")
    assert p.off_policy == (name == "gvpo")
    assert "arXiv:" in p.reference
    assert set(losses.LOSSES) == set(SPEC_PRESETS)


@pytest.mark.parametrize("name", list(SPEC_PRESETS))
def test_preset_loss_equals_the_direct_loss_call(name, data):
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    loss, aux = losses.preset_loss(
        name, logp=j["logp"], old_logp=j["old_logp"], rewards=j["rewards"], mask=j["mask"],
        group_size=G, ref_logp=j["ref_logp"], max_tokens=T,
    )  # fmt: skip
    p = losses.LOSSES[name]
    if p.kind == "gvpo":  # anchor defaults to old_logp
        direct = losses.gvpo_loss(j["logp"], j["old_logp"], j["rewards"], j["mask"], group_size=G,
                                  **p.kwargs)  # fmt: skip
    elif p.kind == "rloo":
        direct = losses.rloo_loss(j["logp"], j["old_logp"], j["rewards"], j["mask"], group_size=G,
                                  ref_logp=j["ref_logp"], **p.kwargs)  # fmt: skip
    else:
        if p.adv_estimator == "reinforce_pp":
            adv = losses.reinforce_pp_advantages(
                j["rewards"], j["mask"], group_size=G, old_logp=j["old_logp"],
                ref_logp=j["ref_logp"], **p.adv_kwargs)  # fmt: skip
        else:
            adv = losses.group_advantages(j["rewards"], G, scale=p.adv_scale)
        extra = dict(ref_logp=j["ref_logp"], max_tokens=T) if p.kind in ("clip", "cispo") else {}
        direct = p.loss_fn(j["logp"], j["old_logp"], adv, j["mask"], **p.kwargs, **extra)
    np.testing.assert_allclose(loss, direct[0], rtol=1e-6)
    assert aux["informative_frac"] == pytest.approx(2 / 3)


def test_preset_loss_gvpo_uses_anchor_logp_and_overrides(data):
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    common = dict(logp=j["logp"], rewards=j["rewards"], mask=j["mask"], group_size=G)
    loss, _ = losses.preset_loss(
        "gvpo", old_logp=None, anchor_logp=j["ref_logp"], beta=2.0, **common
    )
    ref_value, _ = np_gvpo(data["logp"], data["ref_logp"], data["rewards"], data["mask"], G, 2.0)
    np.testing.assert_allclose(loss, ref_value, rtol=1e-5)
    loss, _ = losses.preset_loss("grpo", old_logp=j["old_logp"], kl_coef=0.0, adv_scale="none",
                                 agg="token-mean", **common)  # fmt: skip
    ref_value, _ = np_grpo(data["logp"], data["old_logp"], np_group_advantages(
        data["rewards"], G, "none"), data["mask"], agg="token-mean")  # fmt: skip
    np.testing.assert_allclose(loss, ref_value, rtol=1e-5)


# ----------------------------------------------------------------------------- misuse


def _j(*shape):
    return jnp.zeros(shape, jnp.float32)


MISUSE = {
    "batch-not-divisible": (
        lambda: losses.gvpo_loss(_j(6, 3), _j(6, 3), _j(6), _j(6, 3), group_size=4, beta=0.1),
        "group_size.*does not divide"),
    "advantages-batch-not-divisible": (
        lambda: losses.group_advantages(_j(7), 2), "group_size.*does not divide"),
    "gvpo-group-size-1": (
        lambda: losses.gvpo_loss(_j(4, 3), _j(4, 3), _j(4), _j(4, 3), group_size=1, beta=0.1),
        "group_size.*>= 2"),
    "group-size-not-int": (lambda: losses.group_advantages(_j(4), 2.0), "group_size.*int"),
    "unknown-agg": (lambda: losses.grpo_loss(_j(4, 3), _j(4, 3), _j(4), _j(4, 3), agg="mean"),
                    "agg"),
    "unknown-estimator": (
        lambda: losses.grpo_loss(_j(4, 3), _j(4, 3), _j(4), _j(4, 3), kl_coef=0.1,
                                 ref_logp=_j(4, 3), kl_estimator="k4"), "kl_estimator"),
    "unknown-preset": (
        lambda: losses.preset_loss("ppo", logp=_j(4, 3), old_logp=_j(4, 3), rewards=_j(4),
                                   mask=_j(4, 3), group_size=2), "preset 'ppo'"),
    "unknown-override": (
        lambda: losses.preset_loss("gvpo", logp=_j(4, 3), old_logp=_j(4, 3), rewards=_j(4),
                                   mask=_j(4, 3), group_size=2, eps_low=0.1), "override.*eps_low"),
    "dr-grpo-without-max-tokens": (
        lambda: losses.preset_loss("dr_grpo", logp=_j(4, 3), old_logp=_j(4, 3), rewards=_j(4),
                                   mask=_j(4, 3), group_size=2), "max_tokens"),
    "kl-without-ref": (
        lambda: losses.grpo_loss(_j(4, 3), _j(4, 3), _j(4), _j(4, 3), kl_coef=0.04), "ref_logp"),
    "dual-clip-below-1": (
        lambda: losses.grpo_loss(_j(4, 3), _j(4, 3), _j(4), _j(4, 3), dual_clip=0.5), "dual_clip"),
    "mask-shape": (lambda: losses.grpo_loss(_j(4, 3), _j(4, 3), _j(4), _j(4, 2)), "`mask`"),
    "old-logp-shape": (lambda: losses.gspo_loss(_j(4, 3), _j(3, 3), _j(4), _j(4, 3)), "old_logp"),
    "rewards-shape": (
        lambda: losses.gvpo_loss(_j(4, 3), _j(4, 3), _j(2), _j(4, 3), group_size=2, beta=0.1),
        "`rewards`"),
    "logp-rank": (
        lambda: losses.gvpo_loss(_j(4), _j(4), _j(4), _j(4), group_size=2, beta=0.1), "`logp`"),
    "token-adv-for-sequence-gspo": (
        lambda: losses.gspo_loss(_j(4, 3), _j(4, 3), _j(4, 3), _j(4, 3)), "token_level=True"),
    "overlong-cache-too-long": (
        lambda: losses.overlong_penalty(_j(4), max_len=8, cache_len=16), "cache_len"),
    "logits-targets-shape": (
        lambda: losses.token_logprobs_from_logits(_j(2, 3, 5), _j(2, 4)), "targets_BxT"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_a_clear_error(case):
    fn, pattern = MISUSE[case]
    with pytest.raises(ValueError, match=pattern):
        fn()


def test_misuse_is_caught_at_trace_time_under_jit():
    f = jax.jit(functools.partial(losses.preset_loss, "gvpo", group_size=3))
    with pytest.raises(ValueError, match="does not divide"):
        f(logp=_j(4, 3), old_logp=_j(4, 3), rewards=_j(4), mask=_j(4, 3))


# ----------------------------------------------------------------------------- jit and padding


@pytest.mark.parametrize("name", list(SPEC_PRESETS))
def test_loss_jits_and_is_finite_with_fully_padded_rows_and_tool_tokens(name, data):
    mask = data["mask"].copy()
    mask[G : 2 * G] = 0.0  # a whole group of padding rows, besides the empty row 9
    mask[0, 1:3] = mask[10, 2] = 0.0  # a tool's answers inside responses: counted nowhere
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    bad = lambda x: jnp.where(jnp.asarray(mask) > 0, x, jnp.nan).at[0, -1].set(jnp.inf)
    mask[0, -1] = 0.0
    kw = dict(old_logp=bad(j["old_logp"]), ref_logp=bad(j["ref_logp"]), rewards=j["rewards"],
              mask=jnp.asarray(mask))  # fmt: skip
    f = jax.jit(functools.partial(losses.preset_loss, name, group_size=G, max_tokens=T))
    (loss, aux), grad = jax.value_and_grad(lambda x: f(logp=x, **kw), has_aux=True)(bad(j["logp"]))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[mask == 0] == 0) and np.abs(np.asarray(grad)).max() > 0
    assert all(np.isfinite(v) and v.dtype == jnp.float32 and v.shape == () for v in aux.values())
    # A batch with no tokens at all: loss 0 (gvpo: only its reward-variance constant), finite.
    kw["mask"] = jnp.zeros_like(kw["mask"])
    (loss, aux), grad = jax.value_and_grad(lambda x: f(logp=x, **kw), has_aux=True)(bad(j["logp"]))
    assert np.isfinite(loss) and np.all(np.asarray(grad) == 0)
    assert all(np.isfinite(v) for v in aux.values())


@pytest.mark.parametrize("name", list(SPEC_PRESETS))
def test_bfloat16_inputs_reduce_in_float32(name, data):
    j = {k: jnp.asarray(v, jnp.bfloat16) for k, v in data.items()}
    loss, aux = losses.preset_loss(
        name, logp=j["logp"], old_logp=j["old_logp"], rewards=j["rewards"], mask=j["mask"],
        group_size=G, ref_logp=j["ref_logp"], max_tokens=T,
    )  # fmt: skip
    f32 = {k: jnp.asarray(v, jnp.bfloat16).astype(jnp.float32) for k, v in data.items()}
    loss32, _ = losses.preset_loss(
        name, logp=f32["logp"], old_logp=f32["old_logp"], rewards=f32["rewards"],
        mask=f32["mask"], group_size=G, ref_logp=f32["ref_logp"], max_tokens=T,
    )  # fmt: skip
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in aux.values())
    np.testing.assert_allclose(loss, loss32, rtol=1e-6, atol=1e-7)
