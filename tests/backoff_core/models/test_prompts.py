"""Text -> prompt ids (backoff_core/models/prompts.py) with the tiny word-level tokenizer
("wN" is id N + 2) and a hand-written chat template."""

from __future__ import annotations

import pytest

from backoff_core.models.prompts import encode_chat, encode_prompt
from tests.support.tiny import tiny_tokenizer

# every user turn is "w1 <content>", the generation prompt "w2"; a system turn is refused
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
    "w1 {{ m['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}w2{% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    tok = tiny_tokenizer()  # a fresh one: the session's `tokenizer` fixture stays template-free
    tok.chat_template = TEMPLATE
    return tok


def test_a_plain_prompt_is_the_tokenizers_ids(tokenizer):
    assert encode_prompt(tokenizer, "w3 w4 w40") == [5, 6, 42]


@pytest.mark.parametrize("text, says", [("", "empty"), ("   ", "no tokens")])
def test_an_empty_prompt_is_refused(tokenizer, text, says):
    with pytest.raises(ValueError, match=says):
        encode_prompt(tokenizer, text)


def test_chat_goes_through_the_template_with_the_generation_prompt(chat_tokenizer):
    assert encode_prompt(chat_tokenizer, "w3", chat=True) == [3, 5, 4]
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w5 w6"}]
    ids = encode_chat(chat_tokenizer, messages)
    assert ids == [3, 5, 3, 7, 8, 4] and isinstance(ids, list) and all(type(i) is int for i in ids)


def test_chat_without_a_template_is_a_value_error(tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tokenizer, "w3", chat=True)


def test_a_template_that_refuses_the_messages_is_a_value_error(chat_tokenizer):
    with pytest.raises(ValueError, match="refused the messages: no system turns"):
        encode_chat(chat_tokenizer, [{"role": "system", "content": "w3"}])
