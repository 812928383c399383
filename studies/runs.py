"""One learning-study run: the study's cells, a config's cold start (SFT) and an RL run at a
fixed rollout budget, measured by held-out accuracy and KL to the start, and written as a record.

Each study (`studies.toy.study`, `studies.smollm2.study`, `studies.stale.study`,
`studies.stale_smollm2.study`) builds its cells from its arms' configs (`studies/arms.py`) and
runs them with these pieces; `studies.report` turns the records into tables and plots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from gvpo_jax import assemble, resume, train
from gvpo_jax import config as config_lib
from gvpo_jax import eval as eval_lib
from gvpo_jax.rl_step import TrainingError
from gvpo_jax.rollout import collect_groups
from studies import arms
from studies.report import diverged

REPO = arms.REPO
# Step metrics a record keeps per step (besides losses, rewards and the gradient norms).
STEP_KEYS = (
    "adv_term", "var_term", "cov_term", "reward_corr", "rollout_lag", "is_weight_mean",
    "is_weight_max", "is_clipped_frac", "is_masked_frac", "sampler_logp_gap_max",
    "sampler_logp_gap_mean", "sampler_over_cap_frac", "moe/routing_drift",
    "moe/update_routing_drift",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of one experiment: `config` is its arm's config file and argument as
    `--config` takes them ("studies/stale/configs/grpo.py:k=4,tis"; studies/arms.py)."""

    exp: str
    name: str
    config: str
    start: str = "clean"  # which cold-start checkpoint: clean | noisy

    def load(self, quick: bool = False, seed: int | None = None):
        """The cell's config (with the arm's "quick" sizes), its seed set when given."""
        spec = self.config
        if quick:
            spec += ("," if ":" in spec else ":") + "quick"
        c = arms.load(spec)
        if seed is not None:
            c.seed = seed
        return c


def arm(study: str, name: str, **args) -> str:
    """ "studies/<study>/configs/<name>.py:k=v,..." (a True flag as its bare name)."""
    parts = [k if v is True else f"{k}={v}" for k, v in args.items() if v is not False]
    path = f"studies/{study}/configs/{name}.py"
    return path + (":" + ",".join(parts) if parts else "")


def config_key(cell: Cell, config, base) -> str:
    """Cells with the same effective config share runs (e.g. gvpo lr x1 and the offpolicy gvpo):
    the cell's start and the fields its config (seed unset) changes from the study's base. A
    record is named by this key and the budget (`record_tag`)."""
    return json.dumps([cell.start, arms.overrides(config, base)])


def record_tag(key: str, budget: int, seed: int) -> str:
    """A run's record name: its config key and budget hashed, and its seed."""
    return f"{zlib.crc32((key + str(budget)).encode()):08x}_s{seed}"


def record_path(root: str, key: str, budget: int, seed: int) -> str:
    """Where a study keeps a run's record: root/records/<record_tag>.json (root: the study's
    results folder or its work directory)."""
    return os.path.join(root, "records", f"{record_tag(key, budget, seed)}.json")


def with_overrides(c, overrides, seed: int):
    c = config_lib.set_fields(c.copy_and_resolve_references(), overrides)
    c.seed = seed
    return c


# ----------------------------------------------------------------------------------------------
# The cold start (SFT, optionally on corrupted demonstrations)


class NoisyTask:
    """Wraps a Task: a fixed NOISE_FRAC of problems get a wrong SFT target ("solution").

    The corruption is a pure function of the problem id (crc32), so a wrong problem is always
    wrong the same way, like a flawed demonstration set. "answer" (the verifier's gold) is
    untouched: rewards and evaluation stay exact.
    """

    def __init__(self, task, frac: float):
        self.task, self.frac = task, frac

    def __getattr__(self, name):
        return getattr(self.task, name)

    def corrupt(self, ex: dict) -> dict:
        h = zlib.crc32(ex["id"].encode())
        if (h % 1000) / 1000.0 >= self.frac:
            return ex
        offsets = (1, 2, 3, 10)
        off = offsets[(h >> 10) % len(offsets)]
        gold = int(ex["answer"])
        wrong = gold + off if (h >> 14) % 2 or gold - off < 0 else gold - off
        return dict(ex, solution=str(wrong))

    def next_train(self, n: int, cursor, rows=None):
        examples, cursor = self.task.next_train(n, cursor, rows)
        return [self.corrupt(ex) for ex in examples], cursor


def sft(config, workdir: str, *, noise: float, steps: int, eval_points: int, extra: int = 0):
    """Cold-start SFT (the trainer's `train.run_sft`, plus held-out evals) saved as step 0 in
    workdir.

    With `extra` > 0 the SFT continues for that many steps at a constant 1/10 of the SFT
    learning rate after the saved checkpoint (the plateau check; not saved).
    Returns {"curve": [(sft_step, accuracy)], "extra_curve": [...], "time_s": ...}.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    c = config.copy_and_resolve_references()
    c.mode = "sft"
    run_, state = assemble.assemble(c, workdir)
    if noise:
        run_ = dataclasses.replace(run_, task=NoisyTask(run_.task, noise))
    loop = assemble.start_loop(run_)
    try:
        curve = [(0, held_out(run_, state.params, step=0))]
        sft_state = _sft_phase(run_, state, loop, steps, c.sft.lr, "cosine", eval_points, curve)
        state = train.fresh_moments(run_, sft_state)  # fresh RL moments
        resume.save(run_, state, loop, None)
        run_.ckpt.wait()
        extra_curve = [(steps, curve[-1][1])]
        if extra:
            _sft_phase(run_, sft_state, loop, extra, c.sft.lr / 10, "constant",
                       max(eval_points // 2, 1), extra_curve, offset=steps)  # fmt: skip
    finally:
        run_.writer.close()
        run_.task.close()
        run_.ckpt.close()
    return {"curve": curve, "extra_curve": extra_curve, "time_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0}  # fmt: skip


def _sft_phase(run_, state, loop, steps, lr, schedule, eval_points, curve, offset=0):
    """`train.run_sft` for `steps` steps, evaluated every steps / eval_points (appended to
    `curve`); returns the state with the new params."""
    every = max(steps // eval_points, 1)

    def evaluate(i, params):
        if i % every == 0 or i == steps:
            acc = held_out(run_, params, step=offset + i)
            curve.append((offset + i, acc))
            print(f"[sft] step {offset + i}: held-out greedy accuracy {acc:.3f}", flush=True)

    warmup = run_.config.sft.warmup_steps if not offset else 0
    return train.run_sft(run_, state, loop, steps=steps, lr=lr, warmup_steps=warmup,
                         schedule=schedule, log_prefix="sft_extra" if offset else "sft",
                         on_step=evaluate)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# One RL run


def held_out(run_, params, *, step: int, n: int = 1) -> float:
    """Held-out greedy accuracy (n = 1), or avg@n at the rollout temperature (n > 1), whatever
    the config's own `train.eval_samples` (the demo config evaluates avg@16 by default)."""
    c = run_.config.copy_and_resolve_references()
    c.train.eval_samples = n
    result = eval_lib.evaluate_held_out(dataclasses.replace(run_, config=c), params, step=step)
    return result["accuracy"]


def held_out_both(run_, params, *, step: int, n: int) -> tuple[float, float]:
    """(greedy, avg@n at the rollout temperature) from one evaluation call."""
    c = run_.config.copy_and_resolve_references()
    c.train.eval_samples = n
    r = eval_lib.evaluate_held_out(dataclasses.replace(run_, config=c), params, step=step)
    return r["greedy"], r["accuracy"]


def rl_run(
    config,
    workdir: str,
    start_dir: str | None,
    *,
    budget: int,
    eval_points: int,
    start_acc,
    eval_n=0,
    sampled_at_ends_only=False,
    start_sampled=None,
    keep_outcomes=False,
):
    """RL from `start_dir` until `budget` responses are sampled; returns the run's record.

    The steps run in the trainer's own loop (`train.rl_loop`); its `on_step` hook counts the
    responses, records each step, evaluates at budget / eval_points intervals and stops the
    loop at the budget. KL to the start policy is measured at the end. With `eval_n` > 1 every
    evaluation also records held-out avg@eval_n at the rollout temperature (`curve_sampled`),
    next to the greedy `curve`; with `sampled_at_ends_only` only the start and the end do
    (`start_sampled`, when given, is the start's). `start_dir` None starts from the config's own
    weights (a pretrained model as shipped: no checkpoint). `keep_outcomes` keeps the final
    evaluation's per-problem outcomes (`rec["outcomes"]`, `problem_outcomes`) for paired
    comparisons.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    c = config.copy_and_resolve_references()
    if start_dir is not None:
        c.restore_from = os.path.join(start_dir, "checkpoints")
    P, G = c.rollout.prompts_per_step, c.rollout.group_size
    f = c.algo.replay_fraction
    c.train.steps = int(np.ceil(1 + (budget / (P * G) - 1) / (1 - f)))  # schedule length only
    run_, state = assemble.assemble(c, workdir)
    rec = {"curve": [], "curve_sampled": [], "losses": [], "rewards": [], "skipped": 0,
           "error": None, "grad_norm": [], "grad_norm_max": [], "grad_clipped_frac": [],
           "clip_frac": []}  # fmt: skip
    try:
        if start_dir is not None:
            state, ref, _ = resume.restore(run_, state, assemble.start_loop(run_))
        else:
            copy = run_.reference.kind == "copy"
            ref = resume.reference_copy(run_, state.params) if copy else None
        # The checkpoint carries the SFT run's rng and loop state (data position, shuffle
        # stream): the RL run starts its own from its seed, so that seeds differ.
        state = state.replace(rng=jax.random.key_data(jax.random.key(c.seed)))
        loop = assemble.start_loop(run_)
        start_params = jax.tree.map(jnp.copy, state.params)
        acc0 = start_acc
        if acc0 is None:
            acc0 = held_out(run_, state.params, step=0)
        rec["curve"].append((0, acc0))
        if eval_n > 1:
            if start_sampled is None:
                start_sampled = held_out(run_, state.params, step=0, n=eval_n)
            rec["curve_sampled"].append((0, start_sampled))
        count = {"responses": 0, "next_eval": 1}

        def on_step(step, state, m):
            responses = count["responses"]
            responses += int(m["rollout_rounds"]) * (P - int(m["replayed_groups"])) * G
            count["responses"] = m["responses"] = responses  # written with the step's metrics
            rec["losses"].append(m.get("loss", float("nan")))
            rec["rewards"].append(m["accuracy"])
            rec["skipped"] += int(m["skipped_updates"])
            for k in ("grad_norm", "grad_norm_max", "grad_clipped_frac"):
                rec[k].append(float(m[k]))
            # the ratio clip's share of tokens (GRPO family; GSPO: sequences); GVPO has none
            rec["clip_frac"].append(float(m.get("clip_frac", float("nan"))))
            # GVPO's loss terms, the lag and the IS weights, when the step has them (part 3)
            kept = {k: float(m[k]) for k in STEP_KEYS if k in m}
            if kept:
                rec.setdefault("step_metrics", []).append(kept)
            if responses >= count["next_eval"] * budget / eval_points or responses >= budget:
                if eval_n > 1 and (responses >= budget or not sampled_at_ends_only):
                    # one evaluation call scores greedy and avg@n
                    acc, acc_n = held_out_both(run_, state.params, step=step, n=eval_n)
                    rec["curve_sampled"].append((responses, acc_n))
                    if keep_outcomes and responses >= budget:
                        rec["outcomes"] = problem_outcomes(run_.workdir, step)
                else:
                    acc = held_out(run_, state.params, step=step)
                rec["curve"].append((responses, acc))
                count["next_eval"] = int(responses * eval_points / budget) + 1
            return responses >= budget

        state, preempted = train.rl_loop(run_, state, loop, ref, on_step=on_step)
        if preempted or count["responses"] < budget:
            raise TrainingError(
                f"stopped at step {loop.step} after {count['responses']} of {budget} responses"
                + (" (preempted)" if preempted else "")
            )
        rec["steps"] = loop.step
        rec["kl_start"] = kl_to_start(run_, loop, state.params, start_params, c.seed)
    except TrainingError as e:
        rec["error"] = str(e)
        rec["kl_start"] = float("nan")
    finally:
        run_.writer.close()
        run_.task.close()
        run_.ckpt.close()
    rec["time_s"] = time.perf_counter() - t0
    rec["cpu_s"] = time.process_time() - cpu0
    return rec


def problem_outcomes(workdir: str, step: int) -> dict:
    """A training-time evaluation's per-problem outcomes (`eval.evaluate_held_out`'s file), compact:
    problem ids, correct samples of n, the greedy verdicts, and the samples' lengths and
    truncations (summed over the problem's samples)."""
    with open(os.path.join(workdir, "eval_outcomes", f"step_{step:06d}.json")) as fh:
        outs = json.load(fh)["outcomes"]
    return {
        "ids": [o["id"] for o in outs], "n": outs[0]["n"] if outs else 0,
        "correct": [int(o["correct"]) for o in outs],
        "greedy": [bool(o["greedy"]) for o in outs],
        "length_sum": [int(sum(o["lengths"])) for o in outs],
        "truncated": [int(o["truncated"]) for o in outs],
        "greedy_truncated": [bool(o["greedy_truncated"]) for o in outs],
    }  # fmt: skip


def kl_to_start(run_, loop, params, start_params, seed: int, batches: int = 2) -> float:
    """KL(pi_final || pi_start) per response token: k3 = e^d - d - 1, d = logp_start - logp_final,
    on responses sampled from the final policy (unbiased for the per-token KL of those tokens,
    the same estimate as the trainer's kl_ref)."""
    total, ntok = 0.0, 0.0
    for i in range(batches):
        key = jax.random.fold_in(jax.random.key(seed + 777), i)
        P = run_.config.rollout.prompts_per_step
        batch, *_ = collect_groups(run_, params, loop, key, P)
        tokens, attn, mask = batch["tokens"], batch["attn_mask"], batch["resp_mask"]
        final = np.asarray(run_.updater.logprobs(params, tokens, attn), np.float64)
        start = np.asarray(run_.updater.logprobs(start_params, tokens, attn), np.float64)
        d = np.clip(start - final, -20, 20)
        total += float(np.sum((np.exp(d) - d - 1.0) * mask))
        ntok += float(mask.sum())
    return total / max(ntok, 1.0)


def save_record(rec: dict, cell: Cell, path: str) -> dict:
    """Marks the run's cell and divergence and writes it where the next invocation finds it."""
    rec["diverged"] = diverged(rec)
    rec["cell"] = cell.name
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(rec, fh)
    return rec
