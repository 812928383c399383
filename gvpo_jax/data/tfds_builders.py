"""TFDS builders for GSM8K and MATH (lighteval, MATH-500) writing array_record: no TensorFlow.

Each builder reads the standard published files from `source_dir` when they are there and otherwise
downloads them (TFDS download manager, needs a network). `download_and_prepare` writes array_record
shards under `data_dir/<name>/<config>/<version>`; reading goes through `as_data_source()` (random
access, what grain wants). Text features come back as bytes; `sources.py` decodes and normalises.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from gvpo_jax.rewards.extract import gsm8k_final_answer, last_boxed

_HF = "https://huggingface.co/datasets"
GSM8K_URLS = {
    split: f"https://raw.githubusercontent.com/openai/grade-school-math/master/"
    f"grade_school_math/data/{split}.jsonl"
    for split in ("train", "test")
}
# openai/grade-school-math ships {split}.jsonl; the HF mirror openai/gsm8k ships main/*.parquet.
GSM8K_FILES = {s: (f"{s}.jsonl", f"{s}-00000-of-00001.parquet") for s in ("train", "test")}
MATH_URLS = {
    "lighteval": {
        s: f"{_HF}/DigitalLearningGmbH/MATH-lighteval/resolve/main/data/{s}-00000-of-00001.parquet"
        for s in ("train", "test")
    },
    "math500": {"test": f"{_HF}/HuggingFaceH4/MATH-500/resolve/main/test.jsonl"},
}
MATH_FILES = {
    "lighteval": {s: (f"{s}-00000-of-00001.parquet",) for s in ("train", "test")},
    "math500": {"test": ("test.jsonl",)},
}
# Fields a candidate file must have: GSM8K's HF parquet and MATH-lighteval's share a file name.
GSM8K_FIELDS = ("question", "answer")
MATH_FIELDS = {"lighteval": ("problem", "solution"), "math500": ("problem", "solution", "answer")}
_MAX_SEARCH_DEPTH = 3  # source_dir may be a repository checkout: look a few folders down


def find_file(root: str | None, names: Sequence[str], fields: Sequence[str] = ()) -> str | None:
    """The shallowest file under `root` (<= 3 levels) named one of `names` whose records have all
    of `fields` (so GSM8K's and MATH's identically named test files are told apart), or None."""
    if not root or not os.path.isdir(root):
        return None
    root = os.path.abspath(root)
    for dirpath, dirnames, filenames in sorted(os.walk(root), key=lambda w: w[0].count(os.sep)):
        if dirpath.count(os.sep) - root.count(os.sep) > _MAX_SEARCH_DEPTH:
            continue
        dirnames.sort()
        for name in names:
            path = os.path.join(dirpath, name)
            if name in filenames and set(fields) <= set(record_fields(path)):
                return path
    return None


def record_fields(path: str) -> list[str]:
    """Field names of the first record of a .jsonl / .json / .parquet file ([] if unreadable)."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                return list(json.loads(f.readline()))
            data = json.load(f)
        return list((data[0] if isinstance(data, list) else data) if data else [])
    except (OSError, ValueError, TypeError, IndexError, KeyError):
        return []


def default_data_dir(source_dir: str | None) -> str:
    """Where prepared array_record files go when no data_dir is given: one folder per source.

    `$GVPO_TFDS_DIR` (default `~/.cache/gvpo_jax/tfds`) / a hash of the source directory's path and
    its data files' names, sizes and mtimes, so editing or replacing the files re-prepares instead
    of silently reusing an old build (TFDS itself only keys on name/config/version).
    """
    base = os.environ.get("GVPO_TFDS_DIR") or os.path.expanduser("~/.cache/gvpo_jax/tfds")
    digest = hashlib.sha1()
    root = os.path.abspath(source_dir) if source_dir else ""
    digest.update(root.encode())
    if root and os.path.isdir(root):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith((".jsonl", ".json", ".parquet")):
                    st = os.stat(os.path.join(dirpath, name))
                    rel = os.path.relpath(os.path.join(dirpath, name), root)
                    digest.update(f"{rel}:{st.st_size}:{st.st_mtime_ns};".encode())
    return os.path.join(base, "download" if not root else digest.hexdigest()[:16])


def read_records(path: str) -> list[dict]:
    """Rows of a .jsonl / .json (list of records) / .parquet file, as dicts."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            rows = []
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path} line {lineno} is not valid JSON ({e.msg}); fix or remove it"
                    ) from e
            return rows
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {e.lineno} is not valid JSON ({e.msg}); fix it") from e
    return data if isinstance(data, list) else [data]


def _resolve(
    dl_manager,
    source_dir: str | None,
    files: Mapping[str, Sequence[str]],
    urls: Mapping[str, str],
    fields: Sequence[str],
) -> dict[str, str]:
    """split -> local path: published files in source_dir, else downloaded from `urls`."""
    found = {split: find_file(source_dir, names, fields) for split, names in files.items()}
    missing = {split: urls[split] for split, path in found.items() if path is None}
    if missing:
        try:
            found.update(dl_manager.download(missing))
        except Exception as e:
            wanted = sorted({n for s in missing for n in files[s]})
            raise FileNotFoundError(
                f"no {' / '.join(wanted)} under source_dir={source_dir!r} and downloading "
                f"{list(missing.values())} failed ({type(e).__name__}); put the published files "
                "there or run once with network access."
            ) from e
    return {split: os.fspath(path) for split, path in found.items()}


class _LocalFirstBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Adds `source_dir` (published files) and `urls` (download fallback) to a TFDS builder."""

    def __init__(self, *, source_dir: str | None = None, urls: Mapping | None = None, **kwargs):
        self._source_dir = source_dir
        self._urls = urls
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)


class GvpoGsm8k(_LocalFirstBuilder):
    """GSM8K (Cobbe et al. 2021): question, answer (published solution), final_answer, id."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "question, answer and the final answer after '####'."}

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self,
            description="Grade-school math word problems with a final integer answer.",
            features=tfds.features.FeaturesDict(
                {"question": text, "answer": text, "final_answer": text, "id": text}
            ),
            homepage="https://github.com/openai/grade-school-math",
        )

    def _split_generators(self, dl_manager):
        paths = _resolve(
            dl_manager, self._source_dir, GSM8K_FILES, self._urls or GSM8K_URLS, GSM8K_FIELDS
        )
        return {split: self._generate_examples(split, path) for split, path in paths.items()}

    def _generate_examples(self, split: str, path: str) -> Iterator[tuple[int, dict]]:
        for i, row in enumerate(read_records(path)):
            final = gsm8k_final_answer(row["answer"])
            if final is None:
                raise ValueError(f"{path} row {i} has no '####' final answer: {row['answer']!r}")
            yield (
                i,
                {
                    "question": row["question"],
                    "answer": row["answer"],
                    "final_answer": final,
                    "id": f"{split}/{i}",
                },
            )


def _level(value) -> int:
    """MATH levels: 1..5 ("Level 3" or 3); 0 when unknown ("Level ?")."""
    m = re.search(r"\d+", str(value))
    return int(m.group()) if m else 0


class GvpoMath(_LocalFirstBuilder):
    """MATH (Hendrycks et al. 2021): problem, solution, boxed answer, subject, level, unique_id.

    Configs: `lighteval` (train 7500 / test 5000, DigitalLearningGmbH/MATH-lighteval parquet or the
    original MATH/{train,test}/<subject>/<n>.json tree) and `math500` (test 500,
    HuggingFaceH4/MATH-500 test.jsonl, the PRM800K subset of the test split).
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "lighteval and math500 configs."}
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name="lighteval", description="MATH train/test, 12.5k problems."),
        tfds.core.BuilderConfig(name="math500", description="MATH-500 test subset."),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self,
            description="Competition mathematics problems with LaTeX solutions.",
            features=tfds.features.FeaturesDict(
                {
                    "problem": text,
                    "solution": text,
                    "answer": text,
                    "subject": text,
                    "level": np.int32,
                    "unique_id": text,
                }
            ),
            homepage="https://github.com/hendrycks/math",
        )

    def _split_generators(self, dl_manager):
        name = self.builder_config.name
        files = MATH_FILES[name]
        fields = MATH_FIELDS[name]
        if name == "lighteval" and not any(
            find_file(self._source_dir, f, fields) for f in files.values()
        ):
            trees = {split: _hendrycks_tree(self._source_dir, split) for split in files}
            if all(trees.values()):
                return {split: self._generate_tree(split, paths) for split, paths in trees.items()}
        urls = self._urls or MATH_URLS[name]
        paths = _resolve(dl_manager, self._source_dir, files, urls, fields)
        return {split: self._generate_examples(split, path) for split, path in paths.items()}

    def _generate_examples(self, split: str, path: str) -> Iterator[tuple[str, dict]]:
        for i, row in enumerate(read_records(path)):
            uid = row.get("unique_id") or f"{split}/{i}"
            yield uid, _math_record(row, uid)

    def _generate_tree(self, split: str, files: list[str]) -> Iterator[tuple[str, dict]]:
        for path in files:
            subject_dir, name = path.split(os.sep)[-2:]
            uid = f"{split}/{subject_dir}/{name}"  # the unique_id spelling MATH-500 uses
            yield uid, _math_record(read_records(path)[0], uid)


def _hendrycks_tree(source_dir: str | None, split: str) -> list[str]:
    """Sorted <subject>/<n>.json files of the original MATH release under source_dir (or [])."""
    if not source_dir:
        return []
    for base in (os.path.join(source_dir, "MATH", split), os.path.join(source_dir, split)):
        if os.path.isdir(base):
            subjects = [d for d in sorted(os.listdir(base)) if os.path.isdir(os.path.join(base, d))]
            files = [
                os.path.join(base, d, f)
                for d in subjects
                for f in sorted(os.listdir(os.path.join(base, d)), key=_numeric_key)
                if f.endswith(".json")
            ]
            if files:
                return files
    return []


def _numeric_key(name: str) -> tuple[int, str]:
    m = re.match(r"\d+", name)
    return (int(m.group()) if m else -1, name)


def _math_record(row: Mapping, uid: str) -> dict:
    solution = row["solution"]
    answer = row.get("answer") or last_boxed(solution)
    if answer is None:
        raise ValueError(f"MATH problem {uid} has neither an answer field nor a boxed answer.")
    return {
        "problem": row["problem"],
        "solution": solution,
        "answer": answer.strip(),
        "subject": row.get("subject") or row.get("type") or "",
        "level": _level(row.get("level", "")),
        "unique_id": uid,
    }


def prepare(
    builder_cls: type[_LocalFirstBuilder],
    *,
    data_dir: str | None = None,
    source_dir: str | None = None,
    config: str | None = None,
    urls: Mapping | None = None,
) -> tfds.core.DatasetBuilder:
    """Builds (once; later calls reuse the array_record files) and returns the TFDS builder.

    `data_dir=None` uses `default_data_dir(source_dir)`, a folder keyed on the source files.
    """
    data_dir = data_dir or default_data_dir(source_dir)
    builder = builder_cls(data_dir=data_dir, config=config, source_dir=source_dir, urls=urls)
    tfds.display_progress_bar(False)  # progress bars would flood training logs
    try:
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False),
            file_format="array_record",
        )
    except OSError:
        # Another process prepared the same folder first (TFDS renames its temporary folder into
        # place, which fails once the target exists): use theirs if it is complete.
        builder = builder_cls(data_dir=data_dir, config=config, source_dir=source_dir, urls=urls)
        if not builder.is_prepared():
            raise
    return builder
