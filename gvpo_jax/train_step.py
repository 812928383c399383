"""Pure jitted pieces of training: state, optimizer, log-prob recompute, RL and SFT updates."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from gvpo_jax import losses, models, sharding
from gvpo_jax.batch import BatchSpec, UpdateBatch
from gvpo_jax.models import lora, moe


@struct.dataclass
class TrainState:
    """Everything an update changes. Graph definition and optimizer are static, bound elsewhere.
    ("step" is the RL step, `rl_step.LoopState.step`; an RL step makes epochs x minibatches
    updates, counted here.)"""

    updates: jax.Array  # optimizer updates applied (skipped non-finite updates do not count)
    params: nnx.State  # policy parameters (with LoRA: the frozen base and the adapters)
    opt_state: optax.OptState  # of the trained parameters only (with LoRA: the adapters')
    rng: jax.Array  # the run's PRNG key, split once per RL step
    bad_steps: jax.Array  # consecutive non-finite updates skipped so far


def make_optimizer(
    *,
    lr: float,
    total_updates: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    grad_clip: float = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warm-up then constant / cosine / linear decay, and global-norm clipping."""
    warmup_steps = min(warmup_steps, max(total_updates - 1, 0))
    decay_steps = max(total_updates - warmup_steps, 1)
    if schedule == "constant":
        after = optax.constant_schedule(lr)
    elif schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps, alpha=0.1)
    elif schedule == "linear":
        after = optax.linear_schedule(lr, 0.1 * lr, decay_steps)
    else:
        raise ValueError(f"schedule {schedule!r} is unknown; use constant, cosine or linear.")
    if warmup_steps:
        warm = optax.linear_schedule(lr / max(warmup_steps, 1), lr, warmup_steps)
        sched = optax.join_schedules([warm, after], [warmup_steps])
    else:
        sched = after
    # The clip's slot is kept when it is off (identity: the same empty state), so the optimizer
    # state has one structure whatever grad_clip is and a run can start from a checkpoint made
    # with the clip on or off.
    clip = optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity()
    adam = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
    return optax.chain(clip, adam), sched


def init_state(params: nnx.State, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """Step 0: optimizer state for the trained part of `params` (`lora.split_trainable`: all of
    them, or with LoRA the adapters alone; the frozen base has no moments)."""
    return TrainState(
        updates=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(lora.split_trainable(params)[0]),
        rng=rng,
        bad_steps=jnp.zeros((), jnp.int32),
    )


def train_state_shardings(
    params, tx: optax.GradientTransformation, rng, mesh, rules=sharding.LOGICAL_RULES
):
    """NamedShardings of `init_state(params, tx, rng)` (params and Adam moments by their logical
    axes, scalars and the key replicated), from shapes only."""
    abstract = jax.eval_shape(lambda p, r: init_state(p, tx, r), params, rng)
    return sharding.state_shardings(abstract, mesh, rules)


def init_state_sharded(
    params, tx: optax.GradientTransformation, rng, mesh, rules=sharding.LOGICAL_RULES
):
    """`init_state` with the optimizer state created directly in its shards.

    Returns (state, shardings); `params` should already be sharded (e.g. `sharding.init_sharded`)
    and are passed through (moved onto their shardings if they are not). `shardings` are the
    `state_shardings` for `jit_update`.
    """
    shardings = train_state_shardings(params, tx, rng, mesh, rules)
    params = jax.device_put(params, shardings.params)  # no-op when already in place
    init = jax.jit(
        lambda p, r: init_state(p, tx, r),
        in_shardings=(shardings.params, sharding.replicated(mesh)),
        out_shardings=shardings,
    )
    return init(params, rng), shardings


def params_only_state(
    params: nnx.State, tx: optax.GradientTransformation, rng: jax.Array, shardings: TrainState
) -> TrainState:
    """A `TrainState` for runs that never update (mode=eval, mode=export): the parameters placed
    on their shardings and the optimizer state as shapes only (`jax.ShapeDtypeStruct`s with
    their shardings), so no Adam moments are allocated. A restore skips those leaves
    (`checkpoint.SKIP`); an update refuses them (they are not arrays)."""
    abstract = jax.eval_shape(lambda p, r: init_state(p, tx, r), params, rng)
    return TrainState(
        updates=jax.device_put(jnp.zeros((), jnp.int32), shardings.updates),
        params=jax.device_put(params, shardings.params),
        opt_state=sharding.abstract_with_shardings(abstract.opt_state, shardings.opt_state),
        rng=jax.device_put(rng, shardings.rng),
        bad_steps=jax.device_put(jnp.zeros((), jnp.int32), shardings.bad_steps),
    )


def response_logprobs(
    graphdef,
    params,
    tokens_BxS,
    attn_mask_BxS,
    *,
    prompt_len: int,
    chunk_size: int,
    group_size: int = 1,
    with_entropy: bool = False,
    with_routes: bool = False,
    routing=None,
    replay: bool = True,
):
    """log pi(y_t | x, y_<t) of the response slots [prompt_len:] of a left-padded batch -> [B, N]
    (with_entropy: (logp, entropy), the entropy of pi(. | x, y_<t) at each slot, same sweep;
    with_routes: (that, the MoE routers' `moe.Routes` of the whole rows, None without MoE)).
    `routing` (experts [B, S, M, K], mask [B, S]: `UpdateBatch.routing` / `routing_mask`) is a
    recorded routing, replayed where the mask is set (`replay`; else only compared with the
    routers' choice, `moe.Routes.drift`): docs/routing_replay.md.

    Rows are `[pad.., prompt, response, pad..]` with the prompt right-aligned at `prompt_len`, so
    slot prompt_len-1 always holds the last prompt token and positions come from the mask.
    group_size > 1: rows come in groups of that many consecutive rows with the same prompt (a
    rollout batch), and each prompt is run once per group (`Transformer.hidden_shared_prefix`).
    """
    model = nnx.merge(graphdef, params)
    replay = _replay(routing, apply=replay)
    if group_size > 1:
        hidden_BxSxD = model.hidden_shared_prefix(
            tokens_BxS,
            attn_mask_BxS,
            prefix_len=prompt_len,
            group_size=group_size,
            routing=replay,
            with_routes=with_routes,
        )
    else:
        hidden_BxSxD = model.hidden(
            tokens_BxS, None, attn_mask_BxS, routing=replay, with_routes=with_routes
        )
    routes = None
    if with_routes:
        hidden_BxSxD, routes = hidden_BxSxD
    # Only the response slots need logits: hidden state s-1 predicts token s.
    out = models.chunked_logprobs(
        hidden_BxSxD[:, prompt_len - 1 : -1],
        model.unembed_matrix(),
        tokens_BxS[:, prompt_len:],
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
    real_BxN = attn_mask_BxS[:, prompt_len:] > 0
    if with_entropy:
        out = tuple(jnp.where(real_BxN, x, 0.0) for x in out)
    else:
        out = jnp.where(real_BxN, out, 0.0)
    return (out, routes) if with_routes else out


def _replay(routing, *, apply: bool = True) -> moe.Replay | None:
    """An update batch's (experts [B, S, M, K], mask [B, S]) as the model's `moe.Replay`
    ([M, B, S, K]), replayed wherever it holds when `apply` (else only compared); None stays
    None."""
    if routing is None:
        return None
    experts, mask = routing
    held = mask > 0
    return moe.Replay(jnp.moveaxis(experts, 2, 0), held, held if apply else jnp.zeros_like(held))


def unpack_routes(experts_MxRxSxK, packed, *, prompt_len: int, group_size: int) -> jax.Array:
    """The experts of a packed micro-batch's tokens ([M, R, J + W, K], `packed_logprobs`'s
    routes) in the unpacked update layout [B, J + N, M, K]: each row's prompt slots from its
    group's packed row, its response tokens through `packed.index` (0 where it is -1)."""
    j = prompt_len
    m, r, _, k = experts_MxRxSxK.shape
    prefix_MxBxJxK = jnp.repeat(experts_MxRxSxK[:, :, :j], group_size, axis=1)
    flat_MxAxK = experts_MxRxSxK[:, :, j:].reshape(m, -1, k)
    index_BxN = packed.index
    rest_MxBxNxK = jnp.take(flat_MxAxK, jnp.maximum(index_BxN, 0), axis=1)
    rest_MxBxNxK = jnp.where((index_BxN >= 0)[None, :, :, None], rest_MxBxNxK, 0)
    return jnp.moveaxis(jnp.concatenate([prefix_MxBxJxK, rest_MxBxNxK], axis=2), 0, 2)


def packed_logprobs(
    graphdef,
    params,
    packed,
    *,
    prompt_len: int,
    chunk_size: int,
    with_entropy: bool = False,
    with_routes: bool = False,
    group_size: int = 1,
    routing: bool = False,
    replay: bool = True,
):
    """`response_logprobs` of a packed micro-batch -> [B, N] in the unpacked layout.

    `packed` is a `batch.PackedRows` (`gvpo_jax.buckets.pack`): R groups, each one row [prompt
    (prompt_len slots) | its G responses back to back | padding] of width prompt_len + W, with
    per-slot RoPE positions and segment ids; `pred` [R, W] the slot whose hidden state predicts
    each packed response slot (the last prompt slot for a response's first token); `index`
    [B, N] where row b's response token t sits in the flattened [R * W] packed slots (-1: none).
    The output layer runs on the R * W packed slots only; the [B, N] result is 0 where index is
    -1, as masked slots are. `with_routes`: (that, the routers' `moe.Routes` in the packed
    layout, each prompt's load counted `group_size` times as the unpacked rows hold it).
    `routing` True reads the packed rows' record (`packed.routing`, `packed.routing_mask`),
    replayed when `replay` (as `response_logprobs`'s).
    """
    model = nnx.merge(graphdef, params)
    hidden_RxSxD = model.hidden_packed(
        packed.tokens,
        packed.valid,
        packed.positions,
        packed.segments,
        prefix_len=prompt_len,
        prefix_copies=group_size,
        routing=_replay((packed.routing, packed.routing_mask), apply=replay) if routing else None,
        with_routes=with_routes,
    )
    routes = None
    if with_routes:
        hidden_RxSxD, routes = hidden_RxSxD
    hidden_RxWxD = jnp.take_along_axis(hidden_RxSxD, packed.pred[:, :, None], axis=1)
    out = models.chunked_logprobs(
        hidden_RxWxD,
        model.unembed_matrix(),
        packed.tokens[:, prompt_len:],
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
    index_BxN = packed.index
    found_BxN = index_BxN >= 0

    def unpack(x_RxW):
        return jnp.where(found_BxN, jnp.take(x_RxW.reshape(-1), jnp.maximum(index_BxN, 0)), 0.0)

    out = tuple(unpack(x) for x in out) if with_entropy else unpack(out)
    return (out, routes) if with_routes else out


@dataclasses.dataclass(frozen=True)
class Pass:
    """What a log-prob pass does besides the log-probs (a static argument of the jitted
    passes): `replay` the batch's recorded routing (routing replay's old-policy pass),
    `record` the routing it computes, returned beside the log-probs as [B, S, M, K]
    `record_dtype` integers (R2's record)."""

    replay: bool = False
    record: bool = False
    record_dtype: str = "uint8"


PLAIN = Pass()


def jit_packed_logprobs(
    graphdef,
    *,
    prompt_len: int,
    chunk_size: int,
    group_size: int = 1,
    mesh,
    param_shardings,
    rules=sharding.LOGICAL_RULES,
    reference_graphdef=None,
):
    """`packed_logprobs` jitted as (params, `batch.PackedRows`) -> [B, N], rows over data x
    fsdp; a third argument True runs `reference_graphdef` instead, and a fourth (`Pass`)
    replays the packed rows' routing and / or records the routing (as in `jit_logprobs`)."""
    rows = sharding.batch_sharding(mesh)

    def logprobs(params, packed, reference=False, mode=PLAIN):
        graph = reference_graphdef if reference else graphdef
        with sharding.tracing_mesh(mesh, rules):
            out = packed_logprobs(
                graph,
                params,
                packed,
                prompt_len=prompt_len,
                chunk_size=chunk_size,
                routing=mode.replay,
                with_routes=mode.record,
                group_size=group_size,
            )
            if not mode.record:
                return out
            logp, routes = out
            experts = unpack_routes(
                routes.experts, packed, prompt_len=prompt_len, group_size=group_size
            )
            return logp, experts.astype(mode.record_dtype)

    return jax.jit(
        logprobs, in_shardings=(param_shardings, rows), out_shardings=rows, static_argnums=(2, 3)
    )


def jit_logprobs(
    graphdef,
    *,
    prompt_len: int,
    chunk_size: int,
    group_size: int = 1,
    mesh,
    param_shardings,
    rules=sharding.LOGICAL_RULES,
    reference_graphdef=None,
):
    """`response_logprobs` as a jitted function of (params, tokens_BxS, attn_mask_BxS) -> [B, N].

    group_size > 1: batches of whole groups sharing their prompt (see `response_logprobs`).
    Explicit shardings: params as given, rows over data x fsdp in and out, with the model's
    activation constraints active under `rules`; the same function serves the policy and the
    frozen reference, which share their shardings. Positional arguments after those (jit takes
    no keywords with in_shardings): `reference` (static: True runs `reference_graphdef`
    instead: with LoRA, the same parameters with the adapters off), `mode` (static, a `Pass`:
    replay `routing`, record the routing and return (log-probs, experts [B, S, M, K])) and
    `routing` (experts [B, S, M, K], mask [B, S], or None). `.lower` takes the same arguments.
    """
    kw = dict(prompt_len=prompt_len, chunk_size=chunk_size, group_size=group_size)
    rows = sharding.batch_sharding(mesh)

    def logprobs(params, tokens_BxS, attn_mask_BxS, routing, reference, mode):
        graph = reference_graphdef if reference else graphdef
        with sharding.tracing_mesh(mesh, rules):
            out = response_logprobs(
                graph,
                params,
                tokens_BxS,
                attn_mask_BxS,
                routing=routing if mode.replay else None,
                with_routes=mode.record,
                **kw,
            )
            if not mode.record:
                return out
            logp, routes = out
            return logp, jnp.moveaxis(routes.experts, 0, 2).astype(mode.record_dtype)

    jitted = jax.jit(
        logprobs,
        in_shardings=(param_shardings, rows, rows, rows),
        out_shardings=rows,
        static_argnums=(4, 5),
    )
    return _RoutingLast(jitted)


class _RoutingLast:
    """A jitted pass of (params, tokens, valid, routing, reference, mode) called as (params,
    tokens, valid, reference=False, mode=PLAIN, routing=None): the optional routing last, so a
    caller that passes no routing passes what it always did (jit counts every positional
    argument against its in_shardings, so the routing cannot simply default)."""

    def __init__(self, jitted):
        self._jitted = jitted

    @staticmethod
    def _order(params, tokens, valid, reference=False, mode=PLAIN, routing=None):
        return (params, tokens, valid, routing, reference, mode)

    def __call__(self, *args, **kwargs):
        return self._jitted(*self._order(*args, **kwargs))

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*self._order(*args, **kwargs))

    def _cache_size(self) -> int:
        return self._jitted._cache_size()


@dataclasses.dataclass(frozen=True)
class Reference:
    """Where a run's reference log-probs (`ref_logp`) come from, fixed at assembly: "copy" (a
    frozen copy of the start policy's parameters), "adapters_off" (LoRA: the policy's own
    parameters with the adapters off, no copy) or "none"."""

    kind: str = "none"

    def __post_init__(self):
        if self.kind not in ("none", "copy", "adapters_off"):
            raise ValueError(f"Reference kind {self.kind!r}; use none, copy or adapters_off.")

    @property
    def present(self) -> bool:
        return self.kind != "none"


def rl_loss(
    params,
    batch: UpdateBatch,
    *,
    graphdef,
    algorithm: losses.Algorithm,
    spec: BatchSpec,
    group_size: int,
    prompt_len: int,
    chunk_size: int,
):
    """The run's algorithm's loss on one micro-batch of whole groups (a `batch.UpdateBatch`
    carrying what `spec` says) -> (loss, aux). The algorithm and the spec fix the path at trace
    time.

    The G rows of a group share their prompt, which is run once per group (`response_logprobs`
    with group_size = G), or the micro-batch is packed (`spec.packed`). With an entropy bonus
    the same pass gives the per-token entropy. Without `old_logp` (one update per step) the
    update starts from the rollout's parameters, so pi_old is this forward's value, held
    constant. `algorithm.correction` = (mode, cap) of `losses.rollout_correction` against
    `behaviour_logp`: token_tis scales the token advantages by the truncated weights, seq_mis
    masks responses out of the loss. `advantages`, when carried, were computed on the whole
    rollout batch (`losses.uses_batch_statistics`) and are used as they are. With
    `algorithm.router_aux_loss_coef` (an MoE policy) the routers' load-balancing loss over the
    micro-batch's real tokens (`moe.balance_loss`) is added, times that coefficient. With
    `spec.routing` the batch carries a routing record (the sampler's; R2: the old-policy
    pass's), which the forward replays with `spec.replay` (routing replay), and the aux counts
    the recorded (token, layer) pairs whose record the router does not pick itself.
    """
    with_entropy = algorithm.entropy_coef != 0.0
    balanced = algorithm.router_aux_loss_coef != 0.0
    kw = dict(prompt_len=prompt_len, chunk_size=chunk_size, with_entropy=with_entropy,
              with_routes=balanced or spec.routing, group_size=group_size)  # fmt: skip
    if spec.packed:  # a packed micro-batch (`gvpo_jax.buckets`): the same log-probs
        out = packed_logprobs(
            graphdef, params, batch.packed, routing=spec.routing, replay=spec.replay, **kw
        )
    else:
        routing = (batch.routing, batch.routing_mask) if spec.routing else None
        out = response_logprobs(
            graphdef, params, batch.tokens, batch.valid, routing=routing, replay=spec.replay, **kw
        )
    routes = None
    if kw["with_routes"]:
        out, routes = out
    logp_BxN, entropy_BxN = out if with_entropy else (out, None)
    mask_BxN = batch.loss_mask
    ref_logp = batch.ref_logp if spec.ref_logp else None
    sampler_logp = batch.sampler_logp if spec.sampler_logp else None
    # GVPO's pi_theta': "old" is old_logp (below); "ref" the frozen start; "sampler" the
    # sampling policy's own log-probs (at T = 1): rollout.staleness updates before "old".
    anchor_logp = {"ref": ref_logp, "sampler": sampler_logp}.get(algorithm.anchor)
    old_logp = batch.old_logp if spec.old_logp else jax.lax.stop_gradient(logp_BxN)
    advantages = batch.advantages if spec.advantages else None
    loss_mask, is_aux = mask_BxN, {}
    if spec.behaviour_logp:  # the rollout correction, against what the sampler drew from
        mode, cap = algorithm.correction
        weights_BxN, loss_mask, is_aux = losses.rollout_correction(
            old_logp, batch.behaviour_logp, mask_BxN, mode=mode, cap=cap
        )
        if mode == "token_tis":  # the advantages of this batch, weighted
            if not spec.advantages:
                advantages = algorithm.advantages(
                    rewards=batch.rewards,
                    mask=mask_BxN,
                    group_size=group_size,
                    old_logp=old_logp,
                    ref_logp=ref_logp,
                )
            if advantages.ndim == 1:
                advantages = advantages[:, None]
            advantages = advantages * weights_BxN
    loss, aux = algorithm.loss(
        logp=logp_BxN,
        old_logp=old_logp,
        rewards=batch.rewards,
        mask=loss_mask,
        group_size=group_size,
        ref_logp=ref_logp,
        anchor_logp=anchor_logp,
        advantages=advantages,
        entropy=entropy_BxN,
    )
    aux = dict(aux) | is_aux
    if spec.routing:  # recorded (token, layer) pairs, and those the router picks otherwise
        # (packed: a prompt slot's mask counts the group's rows that hold its record)
        mask = batch.packed.routing_mask if spec.packed else batch.routing_mask
        recorded = mask.astype(jnp.float32)
        sums = moe.routing_sums(routes, recorded)  # per layer: the step's moe/* metrics
        aux.update({f"routing_{k}_by_layer": v for k, v in sums.items()})
        aux["routing_drifted"] = jnp.sum(sums["drifted"])
        aux["routing_recorded"] = routes.drift.shape[0] * jnp.sum(recorded)
    if balanced:
        aux["router_balance_loss"] = _balance_loss(routes)
        loss = loss + algorithm.router_aux_loss_coef * aux["router_balance_loss"]
    # The tokens the loss counted (the mask it was given, after seq_mis): length buckets weight
    # their micro-batches by it for a token mean's exact value (`gvpo_jax.buckets`).
    aux["loss_tokens"] = jnp.sum(loss_mask).astype(jnp.float32)
    if spec.sampler_logp and not spec.old_logp:  # one update per step: the sampler vs this pass
        drawn_BxN = mask_BxN * batch.drawn[:, None]
        logp = jax.lax.stop_gradient(logp_BxN)
        aux["sampled_logp_sum"] = jnp.sum(logp * drawn_BxN)
        aux["sampled_tokens"] = jnp.sum(drawn_BxN)
        gap = jnp.abs(logp - sampler_logp) * drawn_BxN
        aux["sampler_logp_gap_max"] = jnp.max(gap)
        aux["sampler_logp_gap_sum"] = jnp.sum(gap)
        # tokens whose weight pi_old / mu exceeds the correction's cap: where token_tis acts
        over = (logp - sampler_logp > jnp.log(algorithm.is_cap)) * drawn_BxN
        aux["sampler_over_cap"] = jnp.sum(over.astype(jnp.float32))
    if spec.ref_logp:  # k3 estimate of KL(pi_theta || pi_ref) on the sampled tokens
        diff = ref_logp - logp_BxN
        k3 = jnp.exp(diff) - diff - 1.0
        aux["kl_ref"] = jnp.sum(k3 * mask_BxN) / jnp.maximum(jnp.sum(mask_BxN), 1.0)
    return loss, aux


def _balance_loss(routes) -> jax.Array:
    """`moe.balance_loss` of a forward's routes (ValueError for a policy with no router)."""
    if routes is None:
        raise ValueError(
            "algo.router_aux_loss_coef is set but the policy has no MoE layers; set it to 0."
        )
    return moe.balance_loss(routes.balance)


def sft_loss(params, batch, *, graphdef, prompt_len: int, chunk_size: int):
    """Token-mean cross-entropy of the answer tokens (cold-start SFT) -> (loss, aux)."""
    logp_BxN = response_logprobs(
        graphdef,
        params,
        batch["tokens"],
        batch["attn_mask"],
        prompt_len=prompt_len,
        chunk_size=chunk_size,
    )
    mask_BxN = batch["resp_mask"]
    ntok = jnp.maximum(jnp.sum(mask_BxN), 1.0)
    nll = -jnp.sum(logp_BxN * mask_BxN) / ntok
    return nll, {"nll": nll, "answer_tokens": ntok}


# rl_loss's aux totals over an update's micro-batches (every other aux value is their mean).
AUX_SUMS = (
    "sampled_logp_sum", "sampled_tokens", "loss_tokens", "sampler_logp_gap_sum", "sampler_over_cap",
    "routing_drifted", "routing_recorded",
    "routing_drifted_by_layer", "routing_entropy_by_layer", "routing_counts_by_layer",
)  # fmt: skip
AUX_MAXES = ("sampler_logp_gap_max", "is_weight_max", "is_seq_log_weight_abs_max")


def _is_total(key: str) -> bool:
    return key in AUX_SUMS or key in AUX_MAXES


def _accumulate(key: str, total, value):
    return jnp.maximum(total, value) if key in AUX_MAXES else total + value


def _where_tree(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def split_micro_batches(x, micro_batches: int, row_shards: int = 1):
    """[B, ...] -> [M, B/M, ...]; micro-batch m is the m-th slice of every one of the row shards.

    With row_shards=1 this is `x.reshape(M, B/M, ...)` (contiguous micro-batches). With the
    batch split over S row shards, slicing every shard keeps each micro-batch spread over all
    devices (no resharding) and, when every shard slice holds whole groups, keeps groups whole.
    """
    b = x.shape[0]
    if b % (row_shards * micro_batches):
        raise ValueError(
            f"{b} rows cannot be split into {micro_batches} micro-batches on each of "
            f"{row_shards} row shards; make the rows a multiple of {row_shards * micro_batches}."
        )
    x = x.reshape(row_shards, micro_batches, b // (row_shards * micro_batches), *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(micro_batches, b // micro_batches, *x.shape[3:])


def update_step(
    state: TrainState,
    batch: dict,
    *,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    micro_batches: int,
    lr_fn=None,
    row_shards: int = 1,
):
    """One optimizer update on `batch` with gradient accumulation over `micro_batches`.

    `batch` arrays have B rows (whole groups; B divisible by micro_batches * group size, which the
    config validation guarantees). A non-finite loss or gradient leaves params and optimizer state
    untouched and increments `bad_steps`; a finite one resets it. `row_shards` > 1 (the number of
    data x fsdp shards of a sharded batch) takes micro-batches across shards
    (`split_micro_batches`); B must then be divisible by row_shards * micro_batches * group size.
    """

    def micro(acc, mb):
        return accumulate(state.params, acc, mb, loss_fn=loss_fn), None

    split = jax.tree.map(lambda x: split_micro_batches(x, micro_batches, row_shards), batch)
    first = jax.tree.map(lambda x: x[0], split)
    aux_shape = jax.eval_shape(lambda p, b: loss_fn(p, b)[1], state.params, first)
    acc, _ = jax.lax.scan(micro, zero_accumulator(state.params, aux_shape), split)
    return apply_gradients(
        state,
        acc["grads"],
        acc["loss"],
        acc["aux"],
        micro_batches=micro_batches,
        tx=tx,
        lr_fn=lr_fn,
    )


def apply_gradients(
    state: TrainState, grads, loss, aux: dict, *, micro_batches: int, tx, lr_fn=None
):
    """The optimizer update from gradients, loss and aux summed over `micro_batches`.

    Averages them (aux totals in AUX_SUMS / AUX_MAXES stay totals), then applies the update only
    if the loss and the gradient norm are finite; otherwise params and optimizer state stay as
    they were and `bad_steps` counts up. Shared by the in-graph accumulation (`update_step`) and
    the host-side one of length-bucketed updates (`gvpo_jax.buckets`).
    """
    scale = 1.0 / micro_batches
    grads = jax.tree.map(lambda g: g * scale, grads)
    loss = loss * scale
    aux = {k: v if _is_total(k) else v * scale for k, v in aux.items()}

    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    trained, frozen = lora.split_trainable(state.params)
    updates, new_opt = tx.update(safe_grads, state.opt_state, trained)
    new_trained = optax.apply_updates(trained, updates)
    new_state = state.replace(
        updates=state.updates + finite.astype(jnp.int32),
        params=lora.join(_where_tree(finite, new_trained, trained), frozen),
        opt_state=_where_tree(finite, new_opt, state.opt_state),
        bad_steps=jnp.where(finite, 0, state.bad_steps + 1),
    )
    metrics = {  # the accumulated loss wins over a loss's own aux["loss"] (per micro-batch)
        **aux,
        "loss": loss,
        "grad_norm": grad_norm,
        "skipped": 1.0 - finite.astype(jnp.float32),
    }
    if lr_fn is not None:
        metrics["lr"] = lr_fn(state.updates)
    return new_state, metrics


def accumulate(params, acc: dict, batch: dict, *, loss_fn: Callable) -> dict:
    """acc + (gradients, loss, aux) of `loss_fn` on one micro-batch: one step of a host-side
    gradient accumulation, whose micro-batches may have different shapes. `acc` holds
    {"grads", "loss", "aux"} (start from `zero_accumulator`). Gradients are taken with respect to
    the trained part of `params` only (`lora.split_trainable`): a LoRA run never computes the
    frozen base's."""
    trained, frozen = lora.split_trainable(params)
    loss_of_trained = lambda t, b: loss_fn(lora.join(t, frozen), b)
    (loss, aux), grads = jax.value_and_grad(loss_of_trained, has_aux=True)(trained, batch)
    return {
        "grads": jax.tree.map(jnp.add, acc["grads"], grads),
        "loss": acc["loss"] + loss,
        "aux": {k: _accumulate(k, acc["aux"][k], aux[k]) for k in aux},
    }


def zero_accumulator(params, aux_shape: dict) -> dict:
    """The empty `accumulate` carry: zero gradients shaped like the trained params, zero loss
    and aux."""
    return {
        "grads": jax.tree.map(jnp.zeros_like, lora.split_trainable(params)[0]),
        "loss": jnp.zeros((), jnp.float32),
        "aux": {k: jnp.zeros(v.shape, v.dtype) for k, v in aux_shape.items()},
    }


def jit_update(
    loss_fn, tx, micro_batches, lr_fn=None, *, mesh, state_shardings, rules=sharding.LOGICAL_RULES
):
    """The update step `(state, batch) -> (state, metrics)`, jitted with the state donated.

    Explicit shardings: `state_shardings` (from `train_state_shardings` / `init_state_sharded`)
    for the state in and out, rows over data x fsdp for every batch array, replicated metrics;
    the model's logical activation constraints are active under `rules` (pass
    `sharding.logical_rules(mesh, model_cfg)`). Call it positionally: update(state, batch).
    """
    step = functools.partial(
        update_step,
        loss_fn=loss_fn,
        tx=tx,
        micro_batches=micro_batches,
        lr_fn=lr_fn,
        row_shards=sharding.batch_shards(mesh),
    )

    def update(state, batch):
        with sharding.tracing_mesh(mesh, rules):
            return step(state, batch)

    return jax.jit(
        update,
        in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnames=("state",),
    )
