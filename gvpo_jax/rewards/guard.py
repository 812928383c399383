"""Refuses parsed answers whose exact evaluation would explode (power towers, huge factorials).

math-verify compares answers by evaluating them exactly (`doit`, `simplify`, `expand`), and
sympy builds the integers of `9^{9^{9^9}}` or `(10^{10})!` in single C calls that no signal can
interrupt. This module estimates, from the unevaluated sympy tree, how large the integers and
expansions of that evaluation can get, without evaluating anything: bounds are carried as
log10 values (floats, `inf` allowed), so estimating a tower costs as much as printing it. It is
defence in depth; the worker pool's hard timeout (`rewards.pool`) is the guarantee.

The bounds are upper bounds and deliberately loose; the limits sit far above any answer of
GSM8K / MATH (the largest exact integer in those is a few hundred digits) and measured costs at
the limits are ~0.2 s (a 10,000-digit power compared with a number, a 200-term expansion).
"""

from __future__ import annotations

import math

import sympy

MAX_DIGITS = 10_000  # an exact integer of more decimal digits than this is refused
MAX_TERMS = 200  # an expansion (or a sum / product range) with more terms than this is refused

_FACTORIALS = (
    sympy.factorial,
    sympy.factorial2,
    sympy.subfactorial,
    sympy.gamma,
    sympy.RisingFactorial,
    sympy.FallingFactorial,
)


class _Refuse(Exception):
    pass


def refusal(parsed) -> str | None:
    """Why evaluating `parsed` (math-verify's list of sympy objects and strings) could explode,
    as a short phrase ("a power of about 1e+08 digits"), or None when it is safe to verify."""
    try:
        for item in parsed:
            if isinstance(item, sympy.Basic) or getattr(item, "is_Matrix", False):
                _size(item, {})
    except _Refuse as e:
        return str(e)
    except RecursionError:
        return "an expression nested too deeply"
    return None


def _exp10(log10_value: float) -> float:
    return math.inf if log10_value > 300 else 10.0**log10_value


def _check(digits: float, terms: float, what: str) -> tuple[float, float]:
    if digits > MAX_DIGITS:
        raise _Refuse(f"{what} of about {_show(digits)} digits")
    if terms > math.log10(MAX_TERMS):
        raise _Refuse(f"{what} expanding to about {_show(_exp10(terms))} terms")
    return digits, terms


def _show(x: float) -> str:
    return "infinitely many" if math.isinf(x) else f"{x:.3g}"


def _size(expr, bound: dict) -> tuple[float, float]:
    """(digits, terms): log10 bounds on the largest numerator or denominator that evaluating
    `expr` exactly can build, and on its number of terms when expanded. `bound` maps the
    variables of enclosing sums / products to the digits of their upper limits."""
    if getattr(expr, "is_Matrix", False) and not isinstance(expr, sympy.Basic):
        sizes = [_size(e, bound) for e in expr] or [(0.0, 0.0)]
        return max(s[0] for s in sizes), max(s[1] for s in sizes)
    if isinstance(expr, sympy.Integer):
        return _check(_digits(int(expr.p)), 0.0, "a number")
    if isinstance(expr, sympy.Rational):
        return _check(max(_digits(int(expr.p)), _digits(int(expr.q))), 0.0, "a number")
    if isinstance(expr, sympy.Float):
        _, man, exp, bc = expr._mpf_
        return _check(abs(exp + bc) * math.log10(2) if man else 0.0, 0.0, "a number")
    if isinstance(expr, sympy.Symbol):
        return bound.get(expr, 0.0), 0.0
    if not isinstance(expr, sympy.Basic) or not expr.args:
        return 0.0, 0.0  # constants (pi, E, I, oo), strings
    if isinstance(expr, (sympy.Sum, sympy.Product)):
        return _size_range(expr, bound)
    sizes = [_size(a, bound) for a in expr.args]
    digits = [s[0] for s in sizes]
    terms = [s[1] for s in sizes]
    if isinstance(expr, sympy.Add):
        return _check(max(digits) + math.log10(len(digits)), _log10_sum(terms), "a sum")
    if isinstance(expr, sympy.Mul):
        return _check(sum(digits), sum(terms), "a product")
    if isinstance(expr, sympy.Pow):
        (base_digits, base_terms), (exp_digits, _) = sizes
        n = _exp10(exp_digits)  # |exponent| <= n
        expanded = _log10_multinomial(n, _exp10(base_terms)) if expr.exp.is_number else 0.0
        return _check(n * max(base_digits, math.log10(2)), expanded, "a power")
    if isinstance(expr, _FACTORIALS):
        n = _exp10(max(digits))  # n! < n^n
        return _check(n * math.log10(max(n, 2.0)), max(terms), "a factorial")
    if isinstance(expr, sympy.binomial):
        return _check(_exp10(digits[0]) * math.log10(2), max(terms), "a binomial")
    return max(digits), max(terms)  # functions, relations, sets, tuples: as large as an argument


def _size_range(expr, bound: dict) -> tuple[float, float]:
    """A sum or product over integer ranges: the range length is its number of terms."""
    bound = dict(bound)
    count = 1.0
    for var, *limits in expr.limits:
        limit_digits = max((_size(x, bound)[0] for x in limits), default=0.0)
        if len(limits) == 2 and all(isinstance(x, sympy.Integer) for x in limits):
            count *= float(min(max(int(limits[1]) - int(limits[0]) + 1, 0), 10**300))
        else:
            count *= 2.0 * _exp10(limit_digits) + 1.0  # lo..hi inside [-10^d, 10^d]
        bound[var] = limit_digits
    if count > MAX_TERMS:
        raise _Refuse(f"a sum or product of about {_show(count)} terms")
    count = max(count, 1.0)  # an empty range evaluates to 0 or 1
    digits, terms = _size(expr.function, bound)
    if isinstance(expr, sympy.Product):
        return _check(count * max(digits, math.log10(2)), terms, "a product")
    return _check(digits + math.log10(count), terms + math.log10(count), "a sum")


def _digits(n: int) -> float:
    return math.log10(abs(n)) if n else 0.0  # math.log10 takes integers of any size


def _log10_sum(log10_values: list[float]) -> float:
    top = max(log10_values)
    if math.isinf(top):
        return top
    return top + math.log10(sum(10.0 ** (v - top) for v in log10_values))


def _log10_multinomial(n: float, t: float) -> float:
    """log10 of the number of terms of (a_1 + ... + a_t)^n expanded: C(n + t - 1, t - 1)."""
    if t <= 1.0 or n <= 1.0:
        return 0.0
    if math.isinf(n) or math.isinf(t):
        return math.inf
    nats = math.lgamma(n + t) - math.lgamma(n + 1.0) - math.lgamma(t)
    return max(nats, 0.0) / math.log(10)
