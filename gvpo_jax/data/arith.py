"""The synthetic arithmetic task of the demo: "12+7=" -> "19", with a held-out set never trained on.

Small enough for a tiny from-scratch transformer to learn on a CPU in minutes: operands in
[0, max_operand], operators from `ops` (+ - *), integer answers (non-negative unless
`allow_negative`). The eval set is fixed by `eval_seed` alone (comparable across training seeds);
the training stream is a deterministic function of (seed, index) that skips every eval problem.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

OPS = "+-*"
# Word-problem phrasings of each operator (style="word"), for pretrained instruction models.
WORD_PROBLEMS = {
    "word": {
        "+": "Sam has {a} marbles and finds {b} more. How many marbles does Sam have now?",
        "-": "Sam has {a} marbles and gives {b} of them away. How many marbles are left?",
        "*": "There are {a} boxes with {b} pencils in each. How many pencils are there in all?",
    }
}


@dataclasses.dataclass(frozen=True)
class ArithTask:
    """Problem generator. Examples are dicts: prompt "a+b=", answer "c", solution "c" (the
    demonstration answer; SFT appends EOS), dataset "arith", id "a+b".
    """

    max_operand: int = 20  # operands drawn uniformly from [0, max_operand]
    ops: str = "+-"  # operators used, a subset of "+-*"
    seed: int = 0  # training stream seed
    eval_seed: int = 0  # held-out set seed (independent of the training seed)
    eval_size: int = 200  # held-out problems
    train_size: int = 1 << 20  # length of the training source (index space of the stream)
    allow_negative: bool = False  # False: "a-b" always has a >= b
    style: str = "symbolic"  # symbolic: "12+7=" | word: a one-sentence word problem

    def __post_init__(self):
        if not self.ops or set(self.ops) - set(OPS) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops is {self.ops!r}; use distinct operators from {OPS!r}.")
        if self.style not in WORD_PROBLEMS and self.style != "symbolic":
            raise ValueError(f"style is {self.style!r}; use 'symbolic' or 'word'.")
        if self.max_operand < 1:
            raise ValueError(f"max_operand is {self.max_operand}; use an integer >= 1.")
        if 2 * self.eval_size > self.num_problems:
            raise ValueError(
                f"eval_size={self.eval_size} leaves too few training problems out of "
                f"{self.num_problems}; lower eval_size or raise max_operand."
            )

    @classmethod
    def from_digits(cls, num_digits: int, **kwargs) -> ArithTask:
        """Operands of at most `num_digits` digits (max_operand = 10**num_digits - 1)."""
        return cls(max_operand=10**num_digits - 1, **kwargs)

    @property
    def num_problems(self) -> int:
        """Distinct problems the generator can produce."""
        n = self.max_operand + 1
        per_op = {"+": n * n, "*": n * n, "-": n * n if self.allow_negative else n * (n + 1) // 2}
        return sum(per_op[op] for op in self.ops)

    def example(self, a: int, op: str, b: int) -> dict:
        """The example dict of one problem."""
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        key = f"{a}{op}{b}"
        prompt = f"{key}=" if self.style == "symbolic" else WORD_PROBLEMS[self.style][op]
        return {
            "prompt": prompt.format(a=a, b=b),
            "answer": str(value),
            "solution": str(value),
            "dataset": "arith",
            "id": key,
            "expression": key,  # what a calculator call computes (tool demonstrations)
        }

    def _draw(self, rng: np.random.Generator) -> tuple[int, str, int]:
        a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
        op = self.ops[int(rng.integers(len(self.ops)))]
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return a, op, b

    @functools.cached_property
    def eval_examples(self) -> list[dict]:
        """The fixed held-out problems (distinct), in generation order."""
        rng = np.random.default_rng([self.eval_seed, 1])
        seen: dict[str, dict] = {}
        while len(seen) < self.eval_size:
            ex = self.example(*self._draw(rng))
            seen.setdefault(ex["id"], ex)
        return list(seen.values())

    @functools.cached_property
    def eval_ids(self) -> frozenset[str]:
        return frozenset(ex["id"] for ex in self.eval_examples)

    def train_example(self, index: int) -> dict:
        """Training problem number `index`: a pure function of (seed, index), never an eval one."""
        rng = np.random.default_rng([self.seed, 0, int(index)])
        while True:
            ex = self.example(*self._draw(rng))
            if ex["id"] not in self.eval_ids:
                return ex

    def train_source(self) -> ArithSource:
        """A random-access source of `train_size` training examples (for `data.make_iterator`)."""
        return ArithSource(self)


@dataclasses.dataclass(frozen=True)
class ArithSource:
    """Random-access view of the training stream: `len` and `source[i]` (grain's protocol)."""

    task: ArithTask

    def __len__(self) -> int:
        return self.task.train_size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} training problems")
        return self.task.train_example(index)
