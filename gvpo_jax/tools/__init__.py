"""Tools a policy calls in its rollout: a registry of typed Python functions (`registry`), exact
arithmetic (`arithmetic.calculator`) and a sandboxed Python executor (`python_exec`);
docs/tools.md."""

from gvpo_jax.tools.arithmetic import calculator
from gvpo_jax.tools.python_exec import python, run_python
from gvpo_jax.tools.registry import Observation, Registry, Tool, ToolError, tool

BUILTIN = {"calculator": calculator, "python": python}


def builtin(names=("calculator", "python")) -> Registry:
    """A registry of the built-in tools by name."""
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise ToolError(f"unknown built-in tool(s) {unknown}; use {', '.join(BUILTIN)}.")
    return Registry([BUILTIN[n] for n in names])


__all__ = ["BUILTIN", "Observation", "Registry", "Tool", "ToolError", "builtin", "calculator",
           "python", "run_python", "tool"]  # fmt: skip
