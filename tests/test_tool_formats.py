"""How a policy writes a tool call and reads the answer, as tokens (`gvpo_jax.tools.formats`).

The tokenizer here is character-level with Qwen3's special tokens whole, so a text's ids are
exactly its characters: any separator a format drops or adds shows as a token.
"""

import pytest

from gvpo_jax import tools
from gvpo_jax.data import char_tokenizer
from gvpo_jax.tools import formats
from tests.helpers import qwen_char_tokenizer


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return qwen_char_tokenizer()


def _chat(tok, **kw):
    return formats.ChatFormat(tok, tools.Registry([tools.calculator]), **kw)


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3141*2718"}}\n</tool_call>'


def test_observation_ids_are_the_whole_conversations_tokens(qwen_tokenizer):
    """prompt + the policy's call + the observation + the policy's answer tokenise to exactly
    the whole conversation rendered at once (the template's own separators included); joining
    per-turn renders, as a tool turn rendered alone gives it, misses the newline after the
    call's <|im_end|>."""
    tok, fmt = qwen_tokenizer, _chat(qwen_tokenizer)
    question = [{"role": "user", "content": "What is 3141*2718?"}]
    prompt = fmt.prompt_ids(question)
    assert fmt.stop_ids == (tok.convert_tokens_to_ids("</tool_call>"),)
    obs, ok = fmt.answer(CALL, room=200)
    assert ok and obs == fmt.observation_ids("8537238")
    final = "The product is 8537238."
    response = fmt.encode(CALL) + obs + fmt.encode(final) + [tok.eos_token_id]
    call = {"name": "calculator", "arguments": {"expression": "3141*2718"}}
    whole = question + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": "8537238"},
        {"role": "assistant", "content": final},
    ]
    text = tok.apply_chat_template(
        whole, tools=fmt.registry.schemas(), chat_template=fmt.template, tokenize=False
    )
    assert prompt + response + fmt.encode("\n") == fmt.encode(text)
    assert tok.decode(obs).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n8537238")
    assert tok.decode(obs).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The turn-by-turn join: the tool turn rendered alone after the call's end.
    alone = tok.apply_chat_template(
        [{"role": "tool", "content": "8537238"}],
        chat_template=fmt.template,
        tokenize=False,
        add_generation_prompt=True,
    )
    joined = prompt + fmt.encode(CALL) + fmt.encode("<|im_end|>" + alone)
    assert joined != (prompt + fmt.encode(CALL) + obs)


def test_prompt_shows_the_tools_and_thinking_switch(qwen_tokenizer):
    fmt = _chat(qwen_tokenizer, template_kwargs={"enable_thinking": False})
    text = fmt.prompt_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "calculator"' in text and "<tools>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert fmt.observation_ids("1")[-len(fmt.encode("</think>\n\n")) :] == fmt.encode(
        "</think>\n\n"
    )


def test_malformed_calls_are_error_observations(qwen_tokenizer):
    fmt = _chat(qwen_tokenizer)
    for text in ("<tool_call>\n{not json\n</tool_call>", "</tool_call>",
                 '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'):  # fmt: skip
        obs, ok = fmt.answer(text, room=400)
        assert not ok and "error" in qwen_tokenizer.decode(obs).lower()


def test_long_answers_are_cut_to_the_room_on_the_chosen_side(qwen_tokenizer):
    """The answer's text is cut (never the frame) with a mark, keeping the head ("right") or
    the tail ("left"); with no room for the frame itself, nothing is returned."""
    digits = "1234567890" * 30
    for side, keep in (("right", str.startswith), ("left", str.endswith)):
        fmt = _chat(qwen_tokenizer, truncate=side)
        frame = len(fmt.observation_ids(""))
        obs = formats._fit(fmt.encode, fmt.render, digits, frame + 40, side)
        text = qwen_tokenizer.decode(obs)
        assert len(obs) <= frame + 40 and len(obs) >= frame + 40 - 1
        body = text.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
        assert formats.TRUNCATION_MARK.strip() in body
        assert keep(digits, body.replace(formats.TRUNCATION_MARK, ""))
        assert formats._fit(fmt.encode, fmt.render, digits, frame - 1, side) == []
    with pytest.raises(ValueError, match="truncate"):
        _chat(qwen_tokenizer, truncate="middle")


def test_bracket_format_for_character_models():
    tok = char_tokenizer.build_char_tokenizer(char_tokenizer.CHARS + "[]")
    fmt = formats.BracketFormat(tok, tools.Registry([tools.calculator]))
    assert fmt.stop_ids == (tok.convert_tokens_to_ids("]"),)
    obs, ok = fmt.answer("so [12*34]", room=20)
    assert ok and tok.decode(obs) == "=408 "
    obs, ok = fmt.answer("[12*]", room=40)
    assert not ok and tok.decode(obs).startswith("=") and "rror" in tok.decode(obs)


def test_a_template_without_the_tool_protocol_is_refused(qwen_tokenizer):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="tool call"):
        _chat(qwen_tokenizer, template=plain)


def test_a_template_that_writes_the_last_assistant_turn_differently_is_accepted(qwen_tokenizer):
    """Qwen3's own template adds an empty think block to an assistant turn only when it is the
    last message: the frame comes from one render of a conversation that goes on after the
    call, so the answers' tokens are the same as with the plain template."""
    plain = "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    assert plain in formats.QWEN3_TEMPLATE
    thinking = formats.QWEN3_TEMPLATE.replace(
        plain,
        "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>"
        "\\n\\n' }}{%- endif %}{{- (message.content or '') }}",
    )
    fmt = _chat(qwen_tokenizer, template=thinking)
    assert fmt.observation_ids("42") == _chat(qwen_tokenizer).observation_ids("42")
