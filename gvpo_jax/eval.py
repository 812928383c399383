"""Held-out evaluation: avg@n (pass@1 averaged over n samples), unbiased pass@k and maj@k.

`evaluate` takes the sampler as a callable: `generate_fn(examples, n) -> list[list[str]]` returns
n completions for each example. `evaluate_policy` is the trainer's evaluation of a policy on a
mesh: greedy accuracy always, and the metric set of n samples at the rollout temperature.
A sample counts as correct when its reward is > 0.5 (rewards are 0/1 verifier scores).

A run's evaluations (bottom): `evaluate_held_out` scores the task's held-out set during and
around training; `evaluate_sets` drives mode=eval over the paper's sets (`run_sets`), each with
its protocol, into the table.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import math
import os
import subprocess
import time
import zlib
from collections.abc import Callable, Mapping, Sequence

import jax
import ml_collections
import numpy as np
import tqdm

from gvpo_jax import assemble, metrics, multiturn, sampler, sharding
from gvpo_jax import batch as batch_lib
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
            completions,
            golds,
            reward_specs=[(reward_fn, 1.0)],
            timeout_s=timeout_s,
            num_workers=num_workers,
        )
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
            "prompt": ex.get("prompt"),
            "answer": ex["answer"],
            "completions": completions[i],
            "scores": np.asarray(scores)[i * n : (i + 1) * n].tolist(),
            "answers": answers_PxN[i],
        }
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
    outcomes: list | None = None,
    tools: multiturn.Tools | None = None,
) -> dict:
    """Held-out metrics of a policy: greedy always, avg@n / pass@k / maj@k of n samples at the
    rollout temperature when n > 1.

    `tools`: a run's tools: the policy samples multi-turn as in its rollouts, its last turn is
    scored, and "eval/tools/calls_per_response" / "failed_frac" (the headline pass's) and
    "eval/tools/greedy_calls_per_response" / "greedy_failed_frac" count its calls.

    Returns a flat dict: "eval/greedy", "eval/avg@n", "eval/pass@k", ... (per dataset as
    "eval/per_dataset/<name>/..."). Examples go through the sampler in chunks of `chunk` prompts
    (fixed shapes: the last chunk is padded), split by rows over the mesh; every process runs the
    same chunks, samples its rows, and the outputs are all-gathered, so every process scores the
    same completions. Sampled accuracy is what GVPO's paper reports (avg@32) and what RL moves
    first; greedy accuracy is the single best guess.

    `outcomes`, when given, receives one dict per problem (`problem_outcomes`): its id, set, gold,
    digest of its text and gold, correct count out of n, greedy verdict, response lengths and
    truncations, what a paired comparison of two policies on the same problems needs
    (`gvpo_jax.compare`). Each chunk samples with its own key, `fold_in(key(seed), chunk index)`.
    """
    rows = sharding.process_rows(chunk, mesh).rows
    key = jax.random.key(seed)
    shapes: list[tuple[list[int], list[bool]]] = []  # per example of the last generate_fn call
    calls = {"rows": 0.0, "calls": 0.0, "failed": 0.0}  # tools: the last generate_fn call's

    def sample(part, eval_settings, rng):
        """The chunk's rows, gathered: tokens, lengths, where the scored text starts, cut."""
        prompts = [part[int(r)]["prompt_ids"] for r in rows]
        if tools is None:
            out = sampler.sample_groups(
                model, prompts, settings=eval_settings, rng=rng, mesh=mesh, rules=rules
            )
            full = sharding.gather_rows({"tokens": out.tokens_BxN, "lengths": out.lengths_B}, mesh)
            # Truncated: the cap reached without an end-of-sequence token in the last slot.
            last = np.asarray(full["tokens"])[:, eval_settings.max_new_tokens - 1]
            lengths = np.asarray(full["lengths"])
            cut = (lengths >= eval_settings.max_new_tokens) & ~np.isin(
                last, np.asarray(eval_settings.eos_ids)
            )
            return full["tokens"], lengths, np.zeros(len(lengths), int), cut
        turn = dataclasses.replace(tools.settings, sampling=eval_settings)
        out = dataclasses.replace(tools, settings=turn).sample(
            model, prompts, tokenizer=tokenizer, rng=rng, mesh=mesh, rules=rules
        )
        rows_out = {"tokens": out.tokens_BxN, "lengths": out.lengths_B, "cut": out.truncated_B}
        rows_out.update(start=multiturn.final_turns(out), calls=out.calls_B, failed=out.failed_B)
        full = sharding.gather_rows(rows_out, mesh)
        calls["rows"] += len(full["lengths"])
        calls["calls"] += float(np.sum(full["calls"]))
        calls["failed"] += float(np.sum(full["failed"]))
        return full["tokens"], np.asarray(full["lengths"]), full["start"], full["cut"] > 0

    def generate_fn(examples, num):
        # Evaluation has its own slot count (capped at each call's chunk x num rows).
        eval_settings = dataclasses.replace(
            settings, group_size=num, num_slots=settings.eval_num_slots
        )
        if num == 1:
            eval_settings = dataclasses.replace(eval_settings, temperature=0.0)
        outs = []
        shapes.clear()
        calls.update(rows=0.0, calls=0.0, failed=0.0)
        for i in range(0, len(examples), chunk):
            part = list(examples[i : i + chunk])
            real = len(part)
            part += [part[-1]] * (chunk - real)
            # A key per chunk: the sampler draws row j from (key, j), so one key for every chunk
            # would give problem j of each chunk the same draws, and problems would no longer be
            # sampled independently (what the paired bootstrap of `compare` assumes).
            tokens, lengths, start, cut = sample(
                part, eval_settings, jax.random.fold_in(key, i // chunk)
            )
            texts = batch_lib.decode(tokenizer, tokens, lengths, start_B=start)
            outs += [texts[j * num : (j + 1) * num] for j in range(real)]
            shapes.extend(
                (lengths[j * num : (j + 1) * num].tolist(), cut[j * num : (j + 1) * num].tolist())
                for j in range(real)
            )
        return outs

    kw = dict(reward_fn=reward_fn, timeout_s=timeout_s, num_workers=num_workers)
    greedy, greedy_details = evaluate(
        generate_fn, examples, n=1, ks=(1,), return_details=True, **kw
    )
    greedy_shapes, greedy_calls = list(shapes), dict(calls)
    if n == 1:
        headline, details, sample_shapes = greedy, greedy_details, greedy_shapes
    else:
        headline, details = evaluate(
            generate_fn, examples, n=n, ks=(1, n), return_details=True, **kw
        )
        sample_shapes = list(shapes)
    if outcomes is not None:
        outcomes.extend(
            problem_outcomes(greedy_details, greedy_shapes, details, sample_shapes, n=n)
        )
    flat = {
        f"eval/{k}": float(v)
        for k, v in metrics.flatten(headline).items()
        if isinstance(v, (int, float, np.floating, np.integer))
    }
    flat["eval/greedy"] = float(greedy["avg@1"])
    if tools is not None:  # padded chunk rows included: a near-exact share
        for tag, c in (("", calls), ("greedy_", greedy_calls)):
            flat[f"eval/tools/{tag}calls_per_response"] = c["calls"] / max(c["rows"], 1.0)
            flat[f"eval/tools/{tag}failed_frac"] = c["failed"] / max(c["calls"], 1.0)
    return flat


def problem_digest(prompt, gold) -> str:
    """16 hex digits of SHA-256 over a problem's text and gold answer: what `compare` checks
    before pairing two evaluations' outcomes, so two files that share a set name and row ids
    but hold different problems are never paired."""
    text = json.dumps([str(prompt), str(gold)], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def problem_outcomes(greedy_details, greedy_shapes, details, shapes, *, n: int) -> list[dict]:
    """One dict per problem from `evaluate(..., return_details=True)`'s details of the greedy
    pass and of the n-sample pass (the same when n = 1) and each pass's (lengths, truncated) per
    problem: id (the digest when the example has none), set, gold, digest (`problem_digest`), n,
    correct (of the n samples), greedy (0/1), lengths (tokens, EOS included) and truncated
    (count) of the n samples, greedy_length, greedy_truncated."""
    out = []
    for g, g_shape, d, shape in zip(greedy_details, greedy_shapes, details, shapes, strict=True):
        digest = problem_digest(d["prompt"], d["answer"])
        out.append(
            {
                "id": digest if d["id"] is None else d["id"],
                "set": d["dataset"],
                "gold": str(d["answer"]),
                "digest": digest,
                "n": n,
                "correct": int(sum(s > 0.5 for s in d["scores"])),
                "greedy": int(g["scores"][0] > 0.5),
                "lengths": [int(x) for x in shape[0]],
                "truncated": int(sum(shape[1])),
                "greedy_length": int(g_shape[0][0]),
                "greedy_truncated": bool(g_shape[1][0]),
            }
        )
    return out


# ----------------------------------------------------------------------------------------------
# The paper's evaluation table: per-set protocol, results written as each set finishes, reruns
# that skip finished sets.

# Samples per problem of the paper's protocol: avg@32 on AIME 2024 (30 problems), one greedy
# answer (pass@1, verl's validation default: temperature 0, n 1) on every other set.
PAPER_N = {"aime24": 32}


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How one set is sampled: n samples at `temperature` / `top_p` (n = 1: greedy), responses
    up to `max_new_tokens`. The headline score is avg@n (n > 1) or greedy accuracy (n = 1)."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int

    def describe(self) -> str:
        cap = f"<= {self.max_new_tokens} new tokens"
        if self.n == 1:
            return f"greedy pass@1, {cap}"
        return f"avg@{self.n} at T={self.temperature:g}, top-p {self.top_p:g}, {cap}"


def protocol_for(
    name: str, *, n: int, temperature: float, top_p: float, max_new_tokens: int
) -> Protocol:
    """The set's protocol: n = 0 takes the paper's (`PAPER_N`, else 1)."""
    return Protocol(
        n=n or PAPER_N.get(name, 1),
        temperature=float(temperature),
        top_p=float(top_p),
        max_new_tokens=int(max_new_tokens),
    )


def headline_key(n: int) -> str:
    return f"avg@{n}" if n > 1 else "greedy"


def write_json_atomic(path: str, value) -> None:
    """Writes `value` as JSON to `path` through a temporary file and a rename: a reader (or a
    rerun after SIGTERM / SIGKILL) sees the old file or the whole new one, never a torn one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, default=metrics.to_python_scalar)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def git_commit(path: str | None = None) -> str:
    """The checkout's short commit, '+' when tracked files differ from it; 'unknown' outside git."""
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        run = functools.partial(
            subprocess.run, cwd=where, capture_output=True, text=True, timeout=10, check=True
        )
        commit = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = bool(run(["git", "status", "--porcelain", "-uno"]).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+" if dirty else "")


def _kept(path: str, protocol: Protocol, policy: str) -> dict | None:
    """A finished set's record at `path` when it was made by the same policy and protocol."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if record.get("policy") != policy or record.get("protocol") != dataclasses.asdict(protocol):
        return None
    return record


def run_sets(
    names: Sequence[str],
    *,
    protocols: Mapping[str, Protocol],
    load_set: Callable[[str], tuple[list[dict], dict]],
    score_set: Callable[[str, list[dict], Protocol], tuple[dict, list[dict]]],
    out_dir: str,
    policy: str,
    commit: str,
    write: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Evaluates each set, writes `out_dir/<set>.json` as soon as it finishes, then the table
    (`out_dir/table.json`, `out_dir/table.md`); returns the table.

    load_set(name) -> (examples with prompt_ids, info: files / skipped / dropped);
    score_set(name, examples, protocol) -> (metrics without the "eval/" prefix, outcomes).
    A set whose file holds a record of the same policy and protocol is kept, not re-run (all
    processes decide from the files present at the start, so they agree); a killed evaluation
    loses at most the set in progress. Only `write=True` (process 0) writes files.
    """
    kept = {
        name: _kept(os.path.join(out_dir, f"{name}.json"), protocols[name], policy)
        for name in names
    }
    records = {}
    for name in names:
        path = os.path.join(out_dir, f"{name}.json")
        if kept[name] is not None:
            records[name] = kept[name]
            log(f"[eval] {name}: finished before, kept ({path})")
            continue
        t0 = time.perf_counter()
        examples, info = load_set(name)
        result, outcomes = score_set(name, examples, protocols[name])
        records[name] = {
            "set": name,
            "policy": policy,
            "commit": commit,
            "protocol": dataclasses.asdict(protocols[name]),
            **info,
            "metrics": result,
            "time_s": round(time.perf_counter() - t0, 2),
            "outcomes": outcomes,
        }
        if write:
            write_json_atomic(path, records[name])
        n = protocols[name].n
        log(
            f"[eval] {name}: {headline_key(n)} {result[headline_key(n)]:.4f} on "
            f"{result['num_problems']} problems ({records[name]['time_s']:.1f} s)"
        )
    table = make_table(names, records, policy=policy, commit=commit)
    if write:
        write_json_atomic(os.path.join(out_dir, "table.json"), table)
        with open(os.path.join(out_dir, "table.md"), "w") as f:
            f.write(table_markdown(table))
    log(table_markdown(table))
    return table


def make_table(
    names: Sequence[str], records: Mapping[str, dict], *, policy: str, commit: str
) -> dict:
    """The table's rows (one per set, in `names` order) from the per-set records."""
    rows = []
    for name in names:
        r, p = records[name], records[name]["protocol"]
        m, outcomes = r["metrics"], r["outcomes"]
        lengths = [x for o in outcomes for x in o["lengths"]]
        samples = max(len(lengths), 1)
        rows.append(
            {
                "set": name,
                "score": m[headline_key(p["n"])],
                "metric": headline_key(p["n"]),
                "problems": m["num_problems"],
                "skipped": sum(r.get("skipped", {}).values()),
                "dropped": r.get("dropped", 0),
                "n": p["n"],
                "greedy": m["greedy"],
                f"avg@{p['n']}": m.get(f"avg@{p['n']}"),
                f"pass@{p['n']}": m.get(f"pass@{p['n']}"),
                f"maj@{p['n']}": m.get(f"maj@{p['n']}"),
                "mean_len": float(np.mean(lengths)) if lengths else 0.0,
                "truncated": sum(o["truncated"] for o in outcomes) / samples,
                "protocol": Protocol(**p).describe(),
                "commit": r.get("commit", commit),
            }
        )
    return {"policy": policy, "commit": commit, "rows": rows}


def table_markdown(table: Mapping) -> str:
    """The table as Markdown, with the policy, the commit and each set's protocol."""
    lines = [
        f"Policy: {table['policy']}; commit `{table['commit']}`.",
        "",
        "| set | score | metric | problems | skipped | greedy | pass@n | maj@n | mean length "
        "| truncated | protocol |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        n = r["n"]
        skipped = f"{r['skipped']}" + (f" (+{r['dropped']} too long)" if r["dropped"] else "")
        lines.append(
            f"| {r['set']} | {100 * r['score']:.2f} | {r['metric']} | {r['problems']} | {skipped} "
            f"| {100 * r['greedy']:.2f} | {100 * r[f'pass@{n}']:.2f} | {100 * r[f'maj@{n}']:.2f} "
            f"| {r['mean_len']:.1f} | {100 * r['truncated']:.1f}% | {r['protocol']} |"
        )
    if any(r["commit"] != table["commit"] for r in table["rows"]):
        lines.append("")
        lines.append(
            "Sets kept from earlier runs: "
            + ", ".join(f"{r['set']} at `{r['commit']}`" for r in table["rows"])
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# A run's evaluations: its held-out set (during and around training) and mode=eval's sets.


def evaluate_held_out(run_: assemble.Run, params, *, step: int, tag: str = "") -> dict:
    """Held-out accuracy (greedy, and avg@n at the rollout temperature when eval_samples > 1),
    written to the metrics and printed, and each problem's outcome to
    `eval_outcomes/step_<step>[_<tag>].json` (for `python -m gvpo_jax.compare`).
    Returns {"accuracy", "greedy", "eval/...": ...}."""
    c = run_.config
    n = c.train.eval_samples
    t0 = time.perf_counter()
    outcomes: list[dict] = []
    flat = evaluate_policy(
        run_.model(params),
        run_.task.eval_examples,
        tokenizer=run_.tokenizer,
        settings=run_.sampling,
        mesh=run_.mesh,
        rules=run_.rules,
        reward_fn=run_.task.eval_reward,
        n=n,
        chunk=c.train.eval_chunk or c.rollout.prompts_per_step,
        seed=step + 12345,
        timeout_s=run_.task.timeout_s,
        num_workers=run_.task.num_workers,
        outcomes=outcomes,
        tools=run_.tools,
    )
    flat["eval/time_s"] = time.perf_counter() - t0
    run_.writer.write_scalars(step, flat)
    if sharding.is_primary():
        name = f"step_{step:06d}" + (f"_{tag}" if tag else "")
        record = {
            "step": step,
            "tag": tag,
            "policy": f"{run_.workdir} at step {step}",
            "metrics": flat,
            "outcomes": outcomes,
        }
        write_json_atomic(os.path.join(run_.workdir, "eval_outcomes", f"{name}.json"), record)
    acc = flat[f"eval/avg@{n}"] if n > 1 else flat["eval/greedy"]
    if sharding.is_primary():
        what = f"avg@{n} (T={c.rollout.temperature:g}) {acc:.3f}, greedy " if n > 1 else ""
        tqdm.tqdm.write(
            f"[eval] step {step}: accuracy {what}{flat['eval/greedy']:.3f} "
            f"on {len(run_.task.eval_examples)} problems"
        )
    return {"accuracy": acc, "greedy": flat["eval/greedy"], **flat}


def describe_policy(c: ml_collections.ConfigDict, resumed: bool, step: int) -> str:
    """What is evaluated, as the table names it: a checkpoint, a HF directory, a GGUF file, or
    a random initialisation."""
    if resumed:
        return f"checkpoint step {step} of {c.restore_from or 'the workdir'}"
    if c.model.hf_dir:
        return f"Hugging Face directory {c.model.hf_dir}"
    if c.model.gguf:
        return f"GGUF {c.model.gguf}"
    return f"random init ({c.model.preset or 'model.overrides'}, seed {c.seed})"


def evaluate_sets(run_: assemble.Run, params, *, policy: str) -> dict:
    """mode=eval over config.eval.sets: each set with its protocol (`protocol_for`), results in
    `workdir/eval/<set>.json` as each finishes (a rerun keeps finished sets), the table printed
    and written as `eval/table.json` and `eval/table.md`. Returns the table."""
    from gvpo_jax import data  # lazy: the data package imports tensorflow_datasets

    c, e = run_.config, run_.config.eval
    names = data.eval_sets.parse_sets(e.sets)
    paths = data.eval_sets.parse_paths(e.paths)
    cap = e.max_new_tokens or c.rollout.max_new_tokens
    protocols = {
        name: protocol_for(
            name, n=e.n, temperature=e.temperature, top_p=e.top_p, max_new_tokens=cap
        )
        for name in names
    }

    def load_set(name):
        path = data.eval_sets.set_path(name, root=e.dir, paths=paths)
        ev = data.load_eval_set(name, path)
        examples, dropped = run_.task.encode(ev.examples)
        if not examples:
            raise data.EvalSetError(
                f"no problem of the {name} set ({path}) fits data.max_prompt_len="
                f"{c.data.max_prompt_len}; raise it."
            )
        return examples, {"files": list(ev.files), "skipped": ev.skipped, "dropped": dropped}

    def score_set(name, examples, protocol):
        settings = dataclasses.replace(
            run_.sampling,
            temperature=protocol.temperature,
            top_p=protocol.top_p,
            max_new_tokens=protocol.max_new_tokens,
        )
        outcomes: list[dict] = []
        flat = evaluate_policy(
            run_.model(params),
            examples,
            tokenizer=run_.tokenizer,
            settings=settings,
            mesh=run_.mesh,
            rules=run_.rules,
            reward_fn="math",
            n=protocol.n,
            chunk=c.train.eval_chunk or c.rollout.prompts_per_step,
            seed=c.seed + zlib.crc32(name.encode()),
            timeout_s=run_.task.timeout_s,
            num_workers=run_.task.num_workers,
            outcomes=outcomes,
            tools=run_.tools,
        )
        prefix = "eval/"
        result = {
            k[len(prefix) :]: v
            for k, v in flat.items()
            if k.startswith(prefix) and "/per_dataset/" not in k
        }
        result["num_problems"] = int(result["num_problems"])
        return result, outcomes

    log = (lambda line: tqdm.tqdm.write(line)) if sharding.is_primary() else (lambda line: None)
    return run_sets(
        names,
        protocols=protocols,
        load_set=load_set,
        score_set=score_set,
        out_dir=os.path.join(run_.workdir, "eval"),
        policy=policy,
        commit=git_commit(),
        write=sharding.is_primary(),
        log=log,
    )
