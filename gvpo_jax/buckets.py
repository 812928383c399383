"""Length-bucketed update and log-prob passes: each micro-batch cut to its own longest response.

A rollout's responses end at very different lengths, but its update rows are laid out to
`max_new_tokens` response slots, so a batch whose answers average 120 of 256 tokens spends about
half of every forward and backward on padding. With `optim.length_buckets = K` the trainer
instead sorts a minibatch's groups by their longest response, cuts them into the configured
`optim.micro_batches`, and trims each micro-batch's response slots to the smallest of K bucket
widths that holds all of its responses. The log-prob passes (pi_old, the reference) run the same
way, in chunks of one micro-batch's rows.

Micro-batches of different widths are different shapes, so the gradients are accumulated outside
the compiled graph: one jitted call per micro-batch adds its gradients into a donated
accumulator, and one jitted call averages them and applies the optimizer (`train_step.
apply_gradients`, the same as the in-graph path). At most K shapes are compiled per function,
the widest being today's; nothing else recompiles.

The result is the plain update's on the same micro-batches (trimmed slots are padding: every
loss masks them, and Dr. GRPO's divisor is the constant `max_new_tokens`), except that groups are
assigned to micro-batches by length rather than by position. Every loss is a mean over whole
groups or sequences of a micro-batch, which that assignment does not change, except DAPO's
token mean: there each micro-batch is weighted by its share of the minibatch's tokens, so the
accumulated loss is the minibatch's exact token mean (sorting by length would otherwise weight
short answers' tokens up).
"""

from __future__ import annotations

import jax
import numpy as np

from gvpo_jax import sharding, train_step
from gvpo_jax.models import lora

SEQUENCE_KEYS = ("tokens", "attn_mask")  # [B, prompt_len + N]; every other 2-D array is [B, N]


def bucket_widths(max_new_tokens: int, buckets: int) -> tuple[int, ...]:
    """K response widths up to max_new_tokens, evenly spaced, each rounded up to a multiple of 8."""
    if buckets < 1:
        raise ValueError(f"buckets={buckets} must be >= 1.")
    n = max_new_tokens
    ceil = [-(-n * i // buckets) for i in range(1, buckets + 1)]
    return tuple(sorted({min(n, -(-w // 8) * 8) for w in ceil}))


def response_ends(resp_mask_BxN) -> np.ndarray:
    """[B] one past each row's last response slot (0 for a row without response tokens)."""
    m = np.asarray(resp_mask_BxN) > 0
    n = m.shape[1]
    return np.where(m.any(1), n - np.argmax(m[:, ::-1], axis=1), 0)


def plan_chunks(
    resp_mask_BxN, group_size: int, chunks: int, widths
) -> list[tuple[np.ndarray, int]]:
    """Groups sorted by their longest response and cut into `chunks` equal runs of whole groups:
    [(row indices, response width)], the width being the smallest of `widths` that holds every
    response of the chunk. Ties keep the batch order (a stable sort)."""
    ends_B = response_ends(resp_mask_BxN)
    num_groups = len(ends_B) // group_size
    if num_groups % chunks:
        raise ValueError(f"{num_groups} groups cannot be cut into {chunks} equal chunks.")
    group_end = ends_B.reshape(num_groups, group_size).max(1)
    order = np.argsort(group_end, kind="stable")
    per = num_groups // chunks
    out = []
    for c in range(chunks):
        groups = order[c * per : (c + 1) * per]
        need = int(group_end[groups].max())
        width = next(w for w in widths if w >= need)
        rows = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        out.append((rows, width))
    return out


def trim(batch: dict, rows: np.ndarray, width: int, prompt_len: int) -> dict:
    """The given rows of a host batch with the response slots cut to `width`."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)[rows]
        if v.ndim == 2:
            v = v[:, : prompt_len + width if k in SEQUENCE_KEYS else width]
        out[k] = v
    return out


class BucketedSteps:
    """The length-bucketed update and log-prob passes of one run (built by `gvpo_jax.assemble`).

    `update(state, host_batch)` is `jit_update`'s step on a host (numpy) minibatch of whole
    groups; `logprobs(params, host_batch)` is the [B, N] response log-probs of `jit_logprobs`
    (`logprobs_fn`, any shape) on a host batch. Both take the global batch, identical on every
    process (as the trainer holds it), and put each micro-batch on the mesh themselves.
    """

    def __init__(self, loss_fn, tx, lr_fn, logprobs_fn, *, micro_batches: int, chunks: int,
                 widths, prompt_len: int, group_size: int, token_weighted: bool, mesh,
                 state_shardings, rules=sharding.LOGICAL_RULES):  # fmt: skip
        self.micro_batches, self.chunks, self.widths = micro_batches, chunks, tuple(widths)
        self.prompt_len, self.group_size, self.mesh = prompt_len, group_size, mesh
        self.token_weighted = token_weighted
        self._loss_fn, self._logprobs, self._aux_shape = loss_fn, logprobs_fn, None
        repl = sharding.replicated(mesh)
        rows = sharding.batch_sharding(mesh)
        trained = lora.split_trainable(state_shardings.params)[0]  # LoRA: the adapters' only
        acc_sh = {"grads": trained, "loss": repl, "aux": repl}
        self._acc_shardings = acc_sh

        def accumulate(params, acc, batch, weight):
            def weighted(p, b):
                loss, aux = loss_fn(p, b)
                return loss * weight, aux

            with sharding.tracing_mesh(mesh, rules):
                return train_step.accumulate(params, acc, batch, loss_fn=weighted)

        def apply(state, acc):
            return train_step.apply_gradients(
                state, acc["grads"], acc["loss"], acc["aux"], micro_batches=micro_batches,
                tx=tx, lr_fn=lr_fn,
            )  # fmt: skip

        self._accumulate = jax.jit(
            accumulate,
            in_shardings=(state_shardings.params, acc_sh, rows, repl),
            out_shardings=acc_sh,
            donate_argnames=("acc",),
        )
        self._apply = jax.jit(
            apply,
            in_shardings=(state_shardings, acc_sh),
            out_shardings=(state_shardings, repl),
            donate_argnames=("state",),  # (the gradients have no output to alias)
        )
        self._zeros = None

    def _zero_acc(self, params, first_batch):
        if self._zeros is None:  # the aux keys and shapes are the same for every width
            aux = jax.eval_shape(lambda p, b: self._loss_fn(p, b)[1], params, first_batch)
            self._zeros = jax.jit(
                lambda p: train_step.zero_accumulator(p, aux),
                out_shardings=self._acc_shardings,
            )
        return self._zeros(params)

    def _device_chunks(self, batch: dict, resp_mask, chunks: int):
        """(rows, width, device batch) per chunk of `plan_chunks(resp_mask, ...)`: the rows of
        whole groups of `batch`, trimmed to the chunk's width and put on the mesh."""
        plan = plan_chunks(resp_mask, self.group_size, chunks, self.widths)
        for rows, width in plan:
            host = trim(batch, rows, width, self.prompt_len)
            yield rows, width, sharding.device_batch(host, self.mesh, group_size=self.group_size)

    def accumulated(self, params, batch: dict) -> tuple[dict, float]:
        """Gradients, loss and aux summed over the micro-batches of a host minibatch of whole
        groups (the `train_step.accumulate` carry), and the share of its response slots that
        were computed."""
        M = self.micro_batches
        resp_mask = np.asarray(batch["resp_mask"])
        total_tokens = max(float(resp_mask.sum()), 1.0)
        acc, slots = None, 0
        for rows, width, mb in self._device_chunks(batch, resp_mask, M):
            weight = 1.0
            if self.token_weighted:  # the minibatch's exact token mean (see the module doc)
                weight = M * float(resp_mask[rows, :width].sum()) / total_tokens
            if acc is None:
                acc = self._zero_acc(params, mb)
            acc = self._accumulate(params, acc, mb, np.float32(weight))
            slots += len(rows) * width
        return acc, slots / resp_mask.size

    def update(self, state, batch: dict):
        """One optimizer update on a host minibatch of whole groups -> (state, metrics);
        metrics["update_slot_frac"] is the share of the response slots computed."""
        acc, slot_frac = self.accumulated(state.params, batch)
        state, metrics = self._apply(state, acc)
        return state, {**metrics, "update_slot_frac": slot_frac}

    def logprobs(self, params, batch: dict, reference: bool = False) -> np.ndarray:
        """[B, N] response log-probs of a host batch (tokens, attn_mask, resp_mask), chunk by
        chunk; slots past a chunk's width are 0, as masked slots are. reference=True: with the
        LoRA adapters off (`train_step.jit_logprobs`)."""
        resp_mask = np.asarray(batch["resp_mask"])
        sequences = {k: batch[k] for k in SEQUENCE_KEYS}
        parts = []
        off = (True,) if reference else ()  # LoRA: the adapters off (jit_logprobs)
        for rows, width, dev in self._device_chunks(sequences, resp_mask, self.chunks):
            # dispatch every chunk, then wait for all of them
            logp = self._logprobs(params, dev["tokens"], dev["attn_mask"], *off)
            parts.append((rows, width, logp))
        out = np.zeros(resp_mask.shape, np.float32)
        for rows, width, logp in parts:
            out[rows, :width] = sharding.gather(logp)
        return out
