"""The GVPO paper's evaluation sets from local files in their published layouts: AIME 2024, AMC,
MATH-500, Minerva Math and OlympiadBench, with gold answers normalised for math-verify.

    ev = load_eval_set("amc", "/data/eval/aimo-validation-amc")   # a file or a directory
    ev.examples[0]   # {"prompt", "answer", "solution", "dataset": "amc", "id", ...}
    ev.skipped       # {"proof": 0, "no single final answer": 0, ...}: items left out, counted

Every reader accepts the field names of the common Hugging Face repositories of its set (the
table is in docs/data.md) and refuses, with one sentence naming the file and the line or row, a
record that has none of them (`EvalSetError`, exit status 2 from the CLI).
"""

from __future__ import annotations

import dataclasses
import fractions
import glob
import json
import math
import os
import re
from collections.abc import Mapping, Sequence

from gvpo_jax.errors import BadInputError
from gvpo_jax.rewards.extract import last_boxed

# The sets, in the order of the paper's table.
EVAL_SETS = ("aime24", "amc", "math500", "minerva", "olympiad")

# Published sizes (the paper's percentages are whole-problem fractions of these: AMC 38.55 =
# 32/83, Minerva 27.20 = 74/272, OlympiadBench 30.66 = 207/675, MATH-500 64.00 = 320/500).
PUBLISHED_SIZES = {"aime24": 30, "amc": 83, "math500": 500, "minerva": 272, "olympiad": 675}

_DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")


class EvalSetError(BadInputError):
    """An evaluation set that cannot be read: missing file, unknown set, fields off-layout."""


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One evaluation set: its examples, the files read, and the items left out by reason."""

    name: str
    examples: list[dict]
    files: tuple[str, ...]
    skipped: dict[str, int]


@dataclasses.dataclass(frozen=True)
class _Fields:
    """Accepted field names (first present wins) of one set's published layouts."""

    problem: tuple[str, ...]
    answer: tuple[str, ...]
    solution: tuple[str, ...] = ("solution", "Solution")
    id: tuple[str, ...] = ("unique_id", "id", "ID", "idx")
    # The answer may be read from the last \boxed{} of the solution when no answer field exists.
    answer_from_solution: bool = False


_FIELDS = {
    "aime24": _Fields(problem=("problem", "Problem", "question"), answer=("answer", "Answer")),
    "amc": _Fields(problem=("problem", "question", "Problem"), answer=("answer", "Answer")),
    "math500": _Fields(problem=("problem",), answer=("answer",), answer_from_solution=True),
    "minerva": _Fields(
        problem=("problem", "question"), answer=("answer",), answer_from_solution=True
    ),
    "olympiad": _Fields(problem=("question", "problem"), answer=("final_answer",)),
}


def _first(row: Mapping, names: Sequence[str]):
    """(field, value) of the first of `names` with a value, else the first present (null), else
    (None, None): a null field is still the layout's field (a proof's missing final answer)."""
    present = [name for name in names if name in row]
    for name in present:
        if row[name] is not None:
            return name, row[name]
    return (present[0], None) if present else (None, None)


def _where(path: str, index: int, is_jsonl: bool) -> str:
    return f"{path} line {index + 1}" if is_jsonl else f"{path} record {index + 1}"


# ----------------------------------------------------------------------------------------------
# Gold answers for math-verify


# Inline-math markers: an unescaped '$', or a '\(' / '\)' pair. '\$' is a dollar sign (MATH-500's
# '\$18.90'), which math-verify reads as money; dropping its '$' leaves '\18.90', which nothing
# parses. The pair is matched lazily so '\(1\), \(-1\)' loses all four markers, not the outer two.
_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_PAREN_MATH_RE = re.compile(r"(?<!\\)\\\((.*?)(?<!\\)\\\)", re.S)


def strip_dollars(text: str) -> str:
    """'$\\frac{1}{2}$' -> '\\frac{1}{2}'; '$x=1$, $x=2$' -> 'x=1, x=2'; '\\(1\\), \\(2\\)' ->
    '1, 2' (inline math markers); an escaped '\\$' is a dollar sign and stays: '\\$18.90'."""
    text = _PAREN_MATH_RE.sub(r"\1", text.strip())
    return _DOLLAR_RE.sub("", text).strip()


def number_text(value) -> str:
    """A gold number as LaTeX: 27.0 -> '27', '025' -> '25', 0.75 -> '\\frac{3}{4}', -3 -> '-3'.

    Integers lose a float's '.0' and AIME's leading zeros (math-verify reads '025' as 25 too, but
    the answer key for maj@k should be one spelling); a non-integer float becomes the fraction
    it is exactly up to 1e-9 with a denominator of at most 1000, else its shortest repr.
    """
    if isinstance(value, bool):
        raise ValueError(f"a boolean {value!r} is not an answer")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite answer")
        if value == int(value):
            return str(int(value))
        frac = fractions.Fraction(value).limit_denominator(1000)
        if abs(float(frac) - value) < 1e-9:
            sign = "-" if frac < 0 else ""
            return f"{sign}\\frac{{{abs(frac.numerator)}}}{{{frac.denominator}}}"
        return repr(value)
    text = strip_dollars(str(value))
    if re.fullmatch(r"[+-]?\d+", text):
        return str(int(text))
    if re.fullmatch(r"[+-]?\d+\.0*", text):
        return str(int(float(text)))
    return text


def olympiad_answer(final_answer, question_type: str | None) -> tuple[str | None, str | None]:
    """(gold, None) or (None, reason to skip) from OlympiadBench's `final_answer` list.

    A proof item (question_type 'Theorem proof', or no final answer) is skipped as "proof"; a list
    with more than one entry has no single final answer and is skipped as such. One entry that
    holds several values ('$3$, $5$', is_multiple_answer) stays: math-verify compares it as a set.
    """
    if question_type and "proof" in str(question_type).lower():
        return None, "proof"
    if isinstance(final_answer, str):
        final_answer = [final_answer]
    answers = [a for a in (final_answer or []) if a is not None and str(a).strip()]
    if not answers:
        return None, "proof"
    if len(answers) > 1:
        return None, "no single final answer"
    return strip_dollars(str(answers[0])), None


# ----------------------------------------------------------------------------------------------
# Files


def _data_files(path: str) -> list[str]:
    """The data files of a set: `path` itself, or the .jsonl / .json / .parquet files up to three
    levels below it (README and dataset_info files excluded)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise EvalSetError(f"{path} does not exist; point the set's path at its published files.")
    found = []
    for depth in range(4):
        pattern = os.path.join(path, *(["*"] * depth), "*")
        found += [
            f
            for f in glob.glob(pattern)
            if f.endswith(_DATA_EXTENSIONS)
            and os.path.isfile(f)
            and not os.path.basename(f).startswith(("dataset_info", "dataset_dict", "state"))
        ]
    return sorted(set(found))


def _read(path: str) -> tuple[list, bool]:
    """(records, is_jsonl) of one file; a line that is not JSON is an error naming it."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist(), False
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                rows = []
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        rows.append(None)
                        continue
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise EvalSetError(
                            f"{path} line {lineno} is not valid JSON ({e.msg}); fix or remove it."
                        ) from e
                return rows, True
            data = json.load(f)
    except EvalSetError:
        raise
    except json.JSONDecodeError as e:
        raise EvalSetError(f"{path} line {e.lineno} is not valid JSON ({e.msg}); fix it.") from e
    except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError)
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise EvalSetError(f"{path} could not be read ({reason}); give a valid file.") from e
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    return (data if isinstance(data, list) else [data]), False


def _pick_files(name: str, files: list[str]) -> list[str]:
    """OlympiadBench's repository holds one file per subset: the paper's set is the English,
    text-only, open-ended maths competition subset (OE_TO_maths_en_COMP, 675 problems)."""
    if name == "olympiad":
        subset = [f for f in files if "OE_TO_maths_en_COMP" in f]
        return subset or files
    if name == "math500":
        tests = [f for f in files if os.path.basename(f).startswith("test")]
        return tests or files
    return files


# ----------------------------------------------------------------------------------------------
# Records -> examples


def _example(name: str, row, where: str, index: int) -> tuple[dict | None, str | None]:
    """(example, None), or (None, reason it is skipped); EvalSetError for an off-layout record."""
    fields = _FIELDS[name]
    if not isinstance(row, Mapping):
        raise EvalSetError(
            f"{where} is not a JSON object with named fields; see docs/data.md for the layout."
        )
    problem_field, problem = _first(row, fields.problem)
    answer_field, answer = _first(row, fields.answer)
    _, solution = _first(row, fields.solution)
    if isinstance(solution, list):  # OlympiadBench: a list of solutions
        solution = "\n\n".join(str(s) for s in solution if s)
    solution = "" if solution is None else str(solution)
    if answer_field is None and fields.answer_from_solution and solution:
        answer = last_boxed(solution)
        answer_field = "solution" if answer is not None else None
    if problem_field is None or answer_field is None:
        missing = [] if problem_field else [" or ".join(repr(f) for f in fields.problem)]
        if answer_field is None:
            missing.append(" or ".join(repr(f) for f in fields.answer))
        raise EvalSetError(
            f"{where} has no field {' and no field '.join(missing)} (its fields are "
            f"{', '.join(sorted(map(str, row)))}); {name} files need the layout in docs/data.md."
        )
    _, raw_id = _first(row, fields.id)
    ex_id = f"{name}/{raw_id if raw_id is not None else index}"
    if name == "olympiad":
        gold, reason = olympiad_answer(answer, row.get("question_type"))
        if gold is None:
            return None, reason
        context = row.get("context")
        if context and str(context).strip():
            problem = f"{str(context).strip()}\n\n{problem}"
    else:
        if answer is None:
            return None, "no single final answer"
        try:
            gold = number_text(answer) if name in ("aime24", "amc") else strip_dollars(str(answer))
        except ValueError as e:
            raise EvalSetError(f"{where}: field {answer_field!r} {e}; fix the record.") from e
        if not gold:
            return None, "no single final answer"
    example = {
        "prompt": str(problem).strip(),
        "answer": gold,
        "solution": solution,
        "dataset": name,
        "id": ex_id,
    }
    for key in ("level", "subject", "subfield", "url", "year"):
        if row.get(key) is not None:
            example[key] = row[key]
    return example, None


def _is_aime_2024(row: Mapping) -> bool | None:
    """Whether an AIME record is from 2024, when the record says (url or year), else None."""
    for key in ("year", "Year"):
        if row.get(key) is not None:
            return "2024" in str(row[key])
    for key in ("url", "ID", "id"):
        value = row.get(key)
        if isinstance(value, str) and re.search(r"(19|20)\d\d", value):
            return "2024" in value
    return None


def load_eval_set(name: str, path: str) -> EvalSet:
    """The examples of evaluation set `name` read from `path` (a file or a directory).

    Raises EvalSetError (one sentence naming the file, and the line or record where it applies)
    for an unknown set, a missing path, a directory without data files, an unreadable file or a
    record without the layout's fields. Items without one final answer (OlympiadBench proofs,
    answer lists) are left out and counted in `skipped`; AI-MO's AIME file (2022-2024) keeps the
    30 problems of 2024 and counts the others as "other years".
    """
    if name not in EVAL_SETS:
        raise EvalSetError(f"unknown evaluation set {name!r}; use one of {', '.join(EVAL_SETS)}.")
    files = _pick_files(name, _data_files(path))
    if not files:
        raise EvalSetError(
            f"{path} holds no .jsonl, .json or .parquet file for the {name} set; point it at the "
            "set's published files (docs/data.md)."
        )
    examples: list[dict] = []
    skipped: dict[str, int] = {}
    for f in files:
        rows, is_jsonl = _read(f)
        for i, row in enumerate(rows):
            if row is None:  # a blank JSONL line
                continue
            where = _where(f, i, is_jsonl)
            if name == "aime24" and isinstance(row, Mapping) and _is_aime_2024(row) is False:
                skipped["other years"] = skipped.get("other years", 0) + 1
                continue
            example, reason = _example(name, row, where, i)
            if example is None:
                skipped[reason] = skipped.get(reason, 0) + 1
            else:
                examples.append(example)
    seen: dict[str, int] = {}
    for ex in examples:  # ids must pair problems across runs: make repeated ones unique
        count = seen.get(ex["id"], 0)
        seen[ex["id"]] = count + 1
        if count:
            ex["id"] = f"{ex['id']}#{count}"
    if not examples:
        raise EvalSetError(
            f"{path} has no usable {name} problem ({sum(skipped.values())} skipped: "
            f"{', '.join(f'{k} {v}' for k, v in skipped.items()) or 'none read'}); check the files."
        )
    return EvalSet(name=name, examples=examples, files=tuple(files), skipped=skipped)


def parse_paths(text: str) -> dict[str, str]:
    """'aime24=/data/aime.parquet,amc=/data/amc' -> {"aime24": ..., "amc": ...}."""
    out: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not value.strip():
            raise ValueError(f"{item!r} is not set=path")
        if name.strip() not in EVAL_SETS:
            raise ValueError(f"{name.strip()!r} is not a set; use one of {', '.join(EVAL_SETS)}")
        out[name.strip()] = value.strip()
    return out


def parse_sets(text: str) -> list[str]:
    """'aime24, amc' -> ['aime24', 'amc'] ('all': every set); ValueError for an unknown name."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return list(EVAL_SETS)
    for s in names:
        if s not in EVAL_SETS:
            raise ValueError(f"unknown evaluation set {s!r}; use one of {', '.join(EVAL_SETS)}")
    if len(set(names)) != len(names):
        raise ValueError("a set is named twice")
    return names


def set_path(name: str, *, root: str, paths: Mapping[str, str]) -> str:
    """Where set `name` is read from: its entry in `paths`, else `root`/<name>."""
    if name in paths:
        return paths[name]
    if not root:
        raise EvalSetError(
            f"no path for the {name} set; set eval.dir (a folder with one folder per set) or "
            f"eval.paths={name}=/path/to/files."
        )
    return os.path.join(root, name)
