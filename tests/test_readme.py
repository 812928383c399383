"""README.md against its recorded demo run: the printed block is generated from
docs/demo/record.json, the record agrees with the run's metrics, the guide stays short, and every
relative link points at a file; docs/config.md's field tables are generated from the comments in
`base_config`. Pure file reading: no model, no compilation."""

import json
import pathlib
import re

import pytest

from gvpo_jax import config
from tools import config_doc, readme_demo

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECORD = ROOT / "docs" / "demo" / "record.json"
METRICS = ROOT / "docs" / "demo" / "metrics.jsonl"


def test_readme_demo_block_is_the_rendered_record():
    _, block, _ = readme_demo.split_readme(README.read_text())
    assert block == readme_demo.render(json.loads(RECORD.read_text())), (
        "README.md's demo block differs from docs/demo/record.json; "
        "run `python -m tools.readme_demo` to re-render it"
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


def test_guides_and_records_point_at_files_that_exist():
    """Every relative link, and every path under docs/, benchmarks/ or studies/ that the README,
    STUDY.md, BENCHMARKS.md and the guides mention, exists (records and logs moved with the lab
    keep their mentions current)."""
    pages = [
        README,
        ROOT / "STUDY.md",
        ROOT / "BENCHMARKS.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]
    missing = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target) and target[0] != "#":
                if not (page.parent / target.split("#")[0]).exists():
                    missing.append(f"{page.name}: link {target}")
        for path in re.findall(r"(?<![\w./-])((?:docs|benchmarks|studies)/[\w./-]*\w)", text):
            if "/." not in path and not (ROOT / path).exists():  # not a cache such as .cache/
                missing.append(f"{page.name}: {path}")
    assert not missing


def test_config_doc_is_generated_from_the_comments_of_base_config():
    doc = (ROOT / "docs" / "config.md").read_text()
    block = doc.split(config_doc.BEGIN)[1].split(config_doc.END)[0]
    assert block.strip() == config_doc.current(), (
        "docs/config.md's field tables differ from gvpo_jax/config.py's fields and comments; "
        "run `python -m tools.config_doc`"
    )
    fields = set(config_doc.field_names(config.base_config()))
    listed = set(re.findall(r"^\| `([a-z0-9_.*]+)` \|", block, re.M))
    assert listed == fields  # every field, once (model.overrides is one row: `model.overrides.*`)


def test_config_doc_follows_a_changed_comment_and_refuses_a_field_without_one():
    source = pathlib.Path(config_doc.SOURCE).read_text()
    base = config.base_config()
    line = "    c.rollout.group_size = 8  # G: responses per prompt (k in the GVPO paper)\n"
    assert line in source
    changed = source.replace(line, line.replace("responses per prompt", "samples of a prompt"))
    rendered = config_doc.render(changed, base)
    assert rendered != config_doc.render(source, base)
    assert (
        "| `rollout.group_size` | `8` | G: samples of a prompt (k in the GVPO paper) |" in rendered
    )
    added = source.replace(line, line + "    c.rollout.spare = 3  # a new field\n")
    base.rollout.spare = 3
    assert "| `rollout.spare` | `3` | a new field |" in config_doc.render(added, base)
    bare = source.replace(line, "    c.rollout.group_size = 8\n")
    with pytest.raises(ValueError, match="config.rollout.group_size has no comment"):
        config_doc.render(bare, base)
