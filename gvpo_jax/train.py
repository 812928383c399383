"""The trainer: `run(config, workdir)` assembles a run, resumes or cold-starts, then does the mode's
work: cold-start SFT, the RL loop over `rl_step.rl_step`, evaluation, export.

Resume order: `config.restore_from` > the latest checkpoint in the workdir > a fresh start. A
checkpoint holds the train state, the frozen reference (when the run keeps one) and the loop
state (`rl_step.LoopState`: step, data position, shuffle stream, replay buffer), so a resumed
run continues bit for bit. A LoRA run's checkpoint holds the adapters and their optimizer state,
not the frozen base: the run reloads that from its source and checks it against the
checkpoint's fingerprint of it (`models.lora.fingerprint`).

`rl_loop` is the one RL loop: the CLI's run (`train_rl`), the learning studies and the
benchmarks drive their steps through it; `run(config, workdir, on_step=...)` hands its `on_step`
hook (record, evaluate or stop after each RL step) to scripts that run a whole mode.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from gvpo_jax import assemble, checkpoint, metrics, models, rollout, sharding, train_step
from gvpo_jax import eval as eval_lib
from gvpo_jax.models import lora
from gvpo_jax.rl_step import LoopState, TrainingError, next_examples, rl_step

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
    state, ref, resumed = restore(run_, handover.pop(), loop)
    summary: dict = {}
    if c.mode == "eval":
        # Sampling casts every weight to the compute dtype anyway: cast once and drop the
        # masters, so an evaluation holds the policy at compute-dtype size (half, in bf16).
        params = models.cast_floating(state.params, c.model.compute_dtype)
        del state
        if c.eval.sets:
            return evaluate_sets(run_, params, policy=describe_policy(c, resumed, loop.step))
        return evaluate(run_, params, step=loop.step, tag="eval")
    if c.mode == "export":
        return export(run_, state.params)
    if c.sft.steps and not resumed:
        _record_eval(summary, "eval_before_sft", run_, state.params, step=0)
        state = run_sft(run_, state, loop, steps=c.sft.steps)
        state = fresh_moments(run_, state)
    if run_.reference.kind == "copy" and not resumed:
        ref = reference_copy(run_, state.params)
    if c.mode == "sft":
        _record_eval(summary, "eval_after_sft", run_, state.params, step=0)
        save(run_, state, loop, ref)
        finish(run_, state.params, summary)
        return summary
    return train_rl(run_, state, loop, ref, summary, on_step)


def train_rl(run_: assemble.Run, state, loop: LoopState, ref, summary: dict, on_step=None) -> dict:
    """RL from `loop.step` to train.steps (or where `on_step` stops it) between two held-out
    evaluations, then the run's end (export, curves, summary)."""
    c = run_.config
    _record_eval(summary, "eval_start", run_, state.params, step=loop.step)
    state, preempted = rl_loop(run_, state, loop, ref, on_step=on_step)
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


def rl_loop(run_: assemble.Run, state, loop: LoopState, ref, *, on_step=None):
    """RL steps loop.step + 1 .. train.steps, with logging, sample logs, periodic evaluation,
    checkpoints and preemption (SIGTERM: save and stop). `loop` is advanced in place.

    `on_step(step, state, metrics) -> bool`, when given, runs after each step before its
    metrics are written (it may add entries to `metrics`); True ends the loop there without a
    checkpoint (e.g. the learning study's response budget). Returns (state, preempted).
    """
    c = run_.config
    guard = checkpoint.PreemptionGuard()
    bar = metrics.Progress(c.train.steps, loop.step, c.train.log_every)
    with guard:
        for step in range(loop.step + 1, c.train.steps + 1):
            try:
                state, m, completions, examples = rl_step(run_, state, loop, ref)
            except TrainingError as e:  # log the step that stopped the run, then stop
                if e.metrics is not None:
                    run_.writer.write_scalars(step, e.metrics)
                    run_.writer.flush()
                bar.close()
                raise TrainingError(f"step {step}: {e}", e.metrics) from e
            loop.step = step
            done = bool(on_step(step, state, m)) if on_step is not None else False
            if step % c.train.log_every == 0:
                run_.writer.write_scalars(step, m)
            bar.update(step, m)
            if done:
                break
            if c.train.sample_log_every and step % c.train.sample_log_every == 0:
                texts = metrics.sample_texts(examples, completions, run_.step.group_size)
                run_.writer.write_texts(step, texts)
            if c.train.eval_every and step % c.train.eval_every == 0 and step < c.train.steps:
                evaluate(run_, state.params, step=step)
            last = step == c.train.steps
            stop = guard.should_stop()  # a collective in multi-process runs: every process calls
            if last or stop or run_.ckpt.should_save(step):
                save(run_, state, loop, ref)
            if stop and not last:
                run_.ckpt.wait()
                bar.close()
                if sharding.is_primary():
                    print(f"Preempted: saved step {step} in {run_.workdir}; exiting.", flush=True)
                return state, True
    bar.close()
    return state, False


def check_trained(run_: assemble.Run, state, phase: str, steps: int) -> None:
    """TrainingError when every update of a phase of `steps` steps was non-finite and skipped
    (`state.step` counts the applied ones): the policy never moved, and exporting it as if it
    had trained would hide that. The checkpoints saved before stay."""
    if steps and int(state.step) == 0:
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


def reference_copy(run_: assemble.Run, params):
    """The frozen reference / anchor "ref": a copy of the policy in the compute dtype.

    It is never updated and only enters forward passes, which cast every weight to the compute
    dtype anyway: storing it cast gives bit-identical log-probs at half the memory in bf16.
    """
    dtype = jnp.dtype(run_.config.model.compute_dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else jnp.copy(x), params)


# ----------------------------------------------------------------------------------------------
# Cold-start SFT


def sft_batch(run_: assemble.Run, examples) -> dict[str, np.ndarray]:
    """Prompt + answer rows in the update layout (groups of one), the answer tokens masked in."""
    c, settings = run_.config, run_.sampling
    toks, mask = rollout.encode_answers(
        run_.tokenizer,
        [ex.get("solution") or ex["answer"] for ex in examples],
        max_new_tokens=c.rollout.max_new_tokens,
        eos_id=settings.eos_ids[0],
        pad_id=settings.pad_id,
    )
    return rollout.layout_batch(
        [ex["prompt_ids"] for ex in examples], toks, mask, group_size=1,
        prompt_len=c.data.max_prompt_len, pad_id=settings.pad_id,
    )  # fmt: skip


def sft_updater(run_: assemble.Run, state, *, steps: int, lr: float, warmup_steps: int,
                schedule: str = "cosine"):  # fmt: skip
    """(sft_state, update) for `steps` cross-entropy updates from `state`'s params and rng.

    `update(sft_state, batch) -> (sft_state, metrics)` is the jitted step (state donated); the
    params and rng are copied so `state` stays valid for the caller.
    """
    c = run_.config
    tx, lr_fn = train_step.make_optimizer(
        lr=lr, total_updates=steps, warmup_steps=warmup_steps, schedule=schedule,
        grad_clip=c.optim.grad_clip,
    )  # fmt: skip
    loss_fn = functools.partial(
        train_step.sft_loss, graphdef=run_.graphdef, prompt_len=c.data.max_prompt_len,
        chunk_size=c.model.logprob_chunk,
    )  # fmt: skip
    sft_state, _ = train_step.init_state_sharded(
        frozen_copy(state.params), tx, jnp.copy(state.rng), run_.mesh, run_.rules
    )
    update = train_step.jit_update(
        loss_fn, tx, 1, lr_fn, mesh=run_.mesh, state_shardings=run_.state_shardings,
        rules=run_.rules,
    )  # fmt: skip
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
        run_, state, steps=steps, lr=c.sft.lr if lr is None else lr,
        warmup_steps=c.sft.warmup_steps if warmup_steps is None else warmup_steps,
        schedule=schedule,
    )  # fmt: skip
    t0 = time.perf_counter()
    for i in range(steps):
        examples = next_examples(run_.task, run_.mesh, loop, c.sft.batch_size)
        batch = sharding.device_batch(sft_batch(run_, examples), run_.mesh, group_size=1,
                                      local=True)  # fmt: skip
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
# Checkpoints: state + reference + loop state (step, data position, shuffle stream, replay) +
# config.


def restore(run_: assemble.Run, state, loop: LoopState):
    """Resume order: config.restore_from > latest in workdir > nothing; `loop` is set to the
    checkpoint's (untouched when there is none). A damaged newest step in the workdir is moved
    aside and the next newest restorable one is used; a damaged explicit restore_from is an
    error (`checkpoint.restore_newest`).

    Returns (state, ref, resumed); ref is the frozen reference (None when the run keeps none,
    or has not made it yet).
    """
    # A checkpoint may or may not hold a reference copy (an SFT start has none, a GRPO run has
    # one); the run may or may not need one. Try the run's own layout first, then the other.
    # A run that never updates reads the parameters alone: moments and reference stay on disk.
    ref_layout = jax.eval_shape(lambda p: reference_copy(run_, p), state.params)
    if not assemble.trains(run_.config):
        state = state.replace(opt_state=checkpoint.skipped(state.opt_state))
        ref_layout = checkpoint.skipped(ref_layout)
    layouts = [ref_layout, None] if run_.reference.kind == "copy" else [None, ref_layout]

    def attempt(directory, step):
        first_error = None
        for ref_layout in layouts:
            try:
                return run_.ckpt.restore(
                    abstract_target(run_, state, ref_layout), step=step, directory=directory
                )
            except checkpoint.CheckpointError as e:
                first_error = first_error or e
        raise first_error

    newest = checkpoint.resolve_restore(run_.config.restore_from or None, run_.workdir)
    if newest is not None:
        check_lora_layout(run_, *newest)
    found = checkpoint.restore_newest(
        run_.ckpt, run_.config.restore_from or None, run_.workdir, attempt,
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    if found is None:
        return state, None, False
    (restored, meta, replay), directory, step = found
    if run_.lora is not None:  # the checkpoint's adapters on the base this run loaded
        check_base(run_, state.params, meta, directory)
        base = lora.split_trainable(state.params)[1]
        adapted = lora.join(restored["state"].params, base)
        restored = {**restored, "state": restored["state"].replace(params=adapted)}
    ref = None
    if run_.reference.kind == "copy":  # start of RL from a checkpoint without reference: freeze now
        ref = (
            restored["ref"]
            if restored["ref"] is not None
            else reference_copy(run_, restored["state"].params)
        )
    loop.load_state_dict(meta, replay)
    # The queued rollouts to this run's rollout.staleness (their prompts served again if dropped).
    note = loop.fit_queue(run_.step.staleness) if assemble.trains(run_.config) else None
    if sharding.is_primary():
        print(f"Resumed from {directory} at step {step}.", flush=True)
        if note:
            print(note, flush=True)
    return restored["state"], ref, True


def stored_state(run_: assemble.Run, state):
    """What a checkpoint holds of a train state (or of its shardings): all of it, or with LoRA
    all but the frozen base."""
    if run_.lora is None:
        return state
    return state.replace(params=lora.split_trainable(state.params)[0])


def check_lora_layout(run_: assemble.Run, directory, step: int) -> None:
    """A LoRA checkpoint needs a LoRA run and the other way round (CheckpointError, raised before
    any read, so a mismatch is not taken for damage). The checkpoint's meta says which it is
    (`lora_base`)."""
    try:
        meta = json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return  # unreadable: the restore itself reports it
    if ("lora_base" in meta) == (run_.lora is not None):
        return
    if run_.lora is None:
        raise checkpoint.CheckpointError(
            f"the checkpoint {Path(directory) / str(step)} holds LoRA adapters; set "
            "--config.lora.enabled=True with its lora settings to resume or evaluate it."
        )
    raise checkpoint.CheckpointError(
        f"the checkpoint {Path(directory) / str(step)} holds a fully trained model, not LoRA "
        "adapters; set --config.lora.enabled=False to resume or evaluate it."
    )


def check_base(run_: assemble.Run, params, meta: dict, directory) -> None:
    """A LoRA checkpoint resumes only onto the base it was trained on (CheckpointError)."""
    saved, ours = meta.get("lora_base"), lora.fingerprint(params)
    # fp32 sums: the reduction order (the mesh) may change the last digits, another base more
    if saved is None or abs(saved - ours) > 1e-5 * abs(ours) + 1e-6:
        raise checkpoint.CheckpointError(
            f"the LoRA checkpoint in {directory} was trained on another base model (fingerprint "
            f"{saved} != {ours} of this run's); point config.model at the base it was trained "
            "on (its config.json in the checkpoint names it) or use another workdir."
        )


def abstract_target(run_: assemble.Run, state, ref):
    """Restore target: shapes, dtypes and the run's shardings."""
    shard = run_.state_shardings
    keep = lambda x, s: (
        x
        if x is checkpoint.SKIP
        else jax.ShapeDtypeStruct(  # noqa: E731
            np.shape(x), x.dtype, sharding=s
        )
    )
    return {
        "state": jax.tree.map(keep, stored_state(run_, state), stored_state(run_, shard)),
        "ref": None if ref is None else jax.tree.map(keep, ref, shard.params),
    }


def save(run_: assemble.Run, state, loop: LoopState, ref) -> None:
    """Checkpoint `state`, `ref` and `loop` as step `loop.step`."""
    meta = loop.state_dict() | {"config": json.loads(run_.config.to_json_best_effort())}
    if run_.lora is not None:
        meta["lora_base"] = lora.fingerprint(state.params)
    stored = {"state": stored_state(run_, state), "ref": ref}
    run_.ckpt.save(loop.step, stored, meta=meta, replay=loop.arrays(), force=True)


# ----------------------------------------------------------------------------------------------
# Evaluation, export, the end of a run.


def evaluate(run_: assemble.Run, params, *, step: int, tag: str = "") -> dict:
    """Held-out accuracy (greedy, and avg@n at the rollout temperature when eval_samples > 1),
    written to the metrics and printed, and each problem's outcome to
    `eval_outcomes/step_<step>[_<tag>].json` (for `python -m gvpo_jax.compare`).
    Returns {"accuracy", "greedy", "eval/...": ...}."""
    c = run_.config
    n = c.train.eval_samples
    t0 = time.perf_counter()
    outcomes: list[dict] = []
    flat = eval_lib.evaluate_policy(
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
    )
    flat["eval/time_s"] = time.perf_counter() - t0
    run_.writer.write_scalars(step, flat)
    if sharding.is_primary():
        name = f"step_{step:06d}" + (f"_{tag}" if tag else "")
        eval_lib.write_json_atomic(
            os.path.join(run_.workdir, "eval_outcomes", f"{name}.json"),
            {"step": step, "tag": tag, "policy": f"{run_.workdir} at step {step}",
             "metrics": flat, "outcomes": outcomes},
        )  # fmt: skip
    acc = flat[f"eval/avg@{n}"] if n > 1 else flat["eval/greedy"]
    if sharding.is_primary():
        what = f"avg@{n} (T={c.rollout.temperature:g}) {acc:.3f}, greedy " if n > 1 else ""
        tqdm.tqdm.write(
            f"[eval] step {step}: accuracy {what}{flat['eval/greedy']:.3f} "
            f"on {len(run_.task.eval_examples)} problems"
        )
    return {"accuracy": acc, "greedy": flat["eval/greedy"], **flat}


def _record_eval(summary: dict, key: str, run_: assemble.Run, params, *, step: int) -> None:
    """summary[key] = held-out accuracy (avg@n when eval_samples > 1), key_greedy = greedy."""
    result = evaluate(run_, params, step=step, tag=key)
    summary[key] = result["accuracy"]
    if run_.config.train.eval_samples > 1:
        summary[f"{key}_greedy"] = result["greedy"]


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
    """mode=eval over config.eval.sets: each set with its protocol (`eval_lib.protocol_for`),
    results in `workdir/eval/<set>.json` as each finishes (a rerun keeps finished sets), the
    table printed and written as `eval/table.json` and `eval/table.md`. Returns the table."""
    from gvpo_jax import data

    c, e = run_.config, run_.config.eval
    names = data.eval_sets.parse_sets(e.sets)
    paths = data.eval_sets.parse_paths(e.paths)
    cap = e.max_new_tokens or c.rollout.max_new_tokens
    protocols = {name: eval_lib.protocol_for(name, n=e.n, temperature=e.temperature,
                                             top_p=e.top_p, max_new_tokens=cap)
                 for name in names}  # fmt: skip

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
            run_.sampling, temperature=protocol.temperature, top_p=protocol.top_p,
            max_new_tokens=protocol.max_new_tokens,
        )  # fmt: skip
        outcomes: list[dict] = []
        flat = eval_lib.evaluate_policy(
            run_.model(params), examples, tokenizer=run_.tokenizer, settings=settings,
            mesh=run_.mesh, rules=run_.rules, reward_fn="math", n=protocol.n,
            chunk=c.train.eval_chunk or c.rollout.prompts_per_step,
            seed=c.seed + zlib.crc32(name.encode()), timeout_s=run_.task.timeout_s,
            num_workers=run_.task.num_workers, outcomes=outcomes,
        )  # fmt: skip
        prefix = "eval/"
        result = {k[len(prefix) :]: v for k, v in flat.items()
                  if k.startswith(prefix) and "/per_dataset/" not in k}  # fmt: skip
        result["num_problems"] = int(result["num_problems"])
        return result, outcomes

    log = (lambda line: tqdm.tqdm.write(line)) if sharding.is_primary() else (lambda line: None)
    return eval_lib.run_sets(
        names, protocols=protocols, load_set=load_set, score_set=score_set,
        out_dir=os.path.join(run_.workdir, "eval"), policy=policy,
        commit=eval_lib.git_commit(), write=sharding.is_primary(), log=log,
    )  # fmt: skip


def export(run_: assemble.Run, params) -> dict:
    """The policy as a Hugging Face directory (model + tokenizer) in workdir/export.

    Tensors are written in `train.export_dtype` (default: the compute dtype). A LoRA policy is
    exported merged (W + scale A B, summed in fp32) there, and its adapters alone in PEFT's
    format in workdir/export_adapter.
    """
    out = os.path.join(run_.workdir, "export")
    c = run_.config
    dtype = c.train.export_dtype or c.model.compute_dtype
    host = sharding.gather(params)  # an all-gather in multi-process runs: every process calls
    result = {"export_dir": out}
    if sharding.is_primary():
        model = run_.model(host)
        if run_.lora is not None:
            result["adapter_dir"] = os.path.join(run_.workdir, "export_adapter")
            lora.save_peft(model, result["adapter_dir"], run_.lora, base_model=c.model.hf_dir)
            model = lora.merged(model, dtype)
        models.save_pretrained(model, out, dtype=dtype)
        run_.tokenizer.save_pretrained(out)
        print(f"Exported the policy to {out}")
    return result


def finish(run_: assemble.Run, params, summary: dict) -> None:
    """End of a run: export, the curves PNG and the summary table."""
    c = run_.config
    if c.train.export:
        summary.update(export(run_, params))
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
            title=f"{c.algo.name} on {c.data.task}",
        )
        summary["plot"] = png
    print(metrics.summary_table(rows, ("reward_mean", "accuracy", *eval_keys(c), "loss")))
    for k, v in summary.items():
        print(f"{k}: {v}")


def eval_keys(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The evaluation metrics a run logs: avg@n at the rollout temperature (n > 1) and greedy."""
    n = c.train.eval_samples
    return (f"eval/avg@{n}", "eval/greedy") if n > 1 else ("eval/greedy",)
