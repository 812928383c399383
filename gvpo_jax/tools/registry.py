"""Tools a policy can call: Python functions whose typed signature and docstring give the JSON
schema the model is shown, called with the arguments it wrote and answering with an
`Observation` whatever happens (an unknown tool, bad arguments, a tool that raises: an error
observation the model reads; the run goes on).

    @tool
    def calculator(expression: str) -> str:
        \"\"\"Evaluates an arithmetic expression exactly.

        Args:
            expression: integers, decimals, + - * / // % ** and parentheses.
        \"\"\"

    tools = Registry([calculator])
    tools.schemas()  # [{"type": "function", "function": {...}}], the chat templates' form
    tools.call("calculator", {"expression": "12 * 34"})   # Observation("408", ok=True)
    tools.call_json('{"name": "calculator", "arguments": {"expression": "1/0"}}')
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

# JSON schema types of the Python annotations a tool's parameters may have
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolError(ValueError):
    """A tool that cannot be registered (an unannotated parameter, a type with no JSON form)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the model reads back from a call: the tool's answer (`ok`) or an error message."""

    text: str
    ok: bool = True
    tool: str = ""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable with its name, description and JSON schema of parameters."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The OpenAI / Hugging Face chat-template form of the tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _json_type(annotation, where: str) -> dict:
    origin = typing.get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin in (list, Sequence):
        (item,) = typing.get_args(annotation) or (str,)
        return {"type": "array", "items": _json_type(item, where)}
    if origin is typing.Literal:
        values = typing.get_args(annotation)
        return {"type": _JSON_TYPES[type(values[0])], "enum": list(values)}
    raise ToolError(f"{where} is annotated {annotation!r}, which has no JSON schema type; use "
                    "str, int, float, bool, a list of them or a Literal.")  # fmt: skip


def _arg_docs(doc: str) -> tuple[str, dict[str, str]]:
    """(summary, {argument: description}) of a Google-style docstring."""
    summary, _, rest = inspect.cleandoc(doc or "").partition("\n\n")
    args, current = {}, None
    block = re.split(r"^\s*Args:\s*$", rest, maxsplit=1, flags=re.M)
    for line in (block[1] if len(block) > 1 else "").splitlines():
        if re.match(r"^\S", line):  # a new section ends the arguments
            break
        m = re.match(r"^\s+(\w+)\s*(\([^)]*\))?:\s*(.*)$", line)
        if m:
            current = m.group(1)
            args[current] = m.group(3).strip()
        elif current and line.strip():
            args[current] += " " + line.strip()
    return " ".join(summary.split()), args


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None):
    """A function as a `Tool` (usable as a decorator): its parameters' annotations give the
    schema's types, parameters without a default are required, the docstring's summary is the
    description and its `Args:` section the parameters' descriptions."""
    if fn is None:
        return lambda f: tool(f, name=name)
    tool_name = name or fn.__name__
    summary, docs = _arg_docs(fn.__doc__ or "")
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolError(f"tool {tool_name!r} takes *{pname}; tools take named parameters.")
        if pname not in hints:
            raise ToolError(f"tool {tool_name!r}'s parameter {pname!r} has no type annotation.")
        props[pname] = _json_type(hints[pname], f"tool {tool_name!r}'s parameter {pname!r}")
        if pname in docs:
            props[pname]["description"] = docs[pname]
        if p.default is p.empty:
            required.append(pname)
    params = {"type": "object", "properties": props, "required": required}
    return Tool(tool_name, fn, summary, params)


def _check_value(value, schema: dict) -> bool:
    kind = schema["type"]
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind == "boolean":
        ok = isinstance(value, bool)
    elif kind == "string":
        ok = isinstance(value, str)
    else:  # array
        ok = isinstance(value, list) and all(_check_value(v, schema["items"]) for v in value)
    return ok and ("enum" not in schema or value in schema["enum"])


class Registry:
    """The tools of a run, by name; `call` never raises for anything a model can write."""

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]] = ()):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            t = t if isinstance(t, Tool) else tool(t)
            if t.name in self.tools:
                raise ToolError(f"two tools are named {t.name!r}; give one another name.")
            self.tools[t.name] = t

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def call(self, name: Any, arguments: Any) -> Observation:
        """The tool's answer as text, or an error observation: an unknown tool, arguments that
        are not an object, missing, unknown or mistyped arguments, an exception in the tool."""
        if not isinstance(name, str) or name not in self.tools:
            known = ", ".join(self.tools) or "none"
            return Observation(f"Error: unknown tool {name!r}; the tools are: {known}.", False)
        t = self.tools[name]
        if not isinstance(arguments, dict):
            return Observation(f"Error: {name}'s arguments must be a JSON object.", False, name)
        props, required = t.parameters["properties"], t.parameters["required"]
        missing = [k for k in required if k not in arguments]
        unknown = [k for k in arguments if k not in props]
        if missing or unknown:
            what = "; ".join(filter(None, [
                missing and f"missing {', '.join(missing)}",
                unknown and f"unknown {', '.join(unknown)}",
            ]))  # fmt: skip
            return Observation(f"Error: {name}: {what} (takes {', '.join(props)}).", False, name)
        for k, v in arguments.items():
            if not _check_value(v, props[k]):
                return Observation(
                    f"Error: {name}: argument {k} must be of type {props[k]['type']}.", False, name
                )
        try:
            result = t.fn(**arguments)
        except Exception as e:  # noqa: BLE001 (a tool's failure is the model's observation)
            return Observation(f"Error: {name} raised {type(e).__name__}: {e}", False, name)
        if isinstance(result, Observation):
            return dataclasses.replace(result, tool=name)
        return Observation(result if isinstance(result, str) else json.dumps(result), True, name)

    def call_json(self, text: str) -> Observation:
        """A call written as JSON, {"name": ..., "arguments": {...}} (Qwen3's `<tool_call>`
        body; arguments may also be a JSON string of the object, as some templates write)."""
        try:
            call = json.loads(text)
        except json.JSONDecodeError as e:
            return Observation(f"Error: the tool call is not valid JSON ({e.msg}).", False)
        if not isinstance(call, dict) or "name" not in call:
            return Observation('Error: a tool call is {"name": ..., "arguments": {...}}.', False)
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return Observation("Error: the tool call's arguments are not valid JSON.", False)
        return self.call(call["name"], arguments)
