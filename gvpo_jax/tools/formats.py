"""How a policy writes a tool call and reads its answer, as tokens (`multiturn` drives them).

- `ChatFormat`: a chat template's tool protocol. The default template, `QWEN3_TEMPLATE`, is
  Qwen3's format, kept here since no model hub is reachable: the tools' JSON schemas in the
  system turn inside <tools></tools>, a call as `<tool_call>\\n{"name": .., "arguments": ..}\\n
  </tool_call>` in the assistant turn, the answer as `<tool_response>` in a user turn.
- `BracketFormat`: one tool in a bracket syntax for character-level models, e.g. the policy
  writes `[3141*2718]` and reads `=8537238`.

Observation tokens come from a render of the whole conversation, never from rendering a tool
turn alone: per-turn renders drop the separators a template writes between turns (the newline
after `<|im_end|>`), so the policy would train on a sequence it never sees at inference.
`ChatFormat` renders a conversation with a call and its answer and keeps what lies between the
call's `</tool_call>` and the answer (the end of the assistant turn, the tool turn's opening)
and after it (its close, the next assistant header).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gvpo_jax.tools.registry import Observation, Registry

# Qwen3's chat format with tools (the parts a tool rollout reads; thinking is off or left to
# the model's own tokens). Variables: messages, tools, add_generation_prompt, enable_thinking.
QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{%- if loop.first and message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}
{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""

TRUNCATION_MARK = " ..."


def _fit(encode, render, content: str, room: int, side: str) -> list[int]:
    """The ids of render(content), with content cut (keeping its head for side "right", its
    tail for "left", and a mark where it was cut) until they fit in `room`; [] if even an
    empty answer does not fit."""
    ids = encode(render(content))
    if len(ids) <= room:
        return ids
    lo, hi, best = 0, len(content), None
    while lo <= hi:  # the longest kept part that fits
        mid = (lo + hi) // 2
        kept = content[:mid] if side == "right" else content[len(content) - mid :]
        cut = kept + TRUNCATION_MARK if side == "right" else TRUNCATION_MARK + kept
        ids = encode(render(cut if mid < len(content) else content))
        if len(ids) <= room:
            best, lo = ids, mid + 1
        else:
            hi = mid - 1
    return best or []


class _Format:
    """What `multiturn.sample_with_tools` needs of a format: the stop ids and `answer`."""

    registry: Registry
    truncate: str

    def call(self, turn_text: str) -> str:
        raise NotImplementedError

    def render(self, content: str) -> str:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def error(self, message: str, room: int) -> list[int]:
        """The observation ids of an error the host reports (a tool that did not answer)."""
        return _fit(self.encode, self.render, f"error: {message}", room, self.truncate)

    def answer(self, turn_text: str, room: int) -> tuple[list[int], bool]:
        """(observation ids, ok) for a turn that ended at a call: the call run through the
        registry (an error observation for anything malformed), fitted into `room` tokens."""
        obs: Observation = self.registry.call_json(self.call(turn_text))
        return _fit(self.encode, self.render, obs.text, room, self.truncate), obs.ok


def demonstration(fmt, call_arguments: dict, tool: str, answer: str, eos_id: int, room: int):
    """A demonstration that calls `tool` once and then answers: (ids, policy mask), the
    answer's observation masked 0 (as a rollout's), `answer` + EOS after it; truncated to
    `room` tokens. The observation is the registry's real answer to the call."""
    call = fmt.encode(fmt.call_text(tool, call_arguments))
    obs = fmt.registry.call(tool, call_arguments)
    seen = fmt.encode(fmt.render(obs.text))
    final = fmt.encode(answer) + [int(eos_id)]
    ids = (call + seen + final)[:room]
    mask = ([1.0] * len(call) + [0.0] * len(seen) + [1.0] * len(final))[:room]
    return ids, mask


class ChatFormat(_Format):
    """Tool calls through a chat template (default: Qwen3's, `QWEN3_TEMPLATE`).

    tokenizer: a Hugging Face tokenizer holding the template's special tokens.
    registry: the tools; their schemas go into the system turn (`prompt_ids`).
    truncate: the side of a long answer that is cut: "right" keeps its head, "left" its tail.
    template_kwargs: more variables for the template (e.g. enable_thinking=False).
    """

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(
        self,
        tokenizer,
        registry: Registry,
        *,
        template: str = QWEN3_TEMPLATE,
        truncate: str = "right",
        template_kwargs: dict | None = None,
    ):
        if truncate not in ("left", "right"):
            raise ValueError(f"truncate is {truncate!r}; use 'left' or 'right'.")
        self.tokenizer, self.registry, self.template = tokenizer, registry, template
        self.truncate, self.kwargs = truncate, dict(template_kwargs or {})
        self.stop_ids = tuple(self.encode(self.close_tag))
        # The observation's frame, from renders of one conversation with a call and with its
        # answer: what the template writes after the call, then the tool turn and the header.
        call = {"name": "f", "arguments": {}}
        base = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
        ]
        # One render of the whole conversation: the frame is what lies between the call's
        # </tool_call> and the answer, and after the answer. (Not a diff against a render
        # that ends at the call: Qwen3's own template writes an assistant turn differently
        # when it is the last message.)
        marker = "\x00CONTENT\x00"
        answered = self._render(base + [{"role": "tool", "content": marker}], True)
        at = answered.find(marker)
        close = answered.rfind(self.close_tag, 0, max(at, 0))
        if at < 0 or close < 0 or answered.count(marker) != 1:
            raise ValueError(
                "the chat template does not render a tool call as <tool_call>..</tool_call> "
                "followed by its answer; use a template with that tool protocol."
            )
        self._before = answered[close + len(self.close_tag) : at]
        self._after = answered[at + len(marker) :]

    def _render(self, messages, add_generation_prompt: bool, tools=None) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.kwargs,
        )

    def prompt_text(self, messages: Sequence[dict]) -> str:
        """The conversation so far with the tools' schemas and the assistant header."""
        return self._render(list(messages), True, tools=self.registry.schemas() or None)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(self.prompt_text(messages))

    def render(self, content: str) -> str:
        """The observation text for a tool's answer: after `</tool_call>` up to the next
        assistant header (Qwen3: `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{content}
        \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`)."""
        return self._before + content + self._after

    def observation_ids(self, content: str) -> list[int]:
        return self.encode(self.render(content))

    def call_text(self, name: str, arguments: dict) -> str:
        """A call as the policy writes it (a demonstration's): what the template renders for an
        assistant turn holding only this call, between the header and the end of the turn."""
        call = {"name": name, "arguments": arguments}
        text = self._render(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            ],
            add_generation_prompt=False,
        )
        start = text.rindex(self.open_tag)
        return text[start : text.rindex(self.close_tag) + len(self.close_tag)]

    def call(self, turn_text: str) -> str:
        """The JSON of the turn's last call (the text between its tags; "" if none)."""
        start = turn_text.rfind(self.open_tag)
        end = turn_text.rfind(self.close_tag)
        if start < 0 or end < start:
            return ""
        return turn_text[start + len(self.open_tag) : end].strip()


class BracketFormat(_Format):
    """One tool in brackets, for character-level models: the policy writes `[arguments]`
    (`open`, `close` single strings), the tool `tool` gets them as its `argument`, and the
    policy reads `reply` with the answer in place of {} (default "={} ", so `[12*34]=408 `,
    after which it writes its final answer).
    An error reads as its message (e.g. `=error: ...`)."""

    def __init__(
        self,
        tokenizer,
        registry: Registry,
        *,
        tool: str = "calculator",
        argument: str = "expression",
        open: str = "[",
        close: str = "]",
        reply: str = "={} ",
        truncate: str = "right",
    ):
        if truncate not in ("left", "right"):
            raise ValueError(f"truncate is {truncate!r}; use 'left' or 'right'.")
        if "{}" not in reply:
            raise ValueError(f"reply {reply!r} has no {{}} for the answer.")
        self.tokenizer, self.registry, self.truncate = tokenizer, registry, truncate
        self.tool, self.argument, self.open, self.close, self.reply = (
            tool,
            argument,
            open,
            close,
            reply,
        )
        self.stop_ids = tuple(self.encode(close))

    def render(self, content: str) -> str:
        return self.reply.replace("{}", content)

    def call_text(self, name: str, arguments: dict) -> str:
        """A call as the policy writes it (a demonstration's): `[arguments]`."""
        return self.open + str(arguments[self.argument]) + self.close

    def call(self, turn_text: str) -> str:
        start = turn_text.rfind(self.open)
        end = turn_text.rfind(self.close)
        inner = turn_text[start + len(self.open) : end] if 0 <= start < end else ""
        return json.dumps({"name": self.tool, "arguments": {self.argument: inner}})
