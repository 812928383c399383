"""docs/config.md's field tables, generated from the comments in `gvpo_jax.config.base_config`.

    python -m tools.config_doc            # rewrites the block between the markers
    python -m tools.config_doc --check    # exit 1 when the block is not current

Each field's meaning is its own comment: the one on its line, else the comment block directly
above it (a field with neither is an error: every field has a short comment). A comment block
above a section (`c.lora = ml_collections.ConfigDict()`), or above a field that has a comment of
its own, is a note printed under the section's heading. Defaults are written as the source
writes them (`1e-4`), or, for computed ones, as `base_config()` holds them. tests/test_readme.py
fails when a field or a comment changes and this was not rerun.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import os
import re
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(REPO, "gvpo_jax", "config.py")
DOC = os.path.join(REPO, "docs", "config.md")
BEGIN, END = "<!-- fields:begin -->", "<!-- fields:end -->"


@dataclasses.dataclass
class Section:
    path: str  # "" for the top-level fields
    notes: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)  # (field, default, meaning)


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """(line -> text of a whole-line comment, line -> text of a comment after code)."""
    whole, trailing = {}, {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            text = tok.string.lstrip("#").strip()
            if lines[line - 1].lstrip().startswith("#"):
                whole[line] = text
            else:
                trailing[line] = text
    return whole, trailing


def _path(target: ast.expr) -> str | None:
    """ "model.param_dtype" for `c.model.param_dtype` (None for anything else)."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    if isinstance(target, ast.Name) and target.id == "c" and parts:
        return ".".join(reversed(parts))
    return None


def _is_section(value: ast.expr) -> bool:
    return isinstance(value, ast.Call) and ast.unparse(value.func).endswith("ConfigDict")


def _default(source: str, value: ast.expr, runtime) -> str:
    if _is_section(value):
        return "{}"
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("placeholder"):
        return "None"
    try:
        ast.literal_eval(value)
    except ValueError:
        return repr(runtime).replace("'", '"')  # a computed default: its value
    return ast.get_source_segment(source, value)


def _meaning(text: str) -> str:
    """A comment as markdown: "|" escaped (it would end a table cell), "*" too (P*G ... P*G is
    not emphasis), the other guides linked."""
    text = text.replace("|", "\\|").replace("*", "\\*")
    return re.sub(r"docs/([a-z_]+\.md)", r"[\1](\1)", text)


def sections(source: str, base) -> list[Section]:
    """The base config's fields in source order, grouped by section, with their comments.
    `base` is `base_config()` (the values of computed defaults)."""
    whole, trailing = _comments(source)
    fn = next(n for n in ast.walk(ast.parse(source)) if getattr(n, "name", "") == "base_config")
    out = {"": Section("")}
    for stmt in fn.body:
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        path = _path(stmt.targets[0])
        if path is None:
            continue
        block, line = [], stmt.lineno - 1
        while line in whole:  # the comment block directly above
            block.insert(0, whole[line])
            line -= 1
        own = " ".join(
            trailing[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in trailing
        )
        parent = path.rpartition(".")[0]
        if _is_section(stmt.value) and not own:  # a heading; its block a note on the section
            out[path] = Section(path, notes=[" ".join(block)] if block else [])
            continue
        if not own and not block:
            raise ValueError(f"gvpo_jax/config.py:{stmt.lineno}: config.{path} has no comment")
        section = out[parent]
        if own and block:
            section.notes.append(" ".join(block))
        node = base
        for part in path.split("."):
            node = node[part]
        name = f"{path}.*" if _is_section(stmt.value) else path
        section.rows.append((name, _default(source, stmt.value, node), own or " ".join(block)))
    return list(out.values())


def field_names(c, prefix: str = "") -> list[str]:
    """Every leaf field of a config, dotted; an empty section (model.overrides) as "name.*"."""
    out = []
    for key, value in c.items():
        if hasattr(value, "items"):
            out += field_names(value, f"{prefix}{key}.") if len(value) else [f"{prefix}{key}.*"]
        else:
            out.append(f"{prefix}{key}")
    return out


def render(source: str, base) -> str:
    """The markdown between the markers: a table per section (field, default, meaning)."""
    lines = []
    for s in sections(source, base):
        if s.path:
            lines += [f"### `{s.path}`", ""]
        lines += [_meaning(note) + "\n" for note in s.notes]
        if s.rows:
            lines += ["| field | default | meaning |", "|---|---|---|"]
            lines += [f"| `{f}` | `{d}` | {_meaning(m)} |" for f, d, m in s.rows]
            lines.append("")
    return "\n".join(lines).strip()


def current() -> str:
    """The block as the code is now."""
    from gvpo_jax import config

    with open(SOURCE) as fh:
        return render(fh.read(), config.base_config())


def replace_block(doc: str, block: str) -> str:
    i, j = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[:i] + "\n" + block + "\n" + doc[j:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is stale")
    args = p.parse_args(argv)
    with open(DOC) as fh:
        doc = fh.read()
    new = replace_block(doc, current())
    if args.check:
        if new != doc:
            print("docs/config.md is not current: run `python -m tools.config_doc`")
            return 1
        return 0
    with open(DOC, "w") as fh:
        fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
