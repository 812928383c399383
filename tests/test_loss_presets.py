"""CISPO, GMPO, RLOO, REINFORCE++ and the entropy bonus against float64 numpy references written
from the papers' formulas, finite differences, and their degenerate cases.

The shared presets' invariants (jit, fully padded rows, bfloat16 inputs, preset defaults) are
parametrized over every preset in test_losses.py; this file holds what is particular to the
losses added after it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import losses, models
from gvpo_jax.models import logprobs
from tests.test_losses import B, G, P, T, make_batch, np_agg_weights


@pytest.fixture(scope="module")
def data():
    return make_batch(1)


def np_kl(logp, ref, estimator):
    d = ref - logp
    if estimator == "k1":
        return -d, np.ones_like(d)
    if estimator == "k2":
        return 0.5 * d**2, -d
    return np.exp(d) - d - 1.0, 1.0 - np.exp(d)  # k3 (no clamp reached in these data)


# ----------------------------------------------------------------------------- CISPO


def np_cispo(
    logp,
    old,
    adv,
    mask,
    *,
    eps_low=1.0,
    eps_high=4.0,
    agg="token-mean",
    kl_coef=0.0,
    ref=None,
    kl_estimator="k3",
):
    """MiniMax-M1 eq. (4): J = sum_i sum_t sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi,
    normalised by the token count; returns (-J, d(-J)/d logp) with the weight held constant."""
    on = mask > 0
    A = np.broadcast_to(adv[:, None], mask.shape) if adv.ndim == 1 else adv
    r = np.exp(np.where(on, logp - old, 0.0))
    w = np.clip(r, 1 - eps_low, 1 + eps_high)
    lp = np.where(on, logp, 0.0)
    loss_t, dloss_t = -w * A * lp, -w * A
    if kl_coef:
        kl, dkl = np_kl(lp, np.where(on, ref, 0.0), kl_estimator)
        loss_t, dloss_t = loss_t + kl_coef * kl, dloss_t + kl_coef * dkl
    wt = np_agg_weights(mask, agg, T)
    return np.sum(wt * loss_t), wt * dloss_t


CISPO_CASES = {
    "default": dict(),
    "two-sided-kl-seq-mean": dict(
        eps_low=0.2, eps_high=0.28, agg="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k2"
    ),
    "token-adv-tight": dict(eps_low=0.1, eps_high=0.1, token_adv=True),
}


@pytest.mark.parametrize("case", list(CISPO_CASES))
def test_cispo_value_and_gradient_match_the_paper_formula(case, data):
    kw = dict(CISPO_CASES[case])
    adv = data["token_adv"] if kw.pop("token_adv", False) else data["adv"]
    ref = data["ref_logp"]
    want, want_grad = np_cispo(data["logp"], data["old_logp"], adv, data["mask"], ref=ref, **kw)
    with jax.enable_x64(True):
        j = {k: jnp.asarray(v) for k, v in data.items()}
        extra = {"ref_logp": j["ref_logp"]} if kw.get("kl_coef") else {}

        def f(x):
            return losses.cispo_loss(x, j["old_logp"], jnp.asarray(adv), j["mask"], **kw, **extra)[
                0
            ]

        value, grad = jax.value_and_grad(f)(j["logp"])
    np.testing.assert_allclose(value, want, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert np.all(np.asarray(grad)[data["mask"] == 0] == 0)


def test_cispo_clipped_tokens_keep_a_gradient_where_ppo_clip_gives_none(data):
    """The point of CISPO: a token whose ratio is past the range still moves (weight = bound)."""
    eps = dict(eps_low=0.2, eps_high=0.2)
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    g_cispo = jax.grad(lambda x: losses.cispo_loss(x, j["old_logp"], j["adv"], j["mask"], **eps)[0])
    g_grpo = jax.grad(lambda x: losses.grpo_loss(x, j["old_logp"], j["adv"], j["mask"], **eps)[0])
    on = (data["mask"] > 0) & (np.abs(data["adv"])[:, None] > 0)
    rho = np.exp(data["logp"] - data["old_logp"])
    clipped = on & (
        ((data["adv"][:, None] > 0) & (rho > 1.2)) | ((data["adv"][:, None] < 0) & (rho < 0.8))
    )
    assert clipped.sum() >= 3
    assert np.all(np.asarray(g_grpo(j["logp"]))[clipped] == 0)
    assert np.all(np.asarray(g_cispo(j["logp"]))[clipped] != 0)


def test_cispo_gradient_matches_finite_differences_with_the_weight_held(data):
    """Moving logp and old_logp together keeps every ratio (so every weight) fixed: the finite
    difference of that value is the stop-gradient weight's derivative, -w A / N per token."""
    h = 1e-6
    with jax.enable_x64(True):
        j = {k: jnp.asarray(v) for k, v in data.items()}
        gap = j["logp"] - j["old_logp"]

        def f(x):
            return losses.cispo_loss(x, x - gap, j["adv"], j["mask"])[0]

        eye = jnp.eye(B * T, dtype=jnp.float64).reshape(B * T, B, T) * h
        fd = (jax.vmap(f)(j["logp"] + eye) - jax.vmap(f)(j["logp"] - eye)).reshape(B, T) / (2 * h)
        grad = jax.grad(lambda x: losses.cispo_loss(x, j["old_logp"], j["adv"], j["mask"])[0])
        np.testing.assert_allclose(grad(j["logp"]), fd, rtol=1e-6, atol=1e-9)


def test_cispo_ratio_exactly_at_the_bound_is_continuous():
    """eps_high = 0 puts the upper bound at rho = 1, which old = logp hits exactly: the weight
    is the bound from either side, and the clip counts only ratios past it."""
    with jax.enable_x64(True):
        logp, mask, adv = jnp.full((2, 3), -1.0), jnp.ones((2, 3)), jnp.array([1.0, -1.0])
        out = []
        for delta in (-1e-9, 0.0, 1e-9):
            f = functools.partial(
                losses.cispo_loss,
                old_logp=logp - delta,
                advantages=adv,
                mask=mask,
                eps_low=0.5,
                eps_high=0.0,
            )
            (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(logp)
            out.append((float(loss), np.asarray(grad), float(aux["clip_frac"])))
    for loss, grad, _ in out:
        np.testing.assert_allclose(loss, out[1][0], atol=1e-8)
        np.testing.assert_allclose(grad, out[1][1], atol=1e-8)
    assert [c for _, _, c in out] == [0.0, 0.0, 1.0]
    np.testing.assert_allclose(out[1][1], [[-1 / 6] * 3, [1 / 6] * 3])


# ----------------------------------------------------------------------------- GMPO


def np_gmpo(logp, old, adv, mask, eps_low=0.4, eps_high=0.4):
    """GMPO eq. (3): -mean_i sgn(A_i) |A_i| prod_t (clipped rho_t)^(1/|o_i|), the clip PPO's
    pessimistic one taken per token in log space; returns (value, d value / d logp)."""
    on = mask > 0
    d = np.where(on, logp - old, 0.0)
    A = adv[:, None]
    clipped = np.where(A > 0, np.minimum(d, eps_high), np.where(A < 0, np.maximum(d, -eps_low), d))
    free = np.where(A > 0, d <= eps_high, np.where(A < 0, d >= -eps_low, True))
    L = mask.sum(1)
    valid = L > 0
    s = np.exp(np.where(on, clipped, 0.0).sum(1) / np.maximum(L, 1))
    per_seq = -adv * s
    n = valid.sum()
    value = per_seq[valid].sum() / n
    grad = np.where(on & free, (-adv * s / np.maximum(L, 1))[:, None], 0.0) / n
    grad[~valid] = 0.0
    return value, grad


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.25, 0.35)])
def test_gmpo_value_and_gradient_match_the_paper_formula(eps, data):
    # d = logp - old_logp takes values in +-{0.05, ..., 1.3}: tokens on both sides of both ranges.
    want, want_grad = np_gmpo(data["logp"], data["old_logp"], data["adv"], data["mask"], *eps)
    with jax.enable_x64(True):
        j = {k: jnp.asarray(v) for k, v in data.items()}

        def f(x):
            return losses.gmpo_loss(
                x, j["old_logp"], j["adv"], j["mask"], eps_low=eps[0], eps_high=eps[1]
            )[0]

        value, grad = jax.value_and_grad(f)(j["logp"])
        np.testing.assert_allclose(value, want, rtol=1e-12)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
        h = 1e-6
        eye = jnp.eye(B * T, dtype=jnp.float64).reshape(B * T, B, T) * h
        fd = (jax.vmap(f)(j["logp"] + eye) - jax.vmap(f)(j["logp"] - eye)).reshape(B, T) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    on = data["mask"] > 0
    d = data["logp"] - data["old_logp"]
    assert np.sum(on & (d > eps[1])) and np.sum(on & (d < -eps[0])) and np.sum(on & (abs(d) < 0.2))


def test_gmpo_geometric_mean_damps_one_outlier_token():
    """One token with ratio e^5 among nine at 1: GRPO's unclipped token mean of ratios moves by
    (e^5 - 1) / 10 ~ 14.7, GMPO's geometric mean by e^0.5 - 1 ~ 0.65 (before any clip)."""
    logp = jnp.zeros((1, 10))
    old = logp.at[0, 3].set(-5.0)
    mask = jnp.ones((1, 10))
    adv = jnp.array([-1.0])  # A < 0: no upper clip on either loss's ratio
    _, aux = losses.gmpo_loss(logp, old, adv, mask, eps_low=0.4, eps_high=100.0)
    assert aux["seq_ratio_mean"] == pytest.approx(np.exp(0.5), rel=1e-6)
    _, aux = losses.grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=100.0)
    assert aux["ratio_mean"] == pytest.approx((9 + np.exp(5.0)) / 10, rel=1e-6)


# ----------------------------------------------------------------------------- RLOO


def np_rloo(logp, old, rewards, mask, g, *, eps_low=0.2, eps_high=0.2, kl_coef=0.0, ref=None):
    """Ahmadian et al. 2024 eq. (6), with the KL in the reward and TRL's sequence-ratio clip."""
    on = mask > 0
    shaped = rewards.copy()
    if kl_coef:
        shaped = shaped - kl_coef * np.where(on, old - ref, 0.0).sum(1)
    r = shaped.reshape(-1, g)
    baseline = (r.sum(1, keepdims=True) - r) / (g - 1)  # mean of the other g - 1
    A = (r - baseline).ravel()
    rho = np.exp(np.where(on, logp - old, 0.0).sum(1))
    unclipped = -A * rho
    clipped = -A * np.clip(rho, 1 - eps_low, 1 + eps_high)
    per_seq = np.maximum(unclipped, clipped)
    free = unclipped >= clipped
    valid = mask.sum(1) > 0
    n = valid.sum()
    value = per_seq[valid].sum() / n
    grad = np.where(on & (free & valid)[:, None], (-A * rho)[:, None], 0.0) / n
    return value, grad


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_rloo_value_and_gradient_match_the_paper_formula(kl_coef, data):
    # Sequence log-ratios of +-0.4 (outside the clip range) and +-0.1 (inside), spread evenly
    # over each row's tokens.
    seq_log_ratio = np.tile([0.4, -0.1, -0.4, 0.1], P)
    lengths = np.maximum(data["mask"].sum(1), 1)
    old = data["logp"] - data["mask"] * (seq_log_ratio / lengths)[:, None]
    want, want_grad = np_rloo(
        data["logp"], old, data["rewards"], data["mask"], G, kl_coef=kl_coef, ref=data["ref_logp"]
    )
    with jax.enable_x64(True):
        j = {k: jnp.asarray(v) for k, v in data.items()}
        ref = j["ref_logp"] if kl_coef else None

        def f(x):
            return losses.rloo_loss(
                x,
                jnp.asarray(old),
                j["rewards"],
                j["mask"],
                group_size=G,
                kl_coef=kl_coef,
                ref_logp=ref,
            )[0]

        value, grad = jax.value_and_grad(f)(j["logp"])
        np.testing.assert_allclose(value, want, rtol=1e-12)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
        h = 1e-6
        eye = jnp.eye(B * T, dtype=jnp.float64).reshape(B * T, B, T) * h
        fd = (jax.vmap(f)(j["logp"] + eye) - jax.vmap(f)(j["logp"] - eye)).reshape(B, T) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    # Both branches occur: rows with a non-zero advantage whose clip zeroes the gradient, and not.
    moving = (data["mask"].sum(1) > 0) & (np.abs(want_grad).sum(1) > 0)
    assert (
        moving.sum() >= 3
        and np.sum((data["mask"].sum(1) > 0) & ~moving & (np.arange(B) // G != 1)) >= 2
    )


def test_rloo_on_policy_is_reinforce_with_the_leave_one_out_baseline(data):
    """old = logp: the gradient is -A_i / n_seq on every token of row i, A_i = r_i - mean of the
    group's other rewards; a group of equal rewards has A = 0."""
    j = {k: jnp.asarray(v) for k, v in data.items()}
    grad = jax.grad(
        lambda x: losses.rloo_loss(
            x, jax.lax.stop_gradient(x), j["rewards"], j["mask"], group_size=G, kl_coef=0.0
        )[0]
    )
    r = data["rewards"].reshape(-1, G)
    A = (r - (r.sum(1, keepdims=True) - r) / (G - 1)).ravel()
    n = np.sum(data["mask"].sum(1) > 0)
    np.testing.assert_allclose(
        grad(j["logp"]), data["mask"] * (-A / n)[:, None], rtol=1e-5, atol=1e-8
    )
    np.testing.assert_allclose(losses.rloo_advantages(j["rewards"], G), A, rtol=1e-6, atol=1e-7)
    assert np.all(A[4:8] == 0)  # the all-equal group


def test_rloo_refuses_a_group_of_one():
    x = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match="group_size.*>= 2"):
        losses.rloo_loss(x, x, jnp.zeros(4), x, group_size=1, kl_coef=0.0)
    with pytest.raises(ValueError, match="group_size.*>= 2"):
        losses.preset_loss(
            "rloo", logp=x, old_logp=x, rewards=jnp.zeros(4), mask=x, group_size=1, ref_logp=x
        )


# ----------------------------------------------------------------------------- REINFORCE++


def np_reinforce_pp(rewards, mask, *, g=1, baseline=False, kl_coef=0.0, old=None, ref=None):
    """REINFORCE++ (arXiv 2501.03262, sections 3.1-3.2): token rewards -kl_coef KL_t with the
    task reward at the last token, returns with gamma = 1 (or the group-centred reward for the
    baseline variant), then one mean and std over every response token of the batch."""
    on = mask > 0
    r = rewards.astype(np.float64).copy()
    if baseline:
        r = (r.reshape(-1, g) - r.reshape(-1, g).mean(1, keepdims=True)).ravel()
    ret = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        running = 0.0
        last = np.flatnonzero(on[b])
        for t in reversed(range(mask.shape[1])):
            if not on[b, t]:
                continue
            u = -kl_coef * (old[b, t] - ref[b, t]) if kl_coef else 0.0
            if t == last[-1]:
                u += r[b]
            running += u
            ret[b, t] = running
    vals = ret[on]
    a = (ret - vals.mean()) / np.sqrt(max(vals.var(), 1e-8))
    return np.where(on, a, 0.0)


@pytest.mark.parametrize("variant", ["kl-in-reward", "baseline"])
def test_reinforce_pp_advantages_match_the_paper(variant, data):
    baseline = variant == "baseline"
    kw = dict(baseline=baseline, reward_kl_coef=0.0 if baseline else 0.3)
    want = np_reinforce_pp(
        data["rewards"],
        data["mask"],
        g=G,
        baseline=baseline,
        kl_coef=kw["reward_kl_coef"],
        old=data["old_logp"],
        ref=data["ref_logp"],
    )
    with jax.enable_x64(True):
        j = {k: jnp.asarray(v) for k, v in data.items()}
        got = losses.reinforce_pp_advantages(
            j["rewards"],
            j["mask"],
            group_size=G,
            old_logp=j["old_logp"],
            ref_logp=j["ref_logp"],
            **kw,
        )
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    on = data["mask"] > 0
    assert abs(want[on].mean()) < 1e-12 and want[on].std() == pytest.approx(1.0)
    if not baseline:  # the KL makes advantages differ along a row
        assert np.any(np.ptp(np.where(on, want, want[on].mean()), axis=1) > 1e-3)


def test_reinforce_pp_equal_returns_give_zero_advantages_not_nan():
    mask = jnp.ones((4, 3)).at[3, 1:].set(0.0)
    for baseline, rewards in ((False, jnp.full(4, 0.7)), (True, jnp.array([1.0, 1.0, 0.0, 0.0]))):
        adv = losses.reinforce_pp_advantages(rewards, mask, group_size=2, baseline=baseline)
        assert np.all(np.asarray(adv) == 0)


def test_reinforce_pp_preset_is_the_clipped_loss_on_its_advantages(data):
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    for name, kl in (
        ("reinforce_pp", dict(kl_coef=0.0)),
        ("reinforce_pp_baseline", dict(kl_coef=0.001, kl_estimator="k2")),
    ):
        preset = losses.LOSSES[name]
        adv = np_reinforce_pp(
            data["rewards"],
            data["mask"],
            g=G,
            baseline=preset.adv_kwargs["baseline"],
            kl_coef=preset.adv_kwargs["reward_kl_coef"],
            old=data["old_logp"],
            ref=data["ref_logp"],
        )
        loss, _ = losses.preset_loss(
            name,
            logp=j["logp"],
            old_logp=j["old_logp"],
            rewards=j["rewards"],
            mask=j["mask"],
            group_size=G,
            ref_logp=j["ref_logp"],
        )
        direct, _ = losses.grpo_loss(
            j["logp"],
            j["old_logp"],
            jnp.asarray(adv, jnp.float32),
            j["mask"],
            agg="token-mean",
            ref_logp=j["ref_logp"],
            **kl,
        )
        np.testing.assert_allclose(loss, direct, rtol=2e-5)
        assert losses.uses_batch_statistics(name)


def test_batch_statistics_differ_on_part_of_the_batch_which_is_why_the_trainer_precomputes(data):
    """REINFORCE++'s normalisation over half the batch is not the whole batch's: advantages
    passed in (computed once on the whole batch) must win over the loss's own."""
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    kw = dict(group_size=G, baseline=True)
    whole = losses.reinforce_pp_advantages(j["rewards"], j["mask"], **kw)
    half = losses.reinforce_pp_advantages(j["rewards"][:8], j["mask"][:8], **kw)
    assert np.abs(np.asarray(whole[:8] - half)).max() > 1e-2
    common = dict(
        old_logp=j["old_logp"][:8],
        rewards=j["rewards"][:8],
        mask=j["mask"][:8],
        group_size=G,
        ref_logp=j["ref_logp"][:8],
    )
    f = functools.partial(losses.preset_loss, "reinforce_pp_baseline", logp=j["logp"][:8], **common)
    given, _ = f(advantages=whole[:8])
    direct, _ = losses.grpo_loss(
        j["logp"][:8],
        common["old_logp"],
        whole[:8],
        common["mask"],
        agg="token-mean",
        kl_coef=0.001,
        kl_estimator="k2",
        ref_logp=common["ref_logp"],
    )
    np.testing.assert_allclose(given, direct, rtol=1e-6)
    assert not losses.uses_batch_statistics("grpo") and losses.uses_batch_statistics(
        "grpo", adv_scale="batch"
    )


# ----------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("vocab,chunk", [(1100, 4), (64, 64)])
def test_blocked_entropy_equals_the_full_softmax_entropy(vocab, chunk):
    """Values and gradients (of a mix of log-prob and entropy) of the blocked pass against the
    [B, T, V] reference: two blocks of 512 rows and a tail of 76, and a single block."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(0, 1, (2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (vocab, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, (2, 5)))
    c1, c2 = jnp.asarray(rng.normal(0, 1, (2, 5))), jnp.asarray(rng.normal(0, 1, (2, 5)))
    assert logprobs.vocab_block_size(10, vocab, chunk) == min(vocab, 512)

    def mix(fn):
        def f(h, w):
            logp, ent = fn(h, w)
            return jnp.sum(c1 * logp + c2 * ent)

        return jax.value_and_grad(f, argnums=(0, 1))

    blocked = mix(
        lambda h, w: models.chunked_logprobs(h, w, y, chunk_size=chunk, with_entropy=True)
    )
    full = mix(lambda h, w: models.naive_logprobs(h, w, y, with_entropy=True))
    logp, ent = models.chunked_logprobs(h, w, y, chunk_size=chunk, with_entropy=True)
    p = jax.nn.softmax(jnp.einsum("btd,vd->btv", h, w), -1)
    np.testing.assert_allclose(ent, -jnp.sum(p * jnp.log(p), -1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logp, models.chunked_logprobs(h, w, y, chunk_size=chunk), rtol=1e-6)
    (v1, (dh1, dw1)), (v2, (dh2, dw2)) = blocked(h, w), full(h, w)
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    np.testing.assert_allclose(dh1, dh2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw1, dw2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["gvpo", "grpo", "dr_grpo", "cispo", "gmpo", "rloo"])
def test_entropy_bonus_moves_the_gradient_by_exactly_coef_times_the_entropy_gradient(name, data):
    """d(loss with bonus) - d(loss) = -coef d agg(entropy), through the blocked pass to the
    unembedding, with the aggregation `entropy_aggregation` names for the preset."""
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(0, 1, (B, T, 8)), jnp.float32)
    w0 = jnp.asarray(rng.normal(0, 0.5, (11, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 11, (B, T)))
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    mask, coef = j["mask"], 0.03

    def loss(w, c):
        logp, ent = models.chunked_logprobs(h, w, y, chunk_size=4, with_entropy=True)
        old = jax.lax.stop_gradient(logp) - 0.1 * mask
        return losses.preset_loss(
            name,
            logp=logp,
            old_logp=old,
            rewards=j["rewards"],
            mask=mask,
            group_size=G,
            ref_logp=j["ref_logp"],
            max_tokens=T,
            entropy=ent,
            entropy_coef=c,
        )[0]

    def agg_entropy(w):
        _, ent = models.chunked_logprobs(h, w, y, chunk_size=4, with_entropy=True)
        agg = losses.entropy_aggregation(name)
        weights = np_agg_weights(np.asarray(mask), agg, T)
        return jnp.sum(jnp.asarray(weights, jnp.float32) * ent)

    diff = jax.grad(loss)(w0, coef) - jax.grad(loss)(w0, 0.0)
    np.testing.assert_allclose(diff, -coef * jax.grad(agg_entropy)(w0), rtol=2e-4, atol=1e-7)
    assert np.abs(np.asarray(diff)).max() > 1e-5
    value, aux = losses.preset_loss(
        name,
        logp=j["logp"],
        old_logp=j["old_logp"],
        rewards=j["rewards"],
        mask=mask,
        group_size=G,
        ref_logp=j["ref_logp"],
        max_tokens=T,
        entropy=-j["logp"],
        entropy_coef=coef,
    )
    assert aux["entropy_loss"] == pytest.approx(
        float(value)
        - float(
            losses.preset_loss(
                name,
                logp=j["logp"],
                old_logp=j["old_logp"],
                rewards=j["rewards"],
                mask=mask,
                group_size=G,
                ref_logp=j["ref_logp"],
                max_tokens=T,
            )[0]
        ),
        rel=1e-4,
    )
    assert aux["loss"] == pytest.approx(float(value))


def test_entropy_aggregation_follows_the_loss():
    assert losses.entropy_aggregation("dapo") == "token-mean"
    assert losses.entropy_aggregation("grpo") == "seq-mean-token-mean"
    assert losses.entropy_aggregation("grpo", agg="token-mean") == "token-mean"
    assert losses.entropy_aggregation("gvpo") == "seq-mean-token-sum"
    assert losses.entropy_aggregation("gmpo") == "seq-mean-token-mean"


# ----------------------------------------------------------------------------- misuse


def _z(*shape):
    return jnp.zeros(shape, jnp.float32)


MISUSE = {
    "gmpo-token-advantages": (
        lambda: losses.gmpo_loss(_z(4, 3), _z(4, 3), _z(4, 3), _z(4, 3)),
        "gmpo_loss needs",
    ),
    "cispo-kl-without-ref": (
        lambda: losses.cispo_loss(_z(4, 3), _z(4, 3), _z(4), _z(4, 3), kl_coef=0.1),
        "ref_logp",
    ),
    "rloo-kl-without-ref": (
        lambda: losses.rloo_loss(_z(4, 3), _z(4, 3), _z(4), _z(4, 3), group_size=2),
        "ref_logp",
    ),
    "reward-kl-without-logps": (
        lambda: losses.reinforce_pp_advantages(_z(4), _z(4, 3), reward_kl_coef=0.1),
        "reward_kl_coef",
    ),
    "baseline-group-of-one": (
        lambda: losses.reinforce_pp_advantages(_z(4), _z(4, 3), baseline=True),
        ">= 2",
    ),
    "entropy-coef-without-entropy": (
        lambda: losses.preset_loss(
            "dapo",
            logp=_z(4, 3),
            old_logp=_z(4, 3),
            rewards=_z(4),
            mask=_z(4, 3),
            group_size=2,
            entropy_coef=0.1,
        ),
        "entropy",
    ),
    "advantages-for-gvpo": (
        lambda: losses.preset_loss(
            "gvpo",
            logp=_z(4, 3),
            old_logp=_z(4, 3),
            rewards=_z(4),
            mask=_z(4, 3),
            group_size=2,
            advantages=_z(4),
        ),
        "rewards",
    ),
    "adv-scale-for-reinforce-pp": (
        lambda: losses.preset_loss(
            "reinforce_pp",
            logp=_z(4, 3),
            old_logp=_z(4, 3),
            rewards=_z(4),
            mask=_z(4, 3),
            group_size=2,
            adv_scale="group",
        ),
        "override.*adv_scale",
    ),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_a_clear_error(case):
    fn, pattern = MISUSE[case]
    with pytest.raises(ValueError, match=pattern):
        fn()


# ----------------------------------------------------------------------------- the Algorithm


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_resolved_algorithm_loss_is_the_preset_loss_with_its_overrides(name, data):
    """`resolve(name, **overrides).loss` is `preset_loss(name, ..., **overrides)`: the object
    carries the overrides, max_tokens and the entropy bonus, and nothing else changes the loss."""
    j = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    preset = losses.LOSSES[name]
    overrides = {"beta": 0.3} if preset.kind == "gvpo" else {}
    if "eps_high" in losses.overridable(name):
        overrides["eps_high"] = 0.5 * preset.kwargs["eps_high"]
    algo = losses.resolve(name, max_tokens=T, entropy_coef=0.01, eps_low=None, **overrides)
    entropy = jnp.abs(j["logp"])
    arrays = dict(logp=j["logp"], old_logp=j["old_logp"], rewards=j["rewards"], mask=j["mask"],
                  group_size=G, ref_logp=j["ref_logp"], entropy=entropy)  # fmt: skip
    got, _ = algo.loss(**arrays)
    want, _ = losses.preset_loss(name, **arrays, max_tokens=T, entropy_coef=0.01, **overrides)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain, _ = losses.preset_loss(name, **arrays, max_tokens=T)
    assert float(got) != float(plain)  # the overrides and the bonus reached the loss
    assert hash(algo) == hash(losses.resolve(name, max_tokens=T, entropy_coef=0.01, **overrides))


def test_resolved_algorithm_says_what_the_trainer_must_provide():
    r = losses.resolve
    assert r("gvpo").needs_reference is False and r("gvpo", anchor="ref").needs_reference
    assert r("grpo", max_tokens=8).needs_reference  # kl_coef 0.04
    assert not r("grpo", max_tokens=8, kl_coef=0.0).needs_reference
    assert r("reinforce_pp", max_tokens=8).needs_reference  # KL in the reward
    assert r("reinforce_pp", max_tokens=8).advantages_need_old
    assert not r("reinforce_pp", max_tokens=8, reward_kl_coef=0.0).needs_reference
    assert r("reinforce_pp", max_tokens=8).batch_statistics and not r("grpo").batch_statistics
    assert [n for n in losses.LOSSES if r(n, max_tokens=8).token_weighted] == [
        "dapo", "cispo", "reinforce_pp", "reinforce_pp_baseline"]  # fmt: skip
    dapo = r("dapo", max_tokens=16, overlong_cache=4, overlong_factor=0.5)
    assert dapo.dynamic_sampling and dapo.overlong == (16, 4, 0.5)
    assert not r("dapo", max_tokens=16, dynamic_sampling=False).dynamic_sampling
    assert r("grpo").overlong is None and r("gvpo").off_policy and not r("grpo").off_policy
    assert r("grpo", anchor="ref").anchor == "old"  # only GVPO has an anchor policy
    assert r("dapo", max_tokens=8, rollout_correction="seq_mis").correction == ("seq_mis", 2.0)


@pytest.mark.parametrize(
    "kwargs, sentence",
    [
        (dict(name="ppo"), "name is 'ppo'; use one of gvpo, grpo"),
        (dict(name="gmpo", kl_coef=0.1), "kl_coef is set but name='gmpo' has no such setting"),
        (dict(name="grpo", eps_low=-0.1), "eps_low is -0.1; use a non-negative value"),
        (dict(name="grpo", kl_coef=float("nan")), "kl_coef is nan; use a non-negative value"),
        (dict(name="gvpo", beta=0.0), "beta is 0.0; set a positive value"),
        (dict(name="gvpo", anchor="new"), "anchor is 'new'; use old, ref or sampler."),
        (dict(name="grpo", anchor="sampler"), "anchor is 'sampler' with name='grpo': only GVPO"),
        (dict(name="gvpo", entropy_coef=-1.0), "entropy_coef is -1.0; use 0 (off)"),
        (dict(name="gvpo", rollout_correction="seq_mis"), "rollout_correction is 'seq_mis' with "
         "name='gvpo': GVPO's optimum holds"),
        (dict(name="gspo", rollout_correction="token_tis"), "rollout_correction is 'token_tis' "
         "with name='gspo', whose loss treats a response as one action"),
        (dict(name="grpo", rollout_is_cap=1.0), "rollout_is_cap is 1.0; use a cap > 1"),
        (dict(name="dr_grpo"), "max_tokens is None but name='dr_grpo' needs it"),
        (dict(name="dapo", max_tokens=8, overlong_cache=8), "overlong_cache is 8; use a window"),
    ],
)  # fmt: skip
def test_resolve_refuses_what_the_algorithm_cannot_honour_in_one_sentence(kwargs, sentence):
    kwargs = dict(kwargs)
    with pytest.raises(losses.AlgorithmError) as e:
        losses.resolve(kwargs.pop("name"), **kwargs)
    assert str(e.value).startswith(sentence) and str(e.value).count(". ") == 0, str(e.value)
    # a trainer names its own fields, every argument the sentence mentions included
    named = e.value.sentence("algo.")
    assert named.startswith("algo." + sentence.split(" ")[0])
    assert " name=" not in named and " rollout_correction=" not in named
