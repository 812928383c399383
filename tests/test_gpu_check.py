"""The GPU check's tiny mode (benchmarks/gpu/check.py): every part runs on the CPU with tiny
shapes, so the check a short GPU lease runs cannot rot between leases."""

import ast
import json
import math
import sys

from benchmarks.gpu import check


def test_gpu_test_ids_name_existing_test_functions():
    """Each id of the GPU subset is a test function of its file (a renamed test fails here)."""
    for test_id in check.GPU_TESTS:
        path, name = test_id.split("::")
        with open(path) as f:
            tree = ast.parse(f.read())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, test_id


def test_tiny_parts_report_their_measures():
    """The unrolled rollout, the update, transformers' generate and the attention in this
    process (tiny shapes): finite, positive measures; the kernels agree with dense."""
    env = dict(bf16_matmul_tflops=1.0, copy_gb_s=10.0)
    unrolled = check.run_part("rollout-unrolled:tiny", True, env)  # (the scanned one: below)
    assert not unrolled["scan_layers"] and unrolled["rows"] == 4 and unrolled["new_tokens"] == 8
    update = check.run_part("update:tiny", True, env)
    assert math.isfinite(update["first_loss"]) and update["programs"] == 1
    assert 0 < update["mfu"] < 1 and update["tflop_per_update"] > 0
    hf = check.run_part("hf:tiny", True, env)  # transformers.generate of the same shapes
    assert hf["rows"] == 4 and hf["tokens_per_s"] > 0
    attention = check.run_part("attention", True, env)
    assert attention["auto"] == "blocked"  # dense at tiny CPU shapes: blocked stands in
    assert attention["value_rel_err"] < 1e-2 and attention["grad_rel_err"] < 1e-2


def test_tiny_moe_part_times_ragged_grouped_and_the_dense_mlp_and_compares_them():
    """The MoE part at tiny shapes on the CPU: every variant and pass compiled and timed, the
    active FLOPs counted, ragged_dot's values and gradients equal to the grouped path's, and the
    console line names them."""
    env = dict(bf16_matmul_tflops=1.0, copy_gb_s=10.0)
    moe = check.run_part("moe", True, env)
    assert moe["failures"] == 0 and moe["ragged_matches_grouped"]
    assert moe["value_rel_err"] < 1e-2 and moe["grad_rel_err"] < 1e-2
    for variant in ("ragged", "grouped", "dense"):
        for p in ("forward", "forward+backward"):
            row = moe[f"{variant} {p}"]
            assert row["compile_s"] > 0 and row["median_s"] > 0 and row["tflops"] > 0, row
    # 64 tokens x top-2 over 8 experts: blocks of 16 rows, at most 8 x 15 padding rows
    assert moe["grouped_block"] == 16 and moe["grouped_rows"] == 256
    line = check.summary(dict(moe, part="moe", ok=True, wall_s=1.0))
    assert "ragged == grouped True" in line and "forward+backward ms" in line


def test_runner_records_each_part_as_it_finishes_and_skips_what_the_budget_cuts(tmp_path):
    """The runner (env and the scanned rollout, each in its own process): one JSON line per
    part, in order, each with its measures; a part that dies or times out is recorded as failed
    and the runner goes on; past the budget the remaining parts are recorded as skipped."""
    out = tmp_path / "out"
    rc = check.main(["--tiny", "--out", str(out), "--only", "env,rollout:tiny"])
    records = [json.loads(line) for line in (out / "check.jsonl").read_text().splitlines()]
    assert rc == 0 and [r["part"] for r in records] == ["env", "rollout:tiny"]
    assert all(r["ok"] for r in records) and records[0]["copy_gb_s"] > 0
    rollout = records[1]
    assert rollout["scan_layers"] and rollout["tokens_per_s"] > 0
    assert 0 < rollout["share_of_floor"] < 1 and rollout["compile_s"] > 0
    assert "===== rollout:tiny =====" in (out / "check.log").read_text()

    died = check._run_child([sys.executable, "-c", "raise SystemExit(3)"], 10, "x", str(out / "l"))
    assert died == dict(died, ok=False, error="the process died")
    hung = check._run_child(
        [sys.executable, "-c", "import time; time.sleep(30)"], 1, "y", str(out / "l")
    )
    assert hung["ok"] is False and hung["error"] == "timed out after 1 s"

    cut = tmp_path / "cut"
    assert check.main(["--tiny", "--out", str(cut), "--budget", "5"]) == 1
    records = [json.loads(line) for line in (cut / "check.jsonl").read_text().splitlines()]
    assert [r["part"] for r in records] == check.parts(check.TINY)
    assert all(r["error"].startswith("skipped") for r in records)
