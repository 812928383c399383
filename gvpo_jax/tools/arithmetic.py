"""Exact arithmetic for a policy to call: the expression is parsed (`ast`, never evaluated as
Python) and computed over exact rationals (`fractions.Fraction`), so 0.1 + 0.2 is 0.3 and
123456789 * 987654321 has every digit. Sizes are bounded before they are computed (a power's
exponent, the digits of any intermediate), so no expression a model writes can stall a run."""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

MAX_DIGITS = 1000  # of any intermediate numerator or denominator
MAX_EXPONENT = 10_000
MAX_LENGTH = 1000  # characters of the expression

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """An expression the calculator does not compute (its message is the model's observation)."""


def _digits(x: Fraction) -> int:
    return max(len(str(abs(x.numerator))), len(str(x.denominator)))


def _checked(x: Fraction) -> Fraction:
    if _digits(x) > MAX_DIGITS:
        raise CalculatorError(f"a number in it has more than {MAX_DIGITS} digits.")
    return x


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are exact.")
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponents are at most {MAX_EXPONENT} in size.")
    # the digits of base ** e, bounded before computing it
    size = max(math.log10(abs(base.numerator) or 1), math.log10(base.denominator))
    if abs(e) * size > MAX_DIGITS:
        raise CalculatorError(f"the power would have more than {MAX_DIGITS} digits.")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero.")
    return base**e


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float):  # the literal's decimal text, exactly
            return _checked(Fraction(repr(node.value)))
        return _checked(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        x = _value(node.operand)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp):
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(a, b))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"the operator {type(node.op).__name__} is not supported.")
        if b == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalculatorError("division by zero.")
        return _checked(Fraction(op(a, b)))
    raise CalculatorError(
        "only numbers, + - * / // % **, unary minus and parentheses are supported."
    )


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (CalculatorError when it is not one)."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters.")
    try:
        tree = ast.parse(expression.replace("^", "**").strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("the expression does not parse.") from None
    return _value(tree)


def format_value(x: Fraction) -> str:
    """An integer as itself; otherwise the exact decimal when it terminates (up to 20 places),
    else the fraction."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:  # a terminating decimal
        sign, x = ("-" if x < 0 else ""), abs(x)
        whole, frac = divmod(x.numerator, x.denominator)
        digits = ""
        while frac and len(digits) < 20:
            frac *= 10
            q, frac = divmod(frac, x.denominator)
            digits += str(q)
        if not frac:
            return f"{sign}{whole}.{digits}"
    return f"{x.numerator}/{x.denominator}"


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** (or ^) and parentheses, e.g. "(17 + 4) * 389".
    """
    return format_value(evaluate(expression))
