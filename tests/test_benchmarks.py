"""Benchmarks: FLOP conventions, timing helpers, each script's --quick run printing its tables."""

import math
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import common, scaling, tunix_rollout, update_step
from gvpo_jax import models


def test_matmul_weights_counts_every_kernel_and_the_tied_output_layer():
    # Independent count from the real model: every matmul kernel plus the embedding, which the
    # tied output layer reuses (one [V, D] matrix, multiplied at the output).
    model = models.abstract_model(models.PRESETS["bench-45m"])
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    names = [(jax.tree_util.keystr(path), x.shape) for path, x in flat]
    kernels = sum(math.prod(s) for k, s in names if "kernel" in k or "embedding" in k)
    assert kernels == 32768 * 512 + 8 * (512 * 512 + 2 * 512 * 128 + 512 * 512 + 3 * 512 * 1408)
    assert common.matmul_weights(**common.BENCH_45M) == kernels  # embedding counted once: tied
    assert common.dims_of(models.PRESETS["bench-45m"]) == common.BENCH_45M


def test_flop_formulas_match_the_issue_conventions():
    d = common.BENCH_45M
    n = common.matmul_weights(**d)
    b, t = 32, 192
    assert common.update_flops(d, b, t) == 6 * n * b * t + 12 * 8 * 512 * b * t * t
    p, g = 64, 128
    ctx = sum(range(1, p + g + 1))
    assert common.generation_flops(d, b, p, g) == 2 * n * b * (p + g) + 4 * 8 * 512 * b * ctx


def test_fit_line_recovers_slope_and_r2():
    x = np.array([2.0, 4.0, 8.0, 16.0])
    fit = scaling.fit_line(x, 0.5 + 0.25 * x)
    assert fit["slope"] == pytest.approx(0.25) and fit["intercept"] == pytest.approx(0.5)
    assert fit["r2"] == pytest.approx(1.0)
    assert scaling.fit_line(x, x**3)["r2"] < 0.95  # a cubic is visibly not linear


def test_time_calls_counts_recompiles_after_the_first_call():
    f = jax.jit(lambda x: x * 2.0)
    shapes = iter([3, 3, 3, 4, 4])
    timing, recompiles = common.time_calls(
        lambda: f(np.ones(next(shapes), np.float32)).block_until_ready(), 4
    )
    assert recompiles == 1  # the new shape, not the repeated ones
    assert len(timing.times_s) == 4 and timing.best <= timing.median
    assert timing.compile_s > 0


def test_update_step_quick_prints_table_and_matches_pytorch(capsys):
    summary = update_step.main(["--quick", "--repeats", "1", "--skip-tunix"])
    out = capsys.readouterr().out
    assert "| update | first-step loss |" in out and "GVPO MFU" in out
    rows = summary["rows"]
    for algo in ("GVPO", "GRPO"):
        ours, torch_row = rows[f"gvpo_jax {algo}"], rows[f"PyTorch {algo}"]
        assert ours["recompiles"] == 0 and ours["cache_size"] == 1
        # Same weights, same batch, same formulas: the first-step losses must agree.
        assert ours["first_loss"] == pytest.approx(torch_row["first_loss"], rel=1e-3, abs=1e-6)
        assert ours["first_loss"] > 0
    assert summary["peak"] > 0 and summary["ratios"]["GVPO vs PyTorch"] > 0
    # Prompts once per group and logits on response positions only: fewer FLOPs than counted.
    assert 0 < summary["ratios"]["gvpo_jax GVPO executed-FLOP MFU"] < summary["ratios"]["GVPO MFU"]


def test_scaling_quick_rollout_sweeps_print_tables_and_fits(capsys):
    # The update sweeps run the same `sweep` code on update_step's pieces (tested above); only
    # the rollout half runs here to keep the compile count (and test time) down.
    results = scaling.main(["--quick", "--repeats", "1", "--only", "rollout"])
    out = capsys.readouterr().out
    assert set(results) == {"rollout vs G", "rollout vs N"}
    for name, r in results.items():
        assert f"## {name}" in out
        assert len(r["points"]) == 2 and math.isfinite(r["fit"]["slope"])
        assert all(t["best"] > 0 for _, t, _ in r["points"])
    assert "## Linear fits" in out and "| rollout vs N |" in out


def test_rollout_quick_without_tunix_times_ours_and_transformers(capsys, monkeypatch):
    monkeypatch.setenv("TUNIX_PYTHON", "/nonexistent/python")
    summary = tunix_rollout.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "tunix: not measured: no .venv-tunix" in out
    assert "| transformers generate |" in out
    assert summary["speedups"]["transformers generate"] > 0
    assert (
        "| gvpo_jax generate |" in out and summary["rows"]["gvpo_jax generate"]["recompiles"] == 0
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not (os.environ.get("RUN_TUNIX_BENCH") and tunix_rollout.tunix_python()),
    reason="opt-in (RUN_TUNIX_BENCH=1) and needs .venv-tunix from benchmarks/setup_tunix.sh",
)
def test_tunix_worker_quick_loads_same_weights_and_samples(capsys):
    summary = tunix_rollout.main(["--quick", "--repeats", "1"])
    assert "tunix Sampler" in summary["rows"], capsys.readouterr().out
    assert summary["rows"]["tunix Sampler"]["logits_max_diff"] < 1e-3
    assert summary["speedups"]["tunix Sampler"] > 0


def test_update_flops_shared_counts_each_prompt_once_and_the_head_on_responses_only():
    dims = dict(vocab=10, d_model=4, layers=2, heads=2, kv_heads=1, head_dim=2, mlp=6)
    n = common.matmul_weights(**dims)  # 2 * (16 + 16 + 16 + 72) + 40
    assert n == 280
    # No prompt: every token is a response token, so both counts agree.
    assert common.update_flops_shared(dims, 3, 2, 0, 5) == common.update_flops(dims, 6, 5)
    # 1 prompt of 3 tokens x 2 rows of 5 response tokens: layers (240 weights) see 3 + 10
    # tokens, the output layer (40) 10, attention 12 * 2 * 4 * 2 * 8^2.
    expected = 6.0 * 240 * 13 + 6.0 * 40 * 10 + 12.0 * 2 * 4 * 2 * 64
    assert common.update_flops_shared(dims, 1, 2, 3, 5) == expected
    assert expected < common.update_flops(dims, 2, 8)


def test_scaling_long_quick_compares_kernels_and_skips_shapes_over_the_memory_cap(capsys):
    results = scaling.main(["--quick", "--long", "--repeats", "1", "--attention", "dense,blocked"])
    out = capsys.readouterr().out
    assert set(results) == {"dense", "blocked"}
    for impl, r in results.items():
        assert f"## Update vs N, attention={impl}" in out
        assert [(x["prompt"], x["n"]) for x in r["update"]] == [(8, 8), (8, 16), (16, 8)]
        assert r["update"][0]["ratio"] == 1.0 and all(x["bytes"] > 0 for x in r["update"])
        assert r["update"][0]["needed_ratio"] == 1.0
        assert all(0 < x["needed_flops"] < x["flops"] for x in r["update"])
        assert [x["n"] for x in r["rollout"]] == [8, 16] and r["rollout"][0]["ratio"] == 1.0
    capped = scaling.main(["--quick", "--long", "--repeats", "1", "--attention", "blocked",
                           "--max-gib", "1e-9", "--only", "update"])  # fmt: skip
    assert all(x["timing"] is None for x in capped["blocked"]["update"])
    assert capped["blocked"]["rollout"] == []
    assert "not run" in capsys.readouterr().out


def test_model_families_quick_times_rollout_and_update_without_recompiles(capsys):
    from benchmarks import model_families

    model_families.main(["--quick", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "| rollout, gvpo_jax |" in out and "| GVPO update, gvpo_jax |" in out
    result = common.parse_json("model_families", out)["tiny"]
    assert result["rollout"]["gvpo_jax"]["recompiles"] == 0
    assert result["update"]["gvpo_jax"]["recompiles"] == 0
    assert len(result["update"]["gvpo_jax"]["timing"]["times_s"]) == 2


def test_decode_roofline_quick_splits_the_step_against_both_floors(capsys):
    """The floors follow from the measured peak and bandwidth and the weight count; the
    weights-only pass multiplies through exactly the model's matmul weights."""
    from benchmarks import decode_roofline

    result = decode_roofline.main(["--quick", "--repeats", "1", "--profile"])
    out = capsys.readouterr().out
    assert "| rows | compute floor ms |" in out and "DECODE_ROOFLINE" in out
    # The profile: every part of a decode step found in the loop's ops by its source, and the
    # parts with the time between ops covering the loop's wall time.
    prof = result["profile"]
    assert "| part | ms per step |" in out
    for part in ("weight matmuls", "attention over the cache", "sampling", "cache writes",
                 "norms, RoPE, activation, residual"):  # fmt: skip
        assert prof[part] > 0, part
    parts = [p for p, _ in decode_roofline.PARTS] + [decode_roofline.NO_SOURCE]
    assert prof["between ops"] >= 0
    assert sum(prof[p] for p in parts) + prof["between ops"] >= 0.95 * prof["loop wall"]
    assert prof["ops"] > 10  # ops per step of the 1-layer model's decode loop
    cfg = models.PRESETS["tiny"].replace(num_layers=1)
    n_w = common.matmul_weights(**common.dims_of(cfg))
    assert result["weights"] == n_w
    assert sum(a * b for a, b in decode_roofline.weight_shapes(cfg)) == n_w
    for rows, r in result["rows"].items():
        assert r["compute_floor"] == pytest.approx(2 * n_w * rows / result["peak_flops"])
        assert r["bandwidth_floor"] == pytest.approx(4 * n_w / result["read_bandwidth"])
        assert r["weights_only"] > 0 and r["tokens"] == rows * 16


def test_rollout_quick_times_ours_and_transformers_on_the_same_weights(capsys):
    from benchmarks import rollout

    summary = rollout.main(["--quick", "--repeats", "1", "--hf-repeats", "1"])
    out = capsys.readouterr().out
    assert "| gvpo_jax generate |" in out and "| transformers generate |" in out
    q = rollout.QUICK
    assert summary["tokens"] == q["prompts"] * q["samples"] * q["new_tokens"]
    cfg = models.PRESETS["tiny"].replace(num_layers=1)
    flops = rollout.generation_flops(cfg, q["prompts"] * q["samples"], q["prompt_len"], 8)
    assert summary["flops"] == flops and summary["speedup"] > 0
    assert all(0 < r["best"] <= r["median"] for r in summary["rows"].values())


def test_padding_quick_times_every_layout_and_counts_the_slots_each_computes(capsys):
    from benchmarks import padding

    argv = ["--quick", "--repeats", "1", "--seeds", "1", "--algos", "gvpo", "--scan-layers", "true"]
    summary = padding.main(argv)
    assert summary["model"].scan_layers  # the layout asked for, in place of the preset's
    out = capsys.readouterr().out
    assert "| gvpo update, packed |" in out and "| log-prob pass, buckets |" in out
    assert {f"gvpo update, {lay}" for lay in padding.LAYOUTS} <= set(summary["rows"])
    assert all(r["recompiles"] == 0 for r in summary["rows"].values())
    ratios = {row[0]: float(row[1]) for row in summary["slot_ratios"]}
    # buckets never compute more slots than full width, per real token (>= 1: nothing lost)
    assert 1.0 <= ratios["per-group buckets"] <= ratios["full"]
    assert 1.0 <= ratios["packed groups"] <= ratios["full"]


def test_precision_quick_times_both_dtypes_and_compiles_the_update_against_the_planner(capsys):
    from benchmarks import precision

    speed = precision.main(["speed", "--quick", "--repeats", "1"])
    assert set(speed) == {f"{k} {d}" for k in ("update", "rollout") for d in precision.DTYPES}
    rows = precision.main(["memory", "--quick", "--layers", "1", "--devices", "8"])
    assert [r[0] for r in rows] == list(precision.DTYPES)
    for r in rows:  # XLA's arguments + temporaries, and the planner's peak over it, both > 0
        assert float(r[-2]) > 0 and float(r[-1]) > 0
    assert "the tiny preset, 1 layer" in capsys.readouterr().out


def test_logprob_memory_chunked_peak_is_lower_and_the_same_gradient():
    from benchmarks import logprob_memory

    small = ["--batch", "1", "--length", "64", "--hidden", "16", "--vocab", "512", "--chunk", "16"]
    r = logprob_memory.main([*small, "--dtype", "float32", "--run"])
    assert r["chunked"] < r["naive"]  # naive holds the [B, T, V] logits, chunked a block
    assert r["values"][0] == pytest.approx(r["values"][1], rel=1e-5) and r["grad_diff"] < 1e-5


def test_async_timeline_quick_overlaps_sampling_with_the_update():
    from benchmarks import async_timeline

    r = async_timeline.main(["--quick"])
    assert r["steps"] == 3 and r["async"]["lag"] == [1.0, 1.0, 1.0]
    assert all(r[mode][k] > 0 for mode in ("sync", "async") for k in ("R", "U", "step"))
    assert r["async"]["W"] > 0 and r["async"]["overlap"] >= 0


def test_tool_rollout_quick_times_every_arm_and_a_late_tool_changes_no_token():
    """The calculator's answers 20 ms late (with and without decode chunks) leave the rollout's
    tokens as they are and show up as time the device waited; nothing recompiles."""
    from benchmarks import tool_rollout

    result = tool_rollout.main(["--quick"])
    rows, last = {r[0]: r for r in result["rows"]}, result["last"]
    assert list(rows) == ["plain", "tools", "tools+20ms", "tools+20ms/0"]
    assert last["plain"]["policy"] > 0 and last["plain"]["answers"] == 0
    assert last["tools"]["policy"] > 0 and last["tools"]["answers"] > 0
    late = ("tools+20ms", "tools+20ms/0")
    tokens = {k: (last[k]["policy"], last[k]["answers"]) for k in last}
    assert all(tokens[k] == tokens["tools"] for k in late), tokens
    # Without chunks no row decodes while a turn's calls run: the device idles for most of each
    # late answer (18 ms of a 20 ms one measured; 0.0 s with the delay removed).
    assert last["tools+20ms/0"]["wait_s"] >= 0.01, last
    assert last["tools+20ms/0"]["wait_s"] > last["tools"]["wait_s"], last
    assert all(r[8] == 0 for r in rows.values())


def test_step_profile_splits_each_call_into_op_shares_and_time_no_op_covers():
    """A loop's body ops take their time from the loop, an op on a second thread from the one it
    runs beside, an asynchronous dot keeps the wall until its completion marker; the rest of
    the wall is no op's."""
    from benchmarks.step_profile import OpEvent, summarise, with_completions

    def ev(op, run, thread, start, dur, program="jit_update"):
        return OpEvent(program, op, run, thread, start * 1e9, dur * 1e9)

    events = [  # call 1: a loop over [0, 10) s holding a dot [1, 7) and a copy [8, 9), and a
        # fusion [3, 5) on a second thread; call 2: a dot launched at 20 s whose work ends at
        # 23.5 s (its marker), then a slice at 25 s
        ev("while.3", 1, "a", 0, 10), ev("ynn_fusion.1", 1, "a", 1, 6),
        ev("copy_bitcast_fusion.2", 1, "a", 8, 1), ev("add_exponential_fusion", 1, "b", 3, 2),
        ev("dot.7", 2, "a", 20, 0.5), ev("wrapped_dynamic-slice.4", 2, "a", 25, 1),
        ev("dot.7", 3, "a", 30, 0.5, program="jit_generate"),
    ]  # fmt: skip
    # Markers match the first start at or before them, not a later op of the same name.
    events = with_completions(events, {"dot.7": [31e9, 23.5e9]})
    assert [e.done_ns / 1e9 for e in events if e.op == "dot.7"] == [23.5, 31.0]
    out = summarise(events)
    update = out["programs"]["jit_update"]
    assert update["calls"] == 2
    assert update["wall_s"] == pytest.approx(10.0 + 6.0)
    assert update["matmul"] == pytest.approx(2.0 + 2.0 + 0.5 + 3.0)  # [1,3) [5,7), the dot's
    assert update["other"] == pytest.approx(1.0 + 2.0 + 1.0 + 1.0)  # the loop's own, the fusion
    assert update["data movement"] == pytest.approx(1.0 + 1.0)
    assert update["async_s"] == pytest.approx(3.0)  # [20.5, 23.5): only the dot's work
    assert update["no_op_s"] == pytest.approx(1.5)  # [23.5, 25)
    parts = sum(update[c] for c in ("matmul", "other", "data movement")) + update["no_op_s"]
    assert parts == pytest.approx(update["wall_s"])
    assert out["programs"]["jit_generate"]["matmul"] == pytest.approx(1.0)  # 30 -> 31
    assert out["top_ops"][0] == dict(program="jit_update", op="ynn_fusion", s=4.0, cls="matmul")


def test_step_profile_quick_reads_every_program_of_a_step_from_the_trace():
    from benchmarks import step_profile

    result = step_profile.main(["--quick", "--warmup", "1"])
    progs = result["programs"]
    assert {"jit_generate", "jit_logprobs", "jit_accumulate"} <= set(progs), sorted(progs)
    for name in ("jit_generate", "jit_logprobs", "jit_accumulate"):
        p = progs[name]
        assert p["calls"] >= 1 and p["matmul"] > 0 and 0 <= p["no_op_s"] < p["wall_s"], (name, p)
        parts = sum(p[c] for c in ("matmul", "data movement", "other")) + p["no_op_s"]
        assert parts == pytest.approx(p["wall_s"], rel=1e-6), (name, p)
    # Profiled steps until one meets no program for the first time (at most 3 after warm-up).
    steps = result["steps"]
    assert [s_["profiled"] for s_ in steps] == [False] + [True] * (len(steps) - 1)
    assert steps[-1]["new_programs"] == 0 or len(steps) == 4
    assert all(s_["new_programs"] > 0 for s_ in steps[1:-1])


def test_lora_quick_runs_an_arm_through_train_run_and_reports_it(tmp_path, monkeypatch):
    """The LoRA arm in its own process (one CPU device, as the benchmark runs), through
    `train.run(..., on_step=...)`; its record, then the report's table from it. (The full
    fine-tuning arm is the same code with lora off: the suite runs one arm, to save time.)"""
    from benchmarks import lora
    from tests.conftest import child_env

    monkeypatch.setenv("XLA_FLAGS", child_env()["XLA_FLAGS"])
    lora.main(["--quick", "--workdir", str(tmp_path), "--arms", "lora"])
    records = {p.stem: __import__("json").loads(p.read_text())
               for p in (tmp_path / "records").glob("*.json")}  # fmt: skip
    assert set(records) == {"lora_s0"}
    r = records["lora_s0"]
    assert r["steps"] == lora.QUICK["train.steps"] and r["update_time_s"] > 0
    mem = r["compiled_update_gib"]
    assert mem["argument_bytes"] > 0 and mem["temp_bytes"] >= 0
    table = lora.report(str(tmp_path))
    assert table.splitlines()[2].startswith("| lora | 0.0002 | 1 |")


def test_train_run_hands_each_rl_step_to_on_step_and_ends_where_it_says(tmp_path):
    """The lab's entry point: `train.run(config, workdir, on_step=...)` calls the hook after each
    RL step with that step's metrics; True ends the RL phase there, and the run ends as after
    its last step (the end's evaluation at that step, the summary)."""
    from configs import arith_tiny
    from gvpo_jax import config as config_lib
    from gvpo_jax import metrics, train

    c = config_lib.set_fields(arith_tiny.get_config(), {
        "sft.steps": 0, "data.eval_size": 8, "train.eval_every": 0, "train.steps": 4,
        "rollout.prompts_per_step": 8, "rollout.group_size": 4, "train.plot": False,
        "train.export": False, "train.eval_samples": 1, "model.overrides.num_layers": 1,
        "mesh.num_devices": 1,
    })  # fmt: skip
    seen = []

    def on_step(step, state, m):
        seen.append((step, float(m["reward_mean"])))
        return step == 2

    summary = train.run(c, str(tmp_path), on_step=on_step)
    assert [s for s, _ in seen] == [1, 2]
    rows = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["reward_mean"] for r in rows if "reward_mean" in r] == [r for _, r in seen]
    assert (
        "eval_end" in summary
        and (tmp_path / "eval_outcomes" / "step_000002_eval_end.json").exists()
    )


def test_compile_depth_quick_compiles_every_program_both_ways_and_times_them(capsys):
    """benchmarks.compile_depth --quick: the log-prob and decode programs compiled unrolled and
    scanned (one row of seconds), then the update, log-prob and decode timed once compiled."""
    from benchmarks import compile_depth

    compile_depth.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tiny | 2 |"))
    assert all(float(x) > 0 for x in row.strip("|").split("|")[2:])
    for name in ("update", "logprobs", "decode"):
        assert re.search(rf"^\| {name} \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ ", out, re.M), name


def test_moe_dispatch_smoke_times_every_dispatch_and_the_mlp_baseline(capsys):
    """benchmarks.moe_dispatch --smoke: each dispatch's forward and forward + backward, and the
    dense MLP of the same active width, compiled once and timed without recompiling; the
    grouped and ragged outputs equal the dense dispatch's."""
    from benchmarks import moe_dispatch

    summary = moe_dispatch.main(["--smoke", "--experts", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "## forward+backward: median (min-max) ms" in out and "| 4 | " in out
    (result,) = summary["results"]
    assert len(result["rows"]) == 2 * (1 + len(moe_dispatch.moe_lib.DISPATCHES))
    assert all(r["recompiles"] == 0 and r["compile_s"] > 0 for r in result["rows"].values())
    assert max(result["rel_err_vs_dense"].values()) < 1e-5
    assert result["computed_vs_active"] == {"dense": 2.0, "grouped": 1.5, "ragged": 1.0}


def test_matmul_shapes_lists_the_models_own_products_and_times_both_libraries(capsys):
    from benchmarks import matmul_shapes

    cfg = models.PRESETS["smollm2-135m"]
    prods = matmul_shapes.products(cfg, 1664)
    # Every layer kernel of the model appears as (K, N) of a forward product at M = 1664, with
    # its input gradient (N, K) and its weight gradient (M = K rows of X^T, K = tokens).
    assert not cfg.scan_layers
    model = models.abstract_model(cfg)
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    kernels = set()  # (inputs, outputs) of each layer kernel, heads flattened
    for path, x in flat:
        key = jax.tree_util.keystr(path)
        if "layers" not in key or "kernel" not in key:
            continue
        if "o_kernel" in key:  # [N, H, D]
            kernels.add((x.shape[-3] * x.shape[-2], x.shape[-1]))
        elif x.ndim == 3:  # q / k / v: [D, heads, H] (the preset's layers are unrolled)
            kernels.add((x.shape[-3], x.shape[-2] * x.shape[-1]))
        else:  # gate / up [D, F], down [F, D]
            kernels.add(tuple(x.shape[-2:]))
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, 192
    assert kernels == {(d, q), (d, kv), (q, d), (d, f), (f, d)}  # q and o coincide at 576 x 576
    forward = {(p["k"], p["n"]) for p in prods if p["kind"] == "x@W" and p["m"] == 1664}
    assert kernels <= forward, (kernels, forward)
    for k, n in kernels:
        assert any(p["kind"] == "dY@W^T" and (p["k"], p["n"]) == (n, k) for p in prods)
        assert any(p["kind"] == "X^T@dY" and (p["m"], p["k"], p["n"]) == (k, 1664, n)
                   for p in prods)  # fmt: skip
    block = models.logprobs.vocab_block_size(1664, cfg.vocab_size, 128)
    assert any(p["n"] == block and p["m"] == 1664 for p in prods)
    assert {p["m"] for p in prods if p["name"] == "decode output"} == {32, 16, 8}

    result = matmul_shapes.main(["--quick", "--repeats", "2", "--rounds", "1"])
    rows = result["rows"]
    assert len(rows) == len(matmul_shapes.products(models.PRESETS["tiny"], 16, (4,)))
    for r in rows:
        assert r["xla_gflops"] > 0 and r["torch_gflops"] > 0
        assert r["ratio"] == pytest.approx(r["xla_gflops"] / r["torch_gflops"])
    out = capsys.readouterr().out
    assert "XLA / PyTorch speed" in out and "All the update's products" in out
