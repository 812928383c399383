"""Prompt templates and tokenisation: the chat template when there is one, lengths checked once.

`encode_prompts` renders each example's `prompt` through a template, tokenises the whole batch in
one call, and drops (or rejects) prompts longer than `max_prompt_len` tokens. `encode_sft` adds the
demonstration response (`solution` + EOS) for cold-start SFT and GVPO demonstration slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BRIEF_BOXED_INSTRUCTION = "Answer in one short sentence and put the final number within \\boxed{}."
VERL_MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """`user` holds the placeholder `{prompt}` (replaced literally, so LaTeX braces are safe);
    `system` is an optional system message; `by_dataset` gives other user messages for the
    examples of named datasets (`example["dataset"]`), e.g. GSM8K's "####" instruction."""

    user: str = "{prompt}"
    system: str | None = None
    by_dataset: tuple[tuple[str, str], ...] = ()

    def user_message(self, prompt: str, dataset: str | None = None) -> str:
        user = dict(self.by_dataset).get(dataset, self.user) if dataset else self.user
        return user.replace("{prompt}", prompt)

    def messages(self, prompt: str, dataset: str | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.user_message(prompt, dataset)}]

    def plain(self, prompt: str, dataset: str | None = None) -> str:
        """The text without a chat template (system message, blank line, user message)."""
        user = self.user_message(prompt, dataset)
        return f"{self.system}\n\n{user}" if self.system else user


TEMPLATES: dict[str, PromptTemplate] = {
    # The raw problem: the arithmetic demo ("12+7=" -> "19") and base models.
    "plain": PromptTemplate(),
    # Qwen2.5-Math / DeepSeek-R1 evaluation style: the instruction follows the question.
    "boxed": PromptTemplate(user="{prompt}\n" + BOXED_INSTRUCTION),
    # Qwen2.5-Math's official chat format: the instruction is the system message.
    "qwen_math": PromptTemplate(user="{prompt}", system=BOXED_INSTRUCTION),
    # Small instruction models: a short reply that ends (SmolLM2-135M-Instruct at T = 1 on the
    # word problems: 7% of replies reach 128 tokens, against 50% reaching 96 and 90% reaching 32
    # with the bare problem; STUDY.md part 3).
    "brief_boxed": PromptTemplate(user="{prompt}\n" + BRIEF_BOXED_INSTRUCTION),
    # Base models without a chat template, GSM8K-style.
    "qa": PromptTemplate(user="Question: {prompt}\nAnswer:"),
    # The official GVPO recipe (jszkc/GVPO on verl 0.6): verl's examples/data_preprocess
    # math_dataset.py / gsm8k.py append their instruction to the problem after one space, as the
    # only (user) message; the chat template adds its own default system message, if any.
    "verl": PromptTemplate(
        user="{prompt} " + VERL_MATH_INSTRUCTION,
        by_dataset=(("gsm8k", "{prompt} " + VERL_GSM8K_INSTRUCTION),),
    ),
}


def get_template(template: str | PromptTemplate) -> PromptTemplate:
    if isinstance(template, PromptTemplate):
        return template
    if template not in TEMPLATES:
        raise ValueError(
            f"unknown prompt template {template!r}; use one of {', '.join(TEMPLATES)}."
        )
    return TEMPLATES[template]


def render(
    tokenizer,
    prompt: str,
    *,
    template,
    use_chat_template: bool,
    dataset: str | None = None,
    tools: Sequence[dict] | None = None,
) -> tuple[str, bool]:
    """The prompt text and whether it already holds the special tokens (chat template applied);
    `dataset` picks a template's per-dataset user message; `tools` (JSON schemas) are shown by
    the chat template."""
    t = get_template(template)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            t.messages(prompt, dataset),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        return text, True
    return t.plain(prompt, dataset), False


def _tokenize(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    return [
        list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    ]


def encode_prompts(
    tokenizer,
    examples: Sequence[Mapping],
    *,
    template: str | PromptTemplate = "plain",
    max_prompt_len: int,
    use_chat_template: bool = False,
    on_too_long: str = "drop",
    tools: Sequence[dict] | None = None,
) -> tuple[list[list[int]], np.ndarray, np.ndarray, int]:
    """Tokenised prompts of `examples` (their `prompt` field); `tools`: the JSON schemas of the
    tools a chat template shows the policy (`render`).

    Without a chat template the tokenizer's own special tokens are added (e.g. <bos>); with one,
    the rendered text already carries them. Returns `(prompt_ids, lens_M, kept_M, num_dropped)`:
    ragged lists of ids for the M kept examples, their lengths (int32 [M]), their indices into
    `examples` (int64 [M]), and how many were longer than `max_prompt_len` and dropped.
    `on_too_long="error"` raises ValueError instead of dropping.
    """
    if on_too_long not in ("drop", "error"):
        raise ValueError(f"on_too_long is {on_too_long!r}; use 'drop' or 'error'.")
    rendered = [
        render(
            tokenizer,
            ex["prompt"],
            template=template,
            use_chat_template=use_chat_template,
            dataset=ex.get("dataset"),
            tools=tools,
        )
        for ex in examples
    ]
    ids = [None] * len(rendered)
    for has_specials in (True, False):  # at most two tokenizer calls for the batch
        idx = [i for i, (_, s) in enumerate(rendered) if s == has_specials]
        for i, row in zip(
            idx, _tokenize(tokenizer, [rendered[i][0] for i in idx], not has_specials), strict=True
        ):
            ids[i] = row
    kept = [i for i, row in enumerate(ids) if len(row) <= max_prompt_len]
    if len(kept) < len(ids) and on_too_long == "error":
        bad = next(i for i, row in enumerate(ids) if len(row) > max_prompt_len)
        raise ValueError(
            f"example {bad} ({examples[bad].get('id', '?')}) has {len(ids[bad])} prompt tokens > "
            f"max_prompt_len={max_prompt_len}; raise max_prompt_len or use on_too_long='drop'."
        )
    prompt_ids = [ids[i] for i in kept]
    lens = np.array([len(row) for row in prompt_ids], np.int32)
    return prompt_ids, lens, np.array(kept, np.int64), len(ids) - len(kept)


def encode_sft(
    tokenizer,
    examples: Sequence[Mapping],
    *,
    template: str | PromptTemplate = "plain",
    max_prompt_len: int,
    max_response_len: int,
    use_chat_template: bool = False,
) -> tuple[list[list[int]], list[list[int]], np.ndarray, int]:
    """Prompt ids and demonstration ids (`solution` tokens + EOS) for supervised warm-up.

    Returns `(prompt_ids, response_ids, kept_M, num_dropped)`; examples whose prompt or response is
    too long, or that have no `solution`, are dropped and counted.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; demonstrations must end with EOS.")
    prompt_ids, _, kept, dropped = encode_prompts(
        tokenizer,
        examples,
        template=template,
        max_prompt_len=max_prompt_len,
        use_chat_template=use_chat_template,
    )
    solutions = [str(examples[i].get("solution") or "") for i in kept]
    responses = [row + [tokenizer.eos_token_id] for row in _tokenize(tokenizer, solutions, False)]
    ok = [
        j
        for j, (s, r) in enumerate(zip(solutions, responses, strict=True))
        if s and len(r) <= max_response_len
    ]
    dropped += len(kept) - len(ok)
    return [prompt_ids[j] for j in ok], [responses[j] for j in ok], kept[ok], dropped


def pad_batch(rows: Sequence[Sequence[int]], *, pad_id: int, length: int | None = None):
    """Right-pads ragged ids to `[B, length]` (default: the longest row): (ids, mask), int32."""
    length = max((len(r) for r in rows), default=0) if length is None else length
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for b, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"row {b} has {len(row)} tokens > length={length}.")
        ids[b, : len(row)] = row
        mask[b, : len(row)] = 1
    return ids, mask
