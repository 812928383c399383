"""Builds a run from its config (model, tokenizer, task, writer, checkpoints); host services."""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from flax import nnx

from gvpo_jax import checkpoint, metrics, models, rollout, sharding, tasks, train_step
from gvpo_jax.replay import ReplayBuffer

# Metrics shown on the progress line, in this order, when present.
PROGRESS_KEYS = ("reward_mean", "accuracy", "response_len_mean", "loss", "kl_ref", "grad_norm")


def build_tokenizer(config, workdir: str):
    """The run's tokenizer; the character tokenizer is saved as a normal HF directory in workdir."""
    from gvpo_jax import data

    kind = config.tokenizer.kind
    if kind == "char":
        tok = data.char_tokenizer.build_char_tokenizer()
        if sharding.is_primary():  # one writer: the workdir may be shared by all processes
            tok.save_pretrained(os.path.join(workdir, "tokenizer"))
        return tok
    import transformers

    if kind == "hf":
        return transformers.AutoTokenizer.from_pretrained(config.tokenizer.path)
    if config.model.hf_dir:
        return transformers.AutoTokenizer.from_pretrained(config.model.hf_dir)
    return None  # kind == "model" with a GGUF: from_gguf returns its tokenizer


def build_model(config, tokenizer, mesh=None):
    """The policy: HF directory > GGUF file > preset / overrides with random init (seeded).

    With a mesh, parameters are created or loaded straight into their shards under the logical
    axis rules. Returns (model, tokenizer, rules); rules is None without a mesh.
    """
    c = config.model
    if c.hf_dir:
        if mesh is None:
            return models.from_pretrained(c.hf_dir, dtype=c.dtype, remat=c.remat), tokenizer, None
        cfg = sharding.hf_model_config(c.hf_dir, c.dtype).replace(remat=c.remat)
        rules = sharding.logical_rules(mesh, cfg)
        model = sharding.load_pretrained_sharded(
            c.hf_dir, mesh, c.dtype, remat=c.remat, rules=rules
        )
        return model, tokenizer, rules
    if c.gguf:
        from gvpo_jax.config import resolve_gguf

        model, gguf_tok = models.from_gguf(resolve_gguf(c.gguf), dtype=c.dtype)
        tokenizer = tokenizer or gguf_tok
        if mesh is None:
            return model, tokenizer, None
        rules = sharding.logical_rules(mesh, model.config)
        return sharding.shard_model(model, mesh, rules), tokenizer, rules
    base = models.PRESETS[c.preset] if c.preset else None
    fields = dict(c.overrides.to_dict())
    if tokenizer is not None and "vocab_size" not in fields and base is None:
        fields["vocab_size"] = len(tokenizer)
    fields.setdefault("param_dtype", c.dtype)
    fields.setdefault("remat", c.remat)
    cfg = base.replace(**fields) if base is not None else models.ModelConfig(**fields)
    if mesh is None:
        return models.Transformer(cfg, rngs=nnx.Rngs(config.seed)), tokenizer, None
    rules = sharding.logical_rules(mesh, cfg)
    return sharding.init_sharded(cfg, mesh, config.seed, rules), tokenizer, rules


def check_mesh(config, mesh) -> None:
    """Batch shapes the mesh can split into whole groups (ShardingError otherwise)."""
    c = config
    P, G = c.rollout.prompts_per_step, c.rollout.group_size
    sharding.check_batch((P // c.algo.num_minibatches) * G, G, mesh, c.optim.micro_batches)
    shards = sharding.batch_shards(mesh)
    fresh = P - int(round(c.algo.replay_fraction * P))
    sizes = [("rollout.prompts_per_step", P), ("fresh groups per step", fresh)]
    if c.sft.steps:
        sizes.append(("sft.batch_size", c.sft.batch_size))
    for name, n in sizes:
        if n % shards:
            raise sharding.ShardingError(
                f"{name} = {n} is not a multiple of the {shards} data x fsdp shards of the "
                "mesh; change prompts_per_step (or replay_fraction) or config.mesh."
            )


def rollout_settings(config, tokenizer) -> rollout.RolloutSettings:
    eos = tasks.eos_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return rollout.RolloutSettings(
        group_size=config.rollout.group_size,
        max_new_tokens=config.rollout.max_new_tokens,
        prompt_len=config.data.max_prompt_len,
        eos_ids=eos,
        pad_id=int(pad),
        temperature=config.rollout.temperature,
        top_k=config.rollout.top_k,
        top_p=config.rollout.top_p,
        buckets=(config.data.max_prompt_len,),
    )


def build(config: ml_collections.ConfigDict, workdir: str):
    """Everything a run needs, before any compilation: returns (Run, initial TrainState)."""
    from gvpo_jax.train import Run

    if config.restore_from:  # a bad explicit path fails before anything is written
        checkpoint.resolve_restore(config.restore_from, workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_test.{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise checkpoint.CheckpointError(
            f"workdir {workdir!r} is not writable ({e.strerror}); choose another --workdir."
        ) from e
    if sharding.is_primary():
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    check_mesh(config, mesh)
    tokenizer = build_tokenizer(config, workdir)
    model, tokenizer, rules = build_model(config, tokenizer, mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    settings = rollout_settings(config, tokenizer)
    task = tasks.build_task(
        config,
        tokenizer,
        shard=sharding.data_shard(mesh),
        allgather=sharding.host_allgather,
    )
    writer = metrics.MetricWriter(workdir)
    ckpt = checkpoint.Checkpointer(
        checkpoint.checkpoint_dir(workdir),
        save_every=config.train.checkpoint_every,
        keep=config.train.keep_checkpoints,
    )
    run = Run(
        config=config,
        workdir=workdir,
        graphdef=graphdef,
        tokenizer=tokenizer,
        task=task,
        settings=settings,
        writer=writer,
        ckpt=ckpt,
        np_rng=np.random.default_rng(config.seed + 1),
        mesh=mesh,
        rules=rules,
    )
    if sharding.is_primary():
        print(
            f"model: {models.param_count(model) / 1e6:.2f}M parameters; "
            f"{jax.device_count()} {jax.devices()[0].platform} devices; mesh "
            + " x ".join(f"{k}={v}" for k, v in sharding.mesh_sizes(mesh).items())
        )
    state = train_step.TrainState(
        step=np.zeros((), np.int32),
        params=params,
        opt_state=(),
        rng=jax.random.key_data(jax.random.key(config.seed)),
        bad_steps=np.zeros((), np.int32),
    )
    return run, state


def freeze_reference(run, params) -> None:
    """A copy of the current policy that never changes (reference / frozen anchor)."""
    run.ref_params = jax.tree.map(jnp.copy, params)  # keeps each array's sharding


# ----------------------------------------------------------------------------------------------
# Checkpoints: state + data position + replay buffer + config, and the resume order.


def restore(run, state):
    """Resume order: config.restore_from > latest in workdir > nothing.

    Returns (state, step, resumed).
    """
    found = checkpoint.resolve_restore(run.config.restore_from or None, run.workdir)
    if found is None:
        return state, 0, False
    directory, step = found
    # A checkpoint may or may not hold a reference copy (an SFT start has none, a GRPO run has
    # one); the run may or may not need one. Try the run's own layout first, then the other.
    needs_ref = run.ref_params is not None
    layouts = [run.ref_params, None] if needs_ref else [None, state.params]
    first_error = None
    for ref in layouts:
        abstract = abstract_target(run, state, ref)
        try:
            restored, meta, replay = run.ckpt.restore(abstract, step=step, directory=directory)
            break
        except checkpoint.CheckpointError as e:
            first_error = first_error or e
    else:
        raise first_error
    if needs_ref and restored["ref"] is None:  # start of RL from a checkpoint without reference
        freeze_reference(run, restored["state"].params)
    else:
        run.ref_params = restored["ref"] if needs_ref else None
    run.task.set_state(meta["data"])
    run.np_rng.bit_generator.state = meta["np_rng"]
    if replay and run.replay is not None:
        run.replay.load_state_dict(replay)
    if sharding.is_primary():
        print(f"Resumed from {directory} at step {step}.", flush=True)
    return restored["state"], step, True


def abstract_target(run, state, ref):
    """Restore target: shapes and dtypes, with the run's shardings when it has a mesh."""
    if run.state_shardings is None:
        return jax.eval_shape(lambda: {"state": state, "ref": ref})
    shard = run.state_shardings
    return {
        "state": sharding.abstract_with_shardings(state, shard),
        "ref": None if ref is None else sharding.abstract_with_shardings(ref, shard.params),
    }


def save(run, state, step: int) -> None:
    meta = {
        "step": step,
        "data": run.task.get_state(),
        "np_rng": run.np_rng.bit_generator.state,
        "config": json.loads(run.config.to_json_best_effort()),
    }
    replay = run.replay.state_dict() if run.replay is not None else None
    run.ckpt.save(
        step, {"state": state, "ref": run.ref_params}, meta=meta, replay=replay, force=True
    )


# ----------------------------------------------------------------------------------------------
# Evaluation, export, what the user sees.


def evaluate(run, params, *, step: int) -> dict:
    """Held-out accuracy: greedy always, and avg@n at the rollout temperature when eval_samples > 1.

    Returns {"accuracy": avg@n if eval_samples > 1 else greedy, "greedy": greedy, "eval/...": ...}.
    Sampled accuracy is what GVPO's paper reports (avg@32) and what RL moves first (it sharpens
    the sampled distribution); greedy accuracy is the single best guess.
    """
    from gvpo_jax import eval as eval_lib

    c = run.config
    n = c.train.eval_samples
    settings = run.settings
    model = run.model(params)
    t0 = time.perf_counter()

    def generate_fn(examples, num):
        # Every process runs the same chunks; each samples its rows and the outputs are
        # all-gathered, so every process scores the same completions (same result everywhere).
        outs = []
        chunk = max(c.rollout.prompts_per_step, 1)
        rows = range(chunk) if run.mesh is None else sharding.process_rows(chunk, run.mesh).rows
        for i in range(0, len(examples), chunk):
            part = list(examples[i : i + chunk])
            real = len(part)
            part += [part[-1]] * (chunk - real)  # fixed shapes: pad the last chunk, drop after
            out = rollout.sample_groups(
                model,
                [part[int(r)]["prompt_ids"] for r in rows],
                settings=_eval_settings(settings, num),
                rng=jax.random.key(step + 12345),
                mesh=run.mesh,
                rules=run.rules,
            )
            tokens, lengths = out.tokens_BxN, out.lengths_B
            if run.mesh is not None:
                full = sharding.gather_rows({"tokens": tokens, "lengths": lengths}, run.mesh)
                tokens, lengths = full["tokens"], full["lengths"]
            texts = rollout.decode(run.tokenizer, tokens, lengths)
            outs += [texts[j * num : (j + 1) * num] for j in range(real)]
        return outs

    evaluate_n = functools.partial(
        eval_lib.evaluate, generate_fn, run.task.eval_examples, reward_fn=run.task.eval_reward
    )
    # The full metric set (avg@n, pass@k, maj@k, per dataset) of the headline evaluation, plus
    # the greedy accuracy as "eval/greedy" in every case.
    greedy = evaluate_n(n=1, ks=(1,))
    headline = greedy if n == 1 else evaluate_n(n=n, ks=(1, n))
    flat = {f"eval/{k}": float(v) for k, v in _flatten(headline).items()}
    flat["eval/greedy"] = float(greedy["avg@1"])
    flat["eval/time_s"] = time.perf_counter() - t0
    run.writer.write_scalars(step, flat)
    acc = flat[f"eval/avg@{n}"] if n > 1 else flat["eval/greedy"]
    if sharding.is_primary():
        what = f"avg@{n} (T={c.rollout.temperature:g}) {acc:.3f}, greedy " if n > 1 else ""
        tqdm.tqdm.write(
            f"[eval] step {step}: accuracy {what}{flat['eval/greedy']:.3f} "
            f"on {len(run.task.eval_examples)} problems"
        )
    return {"accuracy": acc, "greedy": flat["eval/greedy"], **flat}


def _eval_settings(settings, num):
    import dataclasses

    if num == 1:
        return dataclasses.replace(settings, group_size=1, temperature=0.0)
    return dataclasses.replace(settings, group_size=num)


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float, np.floating, np.integer)):
            out[f"{prefix}{k}"] = v
    return out


def export(run, params) -> dict:
    """The policy as a Hugging Face directory (model + tokenizer) in workdir/export."""
    out = os.path.join(run.workdir, "export")
    host = sharding.gather(params)  # an all-gather in multi-process runs: every process calls
    if sharding.is_primary():
        models.save_pretrained(run.model(host), out)
        run.tokenizer.save_pretrained(out)
        print(f"Exported the policy to {out}")
    return {"export_dir": out}


def finish(run, params, summary: dict) -> None:
    """End of a run: export, the curves PNG and the summary table."""
    c = run.config
    if c.train.export:
        summary.update(export(run, params))
    run.writer.flush()
    if not sharding.is_primary():  # metrics, plots and tables are process 0's
        return
    rows = metrics.read_jsonl(os.path.join(run.workdir, "metrics.jsonl"))
    if c.train.plot:
        png = os.path.join(run.workdir, "curves.png")
        metrics.plot_curves(
            rows,
            png,
            keys=("reward_mean", *_eval_keys(c), "response_len_mean", "kl_ref"),
            title=f"{c.algo.name} on {c.data.task}",
        )
        summary["plot"] = png
    print(metrics.summary_table(rows, ("reward_mean", "accuracy", *_eval_keys(c), "loss")))
    for k, v in summary.items():
        print(f"{k}: {v}")


def _eval_keys(c) -> tuple[str, ...]:
    """The evaluation metrics a run logs: avg@n at the rollout temperature (n > 1) and greedy."""
    n = c.train.eval_samples
    return (f"eval/avg@{n}", "eval/greedy") if n > 1 else ("eval/greedy",)


class Progress:
    """A tqdm bar with the key metrics on a terminal; one plain line per log step otherwise."""

    def __init__(self, total: int, initial: int, log_every: int):
        self.tty = sys.stdout.isatty()
        self.total, self.log_every = total, log_every
        self.bar = tqdm.tqdm(total=total, initial=initial, desc="rl", dynamic_ncols=True,
                             disable=not self.tty or jax.process_index() != 0)  # fmt: skip

    def update(self, step: int, m: dict) -> None:
        shown = {k.split("/")[-1]: f"{m[k]:.3f}" for k in PROGRESS_KEYS if k in m}
        t = m.get("rollout_time_s", 0) + m.get("update_time_s", 0)
        if self.tty:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif sharding.is_primary() and (step % self.log_every == 0 or step == self.total):
            text = "  ".join(f"{k} {v}" for k, v in shown.items())
            print(f"[rl] step {step}/{self.total}  {text}  ({t:.2f}s)", flush=True)

    def write(self, text: str) -> None:
        if sharding.is_primary():
            (self.bar.write if self.tty else print)(text)

    def close(self) -> None:
        self.bar.close()


def sample_texts(examples, completions, config, count: int = 4) -> dict[str, str]:
    G = config.rollout.group_size
    lines = []
    for i in range(min(count, len(examples))):
        ex = examples[i]
        lines.append(f"prompt: {ex['prompt']!r} gold: {ex['answer']!r} -> {completions[i * G]!r}")
    return {"samples": "\n".join(lines)}


def preemption_guard():
    return checkpoint.PreemptionGuard()


def make_replay(config) -> ReplayBuffer | None:
    if config.algo.name == "gvpo" and config.algo.replay_fraction > 0:
        return ReplayBuffer(
            config.algo.replay_capacity, mode=config.algo.replay_mode, seed=config.seed
        )
    return None
