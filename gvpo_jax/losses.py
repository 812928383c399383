"""Policy losses for RL post-training of LLMs, in pure JAX: GVPO, GRPO / Dr.GRPO / DAPO, GSPO,
CISPO, GMPO, RLOO and REINFORCE++ (with or without a group baseline), plus an entropy bonus.

This file stands alone (jax + the standard library only) so it can be copied into any JAX trainer.

Batch layout: `P` prompts x `G` responses, `B = P*G` rows, the G responses of one prompt are
contiguous rows (`g*G .. g*G+G-1`). Per-token arrays are `[B, T]`; `mask` is 1.0 on response tokens
that count (up to and including EOS) and 0.0 on padding. Whatever sits at masked positions (even
inf/nan) never reaches the loss or its gradient. Reductions run in float32 (or float64 if the inputs
are float64), whatever the input dtype; `aux` metrics are float32 scalars.

Settings (group_size, agg, eps, ...) are static Python values: shapes and settings are checked at
trace time and misuse raises a ValueError naming the argument and the fix. Bind settings with
`functools.partial` (or `static_argnames`) and `jax.jit` the result.
"""

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
ADV_SCALES = ("group", "batch", "none")
ADV_ESTIMATORS = ("group", "reinforce_pp")  # group_advantages | reinforce_pp_advantages

Array = jax.Array
Aux = dict[str, Array]
sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- checks and helpers


def _fp(x) -> Array:
    """x as a float array of at least float32 precision (bfloat16 -> float32, float64 kept)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check_shape(arg: str, x, shape: tuple[int, ...]) -> None:
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(
            f"`{arg}` has shape {tuple(jnp.shape(x))} but must have shape {tuple(shape)}; "
            "pass per-token arrays as [B, T] and per-response arrays as [B] for the same batch."
        )


def _check_bt(arg: str, x) -> tuple[int, int]:
    if jnp.ndim(x) != 2:
        raise ValueError(f"`{arg}` must be a [B, T] array, got shape {tuple(jnp.shape(x))}.")
    return tuple(jnp.shape(x))


def _check_group_size(group_size, batch: int, minimum: int = 1) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"`group_size` must be a static Python int, got {group_size!r}.")
    if group_size < minimum:
        raise ValueError(
            f"`group_size` is {group_size} but must be >= {minimum}; sample at least {minimum} "
            "responses per prompt (a single response has no group baseline)."
        )
    if batch % group_size:
        raise ValueError(
            f"`group_size`={group_size} does not divide the batch size {batch}; the batch must "
            "hold whole groups of contiguous rows (B = P * group_size)."
        )
    return group_size


def _check_choice(arg: str, value, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"Unknown `{arg}`={value!r}; choose one of {', '.join(options)}.")


def _check_positive(arg: str, value, strict: bool = True) -> None:
    """Checks static Python numbers only (traced values, e.g. a beta schedule, pass through)."""
    if isinstance(value, int | float) and not (value > 0 if strict else value >= 0):
        raise ValueError(f"`{arg}` is {value} but must be {'>' if strict else '>='} 0.")


def _check_max_tokens(agg: str, max_tokens) -> None:
    if agg == "seq-mean-token-sum-norm":
        if max_tokens is None:
            raise ValueError(
                "`max_tokens` is required with agg='seq-mean-token-sum-norm'; pass the maximum "
                "response length (a constant)."
            )
        _check_positive("max_tokens", max_tokens)


def _check_kl_ref(kl_coef, ref_logp) -> None:
    if ref_logp is None and not (isinstance(kl_coef, int | float) and kl_coef == 0):
        raise ValueError("`kl_coef` is non-zero but `ref_logp` is None; pass ref_logp or set 0.")


def _safe_div(num: Array, den: Array) -> Array:
    """num / den, and 0 where den == 0 (e.g. an all-padding batch)."""
    return jnp.where(den > 0, num, 0.0) / jnp.where(den > 0, den, 1.0)


def _masked(x_BxT, m_BxT: Array) -> Array:
    """x at mask > 0, exactly 0 elsewhere (jnp.where, so inf/nan padding never leaks, not even
    into gradients)."""
    return jnp.where(m_BxT > 0, _fp(x_BxT), 0.0)


def _token_mean(x_BxT: Array, m_BxT: Array) -> Array:
    return _safe_div(jnp.sum(x_BxT * m_BxT), jnp.sum(m_BxT))


def _clip_metrics(ratio, adv, w, eps_low, eps_high, prefix: str) -> Aux:
    """Clip fractions (where the clip zeroes the gradient: A > 0 above / A < 0 below the range)
    and ratio statistics, weighted by w (0 = padding); ratio, adv, w broadcast together."""
    ratio, adv, w = jnp.broadcast_arrays(ratio, adv, w)
    is_high = (adv > 0) & (ratio > 1.0 + eps_high)
    is_low = (adv < 0) & (ratio < 1.0 - eps_low)
    on, any_on = w > 0, jnp.any(w > 0)
    return {
        "clip_frac": _token_mean(is_high | is_low, w),
        "clip_frac_low": _token_mean(is_low, w),
        "clip_frac_high": _token_mean(is_high, w),
        f"{prefix}_mean": _token_mean(ratio, w),
        f"{prefix}_min": jnp.where(any_on, jnp.min(jnp.where(on, ratio, jnp.inf)), 0.0),
        f"{prefix}_max": jnp.where(any_on, jnp.max(jnp.where(on, ratio, -jnp.inf)), 0.0),
    }


def _drift_and_adv_metrics(logp_BxT, old_BxT, adv_BxT, m_BxT) -> Aux:
    """kl_old (k3 estimate of KL(pi_old || pi_theta): drift inside the update), adv_mean,
    adv_abs_mean (token means) and response_len_mean (mean mask sum per row)."""
    return {
        "kl_old": _token_mean(_kl_penalty(old_BxT, logp_BxT, "k3"), m_BxT),
        "adv_mean": _token_mean(adv_BxT, m_BxT),
        "adv_abs_mean": _token_mean(jnp.abs(adv_BxT), m_BxT),
        "response_len_mean": jnp.mean(jnp.sum(m_BxT, axis=1)),
    }


def _f32_aux(aux: Mapping[str, Any]) -> Aux:
    return {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}


def _advantages_BxT(advantages, B: int, T: int, allow_tokens: bool, who: str) -> Array:
    """Per-response [B] or per-token [B, T] advantages, broadcast to [B, T], as constants."""
    if jnp.shape(advantages) == (B,):
        return jnp.broadcast_to(sg(_fp(advantages))[:, None], (B, T))
    if allow_tokens and jnp.shape(advantages) == (B, T):
        return sg(_fp(advantages))
    shapes = f"[B]=({B},)" + (f" or [B, T]=({B}, {T})" if allow_tokens else "")
    raise ValueError(
        f"`advantages` has shape {tuple(jnp.shape(advantages))} but {who} needs {shapes}"
        + ("; use token_level=True for per-token advantages." if not allow_tokens else ".")
    )


# ----------------------------------------------------------------------------- advantages, DAPO


def group_advantages(rewards, group_size: int, scale: str = "group", eps: float = 1e-6) -> Array:
    """Group-relative advantages `A_B = r - mean_group(r)`, optionally scaled; float, [B].

    scale: "group" divides by the group std (ddof=1) + eps (GRPO, verl's convention: a group of
      equal rewards gives A = 0); "batch" divides by the std (ddof=1) of all B rewards + eps (group
      mean, batch std); "none" keeps the raw centered reward (Dr. GRPO; what GVPO uses).
    Advantages are constants for the policy gradient, so the result is stop-gradient.
    """
    if jnp.ndim(rewards) != 1:
        raise ValueError(f"`rewards` must be a [B] array, got shape {tuple(jnp.shape(rewards))}.")
    _check_choice("scale", scale, ADV_SCALES)
    B = jnp.shape(rewards)[0]
    G = _check_group_size(group_size, B, minimum=2 if scale == "group" else 1)
    if scale == "batch" and B < 2:
        raise ValueError("`scale`='batch' needs at least 2 rewards in the batch; use 'none'.")
    r_B = sg(_fp(rewards))
    r_PxG = r_B.reshape(-1, G)
    adv_PxG = r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)
    if scale == "group":
        adv_PxG = adv_PxG / (jnp.std(r_PxG, axis=1, ddof=1, keepdims=True) + eps)
    elif scale == "batch":
        adv_PxG = adv_PxG / (jnp.std(r_B, ddof=1) + eps)
    return adv_PxG.reshape(B)


def informative_groups(rewards, group_size: int) -> Array:
    """DAPO dynamic sampling: bool [P], True where a group's rewards are not all equal.

    Uninformative groups have zero advantage and only dilute the batch. In a static-shape batch,
    drop them from the loss with `mask * jnp.repeat(informative, group_size)[:, None]`.
    """
    if jnp.ndim(rewards) != 1:
        raise ValueError(f"`rewards` must be a [B] array, got shape {tuple(jnp.shape(rewards))}.")
    G = _check_group_size(group_size, jnp.shape(rewards)[0])
    r_PxG = jnp.asarray(rewards).reshape(-1, G)
    return jnp.any(r_PxG != r_PxG[:, :1], axis=1)


def overlong_penalty(lengths, *, max_len: int, cache_len: int, factor: float = 1.0) -> Array:
    """DAPO soft overlong punishment, [B] float (<= 0), to be added to the reward.

    0 if L <= max_len - cache_len; -(L - (max_len - cache_len)) / cache_len if L <= max_len;
    -1 beyond; all times `factor`. `lengths` are response lengths in tokens ([B], e.g. mask.sum(1)).
    """
    _check_positive("cache_len", cache_len)
    if isinstance(max_len, int | float) and isinstance(cache_len, int | float):
        if cache_len > max_len:
            raise ValueError(f"`cache_len`={cache_len} must be <= `max_len`={max_len}.")
    L_B = _fp(lengths)
    start = max_len - cache_len
    ramp_B = -(L_B - start) / cache_len
    penalty_B = jnp.where(L_B <= start, 0.0, jnp.where(L_B <= max_len, ramp_B, -1.0))
    return factor * penalty_B


# ----------------------------------------------------------------------------- GVPO


def gvpo_loss(
    logp, anchor_logp, rewards, mask, *, group_size: int, beta: float
) -> tuple[Array, Aux]:
    """GVPO loss (arXiv 2504.19599): mean over groups of `1/(G-1) sum_i 0.5 (rc_i - a_i)^2`.

    logp, anchor_logp, mask: [B, T]; rewards: [B]. `r_theta_i = beta * (seq_logp_i -
    seq_anchor_logp_i)` with token log-probs summed over the mask (no length normalisation);
    `rc` is r_theta centered in its group, `a` the reward centered in its group (no std division,
    which would move the optimum to pi' exp(R / (sigma beta))). The anchor pi_theta' is a constant:
    the log-probs of the policy at the start of the step (anchor="old"; the policy that sampled
    the rollout only when sampling is on-policy), of the policy that sampled (anchor="sampler"),
    or of a frozen reference (anchor="ref").
    Gradient: `dL / d seq_logp_i = beta * d_i / ((G - 1) * P)` with `d = rc - a`; sum_i d_i = 0 in
    every group, which is what removes the partition function Z(x).
    Minimiser: pi' exp(R / beta) / Z for any sampling distribution covering pi' (no importance
    weights, so off-policy groups are fine). Requires G >= 2.

    aux: the loss split as `adv_term + var_term + cov_term` = means over groups of
    `0.5/(G-1) [sum a^2 + sum rc^2 - 2 sum rc a]` (var_term = beta^2/2 * within-group variance of
    the log-ratio, cov_term = -beta * covariance of log-ratio and reward, adv_term = var(R)/2, a
    constant of the data), d_abs_mean, r_theta_mean, log_ratio_mean (nats per sequence), reward_corr
    (correlation of rc and a: 1 at the optimum), reward_mean, reward_std (within-group, ddof=1),
    degenerate_frac (groups with equal rewards), response_len_mean.
    """
    B, T = _check_bt("logp", logp)
    for arg, x in (("anchor_logp", anchor_logp), ("mask", mask)):
        _check_shape(arg, x, (B, T))
    _check_shape("rewards", rewards, (B,))
    G = _check_group_size(group_size, B, minimum=2)
    _check_positive("beta", beta)

    m_BxT = _fp(mask)
    len_B = jnp.sum(m_BxT, axis=1)
    seq_logp_B = jnp.sum(_masked(logp, m_BxT) * m_BxT, axis=1)
    seq_anchor_B = sg(jnp.sum(_masked(anchor_logp, m_BxT) * m_BxT, axis=1))
    log_ratio_PxG = (seq_logp_B - seq_anchor_B).reshape(-1, G)
    r_theta_PxG = beta * log_ratio_PxG
    rewards_PxG = sg(_fp(rewards)).reshape(-1, G)

    rc_PxG = r_theta_PxG - jnp.mean(r_theta_PxG, axis=1, keepdims=True)
    a_PxG = rewards_PxG - jnp.mean(rewards_PxG, axis=1, keepdims=True)
    d_PxG = rc_PxG - a_PxG
    c = 0.5 / (G - 1)
    loss = jnp.mean(c * jnp.sum(d_PxG**2, axis=1))

    sum_aa, sum_rr = jnp.sum(a_PxG**2), jnp.sum(rc_PxG**2)
    sum_ra = jnp.sum(rc_PxG * a_PxG)
    P = B // G
    aux = {
        "loss": loss,
        "adv_term": c * sum_aa / P,
        "var_term": c * sum_rr / P,
        "cov_term": -2.0 * c * sum_ra / P,
        "d_abs_mean": jnp.mean(jnp.abs(d_PxG)),
        "r_theta_mean": jnp.mean(r_theta_PxG),
        "log_ratio_mean": jnp.mean(log_ratio_PxG),
        "reward_corr": _safe_div(sum_ra, jnp.sqrt(sum_aa * sum_rr)),
        "reward_mean": jnp.mean(rewards_PxG),
        "reward_std": jnp.mean(jnp.sqrt(jnp.sum(a_PxG**2, axis=1) / (G - 1))),
        "degenerate_frac": jnp.mean(jnp.all(rewards_PxG == rewards_PxG[:, :1], axis=1)),
        "response_len_mean": jnp.mean(len_B),
    }
    return loss, _f32_aux(aux)


# ----------------------------------------------------------------------------- GRPO family


def _kl_penalty(logp_BxT: Array, ref_BxT: Array, estimator: str) -> Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta."""
    delta = ref_BxT - logp_BxT
    k2 = 0.5 * delta**2
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return k2
    # k3 as verl's low_var_kl: clamps keep one wild token from dominating the batch.
    clamped = jnp.clip(delta, -20.0, 20.0)
    k3 = jnp.clip(jnp.exp(clamped) - clamped - 1.0, -10.0, 10.0)
    if estimator == "k3":
        return k3
    return sg(k3) + k2 - sg(k2)  # "k3+": unbiased k3 value, k2's well-behaved gradient


def _aggregate(loss_BxT: Array, m_BxT: Array, agg: str, max_tokens=None) -> Array:
    """Reduce a per-token loss to a scalar. seq-mean-* modes average over the rows that hold at
    least one token (fully padded rows fill a static batch; they are not responses)."""
    tok_sum_B = jnp.sum(loss_BxT * m_BxT, axis=1)
    len_B = jnp.sum(m_BxT, axis=1)
    if agg == "token-mean":
        return _safe_div(jnp.sum(tok_sum_B), jnp.sum(len_B))
    if agg == "seq-mean-token-mean":
        seq_B = _safe_div(tok_sum_B, len_B)
    elif agg == "seq-mean-token-sum":
        seq_B = tok_sum_B
    else:  # seq-mean-token-sum-norm (Dr. GRPO): a constant divisor, so no length bias
        seq_B = tok_sum_B / max_tokens
    valid_B = len_B > 0
    return _safe_div(jnp.sum(jnp.where(valid_B, seq_B, 0.0)), jnp.sum(valid_B))


def _check_token_loss(
    logp, old_logp, mask, ref_logp, *, agg, kl_estimator, eps_low, eps_high, max_tokens
) -> tuple[int, int]:
    """The argument checks of the token-level ratio losses (grpo_loss, cispo_loss) -> (B, T)."""
    B, T = _check_bt("logp", logp)
    _check_shape("old_logp", old_logp, (B, T))
    _check_shape("mask", mask, (B, T))
    if ref_logp is not None:
        _check_shape("ref_logp", ref_logp, (B, T))
    _check_choice("agg", agg, AGG_MODES)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    _check_positive("eps_low", eps_low, strict=False)
    _check_positive("eps_high", eps_high, strict=False)
    _check_max_tokens(agg, max_tokens)
    return B, T


def _with_kl(
    pg_BxT, logp_BxT, ref_logp, m_BxT, aux: dict, *, kl_coef, kl_estimator, agg, max_tokens
) -> Array:
    """pg + kl_coef * KL(pi_theta || pi_ref) per token when ref_logp is given (adding aux kl, the
    token mean of the estimator, and kl_loss, its aggregated contribution); else pg."""
    if ref_logp is None:
        return pg_BxT
    kl_BxT = _kl_penalty(logp_BxT, sg(_masked(ref_logp, m_BxT)), kl_estimator)
    aux["kl"] = _token_mean(kl_BxT, m_BxT)
    aux["kl_loss"] = kl_coef * _aggregate(kl_BxT, m_BxT, agg, max_tokens)
    return pg_BxT + kl_coef * kl_BxT


def grpo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    ref_logp=None,
    kl_estimator: str = "k3",
    agg: str = "seq-mean-token-mean",
    max_tokens: int | None = None,
) -> tuple[Array, Aux]:
    """Clipped-ratio policy loss of GRPO, Dr. GRPO and DAPO (one function, settings differ).

    logp, old_logp, mask (and ref_logp): [B, T]; advantages: [B] or [B, T] (constants).
    Per token: `rho = exp(clip(logp - old_logp, -20, 20))`,
    `l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))`; with `dual_clip=c` (> 1) and A < 0,
    `l = min(l, -A c)`. Plus `kl_coef * KL` per token, an estimate of KL(pi_theta || pi_ref): "k1"
    logp - ref, "k2" 0.5 (logp - ref)^2, "k3" exp(ref - logp) - (ref - logp) - 1 (clamped as verl's
    low_var_kl), "k3+" k3's value with k2's gradient. Then aggregated with `agg` (AGG_MODES;
    "seq-mean-token-sum-norm" divides each sequence's token sum by the constant `max_tokens`);
    seq-mean-* modes skip rows without any token.

    aux: pg_loss, clip_frac (= clip_frac_low + clip_frac_high: tokens whose gradient the clip
    zeroes, A < 0 below / A > 0 above the range), dual_clip_frac, ratio_mean / min / max, kl_old
    (k3 estimate of KL(pi_old || pi_theta), drift inside the update), adv_mean, adv_abs_mean,
    response_len_mean; with ref_logp: kl (token mean of the chosen estimator) and kl_loss.
    """
    B, T = _check_token_loss(
        logp,
        old_logp,
        mask,
        ref_logp,
        agg=agg,
        kl_estimator=kl_estimator,
        eps_low=eps_low,
        eps_high=eps_high,
        max_tokens=max_tokens,
    )
    if dual_clip is not None and isinstance(dual_clip, int | float) and dual_clip <= 1.0:
        raise ValueError(f"`dual_clip` is {dual_clip} but must be > 1 (e.g. 3.0), or None.")
    _check_kl_ref(kl_coef, ref_logp)

    m_BxT = _fp(mask)
    logp_BxT = _masked(logp, m_BxT)
    old_BxT = sg(_masked(old_logp, m_BxT))
    adv_BxT = _advantages_BxT(advantages, B, T, allow_tokens=True, who="grpo_loss")

    ratio_BxT = jnp.exp(jnp.clip(logp_BxT - old_BxT, -20.0, 20.0))
    pg_BxT = jnp.maximum(
        -adv_BxT * ratio_BxT, -adv_BxT * jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
    )
    aux = _clip_metrics(ratio_BxT, adv_BxT, m_BxT, eps_low, eps_high, "ratio")
    if dual_clip is not None:
        # Dual clip bounds the loss of a negative-advantage token whose ratio exploded.
        dual_BxT = -adv_BxT * dual_clip
        is_dual = (adv_BxT < 0) & (dual_BxT < pg_BxT)
        pg_BxT = jnp.where(adv_BxT < 0, jnp.minimum(pg_BxT, dual_BxT), pg_BxT)
        aux["dual_clip_frac"] = _token_mean(is_dual, m_BxT)

    loss_BxT = _with_kl(
        pg_BxT,
        logp_BxT,
        ref_logp,
        m_BxT,
        aux,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        agg=agg,
        max_tokens=max_tokens,
    )
    loss = _aggregate(loss_BxT, m_BxT, agg, max_tokens)

    aux |= {
        "loss": loss,
        "pg_loss": _aggregate(pg_BxT, m_BxT, agg, max_tokens),
        **_drift_and_adv_metrics(logp_BxT, old_BxT, adv_BxT, m_BxT),
    }
    return loss, _f32_aux(aux)


# ----------------------------------------------------------------------------- GSPO


def gspo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    token_level: bool = False,
) -> tuple[Array, Aux]:
    """GSPO (arXiv 2507.18071): clipping on the length-normalised sequence ratio.

    logp, old_logp, mask: [B, T]; advantages: [B] (or [B, T] with token_level=True).
    `log s_i = min(sum_t (logp - old_logp) m / L_i, 10)`, `l_i = max(-A_i s_i, -A_i clip(s_i,
    1 - eps_low, 1 + eps_high))`, loss = mean over sequences with at least one token (never
    token-weighted). GSPO-token (`token_level=True`): `log s_it = sg[log s_i] + logp_t - sg[logp_t]`
    (same clamp), per-token advantages allowed, aggregated seq-mean-token-mean; with per-sequence
    advantages it equals GSPO in value and gradient.

    aux: pg_loss, clip_frac (+ _low / _high), seq_ratio_mean / min / max (all over sequences, or
    over tokens when token_level), kl_old, adv_mean, adv_abs_mean, response_len_mean.
    """
    B, T = _check_bt("logp", logp)
    _check_shape("old_logp", old_logp, (B, T))
    _check_shape("mask", mask, (B, T))
    _check_positive("eps_low", eps_low, strict=False)
    _check_positive("eps_high", eps_high, strict=False)
    who = "gspo_loss(token_level=True)" if token_level else "gspo_loss"
    adv_BxT = _advantages_BxT(advantages, B, T, allow_tokens=token_level, who=who)

    m_BxT = _fp(mask)
    logp_BxT = _masked(logp, m_BxT)
    old_BxT = sg(_masked(old_logp, m_BxT))
    len_B = jnp.sum(m_BxT, axis=1)
    valid_B = len_B > 0
    seq_log_ratio_B = _safe_div(jnp.sum((logp_BxT - old_BxT) * m_BxT, axis=1), len_B)

    if token_level:
        log_s_BxT = sg(seq_log_ratio_B)[:, None] + logp_BxT - sg(logp_BxT)
        s_BxT, w_BxT, adv = jnp.exp(jnp.minimum(log_s_BxT, 10.0)), m_BxT, adv_BxT
    else:
        # A sequence is one "token" of weight valid_B: same clip and metric code for both modes.
        s_BxT = jnp.exp(jnp.minimum(seq_log_ratio_B, 10.0))[:, None]
        w_BxT, adv = valid_B[:, None].astype(m_BxT.dtype), adv_BxT[:, :1]
    pg = jnp.maximum(-adv * s_BxT, -adv * jnp.clip(s_BxT, 1.0 - eps_low, 1.0 + eps_high))
    loss = _aggregate(pg, w_BxT, "seq-mean-token-mean")
    aux = _clip_metrics(s_BxT, adv, w_BxT, eps_low, eps_high, "seq_ratio")
    aux |= {"loss": loss, "pg_loss": loss}
    aux |= _drift_and_adv_metrics(logp_BxT, old_BxT, adv_BxT, m_BxT)
    return loss, _f32_aux(aux)


# ----------------------------------------------------------------------------- CISPO


def cispo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 1.0,
    eps_high: float = 4.0,
    kl_coef: float = 0.0,
    ref_logp=None,
    kl_estimator: str = "k3",
    agg: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[Array, Aux]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

    logp, old_logp, mask (and ref_logp): [B, T]; advantages: [B] or [B, T] (constants).
    Per token: `rho = exp(clip(logp - old_logp, -20, 20))`, `w = sg(clip(rho, 1 - eps_low,
    1 + eps_high))`, `l = -w A logp` (the paper's `sg(r_hat) A log pi`), so
    `dl / d logp = -w A` for every token: a token outside the range keeps a (down-weighted)
    gradient instead of none, which is the point against PPO's clip. Defaults: no lower bound
    (`eps_low=1` clips at 0: the paper sets its lower bound out of reach) and an upper bound of 5
    (`eps_high=4`, the epsilon_max = 5 of ScaleRL, arXiv 2510.13786, TRL's recommended value),
    aggregated `token-mean` over the batch (the paper's `1 / sum_i |o_i|`). Optional KL to a
    reference and `agg` as in `grpo_loss`.

    The loss value contains `logp` itself (as the paper's objective and verl / TRL), so it is not
    an estimate of the return; `weighted_adv_mean` (token mean of `w A`) is.
    aux: pg_loss, clip_frac (= clip_frac_low + clip_frac_high: tokens whose weight the clip
    changed, rho below / above the range; their gradient is scaled, not zeroed), ratio_mean / min
    / max, weighted_adv_mean, kl_old, adv_mean, adv_abs_mean, response_len_mean; with ref_logp: kl
    and kl_loss.
    """
    B, T = _check_token_loss(
        logp,
        old_logp,
        mask,
        ref_logp,
        agg=agg,
        kl_estimator=kl_estimator,
        eps_low=eps_low,
        eps_high=eps_high,
        max_tokens=max_tokens,
    )
    _check_kl_ref(kl_coef, ref_logp)

    m_BxT = _fp(mask)
    logp_BxT = _masked(logp, m_BxT)
    old_BxT = sg(_masked(old_logp, m_BxT))
    adv_BxT = _advantages_BxT(advantages, B, T, allow_tokens=True, who="cispo_loss")
    ratio_BxT = jnp.exp(jnp.clip(sg(logp_BxT) - old_BxT, -20.0, 20.0))
    w_BxT = jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)  # a constant: ratio is sg
    pg_BxT = -w_BxT * adv_BxT * logp_BxT

    is_high, is_low = ratio_BxT > 1.0 + eps_high, ratio_BxT < 1.0 - eps_low
    on, any_on = m_BxT > 0, jnp.any(m_BxT > 0)
    aux = {
        "clip_frac": _token_mean(is_high | is_low, m_BxT),
        "clip_frac_low": _token_mean(is_low, m_BxT),
        "clip_frac_high": _token_mean(is_high, m_BxT),
        "ratio_mean": _token_mean(ratio_BxT, m_BxT),
        "ratio_min": jnp.where(any_on, jnp.min(jnp.where(on, ratio_BxT, jnp.inf)), 0.0),
        "ratio_max": jnp.where(any_on, jnp.max(jnp.where(on, ratio_BxT, -jnp.inf)), 0.0),
        "weighted_adv_mean": _token_mean(w_BxT * adv_BxT, m_BxT),
    }
    loss_BxT = _with_kl(
        pg_BxT,
        logp_BxT,
        ref_logp,
        m_BxT,
        aux,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        agg=agg,
        max_tokens=max_tokens,
    )
    loss = _aggregate(loss_BxT, m_BxT, agg, max_tokens)
    aux |= {
        "loss": loss,
        "pg_loss": _aggregate(pg_BxT, m_BxT, agg, max_tokens),
        **_drift_and_adv_metrics(logp_BxT, old_BxT, adv_BxT, m_BxT),
    }
    return loss, _f32_aux(aux)


# ----------------------------------------------------------------------------- GMPO


def gmpo_loss(
    logp, old_logp, advantages, mask, *, eps_low: float = 0.4, eps_high: float = 0.4
) -> tuple[Array, Aux]:
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673): the group objective on the
    geometric mean of the token ratios, clipped token by token in log space.

    logp, old_logp, mask: [B, T]; advantages: [B] (one per sequence, constants).
    Per token `d_t = clip(logp - old_logp, -20, 20)` and its PPO-pessimistic clip in log space,
    `c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high))` (A > 0: d capped at
    eps_high; A < 0: d floored at -eps_low; a clipped token gets no gradient). Per sequence
    `s_i = exp(sum_t c_t m_t / L_i)` (the geometric mean of the clipped token ratios) and
    `l_i = -A_i s_i`, averaged over sequences with at least one token. Defaults: the paper's
    token range (e^-0.4, e^0.4). The geometric mean damps a single outlier ratio that an
    arithmetic token mean (GRPO) passes on, so the range can be wider than GRPO's.

    aux: pg_loss, clip_frac (+ _low / _high: tokens whose gradient the clip zeroes), seq_ratio_mean
    / min / max (of s over sequences), kl_old, adv_mean, adv_abs_mean, response_len_mean.
    """
    B, T = _check_bt("logp", logp)
    _check_shape("old_logp", old_logp, (B, T))
    _check_shape("mask", mask, (B, T))
    _check_positive("eps_low", eps_low, strict=False)
    _check_positive("eps_high", eps_high, strict=False)
    adv_BxT = _advantages_BxT(advantages, B, T, allow_tokens=False, who="gmpo_loss")

    m_BxT = _fp(mask)
    logp_BxT = _masked(logp, m_BxT)
    old_BxT = sg(_masked(old_logp, m_BxT))
    d_BxT = jnp.clip(logp_BxT - old_BxT, -20.0, 20.0)
    sgn_BxT = jnp.sign(adv_BxT)
    clipped_BxT = jnp.clip(d_BxT, -eps_low, eps_high)
    c_BxT = sgn_BxT * jnp.minimum(sgn_BxT * d_BxT, sgn_BxT * clipped_BxT)
    len_B = jnp.sum(m_BxT, axis=1)
    valid_B = len_B > 0
    s_B = jnp.exp(_safe_div(jnp.sum(c_BxT * m_BxT, axis=1), len_B))
    pg_B = -adv_BxT[:, 0] * s_B
    loss = _safe_div(jnp.sum(jnp.where(valid_B, pg_B, 0.0)), jnp.sum(valid_B))

    is_high = (adv_BxT > 0) & (d_BxT > eps_high)
    is_low = (adv_BxT < 0) & (d_BxT < -eps_low)
    seq = _clip_metrics(s_B, adv_BxT[:, 0], valid_B, eps_low, eps_high, "seq_ratio")
    aux = {
        "loss": loss,
        "pg_loss": loss,
        "clip_frac": _token_mean(is_high | is_low, m_BxT),
        "clip_frac_low": _token_mean(is_low, m_BxT),
        "clip_frac_high": _token_mean(is_high, m_BxT),
        **{k: v for k, v in seq.items() if k.startswith("seq_ratio")},
        **_drift_and_adv_metrics(logp_BxT, old_BxT, adv_BxT, m_BxT),
    }
    return loss, _f32_aux(aux)


# ----------------------------------------------------------------------------- RLOO


def rloo_advantages(rewards, group_size: int) -> Array:
    """Leave-one-out advantages `A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean r)`, [B].

    Each response's baseline is the mean reward of the other G - 1 responses of its prompt, so
    the baseline is independent of the response it scores (an unbiased policy gradient). G = 1
    has no other response and is refused. Stop-gradient.
    """
    if jnp.ndim(rewards) != 1:
        raise ValueError(f"`rewards` must be a [B] array, got shape {tuple(jnp.shape(rewards))}.")
    G = _check_group_size(group_size, jnp.shape(rewards)[0], minimum=2)
    r_PxG = sg(_fp(rewards)).reshape(-1, G)
    adv_PxG = (r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)) * (G / (G - 1))
    return adv_PxG.reshape(-1)


def rloo_loss(
    logp,
    old_logp,
    rewards,
    mask,
    *,
    group_size: int,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.05,
    ref_logp=None,
) -> tuple[Array, Aux]:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): REINFORCE with the whole response as one
    action and a leave-one-out baseline, the KL to the reference inside the reward.

    logp, old_logp, mask (and ref_logp): [B, T]; rewards: [B] (task rewards).
    `R'_i = r_i - kl_coef * sum_t (old_logp - ref_logp) m` (the sequence's k1 KL under the rollout
    policy: a constant), `A = rloo_advantages(R', G)`, sequence ratio `rho_i = exp(clip(sum_t
    (logp - old_logp) m, -20, 20))`, `l_i = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))`,
    mean over sequences with at least one token. With one update per rollout rho = 1 and the
    gradient is the paper's `-A_i grad sum_t logp`; the clip (TRL's RLOO trainer, the same
    defaults: eps 0.2, kl_coef 0.05) only acts on later updates of the same rollout. G >= 2.

    aux: pg_loss, clip_frac (+ _low / _high, over sequences), seq_ratio_mean / min / max,
    kl_reward (mean over sequences of the KL in the reward; with ref_logp), kl_old, adv_mean,
    adv_abs_mean, response_len_mean.
    """
    B, T = _check_bt("logp", logp)
    for arg, x in (("old_logp", old_logp), ("mask", mask)):
        _check_shape(arg, x, (B, T))
    _check_shape("rewards", rewards, (B,))
    if ref_logp is not None:
        _check_shape("ref_logp", ref_logp, (B, T))
    G = _check_group_size(group_size, B, minimum=2)
    _check_positive("eps_low", eps_low, strict=False)
    _check_positive("eps_high", eps_high, strict=False)
    _check_kl_ref(kl_coef, ref_logp)

    m_BxT = _fp(mask)
    logp_BxT = _masked(logp, m_BxT)
    old_BxT = sg(_masked(old_logp, m_BxT))
    len_B = jnp.sum(m_BxT, axis=1)
    valid_B = len_B > 0
    shaped_B = sg(_fp(rewards))
    aux = {}
    if ref_logp is not None:
        kl_B = jnp.sum((old_BxT - sg(_masked(ref_logp, m_BxT))) * m_BxT, axis=1)
        shaped_B = shaped_B - kl_coef * kl_B
        aux["kl_reward"] = _safe_div(jnp.sum(jnp.where(valid_B, kl_B, 0.0)), jnp.sum(valid_B))
    adv_B = rloo_advantages(shaped_B, G)
    rho_B = jnp.exp(jnp.clip(jnp.sum((logp_BxT - old_BxT) * m_BxT, axis=1), -20.0, 20.0))
    pg_B = jnp.maximum(-adv_B * rho_B, -adv_B * jnp.clip(rho_B, 1.0 - eps_low, 1.0 + eps_high))
    loss = _safe_div(jnp.sum(jnp.where(valid_B, pg_B, 0.0)), jnp.sum(valid_B))
    aux |= _clip_metrics(rho_B, adv_B, valid_B, eps_low, eps_high, "seq_ratio")
    adv_BxT = jnp.broadcast_to(adv_B[:, None], (B, T))
    aux |= {
        "loss": loss,
        "pg_loss": loss,
        **_drift_and_adv_metrics(logp_BxT, old_BxT, adv_BxT, m_BxT),
    }
    return loss, _f32_aux(aux)


# ----------------------------------------------------------------------------- REINFORCE++


def reinforce_pp_advantages(
    rewards,
    mask,
    *,
    group_size: int = 1,
    baseline: bool = False,
    reward_kl_coef: float = 0.0,
    old_logp=None,
    ref_logp=None,
) -> Array:
    """REINFORCE++ advantages (Hu et al. 2025, arXiv 2501.03262): [B, T], 0 on padding.

    baseline=False (REINFORCE++): the KL to the reference is a per-token reward, `u_t =
    -reward_kl_coef * (old_logp_t - ref_logp_t)`, the task reward r comes at the last token, and
    each token's return is what follows it (gamma = 1): `G_t = r - reward_kl_coef * sum_{s >= t}
    (old_logp_s - ref_logp_s)`. baseline=True (REINFORCE++-baseline): `G_t = r - mean_group(r)`
    for every token (the KL goes in the loss instead). Both are then normalised over every token
    of the whole batch, not per group ("global advantage normalisation"): `A = (G - mean) /
    sqrt(max(var, 1e-8))`, mean and (population) variance over the batch's response tokens, as the
    authors' OpenRLHF. A batch whose returns are all equal gets A = 0. Stop-gradient.

    The statistics are those of the batch passed in: give it the whole rollout batch (the
    trainer does, before splitting it into minibatches and micro-batches).
    """
    B, T = _check_bt("mask", mask)
    _check_shape("rewards", rewards, (B,))
    G = _check_group_size(group_size, B, minimum=2 if baseline else 1)
    m_BxT = _fp(mask)
    r_B = sg(_fp(rewards))
    if baseline:
        r_PxG = r_B.reshape(-1, G)
        r_B = (r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)).reshape(B)
    ret_BxT = jnp.broadcast_to(r_B[:, None], (B, T))
    if not (isinstance(reward_kl_coef, int | float) and reward_kl_coef == 0):
        if old_logp is None or ref_logp is None:
            raise ValueError(
                "`reward_kl_coef` is non-zero but `old_logp` or `ref_logp` is None; pass both "
                "(the rollout policy's and the reference's log-probs) or set it to 0."
            )
        _check_shape("old_logp", old_logp, (B, T))
        _check_shape("ref_logp", ref_logp, (B, T))
        kl_BxT = (sg(_masked(old_logp, m_BxT)) - sg(_masked(ref_logp, m_BxT))) * m_BxT
        to_go_BxT = jnp.flip(jnp.cumsum(jnp.flip(kl_BxT, axis=1), axis=1), axis=1)
        ret_BxT = ret_BxT - reward_kl_coef * to_go_BxT
    # Statistics of the returns shifted by one of them, so that equal returns are exactly 0
    # (a float32 mean of equal values need not equal them; 1 / sqrt(1e-8) would amplify that).
    on_BxT = m_BxT > 0
    shift = jnp.max(jnp.where(on_BxT, ret_BxT, -jnp.inf))
    x_BxT = jnp.where(on_BxT, ret_BxT - jnp.where(jnp.any(on_BxT), shift, 0.0), 0.0)
    n = jnp.sum(m_BxT)
    mean = _safe_div(jnp.sum(x_BxT * m_BxT), n)
    centred_BxT = jnp.where(jnp.all(jnp.where(on_BxT, x_BxT == 0, True)), 0.0, x_BxT - mean)
    var = _safe_div(jnp.sum(centred_BxT**2 * m_BxT), n)
    return jnp.where(on_BxT, centred_BxT * jax.lax.rsqrt(jnp.maximum(var, 1e-8)), 0.0)


# ----------------------------------------------------------------------------- entropy bonus


def entropy_bonus(entropy, mask, *, coef: float, agg: str = "token-mean", max_tokens=None):
    """`-coef * agg(entropy)`: the loss term of an entropy bonus (coef > 0 rewards entropy).

    entropy, mask: [B, T]; `entropy[b, t]` is the policy's full-distribution entropy at each
    response token, differentiable (e.g. `gvpo_jax.models.chunked_logprobs(...,
    with_entropy=True)`, which never holds [B, T, V] logits). Aggregated with `agg` as the
    policy loss is; padding never reaches the value or the gradient.
    """
    B, T = _check_bt("entropy", entropy)
    _check_shape("mask", mask, (B, T))
    _check_choice("agg", agg, AGG_MODES)
    _check_max_tokens(agg, max_tokens)
    m_BxT = _fp(mask)
    return -coef * _aggregate(_masked(entropy, m_BxT), m_BxT, agg, max_tokens)


# ----------------------------------------------------------------------------- token log-probs


def token_logprobs_from_logits(logits_BxTxV, targets_BxT, mask_BxT=None) -> Array:
    """Reference `log p(targets[b, t])` under `logits[b, t]`: [B, T] float32, 0 where mask == 0.

    logits[b, t] must already be the prediction for targets[b, t] (shift before calling: for a
    causal LM, logits[:, :-1] predict tokens[:, 1:]). log-softmax in float32 whatever the logits
    dtype. Materialises [B, T, V] in float32: fine for tests and small vocabularies.
    """
    B, T, _ = jnp.shape(logits_BxTxV)
    _check_shape("targets_BxT", targets_BxT, (B, T))
    logp_BxTxV = jax.nn.log_softmax(jnp.asarray(logits_BxTxV).astype(jnp.float32), axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, jnp.asarray(targets_BxT)[..., None], axis=-1)[..., 0]
    if mask_BxT is None:
        return logp_BxT
    _check_shape("mask_BxT", mask_BxT, (B, T))
    return jnp.where(jnp.asarray(mask_BxT) > 0, logp_BxT, 0.0)


# ----------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class LossPreset:
    """A named algorithm: which loss, its default settings, and what the trainer must provide.

    kind: "gvpo" | "clip" (grpo_loss) | "gspo" | "cispo" | "gmpo" | "rloo" (the loss function's
    calling convention). kwargs: default keyword arguments of loss_fn.
    adv_estimator: "group" (`group_advantages` with `adv_scale`: "group" | "batch" | "none") or
    "reinforce_pp" (`reinforce_pp_advantages` with `adv_kwargs`); gvpo and rloo take the rewards
    themselves. dynamic_sampling / overlong_penalty: DAPO's batch filtering and reward shaping,
    applied by the trainer (see informative_groups, overlong_penalty).
    uses_old_logp: the loss needs pi_old's log-probs, the policy at the start of the step (for
    gvpo: as the default anchor).
    off_policy: the loss is correct on groups the rollout policy did not sample (replayed
    groups, demonstrations); only GVPO's is, every ratio- or IS-weighted loss assumes pi_old did.
    """

    name: str
    kind: str
    loss_fn: Callable[..., tuple[Array, Aux]]
    kwargs: Mapping[str, Any] = dataclasses.field(hash=False)
    adv_scale: str
    reference: str
    dynamic_sampling: bool = False
    overlong_penalty: bool = False
    uses_old_logp: bool = True
    adv_estimator: str = "group"
    adv_kwargs: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}), hash=False
    )
    off_policy: bool = False


def _preset(name, kind, loss_fn, adv_scale, reference, **kwargs) -> LossPreset:
    flags = {
        k: kwargs.pop(k)
        for k in ("dynamic_sampling", "overlong_penalty", "adv_estimator", "off_policy")
        if k in kwargs
    }
    if "adv_kwargs" in kwargs:
        flags["adv_kwargs"] = types.MappingProxyType(kwargs.pop("adv_kwargs"))
    return LossPreset(
        name, kind, loss_fn, types.MappingProxyType(kwargs), adv_scale, reference, **flags
    )


_CLIP = dict(dual_clip=None, kl_estimator="k3")
_RPP = "Hu et al. 2025, REINFORCE++, arXiv:2501.03262"
LOSSES: dict[str, LossPreset] = {
    p.name: p
    for p in (
        _preset(
            "gvpo",
            "gvpo",
            gvpo_loss,
            "none",
            "Zhang et al. 2025, GVPO: Group Variance Policy Optimization, arXiv:2504.19599",
            beta=0.1,
            off_policy=True,
        ),
        _preset(
            "grpo",
            "clip",
            grpo_loss,
            "group",
            "Shao et al. 2024, DeepSeekMath (GRPO), arXiv:2402.03300",
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.04,
            agg="seq-mean-token-mean",
            **_CLIP,
        ),
        _preset(
            "dr_grpo",
            "clip",
            grpo_loss,
            "none",
            "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO), arXiv:2503.20783",
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.0,
            agg="seq-mean-token-sum-norm",
            **_CLIP,
        ),
        _preset(
            "dapo",
            "clip",
            grpo_loss,
            "group",
            "Yu et al. 2025, DAPO, arXiv:2503.14476",
            eps_low=0.2,
            eps_high=0.28,
            kl_coef=0.0,
            agg="token-mean",
            **_CLIP,
            dynamic_sampling=True,
            overlong_penalty=True,
        ),
        _preset(
            "gspo",
            "gspo",
            gspo_loss,
            "group",
            "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071",
            eps_low=3e-4,
            eps_high=4e-4,
            token_level=False,
        ),
        _preset(
            "gspo_token",
            "gspo",
            gspo_loss,
            "group",
            "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071",
            eps_low=3e-4,
            eps_high=4e-4,
            token_level=True,
        ),
        _preset(
            "cispo",
            "cispo",
            cispo_loss,
            "group",
            "MiniMax 2025, MiniMax-M1 (CISPO), arXiv:2506.13585",
            eps_low=1.0,
            eps_high=4.0,
            kl_coef=0.0,
            agg="token-mean",
            kl_estimator="k3",
        ),
        _preset(
            "gmpo",
            "gmpo",
            gmpo_loss,
            "group",
            "Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673",
            eps_low=0.4,
            eps_high=0.4,
        ),
        _preset(
            "rloo",
            "rloo",
            rloo_loss,
            "none",
            "Ahmadian et al. 2024, Back to Basics (RLOO), arXiv:2402.14740",
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.05,
        ),
        _preset(
            "reinforce_pp",
            "clip",
            grpo_loss,
            "batch",
            _RPP,
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.0,
            agg="token-mean",
            **_CLIP,
            adv_estimator="reinforce_pp",
            adv_kwargs=dict(baseline=False, reward_kl_coef=0.01),
        ),
        _preset(
            "reinforce_pp_baseline",
            "clip",
            grpo_loss,
            "batch",
            _RPP,
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.001,
            agg="token-mean",
            dual_clip=None,
            kl_estimator="k2",
            adv_estimator="reinforce_pp",
            adv_kwargs=dict(baseline=True, reward_kl_coef=0.0),
        ),
    )
}

# Arguments preset_loss fills itself; every other keyword-only parameter may be overridden.
_FILLED = ("group_size", "ref_logp", "max_tokens")
_TAKES_REWARDS = ("gvpo", "rloo")  # kinds whose loss takes the rewards, not advantages


def overridable(name: str) -> set[str]:
    """The settings of preset `name` that `preset_loss(name, ..., **overrides)` accepts."""
    return _overridable(get_preset(name))


def _overridable(preset: LossPreset) -> set[str]:
    params = inspect.signature(preset.loss_fn).parameters.values()
    names = {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _FILLED}
    if preset.adv_estimator == "reinforce_pp":
        names.add("reward_kl_coef")
    elif preset.kind not in _TAKES_REWARDS:
        names.add("adv_scale")
    return names


def get_preset(name: str) -> LossPreset:
    """LOSSES[name] with a ValueError naming the known presets."""
    if name not in LOSSES:
        raise ValueError(f"Unknown loss preset {name!r}; choose one of {', '.join(LOSSES)}.")
    return LOSSES[name]


def _settings(name: str, overrides: Mapping[str, Any]) -> tuple[LossPreset, dict, dict]:
    """(preset, loss kwargs, advantage kwargs) of preset `name` with `overrides` applied."""
    preset = get_preset(name)
    unknown = sorted(set(overrides) - _overridable(preset))
    if unknown:
        raise ValueError(
            f"Unknown override(s) {unknown} for preset {name!r}; allowed: "
            f"{', '.join(sorted(_overridable(preset)))}."
        )
    kwargs = {**preset.kwargs, **preset.adv_kwargs, "adv_scale": preset.adv_scale, **overrides}
    adv_kwargs = {k: kwargs.pop(k) for k in (*preset.adv_kwargs, "adv_scale")}
    return preset, kwargs, adv_kwargs


def uses_batch_statistics(name: str, **overrides) -> bool:
    """True when preset `name`'s advantages depend on the whole batch, not only on each group
    (REINFORCE++'s global normalisation, adv_scale="batch"): computed on a part of the batch,
    they differ. Give `preset_advantages` the whole rollout batch and the loss its slice."""
    preset, _, adv = _settings(name, overrides)
    if preset.kind in _TAKES_REWARDS:
        return False
    return preset.adv_estimator == "reinforce_pp" or adv["adv_scale"] == "batch"


ROLLOUT_CORRECTIONS = ("none", "token_tis", "seq_mis")
ROLLOUT_IS_CAP = 2.0  # the correction's default cap on the weight pi_old / mu


def takes_token_weights(name: str) -> bool:
    """Whether preset `name` takes per-token advantages, so token-level importance weights can
    scale them (`rollout_correction(mode="token_tis")`): the token-level clipped losses. GSPO,
    GMPO and RLOO treat the response as one action; GVPO needs no weights."""
    preset = get_preset(name)
    return preset.kind in ("clip", "cispo") or (
        preset.kind == "gspo" and bool(preset.kwargs.get("token_level"))
    )


def rollout_correction(old_logp, behaviour_logp, mask, *, mode: str, cap: float):
    """Importance correction for responses drawn from a behaviour distribution mu that is not
    the policy pi_old the clipped ratio is taken against (a stale sampler, a bf16 sampler, a
    tempered or truncated sampling distribution). Per token w = pi_old / mu = exp(old_logp -
    behaviour_logp) (log clamped to +-20, held constant):

    - "token_tis": truncated IS (verl's token-level TIS): token weights min(w, cap), which
      multiply the token advantages (`takes_token_weights`); the mask is unchanged.
    - "seq_mis": masked IS: a response whose sequence weight prod_t w leaves [1/cap, cap] is
      masked out of the loss (its tokens leave the aggregation's denominators too); no weights.
    - "none": nothing (weights None, mask unchanged), metrics still reported.

    old_logp, behaviour_logp, mask: [B, T]. Returns (weights_BxT or None, mask_BxT, aux) with
    aux is_weight_mean / is_weight_max (token weights, before truncation, over response
    tokens), is_clipped_frac (tokens truncated, token_tis), is_masked_frac (responses masked,
    seq_mis), is_seq_log_weight_abs_max.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"mode is {mode!r}; use one of {', '.join(ROLLOUT_CORRECTIONS)}.")
    if not cap > 1.0:
        raise ValueError(f"cap is {cap}; use a truncation cap > 1 (such as 2).")
    m_BxT = _fp(mask)
    log_w_BxT = jax.lax.stop_gradient(
        jnp.clip(_fp(old_logp) - _fp(behaviour_logp), -20.0, 20.0) * m_BxT
    )
    w_BxT = jnp.exp(log_w_BxT)
    n_tokens = jnp.maximum(jnp.sum(m_BxT), 1.0)
    seq_log_w_B = jnp.sum(log_w_BxT, axis=-1)
    has_tokens_B = jnp.sum(m_BxT, axis=-1) > 0
    aux = {
        "is_weight_mean": jnp.sum(w_BxT * m_BxT) / n_tokens,
        "is_weight_max": jnp.max(jnp.where(m_BxT > 0, w_BxT, 0.0)),
        "is_seq_log_weight_abs_max": jnp.max(jnp.abs(seq_log_w_B)),
    }
    weights, new_mask = None, mask
    if mode == "token_tis":
        weights = jnp.minimum(w_BxT, cap) * m_BxT
        aux["is_clipped_frac"] = jnp.sum((w_BxT > cap) * m_BxT) / n_tokens
    elif mode == "seq_mis":
        keep_B = jnp.abs(seq_log_w_B) <= jnp.log(cap)
        new_mask = m_BxT * keep_B[:, None].astype(m_BxT.dtype)
        outside = jnp.sum((~keep_B & has_tokens_B).astype(jnp.float32))
        aux["is_masked_frac"] = outside / jnp.maximum(jnp.sum(has_tokens_B), 1)
    return weights, new_mask, _f32_aux(aux)


def preset_advantages(
    name: str, *, rewards, mask, group_size: int, old_logp=None, ref_logp=None, **overrides
) -> Array:
    """The advantages preset `name`'s loss is given: [B] (group estimators) or [B, T]
    (REINFORCE++). Not defined for gvpo and rloo, whose losses take the rewards themselves."""
    preset, _, adv = _settings(name, overrides)
    if preset.kind in _TAKES_REWARDS:
        raise ValueError(
            f"Preset {name!r} takes the rewards, not advantages; call preset_loss with rewards."
        )
    if preset.adv_estimator == "reinforce_pp":
        return reinforce_pp_advantages(
            rewards,
            mask,
            group_size=group_size,
            baseline=adv["baseline"],
            reward_kl_coef=adv["reward_kl_coef"],
            old_logp=old_logp,
            ref_logp=ref_logp,
        )
    return group_advantages(rewards, group_size, scale=adv["adv_scale"])


def entropy_aggregation(name: str, **overrides) -> str:
    """The AGG_MODES entry an entropy bonus uses with preset `name`: the loss's own `agg` for
    token-level losses; per-sequence token sums for gvpo (its log-ratios are sums); per-sequence
    token means for the sequence-level losses (gspo, gmpo, rloo)."""
    preset, kwargs, _ = _settings(name, overrides)
    if "agg" in kwargs:
        return kwargs["agg"]
    return "seq-mean-token-sum" if preset.kind == "gvpo" else "seq-mean-token-mean"


def preset_loss(
    name: str,
    *,
    logp,
    old_logp,
    rewards,
    mask,
    group_size: int,
    ref_logp=None,
    anchor_logp=None,
    max_tokens: int | None = None,
    advantages=None,
    entropy=None,
    entropy_coef: float = 0.0,
    **overrides,
) -> tuple[Array, Aux]:
    """The loss of preset `name` on a rollout batch: one entry point for every algorithm.

    logp, old_logp, mask, ref_logp, anchor_logp: [B, T]; rewards: [B] (already shaped, e.g. with
    DAPO's overlong penalty added). Losses on advantages get `preset_advantages(name, ...)` of
    this batch, or `advantages` if given (e.g. computed once on the whole rollout batch when
    `uses_batch_statistics`); gvpo and rloo take the rewards. gvpo uses `anchor_logp` if given
    (e.g. the frozen reference: anchor="ref") else `old_logp` (anchor="old"), and ignores
    ref_logp. `overrides` replace the preset's kwargs (plus `adv_scale` for the group estimators,
    `reward_kl_coef` for REINFORCE++). `entropy_coef` != 0 adds `entropy_bonus(entropy, mask,
    coef=entropy_coef, agg=entropy_aggregation(name))` (entropy: [B, T], differentiable).
    aux also gets informative_frac (groups with unequal rewards), and with an entropy bonus
    entropy (token mean) and entropy_loss. jit with name, group_size, max_tokens, entropy_coef
    and overrides static, e.g. `jax.jit(functools.partial(preset_loss, "dapo", group_size=8))`.
    """
    preset, kwargs, _ = _settings(name, overrides)
    if preset.kind == "gvpo":
        anchor = anchor_logp if anchor_logp is not None else old_logp
        if anchor is None:
            raise ValueError("Preset 'gvpo' needs `anchor_logp` or `old_logp` (the anchor policy).")
    elif old_logp is None:
        raise ValueError(
            f"Preset {name!r} needs `old_logp` (pi_old's log-probs: the policy at the start of "
            "the step)."
        )
    if advantages is not None and preset.kind in _TAKES_REWARDS:
        raise ValueError(f"Preset {name!r} takes the rewards; do not pass `advantages`.")
    if kwargs.get("agg") == "seq-mean-token-sum-norm" and max_tokens is None:
        raise ValueError(f"Preset {name!r} needs `max_tokens`; pass the maximum response length.")

    if preset.kind == "gvpo":
        loss, aux = gvpo_loss(logp, anchor, rewards, mask, group_size=group_size, **kwargs)
    elif preset.kind == "rloo":
        loss, aux = rloo_loss(
            logp, old_logp, rewards, mask, group_size=group_size, ref_logp=ref_logp, **kwargs
        )
    else:
        if advantages is None:
            advantages = preset_advantages(
                name,
                rewards=rewards,
                mask=mask,
                group_size=group_size,
                old_logp=old_logp,
                ref_logp=ref_logp,
                **overrides,
            )
        if preset.kind in ("clip", "cispo"):
            loss, aux = preset.loss_fn(
                logp, old_logp, advantages, mask, ref_logp=ref_logp, max_tokens=max_tokens, **kwargs
            )
        else:
            loss, aux = preset.loss_fn(logp, old_logp, advantages, mask, **kwargs)
    if not (isinstance(entropy_coef, int | float) and entropy_coef == 0):
        if entropy is None:
            raise ValueError(
                "`entropy_coef` is non-zero but `entropy` is None; pass the per-token entropy "
                "(models.chunked_logprobs(..., with_entropy=True)) or set it to 0."
            )
        agg = entropy_aggregation(name, **overrides)
        bonus = entropy_bonus(entropy, mask, coef=entropy_coef, agg=agg, max_tokens=max_tokens)
        loss = loss + bonus
        aux = dict(aux)
        aux |= _f32_aux(
            {
                "loss": loss,
                "entropy": _token_mean(_masked(entropy, _fp(mask)), _fp(mask)),
                "entropy_loss": bonus,
            }
        )
    aux["informative_frac"] = jnp.mean(informative_groups(rewards, group_size).astype(jnp.float32))
    return loss, aux


# ----------------------------------------------------------------------------- one algorithm

ANCHORS = ("old", "ref", "sampler")  # GVPO's pi_theta': pi_old, a frozen reference, the sampler


class AlgorithmError(ValueError):
    """An algorithm setting `resolve` cannot honour, in one sentence: argument `field` and what
    follows it (`rest`), where "@x" names another argument. `sentence(prefix, refs)` names them
    as a trainer's own config does (e.g. "config.algo.anchor ... algo.name=...")."""

    def __init__(self, field: str, rest: str):
        self.field, self.rest = field, rest
        super().__init__(self.sentence())

    def sentence(self, prefix: str = "", refs: str | None = None) -> str:
        """The sentence with the field behind `prefix` and every other argument behind `refs`
        (default: `prefix`)."""
        return f"{prefix}{self.field} {self.rest.replace('@', prefix if refs is None else refs)}"


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One algorithm resolved once (`resolve`): preset `name` with its overrides applied, and
    what a trainer must provide and do for it. Frozen and hashable, so jit may take it as a
    static argument; code below a trainer's assembly takes it instead of settings or a config.

    overrides: the preset settings replaced, sorted (name, value) pairs, as `preset_loss` takes
    them. anchor: GVPO's pi_theta' ("old" for every other preset, which all read pi_old).
    max_tokens: the response slots (Dr. GRPO's divisor, DAPO's overlong penalty). correction:
    (mode, cap) of `rollout_correction`, or None. overlong: DAPO's soft penalty (max_len,
    cache_len, factor), or None. dynamic_sampling: DAPO's filter of equal-reward groups.
    router_aux_loss_coef: the MoE routers' load-balancing loss added to the update's, times this
    (0: off, as RL recipes run it; `train_step.rl_loss`).
    """

    name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    anchor: str = "old"
    entropy_coef: float = 0.0
    max_tokens: int | None = None
    correction: tuple[str, float] | None = None
    overlong: tuple[int, int, float] | None = None
    dynamic_sampling: bool = False
    router_aux_loss_coef: float = 0.0

    @property
    def preset(self) -> LossPreset:
        return LOSSES[self.name]

    @property
    def is_cap(self) -> float:
        """The rollout correction's cap (`ROLLOUT_IS_CAP` when there is none): the weight
        pi_old / mu above which token_tis truncates, also measured without a correction."""
        return self.correction[1] if self.correction else ROLLOUT_IS_CAP

    @property
    def settings(self) -> dict:
        """The preset's loss and advantage settings with the overrides applied."""
        _, kwargs, adv = _settings(self.name, dict(self.overrides))
        return {**kwargs, **adv}

    @property
    def loss_kwargs(self) -> dict:
        """`preset_loss`'s keyword arguments besides the arrays and group_size."""
        kw = dict(self.overrides)
        if self.preset.kind != "gvpo":
            kw["max_tokens"] = self.max_tokens
        if self.entropy_coef:
            kw["entropy_coef"] = self.entropy_coef
        return kw

    @property
    def kl_coef(self) -> float:
        """The KL-to-reference coefficient in the loss (0 for GVPO, whose anchor plays its part)."""
        return float(self.settings.get("kl_coef", 0.0))

    @property
    def reward_kl_coef(self) -> float:
        """REINFORCE++'s KL-in-reward coefficient (0 for every other preset)."""
        return float(self.settings.get("reward_kl_coef", 0.0))

    @property
    def needs_reference(self) -> bool:
        """Reference log-probs enter the loss: GVPO's anchor "ref", or a KL penalty (in the loss
        or, REINFORCE++, in the reward)."""
        if self.preset.kind == "gvpo":
            return self.anchor == "ref"
        return self.kl_coef > 0 or self.reward_kl_coef > 0

    @property
    def batch_statistics(self) -> bool:
        """The advantages use whole-batch statistics (`uses_batch_statistics`)."""
        return uses_batch_statistics(self.name, **dict(self.overrides))

    @property
    def advantages_need_old(self) -> bool:
        """The advantages read pi_old (REINFORCE++'s KL in the reward)."""
        return self.reward_kl_coef > 0

    @property
    def token_weighted(self) -> bool:
        """The loss is one token mean over the batch (DAPO, CISPO, REINFORCE++): split into
        micro-batches, each is weighted by the tokens its loss counts."""
        return self.settings.get("agg") == "token-mean"

    @property
    def off_policy(self) -> bool:
        """The loss holds on groups pi_old did not sample (replay, demonstrations): GVPO's."""
        return self.preset.off_policy

    def advantages(self, *, rewards, mask, group_size: int, old_logp=None, ref_logp=None):
        """`preset_advantages` of this algorithm: [B] or [B, T]."""
        return preset_advantages(
            self.name,
            rewards=rewards,
            mask=mask,
            group_size=group_size,
            old_logp=old_logp,
            ref_logp=ref_logp,
            **dict(self.overrides),
        )

    def loss(
        self,
        *,
        logp,
        old_logp,
        rewards,
        mask,
        group_size: int,
        ref_logp=None,
        anchor_logp=None,
        advantages=None,
        entropy=None,
    ) -> tuple[Array, Aux]:
        """`preset_loss` of this algorithm on one batch of whole groups -> (loss, aux)."""
        return preset_loss(
            self.name,
            logp=logp,
            old_logp=old_logp,
            rewards=rewards,
            mask=mask,
            group_size=group_size,
            ref_logp=ref_logp,
            anchor_logp=anchor_logp,
            advantages=advantages,
            entropy=entropy,
            **self.loss_kwargs,
        )


def resolve(
    name: str,
    *,
    anchor: str = "old",
    entropy_coef: float = 0.0,
    max_tokens: int | None = None,
    rollout_correction: str = "none",
    rollout_is_cap: float = ROLLOUT_IS_CAP,
    dynamic_sampling: bool | None = None,
    overlong_cache: int = 4,
    overlong_factor: float = 1.0,
    router_aux_loss_coef: float = 0.0,
    **overrides,
) -> Algorithm:
    """Preset `name` with `overrides` (None: the preset's own value) and the trainer-side
    settings, checked once -> a frozen `Algorithm`. AlgorithmError names the argument and the fix.

    anchor: GVPO's pi_theta' (ANCHORS). max_tokens: the response slots, needed by Dr. GRPO's
    divisor and DAPO's overlong penalty. rollout_correction / rollout_is_cap:
    `rollout_correction`'s mode ("none": off) and cap. dynamic_sampling: None takes the preset's
    choice. overlong_cache / overlong_factor: DAPO's soft penalty window and scale.
    router_aux_loss_coef: an MoE policy's load-balancing loss coefficient (0: off).
    """
    if name not in LOSSES:
        raise AlgorithmError("name", f"is {name!r}; use one of {', '.join(LOSSES)}.")
    preset = LOSSES[name]
    overrides = {k: v for k, v in overrides.items() if v is not None}
    for field, value in sorted(overrides.items()):
        if field not in _overridable(preset):
            users = [n for n, p in LOSSES.items() if field in _overridable(p)]
            raise AlgorithmError(
                field,
                f"is set but @name={name!r} has no such setting; leave "
                f"it unset or use one of {', '.join(users)}.",
            )
        if isinstance(value, int | float) and not value >= 0:
            raise AlgorithmError(field, f"is {value}; use a non-negative value or leave it unset.")
    if preset.kind == "gvpo" and not overrides.get("beta", 1.0) > 0:
        raise AlgorithmError("beta", f"is {overrides['beta']}; set a positive value such as 0.1.")
    if anchor not in ANCHORS:
        raise AlgorithmError("anchor", f"is {anchor!r}; use old, ref or sampler.")
    if anchor == "sampler" and preset.kind != "gvpo":
        raise AlgorithmError(
            "anchor",
            f"is 'sampler' with @name={name!r}: only GVPO has an "
            "anchor policy; use @name=gvpo or leave @anchor=old.",
        )
    if not entropy_coef >= 0:
        raise AlgorithmError(
            "entropy_coef", f"is {entropy_coef}; use 0 (off) or a positive bonus such as 0.001."
        )
    corr = rollout_correction
    if corr not in ROLLOUT_CORRECTIONS:
        raise AlgorithmError("rollout_correction", f"is {corr!r}; use none, token_tis or seq_mis.")
    if corr != "none" and preset.off_policy:
        raise AlgorithmError(
            "rollout_correction",
            f"is {corr!r} with @name={name!r}: GVPO's optimum holds for "
            "any sampling distribution, so it takes stale samples without importance weights; "
            "use @rollout_correction=none.",
        )
    if corr == "token_tis" and not takes_token_weights(name):
        raise AlgorithmError(
            "rollout_correction",
            f"is 'token_tis' with @name={name!r}, whose loss treats a "
            "response as one action (no token advantages to weight); use "
            "@rollout_correction=seq_mis.",
        )
    if not router_aux_loss_coef >= 0:
        raise AlgorithmError(
            "router_aux_loss_coef",
            f"is {router_aux_loss_coef}; use 0 (off) or a small positive value.",
        )
    if not rollout_is_cap > 1.0:
        raise AlgorithmError("rollout_is_cap", f"is {rollout_is_cap}; use a cap > 1 such as 2.")
    _, kwargs, _ = _settings(name, overrides)
    if max_tokens is None and (kwargs.get("agg") == AGG_MODES[3] or preset.overlong_penalty):
        raise AlgorithmError(
            "max_tokens", f"is None but @name={name!r} needs it; pass the number of response slots."
        )
    overlong = None
    if preset.overlong_penalty:
        if not 0 <= overlong_cache < max_tokens:
            raise AlgorithmError(
                "overlong_cache",
                f"is {overlong_cache}; use a window in [0, @max_tokens) (here {max_tokens}).",
            )
        overlong = (max_tokens, overlong_cache, float(overlong_factor))
    if dynamic_sampling is None:
        dynamic_sampling = preset.dynamic_sampling
    return Algorithm(
        name=name,
        overrides=tuple(sorted(overrides.items())),
        anchor=anchor if preset.kind == "gvpo" else "old",
        entropy_coef=float(entropy_coef),
        max_tokens=max_tokens,
        correction=None if corr == "none" else (corr, float(rollout_is_cap)),
        overlong=overlong,
        dynamic_sampling=bool(dynamic_sampling),
        router_aux_loss_coef=float(router_aux_loss_coef),
    )
