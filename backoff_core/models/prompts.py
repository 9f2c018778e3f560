"""Text -> prompt token ids, the same way for the CLI and every serving transport."""

from __future__ import annotations

from collections.abc import Sequence

from jinja2.exceptions import TemplateError


def encode_chat(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """messages: [{"role": ..., "content": ...}] through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    except TemplateError as exc:  # the template's own raise_exception(): e.g. roles out of order
        raise ValueError(f"the chat template refused the messages: {exc}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    if not text:
        raise ValueError("the prompt is empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return list(ids)
