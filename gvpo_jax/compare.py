"""Paired comparison of two policies on the same problems: `python -m gvpo_jax.compare A B`.

A and B are workdirs or outcome files. A workdir gives its eval-mode results (`eval/<set>.json`,
`--config.mode=eval` over `eval.sets`) or, without those, its latest training-time evaluation
(`eval_outcomes/step_*.json`; `--step_a` / `--step_b` pick another). Problems are paired by
(set, id), and each pair must be the same problem (the same digest of text and gold; records
written before digests: the same gold), else the comparison is refused. A problem's score is its
fraction of correct samples (correct / n: avg@n, the greedy verdict when n = 1;
`--metric=greedy` takes the greedy verdict whatever n). Reported per set and over all paired
problems: mean score of A and B, the difference B - A with a 95% (`--level`) paired bootstrap
interval (10,000 `--resamples` of the paired problems, `--seed` 0: the same inputs give the same
interval), how many problems each policy scores higher on, and for 0/1 scores McNemar's exact
two-sided p-value (binomial test on the discordant pairs). Bad input of any kind (a path, a file,
a record, a flag) ends with one sentence `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import numbers
import os
import re
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from gvpo_jax.errors import BadInputError

EXIT_BAD_INPUT = 2


class CompareError(BadInputError):
    """Outcomes that cannot be compared: a missing path, a file that is not an outcome file,
    different problems under the same ids, no shared problem, a bad setting."""


# A bootstrap draws resamples x problems indices at once (int64): bound it to ~800 MB.
MAX_DRAWS = 100_000_000
RESAMPLES = 10_000  # bootstrap resamples by default (the learning studies' too)


def _show(value) -> str:
    """A value as a short one-line repr, for a sentence about it."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value) -> int | None:
    """`value` as an int when it is a whole number (3 or 3.0, not True or 'three'), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if not isinstance(value, numbers.Integral) and not (
        math.isfinite(value) and float(value).is_integer()
    ):
        return None
    return int(value)


def _read_json(path: str) -> dict:
    """An outcome file's JSON object, else CompareError naming the file."""
    try:
        with open(path) as f:
            value = json.load(f)
    except OSError as e:
        raise CompareError(f"{path} could not be read ({e.strerror}); give an outcome file.") from e
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CompareError(f"{path} is not valid JSON ({reason}); give an outcome file.") from e
    if not isinstance(value, dict) or not isinstance(value.get("outcomes"), list):
        raise CompareError(f"{path} holds no 'outcomes' list; give an eval or eval_outcomes file.")
    return value


def outcome_files(path: str, step: int | None = None, *, flag: str = "step") -> list[str]:
    """The outcome files a path stands for: itself (a file), a workdir's eval-mode results, or
    its training-time evaluation at `step` (default: the latest)."""
    if os.path.isfile(path):
        if step is not None:
            raise CompareError(
                f"--{flag} picks a training-time evaluation in a workdir, and {path} is a file; "
                f"give the workdir or drop --{flag}."
            )
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


def _check_outcome(o, where: str) -> None:
    """An outcome record as `eval.problem_outcomes` writes it, else CompareError naming it."""
    fix = "give an eval or eval_outcomes file"
    if not isinstance(o, Mapping):
        raise CompareError(f"{where} is {_show(o)}, not a JSON object; {fix}.")
    missing = [k for k in ("id", "set", "n", "correct", "greedy") if k not in o]
    if missing:
        raise CompareError(f"{where} has no {' / '.join(missing)}; {fix}.")
    n, correct = _whole(o["n"]), _whole(o["correct"])
    if n is None or n < 1:
        raise CompareError(f"{where} has n {_show(o['n'])}; n counts samples, at least 1.")
    if correct is None or not 0 <= correct <= n:
        raise CompareError(
            f"{where} has correct {_show(o['correct'])} of n {n}; it counts correct samples, "
            "a whole number from 0 to n."
        )
    if _whole(o["greedy"]) not in (0, 1):
        raise CompareError(f"{where} has greedy {_show(o['greedy'])}; it is a verdict, 0 or 1.")


def load_outcomes(path: str, step: int | None = None, *, flag: str = "step"):
    """{(set, id): outcome} of every outcome file `path` stands for; CompareError for a record
    off the layout or an id twice in one set."""
    out: dict[tuple[str, str], dict] = {}
    for f in outcome_files(path, step, flag=flag):
        for i, o in enumerate(_read_json(f)["outcomes"]):
            _check_outcome(o, f"{f} outcome {i + 1}")
            key = (str(o["set"]), str(o["id"]))
            if key in out:
                raise CompareError(
                    f"{f} outcome {i + 1} repeats id {key[1]!r} of set {key[0]!r}; pairs need "
                    "ids unique within a set, so re-evaluate with this version."
                )
            out[key] = o
    return out


def _same_problem(x: Mapping, y: Mapping) -> bool | None:
    """Whether two outcomes are of the same problem: by their digests (eval.problem_digest, over
    text and gold), or, for records written before digests, by their golds; None: no way to
    tell."""
    for field in ("digest", "gold"):
        if field in x and field in y:
            return str(x[field]) == str(y[field])
    return None


def _check_settings(metric: str, resamples, seed, level) -> None:
    """CompareError for a setting no comparison can use, before any file is read."""
    if metric not in ("mean", "greedy"):
        raise CompareError(f"--metric is {_show(metric)}; use mean or greedy.")
    if _whole(resamples) is None or resamples < 1:
        raise CompareError(
            f"--resamples is {_show(resamples)}; give at least 1 ({RESAMPLES} default)."
        )
    if _whole(seed) is None or seed < 0:
        raise CompareError(f"--seed is {_show(seed)}; give a whole number >= 0.")
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 < level < 1:
        raise CompareError(
            f"--level is {_show(level)}; give the interval's confidence between 0 and 1 "
            "(0.95: a 95% interval)."
        )


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


def paired_difference(a, b, *, resamples: int = RESAMPLES, seed: int = 0, level: float = 0.95):
    """Mean of b - a over paired problems and its bootstrap interval (percentile method, the
    problems resampled with replacement `resamples` times from a fixed seed)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = b - a
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    out = {
        "problems": len(d),
        "a": float(a.mean()),
        "b": float(b.mean()),
        "diff": float(d.mean()),
        "lo": float(min(lo, d.mean())),
        "hi": float(max(hi, d.mean())),
        "b_higher": int((d > 0).sum()),
        "a_higher": int((d < 0).sum()),
    }
    if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
        out["mcnemar_p"] = mcnemar_p(out["a_higher"], out["b_higher"])
    return out


def compare(
    a_path: str,
    b_path: str,
    *,
    metric: str = "mean",
    step_a=None,
    step_b=None,
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """{"sets": {set: paired_difference...}, "all": ..., "unpaired": {"a": k, "b": k}}.

    Problems are paired by (set, id), and a pair must be the same problem (same digest of text
    and gold; records without digests: the same gold), else CompareError: two files that share
    a set name but hold other problems are refused, never paired row by row.
    """
    _check_settings(metric, resamples, seed, level)
    a = load_outcomes(a_path, step_a, flag="step_a")
    b = load_outcomes(b_path, step_b, flag="step_b")
    keys = [k for k in a if k in b]
    if not keys:
        sets = lambda x: ", ".join(dict.fromkeys(k[0] for k in x)) or "none"
        raise CompareError(
            f"{a_path} (sets {sets(a)}) and {b_path} (sets {sets(b)}) share no problem (pairs "
            "are matched by set and id); evaluate both on the same sets."
        )
    same = {k: _same_problem(a[k], b[k]) for k in keys}
    unknown = [k for k in keys if same[k] is None]
    if unknown:
        raise CompareError(
            f"{a_path} and {b_path} have outcomes without a digest or gold (first: set "
            f"{unknown[0][0]!r} id {unknown[0][1]!r}), so they cannot be checked to be the same "
            "problems; re-evaluate with this version."
        )
    differ = [k for k in keys if not same[k]]
    if differ:
        raise CompareError(
            f"{a_path} and {b_path} hold different problems under the same set and id "
            f"({len(differ)} of {len(keys)}, first: set {differ[0][0]!r} id {differ[0][1]!r}); "
            "compare evaluations of the same problem files."
        )
    if resamples * len(keys) > MAX_DRAWS:
        raise CompareError(
            f"--resamples is {resamples}, which over {len(keys)} problems draws more than "
            f"{MAX_DRAWS:,} indices; give at most {MAX_DRAWS // len(keys):,}."
        )
    sets = list(dict.fromkeys(k[0] for k in keys))
    result = {
        "metric": metric,
        "level": level,
        "sets": {},
        "unpaired": {"a": len(a) - len(keys), "b": len(b) - len(keys)},
    }
    for name in [*sets, None]:
        ks = [k for k in keys if name is None or k[0] == name]
        diff = paired_difference(
            [score(a[k], metric) for k in ks],
            [score(b[k], metric) for k in ks],
            resamples=resamples,
            seed=seed,
            level=level,
        )
        if name is None:
            result["all"] = diff
        else:
            result["sets"][name] = diff
    return result


def format_result(result: Mapping, a_path: str, b_path: str) -> str:
    """The result as a Markdown table, one row per set and one over all paired problems."""
    level = f"{100 * result.get('level', 0.95):g}%"
    lines = [
        f"A = {a_path}",
        f"B = {b_path}",
        f"score per problem: {'greedy verdict' if result['metric'] == 'greedy' else 'correct / n'}"
        f"; B - A with a {level} paired bootstrap interval",
        "",
        f"| set | problems | A | B | B - A | {level} interval | B higher | A higher | McNemar p |",
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


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one sentence (CompareError), not usage text and exit."""

    def error(self, message):
        raise CompareError(f"{message}; see python -m gvpo_jax.compare --help.")


def _check_json_path(path: str) -> None:
    """Refuses a --json path that cannot be written before anything is computed or printed."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent):
        what = "is a directory" if os.path.isdir(path) else f"is in {parent}, which is no directory"
        raise CompareError(f"--json {path} {what}; give a file path in an existing directory.")


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: prints the table (and writes --json); bad input of any kind is one sentence on
    stderr and exit status 2, with nothing written."""
    parser = _Parser(
        prog="python -m gvpo_jax.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", help="workdir or outcome file of policy A")
    parser.add_argument("b", help="workdir or outcome file of policy B")
    parser.add_argument("--metric", choices=("mean", "greedy"), default="mean")
    parser.add_argument("--step_a", type=int, default=None, help="A's training-time evaluation")
    parser.add_argument("--step_b", type=int, default=None, help="B's training-time evaluation")
    parser.add_argument("--resamples", type=int, default=RESAMPLES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--level", type=float, default=0.95, help="the interval's confidence")
    parser.add_argument("--json", default="", help="also write the result to this JSON file")
    try:
        args = parser.parse_args(argv)
        if args.json:
            _check_json_path(args.json)
        result = compare(
            args.a,
            args.b,
            metric=args.metric,
            step_a=args.step_a,
            step_b=args.step_b,
            resamples=args.resamples,
            seed=args.seed,
            level=args.level,
        )
    except BadInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_result(result, args.a, args.b))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as e:
            print(
                f"error: --json {args.json} could not be written ({e.strerror}); give a "
                "writable file path.",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
