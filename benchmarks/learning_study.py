"""Learning study: GVPO vs the GRPO family where the claims bite (off-policy, replay, lr, beta).

Run (66 runs, about an hour on a 2-core CPU; writes docs/study/{results.json,results.md,*.png}):
    .venv/bin/python -m benchmarks.learning_study
    .venv/bin/python -m benchmarks.learning_study --quick --out /tmp/s --workdir /tmp/s/runs
    .venv/bin/python -m benchmarks.learning_study --only offpolicy,replay --seeds 0,1

Every RL run starts from one shared cold-start checkpoint (SFT on the arithmetic task, made once
in <workdir>/start and reused) and runs until it has sampled the same number of responses (the
rollout budget), whatever its replay fraction or dynamic-sampling rounds. Held-out greedy
accuracy is measured at fixed budget fractions; KL(pi_final || pi_start) is a per-token k3
estimate on fresh samples of the final policy. A run diverges when its loss is non-finite, an
update is skipped, the trainer stops, or its final accuracy falls below half the start's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from gvpo_jax import assemble, tasks, train
from gvpo_jax import config as config_lib
from gvpo_jax.rl_step import TrainingError, collect_groups, rl_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY_DIR = os.path.join(REPO, "docs", "study")
NOISE_FRAC = 0.3  # share of SFT demonstrations with a wrong answer (experiment "noisy")
NOISY_SFT_MULT = 2.5  # the noisy start gets 2.5x the clean start's SFT steps (its plateau)
DIVERGE_RATIO = 0.5  # final accuracy below this times the start's counts as a collapse
OFF_POLICY = {"algo.num_minibatches": 4, "algo.num_epochs": 2}
# The official GVPO recipe's regime: 4 minibatches x 1 epoch per rollout (1024 prompts per
# rollout, minibatches of 256 in the paper's verl script).
OFFICIAL = {"algo.num_minibatches": 4, "algo.num_epochs": 1}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of one experiment; `overrides` are dotted config fields."""

    exp: str
    name: str
    overrides: tuple = ()
    start: str = "clean"  # which cold-start checkpoint: clean | noisy


def _cell(exp, name, start="clean", **kw):
    return Cell(exp, name, tuple(sorted((k.replace("__", "."), v) for k, v in kw.items())), start)


def cells(lr: float) -> list[Cell]:
    """The study's cells; identical configurations in several experiments run once."""
    off = {k.replace(".", "__"): v for k, v in OFF_POLICY.items()}
    official = {k.replace(".", "__"): v for k, v in OFFICIAL.items()}
    out = []
    for algo in ("gvpo", "grpo", "dr_grpo", "gspo"):
        out.append(_cell("offpolicy", f"{algo} 4mbx2ep", algo__name=algo, **off))
    for f in (0.0, 0.5, 0.75):
        out.append(_cell("replay", f"gvpo replay {f}", algo__name="gvpo", algo__replay_fraction=f))
    for algo in ("gvpo", "grpo"):
        for mult in (1, 3, 10):
            out.append(
                _cell(
                    "stability",
                    f"{algo} lr x{mult} 4mbx2ep",
                    algo__name=algo,
                    optim__lr=lr * mult,
                    **off,
                )
            )
    # On-policy with anchor "old", beta only scales the gradient (Adam undoes it): a control.
    # Off-policy (later minibatches see logp != anchor) is where beta shapes the update.
    for beta in (0.05, 0.1, 0.2):
        out.append(_cell("beta", f"gvpo beta {beta}", algo__name="gvpo", algo__beta=beta))
    for beta in (0.05, 0.1, 0.2):
        out.append(_cell("beta", f"gvpo beta {beta} 4mbx2ep", algo__name="gvpo",
                         algo__beta=beta, **off))  # fmt: skip
    out.append(_cell("noisy", "gvpo from noisy SFT", start="noisy", algo__name="gvpo"))
    out.append(_cell("noisy", "gvpo from noisy SFT lr x3", start="noisy", algo__name="gvpo",
                     optim__lr=lr * 3))  # fmt: skip
    for anchor in ("old", "ref"):
        out.append(_cell("anchor", f"gvpo anchor {anchor}", algo__name="gvpo", algo__anchor=anchor))
    for algo in ("gvpo", "grpo", "dr_grpo", "dapo", "gspo"):  # one update per rollout
        out.append(_cell("baselines", algo, algo__name=algo))
    # Part 2's controls (STUDY.md "Part 2"): the official regime, GVPO's restoring term made
    # active by a large beta, Dr. GRPO without its trust region, GRPO without its KL penalty.
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(_cell("official", f"{algo} 4mbx1ep", algo__name=algo, **official))
    for beta in (1.0, 10.0):
        out.append(_cell("bigbeta", f"gvpo beta {beta:g} 4mbx2ep", algo__name="gvpo",
                         algo__beta=beta, **off))  # fmt: skip
    out.append(_cell("bigbeta", "gvpo 4mbx2ep", algo__name="gvpo", **off))
    out.append(_cell("noclip", "dr_grpo eps 1e3 4mbx2ep", algo__name="dr_grpo",
                     algo__eps_low=1e3, algo__eps_high=1e3, **off))  # fmt: skip
    for algo in ("gvpo", "dr_grpo"):
        out.append(_cell("noclip", f"{algo} 4mbx2ep", algo__name=algo, **off))
    for mult in (1, 3, 10):
        out.append(_cell("nokl", f"grpo no KL lr x{mult} 4mbx2ep", algo__name="grpo",
                         algo__kl_coef=0.0, optim__lr=lr * mult, **off))  # fmt: skip
        out.append(_cell("nokl", f"grpo lr x{mult} 4mbx2ep", algo__name="grpo",
                         optim__lr=lr * mult, **off))  # fmt: skip
        out.append(_cell("nokl", f"gvpo lr x{mult} 4mbx2ep", algo__name="gvpo",
                         optim__lr=lr * mult, **off))  # fmt: skip
    return out


def config_key(cell: Cell, base) -> str:
    """Cells with the same effective config share runs (e.g. gvpo lr x1 and the offpolicy gvpo)."""
    fields = dict(cell.overrides)
    for k, v in list(fields.items()):
        node = base
        for part in k.split("."):
            node = node[part]
        if node == v:
            del fields[k]
    return json.dumps([cell.start, sorted(fields.items())])


# ----------------------------------------------------------------------------------------------
# Configs and the two cold starts


def base_config(quick: bool):
    """configs/arith_tiny.py with study settings (no export / plot / periodic checkpoints)."""
    import importlib.util

    path = os.path.join(REPO, "configs", "arith_tiny.py")
    spec = importlib.util.spec_from_file_location("arith_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = _quiet(module.get_config())
    return config_lib.set_fields(c, QUICK) if quick else c


QUICK = (
    ("rollout.prompts_per_step", 8),
    ("rollout.group_size", 4),
    ("data.eval_size", 16),
    ("sft.steps", 20),
    ("sft.batch_size", 16),
)


def _quiet(c):
    """A config's run without export, plots, periodic checkpoints, sample logs or evaluations
    of its own (the study evaluates), on all devices."""
    c.train.export = False
    c.train.plot = False
    c.train.checkpoint_every = 10**9
    c.train.sample_log_every = 0
    c.train.eval_every = 0
    if "kl_ref_metric" in c.train:  # the study measures KL to the start itself, at the end
        c.train.kl_ref_metric = False
    c.mesh.data = -1  # all devices: one on a plain CPU (the test runs the script without fakes)
    return c


# The study's task and RL settings (STUDY.md "Set-up"): configs/arith_tiny.py as it was when the
# study ran; the config has since become the demo recipe (addition 0-99, P = 128 x G = 4, lr 1e-4).
FIRST_SETUP = (
    ("data.arith.max_operand", 30),
    ("data.arith.ops", "+-"),
    ("rollout.prompts_per_step", 32),
    ("rollout.group_size", 8),
    ("optim.lr", 1e-5),
    ("optim.warmup_steps", 5),
)


def study_config(quick: bool):
    """base_config with the study's own set-up (FIRST_SETUP)."""
    c = config_lib.set_fields(base_config(quick=False), FIRST_SETUP)
    return config_lib.set_fields(c, QUICK) if quick else c


def with_overrides(c, overrides, seed: int):
    c = config_lib.set_fields(c.copy_and_resolve_references(), overrides)
    c.seed = seed
    return c


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

    def next_train(self, n: int, rows=None) -> list[dict]:
        return [self.corrupt(ex) for ex in self.task.next_train(n, rows)]


def sft(config, workdir: str, *, noise: float, steps: int, eval_points: int, extra: int = 0):
    """Cold-start SFT (train.run_sft's recipe, plus held-out evals) saved as step 0 in workdir.

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
    try:
        curve = [(0, held_out(run_, state.params, step=0))]
        params, curve = _sft_phase(run_, state, steps, c.sft.lr, "cosine", eval_points, curve)
        state = train.fresh_moments(run_, state.replace(params=params))  # fresh RL moments
        train.save(run_, state, None, 0)
        run_.ckpt.wait()
        extra_curve = [(steps, curve[-1][1])]
        if extra:
            state = state.replace(params=params)
            _, extra_curve = _sft_phase(
                run_,
                state,
                extra,
                c.sft.lr / 10,
                "constant",
                max(eval_points // 2, 1),
                extra_curve,
                offset=steps,
            )
    finally:
        run_.writer.close()
        run_.task.close()
        run_.ckpt.close()
    return {"curve": curve, "extra_curve": extra_curve, "time_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0}  # fmt: skip


def _sft_phase(run_, state, steps, lr, schedule, eval_points, curve, offset=0):
    c = run_.config
    st, update = train.sft_updater(
        run_,
        state,
        steps=steps,
        lr=lr,
        warmup_steps=c.sft.warmup_steps if not offset else 0,
        schedule=schedule,
    )
    every = max(steps // eval_points, 1)
    for i in range(1, steps + 1):
        st, _ = update(st, train.sft_batch(run_, run_.task.next_train(c.sft.batch_size)))
        if i % every == 0 or i == steps:
            acc = held_out(run_, st.params, step=offset + i)
            curve.append((offset + i, acc))
            print(f"[sft] step {offset + i}: held-out greedy accuracy {acc:.3f}", flush=True)
    return st.params, curve


# ----------------------------------------------------------------------------------------------
# One RL run


def held_out(run_, params, *, step: int, n: int = 1) -> float:
    """Held-out greedy accuracy (n = 1), or avg@n at the rollout temperature (n > 1), whatever
    the config's own `train.eval_samples` (the demo config evaluates avg@16 by default)."""
    c = run_.config.copy_and_resolve_references()
    c.train.eval_samples = n
    return train.evaluate(dataclasses.replace(run_, config=c), params, step=step)["accuracy"]


def held_out_both(run_, params, *, step: int, n: int) -> tuple[float, float]:
    """(greedy, avg@n at the rollout temperature) from one evaluation call."""
    c = run_.config.copy_and_resolve_references()
    c.train.eval_samples = n
    r = train.evaluate(dataclasses.replace(run_, config=c), params, step=step)
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
):
    """RL from `start_dir` until `budget` responses are sampled; returns the run's record.

    Composes the trainer's public pieces (assemble, train.restore, rl_step) so that the
    loop can stop on a response budget and measure KL to the start policy at the end. With
    `eval_n` > 1 every evaluation also records held-out avg@eval_n at the rollout temperature
    (`curve_sampled`), next to the greedy `curve`; with `sampled_at_ends_only` only the start
    and the end do (`start_sampled`, when given, is the start's). `start_dir` None starts from
    the config's own weights (a pretrained model as shipped: no checkpoint).
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
            state, ref, _, _ = train.restore(run_, state)
        else:
            ref = train.reference_copy(run_, state.params) if run_.needs_reference else None
        # The checkpoint carries the SFT run's rng, data position and shuffle stream: reseed them
        # (and rebuild the task) so that seeds differ.
        state = state.replace(rng=jax.random.key_data(jax.random.key(c.seed)))
        run_.task.close()
        run_ = dataclasses.replace(
            run_, np_rng=np.random.default_rng(c.seed + 1), task=tasks.build_task(c, run_.tokenizer)
        )
        start_params = jax.tree.map(jnp.copy, state.params)
        acc0 = start_acc
        if acc0 is None:
            acc0 = held_out(run_, state.params, step=0)
        rec["curve"].append((0, acc0))
        if eval_n > 1:
            if start_sampled is None:
                start_sampled = held_out(run_, state.params, step=0, n=eval_n)
            rec["curve_sampled"].append((0, start_sampled))
        responses, step, next_eval = 0, 0, 1
        while responses < budget:
            step += 1
            state, m, _, _ = rl_step(run_, state, ref)
            responses += int(m["rollout_rounds"]) * (P - int(m["replayed_groups"])) * G
            run_.writer.write_scalars(step, m | {"responses": responses})
            rec["losses"].append(m.get("loss", float("nan")))
            rec["rewards"].append(m["accuracy"])
            rec["skipped"] += int(m["skipped_updates"])
            for k in ("grad_norm", "grad_norm_max", "grad_clipped_frac"):
                rec[k].append(float(m[k]))
            # the ratio clip's share of tokens (GRPO family; GSPO: sequences); GVPO has none
            rec["clip_frac"].append(float(m.get("clip_frac", float("nan"))))
            if responses >= next_eval * budget / eval_points or responses >= budget:
                if eval_n > 1 and (responses >= budget or not sampled_at_ends_only):
                    # one evaluation call scores greedy and avg@n
                    acc, acc_n = held_out_both(run_, state.params, step=step, n=eval_n)
                    rec["curve_sampled"].append((responses, acc_n))
                else:
                    acc = held_out(run_, state.params, step=step)
                rec["curve"].append((responses, acc))
                next_eval = int(responses * eval_points / budget) + 1
        rec["steps"] = step
        rec["kl_start"] = kl_to_start(run_, state.params, start_params, c.seed)
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


def kl_to_start(run_, params, start_params, seed: int, batches: int = 2) -> float:
    """KL(pi_final || pi_start) per response token: k3 = e^d - d - 1, d = logp_start - logp_final,
    on responses sampled from the final policy (unbiased for the per-token KL of those tokens,
    the same estimate as the trainer's kl_ref)."""
    total, ntok = 0.0, 0.0
    for i in range(batches):
        key = jax.random.fold_in(jax.random.key(seed + 777), i)
        P = run_.config.rollout.prompts_per_step
        batch, *_ = collect_groups(run_, params, key, P)
        tokens, attn, mask = batch["tokens"], batch["attn_mask"], batch["resp_mask"]
        final = np.asarray(run_.logprobs(params, tokens, attn), np.float64)
        start = np.asarray(run_.logprobs(start_params, tokens, attn), np.float64)
        d = np.clip(start - final, -20, 20)
        total += float(np.sum((np.exp(d) - d - 1.0) * mask))
        ntok += float(mask.sum())
    return total / max(ntok, 1.0)


# ----------------------------------------------------------------------------------------------
# Summaries, tables, plots


def diverged(rec: dict) -> bool:
    losses = np.asarray(rec["losses"], np.float64)
    acc0, acc_end = rec["curve"][0][1], rec["curve"][-1][1]
    return bool(
        rec["error"]
        or rec["skipped"]
        or not np.all(np.isfinite(losses))
        or acc_end < DIVERGE_RATIO * acc0
    )


def auc(curve, budget: int) -> float:
    """Mean accuracy over the budget: trapezoid area under accuracy vs responses / budget."""
    x = np.array([p[0] for p in curve], np.float64)
    y = np.array([p[1] for p in curve], np.float64)
    return float(np.trapezoid(y, x) / max(x[-1], 1.0)) if len(x) > 1 else float(y[0])


def cell_summary(recs: list[dict], budget: int) -> dict:
    final = np.array([r["curve"][-1][1] for r in recs])
    return {
        "seeds": len(recs),
        "final_mean": float(final.mean()),
        "final_std": float(final.std(ddof=1)) if len(final) > 1 else 0.0,
        "final_min": float(final.min()),
        "final_max": float(final.max()),
        "auc": float(np.mean([auc(r["curve"], budget) for r in recs])),
        "diverged": int(sum(diverged(r) for r in recs)),
        "kl_start": float(np.nanmean([r["kl_start"] for r in recs])),
        "steps": float(np.mean([r.get("steps", 0) for r in recs])),
        "time_s": float(np.mean([r["time_s"] for r in recs])),
        # CPU seconds of the run's process (nan for records from before they were logged): wall
        # time includes other jobs on the cores and any pause, CPU time does not.
        "cpu_s": float(np.mean([r.get("cpu_s", np.nan) for r in recs])),
        "ci95": ci95(final),
        # per-step means over every step of every seed (records before these were logged: nan)
        **{
            k: _step_mean(recs, k)
            for k in ("grad_norm", "grad_norm_max", "grad_clipped_frac", "clip_frac")
        },  # fmt: skip
    }


def _step_mean(recs: list[dict], key: str) -> float:
    vals = np.concatenate([np.asarray(r.get(key, []), np.float64) for r in recs])
    vals = vals[np.isfinite(vals)]
    return float(vals.mean()) if vals.size else float("nan")


# Two-sided 97.5% quantiles of Student's t for 1-9 degrees of freedom (no scipy dependency).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def ci95(x) -> float:
    """Half-width of the 95% confidence interval of the mean of x (Student's t over seeds)."""
    x = np.asarray(x, np.float64)
    if len(x) < 2:
        return float("nan")
    return float(T975[min(len(x) - 2, len(T975) - 1)] * x.std(ddof=1) / np.sqrt(len(x)))


def diff_ci95(a, b) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95% interval (Welch's t, the seeds of two
    cells as independent samples). The difference is resolved when |diff| > half-width."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = np.sqrt(va + vb)
    if se == 0:
        return float(a.mean() - b.mean()), 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = T975[int(np.clip(np.floor(dof), 1, len(T975))) - 1]
    return float(a.mean() - b.mean()), float(t * se)


def problems_ci95(pa: float, pb: float, problems: int) -> float:
    """Half-width of the 95% interval that the finite held-out set alone puts on a difference of
    two accuracies pa - pb, each measured on `problems` problems (normal approximation of the
    binomial). It treats the two as independent, which over-states it: both cells are scored on
    the same problems, and a problem one method finds hard the other tends to find hard too."""
    return float(1.96 * np.sqrt((pa * (1 - pa) + pb * (1 - pb)) / problems))


def data_to_resolve(a, b, problems: int) -> tuple[float, float, int, int]:
    """How much data would resolve mean(a) - mean(b) if it is real: seeds per cell at the two
    cells' seed spread and held-out problems at their accuracies, with the two sources sharing
    the combined 95% interval equally (each half-width <= |d| / sqrt(2); normal quantiles, so
    an under-estimate for few seeds). Returns (difference, the pooled seed std, seeds, problems);
    both counts are at least the data already used (3 seeds, `problems`)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = float(a.mean() - b.mean())
    seed_var = a.var(ddof=1) + b.var(ddof=1)
    pa, pb = float(a.mean()), float(b.mean())
    prob_var = pa * (1 - pa) + pb * (1 - pb)
    if d == 0:
        return d, float(np.sqrt(seed_var / 2)), 10**9, 10**9
    z2 = 2 * 1.96**2 / d**2
    seeds = max(int(np.ceil(z2 * seed_var)), len(a), len(b))
    return d, float(np.sqrt(seed_var / 2)), seeds, max(int(np.ceil(z2 * prob_var)), problems)


def needs_lines(records: dict[str, list[dict]], pairs, problems: int) -> list[str]:
    """For each recorded pair whose greedy difference `diff_lines` does not resolve: the seeds
    and problems `data_to_resolve` says a difference of that size would need."""
    out = []
    for a, b in pairs:
        if len(records.get(a, ())) < 2 or len(records.get(b, ())) < 2:
            continue
        xa = [r["curve"][-1][1] for r in records[a]]
        xb = [r["curve"][-1][1] for r in records[b]]
        d, h = diff_ci95(xa, xb)
        if abs(d) > np.hypot(h, problems_ci95(float(np.mean(xa)), float(np.mean(xb)), problems)):
            continue  # already resolved
        d, sd, seeds, probs = data_to_resolve(xa, xb, problems)
        out.append(f"- {a} - {b}: {d:+.3f} at a seed std of {sd:.3f}: ~{seeds} seeds per cell "
                   f"and ~{probs} problems")  # fmt: skip
    return out


TABLE_HEAD = (
    "| cell | final acc (mean +- std) | 95% CI | min / max | AUC | diverged | KL to start "
    "| grad norm (mean / max) | clipped updates | ratio-clip frac | steps | s/run (CPU s) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _fmt(x: float, spec: str) -> str:
    return "-" if not np.isfinite(x) else format(x, spec)


def table(rows: list[tuple[str, dict]], start_acc: float, start: str = "the cold start") -> str:
    lines = [f"start (held-out greedy accuracy of {start}): {start_acc:.3f}", "", TABLE_HEAD]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['final_mean']:.3f} +- {s['final_std']:.3f} | "
            f"+- {_fmt(s['ci95'], '.3f')} | "
            f"{s['final_min']:.3f} / {s['final_max']:.3f} | {s['auc']:.3f} | "
            f"{s['diverged']}/{s['seeds']} | {s['kl_start']:.4f} | "
            f"{_fmt(s['grad_norm'], '.3g')} / {_fmt(s['grad_norm_max'], '.3g')} | "
            f"{_fmt(s['grad_clipped_frac'], '.2f')} | {_fmt(s['clip_frac'], '.3f')} | "
            f"{s['steps']:.0f} | {s['time_s']:.0f} ({_fmt(s['cpu_s'], '.0f')}) |"
        )
    return "\n".join(lines)


def _seed_bands(ax, series: list[tuple[str, list[dict]]], title: str) -> None:
    """One axis: per cell the seed mean of held-out greedy accuracy and its min-max band."""
    for name, recs in series:
        grid = np.unique(np.concatenate([[p[0] for p in r["curve"]] for r in recs]))
        ys = np.stack([np.interp(grid, *np.array(r["curve"], np.float64).T) for r in recs])
        (line,) = ax.plot(grid / 1000, ys.mean(0), lw=1.5, marker=".", label=name)
        ax.fill_between(grid / 1000, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("sampled responses (thousands)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_panels(panels: list[tuple[str, list[tuple[str, list[dict]]]]], out_png: str) -> None:
    """Side-by-side `_seed_bands` axes with a shared accuracy scale, one per (title, series)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(panels), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True).ravel()
    for ax, (title, series) in zip(axes, panels, strict=True):
        _seed_bands(ax, series, title)
    fig.savefig(out_png, dpi=100)


def plot(exp: str, series: list[tuple[str, list[dict]]], out_png: str, extra=None) -> None:
    """Accuracy vs sampled responses: the seed mean and a min-max band per cell; with `extra`
    (name, SFT curve) pairs a second axis of SFT accuracy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = 2 if extra else 1
    fig = Figure(figsize=(6.5 * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False).ravel()
    _seed_bands(axes[0], series, f"{exp}: mean and min-max band over seeds")
    if extra:
        ax = axes[1]
        for name, curve in extra:
            x, y = np.array(curve, np.float64).T
            ax.plot(x, y, marker=".", lw=1.5, label=name)
        ax.set_xlabel("SFT steps")
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title("SFT on clean vs noisy demonstrations")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(out_png, dpi=100)


# ----------------------------------------------------------------------------------------------
# The demo recipe search (STUDY.md, "The demo recipe"): end-to-end seeds, greedy and avg@n


@dataclasses.dataclass(frozen=True)
class DemoTrial:
    """A demo-recipe candidate: `start` overrides (task + SFT: one cold start per seed) and `rl`
    overrides (dotted config fields); RL runs `steps` rollouts (0: the config's train.steps)."""

    name: str
    start: tuple = ()
    rl: tuple = ()
    steps: int = 0


_OLD_TASK = (("data.arith.max_operand", 30), ("data.arith.ops", "+-"))
_P32G8 = (("rollout.prompts_per_step", 32), ("rollout.group_size", 8), ("optim.warmup_steps", 5))
DEMO_TRIALS = (
    DemoTrial("demo recipe (configs/arith_tiny.py)"),
    DemoTrial(
        "previous default: +- 0-30, P32 G8, lr 1e-5",
        _OLD_TASK,
        (*_P32G8, ("optim.lr", 1e-5)),
        steps=100,
    ),  # fmt: skip
    DemoTrial("+ 0-99, P32 G8, lr 2e-5", (), (*_P32G8, ("optim.lr", 2e-5)), steps=100),
)


def demo_search(trials, seeds, *, workdir: str, out: str, eval_n: int, eval_points: int = 6):
    """Each trial x seed: SFT from scratch with that seed (cached per start + seed), then RL from
    it with the same seed; greedy and avg@eval_n held-out accuracy along the RL run."""
    base = base_config(quick=False)
    records = {}
    for trial in trials:
        for seed in seeds:
            start_cfg = with_overrides(base, trial.start, seed)
            key = json.dumps([sorted(trial.start), seed, start_cfg.sft.steps])
            start_dir = os.path.join(workdir, "starts", f"{zlib.crc32(key.encode()):08x}")
            meta = os.path.join(start_dir, "start.json")
            if not os.path.exists(meta):
                info = sft(start_cfg, start_dir, noise=0.0, steps=start_cfg.sft.steps,
                           eval_points=5)  # fmt: skip
                with open(meta, "w") as fh:
                    json.dump(info, fh)
            with open(meta) as fh:
                start = json.load(fh)
            cfg = with_overrides(start_cfg, trial.rl, seed)
            P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
            steps = trial.steps or cfg.train.steps
            # The whole resolved config: a changed default (e.g. the config's lr) is a new run.
            rl_key = json.dumps([cfg.to_dict(), steps], sort_keys=True, default=str)
            tag = f"{zlib.crc32(rl_key.encode()):08x}"
            cached = os.path.join(workdir, "records", f"{tag}_s{seed}.json")
            if not os.path.exists(cached):
                wd = os.path.join(workdir, "runs", f"{tag}_s{seed}")
                shutil.rmtree(wd, ignore_errors=True)
                print(f"== demo / {trial.name} / seed {seed}", flush=True)
                rec = rl_run(cfg, wd, start_dir, budget=steps * P * G,
                             eval_points=eval_points, start_acc=start["curve"][-1][1],
                             eval_n=eval_n)  # fmt: skip
                rec.update(sft_time_s=start["time_s"], sft_cpu_s=start.get("cpu_s", float("nan")))
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                with open(cached, "w") as fh:
                    json.dump(rec, fh)
            with open(cached) as fh:
                records.setdefault(trial.name, []).append(json.load(fh))
    md = demo_table(records, eval_n)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "demo_search.json"), "w") as fh:
        json.dump({"seeds": list(seeds), "eval_n": eval_n, "records": records}, fh, indent=1)
    with open(os.path.join(out, "demo_search.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    return records


def gain_stats(recs: list[dict], curve: str) -> dict:
    """Start, end and end - start of one accuracy curve over seeds (mean, sample std, min)."""
    start = np.array([r[curve][0][1] for r in recs])
    end = np.array([r[curve][-1][1] for r in recs])
    gain = end - start

    def std(x):
        return float(x.std(ddof=1)) if len(x) > 1 else 0.0

    return {
        "start": float(start.mean()),
        "end": float(end.mean()),
        "end_std": std(end),
        "gain": float(gain.mean()),
        "gain_std": std(gain),
        "gain_min": float(gain.min()),
    }


def demo_table(records: dict[str, list[dict]], eval_n: int) -> str:
    """Markdown: per trial, greedy and avg@n at the RL start and end (mean +- std over seeds)."""
    lines = [
        f"| trial | seeds | greedy start -> end (gain, min gain) | avg@{eval_n} start -> end "
        "(gain, min gain) | RL s (CPU s) per run |",
        "|---|---|---|---|---|",
    ]
    for name, recs in records.items():
        cells = []
        for curve in ("curve", "curve_sampled"):
            g = gain_stats(recs, curve)
            cells.append(
                f"{g['start']:.3f} -> {g['end']:.3f} +- {g['end_std']:.3f} "
                f"({g['gain']:+.3f} +- {g['gain_std']:.3f}, min {g['gain_min']:+.3f})"
            )
        t = np.mean([r["time_s"] for r in recs])
        cpu = np.mean([r.get("cpu_s", float("nan")) for r in recs])
        lines.append(f"| {name} | {len(recs)} | {cells[0]} | {cells[1]} | {t:.0f} ({cpu:.0f}) |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Part 2: SmolLM2-135M-Instruct as shipped, the official regime (STUDY.md "Part 2")

SMOL = {  # dotted config fields on configs/smollm2_arith.py (sized in STUDY.md "Part 2")
    "rollout.prompts_per_step": 16,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 32,
    "data.eval_size": 200,
    "train.eval_chunk": 40,
    # On this CPU an update over 16 rows at a time runs ~2x faster than over 64 at once (the
    # same gradient: accumulation is exact); the official regime's minibatches hold 16 rows.
    "optim.micro_batches": 4,
}
SMOL_STEPS = 15  # rollouts per run: budget = 15 x 16 x 4 = 960 sampled responses
SMOL_EVAL_N = 8  # avg@8 at the rollout temperature (with greedy) at the start and the end
SMOL_EVAL_POINTS = 5  # greedy at every 1/5 of the budget
# The method comparisons the study asks about: in each regime, and each method across regimes.
SMOL_PAIRS = [
    *[(f"{a} {r}", f"{b} {r}") for r in ("4mbx1ep", "on-policy")
      for a, b in (("gvpo", "grpo"), ("gvpo", "dr_grpo"), ("grpo", "dr_grpo"))],
    *[(f"{a} 4mbx1ep", f"{a} on-policy") for a in ("gvpo", "grpo", "dr_grpo")],
    ("gvpo 4mbx1ep", "gvpo beta 0.05 4mbx1ep"), ("gvpo 4mbx1ep", "gvpo beta 0.2 4mbx1ep"),
]  # fmt: skip


def _record(rec: dict, cell: Cell, path: str) -> dict:
    """Marks the run's cell and divergence and writes it where the next invocation finds it."""
    rec["diverged"] = diverged(rec)
    rec["cell"] = cell.name
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(rec, fh)
    return rec


def smol_cells() -> list[Cell]:
    official = {k.replace(".", "__"): v for k, v in OFFICIAL.items()}
    out = []
    official["optim__micro_batches"] = 1  # a minibatch is 4 groups = 16 rows already
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(_cell("smollm2", f"{algo} 4mbx1ep", algo__name=algo, **official))
    for beta in (0.05, 0.2):
        out.append(_cell("smollm2", f"gvpo beta {beta} 4mbx1ep", algo__name="gvpo",
                         algo__beta=beta, **official))  # fmt: skip
    for algo in ("gvpo", "grpo", "dr_grpo"):
        out.append(_cell("smollm2", f"{algo} on-policy", algo__name=algo))
    return out


def smol_panels(records: dict[str, list[dict]]) -> list[tuple[str, list]]:
    """The part-2 figure's panels, one per question, each with the recorded cells it compares:
    the methods in the official regime, GVPO's beta there, the methods on-policy."""
    panels = [
        ("official regime (4 minibatches x 1 epoch)",
         [(f"{a} 4mbx1ep", f"{a} 4mbx1ep") for a in ("gvpo", "grpo", "dr_grpo")]),
        ("GVPO's beta, official regime",
         [("gvpo beta 0.05 4mbx1ep", "beta 0.05"), ("gvpo 4mbx1ep", "beta 0.1"),
          ("gvpo beta 0.2 4mbx1ep", "beta 0.2")]),
        ("on-policy (one update per rollout)",
         [(f"{a} on-policy", f"{a} on-policy") for a in ("gvpo", "grpo", "dr_grpo")]),
    ]  # fmt: skip
    out = []
    for title, cells_ in panels:
        series = [(label, records[name]) for name, label in cells_ if name in records]
        if series:
            out.append((f"SmolLM2-135M: {title}", series))
    return out


def smol_config(quick: bool):
    """configs/smollm2_arith.py with the study's sizes (quick: a tiny random Llama instead)."""
    import importlib.util

    path = os.path.join(REPO, "configs", "smollm2_arith.py")
    spec = importlib.util.spec_from_file_location("smollm2_arith", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = _quiet(config_lib.set_fields(module.get_config(), tuple(SMOL.items())))
    if quick:  # the same code path on a model the test can afford (no GGUF file needed)
        c.model.gguf = ""
        c.model.preset = "tiny"
        c.tokenizer.kind = "char"
        c.data.use_chat_template = False
        c.data.rewards = "exact_match:1"
        c.data.arith.style = "symbolic"
        c.data.max_prompt_len = 16
        c.rollout.prompts_per_step, c.rollout.max_new_tokens = 8, 4
        c.algo.overlong_cache = 2
        c.data.eval_size = 16
        c.train.eval_chunk = 8
    return c


def smol_study(args) -> dict:
    """Part 2: every cell x seed from the model as shipped, each run recorded and skipped when
    recorded; then tables (greedy and avg@8, 95% intervals) and PNGs in args.out."""
    quick = args.quick
    config = smol_config(quick)
    P, G = config.rollout.prompts_per_step, config.rollout.group_size
    steps = 2 if quick else SMOL_STEPS
    budget = steps * P * G
    eval_points = 1 if quick else SMOL_EVAL_POINTS
    eval_n = 2 if quick else SMOL_EVAL_N
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if quick else [0, 1, 2])
    only = [w for w in args.only.split(",") if w]
    todo = [c for c in smol_cells() if not only or any(w in c.name for w in only)]
    if quick and not only:
        todo = [c for c in todo if c.name in ("gvpo 4mbx1ep", "grpo on-policy")]
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    # The start (the same weights for every run) is evaluated once: greedy and avg@n use fixed
    # evaluation seeds, so every run would measure the same numbers. It and every finished run's
    # record live beside the results (committed), so a fresh checkout resumes where the last
    # session stopped; args.workdir holds only scratch (checkpoints, compilation cache).
    meta = os.path.join(args.out, "start.json")
    if os.path.exists(meta):
        with open(meta) as fh:
            start = json.load(fh)
    elif args.report_only:
        start = None
    else:
        t0 = time.perf_counter()
        run_, state = assemble.assemble(config.copy_and_resolve_references(),
                                        os.path.join(args.workdir, "start"))  # fmt: skip
        try:
            greedy, sampled = held_out_both(run_, state.params, step=0, n=eval_n)
        finally:
            run_.writer.close()
            run_.task.close()
            run_.ckpt.close()
        start = {"greedy": greedy, "sampled": sampled, "time_s": time.perf_counter() - t0}
        with open(meta, "w") as fh:
            json.dump(start, fh)

    records: dict[str, list[dict]] = {}
    runs: list[tuple[str, int, dict]] = []  # (cell, seed, record) for the per-run table
    for cell in todo:
        key = config_key(cell, config)
        recs = []
        for seed in seeds:
            tag = f"{zlib.crc32((key + str(budget)).encode()):08x}_s{seed}"
            cached = os.path.join(args.out, "records", f"{tag}.json")
            if os.path.exists(cached):
                with open(cached) as fh:
                    recs.append(json.load(fh))
                runs.append((cell.name, seed, recs[-1]))
                continue
            if args.report_only:
                continue
            wd = os.path.join(args.workdir, "runs", tag)
            shutil.rmtree(wd, ignore_errors=True)
            print(f"== smollm2 / {cell.name} / seed {seed}", flush=True)
            rec = rl_run(with_overrides(config, cell.overrides, seed), wd, None, budget=budget,
                         eval_points=eval_points, start_acc=start["greedy"], eval_n=eval_n,
                         sampled_at_ends_only=True, start_sampled=start["sampled"])  # fmt: skip
            recs.append(_record(rec, cell, cached))
            runs.append((cell.name, seed, rec))
            shutil.rmtree(wd, ignore_errors=True)  # metrics are in the record
            print(f"   greedy {rec['curve'][-1][1]:.3f}  avg@{eval_n} "
                  f"{rec['curve_sampled'][-1][1]:.3f}  kl {rec['kl_start']:.4f}  "
                  f"{rec['time_s']:.0f}s", flush=True)  # fmt: skip
        if recs:
            records[cell.name] = recs
    if start is None or not records:
        print("nothing recorded yet")
        return {}
    cells_done = [c for c in todo if c.name in records]
    rows = [(c.name, cell_summary(records[c.name], budget)) for c in cells_done]
    md = [
        f"# Learning study part 2: SmolLM2-135M-Instruct "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Budget {budget} sampled responses per run ({steps} rollouts of P={P} x G={G}, up to "
        f"{config.rollout.max_new_tokens} new tokens); {config.data.eval_size} held-out "
        f"problems; start: greedy {start['greedy']:.3f}, avg@{eval_n} "
        f"{start['sampled']:.3f}. RL compute summed over runs: "
        f"{sum(r['time_s'] for v in records.values() for r in v) / 3600:.2f} h wall, "
        f"{sum(r.get('cpu_s', 0.0) for v in records.values() for r in v) / 3600:.2f} h of CPU "
        "(s/run below is wall time: it includes other jobs on the cores and any pause; CPU s "
        "is the run's own).",
        "",
        "Greedy (every 1/5 of the budget; AUC from these):",
        "",
        table(rows, start["greedy"], "the instruction model as shipped"),
        "",
        f"avg@{eval_n} at temperature {config.rollout.temperature:g} (start and end):",
        "",
        sampled_table([(c.name, records[c.name]) for c in cells_done]),
        "",
        "Differences of final accuracy (first - second cell): the 95% Welch interval over seeds "
        f"(does the difference hold on these {config.data.eval_size} problems?) and the 95% "
        "interval the finite problem set adds (binomial, the two cells taken as independent: an "
        "over-estimate, since both are scored on the same problems). 'resolved' = beyond both "
        "combined; 'resolved on these problems' = beyond the seeds' interval only.",
        "",
        *diff_lines(
            records,
            [
                "gvpo 4mbx1ep",
                "grpo 4mbx1ep",
                "dr_grpo 4mbx1ep",
                "gvpo beta 0.05 4mbx1ep",
                "gvpo beta 0.2 4mbx1ep",
                "gvpo on-policy",
                "grpo on-policy",
                "dr_grpo on-policy",
            ],
            problems=config.data.eval_size,
        ),  # fmt: skip
        "",
        "What would resolve the unresolved greedy differences between methods, if they are real "
        "(`data_to_resolve`: seeds per cell at the observed seed spread and held-out problems at "
        "the observed accuracies, the two sharing the interval equally):",
        "",
        *needs_lines(records, SMOL_PAIRS, config.data.eval_size),
        "",
        f"Every run: greedy accuracy at each 1/{eval_points} of the budget, avg@{eval_n} at the "
        "start and the end, KL to the start, and the run's CPU time:",
        "",
        runs_table(runs),
        "",
        "![smollm2](smollm2.png)",
    ]
    plot_panels(smol_panels(records), os.path.join(args.out, "smollm2.png"))
    summary = {
        "budget_responses": budget,
        "start": start,
        "seeds": seeds,
        "settings": {**SMOL, "steps": steps, "eval_n": eval_n, "eval_points": eval_points},
        "cells": {c.name: {**dict(rows)[c.name], "records": records[c.name]} for c in cells_done},
        "wall_time_s": time.perf_counter() - t_start,
    }
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    return summary


def runs_table(runs: list[tuple[str, int, dict]]) -> str:
    """Markdown, a row per (cell, seed, record): the greedy curve's points, avg@n at the start
    and the end, KL to the start and CPU minutes."""
    lines = [
        "| cell | seed | greedy along the budget | avg@n start -> end | KL to start | CPU min |",
        "|---|---|---|---|---|---|",
    ]
    for name, seed, r in runs:
        greedy = " ".join(f"{a:.3f}" for _, a in r["curve"])
        sampled = r.get("curve_sampled") or [(0, np.nan)]
        lines.append(
            f"| {name} | {seed} | {greedy} | {_fmt(sampled[0][1], '.3f')} -> "
            f"{_fmt(sampled[-1][1], '.3f')} | {r['kl_start']:.3f} | "
            f"{_fmt(r.get('cpu_s', np.nan) / 60, '.0f')} |"
        )
    return "\n".join(lines)


def sampled_table(series: list[tuple[str, list[dict]]]) -> str:
    """Final avg@n per cell: mean +- std, 95% interval, min / max, and the gain over the start."""
    lines = ["| cell | final avg@n (mean +- std) | 95% CI | min / max | gain over start |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, recs in series:
        end = np.array([r["curve_sampled"][-1][1] for r in recs])
        gain = end - np.array([r["curve_sampled"][0][1] for r in recs])
        std = end.std(ddof=1) if len(end) > 1 else 0.0
        lines.append(f"| {name} | {end.mean():.3f} +- {std:.3f} | +- {_fmt(ci95(end), '.3f')} | "
                     f"{end.min():.3f} / {end.max():.3f} | {gain.mean():+.3f} |")  # fmt: skip
    return "\n".join(lines)


def diff_lines(
    records: dict[str, list[dict]], names: list[str], problems: int | None = None
) -> list[str]:
    """Pairwise final-accuracy differences (greedy and avg@n when recorded) with 95% intervals;
    'resolved' when the interval excludes 0.

    The seeds' interval (Welch) says whether the difference holds on the evaluated problems.
    With `problems` (the held-out set's size) each line also gives the interval the finite
    problem set adds (`problems_ci95`), and a difference counts as resolved only when it
    exceeds both combined (their root sum of squares); one that only the seeds resolve is
    'resolved on these problems'.
    """
    names = [n for n in names if n in records and len(records[n]) > 1]
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            parts = []
            for curve, label in (("curve", "greedy"), ("curve_sampled", "avg@n")):
                xa = [r[curve][-1][1] for r in records[a] if r.get(curve)]
                xb = [r[curve][-1][1] for r in records[b] if r.get(curve)]
                if len(xa) < 2 or len(xb) < 2:
                    continue
                d, h = diff_ci95(xa, xb)
                if problems is None:
                    verdict = "resolved" if abs(d) > h else "not resolved"
                    parts.append(f"{label} {d:+.3f} +- {h:.3f} ({verdict})")
                    continue
                hp = problems_ci95(float(np.mean(xa)), float(np.mean(xb)), problems)
                if abs(d) > np.hypot(h, hp):
                    verdict = "resolved"
                elif abs(d) > h:
                    verdict = "resolved on these problems"
                else:
                    verdict = "not resolved"
                parts.append(f"{label} {d:+.3f} +- {h:.3f} seeds, +- {hp:.3f} problems ({verdict})")
            if parts:
                out.append(f"- {a} - {b}: " + "; ".join(parts))
    return out


# ----------------------------------------------------------------------------------------------
# The study


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run (one seed, few cells)")
    p.add_argument("--out", default=STUDY_DIR, help="results.json, results.md and PNGs")
    p.add_argument("--workdir", default="runs/study", help="checkpoints and per-run metrics")
    p.add_argument("--only", default="", help="comma-separated experiments (default: all)")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--budget", type=int, default=0, help="sampled responses per run")
    p.add_argument("--eval-points", type=int, default=0, help="evaluations along the budget")
    p.add_argument(
        "--jax-cache",
        default="",
        help="compile cache (default $JAX_COMPILATION_CACHE_DIR, else <workdir>/jax_cache)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="tables and plots from the runs already recorded; runs nothing",
    )
    p.add_argument("--demo", action="store_true",
                   help="the demo recipe search (DEMO_TRIALS) instead of the study")  # fmt: skip
    p.add_argument("--eval-n", type=int, default=16, help="--demo: samples for avg@n")
    p.add_argument("--smollm2", action="store_true",
                   help="part 2: SmolLM2-135M-Instruct cells (out docs/study/smollm2, workdir "
                   "runs/study_smollm2 unless given)")  # fmt: skip
    args = p.parse_args(argv)
    if args.smollm2:
        if args.out == STUDY_DIR:
            args.out = os.path.join(STUDY_DIR, "smollm2")
        if args.workdir == "runs/study":
            args.workdir = "runs/study_smollm2"
        cache = (args.jax_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or os.path.join(args.workdir, "jax_cache"))  # fmt: skip
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        return smol_study(args)

    quick = args.quick
    if args.demo:
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [0, 1, 2]
        only = [w for w in args.only.split(",") if w]
        trials = [t for t in DEMO_TRIALS if not only or any(w in t.name for w in only)]
        return demo_search(trials, seeds, workdir=args.workdir, out=args.out,
                           eval_n=args.eval_n)  # fmt: skip
    config = study_config(quick)
    P, G = config.rollout.prompts_per_step, config.rollout.group_size
    budget = args.budget or (2 * P * G if quick else 30 * P * G)
    eval_points = args.eval_points or (1 if quick else 6)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if quick else [0, 1, 2])
    only = set(filter(None, args.only.split(",")))
    todo = [c for c in cells(config.optim.lr) if not only or c.exp in only]
    if quick and not only:  # one cell per experiment kind that exercises a distinct code path
        keep = {"grpo 4mbx2ep", "gvpo replay 0.5", "gvpo anchor ref", "gvpo from noisy SFT",
                "dr_grpo eps 1e3 4mbx2ep"}  # fmt: skip
        todo = [c for c in todo if c.name in keep]
    os.makedirs(args.out, exist_ok=True)
    # Every run re-traces the same functions; the persistent cache skips their XLA compiles.
    cache = (args.jax_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
             or os.path.join(args.workdir, "jax_cache"))  # fmt: skip
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    t_start = time.perf_counter()

    results_path = os.path.join(args.out, "results.json")
    starts = {}
    sft_points = 2 if quick else 10

    def get_start(kind: str) -> dict:
        """The cold start of this kind: made once (SFT), then reused by every invocation."""
        if kind in starts:
            return starts[kind]
        wd = os.path.join(args.workdir, f"start_{kind}")
        meta = os.path.join(wd, "start.json")
        if os.path.exists(meta):
            with open(meta) as fh:
                starts[kind] = json.load(fh)
            return starts[kind]
        # The noisy start trains longer (to its plateau), then shows it: more SFT at lr / 10.
        noise = NOISE_FRAC if kind == "noisy" else 0.0
        steps = int(NOISY_SFT_MULT * config.sft.steps) if kind == "noisy" else config.sft.steps
        extra = steps // 3 if kind == "noisy" else 0
        info = sft(config, wd, noise=noise, steps=steps, eval_points=sft_points, extra=extra)
        info["dir"] = wd
        with open(meta, "w") as fh:
            json.dump(info, fh)
        starts[kind] = info
        return info

    records: dict[str, list[dict]] = {}
    done = {}
    for cell in todo:
        key = config_key(cell, config)
        if key in done:
            records[cell.name] = done[key]
            continue
        recs = []
        for seed in seeds:
            cfg = with_overrides(config, cell.overrides, seed)
            tag = f"{zlib.crc32((key + str(budget)).encode()):08x}_s{seed}"
            cached = os.path.join(args.workdir, "records", f"{tag}.json")
            if os.path.exists(cached):  # an interrupted study resumes at the first missing run
                with open(cached) as fh:
                    recs.append(json.load(fh))
                continue
            if args.report_only:
                continue
            start = get_start(cell.start)
            wd = os.path.join(args.workdir, "runs", tag)
            if os.path.exists(wd):
                shutil.rmtree(wd)
            print(f"== {cell.exp} / {cell.name} / seed {seed}", flush=True)
            rec = rl_run(
                cfg,
                wd,
                start["dir"],
                budget=budget,
                eval_points=eval_points,
                start_acc=start["curve"][-1][1],
            )
            recs.append(_record(rec, cell, cached))
            print(
                f"   final {rec['curve'][-1][1]:.3f}  kl {rec['kl_start']:.4f}  "
                f"{rec['time_s']:.0f}s",
                flush=True,
            )
        done[key] = recs
        if recs:
            records[cell.name] = recs

    summary = {
        "command": "python -m benchmarks.learning_study " + " ".join(argv or []),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}",
        "budget_responses": budget,
        "prompts_per_step": P,
        "group_size": G,
        "seeds": seeds,
        "starts": {
            k: {"curve": v["curve"], "extra_curve": v["extra_curve"]} for k, v in starts.items()
        },
        "cells": {},
        "wall_time_s": time.perf_counter() - t_start,
        # Compute actually spent on RL runs (also right for --report-only and resumed studies).
        "rl_run_time_s": sum(
            r["time_s"] for recs in {id(v): v for v in records.values()}.values() for r in recs
        ),
    }
    md = [
        f"# Learning study results ({summary['date']})",
        "",
        f"Budget: {budget} sampled responses per run (P={P}, G={G}); seeds {seeds}; "
        f"machine: {summary['machine']}; RL run time summed over runs "
        f"{summary['rl_run_time_s'] / 60:.1f} min; this invocation "
        f"{summary['wall_time_s'] / 60:.1f} min.",
        "",
    ]
    todo = [c for c in todo if c.name in records]  # --report-only: what has run so far
    for exp in dict.fromkeys(c.exp for c in todo):
        exp_cells = [c for c in todo if c.exp == exp]
        start_acc = get_start(exp_cells[0].start)["curve"][-1][1]
        rows = [(c.name, cell_summary(records[c.name], budget)) for c in exp_cells]
        for (name, s), c in zip(rows, exp_cells, strict=True):
            summary["cells"][name] = {
                "exp": exp,
                **s,
                "curves": [r["curve"] for r in records[c.name]],
            }
        md += [f"## {exp}", "", table(rows, start_acc), "", f"![{exp}]({exp}.png)", ""]
        extra = None
        if exp == "noisy":
            extra = [
                ("clean SFT", starts["clean"]["curve"]),
                ("noisy SFT (30% wrong)", starts["noisy"]["curve"]),
                ("noisy SFT, continued", starts["noisy"]["extra_curve"]),
            ]
            md += [
                "SFT held-out accuracy (step, acc): clean "
                + ", ".join(f"({s}, {a:.3f})" for s, a in starts["clean"]["curve"])
                + "; noisy "
                + ", ".join(f"({s}, {a:.3f})" for s, a in starts["noisy"]["curve"])
                + "; noisy continued "
                + ", ".join(f"({s}, {a:.3f})" for s, a in starts["noisy"]["extra_curve"]),
                "",
            ]
        plot(
            exp,
            [(c.name, records[c.name]) for c in exp_cells],
            os.path.join(args.out, f"{exp}.png"),
            extra=extra,
        )
    with open(results_path, "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()
