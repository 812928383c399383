"""Host side of an RL step: sample groups with the sampler, score them, lay out the update batch."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from gvpo_jax import losses, sampler


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """Static rollout settings (hashable, so they never trigger retracing by themselves)."""

    group_size: int
    max_new_tokens: int
    prompt_len: int  # prompt slots of the update layout (the config's max_prompt_len)
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    buckets: tuple[int, ...] = ()  # prompt-length buckets of the sampler (default: prompt_len)


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


def sample_groups(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    settings: RolloutSettings,
    rng: jax.Array,
    mesh=None,
    rules=None,
) -> sampler.SampleOutput:
    """G responses for each prompt (rows grouped contiguously), fetched to the host.

    With a mesh the prompts are split by rows over data x fsdp (explicit shardings; P must be a
    multiple of the row shards) and the parameters stay in their shards.
    """
    buckets = settings.buckets or (settings.prompt_len,)
    prompt_ids, prompt_lens = sampler.pad_prompts(prompts, buckets, settings.pad_id)
    kw = dict(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        eos_ids=settings.eos_ids,
        num_samples=settings.group_size,
        pad_id=settings.pad_id,
    )
    if mesh is None:
        out = sampler.generate(model, prompt_ids, prompt_lens, rng=rng, **kw)
        return sampler.SampleOutput(*(np.asarray(x) for x in jax.device_get(out)))
    from gvpo_jax import sharding

    ids = sharding.shard_batch({"ids": prompt_ids, "lens": prompt_lens}, mesh)
    out = sharding.generate(model, ids["ids"], ids["lens"], mesh=mesh, rules=rules, rng=rng, **kw)
    return sampler.SampleOutput(*(sharding.local_rows(x) for x in out))


def rollout(
    model,
    examples: Sequence[dict],
    prompts: Sequence[Sequence[int]],
    *,
    tokenizer,
    settings: RolloutSettings,
    rng: jax.Array,
    score_fn: Callable[[list[str], list[str]], tuple[np.ndarray, dict]],
    demo_answers: Sequence[str] | None = None,
    mesh=None,
    rules=None,
) -> tuple[dict[str, np.ndarray], list[str], dict[str, float]]:
    """One round: sample, optionally put a demonstration in each group's last slot, score, lay out.

    Returns (batch, completions, info). `batch` holds tokens / attn_mask / resp_mask / rewards and
    the sampler's own log-probs (`sample_logp`, used only as a consistency metric: the trainer
    recomputes pi_old in one forward).
    """
    G, N = settings.group_size, settings.max_new_tokens
    t0 = time.perf_counter()
    out = sample_groups(model, prompts, settings=settings, rng=rng, mesh=mesh, rules=rules)
    rollout_s = time.perf_counter() - t0
    tokens, mask, lengths = out.tokens_BxN, out.mask_BxN.astype(np.float32), out.lengths_B
    sample_logp = np.asarray(out.logp_BxN, np.float32)
    if demo_answers is not None:
        demo_tokens, demo_mask = encode_answers(
            tokenizer,
            demo_answers,
            max_new_tokens=N,
            eos_id=settings.eos_ids[0],
            pad_id=settings.pad_id,
        )
        rows = np.arange(len(prompts)) * G + (G - 1)
        tokens, mask, lengths = tokens.copy(), mask.copy(), lengths.copy()
        tokens[rows], mask[rows] = demo_tokens, demo_mask
        lengths[rows] = demo_mask.sum(-1).astype(lengths.dtype)
        sample_logp = sample_logp.copy()
        sample_logp[rows] = 0.0
    completions = decode(tokenizer, tokens, lengths)
    golds = [str(examples[b // G]["answer"]) for b in range(len(completions))]
    t1 = time.perf_counter()
    rewards, reward_info = score_fn(completions, golds)
    reward_s = time.perf_counter() - t1
    batch = layout_batch(
        prompts, tokens, mask, group_size=G, prompt_len=settings.prompt_len, pad_id=settings.pad_id
    )
    batch["rewards"] = np.asarray(rewards, np.float32)
    batch["sample_logp"] = sample_logp
    batch["lengths"] = np.asarray(lengths, np.int32)
    ended = np.zeros(len(lengths), bool)
    for eos in settings.eos_ids:
        ended |= (tokens == eos).any(-1)
    info = {
        "rollout_time_s": rollout_s,
        "reward_time_s": reward_s,
        "truncated": (~ended).astype(np.float32),
        **{f"reward/{k}": float(v) for k, v in reward_info.items()},
    }
    return batch, completions, info


def concat_batches(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def select_groups(batch: dict[str, np.ndarray], groups: np.ndarray, group_size: int):
    """Rows of the given group indices (whole groups, in the given order)."""
    rows = (np.asarray(groups)[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)
    return {k: v[rows] for k, v in batch.items()}


def informative_mask(rewards_B: np.ndarray, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling on the host: True for groups whose rewards are not all equal."""
    return np.asarray(losses.informative_groups(rewards_B, group_size))


def minibatch_groups(num_groups: int, num_minibatches: int, rng: np.random.Generator):
    """A shuffled partition of group indices into equal minibatches: groups are never split."""
    if num_groups % num_minibatches:
        raise ValueError(f"{num_minibatches} minibatches do not divide {num_groups} groups.")
    return rng.permutation(num_groups).reshape(num_minibatches, -1)
