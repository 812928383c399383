"""Paired comparison of two policies on the same problems: `python -m gvpo_jax.compare A B`.

A and B are workdirs or outcome files. A workdir gives its eval-mode results (`eval/<set>.json`,
`--config.mode=eval` over `eval.sets`) or, without those, its latest training-time evaluation
(`eval_outcomes/step_*.json`; `--step` picks another). Problems are paired by (set, id); a
problem's score is its fraction of correct samples (correct / n: avg@n, the greedy verdict when
n = 1; `--metric=greedy` takes the greedy verdict whatever n). Reported per set and over all
paired problems: mean score of A and B, the difference B - A with a 95% paired bootstrap
interval (10,000 resamples of the paired problems, seed 0: the same inputs give the same
interval), how many problems each policy scores higher on, and for 0/1 scores McNemar's exact
two-sided p-value (binomial test on the discordant pairs).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from gvpo_jax.errors import BadInputError

EXIT_BAD_INPUT = 2


class CompareError(BadInputError):
    """Outcomes that cannot be compared: a missing path, no outcome file, no shared problem."""


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except OSError as e:
        raise CompareError(f"{path} could not be read ({e.strerror}); give an outcome file.") from e
    except ValueError as e:
        raise CompareError(f"{path} is not valid JSON ({e}); give an outcome file.") from e
    if not isinstance(value, dict) or not isinstance(value.get("outcomes"), list):
        raise CompareError(f"{path} holds no 'outcomes' list; give an eval or eval_outcomes file.")
    return value


def outcome_files(path: str, step: int | None = None) -> list[str]:
    """The outcome files a path stands for: itself (a file), a workdir's eval-mode results, or
    its training-time evaluation at `step` (default: the latest)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise CompareError(f"{path} does not exist; give a workdir or an outcome file.")
    sets = sorted(
        f
        for f in glob.glob(os.path.join(path, "eval", "*.json"))
        if os.path.basename(f) != "table.json"
    )
    if sets and step is None:
        return sets
    runs = glob.glob(os.path.join(path, "eval_outcomes", "step_*.json"))

    def order(f):
        match = re.match(r"step_(\d+)", os.path.basename(f))
        return (int(match.group(1)), os.path.getmtime(f)) if match else (-1, 0.0)

    runs = [f for f in runs if step is None or order(f)[0] == step]
    if not runs:
        what = f"at step {step}" if step is not None else "(eval/ or eval_outcomes/)"
        raise CompareError(f"{path} holds no evaluation outcomes {what}; evaluate it first.")
    return [max(runs, key=order)]


def load_outcomes(path: str, step: int | None = None) -> dict[tuple[str, str], dict]:
    """{(set, id): outcome} of every outcome file `path` stands for."""
    out = {}
    for f in outcome_files(path, step):
        for o in _read_json(f)["outcomes"]:
            if not {"id", "set", "n", "correct", "greedy"} <= set(o):
                raise CompareError(f"{f} has an outcome without id / set / n / correct / greedy.")
            out[(str(o["set"]), str(o["id"]))] = o
    return out


def score(outcome: Mapping, metric: str = "mean") -> float:
    """A problem's score: its fraction of correct samples ("mean"), or its greedy verdict."""
    if metric == "greedy":
        return float(outcome["greedy"])
    return float(outcome["correct"]) / float(outcome["n"])


def mcnemar_p(a_only: int, b_only: int) -> float:
    """Exact two-sided McNemar p-value: a binomial(a_only + b_only, 1/2) test of the discordant
    pairs (1.0 when there are none)."""
    m = a_only + b_only
    if m == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2.0**m
    return min(1.0, 2.0 * tail)


def paired_difference(a, b, *, resamples: int = 10_000, seed: int = 0, level: float = 0.95):
    """Mean of b - a over paired problems and its bootstrap interval (percentile method, the
    problems resampled with replacement `resamples` times from a fixed seed)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = b - a
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    out = {
        "problems": len(d), "a": float(a.mean()), "b": float(b.mean()), "diff": float(d.mean()),
        "lo": float(min(lo, d.mean())), "hi": float(max(hi, d.mean())),
        "b_higher": int((d > 0).sum()), "a_higher": int((d < 0).sum()),
    }  # fmt: skip
    if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
        out["mcnemar_p"] = mcnemar_p(out["a_higher"], out["b_higher"])
    return out


def compare(a_path: str, b_path: str, *, metric: str = "mean", step_a=None, step_b=None,
            resamples: int = 10_000, seed: int = 0) -> dict:  # fmt: skip
    """{"sets": {set: paired_difference...}, "all": ..., "unpaired": {"a": k, "b": k}}."""
    a, b = load_outcomes(a_path, step_a), load_outcomes(b_path, step_b)
    keys = [k for k in a if k in b]
    if not keys:
        raise CompareError(
            f"{a_path} and {b_path} share no problem (pairs are matched by set and id); "
            "evaluate both on the same sets."
        )
    sets = list(dict.fromkeys(k[0] for k in keys))
    result = {"metric": metric, "sets": {}, "unpaired": {"a": len(a) - len(keys),
                                                         "b": len(b) - len(keys)}}  # fmt: skip
    for name in [*sets, None]:
        ks = [k for k in keys if name is None or k[0] == name]
        diff = paired_difference([score(a[k], metric) for k in ks],
                                 [score(b[k], metric) for k in ks],
                                 resamples=resamples, seed=seed)  # fmt: skip
        if name is None:
            result["all"] = diff
        else:
            result["sets"][name] = diff
    return result


def format_result(result: Mapping, a_path: str, b_path: str) -> str:
    lines = [
        f"A = {a_path}",
        f"B = {b_path}",
        f"score per problem: {'greedy verdict' if result['metric'] == 'greedy' else 'correct / n'}"
        "; B - A with a 95% paired bootstrap interval",
        "",
        "| set | problems | A | B | B - A | 95% interval | B higher | A higher | McNemar p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [*result["sets"].items(), ("all", result["all"])]
    for name, r in rows:
        p = f"{r['mcnemar_p']:.3g}" if "mcnemar_p" in r else "-"
        lines.append(
            f"| {name} | {r['problems']} | {r['a']:.4f} | {r['b']:.4f} | {r['diff']:+.4f} "
            f"| [{r['lo']:+.4f}, {r['hi']:+.4f}] | {r['b_higher']} | {r['a_higher']} | {p} |"
        )
    if result["unpaired"]["a"] or result["unpaired"]["b"]:
        lines.append(
            f"\nUnpaired problems left out: {result['unpaired']['a']} of A, "
            f"{result['unpaired']['b']} of B."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gvpo_jax.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", help="workdir or outcome file of policy A")
    parser.add_argument("b", help="workdir or outcome file of policy B")
    parser.add_argument("--metric", choices=("mean", "greedy"), default="mean")
    parser.add_argument("--step_a", type=int, default=None, help="A's training-time evaluation")
    parser.add_argument("--step_b", type=int, default=None, help="B's training-time evaluation")
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="also write the result to this JSON file")
    args = parser.parse_args(argv)
    try:
        result = compare(args.a, args.b, metric=args.metric, step_a=args.step_a,
                         step_b=args.step_b, resamples=args.resamples, seed=args.seed)  # fmt: skip
    except BadInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_result(result, args.a, args.b))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
