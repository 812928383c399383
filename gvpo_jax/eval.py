"""Held-out evaluation: avg@n (pass@1 averaged over n samples), unbiased pass@k and maj@k.

`evaluate` takes the sampler as a callable: `generate_fn(examples, n) -> list[list[str]]` returns
n completions for each example. `evaluate_policy` is the trainer's evaluation of a policy on a
mesh: greedy accuracy always, and the metric set of n samples at the rollout temperature.
A sample counts as correct when its reward is > 0.5 (rewards are 0/1 verifier scores).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from gvpo_jax import metrics, rollout, sampler, sharding
from gvpo_jax import rewards as rewards_lib


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), from n samples with c correct.

    The probability that at least one of k samples drawn without replacement from the n is correct.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    # Product form of C(n-c, k) / C(n, k); exact enough and free of huge binomials.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k: the fraction of disjoint blocks of k samples whose most frequent answer is correct.

    `answers[i]` is sample i's answer key (None: no answer, no vote); `correct[i]` its verdict.
    Blocks are samples [0, k), [k, 2k), ... (floor(n / k) of them; all iid, so their mean is an
    unbiased, lower-variance estimate of maj@k). Ties go to the answer seen first; a block with
    no answer at all counts as wrong.
    """
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs len(answers) == len(correct) >= k >= 1; got {n}, k={k}.")
    wins = []
    for start in range(0, n - k + 1, k):
        votes: collections.Counter = collections.Counter()
        first: dict[str, int] = {}
        for i in range(start, start + k):
            if answers[i] is not None:
                votes[answers[i]] += 1
                first.setdefault(answers[i], i)
        if not votes:
            wins.append(False)
            continue
        top = max(votes, key=lambda a: (votes[a], -first[a]))
        wins.append(bool(correct[first[top]]))
    return float(np.mean(wins))


def avg_at_n(correct_PxN) -> float:
    """avg@n: mean over problems of the fraction of its n samples that are correct."""
    c = np.asarray(correct_PxN, np.float64)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"avg@n needs a non-empty [problems, n] array; got shape {c.shape}.")
    return float(c.mean(axis=1).mean())


def _score(reward_fn, completions, golds, timeout_s, num_workers) -> tuple[np.ndarray, dict]:
    if isinstance(reward_fn, str):
        scores, info = rewards_lib.score_batch(
            completions, golds, reward_specs=[(reward_fn, 1.0)], timeout_s=timeout_s,
            num_workers=num_workers,
        )  # fmt: skip
        return scores, {"timeouts": info["timeouts"], "errors": info["errors"]}
    scores, errors = np.zeros(len(completions), np.float64), 0
    for i, (c, g) in enumerate(zip(completions, golds, strict=True)):
        try:
            value = float(reward_fn(c, g))
            scores[i] = value if math.isfinite(value) else 0.0
        except Exception:  # noqa: BLE001 - a failing reward is a wrong answer, counted
            errors += 1
    return scores, {"timeouts": 0, "errors": errors}


def _answers(reward_fn, answer_fn, completions, timeout_s, num_workers):
    if answer_fn is not None:
        return [answer_fn(c) for c in completions]
    if isinstance(reward_fn, str) and rewards_lib.REWARDS[reward_fn].answer is not None:
        answers, _ = rewards_lib.extract_batch(
            completions, reward=reward_fn, timeout_s=timeout_s, num_workers=num_workers
        )
        return answers
    return [c.strip() or None for c in completions]  # exact-match tasks: the text is the answer


def _metrics(correct_PxN: np.ndarray, answers_PxN: list[list], n: int, ks: Sequence[int]) -> dict:
    out = {f"avg@{n}": avg_at_n(correct_PxN), "num_problems": len(correct_PxN)}
    counts = correct_PxN.sum(axis=1).astype(int)
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
            out[f"maj@{k}"] = float(
                np.mean([maj_at_k(a, c, k) for a, c in zip(answers_PxN, correct_PxN, strict=True)])
            )
    return out


def evaluate(
    generate_fn: Callable[[list[Mapping], int], list[list[str]]],
    examples: Sequence[Mapping],
    *,
    reward_fn: str | Callable[[str, str], float],
    n: int,
    ks: Sequence[int] = (1,),
    answer_fn: Callable[[str], str | None] | None = None,
    timeout_s: float = 5.0,
    num_workers: int = rewards_lib.AUTO_WORKERS,
    return_details: bool = False,
):
    """Samples n completions per example and scores them against `example["answer"]`.

    Args:
      generate_fn: `(examples, n) -> completions`, one list of n strings per example.
      examples: dicts with `answer` (and `dataset`, default "eval", for the per-dataset split).
      reward_fn: a name in `rewards.REWARDS` (sympy-based ones are scored in the worker pool
        with hard timeouts; `num_workers` as in `rewards.score_batch`, default one per core) or
        a callable `(completion, gold) -> float`.
      n: samples per problem; ks: the k of pass@k and maj@k (k > n is skipped).
      answer_fn: answer key for maj@k; default the reward's extractor, else the stripped text.

    Returns a dict: `avg@n`, `pass@k`, `maj@k`, `num_problems`, `timeouts`, `errors` over all
    examples, and `per_dataset: {name: {same metrics}}`. With `return_details`, also a list of
    per-example dicts (completions, scores, answers).
    """
    examples = list(examples)
    if n < 1:
        raise ValueError(f"n is {n}; sample at least one completion per problem.")
    completions = generate_fn(examples, n)
    if len(completions) != len(examples) or any(len(c) != n for c in completions):
        raise ValueError(
            f"generate_fn must return {n} completions for each of {len(examples)} examples."
        )
    flat = [c for group in completions for c in group]
    golds = [str(ex["answer"]) for ex in examples for _ in range(n)]
    scores, info = _score(reward_fn, flat, golds, timeout_s, num_workers)
    answers = _answers(reward_fn, answer_fn, flat, timeout_s, num_workers)
    correct_PxN = (np.asarray(scores).reshape(len(examples), n) > 0.5).astype(np.float64)
    answers_PxN = [answers[i * n : (i + 1) * n] for i in range(len(examples))]
    names = [str(ex.get("dataset", "eval")) for ex in examples]
    result = {**_metrics(correct_PxN, answers_PxN, n, ks), **info, "per_dataset": {}}
    for name in dict.fromkeys(names):
        rows = [i for i, x in enumerate(names) if x == name]
        result["per_dataset"][name] = _metrics(
            correct_PxN[rows], [answers_PxN[i] for i in rows], n, ks
        )
    if not return_details:
        return result
    details = [
        {
            "id": ex.get("id"),
            "dataset": names[i],
            "answer": ex["answer"],
            "completions": completions[i],
            "scores": np.asarray(scores)[i * n : (i + 1) * n].tolist(),
            "answers": answers_PxN[i],
        }  # fmt: skip
        for i, ex in enumerate(examples)
    ]
    return result, details


def evaluate_policy(
    model,
    examples: Sequence[Mapping],
    *,
    tokenizer,
    settings: sampler.SamplingSettings,
    mesh,
    rules,
    reward_fn: str | Callable[[str, str], float],
    n: int,
    chunk: int,
    seed: int,
    timeout_s: float = 5.0,
    num_workers: int = rewards_lib.AUTO_WORKERS,
) -> dict:
    """Held-out metrics of a policy: greedy always, avg@n / pass@k / maj@k of n samples at the
    rollout temperature when n > 1.

    Returns a flat dict: "eval/greedy", "eval/avg@n", "eval/pass@k", ... (per dataset as
    "eval/per_dataset/<name>/..."). Examples go through the sampler in chunks of `chunk` prompts
    (fixed shapes: the last chunk is padded), split by rows over the mesh; every process runs the
    same chunks, samples its rows, and the outputs are all-gathered, so every process scores the
    same completions. Sampled accuracy is what GVPO's paper reports (avg@32) and what RL moves
    first; greedy accuracy is the single best guess.
    """
    rows = sharding.process_rows(chunk, mesh).rows
    key = jax.random.key(seed)

    def generate_fn(examples, num):
        # Evaluation has its own slot count (capped at each call's chunk x num rows).
        eval_settings = dataclasses.replace(
            settings, group_size=num, num_slots=settings.eval_num_slots
        )
        if num == 1:
            eval_settings = dataclasses.replace(eval_settings, temperature=0.0)
        outs = []
        for i in range(0, len(examples), chunk):
            part = list(examples[i : i + chunk])
            real = len(part)
            part += [part[-1]] * (chunk - real)
            out = sampler.sample_groups(
                model, [part[int(r)]["prompt_ids"] for r in rows],
                settings=eval_settings, rng=key, mesh=mesh, rules=rules,
            )  # fmt: skip
            full = sharding.gather_rows({"tokens": out.tokens_BxN, "lengths": out.lengths_B}, mesh)
            texts = rollout.decode(tokenizer, full["tokens"], full["lengths"])
            outs += [texts[j * num : (j + 1) * num] for j in range(real)]
        return outs

    kw = dict(reward_fn=reward_fn, timeout_s=timeout_s, num_workers=num_workers)
    greedy = evaluate(generate_fn, examples, n=1, ks=(1,), **kw)
    headline = greedy if n == 1 else evaluate(generate_fn, examples, n=n, ks=(1, n), **kw)
    flat = {
        f"eval/{k}": float(v)
        for k, v in metrics.flatten(headline).items()
        if isinstance(v, (int, float, np.floating, np.integer))
    }
    flat["eval/greedy"] = float(greedy["avg@1"])
    return flat
