"""The RL loop end to end on a tiny model: every algorithm, learning, replay, the GVPO gradient."""

import dataclasses
import functools
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import assemble, losses, resume, sharding, tasks, train, train_step
from gvpo_jax import batch as batch_lib
from gvpo_jax import config as config_lib
from gvpo_jax.batch import BatchSpec, UpdateBatch
from gvpo_jax.replay import ReplayBuffer
from gvpo_jax.rl_step import rl_step
from gvpo_jax.rollout import collect_groups

TARGET = "7"


class ToyTask:
    """Prompts of digits; reward = share of response characters equal to TARGET (dense, easy)."""

    def __init__(self, tokenizer, seed=0):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.eval_examples = [self._example() for _ in range(8)]
        self.calls = 0

    def _example(self):
        text = "".join(str(d) for d in self.rng.integers(0, 10, size=3)) + "="
        ids = self.tokenizer.encode(text)
        return {"prompt": text, "answer": TARGET, "prompt_ids": ids}

    start = tasks.DataCursor()

    def next_train(self, n, cursor, rows=None):
        batch = [self._example() for _ in range(n)]
        return (batch if rows is None else [batch[int(r)] for r in rows]), cursor

    def score(self, completions, golds):
        self.calls += 1
        r = [c.count(TARGET) / max(len(c), 1) for c in completions]
        return np.asarray(r, np.float32), {"timeouts": 0, "errors": 0}

    eval_reward = staticmethod(lambda c, g: float(c.count(TARGET) / max(len(c), 1)))
    timeout_s, num_workers = 5.0, 0

    def close(self):
        pass


class NullWriter:
    def write_scalars(self, *a, **k):
        pass

    write_texts = flush = close = write_scalars


def toy_config(algo="gvpo", **changes):
    c = config_lib.base_config()
    c.model.overrides.update(dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  head_dim=16, intermediate_size=64))  # fmt: skip
    c.algo.name = algo
    c.data.max_prompt_len = 6
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 4
    c.algo.overlong_cache = 2
    c.optim.lr = 3e-3
    c.optim.grad_clip = 0.0
    c.model.logprob_chunk = 8
    c.mesh.num_devices = 1  # the 1 x 1 x 1 mesh: tiny shapes, no 8-way split of 4 prompts
    config_lib.set_fields(c, changes)
    config_lib.validate(c)
    return c


def make_run(config):
    """The trainer's own assembly with the toy task and no writer: (run, state, loop, ref)."""
    run, state = assemble.assemble(config, tempfile.mkdtemp(prefix="gvpo_test_"))
    run.task.close()
    run.writer.close()  # (an open TensorBoard writer's exit hook fails on Python 3.12)
    run = dataclasses.replace(run, task=ToyTask(run.tokenizer), writer=NullWriter())
    ref = resume.reference_copy(run, state.params) if run.reference.kind == "copy" else None
    return run, state, assemble.start_loop(run), ref


def update_batch(rows: dict, **optional) -> UpdateBatch:
    """A rollout's rows (`rollout.collect_groups`) as an update batch with `optional` fields."""
    return UpdateBatch(tokens=rows["tokens"], valid=rows["attn_mask"], loss_mask=rows["resp_mask"],
                       rewards=rows["rewards"], **optional)  # fmt: skip


def _flat(params):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])


FIRST_PRESETS = ("gvpo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token")


@pytest.mark.parametrize("algo", [*FIRST_PRESETS, "cispo+entropy", "reinforce_pp"])
def test_every_algorithm_runs_and_changes_the_policy(algo):
    """Two steps of each preset (two minibatches each but gvpo's, so REINFORCE++'s advantages
    are computed once on the whole rollout batch), and one with the entropy bonus; the other
    later presets run through the demo config below."""
    algo, _, bonus = algo.partition("+")
    changes = {"algo.num_minibatches": 2} if algo != "gvpo" else {}
    if bonus:
        changes["algo.entropy_coef"] = 0.01
    c = toy_config(algo, **changes)
    run, state, loop, ref = make_run(c)
    before = _flat(state.params)
    for _ in range(2):
        state, metrics, _, _ = rl_step(run, state, loop, ref)
    after = _flat(state.params)
    assert np.isfinite(after).all()
    assert np.abs(after - before).max() > 1e-5
    for key in ("reward_mean", "loss", "grad_norm", "response_len_mean", "entropy_mc"):
        assert np.isfinite(metrics[key]), key
    if algo in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert "kl_ref" in metrics  # a KL in the loss or the reward needs the frozen reference
    if bonus:
        assert metrics["entropy"] > 0 and metrics["entropy_loss"] == pytest.approx(
            -0.01 * metrics["entropy"], rel=1e-5
        )  # cispo: token-mean, like the entropy metric
    if algo != "gvpo":
        assert (
            "clip_frac" in metrics
            or "clip_frac_low" in metrics
            or any(k.startswith("clip") for k in metrics)
        )
    assert metrics["sampler_logp_gap_max"] < 1e-4


@pytest.mark.parametrize("clip", [1e-6, 1e6])
def test_grad_clipped_frac_counts_the_updates_the_norm_clip_acted_on(clip):
    """4 updates per step (2 minibatches x 2 epochs): grad_norm is their mean, grad_norm_max
    their largest, and grad_clipped_frac the share above optim.grad_clip (every update with a
    nonzero gradient at a tiny clip, none at a huge one; a minibatch whose groups all have equal
    rewards has a zero gradient at the first update)."""
    c = toy_config("grpo", **{"algo.num_minibatches": 2, "algo.num_epochs": 2,
                              "optim.grad_clip": clip})  # fmt: skip
    run, state, loop, ref = make_run(c)
    _, m, _, _ = rl_step(run, state, loop, ref)
    assert 0 < m["grad_norm"] <= m["grad_norm_max"] < 1e6
    if clip < 1:
        assert m["grad_clipped_frac"] in (0.25, 0.5, 0.75, 1.0)
    else:
        assert m["grad_clipped_frac"] == 0.0


def test_the_optimizer_state_has_one_structure_with_the_norm_clip_on_or_off(tmp_path):
    """grad_clip 0 keeps the clip's slot (identity), so a run without the clip restores a
    checkpoint written with it (the study's no-clip cells start from the shared SFT checkpoint),
    moments included, and the reverse."""
    from gvpo_jax import checkpoint

    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    states = {}
    for clip in (1.0, 0.0):
        tx, _ = train_step.make_optimizer(lr=1e-3, total_updates=10, grad_clip=clip)
        state = tx.init(params)
        state = tx.update(jax.tree.map(lambda p: 3 * p + 1, params), state, params)[1]
        states[clip] = state
    assert jax.tree.structure(states[1.0]) == jax.tree.structure(states[0.0])
    with checkpoint.Checkpointer(tmp_path / "ckpt", save_every=1, keep=1) as ckpt:
        ckpt.save(1, {"opt_state": states[1.0]}, meta={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore({"opt_state": states[0.0]}, step=1)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(states[1.0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eval_chunk_sets_the_evaluation_batch_and_keeps_the_greedy_scores(monkeypatch):
    """train.eval_chunk prompts go through the sampler per evaluation call (0: rollout P);
    greedy completions, and so the score, do not depend on the chunk."""
    from gvpo_jax import eval as eval_lib

    chunks, real = [], eval_lib.evaluate_policy

    def spy(*args, **kw):
        chunks.append(kw["chunk"])
        return real(*args, **kw)

    monkeypatch.setattr(eval_lib, "evaluate_policy", spy)
    run, state, loop, _ = make_run(toy_config(**{"train.eval_chunk": 8}))
    wide = eval_lib.evaluate_held_out(run, state.params, step=0)
    narrow = eval_lib.evaluate_held_out(
        dataclasses.replace(run, config=toy_config()), state.params, step=0
    )
    assert chunks == [8, 4]
    assert wide["greedy"] == narrow["greedy"]
    with pytest.raises(sharding.ShardingError, match="config.train.eval_chunk = 3 cannot be split"):
        c = toy_config(**{"train.eval_chunk": 3, "rollout.prompts_per_step": 4})
        assemble.check_mesh(c, sharding.make_mesh(2, 1, 1, devices=jax.devices()[:2]))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["gvpo", "grpo"])
def test_reward_rises_on_toy_task(algo):
    c = toy_config(algo, **{"rollout.prompts_per_step": 8, "optim.lr": 1e-2})
    run, state, loop, ref = make_run(c)
    rewards = []
    for _ in range(30):
        state, metrics, _, _ = rl_step(run, state, loop, ref)
        rewards.append(metrics["reward_mean"])
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    # A random policy over the character vocabulary scores ~0.03; measured with this seed both
    # algorithms reach ~1.0 by step 25 (first five steps ~0.03).
    assert first < 0.1 and last > 0.8, (algo, rewards)


def test_gvpo_first_update_gradient_is_minus_beta_a_over_g_minus_1():
    """With logp == anchor, dL/d seq_logp_i = -beta * a_i / (G-1) / P, checked on parameters."""
    c = toy_config("gvpo")
    run, state, loop, _ = make_run(c)
    G, P, beta = c.rollout.group_size, c.rollout.prompts_per_step, c.algo.beta
    batch, _, _, _ = collect_groups(run, state.params, loop, jax.random.key(1), P)
    batch["rewards"] = np.random.default_rng(0).random(P * G).astype(np.float32)
    kw = dict(prompt_len=c.data.max_prompt_len, chunk_size=c.model.logprob_chunk)
    old = run.updater.logprobs(state.params, batch["tokens"], batch["attn_mask"])
    ub = update_batch(batch, old_logp=old)
    loss_fn = functools.partial(
        train_step.rl_loss, graphdef=run.graphdef, algorithm=losses.resolve("gvpo", beta=beta),
        spec=BatchSpec(old_logp=True), group_size=G, **kw,
    )  # fmt: skip
    g_loss = jax.jit(jax.grad(lambda p: loss_fn(p, ub)[0]))(state.params)
    r = batch["rewards"].reshape(P, G)
    a = (r - r.mean(1, keepdims=True)).reshape(-1)
    w = -beta * a / (G - 1) / P

    def surrogate(p):
        logp = train_step.response_logprobs(run.graphdef, p, ub.tokens, ub.valid, **kw)
        return jnp.sum(w * jnp.sum(logp * ub.loss_mask, -1))

    g_ref = jax.jit(jax.grad(surrogate))(state.params)
    for x, y in zip(jax.tree.leaves(g_loss), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_ref)) > 1e-4


def test_replayed_groups_use_current_anchor_logprobs():
    c = toy_config(
        "gvpo",
        **{
            "algo.replay_fraction": 0.5,
            "rollout.prompts_per_step": 4,
            "algo.num_minibatches": 2,  # several updates per step: pi_old gets its own pass
            "train.kl_ref_metric": False,
        },
    )
    run, state, loop, ref = make_run(c)
    assert isinstance(loop.replay, ReplayBuffer)
    seen = []
    real = run.updater.logprobs

    def spy(params, tokens, valid, reference=False):
        out = real(params, tokens, valid, reference)
        seen.append((np.asarray(tokens), np.asarray(out), _flat(params)))
        return out

    run.updater.logprobs = spy
    for _ in range(3):
        state, metrics, _, _ = rl_step(run, state, loop, ref)
    assert metrics["replayed_groups"] == 2.0
    tokens3, old3, params3 = seen[-1]
    assert tokens3.shape[0] == 4 * c.rollout.group_size  # 2 fresh + 2 replayed groups
    # The buffer stores no log-probs, so the replayed rows' anchor log-probs in this step were
    # recomputed under the current parameters: they differ from the values of the step that
    # sampled them.
    assert not any("logp" in k for k in loop.replay.state_dict())
    replayed = slice(2 * c.rollout.group_size, None)
    earlier = {tuple(t): lp for toks, lps, _ in seen[:-1] for t, lp in zip(toks, lps, strict=True)}
    changed = [
        np.abs(earlier[tuple(t)] - lp).max() > 1e-6
        for t, lp in zip(tokens3[replayed], old3[replayed], strict=True)
        if tuple(t) in earlier
    ]
    assert changed and all(changed)
    assert not np.allclose(params3, seen[0][2])


@pytest.mark.parametrize("algo", ["gvpo", "grpo"])
def test_single_update_takes_pi_old_from_its_own_forward(algo):
    """One update per step starts from the rollout's parameters: rl_step skips the pi_old pass
    (the reference pass stays) and the update equals the one with an explicit old_logp; the
    sampler consistency and entropy metrics come from the update's forward instead."""
    c = toy_config(algo, **{"optim.micro_batches": 2})
    run, state, loop, ref = make_run(c)
    assert run.settings.num_epochs * run.settings.num_minibatches == 1
    start = jax.tree.map(jnp.copy, state)  # (updates donate their state)
    calls = []
    real = run.updater.logprobs
    run.updater.logprobs = lambda *args, **kw: calls.append(1) or real(*args, **kw)
    _, metrics, _, _ = rl_step(run, state, loop, ref)
    del run.updater.logprobs
    assert len(calls) == (1 if run.reference.kind == "copy" else 0)  # the reference's pass only
    assert metrics["sampler_logp_gap_max"] < 1e-4 and metrics["entropy_mc"] > 0

    # One batch, updated without and with old_logp from the separate pass: the same update.
    fresh, _, _, _ = collect_groups(
        run, start.params, loop, jax.random.key_data(jax.random.key(5)), 4
    )
    rewards = np.random.default_rng(0).normal(size=len(fresh["rewards"])).astype("f4")
    batch = update_batch(dict(fresh, rewards=rewards))
    if ref is not None:
        batch = batch.replace(ref_logp=real(ref, batch.tokens, batch.valid))
    with_old = batch.replace(old_logp=real(start.params, batch.tokens, batch.valid))
    spec = run.settings.spec
    loss_fn = assemble.rl_loss_fn(c, run.graphdef)
    grad = jax.jit(jax.grad(lambda p, b, spec: loss_fn(p, b, spec=spec)[0]), static_argnums=2)
    g_skip = _flat(grad(start.params, batch, dataclasses.replace(spec, sampler_logp=False)))
    g_pass = _flat(grad(start.params, with_old, BatchSpec(old_logp=True, ref_logp=spec.ref_logp)))
    # (GVPO's loss reads log pi_theta - log pi_old in value: 0 exactly here, fp32 noise there)
    np.testing.assert_allclose(g_skip, g_pass, rtol=0, atol=1e-5 * np.abs(g_pass).max())
    assert np.abs(g_pass).max() > 1e-4
    drawn = batch.replace(sampler_logp=fresh["rollout_logp"], drawn=fresh["sampled"])
    new, _ = run.updater.update(jax.tree.map(jnp.copy, start), drawn)
    p_skip, before = _flat(new.params), _flat(start.params)
    assert np.abs(p_skip - before).max() > 1e-5  # it did update


def test_dynamic_sampling_keeps_informative_groups_and_stops_at_bound():
    c = toy_config("dapo", **{"algo.max_extra_rounds": 2})
    run, state, loop, _ = make_run(c)
    G, P = c.rollout.group_size, c.rollout.prompts_per_step
    # Reward 1 for every response in even-numbered calls -> those groups are uninformative.
    task = run.task
    pattern = iter([np.ones(P * G), np.tile([1.0, 0.0, 0.0, 0.0], P), np.ones(P * G)] * 3)

    def score(completions, golds):
        task.calls += 1
        return next(pattern).astype(np.float32), {"timeouts": 0, "errors": 0}

    task.score = score
    batch, _, _, m = collect_groups(run, state.params, loop, jax.random.key(0), P)
    assert m["rollout_rounds"] == 2.0  # round 1 all-equal, round 2 fills the batch
    assert losses.informative_groups(batch["task_rewards"], G).all()
    # Never informative: stops after 1 + max_extra_rounds rounds and fills with what it has.
    task.score = lambda comp, golds: (np.ones(len(comp), np.float32), {"timeouts": 0, "errors": 0})
    batch, _, _, m = collect_groups(run, state.params, loop, jax.random.key(1), P)
    assert m["rollout_rounds"] == 3.0
    assert batch["rewards"].shape[0] == P * G
    assert batch_lib.informative_groups(batch["task_rewards"], G).sum() == 0


def test_bf16_compute_update_moves_the_fp32_masters_like_fp32_compute():
    """The regression test of pure-bf16 storage: at lr 1e-6 an Adam step (~1e-6 per entry) is
    below the bf16 spacing of most weights, so bf16-stored parameters barely move. With fp32
    masters and bf16 compute one trainer update changes (almost) every master entry, in the
    direction of the fp32-compute update."""
    c32 = toy_config("gvpo", **{"optim.lr": 1e-6})
    run32, state32, loop32, _ = make_run(c32)
    P, G = c32.rollout.prompts_per_step, c32.rollout.group_size
    batch, _, _, _ = collect_groups(run32, state32.params, loop32, jax.random.key(1), P)
    batch["rewards"] = np.random.default_rng(0).random(P * G).astype(np.float32)
    deltas = {}
    pure = {"model.param_dtype": "bfloat16", "model.allow_bf16_params": True}
    for name, changes in [
        ("float32", {}),
        ("bfloat16", {"model.compute_dtype": "bfloat16"}),
        ("pure_bf16", {"model.compute_dtype": "bfloat16", **pure}),
    ]:
        c = toy_config("gvpo", **{"optim.lr": 1e-6, **changes})
        run, state, loop, _ = make_run(c)
        master = jnp.bfloat16 if name == "pure_bf16" else jnp.float32
        assert all(x.dtype == master for x in jax.tree.leaves(state.params))
        ub = update_batch(batch).replace(sampler_logp=batch["rollout_logp"],
                                         drawn=batch["sampled"])  # fmt: skip
        if run.settings.spec.ref_logp:  # the reference: the start, i.e. these parameters
            ub = ub.replace(ref_logp=run.updater.logprobs(state.params, ub.tokens, ub.valid))
        before = _flat(state.params).astype(np.float32)  # the update donates `state`
        new, metrics = run.updater.update(state, ub)
        assert not bool(metrics["skipped"])
        assert all(x.dtype == master for x in jax.tree.leaves(new.params))
        deltas[name] = _flat(new.params).astype(np.float32) - before
    d16, d32 = deltas["bfloat16"], deltas["float32"]
    changed = np.mean(d16 != 0)
    cosine = d16 @ d32 / (np.linalg.norm(d16) * np.linalg.norm(d32))
    assert changed >= 0.99, changed
    assert cosine >= 0.99, cosine
    # Pure bf16 storage (the opt-in) loses most of the same update.
    assert np.mean(deltas["pure_bf16"] != 0) < 0.1, np.mean(deltas["pure_bf16"] != 0)


NEW_PRESETS = ("cispo", "gmpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@pytest.mark.slow
def test_demo_config_trains_with_each_new_preset_without_a_non_finite_value(tmp_path):
    """configs/arith_tiny.py (the README's demo, cut to one layer as the resume tests cut it)
    after a short SFT, two RL steps of each preset added with CISPO (two minibatches, an entropy
    bonus), one device; every logged metric finite and every update applied."""
    from configs import arith_tiny

    assert set(FIRST_PRESETS) | set(NEW_PRESETS) == set(losses.LOSSES)  # every preset trains
    for algo in NEW_PRESETS:
        c = arith_tiny.get_config()
        config_lib.set_fields(c, {
            "algo.name": algo, "sft.steps": 4, "train.steps": 2, "train.eval_every": 0,
            "train.checkpoint_every": 100, "train.export": False, "train.plot": False,
            "train.sample_log_every": 0, "rollout.prompts_per_step": 8, "data.eval_size": 8,
            "mesh.num_devices": 1, "algo.num_minibatches": 2, "algo.entropy_coef": 0.001,
            "train.eval_samples": 1,  # greedy evaluation only: one sampler program less
            "model.overrides.num_layers": 1,  # compile time grows with the layer count
        })  # fmt: skip
        config_lib.validate(c)
        workdir = tmp_path / algo
        train.run(c, str(workdir))
        rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
        rl = [r for r in rows if "reward_mean" in r]
        assert [r["step"] for r in rl] == [1, 2], algo
        for r in rl:
            bad = [k for k, v in r.items() if isinstance(v, float) and not np.isfinite(v)]
            assert not bad, (algo, bad)
            assert r["skipped_updates"] == 0 and r["loss"] != 0 and r["entropy"] > 0, algo


def test_a_checkpoint_that_named_the_update_count_step_restores_into_updates():
    """`TrainState.updates` was `step` (the RL step's name): a checkpoint written in that layout
    restores, its count, parameters and moments into the current state."""
    from gvpo_jax import resume

    c = toy_config("grpo")
    run, state, loop, ref = make_run(c)
    written = state.replace(updates=jnp.int32(7), rng=state.rng + 1)
    loop.step = 3
    resume.save(run, resume.StepNamedState.of(written), loop, ref)
    run.ckpt.wait()
    fresh = jax.tree.map(jnp.copy, state)
    got, got_ref, resumed = resume.restore(run, fresh, assemble.start_loop(run))
    assert resumed and isinstance(got, train_step.TrainState) and int(got.updates) == 7
    np.testing.assert_array_equal(_flat(got.params), _flat(written.params))
    np.testing.assert_array_equal(np.asarray(got.rng), np.asarray(written.rng))
    assert (got_ref is None) == (ref is None)
