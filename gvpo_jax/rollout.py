"""Host-side batch helpers of an RL step: the update layout, demonstrations, group selection."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def layout_batch(
    prompts: Sequence[Sequence[int]],
    responses_BxN: np.ndarray,
    resp_mask_BxN: np.ndarray,
    *,
    group_size: int,
    prompt_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """The update layout: row b = [pad.., prompt[b // G], response[b], pad..], shape [B, Tp + N].

    Prompts are right-aligned at slot `prompt_len` (left padding), so the token before the first
    response slot is always the prompt's last token and `token_logprobs` needs no gathers.
    """
    B, N = responses_BxN.shape
    tokens = np.full((B, prompt_len + N), pad_id, np.int32)
    attn = np.zeros((B, prompt_len + N), np.float32)
    for b in range(B):
        p = prompts[b // group_size]
        tokens[b, prompt_len - len(p) : prompt_len] = p
        attn[b, prompt_len - len(p) : prompt_len] = 1.0
    tokens[:, prompt_len:] = np.where(resp_mask_BxN > 0, responses_BxN, pad_id)
    attn[:, prompt_len:] = resp_mask_BxN
    return {"tokens": tokens, "attn_mask": attn, "resp_mask": resp_mask_BxN.astype(np.float32)}


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


def decode(tokenizer, tokens_BxN: np.ndarray, lengths_B: np.ndarray) -> list[str]:
    return [
        tokenizer.decode(tokens_BxN[b, : int(lengths_B[b])].tolist(), skip_special_tokens=True)
        for b in range(tokens_BxN.shape[0])
    ]


def concat_batches(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def select_groups(batch: dict[str, np.ndarray], groups: np.ndarray, group_size: int):
    """Rows of the given group indices (whole groups, in the given order)."""
    rows = (np.asarray(groups)[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)
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
