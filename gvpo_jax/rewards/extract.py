"""String-level answer helpers shared by the datasets and the rewards: boxed spans, GSM8K '####'."""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")


def boxed_spans(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}` (balanced braces) or `\\boxed 5`, in order.

    An unclosed `\\boxed{` (a truncated response) yields nothing for that occurrence.
    """
    spans = []
    i = 0
    while True:
        starts = [(text.find(cmd, i), cmd) for cmd in _BOX_COMMANDS]
        starts = [(pos, cmd) for pos, cmd in starts if pos >= 0]
        if not starts:
            return spans
        pos, cmd = min(starts)
        j = pos + len(cmd)
        if text.startswith("{", j):
            depth, k = 0, j
            while k < len(text):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    break
                k += 1
            if depth != 0:
                return spans
            spans.append(text[j + 1 : k])
            i = k + 1
        elif text.startswith(" ", j):
            # MATH writes a few answers as "\boxed 5": the answer runs to the next space or $.
            m = re.match(r" +([^\s$]+)", text[j:])
            if m:
                spans.append(m.group(1))
            i = j + 1
        else:
            i = j


def last_boxed(text: str) -> str | None:
    """Content of the last boxed span, or None (MATH's convention for the final answer)."""
    spans = boxed_spans(text)
    return spans[-1] if spans else None


def gsm8k_final_answer(text: str) -> str | None:
    """The number after the last '####' (GSM8K's marker), without commas, '$' or spaces, or None."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    tail = tail.replace(",", "").replace("$", "").strip()
    return tail or None


def strip_calculator_annotations(text: str) -> str:
    """Removes GSM8K's `<<48/2=24>>` calculator calls (not part of the written solution)."""
    return _CALCULATOR_RE.sub("", text)
