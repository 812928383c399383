"""The shape of the house: imports point one way, the run is frozen, the step reads no config."""

import ast
import dataclasses
import pathlib

import pytest

import gvpo_jax
from gvpo_jax import assemble, rl_step

ROOT = pathlib.Path(gvpo_jax.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module -> the gvpo_jax modules it imports (any import statement, at any depth)."""
    names = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in names.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            # A package's __init__ re-exporting its own submodules is not a cycle of the house.
            if d.startswith(n + ".") or n.startswith(d + "."):
                continue
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_in_the_package():
    graph = _imports()
    assert "gvpo_jax.train" in graph and "gvpo_jax.assemble" in graph["gvpo_jax.train"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_run_is_frozen_and_the_step_reads_no_config():
    with pytest.raises(dataclasses.FrozenInstanceError):
        assemble.Run.__new__(assemble.Run).replay = None
    source = pathlib.Path(rl_step.__file__).read_text()
    assert ".config" not in source and "ConfigDict" not in source
    assert not any(f.name == "session.py" for f in ROOT.iterdir())
