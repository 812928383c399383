"""The RL training loop: optional cold-start SFT, then rollout -> rewards -> minibatch updates."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from gvpo_jax import losses, rollout, session, sharding, tasks, train_step
from gvpo_jax.replay import ReplayBuffer


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps); checkpoints are intact."""


def loss_kwargs(config: ml_collections.ConfigDict) -> dict:
    """Preset overrides from the config (only the ones the user set), plus max_tokens."""
    preset = losses.get_preset(config.algo.name)
    kw = {}
    if preset.kind == "gvpo":
        kw["beta"] = config.algo.beta
    else:
        for name in ("eps_low", "eps_high"):
            if config.algo[name] is not None:
                kw[name] = config.algo[name]
        if preset.kind == "clip":
            if config.algo.kl_coef is not None:
                kw["kl_coef"] = config.algo.kl_coef
            kw["max_tokens"] = config.rollout.max_new_tokens
    return kw


def needs_reference(config: ml_collections.ConfigDict) -> bool:
    """A frozen reference copy: GVPO's anchor="ref", a KL penalty, or the KL-to-start metric."""
    preset = losses.get_preset(config.algo.name)
    if config.train.kl_ref_metric:
        return True
    if preset.kind == "gvpo":
        return config.algo.anchor == "ref"
    kl = config.algo.kl_coef if config.algo.kl_coef is not None else preset.kwargs.get("kl_coef", 0)
    return preset.kind == "clip" and kl > 0


def uses_dynamic_sampling(config) -> bool:
    if config.algo.dynamic_sampling is not None:
        return bool(config.algo.dynamic_sampling)
    return losses.get_preset(config.algo.name).dynamic_sampling


@dataclasses.dataclass
class Run:
    """Host-side objects of one run (everything that is not a jax pytree)."""

    config: ml_collections.ConfigDict
    workdir: str
    graphdef: nnx.GraphDef
    tokenizer: object
    task: tasks.Task
    settings: rollout.RolloutSettings
    writer: object
    ckpt: object
    ref_params: object = None
    replay: ReplayBuffer | None = None
    np_rng: np.random.Generator | None = None
    mesh: object = None  # jax.sharding.Mesh; None: one device, shardings follow the inputs
    rules: object = None  # logical axis rules for the model on the mesh
    state_shardings: object = None  # TrainState of shardings (with a mesh)
    logprobs: object = None  # jitted (params, tokens, attn_mask) -> response log-probs

    def model(self, params):
        return nnx.merge(self.graphdef, params)


def init_train_state(run: Run, params, tx, rng) -> train_step.TrainState:
    """A fresh train state; with a mesh, placed in its shards (and run.state_shardings set)."""
    if run.mesh is None:
        return train_step.init_state(params, tx, rng)
    state, run.state_shardings = train_step.init_state_sharded(params, tx, rng, run.mesh, run.rules)
    return state


def make_update_fns(run: Run, params, rng, total_rl_updates: int):
    """The RL train state and its jitted update (static settings bound by partial).

    Also sets `run.logprobs`, the jitted old / reference log-prob forward with the same shardings.
    Returns (state, update, tx); tx re-initialises the moments after an SFT phase.
    """
    c = run.config
    tx, lr_fn = train_step.make_optimizer(
        lr=c.optim.lr,
        total_updates=total_rl_updates,
        warmup_steps=c.optim.warmup_steps,
        schedule=c.optim.schedule,
        weight_decay=c.optim.weight_decay,
        b1=c.optim.b1,
        b2=c.optim.b2,
        grad_clip=c.optim.grad_clip,
    )
    state = init_train_state(run, params, tx, rng)
    shardings = run.state_shardings
    run.logprobs = train_step.jit_logprobs(
        run.graphdef, prompt_len=c.data.max_prompt_len, chunk_size=c.model.logprob_chunk,
        group_size=c.rollout.group_size, mesh=run.mesh,
        param_shardings=None if shardings is None else shardings.params, rules=run.rules,
    )  # fmt: skip
    loss_fn = functools.partial(
        train_step.rl_loss,
        graphdef=run.graphdef,
        algo=c.algo.name,
        group_size=c.rollout.group_size,
        prompt_len=c.data.max_prompt_len,
        chunk_size=c.model.logprob_chunk,
        anchor=c.algo.anchor,
        loss_kwargs=loss_kwargs(c),
    )
    update = train_step.jit_update(
        loss_fn, tx, c.optim.micro_batches, lr_fn, mesh=run.mesh, state_shardings=shardings,
        rules=run.rules,
    )  # fmt: skip
    return state, update, tx


# ----------------------------------------------------------------------------------------------
# Multi-process data flow. Each process reads, samples and scores only the rows it feeds; the
# host-side batch of a step (rewards, tokens, log-probs: small next to the model) is then
# all-gathered, so dynamic sampling, the replay buffer, minibatch shuffles and metrics run on the
# same global numpy batch on every process, exactly as in a single-process run, and each process
# hands only its rows back to the devices. With one process every helper is the identity.


def _multi(run: Run) -> bool:
    return run.mesh is not None and jax.process_count() > 1


def next_examples(run: Run, n: int) -> list[dict]:
    """This process's rows of the next global batch of n training examples (all in one process)."""
    if not _multi(run):
        return run.task.next_train(n)
    return run.task.next_train(n, rows=sharding.process_rows(n, run.mesh).rows)


def gather_rows(run: Run, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The global host batch on every process from each process's local rows."""
    return sharding.gather_rows(batch, run.mesh) if _multi(run) else batch


def to_device(run: Run, batch, *, group_size=None, micro_batches=1, local=False):
    """A host batch as the jitted functions' input: numpy as is in one process (jit places it
    with its in_shardings); multi-process, global arrays built from this process's rows of the
    global `batch` (or from `batch` itself with local=True), whole groups per shard checked."""
    if not _multi(run):
        return batch
    if not local:
        rows = sharding.process_rows(len(next(iter(batch.values()))), run.mesh).rows
        batch = {k: v[rows] for k, v in batch.items()}
    return sharding.shard_batch(batch, run.mesh, group_size=group_size, micro_batches=micro_batches)


def to_host(run: Run, x) -> np.ndarray:
    """A row-sharded result as a full numpy array on every process."""
    return sharding.gather(x) if _multi(run) else np.asarray(x)


# ----------------------------------------------------------------------------------------------
# Cold-start SFT


def sft_batch(run: Run, examples) -> dict[str, np.ndarray]:
    c = run.config
    prompts = [ex["prompt_ids"] for ex in examples]
    answers = [ex.get("solution") or ex["answer"] for ex in examples]
    toks, mask = rollout.encode_answers(
        run.tokenizer,
        answers,
        max_new_tokens=c.rollout.max_new_tokens,
        eos_id=run.settings.eos_ids[0],
        pad_id=run.settings.pad_id,
    )
    return rollout.layout_batch(
        prompts,
        toks,
        mask,
        group_size=1,
        prompt_len=c.data.max_prompt_len,
        pad_id=run.settings.pad_id,
    )


def sft_updater(
    run: Run,
    state: train_step.TrainState,
    *,
    steps: int,
    lr: float,
    warmup_steps: int,
    schedule: str = "cosine",
):
    """(sft_state, update) for `steps` cross-entropy updates from `state`'s params and rng.

    `update(sft_state, batch) -> (sft_state, metrics)` is the jitted step (state donated); the
    params and rng are copied so `state` stays valid for the caller.
    """
    c = run.config
    tx, lr_fn = train_step.make_optimizer(
        lr=lr,
        total_updates=steps,
        warmup_steps=warmup_steps,
        schedule=schedule,
        grad_clip=c.optim.grad_clip,
    )
    loss_fn = functools.partial(
        train_step.sft_loss,
        graphdef=run.graphdef,
        prompt_len=c.data.max_prompt_len,
        chunk_size=c.model.logprob_chunk,
    )
    sft_state = init_train_state(run, jax.tree.map(jnp.copy, state.params), tx, jnp.copy(state.rng))
    update = train_step.jit_update(
        loss_fn, tx, 1, lr_fn, mesh=run.mesh, state_shardings=run.state_shardings,
        rules=run.rules,
    )  # fmt: skip
    return sft_state, update


def run_sft(run: Run, state: train_step.TrainState, *, steps: int, log_prefix="sft"):
    """Cross-entropy on prompt + answer pairs with the response mask; returns the new params."""
    c = run.config
    sft_state, update = sft_updater(
        run, state, steps=steps, lr=c.sft.lr, warmup_steps=c.sft.warmup_steps
    )
    t0 = time.perf_counter()
    for i in range(steps):
        examples = next_examples(run, c.sft.batch_size)
        batch = to_device(run, sft_batch(run, examples), group_size=1, local=True)
        sft_state, m = update(sft_state, batch)
        if (i + 1) % max(steps // 10, 1) == 0 or i + 1 == steps:
            m = jax.device_get(m)
            run.writer.write_scalars(
                i + 1,
                {f"{log_prefix}/{k}": float(v) for k, v in m.items()}
                | {f"{log_prefix}/time_s": time.perf_counter() - t0},
            )
            if sharding.is_primary():
                print(f"[sft] step {i + 1}/{steps}  nll {float(m['nll']):.4f}", flush=True)
    return state.replace(params=sft_state.params)


# ----------------------------------------------------------------------------------------------
# RL


def collect_rollout(run: Run, params, rng: jax.Array, num_prompts: int):
    """Fresh groups for one step; with dynamic sampling, extra rounds replace uninformative ones.

    Returns (batch, completions, examples, metrics): `batch` is the global batch (every row, on
    every process); completions / examples are this process's rows of the first round.
    """
    c, G = run.config, run.config.rollout.group_size
    model = run.model(params)
    dynamic = uses_dynamic_sampling(c)
    preset = losses.get_preset(c.algo.name)
    kept, info_acc, completions_all, examples_all = [], {}, [], []
    num_kept, rounds_run = 0, 0
    rounds = 1 + (c.algo.max_extra_rounds if dynamic else 0)
    for r in range(rounds):
        rounds_run += 1
        examples = next_examples(run, num_prompts)
        batch, completions, info = rollout.rollout(
            model,
            examples,
            [ex["prompt_ids"] for ex in examples],
            tokenizer=run.tokenizer,
            settings=run.settings,
            mesh=run.mesh,
            rules=run.rules,
            rng=jax.random.fold_in(rng, r),
            score_fn=run.task.score,
            demo_answers=[ex.get("solution") or ex["answer"] for ex in examples]
            if c.algo.demo_slot
            else None,
        )
        batch["truncated"] = info.pop("truncated")
        batch = gather_rows(run, batch)  # every process now holds all rows of this round
        info["truncated"] = batch.pop("truncated")
        batch["task_rewards"] = batch["rewards"].copy()
        if preset.overlong_penalty:
            batch["rewards"] = batch["rewards"] + np.asarray(
                losses.overlong_penalty(
                    batch["lengths"],
                    max_len=c.rollout.max_new_tokens,
                    cache_len=c.algo.overlong_cache,
                    factor=c.algo.overlong_factor,
                )
            )
        for k, v in info.items():
            info_acc.setdefault(k, []).append(v)
        if r == 0:
            completions_all, examples_all = completions, examples
        if not dynamic:
            kept.append(batch)
            num_kept = num_prompts
            break
        good = np.flatnonzero(rollout.informative_mask(batch["task_rewards"], G))
        if r == 0:
            first_round = batch
        take = good[: num_prompts - num_kept]
        if len(take):
            kept.append(rollout.select_groups(batch, take, G))
            num_kept += len(take)
        if num_kept == num_prompts:
            break
    if num_kept < num_prompts:  # bound reached: fill with uninformative groups (zero advantage)
        good = rollout.informative_mask(first_round["task_rewards"], G)
        fill = np.flatnonzero(~good)[: num_prompts - num_kept]
        kept.append(rollout.select_groups(first_round, fill, G))
    batch = rollout.concat_batches(kept)
    metrics = {
        "rollout_time_s": float(np.sum(info_acc.pop("rollout_time_s"))),
        "reward_time_s": float(np.sum(info_acc.pop("reward_time_s"))),
        "truncated_frac": float(np.mean(np.concatenate(info_acc.pop("truncated")))),
        "rollout_rounds": float(rounds_run),
    }
    for k, v in info_acc.items():  # counts (reward timeouts, errors) of this process's rows
        metrics[k] = (
            sharding.sum_over_shards(np.sum(v), run.mesh) if _multi(run) else float(np.sum(v))
        )
    return batch, completions_all, examples_all, metrics


def rl_step(run: Run, state, update, step: int):
    """One RL step: rollout, log-prob recompute, num_epochs x num_minibatches updates."""
    c, G = run.config, run.config.rollout.group_size
    P = c.rollout.prompts_per_step
    rng, roll_rng = jax.random.split(state.rng)
    state = state.replace(rng=rng)
    n_replay = int(round(c.algo.replay_fraction * P)) if run.replay is not None else 0
    if run.replay is not None and len(run.replay) < n_replay:
        n_replay = 0  # buffer still filling: a fresh-only batch (one extra compile at most)
    fresh, completions, examples, metrics = collect_rollout(
        run, state.params, roll_rng, P - n_replay
    )
    t0 = time.perf_counter()
    update_batch = {k: fresh[k] for k in ("tokens", "attn_mask", "resp_mask", "rewards")}
    if n_replay:
        update_batch = rollout.concat_batches([update_batch, run.replay.sample(n_replay)])
    if run.replay is not None:
        run.replay.add(fresh, G)
    # pi_old (and the GVPO anchor "old") for every row, replayed ones included, in one forward.
    dev = to_device(run, {k: update_batch[k] for k in ("tokens", "attn_mask")})
    tokens, attn = dev["tokens"], dev["attn_mask"]
    update_batch["old_logp"] = to_host(run, run.logprobs(state.params, tokens, attn))
    if run.ref_params is not None:
        update_batch["ref_logp"] = to_host(run, run.logprobs(run.ref_params, tokens, attn))
    old = np.asarray(update_batch["old_logp"])[: fresh["sample_logp"].shape[0]]
    gap = np.abs(old - fresh["sample_logp"]) * fresh["resp_mask"]
    num_groups = update_batch["rewards"].shape[0] // G
    step_metrics = []
    for _ in range(c.algo.num_epochs):
        for groups in rollout.minibatch_groups(num_groups, c.algo.num_minibatches, run.np_rng):
            mb = (
                rollout.select_groups(update_batch, groups, G)
                if c.algo.num_minibatches > 1 or c.algo.num_epochs > 1
                else update_batch
            )
            mb = to_device(run, mb, group_size=G, micro_batches=c.optim.micro_batches)
            state, m = update(state, mb)
            step_metrics.append(m)
    m = jax.device_get(step_metrics)
    update_s = time.perf_counter() - t0
    mask = fresh["resp_mask"]
    r = fresh["task_rewards"]
    ntok = float(mask.sum())
    metrics.update(
        {
            "reward_mean": float(np.mean(fresh["rewards"])),
            "reward_std": float(np.std(fresh["rewards"])),
            "accuracy": float(np.mean(r >= 1.0)),
            "equal_reward_group_frac": float(np.mean(~rollout.informative_mask(r, G))),
            "response_len_mean": float(np.mean(fresh["lengths"])),
            "response_len_max": float(np.max(fresh["lengths"])),
            "entropy_mc": float(-np.sum(old * mask) / max(ntok, 1.0)),
            "sampler_logp_gap_max": float(gap.max()),
            "replayed_groups": float(n_replay),
            "update_time_s": update_s,
            "tokens_per_s": ntok / max(metrics["rollout_time_s"] + update_s, 1e-9),
        }
    )
    for k in m[0]:
        metrics[k if k not in metrics else f"loss/{k}"] = float(np.mean([x[k] for x in m]))
    metrics["skipped_updates"] = float(np.sum([x["skipped"] for x in m]))
    if int(state.bad_steps) >= c.train.max_bad_steps:
        raise TrainingError(
            f"{int(state.bad_steps)} consecutive non-finite updates (train.max_bad_steps="
            f"{c.train.max_bad_steps}); the last good checkpoint in {run.workdir} is intact."
        )
    return state, metrics, completions, examples


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs the configured mode in `workdir`; returns the final summary metrics."""
    run_, state = session.build(config, workdir)
    run_.replay = session.make_replay(config)
    try:
        return _run_mode(run_, state)
    finally:
        run_.writer.close()
        run_.task.close()
        run_.ckpt.close()


def _record_eval(summary: dict, key: str, run_: Run, params, *, step: int) -> None:
    """summary[key] = held-out accuracy (avg@n when eval_samples > 1), key_greedy = greedy."""
    result = session.evaluate(run_, params, step=step)
    summary[key] = result["accuracy"]
    if run_.config.train.eval_samples > 1:
        summary[f"{key}_greedy"] = result["greedy"]


def _run_mode(run_: Run, state) -> dict:
    """Restore or cold-start, then the mode's work. Resume order: restore_from > workdir > init."""
    c = run_.config
    per_step = c.algo.num_epochs * c.algo.num_minibatches
    state, update, tx = make_update_fns(
        run_, state.params, state.rng, per_step * max(c.train.steps, 1)
    )
    if needs_reference(c):
        run_.ref_params = state.params  # structure for the restore target; frozen again below
    state, start, resumed = session.restore(run_, state)
    summary: dict = {}
    if c.mode == "eval":
        return session.evaluate(run_, state.params, step=start)
    if c.mode == "export":
        return session.export(run_, state.params)
    if c.sft.steps and not resumed:
        _record_eval(summary, "eval_before_sft", run_, state.params, step=0)
        state = run_sft(run_, state, steps=c.sft.steps)
        state = init_train_state(run_, state.params, tx, state.rng)  # fresh moments for RL
    if needs_reference(c) and not resumed:
        session.freeze_reference(run_, state.params)
    if c.mode == "sft":
        _record_eval(summary, "eval_after_sft", run_, state.params, step=0)
        session.save(run_, state, 0)
        session.finish(run_, state.params, summary)
        return summary
    return train_rl(run_, state, update, start, summary)


def train_rl(run_: Run, state, update, start: int, summary: dict) -> dict:
    c = run_.config
    _record_eval(summary, "eval_start", run_, state.params, step=start)
    guard = session.preemption_guard()
    bar = session.Progress(c.train.steps, start, c.train.log_every)
    with guard:
        for step in range(start + 1, c.train.steps + 1):
            state, metrics, completions, examples = rl_step(run_, state, update, step)
            if step % c.train.log_every == 0:
                run_.writer.write_scalars(step, metrics)
            bar.update(step, metrics)
            if c.train.sample_log_every and step % c.train.sample_log_every == 0:
                run_.writer.write_texts(step, session.sample_texts(examples, completions, c))
            if c.train.eval_every and step % c.train.eval_every == 0 and step < c.train.steps:
                session.evaluate(run_, state.params, step=step)
            last = step == c.train.steps
            stop = guard.should_stop()  # a collective in multi-process runs: every process calls
            if last or stop or run_.ckpt.should_save(step):
                session.save(run_, state, step)
            if stop and not last:
                run_.ckpt.wait()
                bar.close()
                if sharding.is_primary():
                    print(f"Preempted: saved step {step} in {run_.workdir}; exiting.", flush=True)
                summary["preempted_at"] = step
                return summary
    bar.close()
    _record_eval(summary, "eval_end", run_, state.params, step=c.train.steps)
    session.finish(run_, state.params, summary)
    if sharding.is_primary():
        with open(os.path.join(run_.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary
