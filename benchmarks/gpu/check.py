"""The GPU check: what gvpo_jax does on one accelerator, in one short run (issue 51).

Made for a lease of minutes on one NVIDIA H100 (no network, Python 3.12, JAX 0.11 with the CUDA
plugin, PyTorch and transformers in the image; the rest of our dependencies travel as wheels,
`benchmarks/gpu/wheels.sh`). Run there by `bash benchmarks/gpu/run.sh` (under 5 minutes);
`python -m benchmarks.gpu.check --tiny` runs every part on the CPU with tiny shapes (the suite
does, so the check cannot rot).

Parts, in order of what a cut-off run most needs; each runs in its own process with its own time
limit (a crash or a hang costs that part only) and appends its JSON record to `check.jsonl` as it
finishes, so a run cut off at any point still reports what it did:

- env: versions, the device, bf16 matmul throughput (8192^3, the MFU denominator) and memory
  bandwidth (a jitted copy, bytes read + written per second: the decode floor's denominator).
- tests: a GPU subset of the suite (model parity with transformers, the sampler against
  `generate` and the softmax, losses against float64, a train step, the attention kernels).
- rollout:PRESET / hf:PRESET: `sampler.generate` of random-weight bf16 models of the preset's
  shapes against `transformers.generate` of the same shapes on the same GPU (separate process),
  and against the memory-bandwidth floor (every weight and the KV cache read once per step);
  rollout-unrolled:PRESET the same rollout with the layers unrolled (`model.scan_layers` off),
  rollout-sliced:PRESET with the scanned layers sliced once per call and run unrolled
  (`model.scan_decode` off, XLA CPU's faster decode): which of the three is fastest here.
- update:PRESET: the trainer's RL update (GRPO, fp32 masters, bf16 compute) and its MFU against
  the measured bf16 peak, with the compile time.
- attention: the kernel `auto` picks on this platform against the dense one through a 2-layer
  model at T = 2048 (values, gradients, time), and whether cuDNN's fused kernel ran.
- moe: one Qwen3-30B-A3B MoE layer's experts (D 2048, F 768, E 128, top-8) on 4096 bf16 tokens
  of a fixed random routing: `jax.lax.ragged_dot` (`models.moe.ragged`, the TPU / GPU path)
  against the grouped path (`models.moe.grouped`) and a dense SwiGLU of the active width (F * 8),
  forward and forward + backward (time, TFLOP/s of the active FLOPs, compile time, XLA's
  temporaries), and ragged's values and gradients against grouped's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
import traceback

# GPU sessions: the tests' compile flags are CPU flags, and each part takes the GPU's memory as
# it needs it (a part that runs torch beside JAX would otherwise find 75% of it taken).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The suite's tests that need one device and say most about a GPU. Each is a file's test
# function (all its parameters); `tests` checks they all collect.
GPU_TESTS = (
    "tests/test_models.py::test_logit_parity_with_transformers",
    "tests/test_models.py::test_logit_parity_padded_batches",
    "tests/test_models.py::test_cache_prefill_then_decode_equals_full_forward",
    "tests/test_models.py::test_bf16_compute_logits_against_fp32_and_transformers_bf16",
    "tests/test_models.py::test_greedy_generation_matches_transformers_generate",
    "tests/test_models.py::test_chunked_token_logprobs_equal_naive_values_and_gradients",
    "tests/test_sampler.py::test_greedy_matches_transformers_generate",
    "tests/test_sampler.py::test_bf16_greedy_matches_transformers_in_bf16",
    "tests/test_sampler.py::test_first_and_second_token_distributions",
    "tests/test_sampler.py::test_returned_logps_equal_recomputed",
    "tests/test_losses.py::test_loss_value_and_gradient_match_float64_numpy_reference",
    "tests/test_losses.py::test_gradient_matches_central_finite_differences",
    "tests/test_attention.py::test_kernels_match_dense_through_the_model_values_and_gradients",
    "tests/test_attention.py::test_kernels_in_bf16_compute_agree_with_dense_bf16",
    "tests/test_train.py::test_gvpo_first_update_gradient_is_minus_beta_a_over_g_minus_1",
    "tests/test_train.py::test_bf16_compute_update_moves_the_fp32_masters_like_fp32_compute",
)
# Splash is a TPU kernel (interpret mode elsewhere: minutes on a GPU, and it says nothing).
GPU_TESTS_DESELECT = "not splash"

# Workloads. Full: an RL step's rollout (32 prompts x 4, prompt 128, 256 new tokens, EOS off)
# and update (8 prompts x 4, prompt 128 + 384 response tokens). Tiny: the same code on CPU.
FULL = dict(
    presets=("qwen2.5-0.5b", "qwen3-1.7b"),
    rollout=dict(prompts=32, group=4, prompt_len=128, new_tokens=256, repeats=3),
    update=dict(prompts=8, group=4, prompt_len=128, new_tokens=384, repeats=3, chunk=128),
    attention=dict(preset="qwen3-1.7b", rows=8, length=2048, layers=2),
    moe=dict(tokens=4096, hidden=2048, width=768, experts=128, top_k=8, repeats=5),
    peak=8192,
    copy_gib=2.0,
)
TINY = dict(
    presets=("tiny",),
    rollout=dict(prompts=2, group=2, prompt_len=8, new_tokens=8, repeats=1),
    update=dict(prompts=2, group=2, prompt_len=8, new_tokens=8, repeats=1, chunk=8),
    attention=dict(preset="tiny", rows=2, length=32, layers=2),
    moe=dict(tokens=64, hidden=32, width=16, experts=8, top_k=2, repeats=1),
    peak=256,
    copy_gib=0.01,
)
# Seconds each part may take on the GPU (the whole check's budget cuts them further).
LIMITS = {"env": 60, "tests": 180, "rollout": 90, "rollout-unrolled": 90, "rollout-sliced": 90,
          "hf": 60, "update": 120, "attention": 60, "moe": 60}  # fmt: skip
# ragged_dot against grouped in bf16 (relative to the largest value / gradient): rounding only.
MOE_TOLERANCE = dict(value=2e-2, grad=5e-2)


def parts(shape: dict) -> list[str]:
    """The parts in run order: what a cut-off run most needs first."""
    first, *rest = shape["presets"]
    out = ["env", "tests", f"rollout:{first}", f"hf:{first}", f"update:{first}", "attention"]
    out.append("moe")  # one Qwen3-30B-A3B MoE layer: ragged_dot against the grouped path
    out.append(f"rollout-unrolled:{first}")  # the same rollout with model.scan_layers off
    out.append(f"rollout-sliced:{first}")  # and with model.scan_decode off
    for preset in rest:
        out += [f"rollout:{preset}", f"hf:{preset}"]
    return out


# ----------------------------------------------------------------------------- the parts


def _model_config(preset: str, *, params: str, compute: str, layers: int | None = None):
    from gvpo_jax import models

    cfg = models.PRESETS[preset].replace(param_dtype=params, compute_dtype=compute)
    return cfg.replace(num_layers=layers) if layers else cfg


def _timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first call, seconds of each later call); fn blocks until done."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, times


def _spread(times: list[float]) -> dict:
    import statistics

    return dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times))


def part_env(shape: dict, tiny: bool) -> dict:
    """Versions, the device, the bf16 matmul peak and memory bandwidth."""
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    dev = jax.devices()[0]
    n = shape["peak"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    dot = jax.jit(lambda a, b: a @ b)
    _, times = _timed(lambda: dot(a, b).block_until_ready(), 10)
    elements = int(shape["copy_gib"] * 2**30 / 4)
    x = jnp.ones((elements,), jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)  # reads and writes every element once
    _, copies = _timed(lambda: copy(x).block_until_ready(), 10)
    smi = ""
    if not tiny:
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            smi = f"nvidia-smi failed: {e}"
    return dict(
        commit=os.environ.get("GVPO_COMMIT"),
        python=sys.version.split()[0],
        jax=jax.__version__,
        jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        flax=flax.__version__,
        optax=optax.__version__,
        numpy=np.__version__,
        backend=jax.default_backend(),
        device=str(dev.device_kind),
        devices=jax.device_count(),
        nvidia_smi=smi,
        bf16_matmul_tflops=2 * n**3 / min(times) / 1e12,
        bf16_matmul_tflops_median=2 * n**3 / sorted(times)[len(times) // 2] / 1e12,
        copy_gb_s=2 * elements * 4 / min(copies) / 1e9,
    )


def part_tests(shape: dict, tiny: bool, limit: float = 150.0) -> dict:
    """The GPU subset of the suite, by pytest (tiny: collected only, so the ids cannot rot).
    Each test's outcome is read from pytest's verbose lines as they come, so a run cut off at
    `limit` still reports the tests it finished."""
    env = dict(os.environ)
    if not tiny:  # the suite's fake CPU devices and CPU compile flags do not apply here
        env.update(XLA_FLAGS="", GVPO_TEST_XLA_FLAGS="", JAX_PLATFORMS="")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", GPU_TESTS_DESELECT,
           *GPU_TESTS]  # fmt: skip
    if tiny:
        cmd[3:3] = ["-q", "--collect-only"]
    else:  # compiling is most of the tests' time (165 s with one worker per file on an H200):
        # tests spread over 8 workers; one line per failure (its assertion) in the output
        cmd[3:3] = ["-v", "--tb=line", "-rf", "-n", str(min(8, os.cpu_count() or 1))]
    start = time.perf_counter()
    output, returncode = _run_group(cmd, limit, env=env)
    wall = time.perf_counter() - start
    if tiny:
        collected = [ln for ln in output.splitlines() if "::" in ln]
        files = {t.split("::")[0] + "::" + t.split("::")[1].split("[")[0] for t in collected}
        missing = [t for t in GPU_TESTS if t not in files]
        return dict(returncode=returncode, collected=len(collected), missing=missing,
                    wall_s=wall, tail=output[-3000:] if returncode else "")  # fmt: skip
    outcomes = {}
    for m in re.finditer(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+)", output):
        outcomes[m.group(2)] = m.group(1)
    counts = collections.Counter(outcomes.values())
    return dict(returncode=returncode, tests=len(outcomes), passed=counts["PASSED"],
                failures=counts["FAILED"], errors=counts["ERROR"], skipped=counts["SKIPPED"],
                failed=[t for t, o in outcomes.items() if o in ("FAILED", "ERROR")],
                finished=returncode is not None, wall_s=wall, tail=output[-4000:])  # fmt: skip


def _run_group(cmd: list[str], limit: float, env: dict | None = None) -> tuple[str, int | None]:
    """(stdout + stderr, return code or None if cut off) of `cmd` run for at most `limit`
    seconds in its own process group: a cut-off kills the whole group (pytest's workers too),
    so nothing it started keeps the GPU or the cores busy for the parts after it."""
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            returncode = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
        out.seek(0)
        return out.read(), returncode


def _bytes_per_step(cfg, rows: int, context: float, dtype_bytes: int = 2) -> float:
    """Bytes one decode step must read: every matmul weight once (the output layer included)
    and each row's cached keys and values over `context` positions."""
    from benchmarks import common

    weights = common.matmul_weights(**common.dims_of(cfg)) * dtype_bytes
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * context * rows
    return weights + kv


def part_rollout(
    shape: dict, tiny: bool, preset: str, env: dict, scan: bool = True, scan_decode: bool = True
) -> dict:
    """`sampler.generate` tokens/s in bf16 (random weights), with the bandwidth floor; `scan`
    False: the layers unrolled (one block per layer) instead of under one scan; `scan_decode`
    False: scanned layers sliced once per call and run unrolled by the sampler."""
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks import common
    from gvpo_jax import models, sampler

    w = shape["rollout"]
    cfg = _model_config(preset, params="bfloat16", compute="bfloat16")
    cfg = cfg.replace(scan_layers=scan, scan_decode=scan_decode)
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    ids = common.random_prompts(cfg.vocab_size, w["prompts"], w["prompt_len"])
    lens = np.full((w["prompts"],), w["prompt_len"], np.int32)
    settings = sampler.SamplingSettings(
        max_new_tokens=w["new_tokens"], group_size=w["group"], temperature=1.0,
        buckets=(w["prompt_len"],),
    )  # fmt: skip
    seed = [0]

    def call():
        seed[0] += 1
        out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(seed[0]))
        jax.block_until_ready(out)
        return out

    rows, n = w["prompts"] * w["group"], w["new_tokens"]
    first, times = _timed(call, w["repeats"])
    out = call()
    assert int(np.asarray(out.lengths_B).min()) == n, "EOS is off: every row runs to the end"
    med = _spread(times)["median_s"]
    # The floor: each decode step reads the weights and every row's cache once, at the measured
    # bandwidth; the prefill's matmuls at the measured bf16 peak.
    bw = env.get("copy_gb_s", float("nan")) * 1e9
    steps = sum(_bytes_per_step(cfg, rows, w["prompt_len"] + t) for t in range(n))
    from benchmarks import common as c

    prefill = 2.0 * c.matmul_weights(**c.dims_of(cfg)) * w["prompts"] * w["prompt_len"]
    peak = env.get("bf16_matmul_tflops", float("nan")) * 1e12
    floor_s = steps / bw + prefill / peak
    return dict(
        preset=preset,
        scan_layers=scan,
        scan_decode=scan_decode,
        rows=rows,
        prompt_len=w["prompt_len"],
        new_tokens=n,
        first_call_s=first,
        compile_s=first - med,
        **_spread(times),
        tokens_per_s=rows * n / med,
        floor_s=floor_s,
        floor_tokens_per_s=rows * n / floor_s,
        share_of_floor=floor_s / med,
    )


def part_hf(shape: dict, tiny: bool, preset: str, env: dict) -> dict:
    """`transformers.generate` of the same shapes, random bf16 weights, on the same device."""
    import numpy as np
    import torch
    import transformers

    from benchmarks import common
    from gvpo_jax import models

    w = shape["rollout"]
    cfg = _model_config(preset, params="bfloat16", compute="bfloat16")
    hf_config = transformers.AutoConfig.for_model(**models.config_to_hf(cfg, "bfloat16"))
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.eval()
    ids = common.random_prompts(cfg.vocab_size, w["prompts"], w["prompt_len"])
    ids = torch.from_numpy(np.repeat(ids, w["group"], axis=0)).long().to(device)
    n = w["new_tokens"]
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
              min_new_tokens=n, attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip

    def call():
        with torch.inference_mode():
            out = model.generate(ids, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return out

    first, times = _timed(call, max(1, w["repeats"] - 1))
    med = _spread(times)["median_s"]
    rows = ids.shape[0]
    return dict(preset=preset, torch=torch.__version__, transformers=transformers.__version__,
                device=device, rows=rows, new_tokens=n, first_call_s=first, **_spread(times),
                tokens_per_s=rows * n / med)  # fmt: skip


def part_update(shape: dict, tiny: bool, preset: str, env: dict) -> dict:
    """The trainer's GRPO update (fp32 masters, bf16 compute) and its MFU."""
    import jax
    from flax import nnx

    from benchmarks import common, update_step
    from gvpo_jax import models

    w = shape["update"]
    cfg = _model_config(preset, params="float32", compute="bfloat16")
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    kw = dict(group=w["group"], prompt_len=w["prompt_len"], new_tokens=w["new_tokens"])
    batch = update_step.make_batch(model, prompts=w["prompts"], chunk=w["chunk"], **kw)
    bench = update_step.ours_bench(model, batch, "grpo", chunk=w["chunk"], **kw)
    first, compile_s = bench.first()
    times = []
    for _ in range(w["repeats"]):
        start = time.perf_counter()
        bench.fn()
        times.append(time.perf_counter() - start)
    flops = update_step.executed_flops(common.dims_of(cfg), prompts=w["prompts"], **kw)
    med = _spread(times)["median_s"]
    peak = env.get("bf16_matmul_tflops", float("nan")) * 1e12
    extras = bench.extras()
    mem = jax.devices()[0].memory_stats() or {}
    return dict(
        preset=preset,
        rows=w["prompts"] * w["group"],
        length=w["prompt_len"] + w["new_tokens"],
        first_call_s=first,
        compile_s=compile_s,
        **_spread(times),
        tflop_per_update=flops / 1e12,
        tflops=flops / med / 1e12,
        mfu=flops / med / peak,
        first_loss=extras.get("first_loss"),
        programs=extras.get("cache_size"),
        peak_bytes_in_use=mem.get("peak_bytes_in_use"),
    )


def part_attention(shape: dict, tiny: bool, env: dict) -> dict:
    """The platform's `auto` kernel against dense through a small model: values, gradients,
    time of a forward + backward, and whether cuDNN's fused attention is in the program."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gvpo_jax import models
    from gvpo_jax.models import attention as kernels

    w = shape["attention"]
    cfg = _model_config(w["preset"], params="float32", compute="bfloat16", layers=w["layers"])
    base = models.Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    b, t = w["rows"], w["length"]
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (b, t)), jnp.int32)
    valid = np.ones((b, t), bool)
    valid[1, : t // 4] = False  # one left-padded row
    valid = jnp.asarray(valid)
    picked = kernels.resolve("auto", q_rows=t * cfg.num_heads // cfg.num_kv_heads, keys=t)
    # Where `auto` is dense itself (small CPU shapes: the tiny mode), the blocked kernel stands in.
    picked = picked if picked != "dense" else "blocked"
    out = dict(platform=jax.default_backend(), auto=picked, rows=b, length=t)
    results = {}
    for name in ("dense", picked):
        model = models.with_config(base, attention=name)
        graphdef = nnx.graphdef(model)

        def run(state, graphdef=graphdef):
            hidden = lambda s: nnx.merge(graphdef, s).hidden(tokens, None, valid)
            loss = lambda s: jnp.sum(
                jnp.where(valid[..., None], hidden(s).astype(jnp.float32), 0.0) ** 2
            )
            return hidden(state), jax.grad(loss)(state)

        fn = jax.jit(run)
        state = nnx.state(model)
        hlo = fn.lower(state).compile().as_text()
        first, times = _timed(lambda fn=fn, state=state: jax.block_until_ready(fn(state)), 3)
        results[name] = fn(state)
        out[name] = dict(first_call_s=first, **_spread(times), cudnn="cudnn" in hlo.lower())
    (dh, dg), (kh, kg) = results["dense"], results[picked]
    m = valid[..., None]
    scale = float(jnp.max(jnp.abs(jnp.where(m, dh.astype(jnp.float32), 0))))
    err = float(jnp.max(jnp.abs(jnp.where(m, (kh - dh).astype(jnp.float32), 0))))
    gscale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(dg))
    gerr = max(float(jnp.max(jnp.abs(a - c))) for a, c in
               zip(jax.tree.leaves(kg), jax.tree.leaves(dg), strict=True))  # fmt: skip
    out.update(value_rel_err=err / scale, grad_rel_err=gerr / gscale,
               speedup=out["dense"]["median_s"] / out[picked]["median_s"])  # fmt: skip
    return out


def part_moe(shape: dict, tiny: bool, env: dict) -> dict:
    """One MoE layer's experts in bf16 on a fixed random routing (top-k of a softmax over random
    logits, renormalised): ragged_dot, the grouped path and a dense SwiGLU of width F * k (the
    active FLOPs), each forward and forward + backward (gradients of sum(y^2) with respect to
    the input and the weights), compiled ahead; then ragged's output and gradients against
    grouped's. A variant that fails (e.g. out of memory) is recorded and the others still run;
    `failures` counts the failed variants and a ragged / grouped disagreement."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gvpo_jax.models import moe as moe_lib
    from gvpo_jax.models.transformer import swiglu

    w = shape["moe"]
    n, d, f, e, k = (w[key] for key in ("tokens", "hidden", "width", "experts", "top_k"))
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def normal(shape, fan_in):
        x = jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)
        return x.astype(jnp.bfloat16)

    x_NxD = normal((n, d), 1)
    experts = (normal((e, d, f), d), normal((e, d, f), d), normal((e, f, d), f))
    mlp = (normal((d, f * k), d), normal((d, f * k), d), normal((f * k, d), f))
    gates_NxK, chosen_NxK, _ = moe_lib.route(normal((n, e), 1), k, normalize=True)
    gates_NxK = gates_NxK.astype(jnp.bfloat16)
    block = moe_lib.block_size(n * k, e, 64)
    blocks = -(-(n * k + e * (block - 1)) // block)

    def ragged(x, ws):
        return moe_lib.ragged(x, *ws, gates_NxK, chosen_NxK, swiglu)

    def grouped(x, ws):
        return moe_lib.grouped(x, *ws, gates_NxK, chosen_NxK, swiglu, block=block)

    def dense(x, ws):
        gate, up, down = ws
        return swiglu(x @ gate, x @ up) @ down

    variants = {"ragged": (ragged, experts), "grouped": (grouped, experts), "dense": (dense, mlp)}
    active = 2.0 * n * k * 3 * d * f  # the forward's FLOPs; the backward's are twice as many
    peak = env.get("bf16_matmul_tflops", float("nan")) * 1e12
    out = dict(platform=jax.default_backend(), tokens=n, hidden=d, width=f, experts=e, top_k=k,
               grouped_rows=blocks * block, grouped_block=block, failures=0)  # fmt: skip
    results = {}
    for name, (fn, ws) in variants.items():
        loss = lambda x, ws, fn=fn: jnp.sum(fn(x, ws).astype(jnp.float32) ** 2)
        passes = (("forward", fn, active), ("forward+backward", jax.grad(loss, (0, 1)), 3 * active))
        for p, prog, flops in passes:
            key = f"{name} {p}"
            try:
                start = time.perf_counter()
                compiled = jax.jit(prog).lower(x_NxD, ws).compile()
                compile_s = time.perf_counter() - start
                call = lambda c=compiled, ws=ws: jax.block_until_ready(c(x_NxD, ws))
                _, times = _timed(call, w["repeats"])
                results[key] = compiled(x_NxD, ws)
                med = _spread(times)["median_s"]
                mem = compiled.memory_analysis()
                out[key] = dict(compile_s=compile_s, **_spread(times), tflops=flops / med / 1e12,
                                mfu=flops / med / peak,
                                temp_bytes=getattr(mem, "temp_size_in_bytes", None))  # fmt: skip
                if name == "ragged" and p == "forward":  # how XLA lowered ragged_dot here
                    hlo = compiled.as_text()
                    out["ragged_custom_calls"] = sorted(
                        set(re.findall(r'custom_call_target="([^"]+)"', hlo))
                    )
                    out["ragged_dot_in_hlo"] = "ragged-dot" in hlo
            except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
                out[key] = dict(error=f"{type(err).__name__}: {str(err)[:500]}")
                out["failures"] += 1
    if "ragged forward" in results and "grouped forward" in results:
        r, g = (np.asarray(results[f"{v} forward"], np.float32) for v in ("ragged", "grouped"))
        out["value_rel_err"] = float(np.max(np.abs(r - g)) / np.max(np.abs(g)))
    if "ragged forward+backward" in results and "grouped forward+backward" in results:
        pairs = zip(*(jax.tree.leaves(results[f"{v} forward+backward"])
                      for v in ("ragged", "grouped")), strict=True)  # fmt: skip
        out["grad_rel_err"] = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            / float(jnp.max(jnp.abs(b.astype(jnp.float32))))
            for a, b in pairs
        )
    agree = out.get("value_rel_err", 1.0) <= MOE_TOLERANCE["value"]
    agree = agree and out.get("grad_rel_err", 1.0) <= MOE_TOLERANCE["grad"]
    out["ragged_matches_grouped"] = agree
    out["failures"] += not agree
    for p in ("forward", "forward+backward"):
        if "median_s" in out.get(f"ragged {p}", {}) and "median_s" in out.get(f"grouped {p}", {}):
            out[f"ragged_speedup_vs_grouped {p}"] = (
                out[f"grouped {p}"]["median_s"] / out[f"ragged {p}"]["median_s"]
            )
    return out


# ----------------------------------------------------------------------------- the runner


def run_part(name: str, tiny: bool, env: dict) -> dict:
    shape = TINY if tiny else FULL
    kind, _, preset = name.partition(":")
    if kind == "env":
        return part_env(shape, tiny)
    if kind == "tests":  # pytest stops 15 s before the part's limit, to report what it ran
        return part_tests(shape, tiny, float(os.environ.get("GVPO_GPU_LIMIT", 165)) - 15)
    if kind == "attention":
        return part_attention(shape, tiny, env)
    if kind == "moe":
        return part_moe(shape, tiny, env)
    if kind == "rollout-unrolled":
        return part_rollout(shape, tiny, preset, env, scan=False)
    if kind == "rollout-sliced":
        return part_rollout(shape, tiny, preset, env, scan_decode=False)
    fn = {"rollout": part_rollout, "hf": part_hf, "update": part_update}[kind]
    return fn(shape, tiny, preset, env)


def _child(args) -> int:
    """One part in this process: its record (or its error) as one JSON line on stdout."""
    env = json.loads(args.env) if args.env else {}
    start = time.perf_counter()
    try:
        record = dict(part=args.part, ok=True, **run_part(args.part, args.tiny, env))
    except Exception as e:  # noqa: BLE001 - the record says what broke; the check goes on
        record = dict(part=args.part, ok=False, error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc()[-2000:])  # fmt: skip
    record["wall_s"] = time.perf_counter() - start
    print("GPU-CHECK-RECORD " + json.dumps(record, default=str), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu_check", help="folder for check.jsonl / .log")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (the suite)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole check")
    parser.add_argument("--only", default="", help="comma-separated part names (default: all)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # run one part (the child process)
    parser.add_argument("--env", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return _child(args)
    os.makedirs(args.out, exist_ok=True)
    records_path, log_path = (os.path.join(args.out, f) for f in ("check.jsonl", "check.log"))
    shape = TINY if args.tiny else FULL
    todo = [p for p in parts(shape) if not args.only or p in args.only.split(",")]
    deadline, env, failed = time.monotonic() + args.budget, {}, 0
    for name in todo:
        left = deadline - time.monotonic()
        limit = min(LIMITS[name.split(":")[0]], left)
        if limit < 10:
            record = dict(part=name, ok=False, error=f"skipped: {left:.0f} s of the budget left")
        else:
            cmd = [sys.executable, "-m", "benchmarks.gpu.check", "--part", name,
                   "--env", json.dumps(env)] + (["--tiny"] if args.tiny else [])  # fmt: skip
            record = _run_child(cmd, limit, name, log_path)
        if name == "env" and record.get("ok"):
            env = {k: record[k] for k in ("bf16_matmul_tflops", "copy_gb_s")}
        failed += not record.get("ok") or bool(record.get("failures") or record.get("errors"))
        with open(records_path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        print(summary(record), flush=True)
    return 1 if failed else 0


def _run_child(cmd: list[str], limit: float, name: str, log_path: str) -> dict:
    """Runs one part's process (group) for at most `limit` seconds; its output goes to the
    log, its record (the line it prints) is returned."""
    start = time.perf_counter()
    output, returncode = _run_group(cmd, limit, env=dict(os.environ, GVPO_GPU_LIMIT=str(limit)))
    with open(log_path, "a") as f:
        f.write(f"===== {name} =====\n{output}\n")
    for line in output.splitlines():
        if line.startswith("GPU-CHECK-RECORD "):
            return json.loads(line[len("GPU-CHECK-RECORD ") :])
    why = f"timed out after {limit:.0f} s" if returncode is None else "the process died"
    return dict(part=name, ok=False, error=why, wall_s=time.perf_counter() - start,
                tail=output[-1500:])  # fmt: skip


def summary(record: dict) -> str:
    """One line per part for the console."""
    name, wall = record["part"], record.get("wall_s", 0.0)
    if not record.get("ok"):
        return f"{name:<22} FAILED ({wall:.0f} s): {record.get('error')}"
    kind = name.split(":")[0]
    if kind == "env":
        text = (f"{record['device']} ({record['backend']}), jax {record['jax']}, flax "
                f"{record['flax']}; bf16 matmul {record['bf16_matmul_tflops']:.0f} TFLOP/s, "
                f"copy {record['copy_gb_s']:.0f} GB/s")  # fmt: skip
    elif kind == "tests":
        if "collected" in record:
            text = f"{record['collected']} collected, missing {record['missing']}"
        else:
            bad = record["failed"]
            text = (f"{record['passed']} passed, {record['failures']} failed, "
                    f"{record['errors']} errors, {record['skipped']} skipped"
                    f"{'' if record['finished'] else ' (cut off)'} {bad}")  # fmt: skip
    elif kind in ("rollout", "rollout-unrolled", "rollout-sliced", "hf"):
        text = f"{record['tokens_per_s']:.0f} tokens/s (median of {record['rows']} rows)"
        if kind != "hf":
            text += (f", floor {record['floor_tokens_per_s']:.0f} ({record['share_of_floor']:.0%}"
                     f"), compile {record['compile_s']:.1f} s")  # fmt: skip
    elif kind == "moe":
        cells = []
        for p in ("forward", "forward+backward"):
            times = [f"{v} " + (f"{record[f'{v} {p}']['median_s'] * 1e3:.2f}"
                                if "median_s" in record.get(f"{v} {p}", {}) else "failed")
                     for v in ("ragged", "grouped", "dense")]  # fmt: skip
            cells.append(f"{p} ms: " + ", ".join(times))
        errs = [record.get(f"{v}_rel_err", float("nan")) for v in ("value", "grad")]
        same = record["ragged_matches_grouped"]
        cells.append(f"ragged == grouped {same} (errors {errs[0]:.1e}, {errs[1]:.1e})")
        text = "; ".join(cells)
    elif kind == "update":
        text = (f"{record['median_s'] * 1e3:.0f} ms/update, {record['tflops']:.1f} TFLOP/s, MFU "
                f"{record['mfu']:.1%}, compile {record['compile_s']:.1f} s")  # fmt: skip
    else:
        text = (f"{record['auto']}: x{record['speedup']:.2f} vs dense, value err "
                f"{record['value_rel_err']:.1e}, grad err {record['grad_rel_err']:.1e}, "
                f"cudnn {record[record['auto']]['cudnn']}")  # fmt: skip
    return f"{name:<22} ok ({wall:.0f} s): {text}"


if __name__ == "__main__":
    sys.exit(main())
