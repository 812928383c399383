"""The trainer: `run(config, workdir)` assembles a run, resumes or cold-starts (`resume`), then
does the mode's work: cold-start SFT, the RL loop over `rl_step.rl_step`, evaluation
(`eval.evaluate_held_out`, `eval.evaluate_sets`), export (`export.export`).

`rl_loop` is the one RL loop: the CLI's run (`train_rl`), the learning studies and the
benchmarks drive their steps through it; `run(config, workdir, on_step=...)` hands its `on_step`
hook (record, evaluate or stop after each RL step) to scripts that run a whole mode.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time
import zlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gvpo_jax import (
    assemble,
    checkpoint,
    export,
    metrics,
    models,
    programs,
    resume,
    sharding,
    train_step,
)
from gvpo_jax import batch as batch_lib
from gvpo_jax import config as config_lib
from gvpo_jax import eval as eval_lib
from gvpo_jax import rl_step as rl_step_lib
from gvpo_jax.rl_step import LoopState, TrainingError, rl_step
from gvpo_jax.rollout import next_examples

__all__ = ["TrainingError", "rl_loop", "run"]


def run(config: ml_collections.ConfigDict, workdir: str, on_step=None) -> dict:
    """Runs the configured mode in `workdir`; returns the final summary metrics.

    `on_step(step, state, metrics) -> bool`, when given, runs after each RL step (`rl_loop`'s
    hook: it may add entries to `metrics`); True ends the RL phase there, without a checkpoint
    of that step, and the run ends as after its last step (held-out evaluation, export, summary).
    """
    run_, state = assemble.assemble(config, workdir)
    # Handed over in a list that _run_mode empties: once a checkpoint's state replaces the
    # initial one, nothing here keeps the initial parameters (and moments) alive.
    handover = [state]
    del state
    try:
        return _run_mode(run_, handover, assemble.start_loop(run_), on_step)
    finally:
        run_.writer.close()
        run_.task.close()
        run_.ckpt.close()


def _run_mode(run_: assemble.Run, handover: list, loop: LoopState, on_step=None) -> dict:
    c = run_.config
    state, ref, resumed = resume.restore(run_, handover.pop(), loop)
    summary: dict = {}
    if c.mode == "eval":
        # Sampling casts every weight to the compute dtype anyway: cast once and drop the
        # masters, so an evaluation holds the policy at compute-dtype size (half, in bf16).
        params = models.cast_floating(state.params, c.model.compute_dtype)
        del state
        if c.eval.sets:
            policy = eval_lib.describe_policy(c, resumed, loop.step)
            return eval_lib.evaluate_sets(run_, params, policy=policy)
        return eval_lib.evaluate_held_out(run_, params, step=loop.step, tag="eval")
    if c.mode == "export":
        return export.export(run_, state.params)
    if c.sft.steps and not resumed:
        _record_eval(summary, "eval_before_sft", run_, state.params, step=0)
        state = run_sft(run_, state, loop, steps=c.sft.steps)
        state = fresh_moments(run_, state)
    if run_.reference.kind == "copy" and not resumed:
        ref = resume.reference_copy(run_, state.params)
    if c.mode == "sft":
        _record_eval(summary, "eval_after_sft", run_, state.params, step=0)
        resume.save(run_, state, loop, ref)
        finish(run_, state.params, summary)
        return summary
    return train_rl(run_, state, loop, ref, summary, on_step)


def train_rl(run_: assemble.Run, state, loop: LoopState, ref, summary: dict, on_step=None) -> dict:
    """RL from `loop.step` to train.steps (or where `on_step` stops it) between two held-out
    evaluations, then the run's end (export, curves, summary)."""
    c = run_.config
    ahead = compile_ahead(run_, state)  # while the first evaluation and rollout run
    _record_eval(summary, "eval_start", run_, state.params, step=loop.step)
    state, preempted = rl_loop(run_, state, loop, ref, on_step=on_step, ahead=ahead)
    if preempted:
        summary["preempted_at"] = loop.step
        return summary
    check_trained(run_, state, "RL", c.train.steps)
    _record_eval(summary, "eval_end", run_, state.params, step=loop.step)
    finish(run_, state.params, summary)
    if sharding.is_primary():
        with open(os.path.join(run_.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


def compile_ahead(run_: assemble.Run, state) -> programs.Ahead | None:
    """The RL update's and log-prob passes' programs, every width, compiling in background
    threads (`programs.Ahead`, `Updater.compile_ahead`) when `train.compile_ahead` is on;
    None when off."""
    c, s = run_.config, run_.settings
    if not config_lib.compile_ahead(c):
        return None
    ahead = programs.Ahead()
    rows = s.prompts_per_step * s.group_size // run_.updater.chunks  # one micro-batch's
    example = rl_step_lib.example_batch(s, rows, c.rollout.max_new_tokens)
    run_.updater.compile_ahead(ahead, state, example, rl_step_lib.logprob_passes(s))
    return ahead


def rl_loop(run_: assemble.Run, state, loop: LoopState, ref, *, on_step=None, ahead=None):
    """RL steps loop.step + 1 .. train.steps, with logging, sample logs, periodic evaluation,
    checkpoints and preemption (SIGTERM: save and stop). `loop` is advanced in place.

    `on_step(step, state, metrics) -> bool`, when given, runs after each step before its
    metrics are written (it may add entries to `metrics`); True ends the loop there without a
    checkpoint (e.g. the learning study's response budget). `ahead`: the programs compiling
    ahead (`compile_ahead`, which the loop starts itself when not given). Every step's metrics
    count the programs it met for the first time (`programs.Counter`). Returns (state,
    preempted).
    """
    if ahead is None:
        ahead = compile_ahead(run_, state)
    try:
        with programs.Counter() as counter:
            return _rl_steps(run_, state, loop, ref, on_step, counter, ahead)
    finally:
        if ahead is not None:
            run_.updater.end_compile_ahead()


def _rl_steps(run_: assemble.Run, state, loop: LoopState, ref, on_step, counter, ahead):
    c = run_.config
    guard = checkpoint.PreemptionGuard()
    bar = metrics.Progress(c.train.steps, loop.step, c.train.log_every)
    with guard:
        for step in range(loop.step + 1, c.train.steps + 1):
            counter.take()  # from the step's start
            try:
                state, m, completions, examples = rl_step(run_, state, loop, ref)
            except TrainingError as e:  # log the step that stopped the run, then stop
                if e.metrics is not None:
                    run_.writer.write_scalars(step, e.metrics)
                    run_.writer.flush()
                bar.close()
                raise TrainingError(f"step {step}: {e}", e.metrics) from e
            trim_host_memory()  # before the step's figures: what it still holds
            m.update(counter.take())
            if ahead is not None:
                m["programs_compiled_ahead"] = float(ahead.compiled)
                m["programs_reached_first"] = float(ahead.reached_first)
            loop.step = step
            done = bool(on_step(step, state, m)) if on_step is not None else False
            if step % c.train.log_every == 0:
                run_.writer.write_scalars(step, m)
            bar.update(step, m)
            if done:
                break
            if c.train.sample_log_every and step % c.train.sample_log_every == 0:
                texts = metrics.sample_texts(examples, completions, run_.settings.group_size)
                run_.writer.write_texts(step, texts)
            if c.train.eval_every and step % c.train.eval_every == 0 and step < c.train.steps:
                eval_lib.evaluate_held_out(run_, state.params, step=step)
            last = step == c.train.steps
            stop = guard.should_stop()  # a collective in multi-process runs: every process calls
            if last or stop or run_.ckpt.should_save(step):
                resume.save(run_, state, loop, ref)
            if stop and not last:
                run_.ckpt.wait()
                bar.close()
                if sharding.is_primary():
                    print(f"Preempted: saved step {step} in {run_.workdir}; exiting.", flush=True)
                return state, True
    bar.close()
    return state, False


def trim_host_memory() -> None:
    """Hands back to the system the memory glibc's malloc keeps after frees (the step's host
    batches, XLA CPU's temporaries below its mmap threshold): `malloc_trim(0)`, a few ms. A
    long run's resident memory otherwise creeps by what the allocator keeps (BENCHMARKS.md
    section 19). Nothing on other C libraries."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def check_trained(run_: assemble.Run, state, phase: str, steps: int) -> None:
    """TrainingError when every update of a phase of `steps` steps was non-finite and skipped
    (`state.updates` counts the applied ones): the policy never moved, and exporting it as if it
    had trained would hide that. The checkpoints saved before stay."""
    if steps and int(state.updates) == 0:
        raise TrainingError(
            f"every {phase} update of the run ({steps} steps) was non-finite and skipped, so the "
            f"policy never changed and nothing was exported (the checkpoints in {run_.workdir} "
            "are intact); see skipped_updates and loss in metrics.jsonl, and lower the learning "
            "rate or fix the reward or setting that makes the loss NaN or inf."
        )


def fresh_moments(run_: assemble.Run, state: train_step.TrainState) -> train_step.TrainState:
    """The RL optimizer's state from zero for `state`'s parameters (after an SFT phase)."""
    return train_step.init_state_sharded(state.params, run_.tx, state.rng, run_.mesh, run_.rules)[0]


def frozen_copy(params):
    """A copy of the parameters in the same shards and dtype (e.g. the start of an SFT phase)."""
    return jax.tree.map(jnp.copy, params)


# ----------------------------------------------------------------------------------------------
# Cold-start SFT


def calls_tool(example, share: float) -> bool:
    """Whether an SFT demonstration of `example` calls the tool (sft.tool_demos): a fixed
    pseudo-random choice per problem (crc32 of its id), the same in every run and batch."""
    return zlib.crc32(str(example["id"]).encode()) % 10_000 < share * 10_000


def sft_batch(run_: assemble.Run, examples) -> dict[str, np.ndarray]:
    """Prompt + answer rows in the update layout (groups of one), the answer tokens masked in;
    with sft.tool_demos, some demonstrations call the calculator first (`formats.demonstration`:
    the call and the answer counted, the tool's observation seen but not counted)."""
    c, settings = run_.config, run_.sampling
    n = c.rollout.max_new_tokens
    toks, mask = batch_lib.encode_answers(
        run_.tokenizer,
        [ex.get("solution") or ex["answer"] for ex in examples],
        max_new_tokens=n,
        eos_id=settings.eos_ids[0],
        pad_id=settings.pad_id,
    )
    valid = mask.copy()
    if run_.tools is not None and c.sft.tool_demos:
        from gvpo_jax.tools import formats

        for b, ex in enumerate(examples):
            if not calls_tool(ex, c.sft.tool_demos):
                continue
            ids, policy = formats.demonstration(
                run_.tools.format,
                {"expression": ex["expression"]},
                "calculator",
                ex.get("solution") or ex["answer"],
                settings.eos_ids[0],
                n,
            )
            toks[b], mask[b], valid[b] = settings.pad_id, 0.0, 0.0
            toks[b, : len(ids)], mask[b, : len(ids)], valid[b, : len(ids)] = ids, policy, 1.0
    return batch_lib.layout_batch(
        [ex["prompt_ids"] for ex in examples],
        toks,
        mask,
        group_size=1,
        prompt_len=c.data.max_prompt_len,
        pad_id=settings.pad_id,
        valid_BxN=valid,
    )


def sft_updater(
    run_: assemble.Run, state, *, steps: int, lr: float, warmup_steps: int, schedule: str = "cosine"
):
    """(sft_state, update) for `steps` cross-entropy updates from `state`'s params and rng.

    `update(sft_state, batch) -> (sft_state, metrics)` is the jitted step (state donated); the
    params and rng are copied so `state` stays valid for the caller.
    """
    c = run_.config
    tx, lr_fn = train_step.make_optimizer(
        lr=lr,
        total_updates=steps,
        warmup_steps=warmup_steps,
        schedule=schedule,
        grad_clip=c.optim.grad_clip,
    )
    loss_fn = functools.partial(
        train_step.sft_loss,
        graphdef=run_.graphdef,
        prompt_len=c.data.max_prompt_len,
        chunk_size=c.model.logprob_chunk,
    )
    sft_state, _ = train_step.init_state_sharded(
        frozen_copy(state.params), tx, jnp.copy(state.rng), run_.mesh, run_.rules
    )
    update = train_step.jit_update(
        loss_fn,
        tx,
        1,
        lr_fn,
        mesh=run_.mesh,
        state_shardings=run_.state_shardings,
        rules=run_.rules,
    )
    return sft_state, update


def run_sft(
    run_: assemble.Run,
    state,
    loop: LoopState,
    *,
    steps: int,
    lr: float | None = None,
    warmup_steps: int | None = None,
    schedule: str = "cosine",
    log_prefix: str = "sft",
    on_step=None,
):
    """Cross-entropy on prompt + answer pairs with the response mask, on the training stream at
    `loop.data` (advanced). lr / warmup_steps default to config.sft's. `on_step(i, params)`, when
    given, runs after update i (1-based; the learning study evaluates there). Returns `state`
    with the new params."""
    c = run_.config
    sft_state, update = sft_updater(
        run_,
        state,
        steps=steps,
        lr=c.sft.lr if lr is None else lr,
        warmup_steps=c.sft.warmup_steps if warmup_steps is None else warmup_steps,
        schedule=schedule,
    )
    t0 = time.perf_counter()
    for i in range(steps):
        examples = next_examples(run_.task, run_.mesh, loop, c.sft.batch_size)
        batch = sharding.device_batch(
            sft_batch(run_, examples), run_.mesh, group_size=1, local=True
        )
        sft_state, m = update(sft_state, batch)
        if (i + 1) % max(steps // 10, 1) == 0 or i + 1 == steps:
            m = jax.device_get(m)
            run_.writer.write_scalars(
                i + 1,
                {f"{log_prefix}/{k}": float(v) for k, v in m.items()}
                | {f"{log_prefix}/time_s": time.perf_counter() - t0},
            )
            if sharding.is_primary():
                print(f"[sft] step {i + 1}/{steps}  nll {float(m['nll']):.4f}", flush=True)
        if on_step is not None:
            on_step(i + 1, sft_state.params)
    check_trained(run_, sft_state, "SFT", steps)
    return state.replace(params=sft_state.params)


# ----------------------------------------------------------------------------------------------
# The end of a run.


def _record_eval(summary: dict, key: str, run_: assemble.Run, params, *, step: int) -> None:
    """summary[key] = held-out accuracy (avg@n when eval_samples > 1), key_greedy = greedy."""
    result = eval_lib.evaluate_held_out(run_, params, step=step, tag=key)
    summary[key] = result["accuracy"]
    if run_.config.train.eval_samples > 1:
        summary[f"{key}_greedy"] = result["greedy"]


def finish(run_: assemble.Run, params, summary: dict) -> None:
    """End of a run: export, the curves PNG and the summary table."""
    c = run_.config
    if c.train.export:
        summary.update(export.export(run_, params))
    run_.writer.flush()
    if not sharding.is_primary():  # metrics, plots and tables are process 0's
        return
    rows = metrics.read_jsonl(os.path.join(run_.workdir, "metrics.jsonl"))
    if c.train.plot:
        png = os.path.join(run_.workdir, "curves.png")
        metrics.plot_curves(
            rows,
            png,
            keys=("reward_mean", *eval_keys(c), "response_len_mean", "kl_ref"),
            title=f"{run_.algorithm.name} on {c.data.task}",
        )
        summary["plot"] = png
    print(metrics.summary_table(rows, ("reward_mean", "accuracy", *eval_keys(c), "loss")))
    for k, v in summary.items():
        print(f"{k}: {v}")


def eval_keys(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The evaluation metrics a run logs: avg@n at the rollout temperature (n > 1) and greedy."""
    n = c.train.eval_samples
    return (f"eval/avg@{n}", "eval/greedy") if n > 1 else ("eval/greedy",)
