"""Update-step throughput and MFU: gvpo_jax GVPO/GRPO vs plain PyTorch vs tunix 0.1.7 GRPO.

Run from the repo root: `.venv/bin/python -m benchmarks.update_step [--repeats 3] [--quick]`
(about 8 minutes on 2 cores with tunix set up by `bash benchmarks/setup_tunix.sh`; each
bench-45m update is ~1.5 TFLOP). One update = forward, token log-probs, loss, backward, global-norm
clipping and AdamW on 32 sequences (8 prompts x 4 responses) of 64 left-padded prompt + 128
response tokens. Ours is the project's real step: the jitted update of `assemble.step_functions`
(the trainer's own binding, on a one-device mesh), which runs each group's prompt once
(`Transformer.hidden_shared_prefix`). The plain PyTorch update uses transformers'
Qwen2ForCausalLM on the same weights, the same losses written in torch, torch.optim.AdamW and
2 threads. Tunix runs its `grpo_loss_fn` inside its RL Trainer's jitted train step (worker in
.venv-tunix, see tunix_rollout.py). All see the same tokens, rewards and old/ref log-probs, and the
first-step losses are printed side by side as a check that they compute the same thing.

Prints: the machine, the measured fp32 matmul peak (jnp.dot and torch.mm, n = 1024..4096),
a table (first call, XLA compile time, best/median step time, tokens/s, GFLOP/s, MFU, best CPU
time and CPU-time MFU, recompiles after the first step, load average), and the ratios against the
issue's targets. Implementations are timed round-robin (common.interleave), so a drifting load
on a shared machine hits them alike; CPU-time figures are the load-robust cross-check.
FLOPs per update: 6*N*B*T + 12*L*d*B*T^2 (see benchmarks/common.py), the same count for every
implementation: it charges every row its prompt, which our step runs once per group.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import common, tunix_rollout  # noqa: E402
from gvpo_jax import assemble, losses, sharding, train_step  # noqa: E402
from gvpo_jax import batch as batch_lib  # noqa: E402
from gvpo_jax import config as config_lib  # noqa: E402
from gvpo_jax.batch import UpdateBatch  # noqa: E402

LR, BETA, KL_COEF = 1e-6, 0.1, 0.04  # GVPO beta (official script); GRPO preset's k3 KL coef
QUICK = dict(prompts=2, group=2, prompt_len=8, new_tokens=8)
FULL = dict(
    prompts=common.PROMPTS,
    group=common.SAMPLES,
    prompt_len=common.PROMPT_LEN,
    new_tokens=common.NEW_TOKENS,
)


def make_batch(model, *, prompts, group, prompt_len, new_tokens, chunk, seed=0) -> dict:
    """A rollout batch in the trainer's layout (`batch.layout_batch`), as numpy arrays.

    Random full-length prompts and responses (EOS disabled), uniform rewards; old_logp and
    ref_logp = the model's own log-probs plus noise (0.1 and 0.01 nats), so ratios move off 1
    (some clip) and the policy, KL and GVPO terms all enter the first-step loss that the
    implementations are checked on. Also the GRPO advantages, for tunix (which takes them
    precomputed).
    """
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompt_ids = common.random_prompts(vocab, prompts, prompt_len, seed=seed)
    b = prompts * group
    responses = rng.integers(1, vocab, (b, new_tokens)).astype(np.int32)
    mask = np.ones((b, new_tokens), np.float32)
    batch = batch_lib.layout_batch(
        prompt_ids.tolist(), responses, mask, group_size=group, prompt_len=prompt_len, pad_id=0
    )
    batch["rewards"] = rng.random(b).astype(np.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rules = sharding.logical_rules(one, model.config)
    logprobs = train_step.jit_logprobs(
        graphdef, prompt_len=prompt_len, chunk_size=chunk, mesh=one,
        param_shardings=sharding.param_shardings(params, one, rules), rules=rules,
    )  # fmt: skip
    old = logprobs(params, batch["tokens"], batch["attn_mask"])
    noise = lambda scale: scale * rng.standard_normal((b, new_tokens)).astype(np.float32)
    batch["old_logp"] = (np.asarray(old) + noise(0.1)) * mask
    batch["ref_logp"] = (np.asarray(old) + noise(0.01)) * mask
    adv = losses.group_advantages(jnp.asarray(batch["rewards"]), group, scale="group")
    batch["advantages"] = np.asarray(adv, np.float32)
    return batch


def executed_flops(dims: dict, *, prompts, group, prompt_len, new_tokens) -> float:
    """Matmul FLOPs our update executes (forward + backward = 3x the forward's 2 per MAC).

    The issue's convention (`common.update_flops`) charges every row its prompt and every
    position the output layer. Our step runs the layers on each group's prompt once plus every
    response token, the output layer on the response positions only (4 products per token:
    forward, its recompute in the blocked log-prob backward, and the two gradients), and
    attention for P prompts over themselves and B responses over prompt + response (full,
    unmasked score blocks, as the convention counts).
    """
    b = prompts * group
    vd = dims["vocab"] * dims["d_model"]
    body = common.matmul_weights(**dims) - vd
    d = dims["heads"] * dims["head_dim"]
    layer_tokens = b * new_tokens + prompts * prompt_len
    head = 8.0 * vd * b * new_tokens
    pairs = prompts * prompt_len**2 + b * new_tokens * (prompt_len + new_tokens)
    return 6.0 * body * layer_tokens + head + 12.0 * dims["layers"] * d * pairs


def bench_config(algo: str, *, prompts, group, prompt_len, new_tokens, chunk):
    """The trainer's config for this benchmark's update (AdamW at LR, clip 1, constant lr)."""
    c = config_lib.base_config()
    c.algo.name, c.algo.beta = algo, BETA
    if algo != "gvpo":
        c.algo.kl_coef = KL_COEF
    c.rollout.prompts_per_step, c.rollout.group_size = prompts, group
    c.rollout.max_new_tokens, c.data.max_prompt_len = new_tokens, prompt_len
    c.model.logprob_chunk = chunk
    c.optim.lr, c.optim.grad_clip = LR, 1.0
    c.train.steps = 10**6  # a constant schedule: its length does not matter
    # Two passes over a rollout: the update batch carries pi_old from its log-prob pass (the
    # batch's old_logp, which the PyTorch side's ratios use too); the timed update is one pass.
    c.algo.num_epochs = 2
    c.train.kl_ref_metric = algo != "gvpo"  # ref_logp only where the loss reads it
    return c


def ours_bench(model, batch, algo, *, group, prompt_len, new_tokens, chunk) -> common.LocalBench:
    """The trainer's jitted update (state donated), repeated on the same batch."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.copy, params)  # the update donates them; keep the model intact
    prompts = batch["rewards"].shape[0] // group
    config = bench_config(algo, prompts=prompts, group=group, prompt_len=prompt_len,
                          new_tokens=new_tokens, chunk=chunk)  # fmt: skip
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rules = sharding.logical_rules(one, model.config)
    rng = jax.random.key_data(jax.random.key(0))
    tx, shardings, updater = assemble.step_functions(config, graphdef, params, rng, one, rules)
    data = update_batch(batch, updater.spec)
    state = [train_step.init_state_sharded(params, tx, rng, one, rules)[0]]
    first_loss = []

    def call():
        state[0], metrics = updater.update(state[0], data)
        jax.block_until_ready((state[0], metrics))
        first_loss.append(float(metrics["loss"]))

    def info():  # compiled shapes per program of the update: 1 each, nothing recompiles
        return dict(cache_size=max(updater.compiled_shapes().values()), first_loss=first_loss[0])

    def memory():
        # XLA's memory analysis of this update as one program (the state, the batch and the
        # accumulated gradients at once: `plan.compile_train_step`'s upper bound), not timed.
        whole = train_step.jit_update(
            assemble.rl_loss_fn(config, graphdef), tx, config.optim.micro_batches,
            mesh=one, state_shardings=shardings, rules=rules,
        )  # fmt: skip
        dev = sharding.device_batch(data.arrays(), one)
        return whole.lower(state[0], data.replace(**dev)).compile().memory_analysis()

    bench = common.LocalBench(call, info)
    bench.memory = memory
    return bench


def update_batch(batch: dict, spec) -> UpdateBatch:
    """The benchmark's rows as the trainer's update batch carries them under `spec` (one update
    per step: pi_old from the update's own forward, the sampler's log-probs beside it)."""
    rows = len(batch["rewards"])
    return UpdateBatch(
        tokens=batch["tokens"],
        valid=batch["attn_mask"],
        loss_mask=batch["resp_mask"],
        rewards=batch["rewards"],
        old_logp=batch["old_logp"] if spec.old_logp else None,
        ref_logp=batch["ref_logp"] if spec.ref_logp else None,
        sampler_logp=batch["old_logp"] if spec.sampler_logp else None,
        drawn=np.ones(rows, np.float32) if spec.sampler_logp else None,
    )


# ----------------------------------------------------------------------------- plain PyTorch


def torch_loss(algo, logp, batch, group):
    """GVPO / GRPO losses written directly in torch (the SPEC's formulas, fp32)."""
    import torch

    t = lambda k: torch.from_numpy(np.array(batch[k]))  # a writable copy
    mask, old, rewards = t("resp_mask"), t("old_logp"), t("rewards")
    if algo == "gvpo":
        r = BETA * ((logp * mask).sum(-1) - (old * mask).sum(-1)).view(-1, group)
        a = rewards.view(-1, group)
        d = (r - r.mean(1, keepdim=True)) - (a - a.mean(1, keepdim=True))
        return (0.5 * d**2).sum(1).div(group - 1).mean()
    rg = rewards.view(-1, group)
    adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    diff = torch.clamp(t("ref_logp") - logp, -20.0, 20.0)
    k3 = torch.clamp(torch.exp(diff) - diff - 1.0, -10.0, 10.0)
    per_tok = pg + KL_COEF * k3
    return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def torch_bench(hf_dir, batch, algo, *, group, prompt_len, threads=2) -> common.LocalBench:
    """transformers Qwen2ForCausalLM + torch losses + clip_grad_norm_ + AdamW, eager, 2 threads."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    tokens = torch.from_numpy(batch["tokens"]).long()
    attn = torch.from_numpy(batch["attn_mask"]).long()
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    n = tokens.shape[1] - prompt_len
    targets = tokens[:, prompt_len:]
    mask = torch.from_numpy(batch["resp_mask"])
    first_loss = []

    def call():
        opt.zero_grad(set_to_none=True)
        # Only the N+1 last positions need logits: hidden state s-1 predicts token s.
        out = model(
            input_ids=tokens, attention_mask=attn, position_ids=positions, logits_to_keep=n + 1
        )
        logits = out.logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0] * mask
        loss = torch_loss(algo, logp, batch, group)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        first_loss.append(float(loss.detach()))

    return common.LocalBench(call, lambda: dict(first_loss=first_loss[0]))


# ----------------------------------------------------------------------------- report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per implementation")
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes (tests)")
    parser.add_argument("--chunk", type=int, default=128, help="log-prob chunk (config default)")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--skip-tunix", action="store_true")
    args = parser.parse_args(argv)

    shape = QUICK if args.quick else FULL
    p, g, tp, n = shape["prompts"], shape["group"], shape["prompt_len"], shape["new_tokens"]
    model = common.bench_model(args.quick)
    dims = common.dims_of(model.config)
    b, t = p * g, tp + n
    flops = common.update_flops(dims, b, t)
    print(f"# Update step ({'quick' if args.quick else 'bench-45m'})")
    print(common.describe_machine())
    print(
        f"{b} sequences x ({tp} + {n}) tokens; N = {common.matmul_weights(**dims) / 1e6:.1f}M "
        f"matmul weights; {flops / 1e9:.1f} GFLOP per update; lr {LR}, grad clip 1.0"
    )
    sizes = (256,) if args.quick else common.PEAK_SIZES
    peak = common.measure_peak(sizes, torch=not args.skip_torch)
    batch = make_batch(model, **shape, chunk=args.chunk)

    benches = {}
    for algo in ("gvpo", "grpo"):
        benches[f"gvpo_jax {algo.upper()}"] = ours_bench(
            model, batch, algo, group=g, prompt_len=tp, new_tokens=n, chunk=args.chunk
        )
    with tempfile.TemporaryDirectory() as work:
        tunix_rollout.export_for_worker(model, work)
        if not args.skip_torch:
            for algo in ("gvpo", "grpo"):
                benches[f"PyTorch {algo.upper()}"] = torch_bench(
                    work, batch, algo, group=g, prompt_len=tp
                )
        if not args.skip_tunix:
            np.savez(os.path.join(work, "batch.npz"), **batch)
            try:
                benches["tunix GRPO"] = tunix_rollout.TunixWorker(
                    "update", work, group_size=g, prompt_len=tp, kl_coef=KL_COEF, lr=LR
                )
            except tunix_rollout.WorkerError as e:
                print(f"tunix: not measured: {e}")
        rows = common.interleave(benches, args.repeats)
    if "tunix GRPO" in rows:
        print(f"tunix versions: {rows['tunix GRPO']['versions']}")
    peak = peak.merge(common.measure_peak(sizes, torch=not args.skip_torch))
    print(peak.describe() + "\n")

    table = [
        [
            name,
            f"{r['first_loss']:.6f}",
            *common.perf_cells(r, flops=flops, tokens=b * t, peak=peak),
        ]
        for name, r in rows.items()
    ]
    print(common.md_table(["update", "first-step loss", *common.PERF_HEADERS], table))

    timing = {k: common.Timing.from_dict(r["timing"]) for k, r in rows.items()}
    summary = dict(rows=rows, peak=peak.flops, flops=flops, shape=shape, ratios={})
    lines = []
    for algo in ("GVPO", "GRPO"):
        ours = timing[f"gvpo_jax {algo}"]
        mfu, cpu_mfu = common.utilisation(flops, ours, peak)
        summary["ratios"][f"{algo} MFU"] = mfu
        summary["ratios"][f"{algo} CPU-time MFU"] = cpu_mfu
        lines.append(common.ratio_line(f"{algo} MFU (wall)", mfu, 0.55))
        lines.append(common.ratio_line(f"{algo} MFU (CPU time)", cpu_mfu, 0.55))
        pairs = [(f"PyTorch {algo}", 1.1)] + ([("tunix GRPO", 1.5)] if algo == "GRPO" else [])
        for other, target in pairs:
            if other in timing:
                ratio = timing[other].best / ours.best
                cpu_ratio = timing[other].best_cpu / ours.best_cpu
                summary["ratios"][f"{algo} vs {other.split()[0]}"] = ratio
                summary["ratios"][f"{algo} vs {other.split()[0]} (CPU time)"] = cpu_ratio
                lines.append(common.ratio_line(f"{algo} speed-up over {other}", ratio, target))
                lines.append(
                    common.ratio_line(f"{algo} speed-up over {other} (CPU time)", cpu_ratio, target)
                )
    # Utilisation on the FLOPs our step really executes (prompts once per group, output layer
    # on the response positions): the convention's figures above overstate it.
    done = executed_flops(dims, prompts=p, group=g, prompt_len=tp, new_tokens=n)
    for name in ("gvpo_jax GVPO", "gvpo_jax GRPO"):
        mfu, cpu_mfu = common.utilisation(done, timing[name], peak)
        summary["ratios"][f"{name} executed-FLOP MFU"] = mfu
        summary["ratios"][f"{name} executed-FLOP CPU-time MFU"] = cpu_mfu
        lines.append(
            f"{name}: executes {done / 1e9:.1f} GFLOP ({done / flops:.0%} of the convention's); "
            f"MFU on those {mfu:.1%} wall, {cpu_mfu:.1%} CPU time"
        )
    ours_recompiles = sum(r["recompiles"] for k, r in rows.items() if k.startswith("gvpo_jax"))
    lines.append(common.ratio_line("gvpo_jax recompiles after the first step", ours_recompiles, 0,
                                   higher_is_better=False))  # fmt: skip
    print("\n" + "\n".join(lines))
    common.emit_json("UPDATE_STEP", summary)
    return summary


if __name__ == "__main__":
    main()
