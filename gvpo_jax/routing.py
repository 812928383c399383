"""Mixture-of-experts routing in training: what an MoE rollout's recorded routing (the
sampler's, `SampleOutput.routes_BxNxMxK`, laid out as `batch["routes"]`) says against the
policy that trains on it, and the record routing replay's R3 replays (`sampler_record`; the
replay itself is `moe.route`'s, driven by `rl_step`: docs/routing_replay.md)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from gvpo_jax.models import moe


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _routing_stats(graphdef, params, tokens_BxS, valid_BxS, recorded_BxSxMxK, fed_BxS):
    """`moe.routing_stats` of a forward with `params` over rows the sampler recorded."""
    model = nnx.merge(graphdef, params)
    _, routes = model.hidden(tokens_BxS, None, valid_BxS, with_routes=True)
    e = model.config.num_experts
    return moe.routing_stats(routes, recorded_BxSxMxK, fed_BxS, valid_BxS, e)


def fed_mask(fresh: dict, prompt_len: int) -> np.ndarray:
    """[B, prompt_len + N] 1.0 on the tokens of a rollout's rows whose routing the sampler
    recorded: the prompt and response tokens of the rows it drew, less each response's last
    token (sampled, never fed back); 0 on padding and on demonstration rows."""
    fed = fresh["attn_mask"] * fresh["sampled"][:, None]
    lengths = fresh["lengths"].astype(np.int64)
    rows = np.flatnonzero(lengths > 0)
    fed[rows, prompt_len + lengths[rows] - 1] = 0.0  # a row's last token was never fed back
    return fed


def sampler_record(fresh: dict, prompt_len: int, *, extra_rows: int = 0):
    """R3's record of a rollout: (experts [B, prompt_len + N, M, K], mask [B, prompt_len + N])
    as the sampler recorded them (`fed_mask`), then `extra_rows` rows with no record (groups
    the replay buffer adds: they route as without replay)."""
    if "routes" not in fresh:
        raise ValueError(
            "the update reads the sampler's routing record (algo.routing_replay=r3 or "
            "train.routing_metrics on an MoE policy), but this rollout carries none."
        )
    experts, mask = fresh["routes"], fed_mask(fresh, prompt_len)
    if experts.shape[:2] != mask.shape:
        raise ValueError(
            f"the rollout's routing record covers {experts.shape[:2]} (rows, slots) but its "
            f"tokens {mask.shape}: the record does not line up with the tokens."
        )
    pad = ((0, extra_rows),) + ((0, 0),) * (experts.ndim - 1)
    return np.pad(experts, pad), np.pad(mask, pad[:2])


def metrics(run, params, fresh: dict) -> dict[str, float]:
    """An MoE rollout's routing against the policy the update starts from (the old-policy
    pass's parameters), on the rows the sampler drew: `moe/routing_drift` (the fraction of
    (token, layer) pairs whose experts changed since sampling; mean and max over layers),
    `moe/load_max_over_mean` (the busiest expert's share times E; mean, max and per layer
    `moe/load_max_over_mean/layer_<i>`) and `moe/router_entropy` (mean over layers)."""
    fed = fed_mask(fresh, run.settings.prompt_len)
    stats = jax.device_get(
        _routing_stats(
            run.graphdef, params, fresh["tokens"], fresh["attn_mask"], fresh["routes"], fed
        )
    )
    cfg = run.model(params).config
    layers = [i for i in range(cfg.num_layers) if cfg.moe_layer(i)]
    out = {
        "moe/routing_drift": float(np.mean(stats["drift"])),
        "moe/routing_drift_max": float(np.max(stats["drift"])),
        "moe/load_max_over_mean": float(np.mean(stats["load_max_over_mean"])),
        "moe/load_max_over_mean_max": float(np.max(stats["load_max_over_mean"])),
        "moe/router_entropy": float(np.mean(stats["entropy"])),
    }
    for i, x in zip(layers, stats["load_max_over_mean"], strict=True):
        out[f"moe/load_max_over_mean/layer_{i}"] = float(x)
    return out
