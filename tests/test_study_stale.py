"""Learning study part 3 (stale rollouts): the quick run's records, report and figure, and the
SmolLM2 part's paired comparisons on per-problem outcomes."""

import json
import subprocess
import sys

import numpy as np
import pytest

from studies import runs, stats
from studies.stale import study as study_stale
from studies.stale_smollm2 import study as smol
from tests.test_learning_study import child_env


def test_quick_stale_study_records_every_run_and_reports_the_records_numbers(tmp_path):
    """GVPO at k = 0 and GRPO + token_tis at k = 2, 1 seed, 2 rollouts each (a subprocess on
    one CPU device): a record per run with its per-step lag, IS weights and GVPO's loss terms and
    the final evaluation's per-problem outcomes; results.md's numbers are the records'
    (recomputed here by hand); the figure is written; each run's record is kept under
    records/, where a rerun finds and skips it."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "studies.stale.study", "--quick", "--out", str(out),
           "--workdir", str(work)]  # fmt: skip
    env = child_env()
    proc = subprocess.run(cmd, cwd=runs.REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    records = study_stale.load_records(str(out))
    assert set(records) == {"gvpo k=0", "grpo + token_tis k=2"}
    md = (out / "results.md").read_text()
    for name, (rec,) in records.items():
        steps = rec["step_metrics"]
        assert len(steps) == rec["steps"] == 2, name
        # the exact lag: k = 2 trains step 2 on the start policy's rollout (1 update old)
        assert [s.get("rollout_lag", 0.0) for s in steps] == ([0.0, 1.0] if "k=2" in name
                                                              else [0.0, 0.0]), name  # fmt: skip
        assert ("is_weight_mean" in steps[0]) == ("token_tis" in name), name
        assert ("var_term" in steps[0]) == name.startswith("gvpo"), name
        # the final evaluation's outcomes give the final greedy and avg@n of the curves
        o = rec["outcomes"]
        assert len(o["ids"]) == 16 and o["n"] == 2, name
        assert np.mean(o["greedy"]) == pytest.approx(rec["curve"][-1][1]), name
        assert sum(o["correct"]) / (2 * 16) == pytest.approx(rec["curve_sampled"][-1][1]), name
        # the report's row: final greedy, avg@n, KL and (GVPO) the restoring term's share
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {rec['curve'][-1][1]:.3f} +- " in row, name
        assert f"| {rec['curve_sampled'][-1][1]:.3f} +- " in row, name
        assert f"| {rec['kl_start']:.4f} |" in row, name
        gap = np.median([s["sampler_logp_gap_max"] for s in steps])  # the sampler gap column
        assert f"| {gap:.2f} | {np.mean(rec['grad_clipped_frac']):.2f} |" in row, name
        if name.startswith("gvpo"):
            with_spread = [s for s in steps if s["adv_term"] > 0]
            share = (sum(s["var_term"] for s in with_spread) / sum(s["adv_term"]
                     for s in with_spread)) if with_spread else float("nan")  # fmt: skip
            assert (f"| {share:.4f} |" if np.isfinite(share) else "| - |") in row, name
    assert (out / "stale.png").stat().st_size > 1000
    assert len(list((work / "records").glob("*_s0.json"))) == 2  # what a rerun skips


def test_smollm2_stale_study_quick_records_runs_and_pairs_them_on_the_problems(tmp_path):
    """Part 3 on SmolLM2's code path on a tiny random Llama (no GGUF): the start evaluated once
    with its per-problem outcomes, one record per (cell, seed) under out/records named by the
    cell's config, and the paired comparison of the two methods at k = 4 in results.json."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "studies.stale_smollm2.study", "--quick", "--only", "k=4",
           "--out", str(out), "--workdir", str(work)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=runs.REPO, env=child_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["cells"]) == {"gvpo k=4", "grpo + token_tis k=4"}
    (diff,) = summary["diffs"]
    assert (diff["a"], diff["b"]) == ("gvpo k=4", "grpo + token_tis k=4")
    assert set(diff) == {"a", "b", "greedy", "avg@2"}
    config = smol.study_config(True)
    budget = summary["budget_responses"]
    todo = [c for c in smol.cells(True) if "k=4" in c.name]
    records, _ = smol.load_records(str(out), config, todo, [0], budget, quick=True)
    assert set(records) == set(summary["cells"])
    for name, (rec,) in records.items():
        assert rec["outcomes"]["ids"] == summary["start"]["outcomes"]["ids"], name
        assert [s["rollout_lag"] for s in rec["step_metrics"]] == [0.0, 1.0], name  # k > steps
    assert (out / "stale_smollm2.png").stat().st_size > 1000


def _record(greedy, correct, n, truncated, curve_sampled, kl=0.1, first_reward=0.1):
    problems = len(greedy)
    return {
        "curve": [[0, 0.1], [960, float(np.mean(greedy))]],
        "curve_sampled": [[0, 0.05], [960, curve_sampled]],
        "outcomes": {"ids": [f"p{i}" for i in range(problems)], "n": n, "correct": correct,
                     "greedy": greedy, "truncated": truncated, "length_sum": [10 * n] * problems,
                     "greedy_truncated": [False] * problems},
        "kl_start": kl, "losses": [0.1], "skipped": 0, "error": None, "rewards": [first_reward],
        "grad_clipped_frac": [0.5], "step_metrics": [], "cpu_s": 60.0, "time_s": 60.0,
    }  # fmt: skip


def test_smollm2_stale_differences_are_over_seeds_and_over_seeds_and_problems(tmp_path):
    """compare_cells: the seeds' interval is Student's t over the seed differences when the
    cells' seeds share their first rollouts (else Welch's); the other interval is the two-stage
    bootstrap of the runs' per-problem scores; the tables print them."""
    from scipy import stats as sp

    rng = np.random.default_rng(0)
    problems, n = 40, 8
    recs = {}
    for name, p in (("a", 0.36), ("b", 0.3)):
        recs[name] = []
        for seed in range(3):
            greedy = [bool(x) for x in rng.random(problems) < p]
            correct = [int(x) for x in rng.binomial(n, p, problems)]
            recs[name].append(_record(greedy, correct, n, [1] * problems,
                                      sum(correct) / (n * problems),
                                      first_reward=0.1 * seed))  # fmt: skip
    d = smol.compare_cells(recs, "a", "b")
    for metric, per_problem in (
        ("greedy", lambda o: np.asarray(o["greedy"], float)),
        ("avg@8", lambda o: np.asarray(o["correct"], float) / n),
    ):
        end = "curve" if metric == "greedy" else "curve_sampled"
        xa = np.array([r[end][-1][1] for r in recs["a"]])
        xb = np.array([r[end][-1][1] for r in recs["b"]])
        lo, hi = sp.ttest_rel(xa, xb).confidence_interval(0.95)  # paired: the same first rewards
        x = d[metric]
        assert x["paired"] and x["diff"] == pytest.approx(np.mean(xa - xb))
        assert x["seeds_ci95"] == pytest.approx((hi - lo) / 2)
        sa = np.stack([per_problem(r["outcomes"]) for r in recs["a"]])
        sb = np.stack([per_problem(r["outcomes"]) for r in recs["b"]])
        assert (x["lo"], x["hi"]) == stats.two_stage_interval(sa, sb, paired=True)[1:]
        assert x["diff"] == pytest.approx(sa.mean() - sb.mean())  # the outcomes are the finals
        assert (x["a_higher"], x["b_higher"]) == ((sa.mean(0) > sb.mean(0)).sum(),
                                                  (sb.mean(0) > sa.mean(0)).sum())  # fmt: skip
        assert x["seeds_needed"] == stats.seeds_needed(xa, xb, x["diff"], paired=True)
    # another seed's first rollout in one cell: Welch's
    recs["c"] = recs["b"][::-1]
    assert not smol.compare_cells(recs, "a", "c")["greedy"]["paired"]
    # what would resolve an unresolved difference over seeds, or "more than" past the search
    x = {"diff": 0.01, "seeds_ci95": 0.2, "lo": -0.01, "hi": 0.03, "seeds_needed": 12.0}
    line = smol.needs_lines([{"a": "a", "b": "b", "greedy": x}])[0]
    assert line == "- a - b, greedy +0.010: ~12 seeds per cell"
    line = smol.needs_lines([{"a": "a", "b": "b", "greedy": {**x, "seeds_needed": np.inf}}])[0]
    assert line.endswith(f"more than {stats.MOST_SEEDS:,} seeds per cell")
    resolved = {**x, "seeds_ci95": 0.001}  # by the seeds' interval: no line
    assert smol.needs_lines([{"a": "a", "b": "b", "greedy": resolved}]) == []
    table = smol.diff_table([d])
    assert f"{d['greedy']['diff']:+.3f} +- {d['greedy']['seeds_ci95']:.3f} paired" in table
    assert f"[{d['avg@8']['lo']:+.3f}, {d['avg@8']['hi']:+.3f}]" in table
    for i, r in enumerate(recs["a"]):  # the sampler gap: median over every run's steps
        r["step_metrics"] = [{"sampler_logp_gap_max": 0.5 * i + j} for j in range(3)]
    s = smol.summarise(recs["a"])
    assert s["logp_gap"] == pytest.approx(1.5)  # of 0 1 2, .5 1.5 2.5, 1 2 3
    assert s["truncated_end"] == pytest.approx(1 / n)  # 1 of 8 samples per problem at the cap
    assert s["greedy"] == pytest.approx(np.mean([r["curve"][-1][1] for r in recs["a"]]))
    row = smol.cell_table({"a": s}, n).splitlines()[-1]
    assert f"| {s['greedy']:.3f} +- {s['greedy_ci95']:.3f} |" in row and "| 12.5% |" in row
    # the figure: one line per method across k
    png = tmp_path / "stale_smollm2.png"
    cells = {f"{m} k={k}": s for m in smol.METHODS for k in smol.STALENESS}
    study_stale.plot_by_staleness(cells, smol.METHODS, smol.STALENESS,
                                  [("avg", "avg@8"), ("greedy", "greedy")], str(png))  # fmt: skip
    assert png.stat().st_size > 1000
    # records scored on other problems are not paired
    recs["b"][0]["outcomes"]["ids"] = list(reversed(recs["b"][0]["outcomes"]["ids"]))
    with pytest.raises(AssertionError, match="other problems"):
        smol.compare_cells(recs, "a", "b")


def test_study_md_part_3_tables_are_the_recorded_runs():
    """STUDY.md part 3's tables are `report_block` of the records in studies/stale/results (not
    typed by hand): the cell table and the differences recomputed from every recorded run."""
    import os

    results = json.loads(open(os.path.join(study_stale.OUT, "results.json")).read())
    records = study_stale.load_records(study_stale.OUT)
    budget = results["budget_rollouts"] * results["prompts_per_step"] * results["group_size"]
    summary = {**results, "cells": {name: study_stale.summarise(recs, budget)
                                    for name, recs in records.items()}}  # fmt: skip
    block = study_stale.report_block(summary, records, problems=200)
    text = open(os.path.join(runs.REPO, "STUDY.md")).read()
    start = text.index(study_stale.BEGIN) + len(study_stale.BEGIN)
    assert text[start : text.index(study_stale.END)].strip() == block.strip()
    _check_seed_intervals_by_hand(block, records, study_stale.pairs(), "{a} - {b}: ")


def _check_seed_intervals_by_hand(block, records, pairs, row):
    """Every pair's greedy interval over seeds, recomputed from the records' finals with
    scipy: paired t where each seed's first reward agrees in both cells (the same first
    rollout), else Welch's, and printed on the pair's row of `block`."""
    from scipy import stats as sp

    for a, b in pairs:
        xa = [r["curve"][-1][1] for r in records[a]]
        xb = [r["curve"][-1][1] for r in records[b]]
        paired = [r["rewards"][0] for r in records[a]] == [r["rewards"][0] for r in records[b]]
        test = sp.ttest_rel(xa, xb) if paired else sp.ttest_ind(xa, xb, equal_var=False)
        lo, hi = test.confidence_interval(0.95)
        line = next(x for x in block.splitlines() if row.format(a=a, b=b) in x)
        kind = "paired" if paired else "Welch"
        assert f"{np.mean(xa) - np.mean(xb):+.3f} +- {(hi - lo) / 2:.3f} {kind}" in line.replace(
            " seeds ", " "), (a, b)  # fmt: skip


def test_study_md_part_3_smollm2_tables_are_the_recorded_runs():
    """STUDY.md's SmolLM2 part 3 tables are `report_block` of the committed records (not typed
    by hand): the cells, the over-seeds and paired differences, and every recorded run."""
    import os

    config = smol.study_config(False)
    budget = smol.SMOL_STEPS * config.rollout.prompts_per_step * config.rollout.group_size
    records, runs_ = smol.load_records(smol.OUT, config, smol.cells(False), smol.SEEDS, budget)
    assert records, "no SmolLM2 part 3 run recorded"
    _, diffs, block = smol.report_block(records, runs_, smol.SMOL_EVAL_N)
    text = open(os.path.join(runs.REPO, "STUDY.md")).read()
    start = text.index(smol.BEGIN) + len(smol.BEGIN)
    assert text[start : text.index(smol.END)].strip() == block.strip()
    _check_seed_intervals_by_hand(block, records, smol.PAIRS, "| {a} - {b} | greedy |")
    for d in diffs:  # the two-stage interval: the records' per-problem greedy outcomes
        scores = [np.array([r["outcomes"]["greedy"] for r in records[c]], float)
                  for c in (d["a"], d["b"])]  # fmt: skip
        paired = d["greedy"]["paired"]
        _, lo, hi = stats.two_stage_interval(*scores, paired=paired)
        assert f"| [{lo:+.3f}, {hi:+.3f}] (" in block, (d["a"], d["b"])


def test_study_md_part_3_calibration_is_the_recorded_one():
    """The SmolLM2 calibration table in STUDY.md is `calibration_table` of calibration.json,
    and the study's cap is one the start policy's replies reach less than 10% of the time."""
    import os

    rows = json.loads(open(os.path.join(smol.OUT, "calibration.json")).read())
    text = open(os.path.join(runs.REPO, "STUDY.md")).read()
    start = text.index(smol.CALIBRATION_BEGIN) + len(smol.CALIBRATION_BEGIN)
    assert text[start : text.index(smol.CALIBRATION_END)].strip() == smol.calibration_table(rows)
    chosen = next(r for r in rows if (r["template"], r["cap"]) == (
        smol.SETTINGS["data.template"], smol.SETTINGS["rollout.max_new_tokens"]))  # fmt: skip
    assert chosen["sampled_truncated"] < 0.10


def test_study_md_part_4_tables_are_the_recorded_runs():
    """STUDY.md part 4's tables (the MoE study) are `report_block` of the records in
    studies/moe/results, recomputed here, and each pair's greedy interval over seeds is the
    records' (paired t where the cells share their first rollouts, else Welch's)."""
    import os

    from studies.moe import study as moe_study

    results = json.loads(open(os.path.join(moe_study.OUT, "results.json")).read())
    records = study_stale.load_records(moe_study.OUT)
    start = results["start_greedy"]
    summary = {**results, "cells": {name: moe_study.summarise(recs, start)
                                    for name, recs in records.items()}}  # fmt: skip
    block = moe_study.report_block(summary, records, problems=200)
    text = open(os.path.join(runs.REPO, "STUDY.md")).read()
    begin = text.index(moe_study.BEGIN) + len(moe_study.BEGIN)
    assert text[begin : text.index(moe_study.END)].strip() == block.strip()
    pairs = [p for p in moe_study.PAIRS if p[0] in records and p[1] in records]
    _check_seed_intervals_by_hand(block, records, pairs, "{a} - {b}: ")


def test_study_md_part_3b_tables_are_the_recorded_runs():
    """STUDY.md part 3b's tables (the stale-regime study) are `report_block` of the records in
    studies/regime/results, recomputed here (every cell's summary, the at-a-glance verdicts,
    the differences), and each pair's greedy interval over seeds is the records' (paired t
    where the cells share their first rollouts, else Welch's)."""
    import os

    from studies.regime import study as regime

    results = json.loads(open(os.path.join(regime.OUT, "results.json")).read())
    records = study_stale.load_records(regime.OUT)
    start = results["start_greedy"]
    budget = results["budget_rollouts"] * results["prompts_per_step"] * results["group_size"]
    summary = {**results, "cells": {name: regime.summarise(recs, budget, start)
                                    for name, recs in records.items()}}  # fmt: skip
    block = regime.report_block(summary, records, problems=200)
    text = open(os.path.join(runs.REPO, "STUDY.md")).read()
    begin = text.index(regime.BEGIN) + len(regime.BEGIN)
    assert text[begin : text.index(regime.END)].strip() == block.strip()
    pairs = [p for p in regime.pairs() if p[0] in records and p[1] in records]
    assert len(pairs) >= 20
    _check_seed_intervals_by_hand(block, records, pairs, "{a} - {b}: ")


def test_quick_regime_study_records_its_cells_and_reports_the_records_numbers(tmp_path):
    """Part 3b's quick mode (Dr. GRPO at k = 0 and GVPO with 4 passes per rollout at k = 4,
    lr 3e-5, 1 seed, 2 rollouts each, a subprocess on one CPU device): a record per run, the
    every-cell table's numbers recomputed from them (final greedy, gain over the start, the mean
    |log pi_old / mu| and the share of drawn tokens over token_tis's cap), the figure, and the
    records kept where a rerun finds them."""
    from studies.regime import study as regime

    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "studies.regime.study", "--quick", "--out", str(out),
           "--workdir", str(work)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=runs.REPO, env=child_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = study_stale.load_records(str(out))
    assert set(records) == set(regime.QUICK_CELLS)
    summary = json.loads((out / "results.json").read_text())
    start = summary["start_greedy"]
    md = (out / "results.md").read_text()
    for name, (rec,) in records.items():
        steps = rec["step_metrics"]
        assert len(steps) == rec["steps"] == 2, name
        greedy = rec["curve"][-1][1]
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} | 1 |"))
        assert f"| {greedy:.3f} +- " in row and f"| {greedy - start:+.3f} |" in row, name
        gap = np.mean([s["sampler_logp_gap_mean"] for s in steps])
        over = np.mean([s["sampler_over_cap_frac"] for s in steps])
        assert f"| {gap:.4f} | {over:.4f} |" in row, name
    assert (out / "regime.png").stat().st_size > 1000
    assert len(list((work / "records").glob("*_s0.json"))) == 2  # what a rerun skips
