"""Rollout: gvpo_jax vs transformers vs google-tunix 0.1.7 on the same bench-45m weights.

Run from the repo root, after `bash benchmarks/setup_tunix.sh` (creates .venv-tunix):
  .venv/bin/python -m benchmarks.tunix_rollout [--repeats 3] [--quick]
(about 5 minutes on 2 cores). The driver (main venv) builds bench-45m, exports it with
`models.save_pretrained`, and times, round-robin (common.interleave), `gvpo_jax.sampler.generate`,
transformers' `generate` (torch CPU, 2 threads, same sampling settings as benchmarks/rollout.py)
and tunix's `Sampler`. Tunix runs in this same module started with .venv-tunix's python as a
worker (`--worker rollout|update --dir DIR`) that loads the
safetensors into tunix's Qwen2, checks its logits against ours, and times tunix's `Sampler`
(rollout) or its GRPO loss in tunix's RL `Trainer` train step (update, used by update_step.py).
Tunix needs safetensors<0.8 and its own dependency set, so it lives in a separate venv; the worker
imports only tunix, jax, numpy and benchmarks.common.

Workload: 8 prompts x 4 samples, prompt 64, 128 new tokens, T=1 sampling over the full vocabulary,
EOS disabled. Tunix has no shared-prefix sampling: it gets the 32 rows (each prompt repeated 4
times, as its GRPO learner does) and `return_logprobs=False` (its cheapest mode; ours always
returns log-probs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from benchmarks import common, workers  # noqa: E402

REPO = workers.REPO
TUNIX_PYTHON = os.path.join(REPO, ".venv-tunix", "bin", "python")
NEVER_EOS = -1  # not a token id: generation always runs to the last step
QUICK = dict(prompts=2, samples=2, prompt_len=8, new_tokens=8)
FULL = dict(
    prompts=common.PROMPTS,
    samples=common.SAMPLES,
    prompt_len=common.PROMPT_LEN,
    new_tokens=common.NEW_TOKENS,
)


# ----------------------------------------------------------------------------- driver side


def tunix_python() -> str | None:
    """The tunix venv's interpreter, or None when benchmarks/setup_tunix.sh has not been run."""
    path = os.environ.get("TUNIX_PYTHON", TUNIX_PYTHON)
    return path if os.path.exists(path) else None


def export_for_worker(model, out_dir: str, *, check_len: int = 16) -> None:
    """Weights (HF safetensors), dims and reference logits the worker checks tunix against."""
    import jax.numpy as jnp

    from gvpo_jax import models

    cfg = model.config
    models.save_pretrained(model, out_dir)
    tokens = common.random_prompts(cfg.vocab_size, 2, check_len, seed=123)
    logits = np.asarray(model(jnp.asarray(tokens)))
    np.save(os.path.join(out_dir, "check_tokens.npy"), tokens)
    np.save(os.path.join(out_dir, "check_logits.npy"), logits)
    meta = dict(dims=common.dims_of(cfg), rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)


WorkerError = workers.WorkerError


class TunixWorker(workers.LineWorker):
    """Proxy of a tunix worker process, with LocalBench's first() / step() / close() interface.

    The worker loads the weights, checks its logits against ours and builds the call to time,
    then answers one line per command, so the driver can interleave it with in-process benches.
    """

    def __init__(self, mode: str, work_dir: str, **job):
        python = tunix_python()
        if python is None:
            raise WorkerError("no .venv-tunix (run `bash benchmarks/setup_tunix.sh`)")
        with open(os.path.join(work_dir, "job.json"), "w") as f:
            json.dump(dict(mode=mode, **job), f)
        # info: after loading: versions, logits check, load time
        super().__init__("tunix", [python, "-m", "benchmarks.tunix_rollout", "--worker", work_dir])

    _send = workers.LineWorker.send

    def first(self) -> tuple[float, float]:
        return tuple(self._send("first")["first"])

    def step(self) -> tuple[float, float]:
        return tuple(self._send("step")["step"])

    def close(self) -> dict:
        result = self._send("close")
        self.proc.wait()
        return dict(self.info, **result)


def ours_bench(model, prompt_ids, *, samples: int, new_tokens: int) -> common.LocalBench:
    """gvpo_jax.sampler.generate (prefill once per prompt, decode in one while_loop)."""
    import jax
    from flax import nnx

    from gvpo_jax import sampler

    settings = sampler.SamplingSettings(
        max_new_tokens=new_tokens, temperature=1.0, group_size=samples
    )
    graphdef, state = nnx.split(model)
    lens = np.full((prompt_ids.shape[0],), prompt_ids.shape[1], np.int32)
    seed = iter(range(10**6))

    def call():
        out = sampler.generate_split(
            graphdef, state, prompt_ids, lens, jax.random.key(next(seed)), settings=settings
        )
        out = jax.device_get(out)
        assert int(out.lengths_B.min()) == new_tokens  # no EOS: every row ran to the end
        return out

    return common.LocalBench(call)


def hf_bench(hf_dir: str, prompt_ids, *, samples: int, new_tokens: int) -> common.LocalBench:
    """transformers `generate` (sampling at T=1 over the full vocabulary, EOS off, 2 threads)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.tensor(prompt_ids, dtype=torch.long)
    kwargs = dict(
        attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        num_return_sequences=samples, eos_token_id=None, pad_token_id=0,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
    )  # fmt: skip

    def call():
        with torch.no_grad():
            out = hf.generate(x, **kwargs)
        assert out.shape == (x.shape[0] * samples, x.shape[1] + new_tokens)

    return common.LocalBench(call)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per sampler")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers generate")
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes (tests)")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)

    shape = QUICK if args.quick else FULL
    p, g, tp, n = shape["prompts"], shape["samples"], shape["prompt_len"], shape["new_tokens"]
    model = common.bench_model(args.quick)
    dims = common.dims_of(model.config)
    prompt_ids = common.random_prompts(dims["vocab"], p, tp)
    which = "quick" if args.quick else "bench-45m"
    print(f"# Rollout: gvpo_jax vs transformers vs tunix 0.1.7 ({which})")
    print(common.describe_machine())
    print(f"{p} prompts x {g} samples, prompt {tp}, {n} new tokens, T=1, no EOS\n")

    sizes = (256,) if args.quick else common.PEAK_SIZES
    peak = common.measure_peak(sizes, torch=not args.skip_hf)
    benches = {"gvpo_jax generate": ours_bench(model, prompt_ids, samples=g, new_tokens=n)}
    with tempfile.TemporaryDirectory() as work:
        export_for_worker(model, work)
        np.save(os.path.join(work, "prompts.npy"), prompt_ids)
        if not args.skip_hf:
            benches["transformers generate"] = hf_bench(work, prompt_ids, samples=g, new_tokens=n)
        try:
            benches["tunix Sampler"] = TunixWorker("rollout", work, samples=g, new_tokens=n)
        except WorkerError as e:
            print(f"tunix: not measured: {e}")
        rows = common.interleave(benches, args.repeats)
    if "tunix Sampler" in rows:
        r = rows["tunix Sampler"]
        print(
            f"tunix versions: {r['versions']}; logits max |diff| vs gvpo_jax "
            f"{r['logits_max_diff']:.1e}"
        )
    peak = peak.merge(common.measure_peak(sizes, torch=not args.skip_hf))
    print(peak.describe() + "\n")

    flops = common.generation_flops(dims, p * g, tp, n)
    table = [
        [name, *common.perf_cells(r, flops=flops, tokens=p * g * n, peak=peak)]
        for name, r in rows.items()
    ]
    print(common.md_table(["sampler", *common.PERF_HEADERS], table))
    summary = dict(rows=rows, peak=peak.flops, flops=flops, shape=shape, speedups={})
    t = {k: common.Timing.from_dict(r["timing"]) for k, r in rows.items()}
    ours = t["gvpo_jax generate"]
    print()
    for other in ("transformers generate", "tunix Sampler"):
        if other in t:
            wall, cpu = t[other].best / ours.best, t[other].best_cpu / ours.best_cpu
            summary["speedups"][other] = wall
            summary["speedups"][other + " (CPU time)"] = cpu
            print(common.ratio_line(f"rollout speed-up over {other}", wall, 2.0))
            print(common.ratio_line(f"rollout speed-up over {other} (CPU time)", cpu, 2.0))
    common.emit_json("ROLLOUT", summary)
    return summary


# ----------------------------------------------------------------------------- worker side


class IdTokenizer:
    """Tunix's sampler takes text: here text is space-separated token ids (no BOS, pad 0)."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0  # falsy: the sampler prepends no BOS

    def eos_id(self) -> int:
        return NEVER_EOS

    def pad_id(self) -> int:
        return 0


def _load_tunix_model(work: str, meta: dict):
    import jax.numpy as jnp
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params

    d = meta["dims"]
    cfg = qwen2_model.ModelConfig(
        num_layers=d["layers"],
        vocab_size=d["vocab"],
        embed_dim=d["d_model"],
        hidden_dim=d["mlp"],
        num_heads=d["heads"],
        head_dim=d["head_dim"],
        num_kv_heads=d["kv_heads"],
        rope_theta=int(meta["rope_theta"]),
        norm_eps=meta["rms_norm_eps"],
        use_tied_embedding=d["tied"],
    )
    model = qwen2_params.create_model_from_safe_tensors(work, cfg, dtype=jnp.float32)
    tokens = np.load(os.path.join(work, "check_tokens.npy"))
    ref = np.load(os.path.join(work, "check_logits.npy"))
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), None, jnp.asarray(causal))
    diff = float(np.max(np.abs(np.asarray(logits) - ref)))
    if diff > 1e-3:
        raise AssertionError(f"tunix logits differ from gvpo_jax's by {diff}: weights not equal")
    return model, cfg, diff


def _worker_rollout(work: str, job: dict, model, cfg):
    """tunix's Sampler on the G-times repeated prompts -> (blocking call, extras)."""
    from tunix.generate import sampler as tunix_sampler

    prompts = np.load(os.path.join(work, "prompts.npy"))
    g, n = job["samples"], job["new_tokens"]
    rows = [" ".join(map(str, p)) for p in prompts for _ in range(g)]  # each prompt G times
    tp = prompts.shape[1]
    cache = tunix_sampler.CacheConfig(
        cache_size=tp + n, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )  # fmt: skip
    smp = tunix_sampler.Sampler(transformer=model, tokenizer=IdTokenizer(), cache_config=cache)
    seed = iter(range(10**6))

    def call():
        out = smp(
            rows, max_generation_steps=n, max_prompt_length=tp, temperature=1.0, top_p=1.0,
            top_k=None, eos_tokens=[NEVER_EOS], seed=next(seed), echo=False,
        )  # fmt: skip
        assert min(len(t) for t in out.tokens) == n, [len(t) for t in out.tokens]

    return call, dict


def _worker_update(work: str, job: dict, model, cfg):
    """tunix's GRPO loss in its RL Trainer's jitted train step, bound as GRPOLearner does."""
    import jax
    import optax
    from tunix.rl import algo_core
    from tunix.rl import common as rl_common
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    data = dict(np.load(os.path.join(work, "batch.npz")))
    tp = job["prompt_len"]
    algo = grpo_learner.GRPOConfig(
        num_generations=job["group_size"], num_iterations=1, beta=job["kl_coef"],
        kl_loss_mode="low_var_kl", kl_clamp_value=10.0, epsilon=0.2,
        loss_agg_mode="sequence-mean-token-mean",
    )  # fmt: skip
    algo.temperature = 1.0  # GRPOLearner copies the rollout temperature here
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(job["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    trainer = rl_trainer.Trainer(
        model, tx, peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**6),
        custom_checkpoint_metadata_fn=dict,
    )  # fmt: skip
    loss_fn = lambda model, train_example, algo_config: algo_core.grpo_loss_fn(
        model, train_example, algo_config=algo, pad_id=0, eos_id=NEVER_EOS
    )
    trainer.with_loss_fn(loss_fn, has_aux=True)
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    step, _ = trainer.jit_train_and_eval_step()
    example = jax.device_put(
        rl_common.TrainExample(
            prompt_ids=data["tokens"][:, :tp],
            prompt_mask=data["attn_mask"][:, :tp],
            completion_ids=data["tokens"][:, tp:],
            completion_mask=data["resp_mask"],
            advantages=data["advantages"],
            ref_per_token_logps=data["ref_logp"],
            old_per_token_logps=data["old_logp"],
        )
    )
    losses = []

    def call():
        loss, _, _ = step(example)
        losses.append(float(jax.block_until_ready(loss)))

    return call, lambda: {"first_loss": losses[0]}


def worker_main(work: str) -> dict:
    """Loads, then serves `first` / `step` / `close` commands from stdin, one JSON line each."""
    import importlib.metadata as md

    with open(os.path.join(work, "job.json")) as f:
        job = json.load(f)
    with open(os.path.join(work, "meta.json")) as f:
        meta = json.load(f)
    start = time.perf_counter()
    model, cfg, diff = _load_tunix_model(work, meta)
    make = {"rollout": _worker_rollout, "update": _worker_update}[job["mode"]]
    bench = common.LocalBench(*make(work, job, model, cfg))
    versions = {k: md.version(k) for k in ("google-tunix", "jax", "flax", "safetensors")}
    info = dict(logits_max_diff=diff, setup_s=time.perf_counter() - start, versions=versions)
    common.emit_json("WORKER", info)
    for line in sys.stdin:
        command = line.strip()
        if command == "first":
            common.emit_json("WORKER", {"first": bench.first()})
        elif command == "step":
            common.emit_json("WORKER", {"step": bench.step()})
        elif command == "close":
            result = bench.close()
            common.emit_json("WORKER", result)
            return result
    raise WorkerError("the driver closed stdin without `close`")


if __name__ == "__main__":
    main()
