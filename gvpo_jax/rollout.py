"""The rollout of an RL step: sample G responses per prompt, score them, and lay the groups out
for the update (`sample_round`); dynamic sampling's extra rounds (`collect_groups`).

`run` is the frozen `assemble.Run` (sampler settings, task, tokenizer, mesh), `loop` the step's
`rl_step.LoopState` (its data position advances as prompts are read). A round's rows are sampled
and scored on the process that feeds them, then all-gathered, so every process holds the whole
rollout (what dynamic sampling, the replay buffer and the metrics read).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from gvpo_jax import batch as batch_lib
from gvpo_jax import rewards, sampler, sharding
from gvpo_jax.multiturn import final_turns


def next_examples(task, mesh, loop, n: int) -> list[dict]:
    """This process's rows of the next global batch of n training examples (advances
    `loop.data`)."""
    examples, loop.data = task.next_train(n, loop.data, rows=sharding.process_rows(n, mesh).rows)
    return examples


def collect_groups(run, params, loop, rng: jax.Array, num_prompts: int, *, mesh=None):
    """Fresh groups for one step; with dynamic sampling, extra rounds replace uninformative ones.
    Reads the next training prompts at `loop.data` (advanced). `mesh`: a
    `rollout_queue.SamplingMesh` to sample on (default: the run's mesh).

    Returns (batch, completions, examples, metrics): `batch` is the global batch (every row, on
    every process); completions / examples are this process's rows of the first round.
    """
    s, G = run.settings, run.settings.group_size
    model = run.rollout_model(params)  # in rollout.compute_dtype
    kept, info_acc, completions_all, examples_all = [], {}, [], []
    num_kept, rounds_run = 0, 0
    for r in range(1 + (s.max_extra_rounds if s.algorithm.dynamic_sampling else 0)):
        rounds_run += 1
        examples = next_examples(run.task, run.mesh, loop, num_prompts)
        batch, completions, info = sample_round(
            run, model, examples, jax.random.fold_in(rng, r), mesh=mesh
        )
        batch = sharding.gather_rows(batch, run.mesh)  # every process now holds every row
        info["truncated"] = batch.pop("truncated")
        settings = run.sampling
        if run.tools is None:  # the single-turn sampler's schedule (a tool rollout has turns)
            info["decode_slots"] = sampler.decode_slots(
                batch["lengths"],
                max_new_tokens=settings.max_new_tokens,
                shed=settings.shed,
                num_slots=sampler.resolve_slots(settings.num_slots, len(batch["lengths"])),
            )
            info["decode_tokens"] = float(np.sum(batch["lengths"]))
        batch["task_rewards"] = batch["rewards"].copy()
        if s.algorithm.overlong is not None:  # DAPO's soft overlong penalty on the lengths
            max_len, cache_len, factor = s.algorithm.overlong
            batch["rewards"] = batch["rewards"] + rewards.overlong_penalty(
                batch["lengths"], max_len=max_len, cache_len=cache_len, factor=factor
            )
        for k, v in info.items():
            info_acc.setdefault(k, []).append(v)
        if r == 0:
            completions_all, examples_all, first_round = completions, examples, batch
        if not s.algorithm.dynamic_sampling:
            kept.append(batch)
            num_kept = num_prompts
            break
        good = np.flatnonzero(batch_lib.informative_groups(batch["task_rewards"], G))
        take = good[: num_prompts - num_kept]
        if len(take):
            kept.append(batch_lib.select_groups(batch, take, G))
            num_kept += len(take)
        if num_kept == num_prompts:
            break
    if num_kept < num_prompts:  # bound reached: fill with uninformative groups (zero advantage)
        good = batch_lib.informative_groups(first_round["task_rewards"], G)
        fill = np.flatnonzero(~good)[: num_prompts - num_kept]
        kept.append(batch_lib.select_groups(first_round, fill, G))
    metrics = {
        "rollout_time_s": float(np.sum(info_acc.pop("rollout_time_s"))),
        "reward_time_s": float(np.sum(info_acc.pop("reward_time_s"))),
        "truncated_frac": float(np.mean(np.concatenate(info_acc.pop("truncated")))),
        "rollout_rounds": float(rounds_run),
    }
    if "decode_slots" in info_acc:  # decode row-steps per generated token (1.0: none wasted)
        metrics["decode_pad_ratio"] = float(np.sum(info_acc.pop("decode_slots"))) / max(
            float(np.sum(info_acc.pop("decode_tokens"))), 1.0
        )
    if "tools/wait_s" in info_acc:  # this process's device idle on the tools, of its rollout
        wait = float(np.sum(info_acc.pop("tools/wait_s")))
        metrics["tools/wait_frac"] = wait / max(metrics["rollout_time_s"], 1e-9)
    for k, v in info_acc.items():  # counts (reward timeouts, errors) of this process's rows
        metrics[k] = sharding.sum_over_shards(np.sum(v), run.mesh)
    if "tools/rows" in metrics:  # per response, per call and per token, from the counts
        rows, calls = metrics.pop("tools/rows"), metrics.pop("tools/calls")
        metrics["tools/calls_per_response"] = calls / rows
        metrics["tools/failed_frac"] = metrics.pop("tools/failed") / max(calls, 1.0)
        metrics["tools/turns_mean"] = metrics.pop("tools/turns") / rows
        metrics["tools/token_share"] = metrics.pop("tools/tokens") / max(
            metrics.pop("tools/response_tokens"), 1.0
        )
    return batch_lib.concat_batches(kept), completions_all, examples_all, metrics


def sample_round(run, model, examples: list[dict], rng: jax.Array, *, mesh=None):
    """This process's rows of one round: sample G responses per prompt, optionally put the
    demonstration in each group's last slot, score, and lay out the update rows.

    Returns (batch, completions, info): `batch` holds tokens / attn_mask / resp_mask / rewards /
    lengths / truncated, `rollout_logp` (the sampler's `logp_BxN`: the sampling policy's own
    log-probs at T = 1, not those of the tempered / truncated distribution it drew from; only a
    consistency metric: pi_old is recomputed in one forward) and `sampled` (0 on demonstration
    rows).
    """
    settings, G = run.sampling, run.settings.group_size
    prompts = [ex["prompt_ids"] for ex in examples]
    t0 = time.perf_counter()
    where = dict(
        rng=rng,
        mesh=run.mesh if mesh is None else mesh.mesh,
        rules=run.rules if mesh is None else mesh.rules,
    )
    tool_info = {}
    if run.tools is not None:  # multi-turn: the policy's tokens and the tools' answers
        out = run.tools.sample(model, prompts, tokenizer=run.tokenizer, **where)
        tokens, mask, valid = out.tokens_BxN, out.policy_BxN, out.valid_BxN
        lengths, sample_logp, scored_from = out.lengths_B, out.sample_logp_BxN, final_turns(out)
        tool_info = {
            "tools/rows": float(len(lengths)),
            "tools/calls": float(out.calls_B.sum()),
            "tools/failed": float(out.failed_B.sum()),
            "tools/turns": float(out.turns_B.sum()),
            "tools/tokens": float(out.tool_tokens_B.sum()),
            "tools/response_tokens": float(lengths.sum()),
            "tools/wait_s": out.tool_wait_s,
        }
        routes = None
    else:
        out = sampler.sample_groups(model, prompts, settings=settings, **where)
        tokens, mask, lengths = out.tokens_BxN, out.mask_BxN.astype(np.float32), out.lengths_B
        valid, sample_logp, scored_from = mask, out.sample_logp_BxN, np.zeros(len(lengths), int)
        routes = out.routes_BxNxMxK
    rollout_s = time.perf_counter() - t0
    rollout_logp = np.asarray(out.logp_BxN, np.float32)
    sampled = np.ones(len(lengths), np.float32)  # 0: a demonstration, not the sampler's
    if run.settings.demo_slot:
        demo_tokens, demo_mask = batch_lib.encode_answers(
            run.tokenizer,
            [ex.get("solution") or ex["answer"] for ex in examples],
            max_new_tokens=settings.max_new_tokens,
            eos_id=settings.eos_ids[0],
            pad_id=settings.pad_id,
        )
        rows = np.arange(len(prompts)) * G + (G - 1)
        tokens, mask, lengths = tokens.copy(), mask.copy(), lengths.copy()
        valid, scored_from = valid.copy(), scored_from.copy()
        tokens[rows], mask[rows], valid[rows], scored_from[rows] = (
            demo_tokens,
            demo_mask,
            demo_mask,
            0,
        )
        lengths[rows] = demo_mask.sum(-1).astype(lengths.dtype)
        rollout_logp = rollout_logp.copy()
        rollout_logp[rows] = 0.0
        sampled[rows] = 0.0
    completions = batch_lib.decode(run.tokenizer, tokens, lengths)
    # What the task scores: the response, or with tools the policy's last turn (its answer).
    scored = batch_lib.decode(run.tokenizer, tokens, lengths, start_B=scored_from)
    golds = [str(examples[b // G]["answer"]) for b in range(len(completions))]
    t1 = time.perf_counter()
    scores, reward_info = run.task.score(scored, golds)
    reward_s = time.perf_counter() - t1
    batch = batch_lib.layout_batch(
        prompts,
        tokens,
        mask,
        group_size=G,
        prompt_len=run.settings.prompt_len,
        pad_id=settings.pad_id,
        valid_BxN=valid,
    )
    if routes is not None:  # an MoE policy: its rows' routing, as sampled
        batch["routes"] = batch_lib.layout_routes(
            np.asarray(out.prompt_routes_PxTxMxK),
            [len(p) for p in prompts],
            np.asarray(routes),
            group_size=G,
            prompt_len=run.settings.prompt_len,
        )
        batch["routes"][sampled == 0] = 0  # demonstrations: not the sampler's tokens
    ended = np.zeros(len(lengths), bool)
    for eos in settings.eos_ids:  # the policy's own EOS (a tool's answer may hold the id)
        ended |= ((tokens == eos) & (mask > 0)).any(-1)
    batch.update(
        rewards=np.asarray(scores, np.float32),
        rollout_logp=rollout_logp,
        # What the rows were drawn from (tempered, truncated): the rollout correction's mu.
        behaviour_logp=np.where(sampled[:, None] > 0, np.asarray(sample_logp), 0.0).astype(
            np.float32
        ),
        sampled=sampled,
        lengths=np.asarray(lengths, np.int32),
        truncated=(~ended).astype(np.float32),
    )
    info = {
        "rollout_time_s": rollout_s,
        "reward_time_s": reward_s,
        **{f"reward/{k}": float(v) for k, v in reward_info.items()},
        **tool_info,
    }
    return batch, completions, info
