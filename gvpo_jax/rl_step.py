"""One RL step on one page: rollout, rewards, filters, replay, log-probs, updates, metrics.

`rl_step(run, state, loop, ref_params)` is the whole step of `python -m gvpo_jax.main`; `run`
is the frozen object of `gvpo_jax.assemble` (jitted functions, task, sampler settings, mesh),
`state` the `train_step.TrainState` (device arrays), `loop` the host side of what changes
(`LoopState`: data position, shuffle stream, replay buffer), and every setting the step reads is
in `run.settings` (`StepSettings`), never in the config.

Multi-process runs: each process samples and scores only the rows it feeds; the small host batch
of a round (tokens, rewards, log-probs) is then all-gathered, so dynamic sampling, the replay
buffer, minibatch shuffles and metrics see the same global numpy batch on every process, and each
process hands only its rows back to the devices. With one process the gathers are the identity.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from gvpo_jax import batch as batch_lib
from gvpo_jax import losses, rollout_queue, routing, tasks, train_step
from gvpo_jax.batch import BatchSpec, UpdateBatch
from gvpo_jax.errors import FaultError
from gvpo_jax.replay import ReplayBuffer
from gvpo_jax.rollout import collect_groups


class TrainingError(FaultError):
    """The run cannot go on (e.g. too many consecutive non-finite steps); checkpoints are intact.

    `metrics` holds the failing step's metrics when they were computed (the trainer logs them).
    """

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What one RL step does: the algorithm and reference resolved at assembly, and the
    config's rollout / algo / optim layout."""

    algorithm: losses.Algorithm  # the loss, its advantages and what the step must provide
    reference: train_step.Reference  # where ref_logp comes from (a copy, adapters off, none)
    spec: BatchSpec  # the optional fields the update batch carries (fixed by the two above)
    prompts_per_step: int  # P groups per update batch (fresh + replayed)
    group_size: int  # G responses per prompt
    prompt_len: int  # prompt slots of the update layout (data.max_prompt_len)
    num_epochs: int  # passes over a rollout's groups
    num_minibatches: int  # updates per pass (whole groups per minibatch)
    micro_batches: int  # gradient accumulation inside one update
    replay_fraction: float  # share of the P groups drawn from the replay buffer (GVPO)
    max_extra_rounds: int  # rollout rounds at most beyond the first, with dynamic sampling
    demo_slot: bool  # the last response of every group is the demonstration answer
    max_bad_steps: int  # consecutive non-finite updates before the run stops
    grad_clip: float = 0.0  # the optimizer's global-norm clip (0: off), for grad_clipped_frac
    staleness: int = 0  # the rollout of step t comes from the policy of step t - staleness
    routing_metrics: bool = True  # an MoE policy's moe/* metrics (from the first update's forward)
    routing_replay: str = "none"  # an MoE policy's routing replay: none | r2 | r3
    # An MoE policy's routing record per token: (MoE layers, experts per token, integer dtype)
    record: tuple = ()
    moe_layers: tuple = ()  # the MoE layers' indices (per-layer metrics)


@dataclasses.dataclass
class LoopState:
    """What changes during a run besides the `TrainState`, on the host: threaded through the
    trainer's loop (`rl_step` and `train.run_sft` advance it in place) and checkpointed with
    the train state (`state_dict` / `load_state_dict`), so a resumed run continues bit for bit.
    `assemble.Run` holds only what never changes."""

    step: int  # the last finished RL step (0 before the first)
    data: tasks.DataCursor  # the position in the task's training stream
    np_rng: np.random.Generator  # minibatch shuffles
    replay: ReplayBuffer | None  # GVPO's replay buffer (None: off)
    # Rollouts sampled ahead of their step (rollout.staleness = k > 0): R_{t+1} .. R_{t+k}.
    queue: list = dataclasses.field(default_factory=list)

    def state_dict(self) -> dict:
        """JSON-able: the step, the data position, the shuffle stream and the queued rollouts'
        texts and metrics (their arrays and the replay buffer's go beside it: `arrays`)."""
        meta = {
            "step": self.step,
            "data": self.data.state_dict(),
            "np_rng": self.np_rng.bit_generator.state,
        }
        if self.queue:
            meta["queue"] = rollout_queue.state_dict(self.queue)
        return meta

    def arrays(self) -> dict[str, np.ndarray] | None:
        """The replay buffer's arrays and the queued rollouts' (under rollout_queue.PREFIX)."""
        out = dict(self.replay.state_dict()) if self.replay is not None else {}
        out.update(rollout_queue.arrays(self.queue))
        return out or None

    def load_state_dict(self, meta: dict, arrays: dict | None) -> None:
        arrays = arrays or {}
        self.step = int(meta["step"])
        self.data = tasks.DataCursor.from_state_dict(meta["data"])
        self.np_rng.bit_generator.state = meta["np_rng"]
        self.queue = rollout_queue.load_state_dict(meta.get("queue", []), arrays)
        replay = {k: v for k, v in arrays.items() if not k.startswith(rollout_queue.PREFIX)}
        if replay and self.replay is not None:
            self.replay.load_state_dict(replay)

    def fit_queue(self, staleness: int) -> str | None:
        """Fits the queue to the `rollout.staleness` a resumed run has (`rollout_queue.fit`):
        the dropped rollouts were never trained on, so the data position goes back to the
        first one's prompts, which the current policy samples again. Returns the log line
        saying so (None: nothing dropped)."""
        dropped = rollout_queue.fit(self.queue, staleness=staleness, step=self.step + 1)
        if not dropped:
            return None
        first = self.step + 1 + len(self.queue)

        def steps(a: int, b: int) -> str:
            return f"step {a}" if a == b else f"steps {a}-{b}"

        what = (
            f"rollout.staleness={staleness}: dropped the {len(dropped)} queued rollout(s) for "
            f"{steps(first, first + len(dropped) - 1)}, sampled by the policy of "
            f"{steps(dropped[0].policy_step, dropped[-1].policy_step)}, as a lag of at most "
            f"{staleness} cannot train on them"
        )
        start = dropped[0].data_start
        if start is None:  # a checkpoint from before the queue recorded its data positions
            return f"{what}; the checkpoint does not say where their prompts start: skipped."
        self.data = tasks.DataCursor.from_state_dict(start)
        return f"{what}; their prompts are sampled again from stream position {self.data.position}."


def logprob_passes(s: StepSettings) -> tuple[tuple[bool, train_step.Pass], ...]:
    """The log-prob passes a step runs, as (adapters-off flag, `train_step.Pass`) pairs
    (`Updater.compile_ahead`'s `passes`): pi_old's (for old_logp or the advantages' pi_old;
    replaying the sampler's routing under R3, recording its own under R2), the frozen
    reference copy's and LoRA's reference (the adapters off: True); () when the update's own
    forward is pi_old and nothing else is needed (step 4 below)."""
    old = s.spec.old_logp or (s.spec.advantages and s.algorithm.advantages_need_old)
    mode = train_step.Pass(
        replay=s.routing_replay == "r3",
        record=s.routing_replay == "r2",
        record_dtype=s.record[2] if s.routing_replay == "r2" else "uint8",
    )
    passes = ((False, mode),) * old + ((False, train_step.PLAIN),) * (s.reference.kind == "copy")
    passes += ((True, train_step.PLAIN),) * (s.reference.kind == "adapters_off")
    return tuple(dict.fromkeys(passes))


def example_batch(s: StepSettings, rows: int, max_new_tokens: int) -> UpdateBatch:
    """A host update batch of `rows` rows (whole groups) of zeros carrying the fields, shapes
    and dtypes of the batches `rl_step` builds, at full width: what `Updater.compile_ahead`
    compiles the step's programs for."""
    J, N, spec = s.prompt_len, max_new_tokens, s.spec

    def zeros(*shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    per_token = ("old_logp", "ref_logp", "behaviour_logp", "sampler_logp")
    record = {}
    if spec.routing:
        m, k, dtype = s.record
        record = dict(
            routing=zeros(rows, J + N, m, k, dtype=dtype), routing_mask=zeros(rows, J + N)
        )
    batch = UpdateBatch(
        tokens=zeros(rows, J + N, dtype=np.int32),
        valid=zeros(rows, J + N),
        loss_mask=zeros(rows, N),
        rewards=zeros(rows),
        drawn=zeros(rows) if spec.sampler_logp else None,
        **{k: zeros(rows, N) for k in per_token if getattr(spec, k)},
        **record,
    )
    if spec.advantages:
        old = zeros(rows, N) if s.algorithm.advantages_need_old else None
        adv = s.algorithm.advantages(
            rewards=batch.rewards,
            mask=batch.loss_mask,
            group_size=s.group_size,
            old_logp=old,
            ref_logp=batch.ref_logp,
        )
        batch = batch.replace(advantages=zeros(*np.shape(adv)))
    return batch


def routing_metrics(run, fresh: dict, batch: UpdateBatch, first: dict) -> dict:
    """An MoE step's moe/* metrics (`train.routing_metrics`), from the first update's own
    forward (`moe.routing_sums` in its aux: the first minibatch's rows, every row with one
    minibatch), which starts from the parameters the step's pi_old is computed with: how
    often its routers pick other experts than the sampler recorded, the experts' load and
    the routers' entropy over the tokens the sampler routed. R2 replays the old-policy pass's
    own record in the updates, so there the drift compares that record with the sampler's."""
    s = run.settings
    if not (s.spec.routing and s.routing_metrics):
        return {}
    layers = list(s.moe_layers)
    sums = {k: first[f"routing_{k}_by_layer"] for k in ("drifted", "entropy", "counts")}
    out = routing.metrics(sums, float(first["routing_recorded"]) / len(layers), layers)
    if s.routing_replay == "r2":
        rows = len(fresh["sampled"])
        fed = routing.fed_mask(fresh, s.prompt_len)
        drift_M = routing.record_drift(fresh["routes"], np.asarray(batch.routing)[:rows], fed)
        out.update({"moe/routing_drift": float(drift_M.mean()),
                    "moe/routing_drift_max": float(drift_M.max())})  # fmt: skip
    return out


def rl_step(run, state, loop: LoopState, ref_params):
    """One RL step from `state` (a `train_step.TrainState`) and `loop` (advanced in place);
    `ref_params` is the frozen reference (None when the run needs none). Returns (state,
    metrics, completions, examples): completions and examples are this process's rows of the
    first rollout round (for sample logging)."""
    t_step = time.perf_counter()
    s = run.settings
    if (ref_params is not None) != (s.reference.kind == "copy"):
        raise ValueError(
            f"the run's reference is {s.reference.kind!r}, so rl_step takes "
            f"{'the frozen copy (resume.reference_copy)' if ref_params is None else 'no'} "
            "reference parameters; pass ref_params accordingly."
        )
    G, P = s.group_size, s.prompts_per_step
    rng, roll_rng = jax.random.split(state.rng)
    state = state.replace(rng=rng)

    # 1. How many of the P groups come from the replay buffer (none until it holds enough).
    replay = loop.replay
    n_replay = int(round(s.replay_fraction * P)) if replay is not None else 0
    if replay is not None and len(replay) < n_replay:
        n_replay = 0  # buffer still filling: a fresh-only batch (one extra compile at most)

    # 2. Rollout and rewards: P - n_replay fresh groups (dynamic sampling may run more rounds).
    #    With staleness k the step trains on the rollout sampled k steps ago and samples the one
    #    of step t + k from its own start parameters (on the sampling mesh: during the update).
    pending = None
    if s.staleness:
        current, pending = rollout_queue.take(
            loop.queue,
            staleness=s.staleness,
            step=loop.step + 1,
            params=state.params,
            rng=roll_rng,
            sampling=run.sampling_mesh,
            position=lambda: loop.data.state_dict(),
            collect=lambda params, key: collect_groups(
                run, params, loop, key, P, mesh=run.sampling_mesh
            ),
        )
        fresh, completions, examples = current.batch, current.completions, current.examples
        metrics = dict(current.metrics, rollout_lag=float(loop.step + 1 - current.policy_step))
    else:
        fresh, completions, examples, metrics = collect_groups(
            run, state.params, loop, roll_rng, P - n_replay
        )
        metrics["rollout_lag"] = 0.0  # logged at every k: a resume may change it

    # 3. Replay: the update batch is the fresh groups plus replayed ones; the fresh go in.
    t0 = time.perf_counter()
    algo, spec, updater = s.algorithm, s.spec, run.updater
    rows = {k: fresh[k] for k in ("tokens", "attn_mask", "resp_mask", "rewards")}
    if n_replay:
        rows = batch_lib.concat_batches([rows, replay.sample(n_replay)])
    if replay is not None:
        replay.add(fresh, G)
    n_old = len(rows["rewards"]) - len(fresh["sampled"])  # replayed rows: not drawn this step
    batch = UpdateBatch(
        tokens=rows["tokens"],
        valid=rows["attn_mask"],
        loss_mask=rows["resp_mask"],
        rewards=rows["rewards"],
        behaviour_logp=fresh["behaviour_logp"] if spec.behaviour_logp else None,
        # The sampling policy's own (T = 1) log-probs of the rows it drew: GVPO's anchor
        # "sampler" (no replay with it), and with one update per step the consistency metrics.
        sampler_logp=np.pad(fresh["rollout_logp"], ((0, n_old), (0, 0)))
        if spec.sampler_logp
        else None,
        drawn=np.pad(fresh["sampled"], (0, n_old)) if spec.sampler_logp else None,
    )
    if spec.routing and s.routing_replay != "r2":  # the sampler's record, where it holds
        experts, mask = routing.sampler_record(fresh, s.prompt_len, extra_rows=n_old)
        batch = batch.replace(routing=experts, routing_mask=mask)

    # 4. Log-probs: pi_old (GVPO's anchor "old") and the reference for every row, replayed ones
    #    included, one forward each with the parameters the rollout used. With one update per
    #    step the update itself starts from those parameters: its own forward gives pi_old
    #    (`train_step.rl_loss` without old_logp), so that pass is skipped; the sampler
    #    consistency and entropy metrics then come from the update (rows sampled this step).
    single_update = not spec.old_logp

    def logprobs(params, adapters_off=False):  # [B, N] on the host, every row (a pass runs)
        return updater.logprobs(params, batch.tokens, batch.valid, reference=adapters_off)

    def old_logprobs():  # pi_old: R3 replays the sampler's routing in it, R2 records its own
        if s.routing_replay == "r3":
            record = (batch.routing, batch.routing_mask)
            return batch, updater.logprobs(state.params, batch.tokens, batch.valid, routing=record)
        if s.routing_replay == "r2":
            old, experts = updater.logprobs(
                state.params, batch.tokens, batch.valid, record=s.record[2]
            )
            return batch.replace(routing=experts, routing_mask=batch.valid), old
        return batch, logprobs(state.params)

    if spec.old_logp:
        batch, old = old_logprobs()
        batch = batch.replace(old_logp=old)
    if s.reference.kind == "copy":
        batch = batch.replace(ref_logp=logprobs(ref_params))
    elif s.reference.kind == "adapters_off":  # LoRA: the base, the parameters without adapters
        batch = batch.replace(ref_logp=logprobs(state.params, adapters_off=True))
    if spec.advantages:
        # Whole-batch statistics (REINFORCE++'s global normalisation) from every row, once,
        # before the batch is cut into minibatches and micro-batches. A KL in the reward needs
        # pi_old, which a single update otherwise takes from its own forward.
        old = batch.old_logp
        if old is None and algo.advantages_need_old:
            old = old_logprobs()[1]
        adv = algo.advantages(
            rewards=batch.rewards,
            mask=batch.loss_mask,
            group_size=G,
            old_logp=old,
            ref_logp=batch.ref_logp,
        )
        batch = batch.replace(advantages=np.asarray(jax.device_get(adv), np.float32))
    logprob_s = time.perf_counter() - t0  # replay + both passes (gather waits for the results)
    # Response slots computed per real response token (1.0: no padding) of a log-prob pass.
    real = max(float(batch.loss_mask.sum()), 1.0)
    pad_ratio = {"logprob_pad_ratio": updater.logprob_slots(batch.valid) / real}

    # 5. num_epochs x num_minibatches updates on shuffled whole groups.
    t0 = time.perf_counter()
    update_metrics = []
    for _ in range(s.num_epochs):
        num_groups = len(batch.rewards) // G
        for groups in batch_lib.minibatch_groups(num_groups, s.num_minibatches, loop.np_rng):
            mb = batch
            if s.num_minibatches > 1 or s.num_epochs > 1:
                mb = batch.rows(batch_lib.group_rows(groups, G))
            state, m = updater.update(state, mb)
            update_metrics.append(m)
    update_metrics = jax.device_get(update_metrics)
    update_s = time.perf_counter() - t0
    moe_metrics = routing_metrics(run, fresh, batch, update_metrics[0])
    if pending is not None:  # R_{t+k} joins the queue; this step's sampling work and timeline
        t_update_end = time.time()
        ahead = pending.join()
        metrics.update(
            rollout_time_s=ahead.metrics["rollout_time_s"],
            reward_time_s=ahead.metrics["reward_time_s"],
            **{
                "timeline/sample_start": ahead.times[0],
                "timeline/sample_end": ahead.times[1],
                "timeline/update_start": t_update_end - update_s,
                "timeline/update_end": t_update_end,
            },
        )

    # 6. Metrics of the fresh groups and of the updates.
    mask, r = fresh["resp_mask"], fresh["task_rewards"]
    ntok = float(mask.sum())
    drawn_BxN = mask * fresh["sampled"][:, None]  # the sampler's tokens (not demonstrations)
    is_sampled = fresh["sampled"] > 0
    if single_update:  # from the update's forward (train_step.rl_loss), summed over micro-batches
        u = update_metrics[0]
        entropy_mc = -float(u["sampled_logp_sum"]) / max(float(u["sampled_tokens"]), 1.0)
        gap_max = float(u["sampler_logp_gap_max"])
        n_drawn = max(float(u["sampled_tokens"]), 1.0)
        gap_mean = float(u["sampler_logp_gap_sum"]) / n_drawn
        over_cap = float(u["sampler_over_cap"]) / n_drawn
    else:
        old = np.asarray(batch.old_logp)[: fresh["rollout_logp"].shape[0]]
        n_drawn = max(float(drawn_BxN.sum()), 1.0)
        entropy_mc = float(-np.sum(old * drawn_BxN) / n_drawn)
        log_w = (old - fresh["rollout_logp"]) * drawn_BxN  # log pi_old / mu, drawn tokens
        gap_max = float(np.abs(log_w).max())
        gap_mean = float(np.abs(log_w).sum()) / n_drawn
        over_cap = float(np.sum(log_w > np.log(algo.is_cap))) / n_drawn
    metrics.update(
        {
            "reward_mean": float(np.mean(fresh["rewards"])),
            "reward_std": float(np.std(fresh["rewards"])),
            "accuracy": float(np.mean(r[is_sampled] >= 1.0)),  # the policy's, not the demos'
            "equal_reward_group_frac": float(np.mean(~batch_lib.informative_groups(r, G))),
            "response_len_mean": float(np.mean(fresh["lengths"][is_sampled])),
            "response_len_max": float(np.max(fresh["lengths"][is_sampled])),
            "entropy_mc": entropy_mc,
            **moe_metrics,
            "sampler_logp_gap_max": gap_max,
            # mean |log pi_old / mu| over the drawn tokens, and the share of them whose weight
            # exceeds the correction's cap (where token_tis acts, measured with or without it)
            "sampler_logp_gap_mean": gap_mean,
            "sampler_over_cap_frac": over_cap,
            "replayed_groups": float(n_replay),
            **pad_ratio,
            "logprob_time_s": logprob_s,
            "update_time_s": update_s,
            # Over the step's wall time: with staleness the next rollout's sampling overlapped
            # the update, so adding its time to the update's would understate the throughput.
            "tokens_per_s": ntok / max(time.perf_counter() - t_step, 1e-9),
        }
    )
    if not is_sampled.all():
        metrics["demo_accuracy"] = float(np.mean(r[~is_sampled] >= 1.0))
    for k in update_metrics[0]:
        if k in train_step.AUX_MAXES and k != "sampler_logp_gap_max":  # IS weights: the max
            metrics[k] = float(np.max([x[k] for x in update_metrics]))
        if k in train_step.AUX_SUMS or k in train_step.AUX_MAXES:
            continue
        value = float(np.mean([x[k] for x in update_metrics]))
        metrics[k if k not in metrics else f"loss/{k}"] = value
    metrics["skipped_updates"] = float(np.sum([x["skipped"] for x in update_metrics]))
    if spec.routing:  # recorded (token, layer) pairs whose experts the updates' routers change
        recorded = max(float(np.sum([x["routing_recorded"] for x in update_metrics])), 1.0)
        drifted = float(np.sum([x["routing_drifted"] for x in update_metrics]))
        metrics["moe/update_routing_drift"] = drifted / recorded
    # grad_norm above is the mean over this step's updates (before clipping); how often the
    # global-norm clip acted shows whether clipping, not the loss, shaped the updates.
    norms = np.array([float(x["grad_norm"]) for x in update_metrics])
    metrics["grad_norm_max"] = float(norms.max())
    metrics["grad_clipped_frac"] = float(np.mean(norms > s.grad_clip)) if s.grad_clip > 0 else 0.0
    if int(state.bad_steps) >= s.max_bad_steps:
        raise TrainingError(
            f"{int(state.bad_steps)} consecutive non-finite updates (train.max_bad_steps="
            f"{s.max_bad_steps}); the last good checkpoint in {run.workdir} is intact.",
            metrics=metrics,
        )
    return state, metrics, completions, examples
