"""Tabular bandit of SPEC section 4: GVPO on stochastic groups reaches pi_ref exp(R/beta) / Z.

One prompt, K arms with distinct rewards, a softmax policy over logits theta, a fixed reference
pi_ref used as GVPO's anchor (anchor="ref"). Each step draws P groups of G arms on-policy from
pi_theta, or off-policy (uniformly, or from pi_ref: no importance weights either way), and takes a
plain SGD step on `preset_loss` (the trainer's entry point).

Why constant-step SGD with no averaging reaches TV < 1e-3: the log-partition of the softmax
cancels in GVPO's group centering, so every group's loss is a quadratic in theta, and it is exactly
zero, with zero gradient, at pi* = pi_ref exp(R/beta) / Z for *every* group of samples (d_i = 0 for
all i). Stochastic groups therefore add no noise floor at the optimum (an interpolation problem),
and SGD converges linearly. The Hessian scales with beta^2, hence the step size LR = 2 / beta^2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import losses

K, P, G, BETA, STEPS = 8, 16, 4, 0.5, 300
LR = 2.0 / BETA**2

_rng = np.random.default_rng(0)
REWARDS_K = jnp.asarray(_rng.permutation(np.linspace(0.0, 1.0, K)), jnp.float32)
LOGP_REF_K = jax.nn.log_softmax(jnp.asarray(_rng.normal(0.0, 0.7, K), jnp.float32))
TARGET_K = jax.nn.softmax(LOGP_REF_K + REWARDS_K / BETA)


def batch_loss(theta_K, arms_B, name):
    """The preset's loss on one batch of sampled arms, as a function of the policy logits."""
    logp_Bx1 = jax.nn.log_softmax(theta_K)[arms_B][:, None]
    ref_Bx1 = LOGP_REF_K[arms_B][:, None]
    kwargs = dict(
        logp=logp_Bx1,
        old_logp=jax.lax.stop_gradient(logp_Bx1),  # one update per batch: pi_old = pi_theta
        rewards=REWARDS_K[arms_B],
        mask=jnp.ones_like(logp_Bx1),
        group_size=G,
        ref_logp=ref_Bx1,
    )
    if name == "gvpo":
        return losses.preset_loss("gvpo", anchor_logp=ref_Bx1, beta=BETA, **kwargs)[0]
    return losses.preset_loss(name, **kwargs)[0]


@functools.partial(jax.jit, static_argnames=("name", "sampling"))
def train(name, sampling, seed=0):
    """STEPS SGD steps from theta = log pi_ref; returns the final policy and TV to pi* per step."""

    def step(theta_K, key):
        behaviour_K = {"on_policy": theta_K, "reference": LOGP_REF_K, "uniform": jnp.zeros(K)}
        arms_B = jax.random.categorical(key, behaviour_K[sampling], shape=(P * G,))
        theta_K = theta_K - LR * jax.grad(batch_loss)(theta_K, arms_B, name)
        pi_K = jax.nn.softmax(theta_K)
        return theta_K, 0.5 * jnp.sum(jnp.abs(pi_K - TARGET_K))

    keys = jax.random.split(jax.random.PRNGKey(seed), STEPS)
    theta_K, tv_steps = jax.lax.scan(step, LOGP_REF_K, keys)
    return jax.nn.softmax(theta_K), tv_steps


def tv(p, q):
    return 0.5 * float(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum())


@pytest.mark.parametrize("sampling", ["on_policy", "uniform", "reference"])
def test_gvpo_converges_to_reference_tilted_by_exp_reward_over_beta(sampling):
    assert tv(jax.nn.softmax(LOGP_REF_K), TARGET_K) > 0.1  # the start is far from the target
    pi_K, tv_steps = train("gvpo", sampling)
    assert tv(pi_K, TARGET_K) < 1e-3
    assert float(tv_steps[STEPS // 2]) < 1e-2  # not a last-step fluke: it got there and stayed
    assert float(np.max(np.asarray(tv_steps[-STEPS // 4 :]))) < 1e-3


def test_grpo_from_the_same_start_ends_measurably_elsewhere():
    gvpo_pi, _ = train("gvpo", "on_policy")
    grpo_pi, _ = train("grpo", "on_policy")  # std-scaled A, clip 0.2, k3 KL 0.04 to pi_ref
    assert tv(grpo_pi, TARGET_K) > 0.3
    assert tv(grpo_pi, gvpo_pi) > 0.3
    # GRPO's std-normalised advantage overwhelms its KL term: it collapses onto the best arm.
    assert int(np.argmax(grpo_pi)) == int(np.argmax(REWARDS_K)) and float(np.max(grpo_pi)) > 0.9
