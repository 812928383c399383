"""README.md against its recorded demo run: the printed block is generated from
docs/demo/record.json, the record agrees with the run's metrics, the guide stays short, and every
relative link points at a file. Pure file reading: no model, no compilation."""

import json
import pathlib
import re

from benchmarks import readme_demo

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECORD = ROOT / "docs" / "demo" / "record.json"
METRICS = ROOT / "docs" / "demo" / "metrics.jsonl"


def test_readme_demo_block_is_the_rendered_record():
    _, block, _ = readme_demo.split_readme(README.read_text())
    assert block == readme_demo.render(json.loads(RECORD.read_text())), (
        "README.md's demo block differs from docs/demo/record.json; "
        "run `python -m benchmarks.readme_demo` to re-render it"
    )


def test_record_eval_lines_agree_with_the_metrics():
    lines = json.loads(RECORD.read_text())["lines"]["eval"]
    printed = [readme_demo.EVAL_RE.match(line) for line in lines]
    assert all(printed), lines
    rows = [json.loads(row) for row in METRICS.read_text().splitlines() if row.strip()]
    evals = [row for row in rows if any(k.startswith("eval/avg@") for k in row)]
    assert len(evals) == len(printed) >= 2
    for which in (0, -1):  # the first and the last evaluation
        match, row = printed[which], evals[which]
        assert int(match.group(1)) == row["step"]
        avg = row[f"eval/avg@{match.group(2)}"]
        assert abs(float(match.group(3)) - avg) <= 5e-4 + 1e-9, (match.group(0), avg)
        assert abs(float(match.group(4)) - row["eval/greedy"]) <= 5e-4 + 1e-9


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n < 400, f"README.md has {n} lines; move details to docs/, BENCHMARKS.md or STUDY.md"


def test_readme_relative_links_exist():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t[0] != "#"]
    assert relative
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
