"""Length-bucketed update and log-prob passes: the same gradients as the full-width update on
fewer response slots, a bounded number of compiled shapes, and the trainer's step through them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import assemble, buckets, programs, rl_step, sampler, train_step
from gvpo_jax.batch import UpdateBatch
from gvpo_jax.rollout import collect_groups
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
    tokens = np.asarray(fresh["tokens"])
    rewards = rng.normal(size=P * G).astype(np.float32)
    batch = UpdateBatch(tokens=tokens, valid=attn, loss_mask=resp, rewards=rewards)
    spec = run.settings.spec
    if spec.ref_logp:
        batch = batch.replace(ref_logp=full_logprobs(run, ref, tokens, attn))
    if spec.sampler_logp:  # a sampler a little off the policy, every row drawn by it
        logp = full_logprobs(run, state.params, tokens, attn)
        batch = batch.replace(sampler_logp=(logp - 0.1) * resp, drawn=np.ones(P * G, np.float32))
    return batch


def full_logprobs(run, params, tokens, valid) -> np.ndarray:
    """[B, N] log-probs of one full-width pass over every row (no buckets, no chunks)."""
    c = run.config
    fn = functools.partial(train_step.response_logprobs, run.graphdef,
                           prompt_len=c.data.max_prompt_len, chunk_size=c.model.logprob_chunk,
                           group_size=c.rollout.group_size)  # fmt: skip
    return np.asarray(jax.jit(fn)(params, jnp.asarray(tokens), jnp.asarray(valid)))


def full_loss(run, params, batch):
    """(loss, aux) and the gradient of one full-width pass over a host minibatch."""
    c = run.config
    unpacked = dataclasses.replace(run.settings.spec, packed=False)
    loss_fn = functools.partial(assemble.rl_loss_fn(c, run.graphdef), spec=unpacked)
    dev = buckets.to_device(batch, run.mesh, c.rollout.group_size)
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, dev)


def _bucketed(algo, micro_batches=2, **changes):
    return toy_config(algo, **{"rollout.max_new_tokens": N, "optim.micro_batches": micro_batches,
                               "optim.length_buckets": 4, **changes})  # fmt: skip


SEQ_MIS = {"algo.rollout_correction": "seq_mis", "algo.rollout_is_cap": 2.0}


@pytest.mark.parametrize(
    "algo, changes",
    [("gvpo", {}), ("grpo", {}), ("dr_grpo", {}), ("dapo", {}), ("dapo", SEQ_MIS),
     ("cispo", SEQ_MIS), ("reinforce_pp", SEQ_MIS)],
    ids=["gvpo", "grpo", "dr_grpo", "dapo", "dapo-seq_mis", "cispo-seq_mis",
         "reinforce_pp-seq_mis"],
)  # fmt: skip
def test_bucketed_update_has_the_full_width_single_batch_gradient(algo, changes):
    """Every loss is a mean over whole groups / sequences (a token mean: micro-batches weighted
    by the tokens their loss counts, after seq_mis masks responses out), so accumulating sorted,
    trimmed micro-batches gives the gradient and loss of one full-width pass over the minibatch;
    and the update applies it."""
    c = _bucketed(algo, **changes)
    run, state, loop, ref = make_run(c)
    batch = _varied_batch(run, state, ref, seed=3)
    if changes:  # a behaviour policy that masks a few long responses out (seq_mis)
        logp = full_logprobs(run, state.params, batch.tokens, batch.valid)
        shift = np.where(batch.loss_mask.sum(1) >= 6, 0.3, 0.0).astype(np.float32)
        shift[1::4] = 0.0  # some long rows stay
        batch = batch.replace(behaviour_logp=(logp - shift[:, None]) * batch.loss_mask)
        if algo == "reinforce_pp":  # its whole-batch advantages, as the trainer gives them
            adv = run.algorithm.advantages(rewards=batch.rewards, mask=batch.loss_mask,
                                           group_size=c.rollout.group_size, old_logp=logp,
                                           ref_logp=batch.ref_logp)  # fmt: skip
            batch = batch.replace(advantages=np.asarray(adv, np.float32))
    acc, slot_frac = run.updater.accumulated(state.params, batch)
    assert slot_frac < 0.9  # the short groups' micro-batch was cut to 8 of 16 slots

    (loss, aux), grads = full_loss(run, state.params, batch)
    if changes:
        assert 0 < float(aux["is_masked_frac"]) < 0.5  # some responses masked out, not all
    M = c.optim.micro_batches
    g_bucket, g_full = _flat(acc["grads"]) / M, _flat(grads)
    np.testing.assert_allclose(g_bucket, g_full, rtol=0, atol=2e-5 * np.abs(g_full).max())
    assert np.abs(g_full).max() > 1e-4
    np.testing.assert_allclose(float(acc["loss"]) / M, float(loss), rtol=2e-5, atol=1e-7)

    before = _flat(state.params)
    new, metrics = run.updater.update(jax.tree.map(jnp.copy, state), batch)
    assert metrics["update_slot_frac"] == slot_frac and not metrics["skipped"]
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=2e-5, atol=1e-7)
    assert np.abs(_flat(new.params) - before).max() > 1e-5 and int(new.updates) == 1


def test_bucketed_logprobs_equal_the_full_width_pass():
    c = _bucketed("grpo", **{"algo.num_minibatches": 2})
    run, state, loop, ref = make_run(c)
    batch = _varied_batch(run, state, ref, seed=4)
    full = full_logprobs(run, state.params, batch.tokens, batch.valid)
    bucketed = run.updater.logprobs(state.params, batch.tokens, batch.valid)
    np.testing.assert_allclose(bucketed, full, rtol=0, atol=1e-5)
    assert (bucketed[batch.loss_mask > 0] < 0).all()


def test_bucketed_steps_compile_at_most_one_shape_per_width():
    """New lengths every call, never a new compile beyond one per bucket width."""
    c = _bucketed("gvpo", **{"algo.num_minibatches": 2, "train.kl_ref_metric": False})
    run, state, loop, ref = make_run(c)
    for seed in range(5):
        batch = _varied_batch(run, state, ref, seed=seed)
        batch = batch.replace(old_logp=run.updater.logprobs(state.params, batch.tokens,
                                                            batch.valid))  # fmt: skip
        state, _ = run.updater.update(state, batch)
    widths = len(run.updater.widths)
    assert run.updater._accumulate._cache_size() == widths == 2
    assert run.updater._apply._cache_size() == 1
    assert run.updater._logprobs._cache_size() <= widths


@pytest.mark.parametrize(
    "algo, changes",
    [("dapo", {}), ("reinforce_pp", {"optim.pack_groups": True, "optim.length_buckets": 1})],
    ids=["dapo-buckets", "reinforce_pp-packed"],
)
def test_programs_compiled_ahead_serve_every_width_without_a_new_program(algo, changes):
    """`Updater.compile_ahead` compiles each width's accumulation and log-prob pass, the token
    mean's normalisation and the optimizer step from a batch of zeros (`rl_step.example_batch`);
    the passes over real batches of varied lengths then lower no program at all."""
    c = _bucketed(algo, **{"algo.num_epochs": 2, "train.kl_ref_metric": False, **changes})
    run, state, loop, ref = make_run(c)
    batches = []
    for seed in range(3):
        batch = _varied_batch(run, state, ref, seed=seed)
        if algo == "reinforce_pp":  # its whole-batch advantages, [B, N], as the trainer gives
            old = full_logprobs(run, state.params, batch.tokens, batch.valid)
            adv = run.algorithm.advantages(rewards=batch.rewards, mask=batch.loss_mask,
                                           group_size=c.rollout.group_size, old_logp=old,
                                           ref_logp=batch.ref_logp)  # fmt: skip
            batch = batch.replace(advantages=np.asarray(adv, np.float32))
        batches.append(batch)
    rows = len(batches[0].rewards) // run.updater.chunks
    example = rl_step.example_batch(run.settings, rows, N)
    ahead = programs.Ahead(threads=2)
    passes = rl_step.logprob_passes(run.settings)
    run.updater.compile_ahead(ahead, state, example, passes)
    ahead.close(wait=True)
    widths = len(run.updater.widths)
    assert not ahead.failed and ahead.compiled == 3 + 2 * widths
    with programs.Counter() as counter:
        for batch in batches:
            batch = batch.replace(old_logp=run.updater.logprobs(state.params, batch.tokens,
                                                                batch.valid))  # fmt: skip
            state, _ = run.updater.update(state, batch)
        met = counter.take()
    assert met["new_programs"] == 0, met


@pytest.mark.parametrize("algo", ["gvpo", "grpo"])
def test_trainer_step_runs_its_passes_and_updates_through_the_buckets(algo):
    """rl_step with optim.length_buckets: the pi_old and reference passes and every update go
    through `run.updater`, cut to the buckets' widths."""
    c = _bucketed(algo, **{"algo.num_minibatches": 2, "algo.num_epochs": 2})
    run, state, loop, ref = make_run(c)
    calls = {"update": 0, "logprobs": 0}
    real_update, real_logprobs = run.updater.update, run.updater.logprobs

    def update(state, batch):
        calls["update"] += 1
        return real_update(state, batch)

    def logprobs(params, tokens, valid, reference=False):
        calls["logprobs"] += 1
        return real_logprobs(params, tokens, valid, reference)

    run.updater.update, run.updater.logprobs = update, logprobs
    before = _flat(state.params)
    state, metrics, _, _ = rl_step.rl_step(run, state, loop, ref)
    assert calls == {"update": 4, "logprobs": 1 + (ref is not None)}
    assert 0 < metrics["update_slot_frac"] <= 1 and np.isfinite(metrics["loss"])
    assert np.abs(_flat(state.params) - before).max() > 1e-5


# ---------------------------------------------------------------------------------------------
# Packed groups: one row per group, its G responses back to back behind one copy of its prompt


@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_sees_the_prefix_and_its_own_segment_only(monkeypatch, window):
    """dense and blocked (small blocks, so key blocks of earlier segments are skipped) against
    a float64 numpy reference of each segment attended on its own: [prefix, that segment]; with
    a sliding window, only keys less than `window` positions back (positions restart after the
    prefix in every segment). The blocked pass's gradients equal the dense one's."""
    from gvpo_jax.models import attention as kernels

    rng = np.random.default_rng(0)
    R, J, T, N, K, H = 2, 5, 24, 4, 2, 8
    # per row, the rest padding; long first segments: whole query blocks lie past the window of
    # the prefix, and the next segment restarts inside it
    lengths = [[14, 1, 7], [13, 2, 6]]
    q = rng.normal(size=(R, T, N, H)).astype(np.float32)
    pk, pv = (rng.normal(size=(R, K, J, H)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(R, K, T, H)).astype(np.float32) for _ in range(2))
    prefix_valid = np.arange(J)[None] >= [[2], [0]]  # left-padded prefixes
    prefix_pos = np.maximum(np.cumsum(prefix_valid, axis=1) - 1, 0).astype(np.int32)
    seg, valid = np.full((R, T), 9, np.int32), np.zeros((R, T), bool)
    pos = np.zeros((R, T), np.int32)
    for r, lens in enumerate(lengths):
        at = 0
        for i, n in enumerate(lens):
            seg[r, at : at + n], valid[r, at : at + n] = i + 1, True
            pos[r, at : at + n] = prefix_valid[r].sum() + np.arange(n)
            at += n
    monkeypatch.setattr(kernels, "BLOCK_Q", 8)
    monkeypatch.setattr(kernels, "BLOCK_K", 4)
    args = [jnp.asarray(x) for x in (q, pk, pv, prefix_valid, k, v, valid, seg)]
    extra = {"window": window, "positions_RxT": jnp.asarray(pos),
             "prefix_pos_RxJ": jnp.asarray(prefix_pos)}  # fmt: skip

    def attend(impl, *a):
        return kernels.packed_prefix(impl, *a, **extra)

    outs = {impl: np.asarray(jax.jit(attend, static_argnums=0)(impl, *args))
            for impl in ("dense", "blocked")}  # fmt: skip
    near = (lambda d: d < window) if window else (lambda d: d >= 0)
    g = N // K
    for r, lens in enumerate(lengths):
        at = 0
        for n in lens:
            keys = np.concatenate([pk[r], k[r, :, at : at + n]], axis=1)  # [K, J + n, H]
            values = np.concatenate([pv[r], v[r, :, at : at + n]], axis=1)
            qp = pos[r, at : at + n]
            seen = np.concatenate([prefix_valid[r] & near(qp[:, None] - prefix_pos[r][None]),
                                   np.tril(near(qp[:, None] - qp[None]))], axis=1)  # fmt: skip
            for head in range(N):
                scores = q[r, at : at + n, head].astype(np.float64) @ keys[head // g].T
                scores = np.where(seen, scores / np.sqrt(H), -np.inf)
                w = np.exp(scores - scores.max(1, keepdims=True))
                want = (w / w.sum(1, keepdims=True)) @ values[head // g]
                for impl, out in outs.items():
                    np.testing.assert_allclose(out[r, at : at + n, head], want, atol=2e-6,
                                               err_msg=impl)  # fmt: skip
            at += n
    cot = jnp.asarray(rng.normal(size=q.shape).astype(np.float32) * valid[:, :, None, None])

    def loss(impl, q_, pk_, pv_, k_, v_):
        a = [q_, pk_, pv_, args[3], k_, v_, args[6], args[7]]
        return jnp.sum(attend(impl, *a) * cot)

    diff = (0, 1, 2, 4, 5)
    grads = {impl: jax.jit(jax.grad(lambda *a, impl=impl: loss(impl, *a), argnums=(0, 1, 2, 3, 4)))(
        *[args[i] for i in diff]) for impl in ("dense", "blocked")}  # fmt: skip
    for a, b in zip(grads["blocked"], grads["dense"], strict=True):
        assert np.abs(np.asarray(b)).max() > 1e-3
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_pack_puts_each_group_behind_one_prompt_with_restarting_positions():
    G, J, n = 2, 3, 4
    tokens = np.array([[0, 5, 6, 10, 11, 12, 0], [0, 5, 6, 20, 0, 0, 0],
                       [7, 8, 9, 30, 31, 0, 0], [7, 8, 9, 40, 41, 42, 43]])  # fmt: skip
    resp = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    attn = np.concatenate([[[0, 1, 1]] * 2 + [[1, 1, 1]] * 2, resp], axis=1).astype(np.float32)
    batch = UpdateBatch(tokens=tokens, valid=attn, loss_mask=resp, rewards=np.arange(4.0))
    plan = buckets.plan_chunks(resp, G, 2, buckets.pack_widths(n, G, 2), packed=True)
    assert [(list(r), w) for r, w in plan] == [([0, 1], 8), ([2, 3], 8)]  # 4 and 6 tokens
    out = buckets.pack(batch, np.arange(4), 8, J, G)
    p = out.packed
    np.testing.assert_array_equal(p.tokens[0], [0, 5, 6, 10, 11, 12, 20, 0, 0, 0, 0])
    np.testing.assert_array_equal(p.positions[0, J:7], [2, 3, 4, 2])  # restarts at 2
    np.testing.assert_array_equal(p.positions[1, J:9], [3, 4, 3, 4, 5, 6])
    np.testing.assert_array_equal(p.segments[0], [1, 1, 1, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(p.pred[1, :6], [2, 3, 2, 5, 6, 7])  # first: prompt end
    np.testing.assert_array_equal(p.index[1], [3, -1, -1, -1])
    np.testing.assert_array_equal(p.index[3], [10, 11, 12, 13])
    assert (out.rewards == batch.rewards).all() and out.tokens is None and out.valid is None


# A tiny Gemma 3: a sliding-window layer (window 3) before a full one.
SLIDING = {f"model.overrides.{k}": v for k, v in dict(
    architecture="gemma3", qk_norm=True, attention_bias=False, query_pre_attn_scalar=16,
    num_layers=2, sliding_window=3, layer_types=("sliding", "full")).items()}  # fmt: skip


@pytest.mark.parametrize("algo, model", [("gvpo", {}), ("dapo", {}), ("gvpo", SLIDING)],
                         ids=["gvpo", "dapo", "gvpo-sliding-window"])  # fmt: skip
def test_packed_update_and_logprobs_equal_the_full_width_pass(algo, model):
    """Packed micro-batches give the full-width pass's log-probs and the gradient and loss of
    one full-width pass over the minibatch (GVPO's group centring and DAPO's token mean
    included), computing fewer response slots than per-group buckets; also with a
    sliding-window layer, whose window restarts with every packed response's positions."""
    c = _bucketed(algo, **{"optim.pack_groups": True, **model})
    run, state, loop, ref = make_run(c)
    batch = _varied_batch(run, state, ref, seed=3)
    full = full_logprobs(run, state.params, batch.tokens, batch.valid)
    packed = run.updater.logprobs(state.params, batch.tokens, batch.valid)
    np.testing.assert_allclose(packed, full, rtol=0, atol=1e-5)

    acc, slot_frac = run.updater.accumulated(state.params, batch)
    (loss, _), grads = full_loss(run, state.params, batch)
    M = c.optim.micro_batches
    g_packed, g_full = _flat(acc["grads"]) / M, _flat(grads)
    np.testing.assert_allclose(g_packed, g_full, rtol=0, atol=2e-5 * np.abs(g_full).max())
    assert np.abs(g_full).max() > 1e-4
    np.testing.assert_allclose(float(acc["loss"]) / M, float(loss), rtol=2e-5, atol=1e-7)
    real = batch.loss_mask.sum()
    per_group = buckets.plan_chunks(batch.loss_mask, c.rollout.group_size, M,
                                    buckets.bucket_widths(N, 4))  # fmt: skip
    assert slot_frac * batch.loss_mask.size < sum(len(r) * w for r, w in per_group)
    _, metrics = run.updater.update(state, batch)
    assert 1.0 <= metrics["update_pad_ratio"] == slot_frac * batch.loss_mask.size / real


def test_packed_steps_compile_one_shape_per_packed_width():
    """New lengths every call: one compiled update and log-prob shape per packed width used,
    none again for a width already seen."""
    c = _bucketed("grpo", **{"optim.pack_groups": True, "train.kl_ref_metric": False})
    run, state, loop, ref = make_run(c)
    seen = set()
    for seed in range(4):
        batch = _varied_batch(run, state, ref, seed=seed)
        seen |= {w for _, w in run.updater._plan(batch.valid, run.updater.micro_batches)}
        state, _ = run.updater.update(state, batch)
        assert run.updater._accumulate._cache_size() == len(seen)
    assert run.updater._apply._cache_size() == 1 and len(seen) < len(run.updater.widths)


def test_planner_padding_ratios_follow_the_layout():
    """plan.padding_ratios: computed / real slots of the update and decode per layout, for given
    lengths and the default long-tailed mix; packing and shedding compute fewer slots."""
    from gvpo_jax import plan

    c = toy_config("grpo", **{"rollout.max_new_tokens": N, "optim.micro_batches": 2})
    lengths = np.array([3, 1, 16, 2, 5, 6, 4, 7, 16, 2, 3, 1, 2, 2, 9, 1])  # 80 tokens
    full = plan.padding_ratios(c, lengths)
    assert full == {"update": 16 * 16 / 80, "logprob_pass": 16 * 16 / 80, "decode": 16 * 16 / 80}
    c.optim.length_buckets = 2  # widths 8, 16; groups' longest 16, 7, 16, 9: both chunks 16
    assert plan.padding_ratios(c, lengths)["update"] == 16 * 16 / 80
    c.optim.pack_groups = True  # groups of 22, 22, 22, 14 tokens, packed widths 8, 16, .., 64
    assert plan.padding_ratios(c, lengths)["update"] == (2 * 24 + 2 * 24) / 80
    c.rollout.shed = 2  # 16 -> 8 -> 4 rows as the running rows fit
    assert plan.padding_ratios(c, lengths)["decode"] == sampler.decode_slots(
        lengths, max_new_tokens=N, shed=2) / 80 < full["decode"]  # fmt: skip
    tail = plan.padding_ratios(c)
    assert 1.0 <= tail["update"] < 2.0 and 1.0 <= tail["decode"]
