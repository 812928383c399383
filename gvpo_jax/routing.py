"""Mixture-of-experts routing in training: what an MoE rollout's recorded routing (the
sampler's, `SampleOutput.routes_BxNxMxK`, laid out as `batch["routes"]`) says against the
policy that trains on it, and the record routing replay's R3 replays (`sampler_record`; the
replay itself is `moe.route`'s, driven by `rl_step`: docs/routing_replay.md)."""

from __future__ import annotations

import numpy as np


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


def metrics(sums: dict, tokens: float, layers: list[int]) -> dict:
    """The moe/* metrics of `moe.routing_sums` (host arrays) over `tokens` weighted tokens, MoE
    layers `layers`: `moe/routing_drift` (the share of (token, layer) pairs whose experts
    changed since the record; mean and max over layers), `moe/load_max_over_mean` (the busiest
    expert's share of a layer's assignments times E: 1 balanced, E one expert takes all; mean,
    max and per layer `moe/load_max_over_mean/layer_<i>`) and `moe/router_entropy` (mean over
    layers)."""
    tokens = max(float(tokens), 1.0)
    drift_M = np.asarray(sums["drifted"], np.float64) / tokens
    counts_MxE = np.asarray(sums["counts"], np.float64)
    load_M = counts_MxE.max(-1) / np.maximum(counts_MxE.sum(-1), 1.0) * counts_MxE.shape[-1]
    out = {
        "moe/routing_drift": float(drift_M.mean()),
        "moe/routing_drift_max": float(drift_M.max()),
        "moe/load_max_over_mean": float(load_M.mean()),
        "moe/load_max_over_mean_max": float(load_M.max()),
        "moe/router_entropy": float(np.mean(np.asarray(sums["entropy"]) / tokens)),
    }
    for i, x in zip(layers, load_M, strict=True):
        out[f"moe/load_max_over_mean/layer_{i}"] = float(x)
    return out


def record_drift(sampler_BxSxMxK: np.ndarray, record_BxSxMxK: np.ndarray, fed_BxS) -> np.ndarray:
    """[M] the share of the fed tokens (`fed_mask`) whose set of experts differs between two
    records of the same rows (any order within a token's k)."""
    a = np.sort(np.asarray(sampler_BxSxMxK).astype(np.int64), axis=-1)
    b = np.sort(np.asarray(record_BxSxMxK).astype(np.int64), axis=-1)
    changed_BxSxM = np.any(a != b, axis=-1)
    fed = np.asarray(fed_BxS, np.float64)
    return np.einsum("bsm,bs->m", changed_BxSxM, fed) / max(float(fed.sum()), 1.0)
