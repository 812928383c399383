"""Tools a policy calls (`gvpo_jax.tools`): the registry's schemas and its error observations,
the exact calculator and the sandboxed Python executor."""

import os
import time
from typing import Literal

import pytest

from gvpo_jax import tools
from gvpo_jax.tools import arithmetic as calc


def test_a_functions_signature_and_docstring_give_its_schema():
    @tools.tool
    def lookup(city: str, days: int, units: Literal["C", "F"] = "C", tags: list[str] = ()):
        """Looks up the weather.

        Args:
            city: the city's name,
                as written on a map.
            days: how many days ahead.
        """

    schema = lookup.schema()["function"]
    assert schema["name"] == "lookup" and schema["description"] == "Looks up the weather."
    props = schema["parameters"]["properties"]
    assert props["city"] == {
        "type": "string",
        "description": "the city's name, as written on a map.",
    }
    assert props["days"]["type"] == "integer" and props["units"] == {
        "type": "string",
        "enum": ["C", "F"],
    }
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert schema["parameters"]["required"] == ["city", "days"]
    with pytest.raises(tools.ToolError, match="parameter 'x' has no type annotation"):
        tools.tool(lambda x: x)
    with pytest.raises(tools.ToolError, match="two tools are named 'lookup'"):
        tools.Registry([lookup, lookup])


def test_whatever_a_model_writes_the_call_answers_with_an_observation():
    def boom(n: int) -> str:
        """Raises."""
        raise RuntimeError(f"no {n}")

    r = tools.Registry([tools.calculator, boom])
    assert r.call("calculator", {"expression": "6 * 7"}) == tools.Observation(
        "42", True, "calculator"
    )
    cases = [
        ("nope", {}, "unknown tool 'nope'; the tools are: calculator, boom"),
        ("calculator", [], "arguments must be a JSON object"),
        ("calculator", {}, "missing expression"),
        ("calculator", {"expression": "1", "x": 2}, "unknown x"),
        ("calculator", {"expression": 3}, "argument expression must be of type string"),
        ("boom", {"n": True}, "argument n must be of type integer"),
        ("boom", {"n": 3}, "boom raised RuntimeError: no 3"),
        ("calculator", {"expression": "1/0"}, "division by zero"),
    ]
    for name, args, message in cases:
        obs = r.call(name, args)
        assert not obs.ok and message in obs.text, (name, args, obs)
    assert (
        r.call_json('{"name": "calculator", "arguments": "{\\"expression\\": \\"2**10\\"}"}').text
        == "1024"
    )
    bad_arguments = '{"name": "calculator", "arguments": "{x"}'
    for text, message in [("{bad", "not valid JSON"), ('["calculator"]', '{"name": ...'),
                          (bad_arguments, "arguments are not")]:  # fmt: skip
        obs = r.call_json(text)
        assert not obs.ok and message in obs.text


def test_the_calculator_is_exact_and_bounded():
    cases = {
        "123456789 * 987654321": "121932631112635269",
        "0.1 + 0.2": "0.3",
        "1 / 3": "1/3",
        "-7 // 2": "-4",
        "2 ^ 10 - 3 % 2": "1023",
        "(17 + 4) * 389 / 8": "1021.125",
        "10 ** -3": "0.001",
    }
    for expression, value in cases.items():
        assert calc.calculator(expression) == value, expression
    assert len(calc.calculator("2 ** 3000")) == 904
    t0 = time.perf_counter()
    for bad, message in [("9 ** 9 ** 9", "exponents are at most"), ("10 ** 5000", "more than 1000"),
                         ("__import__('os')", "only numbers"), ("x + 1", "only numbers"),
                         ("2 ** 0.5", "whole-number exponents"), ("1 +", "does not parse"),
                         ("0 ** -1", "division by zero"), ("1" * 2000, "longer than")]:  # fmt: skip
        with pytest.raises(calc.CalculatorError, match=message):
            calc.evaluate(bad)
    assert time.perf_counter() - t0 < 1.0  # refused before computing, not after


def test_python_runs_code_in_its_own_directory_and_nowhere_else(tmp_path):
    ok = tools.run_python("import math\nprint(math.factorial(20))\nprint(sum(range(10)))")
    assert ok.ok and ok.text == "2432902008176640000\n45\n"
    here = tools.run_python(
        "open('a.txt', 'w').write('hi')\nimport os\nprint(os.getcwd(), open('a.txt').read())"
    )
    assert here.ok and here.text.split()[1] == "hi"
    assert not os.path.exists(here.text.split()[0])  # its directory is gone after the call
    secret = tmp_path / "run_file.txt"
    secret.write_text("checkpoint")
    outside = tmp_path / "made_by_tool.txt"
    refused = {
        f"print(open({str(secret)!r}).read())": "access outside the tool's directory",
        "open('/etc/passwd').read()": "access outside",
        f"open({str(outside)!r}, 'w').write('x')": "access outside",
        f"import os\nos.remove({str(secret)!r})": "access outside",
        f"import os\nprint(os.listdir({str(tmp_path)!r}))": "access outside",
        "import subprocess\nsubprocess.run(['ls'])": "subprocess.Popen is not allowed",
        "import os\nos.system('ls')": "os.system is not allowed",
        "import socket\nsocket.socket()": "is not allowed",
        "import ctypes": "import is not allowed",
    }
    for code, message in refused.items():
        obs = tools.run_python(code)
        assert not obs.ok and message in obs.text, (code, obs)
    assert secret.read_text() == "checkpoint" and not outside.exists()


def test_python_limits_stop_the_code_and_the_caller_goes_on():
    t0 = time.perf_counter()
    obs = tools.run_python("while True:\n    pass", timeout_s=1.0)
    assert not obs.ok and "timed out after 1 s" in obs.text
    assert time.perf_counter() - t0 < 3.0
    obs = tools.run_python(
        "import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=1.0
    )
    assert not obs.ok and obs.text.startswith("started") and "timed out" in obs.text
    obs = tools.run_python("x = bytearray(2 ** 31)", memory_mb=256)
    assert not obs.ok and "MemoryError" in obs.text and "256 MB" in obs.text
    obs = tools.run_python("print('a' * 100000)", max_output=500)
    assert not obs.ok and obs.text.startswith("a" * 500) and "output cut at 500" in obs.text
    obs = tools.run_python("def f(n):\n    return f(n + 1)\nf(0)")
    assert not obs.ok and "line 2: RecursionError" in obs.text
    assert tools.builtin().call("python", {"code": "print(2 + 2)"}).text == "4\n"
