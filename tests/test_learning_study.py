"""Learning study: budget accounting, divergence rule, noisy demonstrations, and the --quick run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from studies import report, runs, stats
from studies.smollm2 import study as smol
from studies.toy import study as ls
from tests.conftest import child_env


class _FakeTask:
    def __init__(self, examples):
        self.examples = examples

    def next_train(self, n, cursor, rows=None):
        out = self.examples[:n] if rows is None else [self.examples[int(r)] for r in rows]
        return out, cursor


def _arith_examples(n):
    pairs = [(a, b) for a in range(31) for b in range(31)][:n]
    return [{"id": f"{a}+{b}", "answer": str(a + b), "solution": str(a + b)} for a, b in pairs]


def test_noisy_task_corrupts_a_fixed_share_of_targets_and_keeps_the_gold_answer():
    examples = _arith_examples(961)  # every a+b with a, b in [0, 30]
    noisy = runs.NoisyTask(_FakeTask(examples), 0.3)
    out, _ = noisy.next_train(len(examples), None)
    wrong = [ex for ex in out if ex["solution"] != ex["answer"]]
    assert 0.25 < len(wrong) / len(out) < 0.35
    for ex, orig in zip(out, examples, strict=True):
        assert ex["answer"] == orig["answer"]  # the verifier's gold is untouched
        assert int(ex["solution"]) >= 0
    assert noisy.next_train(len(examples), None)[0] == out  # a pure function of the problem id


def test_auc_is_the_trapezoid_mean_over_the_budget():
    curve = [(0, 0.5), (100, 0.7), (300, 0.6)]
    # trapezoids: 100 * 0.6 + 200 * 0.65 = 190, over 300 responses
    assert report.auc(curve, 300) == pytest.approx(190 / 300)


def test_divergence_rule():
    ok = {"curve": [(0, 0.5), (10, 0.3)], "losses": [1.0, 0.5], "skipped": 0, "error": None}
    assert not report.diverged(ok)
    assert report.diverged(dict(ok, curve=[(0, 0.5), (10, 0.2)]))  # below half the start
    assert report.diverged(dict(ok, losses=[1.0, float("nan")]))
    assert report.diverged(dict(ok, skipped=1))
    assert report.diverged(dict(ok, error="stopped"))


def test_identical_configurations_share_runs():
    base = ls.base.get_config()
    by_name = {c.name: c for c in ls.cells()}
    key = lambda name: runs.config_key(by_name[name], by_name[name].load(), base)  # noqa: E731
    same = [("gvpo", "gvpo replay 0.0"), ("gvpo", "gvpo beta 0.1"),
            ("gvpo 4mbx2ep", "gvpo lr x1 4mbx2ep"), ("gvpo", "gvpo anchor old"),
            ("gvpo 4mbx2ep", "gvpo beta 0.1 4mbx2ep")]  # fmt: skip
    for a, b in same:
        assert key(a) == key(b)
    assert key("gvpo") != key("grpo")
    assert key("gvpo from noisy SFT") != key("gvpo")
    # the key is what the arm's config changes on the base: the fields, not the arm's argument
    assert json.loads(key("grpo lr x3 4mbx2ep")) == [
        "clean", [["algo.name", "grpo"], ["algo.num_epochs", 2], ["algo.num_minibatches", 4],
                  ["optim.lr", base.optim.lr * 3]],
    ]  # fmt: skip


def test_arm_configs_take_their_argument_and_refuse_an_unknown_one():
    c = runs.Cell("x", "x", "studies/toy/configs/grpo.py:regime=4mbx2ep,lr=3,nokl").load(seed=2)
    assert (c.algo.name, c.algo.num_minibatches, c.algo.num_epochs) == ("grpo", 4, 2)
    assert c.algo.kl_coef == 0.0 and c.seed == 2
    assert c.optim.lr == pytest.approx(3 * ls.base.get_config().optim.lr)
    quick = runs.Cell("x", "x", "studies/toy/configs/grpo.py").load(quick=True)
    assert quick.model.overrides.num_layers == 1 and quick.algo.kl_coef is None
    with pytest.raises(ValueError, match="unknown config argument 'nkl'"):
        runs.Cell("x", "x", "studies/toy/configs/grpo.py:nkl").load()


def test_smollm2_records_are_the_cells_records():
    """Every committed part 2b record is one (cell, seed) of the study's arms (its name hashes
    the fields the arm's config changes), and every cell has its three seeds recorded."""
    config = smol.smol_config(False)
    budget = smol.SMOL_STEPS * config.rollout.prompts_per_step * config.rollout.group_size
    tags = {runs.record_tag(runs.config_key(c, c.load(), config), budget, seed)
            for c in smol.smol_cells() for seed in (0, 1, 2)}  # fmt: skip
    recorded = {p[: -len(".json")] for p in os.listdir(os.path.join(smol.OUT, "records"))}
    assert recorded == tags
    # results.md's differences and the data they need are the records', recomputed here
    records = {}
    for c in smol.smol_cells():
        key = runs.config_key(c, c.load(), config)
        for seed in (0, 1, 2):
            with open(runs.record_path(smol.OUT, key, budget, seed)) as fh:
                records.setdefault(c.name, []).append(json.load(fh))
    md = open(os.path.join(smol.OUT, "results.md")).read()
    lines = report.diff_lines(records, smol.SMOL_PAIRS, problems=config.data.eval_size)
    lines += report.needs_lines(records, smol.SMOL_PAIRS, config.data.eval_size)
    assert len(lines) == 21 and all(line in md.splitlines() for line in lines)


def test_with_overrides_sets_nested_fields_and_leaves_the_base_alone():
    base = ls.base.demo_recipe()
    c = runs.with_overrides(base, (("data.arith.max_operand", 99), ("optim.lr", 1e-4)), seed=3)
    assert (c.data.arith.max_operand, c.optim.lr, c.seed) == (99, 1e-4, 3)
    assert base.to_dict() == ls.base.demo_recipe().to_dict()  # a copy was changed


def test_demo_gain_stats_and_table():
    def rec(g0, g1, s0, s1):
        return {"curve": [(0, g0), (10, g1)], "curve_sampled": [(0, s0), (10, s1)],
                "time_s": 10.0, "cpu_s": 8.0}  # fmt: skip

    recs = [rec(0.5, 0.7, 0.3, 0.6), rec(0.6, 0.7, 0.4, 0.6)]
    g = report.gain_stats(recs, "curve")
    assert g["start"] == pytest.approx(0.55) and g["end"] == pytest.approx(0.7)
    assert g["gain"] == pytest.approx(0.15) and g["gain_min"] == pytest.approx(0.1)
    assert g["gain_std"] == pytest.approx(np.std([0.2, 0.1], ddof=1))
    s = report.gain_stats(recs, "curve_sampled")
    assert s["gain"] == pytest.approx(0.25) and s["end_std"] == pytest.approx(0.0)
    row = report.demo_table({"trial a": recs}, 16).splitlines()[-1]
    assert row.startswith("| trial a | 2 | 0.550 -> 0.700 +- 0.000 (+0.150 +- 0.071, min +0.100)")
    assert "0.350 -> 0.600" in row and "| 10 (8) |" in row


def test_cell_table_reports_wall_and_cpu_seconds_per_run():
    def rec(acc, cpu):
        return {"curve": [(0, 0.2), (10, acc)], "kl_start": 0.1, "steps": 5, "time_s": 100.0,
                "cpu_s": cpu, "losses": [0.1], "error": None, "skipped": 0}  # fmt: skip

    s = report.cell_summary([rec(0.5, 60.0), rec(0.7, 80.0)], budget=10)
    assert s["cpu_s"] == pytest.approx(70.0) and s["time_s"] == pytest.approx(100.0)
    row = report.table([("cell a", s)], 0.2).splitlines()[-1]
    assert row.startswith("| cell a | 0.600 +- 0.141 |") and row.endswith("| 5 | 100 (70) |")
    # records from before CPU time was logged: the column says so instead of a number
    old = report.cell_summary([{k: v for k, v in rec(0.5, 0.0).items() if k != "cpu_s"}], budget=10)
    assert report.table([("old", old)], 0.2).splitlines()[-1].endswith("| 100 (-) |")


@pytest.mark.slow
def test_quick_study_runs_every_code_path_and_writes_tables_and_plots(tmp_path):
    # A subprocess without the suite's 8 fake devices: the study runs on one CPU device.
    out, work = tmp_path / "out", tmp_path / "work"
    env = child_env()
    cmd = [sys.executable, "-m", "studies.toy.study", "--quick"]
    cmd += ["--out", str(out), "--workdir", str(work)]
    proc = subprocess.run(cmd, cwd=runs.REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    budget = summary["budget_responses"]
    assert budget == 2 * summary["prompts_per_step"] * summary["group_size"]
    cells = summary["cells"]
    assert {"grpo 4mbx2ep", "gvpo replay 0.5", "gvpo anchor ref", "gvpo from noisy SFT",
            "dr_grpo eps 1e3 4mbx2ep"} <= set(cells)  # fmt: skip
    # Every cell logs its gradient norms and how often the norm clip acted; the clipped-ratio
    # losses their ratio-clip fraction (GVPO has no ratio, so none).
    for name, cell in cells.items():
        # (>= 0: the quick start is nearly always wrong, so whole minibatches can have zero
        # advantages and a zero gradient)
        assert 0 <= cell["grad_norm"] <= cell["grad_norm_max"], name
        assert 0.0 <= cell["grad_clipped_frac"] <= 1.0, name
    assert 0.0 <= cells["grpo 4mbx2ep"]["clip_frac"] <= 1.0
    assert cells["dr_grpo eps 1e3 4mbx2ep"]["clip_frac"] == 0.0  # the clip never acts at 1e3
    assert np.isnan(cells["gvpo replay 0.5"]["clip_frac"])
    for name, cell in cells.items():
        (curve,) = cell["curves"]
        assert curve[0][0] == 0 and curve[-1][0] >= budget, name  # the whole budget was sampled
        assert np.isfinite(cell["kl_start"]) and cell["kl_start"] >= 0, name
        assert 0.0 <= cell["final_mean"] <= 1.0
    # Replay 0.5: the first step samples P fresh groups, later ones P/2, until the budget.
    assert cells["gvpo replay 0.5"]["steps"] == 3
    assert cells["grpo 4mbx2ep"]["steps"] == 2
    for exp in ("offpolicy", "replay", "anchor", "noisy"):
        assert (out / f"{exp}.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "| gvpo replay 0.5 |" in md and "SFT held-out accuracy" in md
    assert set(summary["starts"]) == {"clean", "noisy"}
    for kind in ("clean", "noisy"):
        assert os.path.isdir(work / f"start_{kind}" / "checkpoints")


def test_confidence_intervals_use_students_t_over_seeds():
    # x = 0, 1, 2: mean 1, sample std 1; t(0.975, 2 dof) = 4.303
    assert stats.ci95([0.0, 1.0, 2.0]) == pytest.approx(4.303 / np.sqrt(3), rel=1e-4)
    assert np.isnan(stats.ci95([0.5]))
    # Equal variances and sizes: Welch's dof = 2 (n - 1) = 4, t = 2.776, se = sqrt(2 / 3)
    d, h = stats.diff_ci95([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert d == pytest.approx(1.0) and h == pytest.approx(2.776 * np.sqrt(2 / 3), rel=1e-3)
    # Unequal spreads: fractional Welch dof (here 3.19), not rounded down to 2 (which widens
    # the interval); the half-width equals scipy's Welch interval.
    from scipy import stats as sp

    a, b = [0.0, 1.0, 2.0, 3.0], [0.0, 0.2, 0.4]
    d, h = stats.diff_ci95(a, b)
    lo, hi = sp.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert d == pytest.approx((lo + hi) / 2) and h == pytest.approx((hi - lo) / 2)
    se = np.sqrt(np.var(a, ddof=1) / 4 + np.var(b, ddof=1) / 3)
    assert h < sp.t.ppf(0.975, 3) * se
    lines = report.diff_lines({"a": [{"curve": [(0, 0.1), (9, x)]} for x in (0.50, 0.52, 0.51)],
                           "b": [{"curve": [(0, 0.1), (9, x)]} for x in (0.30, 0.31, 0.29)]},
                          [("a", "b")])  # fmt: skip
    assert lines == ["- a - b: greedy +0.210 +- 0.023 seeds Welch (resolved)"]


def _power_by_formula(diff, n, xa, xb, paired):
    """The t test's power written out: noncentral t at the measured spread (paired: n - 1 dof
    over the seed differences; Welch: the Welch-Satterthwaite dof at n seeds each)."""
    from scipy import stats as sp

    if paired:
        var, dof = np.var(np.subtract(xa, xb), ddof=1), n - 1
    else:
        va, vb = np.var(xa, ddof=1), np.var(xb, ddof=1)
        var, dof = va + vb, (n - 1) * (va + vb) ** 2 / (va**2 + vb**2)
    crit, nc = sp.t.ppf(0.975, dof), abs(diff) * np.sqrt(n / var)
    return sp.nct.sf(crit, dof, nc) + sp.nct.cdf(-crit, dof, nc)


def test_seeds_needed_is_the_fewest_with_80_percent_power_by_brute_force():
    """`stats.seeds_needed` (a doubling and bisection search) against a scan of every n of the
    t test's power formula, paired and Welch's; the formula against simulated t tests."""
    from scipy import stats as sp

    xa, xb = np.array([0.50, 0.62, 0.55, 0.70]), np.array([0.45, 0.52, 0.56, 0.58])
    for diff, paired in ((0.08, True), (0.08, False), (0.03, True), (0.2, False)):
        scan = next(n for n in range(2, 5000) if _power_by_formula(diff, n, xa, xb, paired) >= 0.8)
        assert stats.seeds_needed(xa, xb, diff, paired=paired) == scan, (diff, paired)
        assert _power_by_formula(diff, scan - 1, xa, xb, paired) < 0.8 or scan == 2
    # the formula is the power: 20,000 simulated paired t tests at the n it gives
    n = int(stats.seeds_needed(xa, xb, 0.08, paired=True))
    sd = np.std(xa - xb, ddof=1)
    d = np.random.default_rng(0).normal(0.08, sd, size=(20_000, n))
    t = d.mean(1) / (d.std(1, ddof=1) / np.sqrt(n))
    simulated = np.mean(np.abs(t) > sp.t.ppf(0.975, n - 1))
    assert simulated == pytest.approx(stats.t_power(0.08, n, xa, xb, paired=True), abs=0.015)
    assert stats.t_power(0.08, n, xa, xb, paired=True) >= 0.8
    # a zero difference needs infinitely many, no spread 2, one seed is no measured spread,
    # and the search stops at `most`
    assert stats.seeds_needed(xa, xb, 0.0, paired=True) == np.inf
    assert stats.seeds_needed([0.5, 0.5], [0.4, 0.4], 0.1, paired=False) == 2
    assert np.isnan(stats.seeds_needed([0.5], [0.4, 0.5], 0.1, paired=False))
    assert stats.seeds_needed(xa, xb, 1e-4, paired=False, most=100) == np.inf


def test_data_to_resolve_counts_seeds_and_problems_for_an_unresolved_difference():
    # d = 0.1, each source resolving 0.1 / sqrt 2 with 80% power: seeds by the t test's power
    # (Welch's here: no record says the seeds share rollouts), problems by the normal test's,
    # (1.96 + 0.8416)^2 * (0.6 * 0.4 + 0.5 * 0.5) / 0.005 = 769.2
    a, b = [0.5, 0.6, 0.7], [0.4, 0.5, 0.6]
    d, sd, seeds, probs = stats.data_to_resolve(a, b, 200, paired=False)
    assert d == pytest.approx(0.1) and sd == pytest.approx(0.1)
    half = 0.1 / np.sqrt(2)
    assert seeds == next(n for n in range(2, 999) if _power_by_formula(half, n, a, b, False) >= 0.8)
    assert seeds == 33 and probs == 770
    # paired: the spread is the seed differences' (here none: 2 seeds would do, 3 were used)
    assert stats.data_to_resolve(a, b, 200, paired=True)[1:3] == (0.0, 3)
    # never fewer than the data already used
    assert stats.data_to_resolve([0.9, 0.9, 0.91], [0.1, 0.1, 0.11], 200, paired=False)[2:] == (
        3, 200)  # fmt: skip
    rec = lambda xs: [{"curve": [(0, 0.1), (9, x)]} for x in xs]  # noqa: E731
    recs = {"gvpo 4mbx1ep": rec((0.5, 0.6, 0.7)), "grpo 4mbx1ep": rec((0.4, 0.5, 0.6)),
            "dr_grpo 4mbx1ep": rec((0.10, 0.11, 0.12))}  # fmt: skip
    lines = report.needs_lines(recs, smol.SMOL_PAIRS, 200)
    # gvpo - dr_grpo and grpo - dr_grpo are resolved; pairs with unrecorded cells are left out
    assert lines == ["- gvpo 4mbx1ep - grpo 4mbx1ep: +0.100 at a seed std of 0.100: ~33 seeds "
                     "per cell and ~770 problems"]  # fmt: skip


def _enumerate_two_stage(a, b, paired):
    """Every equally likely outcome of the two-stage bootstrap, enumerated: (values, weights)."""
    import itertools

    seeds = lambda s: list(itertools.product(range(s), repeat=s))  # noqa: E731
    draws_a = seeds(len(a))
    pairs = [(x, x) for x in draws_a] if paired else list(
        itertools.product(draws_a, seeds(len(b))))  # fmt: skip
    values = []
    for sa, sb in pairs:
        for q in itertools.product(range(a.shape[1]), repeat=a.shape[1]):
            q = list(q)
            values.append(a[list(sa)][:, q].mean() - b[list(sb)][:, q].mean())
    return np.array(values)


def test_two_stage_bootstrap_is_seeds_then_problems_by_enumeration_and_a_direct_loop():
    """The vectorised two-stage bootstrap against a per-resample loop over the same draws, and
    its distribution and interval against an enumeration of every draw on a tiny case."""
    a = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.5]])  # 2 seeds x 3 problems
    b = np.array([[0.0, 0.0, 1.0], [0.5, 1.0, 0.0]])
    c = np.array([[0.0, 0.0, 0.0], [1.0, 0.5, 0.0], [0.0, 1.0, 1.0]])  # 3 seeds
    for x, y, paired in ((a, b, True), (a, c, False)):
        means = stats.two_stage_means(x, y, paired=paired, resamples=4000, seed=3)
        # the loop: seeds first (shared when paired), then problems shared by every run
        rng = np.random.default_rng(3)
        sx = rng.integers(0, len(x), (4000, len(x)))
        sy = sx if paired else rng.integers(0, len(y), (4000, len(y)))
        q = rng.integers(0, 3, (4000, 3))
        loop = [x[sx[r]][:, q[r]].mean() - y[sy[r]][:, q[r]].mean() for r in range(4000)]
        np.testing.assert_allclose(means, loop, atol=1e-12)
        exact = _enumerate_two_stage(x, y, paired)  # 4 x 27 or 4 x 27 x 27 outcomes
        assert means.mean() == pytest.approx(exact.mean(), abs=0.01)
        assert means.std() == pytest.approx(exact.std(), rel=0.04)
        atoms = np.unique(exact)  # the bootstrap's CDF is the enumeration's, within noise
        cdf = lambda v: (v[:, None] <= atoms + 1e-12).mean(0)  # noqa: E731
        assert np.abs(cdf(means) - cdf(exact)).max() < 0.025
        d, lo, hi = stats.two_stage_interval(x, y, paired=paired, resamples=4000, seed=3)
        assert d == pytest.approx(x.mean() - y.mean())
        assert np.quantile(exact, 0.015) <= lo <= np.quantile(exact, 0.035)
        assert np.quantile(exact, 0.965) <= hi <= np.quantile(exact, 0.985)
    with pytest.raises(ValueError, match="do not pair"):
        stats.two_stage_means(a, c, paired=True)


def test_differences_pair_runs_that_share_their_first_rollouts():
    """`report.difference`: the seeds' interval is paired (Student's t over the seed
    differences) when each seed's first reward agrees, else Welch's; with per-problem outcomes
    the problems' interval is the two-stage bootstrap, and the verdict needs both."""
    from scipy import stats as sp

    def run(final, reward, greedy=None):
        r = {"curve": [(0, 0.1), (9, final)], "rewards": [reward, 0.5]}
        if greedy is not None:
            r["outcomes"] = {"ids": ["p0", "p1", "p2", "p3"], "n": 1, "greedy": greedy,
                             "correct": greedy}  # fmt: skip
        return r

    xa, xb = [0.50, 0.60, 0.72], [0.42, 0.50, 0.66]
    a = [run(x, r) for x, r in zip(xa, (0.1, 0.2, 0.3), strict=True)]
    b = [run(x, r) for x, r in zip(xb, (0.1, 0.2, 0.3), strict=True)]
    assert report.shares_first_rollouts(a, b) and not report.shares_first_rollouts(a, b[::-1])
    assert not report.shares_first_rollouts(a, b[:2])
    x = report.difference(a, b)
    lo, hi = sp.ttest_rel(xa, xb).confidence_interval(0.95)
    assert x["paired"] and x["diff"] == pytest.approx(0.08)
    assert x["seeds_ci95"] == pytest.approx((hi - lo) / 2) and x["verdict"] == "resolved"
    y = report.difference(a, b[::-1])  # other first rollouts: Welch's
    lo, hi = sp.ttest_ind(xa, xb[::-1], equal_var=False).confidence_interval(0.95)
    assert not y["paired"] and y["seeds_ci95"] == pytest.approx((hi - lo) / 2)
    # with outcomes: the two-stage interval over the runs' per-problem scores
    ga = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    gb = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    a = [run(np.mean(g), r, g) for g, r in zip(ga, (0.1, 0.2, 0.3), strict=True)]
    b = [run(np.mean(g), r, g) for g, r in zip(gb, (0.1, 0.2, 0.3), strict=True)]
    x = report.difference(a, b, problems=4)
    assert (x["lo"], x["hi"]) == stats.two_stage_interval(ga, gb, paired=True)[1:]
    assert (x["a_higher"], x["b_higher"], "problems_ci95" in x) == (2, 0, False)
    resolved_by_seeds = abs(x["diff"]) > x["seeds_ci95"]
    boot = x["lo"] > 0 or x["hi"] < 0
    assert x["verdict"] == (
        "resolved"
        if resolved_by_seeds and boot
        else "resolved on these problems"
        if resolved_by_seeds
        else "not resolved"
    )


def test_runs_table_has_a_row_per_run_with_its_greedy_curve():
    rec = {"curve": [(0, 0.185), (5, 0.3), (10, 0.59)], "curve_sampled": [(0, 0.097), (10, 0.307)],
           "kl_start": 0.19, "cpu_s": 1620.0}  # fmt: skip
    old = {"curve": [(0, 0.185), (10, 0.4)], "kl_start": 0.05}  # no avg@n, no CPU time logged
    rows = report.runs_table([("gvpo 4mbx1ep", 2, rec), ("grpo on-policy", 0, old)]).splitlines()
    assert rows[2] == "| gvpo 4mbx1ep | 2 | 0.185 0.300 0.590 | 0.097 -> 0.307 | 0.190 | 27 |"
    assert rows[3] == "| grpo on-policy | 0 | 0.185 0.400 | - -> - | 0.050 | - |"


def test_spread_ratio_interval_is_the_f_distributions_and_says_what_3_seeds_resolve():
    # equal spreads, 3 seeds each: F(0.975; 2, 2) = 39, so the std ratio's interval is 39^-+0.5
    ratio, lo, hi = stats.spread_ratio([0.0, 1.0, 2.0], [5.0, 6.0, 7.0])
    assert ratio == pytest.approx(1.0) and lo == pytest.approx(39**-0.5, rel=1e-4)
    assert hi == pytest.approx(39**0.5, rel=1e-4)
    # 5 seeds against 3: F(0.975; 4, 2) = 39.25, F(0.975; 2, 4) = 10.65
    ratio, lo, hi = stats.spread_ratio([0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0])
    assert ratio == pytest.approx(np.sqrt(2.5))
    assert lo == pytest.approx(np.sqrt(2.5 / 39.25), rel=1e-3)
    assert hi == pytest.approx(np.sqrt(2.5 * 10.65), rel=1e-3)
    rec = lambda xs: [{"curve": [(0, 0.1), (9, x)]} for x in xs]  # noqa: E731
    recs = {"gvpo 4mbx1ep": rec((0.50, 0.51, 0.52)), "grpo 4mbx1ep": rec((0.1, 0.5, 0.9)),
            "dr_grpo 4mbx1ep": rec((0.3, 0.5, 0.7))}  # fmt: skip
    lines = report.spread_lines(recs, [("gvpo 4mbx1ep", "grpo 4mbx1ep"),
                                       ("gvpo 4mbx1ep", "dr_grpo 4mbx1ep"),
                                       ("gvpo 4mbx1ep", "gvpo on-policy")])  # fmt: skip
    # 40x and 20x smaller stds are resolved; a pair with an unrecorded cell is left out
    assert len(lines) == 2
    assert lines[0] == ("- gvpo 4mbx1ep / grpo 4mbx1ep: seed std 0.010 / 0.400 = 0.03 "
                        "(95% 0.00-0.16, resolved)")  # fmt: skip
    near = report.spread_lines({"a": rec((0.50, 0.55, 0.60)), "b": rec((0.3, 0.5, 0.7))},
                               [("a", "b")])  # fmt: skip
    assert near[0].endswith("(95% 0.04-1.56, not resolved)")  # a 4x smaller std is not


def test_smollm2_figure_has_a_panel_per_question_with_the_recorded_cells(tmp_path):
    rec = [{"curve": [(0, 0.2), (10, x)]} for x in (0.4, 0.5)]
    names = ["gvpo 4mbx1ep", "dr_grpo 4mbx1ep", "gvpo beta 0.2 4mbx1ep", "grpo on-policy"]
    panels = smol.smol_panels({n: rec for n in names})
    assert [[label for label, _ in series] for _, series in panels] == [
        ["gvpo 4mbx1ep", "dr_grpo 4mbx1ep"],
        ["beta 0.1", "beta 0.2"],  # the official GVPO cell is the beta 0.1 point
        ["grpo on-policy"],
    ]
    assert "official" in panels[0][0] and "beta" in panels[1][0] and "on-policy" in panels[2][0]
    # a question with no recorded cell yet gets no panel
    only = smol.smol_panels({"grpo on-policy": rec})
    assert len(only) == 1 and "on-policy" in only[0][0]
    report.plot_panels(panels, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_differences_also_carry_the_held_out_sets_sampling_error():
    # p = 0.5 and 0.3 on 200 problems: 1.96 * sqrt((0.25 + 0.21) / 200) = 0.0940
    assert stats.problems_ci95(0.5, 0.3, 200) == pytest.approx(1.96 * np.sqrt(0.46 / 200))
    rec = lambda xs: [{"curve": [(0, 0.1), (9, x)]} for x in xs]  # noqa: E731
    recs = {"a": rec((0.50, 0.52, 0.51)), "b": rec((0.30, 0.31, 0.29)),
            "c": rec((0.45, 0.46, 0.44)), "d": rec((0.40, 0.60, 0.50))}  # fmt: skip
    pairs = [("a", "b"), ("a", "c"), ("a", "d"), ("b", "e")]  # "e" has no records: left out
    lines = report.diff_lines(recs, pairs, problems=200)
    assert len(lines) == 3
    by_pair = {line.split(":")[0]: line for line in lines}
    # 0.21 beyond the seeds' 0.023 and the problems' 0.094 combined
    assert by_pair["- a - b"].endswith("+- 0.023 seeds Welch, +- 0.094 problems (resolved)")
    # 0.06: the seeds resolve it on these problems, the 200 problems do not
    assert by_pair["- a - c"].endswith("(resolved on these problems)")
    # seeds spread 0.4-0.6: not even resolved on these problems
    assert by_pair["- a - d"].endswith("(not resolved)")
    # 5000 problems resolve what 200 cannot
    many = {
        line.split(":")[0]: line for line in report.diff_lines(recs, [("a", "c")], problems=5000)
    }
    assert many["- a - c"].endswith("(resolved)")
    assert report.chance_note(40).startswith("(40 comparisons at 95% each") and "about 2.0" in (
        report.chance_note(40)
    )


@pytest.mark.slow
def test_smollm2_study_quick_records_greedy_and_sampled_curves(tmp_path):
    """Part 2's code path on a tiny random Llama (no GGUF): the shared start evaluation, a
    recorded run per cell, avg@n at the start and end only, greedy at every evaluation; the
    records and the start kept beside the results (what a rerun restores them from)."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = child_env()
    cmd = [sys.executable, "-m", "studies.smollm2.study", "--quick"]
    cmd += ["--out", str(out), "--workdir", str(work)]
    proc = subprocess.run(cmd, cwd=runs.REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["cells"]) == {"gvpo 4mbx1ep", "grpo on-policy"}
    budget = summary["budget_responses"]
    for name, cell in summary["cells"].items():
        (rec,) = cell["records"]
        assert rec["curve"][0] == [0, summary["start"]["greedy"]], name
        assert rec["curve_sampled"][0] == [0, summary["start"]["sampled"]], name
        assert len(rec["curve_sampled"]) == 2 and rec["curve_sampled"][-1][0] >= budget, name
        assert len(rec["grad_norm"]) == rec["steps"] == 2, name
    md = (out / "results.md").read_text()
    assert "| gvpo 4mbx1ep |" in md and "avg@2 at temperature 1" in md
    assert "| gvpo 4mbx1ep | 0 |" in md and "| grpo on-policy | 0 |" in md  # the per-run rows
    assert (out / "smollm2.png").stat().st_size > 1000
    assert len(list((out / "records").glob("*_s0.json"))) == 2 and (out / "start.json").exists()
    kept = {p.name: p.read_text() for p in (out / "metrics").glob("*_s0.jsonl")}  # per-step metrics
    assert kept.keys() == {p.name + "l" for p in (out / "records").glob("*_s0.json")}
    assert sum('"adv_term"' in text for text in kept.values()) == 1  # GVPO's loss terms
