"""Example sources: GSM8K / MATH via the TFDS builders, JSONL / parquet files, the arithmetic task.

Every source is random access (`len(src)`, `src[i]`, what grain's MapDataset wants) and yields
example dicts with at least `prompt` (str), `answer` (gold answer str), `solution` (a
demonstration whose final answer is the gold one, for SFT / GVPO demonstrations), `dataset` and
`id`; MATH adds `level` (int, 0 = unknown) and `subject`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping, Sequence

from gvpo_jax.data.arith import ArithTask
from gvpo_jax.rewards.extract import gsm8k_final_answer, last_boxed, strip_calculator_annotations

TASKS = ("arith", "gsm8k", "math", "math500", "jsonl")


class MappedSource:
    """`fn(base[i], i)` for each index of a random-access `base` (a TFDS data source or a list)."""

    def __init__(self, base, fn: Callable[[Mapping, int], dict]):
        self._base = base
        self._fn = fn

    def __len__(self) -> int:
        return len(self._base)

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        return self._fn(self._base[index], index)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def gsm8k_solution(published: str, final: str) -> str:
    """GSM8K's solution without calculator annotations, ending in a boxed final answer."""
    reasoning = strip_calculator_annotations(published.rsplit("####", 1)[0]).strip()
    return f"{reasoning}\nThe final answer is $\\boxed{{{final}}}$."


def load_gsm8k(
    split: str, *, data_dir: str | None = None, source_dir: str | None = None, urls=None
):
    """GSM8K `train` (7473) / `test` (1319) examples; answer = the number after '####'."""
    from gvpo_jax.data import tfds_builders  # tensorflow_datasets: imported when data is read

    builder = tfds_builders.prepare(
        tfds_builders.GvpoGsm8k, data_dir=data_dir, source_dir=source_dir, urls=urls
    )

    def to_example(rec: Mapping, i: int) -> dict:
        final = _text(rec["final_answer"])
        return {
            "prompt": _text(rec["question"]),
            "answer": final,
            "solution": gsm8k_solution(_text(rec["answer"]), final),
            "dataset": "gsm8k",
            "id": f"gsm8k/{_text(rec['id'])}",
        }

    return MappedSource(builder.as_data_source(split=split), to_example)


def load_math(
    split: str,
    *,
    config: str = "lighteval",
    data_dir: str | None = None,
    source_dir: str | None = None,
    urls=None,
):
    """MATH examples: config `lighteval` (train / test) or `math500` (test only)."""
    from gvpo_jax.data import tfds_builders

    builder = tfds_builders.prepare(
        tfds_builders.GvpoMath, data_dir=data_dir, source_dir=source_dir, config=config, urls=urls
    )
    name = "math500" if config == "math500" else "math"

    def to_example(rec: Mapping, i: int) -> dict:
        return {
            "prompt": _text(rec["problem"]),
            "answer": _text(rec["answer"]),
            "solution": _text(rec["solution"]),
            "dataset": name,
            "id": _text(rec["unique_id"]),
            "level": int(rec["level"]),
            "subject": _text(rec["subject"]),
        }

    return MappedSource(builder.as_data_source(split=split), to_example)


def _record_files(path: str, split: str | None) -> list[str]:
    if os.path.isfile(path):
        return [path]
    patterns = [f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"{split}-*.parquet"]
    for pattern in patterns if split else []:
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return files
    raise FileNotFoundError(
        f"{path!r} is not a file and holds no {split}.jsonl / {split}.json / {split}*.parquet; "
        "give a file or a directory with per-split files."
    )


def load_records(
    path: str,
    *,
    split: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    solution_field: str | None = None,
    dataset: str | None = None,
) -> MappedSource:
    """Examples from plain .jsonl / .json / .parquet files with configurable field names.

    `path` is a file, or a directory holding `{split}.jsonl`, `{split}.json`, `{split}.parquet` or
    `{split}-*.parquet`. An answer field that holds a whole solution (GSM8K '####' or a `\\boxed{}`)
    is reduced to its final answer, and the full text becomes the solution unless `solution_field`
    names another field.
    """
    from gvpo_jax.data import tfds_builders

    rows = [row for f in _record_files(path, split) for row in tfds_builders.read_records(f)]
    name = dataset or os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]
    for field in (prompt_field, answer_field, solution_field):
        if field and rows and field not in rows[0]:
            raise KeyError(f"field {field!r} not in {path!r}; its fields are {sorted(rows[0])}.")

    def to_example(row: Mapping, i: int) -> dict:
        raw = str(row[answer_field])
        answer = gsm8k_final_answer(raw) or last_boxed(raw) or raw.strip()
        solution = str(row[solution_field]) if solution_field else (raw if raw != answer else "")
        return {
            "prompt": str(row[prompt_field]),
            "answer": answer,
            "solution": solution,
            "dataset": name,
            "id": f"{name}/{split or 'all'}/{i}",
        }

    return MappedSource(rows, to_example)


def load_task(
    task: str,
    split: str,
    *,
    path: str = "",
    data_dir: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    solution_field: str | None = None,
    arith: ArithTask | None = None,
) -> Sequence[dict]:
    """The examples of `task` ("arith", "gsm8k", "math", "math500", "jsonl") for `split`.

    `path`: published files (gsm8k / math / math500: downloaded when missing) or the jsonl /
    parquet file or directory. `data_dir`: where TFDS writes array_record files (None: a cache
    folder keyed on the source files, see `tfds_builders.default_data_dir`). arith: split
    "train" is the training stream, any other split the held-out set.
    """
    if task == "arith":
        arith = arith or ArithTask()
        return arith.train_source() if split == "train" else arith.eval_examples
    if task == "gsm8k":
        return load_gsm8k(split, data_dir=data_dir, source_dir=path or None)
    if task in ("math", "math500"):
        config = "math500" if task == "math500" else "lighteval"
        return load_math(split, config=config, data_dir=data_dir, source_dir=path or None)
    if task == "jsonl":
        return load_records(
            path,
            split=split,
            prompt_field=prompt_field,
            answer_field=answer_field,
            solution_field=solution_field,
        )
    raise ValueError(f"unknown task {task!r}; use one of {', '.join(TASKS)}.")
