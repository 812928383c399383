"""Asynchronous rollouts with an exact lag: the queue of sampled rollouts that `rl_step` trains
on `rollout.staleness` steps after they were sampled, and the sampling mesh that fills it.

The rollout of step t is sampled by the policy at the start of step t - k (k = staleness; the
first k steps use the start policy), whatever the timing: the lag is a count of updates, not a
race, so reruns and resumes are bit-identical. At step t the queue holds R_t .. R_{t+k-1}; the
step pops R_t, samples R_{t+k} with its own start parameters (on the training mesh, or on a
sampling mesh in a thread while the update runs: `SamplingMesh`), and trains on R_t. The queue
is part of the loop state and is checkpointed (`state_dict` / `load_state_dict`); a resume with
another k first drops what the new k may not train on (`fit`), and the loop state rewinds the
data position so the dropped rollouts' prompts are sampled again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from gvpo_jax import models

# Arrays of queued rollouts are saved beside the replay buffer's, under this key prefix.
PREFIX = "queue/"


@dataclasses.dataclass
class QueuedRollout:
    """One sampled and scored rollout waiting for its step."""

    batch: dict[str, np.ndarray]  # `rollout.collect_groups`' global batch (every row)
    metrics: dict[str, float]  # its rollout metrics (truncation, rounds, reward counters)
    completions: list[str]  # this process's rows of the first round (sample logs)
    examples: list[dict]  # their prompts and golds: {"prompt", "answer"}
    policy_step: int  # the step whose start-of-step policy sampled it
    # The training stream's position before its prompts were read (`tasks.DataCursor`'s
    # state_dict): where a resume that drops it rewinds to (None: an older checkpoint's).
    data_start: dict | None = None
    times: tuple[float, float] = (0.0, 0.0)  # wall-clock start and end of its sampling


def _brief(examples: list[dict]) -> list[dict]:
    """What the sample logs read of an example (JSON-able, for the checkpoint)."""
    return [{"prompt": str(ex.get("prompt", "")), "answer": str(ex["answer"])} for ex in examples]


def state_dict(queue: list[QueuedRollout]) -> list[dict]:
    """JSON-able entries for the checkpoint's meta (the arrays: `arrays`)."""
    meta = []
    for r in queue:
        meta.append(
            {
                "metrics": r.metrics,
                "completions": r.completions,
                "examples": r.examples,
                "policy_step": r.policy_step,
                "keys": sorted(r.batch),
            }
        )
        if r.data_start is not None:
            meta[-1]["data_start"] = dict(r.data_start)
    return meta


def arrays(queue: list[QueuedRollout]) -> dict[str, np.ndarray]:
    """The queued rollouts' arrays under PREFIX, for the checkpoint's array item."""
    return {
        f"{PREFIX}{i}/{k}": np.asarray(v) for i, r in enumerate(queue) for k, v in r.batch.items()
    }


def load_state_dict(meta: list[dict], arrays: dict[str, np.ndarray]) -> list[QueuedRollout]:
    """The queue `state_dict` saved."""
    return [
        QueuedRollout(
            batch={k: np.asarray(arrays[f"{PREFIX}{i}/{k}"]) for k in m["keys"]},
            metrics=dict(m["metrics"]),
            completions=list(m["completions"]),
            examples=list(m["examples"]),
            policy_step=int(m["policy_step"]),
            data_start=m.get("data_start"),
        )
        for i, m in enumerate(meta)
    ]


def fit(queue: list[QueuedRollout], *, staleness: int, step: int) -> list[QueuedRollout]:
    """Removes from `queue` (in place) what a run at `staleness` = k may not train on from step
    `step`, and returns it, oldest first.

    queue[i] is R_{step + i}. It stays while i < k and its lag at that step, step + i minus the
    step whose policy sampled it, is at most k; from the first that fails, it and every newer
    one go, so the kept rollouts and the prompts read again after them stay in stream order.
    A smaller k than the queue was sampled for therefore drops the whole queue (each rollout
    was sampled the old k steps ahead), k = 0 too; a larger k keeps it all.
    """
    keep = 0
    while keep < min(len(queue), staleness) and step + keep - queue[keep].policy_step <= staleness:
        keep += 1
    dropped = queue[keep:]
    del queue[keep:]
    return dropped


class SamplingMesh:
    """The devices that only sample (`mesh.rollout_devices`): the policy is sent there in the
    compute dtype after each update (device to device), and a thread samples while the training
    mesh updates. `collect(params, key)` is `rollout.collect_groups` bound to this mesh."""

    def __init__(self, mesh: jax.sharding.Mesh, rules: tuple, param_shardings, compute_dtype):
        self.mesh, self.rules = mesh, rules
        self._send = jax.jit(lambda p: models.cast_floating(p, compute_dtype))
        self._shardings = param_shardings

    def send(self, params):
        """The policy on the sampling mesh, in the compute dtype (cast where it is, then a
        device-to-device copy)."""
        return jax.device_put(self._send(params), self._shardings)


class Pending:
    """R_{t+k} being sampled: `join()` appends it to the queue (and re-raises its error)."""

    def __init__(self, queue: list, work: Callable[[], QueuedRollout], threaded: bool):
        self._queue, self._error, self._result = queue, None, None
        if not threaded:
            self._result = work()
            self._thread = None
            return

        def run():
            try:
                self._result = work()
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                self._error = e

        self._thread = threading.Thread(target=run, name="gvpo-sampler", daemon=True)
        self._thread.start()

    def join(self) -> QueuedRollout:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        self._queue.append(self._result)
        return self._result


def take(
    queue: list[QueuedRollout],
    *,
    staleness: int,
    step: int,
    params,
    rng: jax.Array,
    collect: Callable,
    position: Callable[[], dict],
    sampling: SamplingMesh | None = None,
) -> tuple[QueuedRollout, Pending]:
    """The rollout step `step` trains on, and the sampling of R_{step + staleness}.

    `collect(params, key) -> (batch, completions, examples, metrics)` samples and scores one
    rollout from the next training prompts, which start at `position()` (the data cursor's
    state_dict, recorded with the rollout). The queue must fit
    `staleness` (`fit`). At the run's start (or a resume whose queue is shorter) the missing
    rollouts are sampled first, from the current policy, with keys folded from `rng` by the
    step they are for; R_{step + staleness} uses `rng`. With `sampling`, that last one runs on
    the sampling mesh in a thread (join the returned `Pending` after the update); without, it
    is sampled here before returning.
    """
    if len(queue) > staleness:  # dropping here would skip their prompts: `fit` rewinds them
        raise ValueError(f"{len(queue)} queued rollouts for staleness {staleness}; fit() first.")

    def sample(policy, key) -> QueuedRollout:
        t0, start = time.time(), position()
        batch, completions, examples, metrics = collect(policy, key)
        return QueuedRollout(
            batch,
            metrics,
            completions,
            _brief(examples),
            policy_step=step,
            data_start=start,
            times=(t0, time.time()),
        )

    policy = params
    if sampling is not None:  # the policy and the key (host copy: uncommitted) go over there
        policy, rng = sampling.send(params), np.asarray(jax.device_get(rng))
    for s in range(step + len(queue), step + staleness):
        queue.append(sample(policy, jax.random.fold_in(rng, s)))
    current = queue.pop(0)
    return current, Pending(queue, lambda: sample(policy, rng), threaded=sampling is not None)
