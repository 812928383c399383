"""Length-bucketed update and log-prob passes: the same gradients as the full-width update on
fewer response slots, a bounded number of compiled shapes, and the trainer's step through them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import assemble, buckets, sharding
from gvpo_jax.rl_step import collect_groups, rl_step
from tests.test_train import _flat, make_run, toy_config

N = 16  # response slots of these tests (4 bucket widths: 8, 8, 16, 16 -> (8, 16))


def test_bucket_widths_round_up_to_multiples_of_8_and_end_at_max_new_tokens():
    assert buckets.bucket_widths(256, 4) == (64, 128, 192, 256)
    assert buckets.bucket_widths(1024, 3) == (344, 688, 1024)
    assert buckets.bucket_widths(10, 3) == (8, 10)
    assert buckets.bucket_widths(16, 1) == (16,)
    with pytest.raises(ValueError, match="buckets=0 must be >= 1"):
        buckets.bucket_widths(16, 0)


def test_plan_sorts_groups_by_longest_response_and_cuts_each_chunk_to_its_bucket():
    rng = np.random.default_rng(0)
    G, groups, n = 4, 8, 32
    lengths = rng.integers(0, n + 1, size=groups * G)
    mask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
    assert (buckets.response_ends(mask) == lengths).all()
    widths = buckets.bucket_widths(n, 4)
    plan = buckets.plan_chunks(mask, G, 4, widths)
    rows = np.concatenate([r for r, _ in plan])
    assert sorted(rows) == list(range(groups * G))  # every row once, groups whole
    assert all((r.reshape(-1, G) // G == (r.reshape(-1, G) // G)[:, :1]).all() for r, _ in plan)
    group_end = lengths.reshape(groups, G).max(1)
    for chunk, (r, width) in enumerate(plan):
        need = lengths[r].max()
        assert width in widths and width >= need and (width == widths[0] or width - 8 < need)
        if chunk:  # sorted: no group of an earlier chunk is longer than one of this chunk
            assert group_end[plan[chunk - 1][0] // G].max() <= group_end[r // G].min()
    with pytest.raises(ValueError, match="8 groups cannot be cut into 3 equal chunks"):
        buckets.plan_chunks(mask, G, 3, widths)


def _varied_batch(run, state, ref, seed):
    """A rollout batch whose rows end at varied lengths (the tiny model rarely emits EOS, so the
    lengths are imposed on its samples) with random rewards and the reference's log-probs."""
    c = run.config
    P, G = c.rollout.prompts_per_step, c.rollout.group_size
    fresh, _, _, _ = collect_groups(
        run, state.params, assemble.start_loop(run), jax.random.key(seed), P
    )
    rng = np.random.default_rng(seed)
    group_len = rng.choice([3, 6, 11, N], size=P, replace=False)  # one short group at least
    lengths = np.minimum(rng.integers(1, N + 1, size=P * G), np.repeat(group_len, G))
    lengths[::G] = np.repeat(group_len, 1)  # each group's longest row sets its bucket
    resp = (np.arange(N)[None] < lengths[:, None]).astype(np.float32)
    attn = np.asarray(fresh["attn_mask"]).copy()
    attn[:, c.data.max_prompt_len :] = resp
    batch = {"tokens": np.asarray(fresh["tokens"]), "attn_mask": attn, "resp_mask": resp}
    batch["rewards"] = rng.normal(size=P * G).astype(np.float32)
    if ref is not None:
        batch["ref_logp"] = np.asarray(run.logprobs(ref, batch["tokens"], batch["attn_mask"]))
    return batch


def _bucketed(algo, micro_batches=2, **changes):
    return toy_config(algo, **{"rollout.max_new_tokens": N, "optim.micro_batches": micro_batches,
                               "optim.length_buckets": 4, **changes})  # fmt: skip


@pytest.mark.parametrize("algo", ["gvpo", "grpo", "dr_grpo", "dapo"])
def test_bucketed_update_has_the_full_width_single_batch_gradient(algo):
    """Every loss is a mean over whole groups / sequences (DAPO's token mean: micro-batches
    weighted by their tokens), so accumulating sorted, trimmed micro-batches gives the gradient
    and loss of one full-width pass over the minibatch; and the update applies it."""
    c = _bucketed(algo)
    run, state, loop, ref = make_run(c)
    batch = _varied_batch(run, state, ref, seed=3)
    acc, slot_frac = run.buckets.accumulated(state.params, batch)
    assert slot_frac < 0.9  # the short groups' micro-batch was cut to 8 of 16 slots

    loss_fn = assemble.rl_loss_fn(c, run.graphdef)
    dev = sharding.device_batch(batch, run.mesh, group_size=c.rollout.group_size)
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state.params, dev)
    M = c.optim.micro_batches
    g_bucket, g_full = _flat(acc["grads"]) / M, _flat(grads)
    np.testing.assert_allclose(g_bucket, g_full, rtol=0, atol=2e-5 * np.abs(g_full).max())
    assert np.abs(g_full).max() > 1e-4
    np.testing.assert_allclose(float(acc["loss"]) / M, float(loss), rtol=2e-5, atol=1e-7)

    before = _flat(state.params)
    new, metrics = run.buckets.update(jax.tree.map(jnp.copy, state), batch)
    assert metrics["update_slot_frac"] == slot_frac and not metrics["skipped"]
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=2e-5, atol=1e-7)
    assert np.abs(_flat(new.params) - before).max() > 1e-5 and int(new.step) == 1


def test_bucketed_logprobs_equal_the_full_width_pass():
    c = _bucketed("grpo", **{"algo.num_minibatches": 2})
    run, state, loop, ref = make_run(c)
    batch = _varied_batch(run, state, ref, seed=4)
    full = np.asarray(run.logprobs(state.params, batch["tokens"], batch["attn_mask"]))
    bucketed = run.buckets.logprobs(state.params, batch)
    np.testing.assert_allclose(bucketed, full, rtol=0, atol=1e-5)
    assert (bucketed[batch["resp_mask"] > 0] < 0).all()


def test_bucketed_steps_compile_at_most_one_shape_per_width():
    """New lengths every call, never a new compile beyond one per bucket width."""
    c = _bucketed("gvpo", **{"algo.num_minibatches": 2, "train.kl_ref_metric": False})
    run, state, loop, ref = make_run(c)
    for seed in range(5):
        batch = _varied_batch(run, state, ref, seed=seed)
        batch["old_logp"] = run.buckets.logprobs(state.params, batch)
        state, _ = run.buckets.update(state, batch)
    widths = len(run.buckets.widths)
    assert run.buckets._accumulate._cache_size() == widths == 2
    assert run.buckets._apply._cache_size() == 1
    assert run.logprobs._cache_size() <= widths


@pytest.mark.parametrize("algo", ["gvpo", "grpo"])
def test_trainer_step_runs_its_passes_and_updates_through_the_buckets(algo):
    """rl_step with optim.length_buckets: the pi_old and reference passes and every update go
    through `run.buckets` (the plain jitted update is never called)."""
    c = _bucketed(algo, **{"algo.num_minibatches": 2, "algo.num_epochs": 2})
    run, state, loop, ref = make_run(c)
    calls = {"update": 0, "logprobs": 0}
    real_update, real_logprobs = run.buckets.update, run.buckets.logprobs

    def update(state, batch):
        calls["update"] += 1
        return real_update(state, batch)

    def logprobs(params, batch):
        calls["logprobs"] += 1
        return real_logprobs(params, batch)

    run.buckets.update, run.buckets.logprobs = update, logprobs
    run = run.__class__(**{**run.__dict__, "update": None})  # the plain update must not run
    before = _flat(state.params)
    state, metrics, _, _ = rl_step(run, state, loop, ref)
    assert calls == {"update": 4, "logprobs": 1 + (ref is not None)}
    assert 0 < metrics["update_slot_frac"] <= 1 and np.isfinite(metrics["loss"])
    assert np.abs(_flat(state.params) - before).max() > 1e-5
