"""The update batch: a typed structure (`UpdateBatch`, its packed rows `PackedRows`, and the
`BatchSpec` that says which optional fields it carries), and the host-side helpers that build it
(the update layout, demonstrations, group selection)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Which optional fields an update batch carries: fixed at assembly by the algorithm, the
    reference and the step's layout, so the loss takes its path at trace time, never by what a
    batch happens to hold.

    old_logp: pi_old from a log-prob pass (more than one update per step; with one, the update's
    own forward is pi_old). ref_logp: a reference is present. behaviour_logp: the rollout
    correction's mu. sampler_logp: the sampler's own log-probs of the rows it drew (GVPO's
    anchor "sampler", and with one update per step the sampler-consistency metrics, `drawn`
    beside it). advantages: computed once on the whole rollout batch (whole-batch statistics
    split into parts). packed: micro-batches in the packed layout (`PackedRows`). routing: an MoE
    policy's routing record (the sampler's; R2: the old-policy pass's), which the updates
    compare with their routers' choice (`train.routing_metrics`) and with `replay` replay
    (`algo.routing_replay`)."""

    old_logp: bool = False
    ref_logp: bool = False
    behaviour_logp: bool = False
    sampler_logp: bool = False
    advantages: bool = False
    packed: bool = False
    routing: bool = False
    replay: bool = False


@struct.dataclass
class PackedRows:
    """A micro-batch's sequences packed one row per group (`gvpo_jax.buckets.pack`): [prompt |
    its G responses back to back | padding]. R groups, W packed response slots, J prompt slots.

    tokens / valid / positions: [R, J + W] (token ids, 1.0 where a token exists, RoPE
    positions restarting with each response); segments: [R, W] (g + 1: response g; G + 1:
    padding); pred: [R, W] the slot whose hidden state predicts each packed response slot;
    index: [B, N] where row b's response token t sits in the flattened [R * W] slots (-1: none).
    routing / routing_mask: [R, J + W, M, K] and [R, J + W], the rows' recorded routing packed
    as the tokens are (None without); a prompt slot's mask counts the group's rows holding it.
    """

    tokens: Any
    valid: Any
    positions: Any
    segments: Any
    pred: Any
    index: Any
    routing: Any = None
    routing_mask: Any = None

    def group_arrays(self) -> dict:
        """The [R, ...] arrays, one row per group (split over the mesh by groups)."""
        names = ("tokens", "valid", "positions", "segments", "pred", "routing", "routing_mask")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


@struct.dataclass
class UpdateBatch:
    """Rows of whole groups in the update layout (B = P x G rows, the G responses of a prompt
    contiguous; J prompt slots, N response slots), as the update and log-prob passes take them.

    tokens: [B, J + N] int32, [pad.., prompt, response, pad..] with the prompt right-aligned at J.
    valid: [B, J + N] 1.0 where a token exists (prompt and response), which attention sees.
    loss_mask: [B, N] 1.0 on the response tokens the loss counts (a tool's output, say, exists
    but is not counted). rewards: [B]. Optional ([B, N] unless said; which ones a run carries is
    its `BatchSpec`): old_logp, ref_logp, behaviour_logp, sampler_logp, drawn ([B], 1.0 on rows
    the sampler drew this step), advantages ([B] or [B, N]), routing and routing_mask (an MoE
    rollout's recorded routing, replayed: [B, J + N, M, K] experts of every token in each of
    the M MoE layers, and [B, J + N] 1.0 where the record holds). A packed micro-batch has
    `packed` instead of tokens / valid / routing / routing_mask.
    """

    loss_mask: Any
    rewards: Any
    tokens: Any = None
    valid: Any = None
    old_logp: Any = None
    ref_logp: Any = None
    behaviour_logp: Any = None
    sampler_logp: Any = None
    drawn: Any = None
    advantages: Any = None
    routing: Any = None
    routing_mask: Any = None
    packed: PackedRows | None = None

    def arrays(self) -> dict:
        """The present [B, ...] fields by name (not the packed rows)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "packed" and getattr(self, f.name) is not None
        }

    def rows(self, rows) -> UpdateBatch:
        """The given rows (numpy indices) of a host batch."""
        return self.replace(**{k: np.asarray(v)[rows] for k, v in self.arrays().items()})

    def check(self, spec: BatchSpec) -> None:
        """ValueError unless the batch carries exactly the optional fields `spec` names."""
        for name in ("old_logp", "ref_logp", "behaviour_logp", "sampler_logp", "advantages"):
            if getattr(spec, name) != (getattr(self, name) is not None):
                raise ValueError(
                    f"the update batch {'lacks' if getattr(spec, name) else 'has'} {name}, "
                    f"which its BatchSpec says it {'has' if getattr(spec, name) else 'lacks'}."
                )
        if spec.sampler_logp != (self.drawn is not None):
            raise ValueError("the update batch's drawn rows do not match its sampler_logp.")
        if spec.routing != (self.routing is not None) or spec.routing != (
            self.routing_mask is not None
        ):
            raise ValueError(
                f"the update batch {'lacks' if spec.routing else 'has'} a routing record, "
                f"which its BatchSpec says it {'has' if spec.routing else 'lacks'}."
            )


def layout_batch(
    prompts: Sequence[Sequence[int]],
    responses_BxN: np.ndarray,
    resp_mask_BxN: np.ndarray,
    *,
    group_size: int,
    prompt_len: int,
    pad_id: int,
    valid_BxN: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The update layout: row b = [pad.., prompt[b // G], response[b], pad..], shape [B, Tp + N].

    Prompts are right-aligned at slot `prompt_len` (left padding), so the token before the first
    response slot is always the prompt's last token and `token_logprobs` needs no gathers.
    `valid_BxN`: the response tokens that exist where the losses do not count them all (a
    tool's answers: attention sees them, `resp_mask` is 0 there); default `resp_mask_BxN`.
    """
    B, N = responses_BxN.shape
    tokens = np.full((B, prompt_len + N), pad_id, np.int32)
    attn = np.zeros((B, prompt_len + N), np.float32)
    for b in range(B):
        p = prompts[b // group_size]
        tokens[b, prompt_len - len(p) : prompt_len] = p
        attn[b, prompt_len - len(p) : prompt_len] = 1.0
    valid_BxN = resp_mask_BxN if valid_BxN is None else valid_BxN
    tokens[:, prompt_len:] = np.where(valid_BxN > 0, responses_BxN, pad_id)
    attn[:, prompt_len:] = valid_BxN
    return {"tokens": tokens, "attn_mask": attn, "resp_mask": resp_mask_BxN.astype(np.float32)}


def layout_routes(
    prompt_routes_PxTxMxK: np.ndarray,
    prompt_lens_P: Sequence[int],
    routes_BxNxMxK: np.ndarray,
    *,
    group_size: int,
    prompt_len: int,
) -> np.ndarray:
    """An MoE rollout's recorded routing (`SampleOutput`) in `layout_batch`'s layout: row b's
    experts [Tp + N, M, K] at its tokens' slots (the prompt's right-aligned at `prompt_len`,
    0 on padding and on the response's last token, which the sampler never fed back)."""
    B, N, M, K = routes_BxNxMxK.shape
    out = np.zeros((B, prompt_len + N, M, K), routes_BxNxMxK.dtype)
    for b in range(B):
        p, n = b // group_size, int(prompt_lens_P[b // group_size])
        out[b, prompt_len - n : prompt_len] = prompt_routes_PxTxMxK[p, :n]
    out[:, prompt_len:] = routes_BxNxMxK
    return out


def encode_answers(
    tokenizer, texts: Sequence[str], *, max_new_tokens: int, eos_id: int, pad_id: int
):
    """Demonstration / SFT targets: answer + EOS, truncated to N -> (tokens_BxN, mask_BxN)."""
    B = len(texts)
    tokens = np.full((B, max_new_tokens), pad_id, np.int32)
    mask = np.zeros((B, max_new_tokens), np.float32)
    for b, text in enumerate(texts):
        ids = list(tokenizer.encode(text, add_special_tokens=False)) + [eos_id]
        ids = ids[:max_new_tokens]
        tokens[b, : len(ids)] = ids
        mask[b, : len(ids)] = 1.0
    return tokens, mask


def decode(tokenizer, tokens_BxN: np.ndarray, lengths_B: np.ndarray, start_B=None) -> list[str]:
    """Each row's text, tokens [start_B[b], lengths_B[b]) (start: 0 by default)."""
    start_B = np.zeros(len(lengths_B), int) if start_B is None else start_B
    return [
        tokenizer.decode(
            tokens_BxN[b, int(start_B[b]) : int(lengths_B[b])].tolist(), skip_special_tokens=True
        )
        for b in range(tokens_BxN.shape[0])
    ]


def concat_batches(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def group_rows(groups: np.ndarray, group_size: int) -> np.ndarray:
    """The row indices of the given groups (whole groups, in the given order)."""
    return (np.asarray(groups)[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)


def select_groups(batch: dict[str, np.ndarray], groups: np.ndarray, group_size: int):
    """Rows of the given group indices (whole groups, in the given order)."""
    rows = group_rows(groups, group_size)
    return {k: v[rows] for k, v in batch.items()}


def informative_groups(rewards_B: np.ndarray, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling on the host: bool [P], True for groups whose rewards are not all
    equal (the numpy twin of `gvpo_jax.losses.informative_groups`)."""
    rewards_B = np.asarray(rewards_B)
    if rewards_B.ndim != 1 or len(rewards_B) % group_size:
        raise ValueError(f"{rewards_B.shape} rewards are not whole groups of {group_size}.")
    r_PxG = rewards_B.reshape(-1, group_size)
    return np.any(r_PxG != r_PxG[:, :1], axis=1)


def minibatch_groups(num_groups: int, num_minibatches: int, rng: np.random.Generator):
    """A shuffled partition of group indices into equal minibatches: groups are never split."""
    if num_groups % num_minibatches:
        raise ValueError(f"{num_minibatches} minibatches do not divide {num_groups} groups.")
    return rng.permutation(num_groups).reshape(num_minibatches, -1)
