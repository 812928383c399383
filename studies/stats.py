"""The learning studies' statistics, one implementation for every part: a difference between
two cells over seeds (paired by seed where the cells' runs share their first rollouts, else
Welch's), over seeds and held-out problems (a two-stage bootstrap: seeds, then problems), the
seeds a difference needs to be resolved at 80% power, and the ratio of two cells' seed spreads.
Pure functions of arrays; `studies.report` applies them to run records."""

from __future__ import annotations

import numpy as np
from scipy import stats

from gvpo_jax.compare import RESAMPLES  # the bootstrap's resamples, as python -m gvpo_jax.compare

LEVEL = 0.95  # every interval's confidence (and the test a "resolved" difference passes)
POWER = 0.8  # the chance the data a difference "needs" give of resolving it, if it is real
MOST_SEEDS = 10_000  # where `seeds_needed` stops searching (more: "more than MOST_SEEDS")


def _quantile(level: float = LEVEL) -> float:
    """The upper tail probability's point of a two-sided interval at `level` (0.975 for 95%)."""
    return 1.0 - (1.0 - level) / 2.0


def ci95(x) -> float:
    """Half-width of the 95% confidence interval of the mean of x (Student's t over seeds)."""
    x = np.asarray(x, np.float64)
    if len(x) < 2:
        return float("nan")
    return float(stats.t.ppf(_quantile(), len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))


def diff_ci95(a, b) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95% interval (Welch's t, the seeds of two
    cells as independent samples, at the Welch-Satterthwaite degrees of freedom, fractional as
    they are: rounding them down widens the interval). The difference is resolved when
    |diff| > half-width."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = np.sqrt(va + vb)
    if se == 0:
        return float(a.mean() - b.mean()), 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(a.mean() - b.mean()), float(stats.t.ppf(_quantile(), dof) * se)


def seeds_ci95(a, b, *, paired: bool) -> tuple[float, float]:
    """mean(a) - mean(b) over seeds and the half-width of its 95% interval: paired by seed
    (Student's t over the n seed differences a_i - b_i, n - 1 degrees of freedom) when the two
    cells' seed i shares its first rollouts, else Welch's (`diff_ci95`)."""
    if not paired:
        return diff_ci95(a, b)
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(d.mean()), ci95(d)


def problems_ci95(pa: float, pb: float, problems: int) -> float:
    """Half-width of the 95% interval that the finite held-out set alone puts on a difference of
    two accuracies pa - pb, each measured on `problems` problems (normal approximation of the
    binomial). It treats the two as independent, which over-states it: both cells are scored on
    the same problems, and a problem one method finds hard the other tends to find hard too.
    For runs that kept no per-problem outcomes; with them, `two_stage_interval`."""
    return float(1.96 * np.sqrt((pa * (1 - pa) + pb * (1 - pb)) / problems))


# ----------------------------------------------------------------------------------------------
# Over seeds and problems: the two-stage bootstrap


def two_stage_means(
    scores_a_SxP, scores_b_SxP, *, paired: bool, resamples: int = RESAMPLES, seed: int = 0
) -> np.ndarray:
    """[resamples] bootstrap draws of mean(scores_a) - mean(scores_b), each mean over seeds and
    problems, resampling in two stages: first the seeds, then the problems.

    scores_*_SxP: each run's (seed's) score per held-out problem (greedy 0/1, or correct / n),
    every run on the same problems in the same order. Stage 1 draws S seeds with replacement:
    one draw for both cells when `paired` (seed i of each shares its first rollouts), else one
    per cell. Stage 2 draws P problems with replacement, one draw for every seed of both cells:
    each run is scored on the same problems, so the problems are crossed with the seeds, not
    nested in them, and a problem drawn twice counts twice in every run. The spread of these
    draws is what a new seed and a new problem set would add; with the seeds held fixed the
    interval would speak only about the trained checkpoints.
    """
    a, b = np.asarray(scores_a_SxP, np.float64), np.asarray(scores_b_SxP, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or (paired and a.shape != b.shape):
        raise ValueError(f"scores of shapes {a.shape} and {b.shape} do not pair")
    rng = np.random.default_rng(seed)
    seeds_a = rng.integers(0, len(a), size=(resamples, len(a)))
    seeds_b = seeds_a if paired else rng.integers(0, len(b), size=(resamples, len(b)))
    problems = a.shape[1]
    drawn = rng.integers(0, problems, size=(resamples, problems))
    # How often each problem was drawn, so a run's resampled mean is counts @ scores / P.
    rows = np.arange(resamples)[:, None] * problems
    counts_RxP = np.bincount((rows + drawn).ravel(), minlength=resamples * problems)
    counts_RxP = counts_RxP.reshape(resamples, problems).astype(np.float64)
    mean_a = np.take_along_axis(counts_RxP @ a.T, seeds_a, axis=1).mean(axis=1)
    mean_b = np.take_along_axis(counts_RxP @ b.T, seeds_b, axis=1).mean(axis=1)
    return (mean_a - mean_b) / problems


def two_stage_interval(
    scores_a_SxP, scores_b_SxP, *, paired: bool, resamples: int = RESAMPLES, seed: int = 0,
    level: float = LEVEL,
) -> tuple[float, float, float]:  # fmt: skip
    """(mean(scores_a) - mean(scores_b), lo, hi): the percentile interval at `level` of
    `two_stage_means` (widened to hold the estimate, as `gvpo_jax.compare`'s). With few seeds
    (3-5) it is narrower than the t interval over seeds, which is the stricter test of a new
    seed: resampling 4 seeds treats their spread as the truth."""
    d = float(np.mean(scores_a_SxP) - np.mean(scores_b_SxP))
    means = two_stage_means(scores_a_SxP, scores_b_SxP, paired=paired, resamples=resamples,
                            seed=seed)  # fmt: skip
    lo, hi = np.quantile(means, [1.0 - _quantile(level), _quantile(level)])
    return d, float(min(lo, d)), float(max(hi, d))


# ----------------------------------------------------------------------------------------------
# The data a difference needs


def t_power(diff: float, n: int, xa, xb, *, paired: bool, level: float = LEVEL) -> float:
    """Chance that the two-sided t test at `level` resolves a true difference `diff` with n seeds
    per cell, at the seed spread measured in xa and xb: paired, over n seed differences (their
    variance that of xa - xb, n - 1 degrees of freedom); else Welch's, the cells' variances
    measured apart (Welch-Satterthwaite degrees of freedom for n seeds each). The statistic is
    noncentral t with noncentrality |diff| / its standard error."""
    xa, xb = np.asarray(xa, np.float64), np.asarray(xb, np.float64)
    if paired:
        var, dof = np.var(xa - xb, ddof=1), n - 1.0
    else:
        va, vb = np.var(xa, ddof=1), np.var(xb, ddof=1)
        var, dof = va + vb, (n - 1.0) * (va + vb) ** 2 / (va**2 + vb**2)
    crit = stats.t.ppf(_quantile(level), dof)
    nc = abs(diff) / np.sqrt(var / n)
    return float(stats.nct.sf(crit, dof, nc) + stats.nct.cdf(-crit, dof, nc))


def seeds_needed(
    xa, xb, diff: float, *, paired: bool, power: float = POWER, level: float = LEVEL,
    most: int = MOST_SEEDS,
) -> float:  # fmt: skip
    """The fewest seeds per cell at which the t test over seeds (`t_power`, paired or Welch's as
    measured) resolves a true difference `diff` with probability `power`, at the spread measured
    in xa and xb. nan with fewer than 2 seeds in a cell (no spread measured), 2 when there is no
    spread, inf for a zero difference or past `most`. Power grows with n, so the search doubles
    n and then bisects."""
    if min(len(xa), len(xb)) < 2 or (paired and len(xa) != len(xb)):
        return float("nan")
    if paired:
        spread = np.var(np.subtract(xa, xb), ddof=1)
    else:
        spread = np.var(xa, ddof=1) + np.var(xb, ddof=1)
    if diff == 0:
        return float("inf")
    if spread == 0:
        return 2.0

    def enough(n):
        return t_power(diff, n, xa, xb, paired=paired, level=level) >= power

    lo, hi = 1, 2  # enough(lo) is false (no test with 1 seed), enough(hi) to be found
    while not enough(hi):
        if hi >= most:
            return float("inf")
        lo, hi = hi, min(2 * hi, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return float(hi)


def problems_needed(pa: float, pb: float, diff: float, *, power: float = POWER,
                    level: float = LEVEL) -> float:  # fmt: skip
    """The held-out problems at which `problems_ci95`'s normal test resolves a true difference
    `diff` of accuracies near pa and pb with probability `power`: (z_level + z_power)^2 times
    the two binomial variances over diff^2 (inf for a zero difference)."""
    if diff == 0:
        return float("inf")
    z = stats.norm.ppf(_quantile(level)) + stats.norm.ppf(power)
    return float(np.ceil(z**2 * (pa * (1 - pa) + pb * (1 - pb)) / diff**2))


def data_to_resolve(a, b, problems: int, *, paired: bool) -> tuple[float, float, float, float]:
    """How much data would resolve mean(a) - mean(b) with probability POWER if it is real, for
    the test of `studies.report.diff_lines` (the seeds' t interval and the problems' binomial
    one combined):
    the seeds per cell (`seeds_needed`) and held-out problems (`problems_needed`) at which each
    resolves a difference of |d| / sqrt(2), so the two share the combined interval equally.
    Returns (difference, the seed spread: the std of the seed differences when `paired`, else
    the cells' pooled seed std, seeds, problems); both counts are at least the data already
    used."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = float(a.mean() - b.mean())
    sd = float(np.std(a - b, ddof=1) if paired else np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2))
    seeds = seeds_needed(a, b, d / np.sqrt(2), paired=paired)
    probs = problems_needed(float(a.mean()), float(b.mean()), d / np.sqrt(2))
    return d, sd, max(seeds, len(a), len(b)), max(probs, problems)


def spread_ratio(a, b) -> tuple[float, float, float]:
    """Seed std of a over that of b, with the 95% interval of the ratio (the F distribution of
    two normal samples' variance ratio, (len(a) - 1, len(b) - 1) degrees of freedom). The
    spreads differ when the interval excludes 1; with 3 seeds each it spans a factor of 39 in
    variance (6.2 in std) either way."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    da, db = len(a) - 1, len(b) - 1
    va, vb = a.var(ddof=1), b.var(ddof=1)
    if va == 0 or vb == 0:
        return float("nan"), float("nan"), float("nan")
    f = va / vb
    q = _quantile()
    lo, hi = f / stats.f.ppf(q, da, db), f * stats.f.ppf(q, db, da)
    return float(np.sqrt(f)), float(np.sqrt(lo)), float(np.sqrt(hi))
