"""The RL update and log-prob passes (`Updater`): micro-batches of whole groups, each cut to its
own longest response (length buckets), or all at full width (one bucket: the plain update).

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

Without `optim.length_buckets` the one width is `max_new_tokens` and the groups keep their
order: the same host-side accumulation then runs the plain full-width update, so there is one
update path. With buckets the result is the plain update's on the same micro-batches (trimmed
slots are padding: every loss masks them, and Dr. GRPO's divisor is the constant
`max_new_tokens`), except that groups are assigned to micro-batches by length rather than by
position. Every loss is a mean over whole groups or sequences of a micro-batch, which that
assignment does not change, except a token mean (DAPO, CISPO, REINFORCE++): there each
micro-batch is weighted by its share of the tokens the minibatch's loss counts (after `seq_mis`
masks responses out), so the accumulated loss is the minibatch's exact token mean (sorting by
length would otherwise weight short answers' tokens up).

Packed groups (`optim.pack_groups`, with buckets): one row per group instead of G, [its prompt |
its G responses back to back | padding] (`pack`), each response attending to the prompt and to
itself only (`Transformer.hidden_packed`), groups sorted by their packed length (the sum of their
responses') and each micro-batch cut to the smallest of K * G widths up to G * max_new_tokens
(`pack_widths`). Per-group buckets still pay for every group's longest response G times; packed,
a micro-batch pays for its longest group's total only, and still runs each prompt once. The loss
sees the unpacked [B, N] log-probs (`train_step.packed_logprobs`), so every preset works as on
whole groups, GVPO's centring included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gvpo_jax import sharding, train_step
from gvpo_jax.batch import BatchSpec, PackedRows, UpdateBatch
from gvpo_jax.models import lora

# [B, prompt_len + N, ...]; every other 2-D field is [B, N]
SEQUENCE_FIELDS = ("tokens", "valid", "routing", "routing_mask")


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


def pack_widths(max_new_tokens: int, group_size: int, buckets: int) -> tuple[int, ...]:
    """Widths of packed groups: K * G evenly spaced up to G * max_new_tokens (multiples of 8)."""
    return bucket_widths(group_size * max_new_tokens, group_size * buckets)


def plan_chunks(
    resp_mask_BxN, group_size: int, chunks: int, widths, *, packed: bool = False
) -> list[tuple[np.ndarray, int]]:
    """Groups sorted by their longest response (packed: by the sum of their responses' lengths)
    and cut into `chunks` equal runs of whole groups: [(row indices, width)], the width being
    the smallest of `widths` that holds every response (packed: every group) of the chunk. Ties
    keep the batch order (a stable sort); with one width (no buckets) the groups keep their
    order."""
    ends_B = response_ends(resp_mask_BxN)
    num_groups = len(ends_B) // group_size
    if num_groups % chunks:
        raise ValueError(f"{num_groups} groups cannot be cut into {chunks} equal chunks.")
    per_group = ends_B.reshape(num_groups, group_size)
    group_end = per_group.sum(1) if packed else per_group.max(1)
    order = np.argsort(group_end, kind="stable") if len(widths) > 1 else np.arange(num_groups)
    per = num_groups // chunks
    out = []
    for c in range(chunks):
        groups = order[c * per : (c + 1) * per]
        need = int(group_end[groups].max())
        width = next(w for w in widths if w >= need)
        rows = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        out.append((rows, width))
    return out


def trim(batch: UpdateBatch, rows: np.ndarray, width: int, prompt_len: int) -> UpdateBatch:
    """The given rows of a host batch with the response slots cut to `width`."""
    out = {}
    for k, v in batch.arrays().items():
        v = np.asarray(v)[rows]
        if v.ndim >= 2:
            v = v[:, : prompt_len + width if k in SEQUENCE_FIELDS else width]
        out[k] = v
    return batch.replace(**out)


def pack(
    batch: UpdateBatch, rows: np.ndarray, width: int, prompt_len: int, group_size: int
) -> UpdateBatch:
    """The given rows (whole groups) of a host batch in the packed layout: `packed` holds the
    `PackedRows` (one row per group: its prompt, then its responses back to back, `width`
    response slots; segment g + 1 is response g, padding G + 1), every other [B, ...] field is
    as it is (full width; the loss reads those unpacked), and tokens / valid (and a routing
    record, packed beside the tokens) are dropped."""
    G, J = group_size, prompt_len
    tokens = np.asarray(batch.tokens)[rows]
    attn = np.asarray(batch.valid)[rows]
    record = batch.routing is not None
    if record:
        routing, routing_mask = (
            np.asarray(batch.routing)[rows],
            np.asarray(batch.routing_mask)[rows],
        )
    b, n = len(rows), tokens.shape[1] - J
    r = b // G
    ends = response_ends(attn[:, J:])
    p = PackedRows(
        tokens=np.zeros((r, J + width), np.int32),
        valid=np.zeros((r, J + width), attn.dtype),
        positions=np.zeros((r, J + width), np.int32),
        segments=np.full((r, width), G + 1, np.int32),
        pred=np.full((r, width), J - 1, np.int32),
        index=np.full((b, n), -1, np.int32),
    )
    if record:
        p = p.replace(
            routing=np.zeros((r, J + width, *routing.shape[2:]), routing.dtype),
            routing_mask=np.zeros((r, J + width), routing_mask.dtype),
        )
    for g in range(r):
        first = g * G
        p.tokens[g, :J] = tokens[first, :J]
        p.valid[g, :J] = attn[first, :J]
        real = np.cumsum(attn[first, :J] > 0)
        p.positions[g, :J] = np.maximum(real - 1, 0)
        if record:
            p.routing[g, :J] = routing[first, :J]
            # how many of the group's rows hold the prompt's record (the first row's is used)
            p.routing_mask[g, :J] = routing_mask[first : first + G, :J].sum(0)
        offset = 0
        for i in range(G):
            row, length = first + i, int(ends[first + i])
            if offset + length > width:
                raise ValueError(
                    f"group of {int(ends[first : first + G].sum())} response tokens does not fit "
                    f"a packed width of {width}."
                )
            at = np.arange(length)
            slots = J + offset + at
            p.tokens[g, slots] = tokens[row, J : J + length]
            p.valid[g, slots] = attn[row, J : J + length]
            p.positions[g, slots] = real[-1] + at
            p.segments[g, offset + at] = i + 1
            p.pred[g, offset + at[1:]] = slots[:-1]  # token 0: the last prompt slot
            p.index[row, :length] = g * width + offset + at
            if record:
                p.routing[g, slots] = routing[first + i, J : J + length]
                p.routing_mask[g, slots] = routing_mask[first + i, J : J + length]
            offset += length
    per_row = {
        k: np.asarray(v)[rows] for k, v in batch.arrays().items() if k not in SEQUENCE_FIELDS
    }
    gone = dict.fromkeys(SEQUENCE_FIELDS)
    return batch.replace(packed=p, **gone, **per_row)


def to_device(batch: UpdateBatch, mesh, group_size: int) -> UpdateBatch:
    """A host micro-batch on the mesh, rows over data x fsdp (whole groups per shard); packed
    rows split by groups alike, so each group's responses stay with its packed row."""
    placed = batch.replace(**sharding.device_batch(batch.arrays(), mesh, group_size=group_size))
    if batch.packed is None:
        return placed
    groups = sharding.device_batch(batch.packed.group_arrays(), mesh)
    index = sharding.device_batch({"index": batch.packed.index}, mesh, group_size=group_size)
    return placed.replace(packed=PackedRows(**groups, **index))


class Updater:
    """The RL update and log-prob passes of one run (built by `gvpo_jax.assemble`), for every
    layout: full width (one bucket), length buckets, or packed groups.

    `update(state, batch)` is one optimizer update on a host (numpy) `UpdateBatch` minibatch of
    whole groups: one jitted call per micro-batch adds its gradients into a donated accumulator,
    one jitted call applies them (`train_step.apply_gradients`). `logprobs(params, tokens,
    valid)` is the [B, N] response log-probs of any host rows, chunk by chunk. Both take the
    global batch, identical on every process (as the trainer holds it), and put each
    micro-batch on the mesh themselves. `spec` says which optional fields every batch carries.
    """

    def __init__(
        self,
        loss_fn,
        tx,
        lr_fn,
        logprobs_fn,
        *,
        micro_batches: int,
        chunks: int,
        widths,
        prompt_len: int,
        group_size: int,
        token_weighted: bool,
        mesh,
        state_shardings,
        spec: BatchSpec,
        rules=sharding.LOGICAL_RULES,
    ):
        self.micro_batches, self.chunks, self.widths = micro_batches, chunks, tuple(widths)
        self.prompt_len, self.group_size, self.mesh = prompt_len, group_size, mesh
        # One micro-batch is the minibatch: its token mean is exact as it is, so it is not
        # multiplied by its token count and divided again (float rounding for nothing).
        token_weighted = token_weighted and micro_batches > 1
        self.token_weighted, self.spec = token_weighted, spec
        self._loss_fn, self._logprobs = loss_fn, logprobs_fn
        repl = sharding.replicated(mesh)
        rows = sharding.batch_sharding(mesh)
        trained = lora.split_trainable(state_shardings.params)[0]  # LoRA: the adapters' only
        acc_sh = {"grads": trained, "loss": repl, "aux": repl}
        self._acc_shardings = acc_sh

        def accumulate(params, acc, batch):
            def weighted(p, b):  # a token mean: its sum, divided by the total in `normalize`
                loss, aux = loss_fn(p, b)
                return loss * jax.lax.stop_gradient(aux["loss_tokens"]), aux

            with sharding.tracing_mesh(mesh, rules):
                return train_step.accumulate(
                    params, acc, batch, loss_fn=weighted if token_weighted else loss_fn
                )

        def normalize(acc):
            # Micro-batch m weighted by M * n_m / sum(n): n_m the tokens its loss counted
            # (`rl_loss`'s aux, after seq_mis masks responses out), so the accumulated loss is the
            # minibatch's exact token mean.
            scale = micro_batches / jnp.maximum(acc["aux"]["loss_tokens"], 1.0)
            grads = jax.tree.map(lambda g: g * scale, acc["grads"])
            return {**acc, "grads": grads, "loss": acc["loss"] * scale}

        def apply(state, acc):
            return train_step.apply_gradients(
                state,
                acc["grads"],
                acc["loss"],
                acc["aux"],
                micro_batches=micro_batches,
                tx=tx,
                lr_fn=lr_fn,
            )

        self._accumulate = jax.jit(
            accumulate,
            in_shardings=(state_shardings.params, acc_sh, rows),
            out_shardings=acc_sh,
            donate_argnames=("acc",),
        )
        self._normalize = jax.jit(
            normalize, in_shardings=(acc_sh,), out_shardings=acc_sh, donate_argnums=0
        )
        self._apply = jax.jit(
            apply,
            in_shardings=(state_shardings, acc_sh),
            out_shardings=(state_shardings, repl),
            donate_argnames=("state",),  # (the gradients have no output to alias)
        )
        self._zeros = None
        self.ahead = None  # `programs.Ahead` compiling this updater's programs (compile_ahead)

    @property
    def packed(self) -> bool:
        return self.spec.packed

    def compiled_shapes(self) -> dict[str, int]:
        """Shapes compiled so far per program: the micro-batch accumulation (one per width met),
        the token-mean normalisation, the optimizer step and the log-prob pass."""
        jitted = {
            "accumulate": self._accumulate,
            "normalize": self._normalize,
            "apply": self._apply,
            "logprobs": self._logprobs,
        }
        return {name: f._cache_size() for name, f in jitted.items()}

    def _zero_acc(self, params, first_batch):
        self._ready("zeros")
        return self._zeros_fn(params, first_batch)(params)

    def _zeros_fn(self, params, first_batch):
        if self._zeros is None:  # the aux keys and shapes are the same for every width
            aux = jax.eval_shape(lambda p, b: self._loss_fn(p, b)[1], params, first_batch)
            self._zeros = jax.jit(
                lambda p: train_step.zero_accumulator(p, aux), out_shardings=self._acc_shardings
            )
        return self._zeros

    def _ready(self, *key) -> None:
        """Waits for the program under `key` when it is being compiled ahead."""
        if self.ahead is not None:
            self.ahead.ready(key)

    def compile_ahead(self, ahead, state, example: UpdateBatch, passes=((False, None),)) -> None:
        """Hands every program the passes can meet to `ahead` (a `programs.Ahead`), widest
        first: the accumulation at each width, the optimizer step (and the token-mean
        normalisation), and the log-prob pass at each width for each (reference flag,
        `train_step.Pass` or None: plain) of `passes` (False: the policy, also the frozen
        reference copy; True: LoRA's adapters off; () when the step runs no log-prob pass; the
        Pass: routing replay's). `example` is a host micro-batch of zeros with the step's
        fields at full width (`rl_step.example_batch`), `state` the train state; only their
        shapes, dtypes and shardings are read, here, so the state may be donated meanwhile.
        From then on each call of one of these programs waits for its compile."""
        self.ahead = ahead
        state = sharding.abstract(state)
        params = state.params
        rows = np.arange(len(example.rewards))
        G, J = self.group_size, self.prompt_len

        def batch_at(width):
            if self.packed:
                return to_device(pack(example, rows, width, J, G), self.mesh, G)
            return to_device(trim(example, rows, width, J), self.mesh, G)

        first = batch_at(max(self.widths))
        acc = self._zeros_fn(params, first).eval_shape(params)  # with the shardings
        ahead.submit(("zeros",), lambda: self._zeros.lower(params).compile())
        for width in sorted(self.widths, reverse=True):
            mb = sharding.abstract(batch_at(width))
            ahead.submit(
                ("accumulate", width),
                lambda mb=mb: self._accumulate.lower(params, acc, mb).compile(),
            )
            if width == max(self.widths):
                ahead.submit(("apply",), lambda: self._apply.lower(state, acc).compile())
                if self.token_weighted:
                    ahead.submit(("normalize",), lambda: self._normalize.lower(acc).compile())
            for off, mode in passes:
                mode = mode or train_step.PLAIN
                args = self._pass_args(mb, off, mode)
                ahead.submit(
                    ("logprobs", width, off, mode),
                    lambda args=args: self._logprobs.lower(params, *args).compile(),
                )

    def end_compile_ahead(self) -> None:
        """Drops the programs `compile_ahead` has not started compiling; each call compiles
        its own again."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def _plan(self, valid, chunks: int):
        """`plan_chunks` of host rows, on the response part of their valid mask (what the
        passes run): [(rows, width)]."""
        real = np.asarray(valid)[:, self.prompt_len :]
        return plan_chunks(real, self.group_size, chunks, self.widths, packed=self.packed)

    def computed_slots(self, valid, chunks: int) -> int:
        """Response slots the passes compute over host rows cut into `chunks`: rows x width per
        chunk, or groups x packed width when packed."""
        per_row = self.group_size if self.packed else 1
        return sum(len(rows) // per_row * width for rows, width in self._plan(valid, chunks))

    def logprob_slots(self, valid) -> int:
        """`computed_slots` of one log-prob pass over host rows."""
        return self.computed_slots(valid, self.chunks)

    def _device_chunks(self, batch: UpdateBatch, chunks: int):
        """(rows, device batch) per chunk of `_plan`: the rows of whole groups of `batch`,
        trimmed to the chunk's width (or packed into it) and put on the mesh."""
        G, J = self.group_size, self.prompt_len
        for rows, width in self._plan(batch.valid, chunks):
            if self.packed:
                yield rows, to_device(pack(batch, rows, width, J, G), self.mesh, G)
            else:
                yield rows, to_device(trim(batch, rows, width, J), self.mesh, G)

    def accumulated(self, params, batch: UpdateBatch) -> tuple[dict, float]:
        """Gradients, loss and aux summed over the micro-batches of a host minibatch of whole
        groups (the `train_step.accumulate` carry), and the share of its response slots that
        were computed (of B x max_new_tokens)."""
        batch.check(self.spec)
        M = self.micro_batches
        acc = None
        for _, mb in self._device_chunks(batch, M):
            if acc is None:
                acc = self._zero_acc(params, mb)
            self._ready("accumulate", mb_width(mb))
            acc = self._accumulate(params, acc, mb)
        if self.token_weighted:  # the minibatch's exact token mean (see the module doc)
            self._ready("normalize")
            acc = self._normalize(acc)
        return acc, self.computed_slots(batch.valid, M) / np.asarray(batch.loss_mask).size

    def update(self, state, batch: UpdateBatch):
        """One optimizer update on a host minibatch of whole groups -> (state, metrics);
        metrics["update_slot_frac"] is the share of the response slots computed,
        ["update_pad_ratio"] the slots computed per real response token (1: no padding)."""
        acc, slot_frac = self.accumulated(state.params, batch)
        self._ready("apply")
        state, metrics = self._apply(state, acc)
        computed = slot_frac * np.asarray(batch.loss_mask).size
        ratio = computed / real_tokens(batch.valid, self.prompt_len)
        return state, {**metrics, "update_slot_frac": slot_frac, "update_pad_ratio": ratio}

    def _pass_args(self, dev: UpdateBatch, reference: bool, mode: train_step.Pass) -> tuple:
        """The log-prob program's arguments after the parameters for a device chunk."""
        if self.packed:  # the record travels only to a pass that replays it
            packed = (
                dev.packed if mode.replay else dev.packed.replace(routing=None, routing_mask=None)
            )
            return (packed, reference, mode)
        routing = (dev.routing, dev.routing_mask) if mode.replay else None
        return (dev.tokens, dev.valid, reference, mode, routing)

    def logprobs(
        self, params, tokens, valid, reference: bool = False, *, routing=None, record=None
    ):
        """[B, N] response log-probs of host rows (tokens, valid: [B, prompt_len + N], whole
        groups), chunk by chunk; slots past a row's response are 0, as masked slots are.
        reference=True: with the LoRA adapters off (`train_step.jit_logprobs` /
        `jit_packed_logprobs`). `routing` (experts [B, prompt_len + N, M, K], mask [B,
        prompt_len + N]) replays a recorded routing; `record` (an integer dtype) also returns
        the routing this pass computes, (log-probs, experts [B, prompt_len + N, M, K])."""
        tokens = np.asarray(tokens)
        n = tokens.shape[1] - self.prompt_len
        rows_b = len(tokens)
        mode = train_step.Pass(
            replay=routing is not None,
            record=record is not None,
            record_dtype=np.dtype(record or "uint8").name,
        )
        sequences = UpdateBatch(
            loss_mask=np.zeros((rows_b, n), np.float32),
            rewards=np.zeros(rows_b, np.float32),
            tokens=tokens,
            valid=np.asarray(valid),
            routing=None if routing is None else np.asarray(routing[0]),
            routing_mask=None if routing is None else np.asarray(routing[1]),
        )
        parts = []
        for rows, dev in self._device_chunks(sequences, self.chunks):
            # dispatch every chunk, then wait for all of them
            self._ready("logprobs", mb_width(dev), reference, mode)
            parts.append((rows, self._logprobs(params, *self._pass_args(dev, reference, mode))))
        out = np.zeros((rows_b, n), np.float32)
        experts = None
        for rows, got in parts:
            logp = sharding.gather(got[0] if mode.record else got)
            out[rows, : logp.shape[1]] = logp
            if mode.record:
                e = sharding.gather(got[1])
                if experts is None:
                    experts = np.zeros((rows_b, tokens.shape[1], *e.shape[2:]), e.dtype)
                experts[rows, : e.shape[1]] = e
        return (out, experts) if mode.record else out


def mb_width(batch: UpdateBatch) -> int:
    """The response width of a micro-batch (packed: its packed response slots)."""
    return batch.packed.segments.shape[1] if batch.packed is not None else batch.loss_mask.shape[1]


def real_tokens(valid, prompt_len: int) -> float:
    """The real response tokens of host rows (their valid mask after the prompt)."""
    return max(float((np.asarray(valid)[:, prompt_len:] > 0).sum()), 1.0)
