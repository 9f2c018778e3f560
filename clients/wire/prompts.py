"""The completions `prompt` as OpenAI and vLLM take it, and the OpenAI fields we refuse.

A prompt is a string, a list of strings, a list of token ids or a list of token-id lists;
the two list-of-prompts forms are a *batch* (one choice per prompt). `parse_prompt` is the
edge's check (pydantic's union errors would not say which item is wrong); `prompts_of`
spreads a checked value into its prompts. No Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

PromptValue = str | list[str] | list[int] | list[list[int]]
FORMS = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def _is_id(x: Any) -> bool:
    return type(x) is int  # bool is an int to Python, not to JSON


def _kind(x: Any) -> str:
    if isinstance(x, str):
        return "a string"
    if _is_id(x):
        return "a token id"
    if isinstance(x, list):
        return "a list"
    return f"a {type(x).__name__}" if x is not None else "null"


def _text(text: str, where: str) -> str:
    if not text:
        raise ValueError(f"{where} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} must be valid Unicode (a lone surrogate such as \\ud800 is not)") from None
    return text


def _ids(ids: list, where: str) -> list[int]:
    if not ids:
        raise ValueError(f"{where} has no token ids")
    for j, t in enumerate(ids):
        if not _is_id(t) or t < 0:
            what = str(t) if _is_id(t) else f"{_kind(t)} ({t!r})"
            raise ValueError(f"{where}[{j}] is {what}; token ids are integers >= 0")
    return ids


def parse_prompt(value: Any) -> PromptValue:
    """The prompt field's value, checked; ValueError saying which item is wrong."""
    if isinstance(value, str):
        return _text(value, "the prompt")
    if not isinstance(value, list):
        raise ValueError(f"must be {FORMS}; got {_kind(value)}")
    if not value:
        raise ValueError("the batch is empty: give at least one prompt")
    first = _kind(value[0])
    for i, x in enumerate(value):
        if _kind(x) != first:
            raise ValueError(
                f"item {i} is {_kind(x)} where item 0 is {first}: a list holds only strings, only token ids, "
                "or only lists of token ids"
            )
    if first == "a string":
        return [_text(x, f"prompt {i}") for i, x in enumerate(value)]
    if first == "a token id":
        return _ids(value, "the prompt")
    if first == "a list":
        return [_ids(x, f"prompt {i}") for i, x in enumerate(value)]
    raise ValueError(f"must be {FORMS}; its items are {first}")


def is_batch(prompt: PromptValue) -> bool:
    return isinstance(prompt, list) and isinstance(prompt[0], (str, list))


def prompts_of(prompt: PromptValue) -> list[str | list[int]]:
    """The prompts of a checked value: one, or a batch's in order."""
    return list(prompt) if is_batch(prompt) else [prompt]


# -- OpenAI fields we do not implement ----------------------------------------------------
# field -> (is the value one that changes nothing?, what to say). A value outside that is
# refused with a 400 naming the field rather than ignored: a silently different request
# (a wrong evaluation score, an unconstrained "JSON" answer) is worse than an error.
_Neutral = Callable[[Any], bool]


def _falsy(v: Any) -> bool:
    return not v


REFUSED_COMPLETIONS: dict[str, tuple[_Neutral, str]] = {
    "best_of": (lambda v: v == 1, "only best_of=1 is supported"),
    "suffix": (_falsy, "suffix (insertion) is not supported"),
    "use_beam_search": (_falsy, "beam search is not supported"),
    "guided_json": (_falsy, "guided decoding is not supported"),
    "guided_regex": (_falsy, "guided decoding is not supported"),
    "guided_choice": (_falsy, "guided decoding is not supported"),
    "guided_grammar": (_falsy, "guided decoding is not supported"),
    "structured_outputs": (_falsy, "structured outputs (guided decoding) are not supported"),
    "logprob_token_ids": (
        _falsy,
        "logprobs of chosen token ids are not supported; logprobs: N reports the top N of each token's source model",
    ),
    "prompt_logprobs": (lambda v: False, "send echo: true with logprobs: N for the prompt's log-probabilities"),
}
REFUSED_CHAT: dict[str, tuple[_Neutral, str]] = {
    **{k: v for k, v in REFUSED_COMPLETIONS.items() if k not in ("best_of", "suffix")},
    "echo": (_falsy, "echo is a completions field (POST /v1/completions)"),
    "response_format": (
        lambda v: isinstance(v, dict) and v.get("type") == "text",
        "only response_format {'type': 'text'} is supported (no JSON mode or schema)",
    ),
    "tools": (_falsy, "tools (function calling) are not supported"),
    "tool_choice": (lambda v: v == "none", "tools (function calling) are not supported"),
    "functions": (_falsy, "functions (function calling) are not supported"),
    "function_call": (lambda v: v == "none", "functions (function calling) are not supported"),
    "prediction": (_falsy, "predicted outputs are not supported"),
    "audio": (_falsy, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], "only the text modality is supported"),
}


def field_error(model: str, name: str, value: Any, message: str) -> ValidationError:
    """A ValidationError located at field `name` (a model validator's own errors have no location)."""
    error = PydanticCustomError("value_error", message)
    return ValidationError.from_exception_data(model, [InitErrorDetails(type=error, loc=(name,), input=value)])


def refuse_unsupported(model: str, data: Any, table: dict[str, tuple[_Neutral, str]]) -> None:
    """A model's `mode="before"` check: raises a ValidationError located at the first field of
    `table` whose value is not neutral (so the 400 names it: `param`)."""
    if not isinstance(data, dict):
        return
    for name, (neutral, why) in table.items():
        if data.get(name) is not None and not neutral(data[name]):
            raise field_error(model, name, data[name], why)
