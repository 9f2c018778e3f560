"""How large an answer may grow, judged before any work (Ray-free, no torch).

Every answer leaves the Ingress as one message (a unary body; an echo chunk or a result on a
stream), and every result crosses from a SmallModel replica to the Ingress as one pickled
item, so what bounds a message is the answer's size. `answer_bytes` is an upper estimate of
the JSON answer of a request from what it asks for (choices x the tokens it may return x
the bytes a token's entry takes with its alternatives); `check_answer` refuses a request
whose estimate passes `limits.max_answer_bytes` with a 400 that names the fields, before it
is admitted. The channels between Serve's processes carry up to `AppArgs.max_message_bytes`
(serve_cli.MESSAGE_BYTES on the proxy), well above it.
"""

from __future__ import annotations

from collections.abc import Sequence

from clients.wire.types import GenerateParams
from deployments.serving.access import ClientError
from deployments.serving.edge_config import LimitsConfig

# bytes of one token in an answer, upper estimates from the JSON bodies: its text, id and
# source (chat / completions / the backoff trace); one log-probability entry (token text,
# logprob, bytes list: chat's is the longest, ~60-75 B for a short token). Measured: n=32 x
# 100 tokens x top_logprobs 20 is a 4.95 MB chat body (1.55 kB a token; estimated 1.74 kB).
TOKEN_BYTES = 64
LOGPROB_ENTRY_BYTES = 80


def token_bytes(logprobs: int | None) -> int:
    """Upper estimate of one token's share of an answer with `logprobs` alternatives (None: none)."""
    return TOKEN_BYTES + (0 if logprobs is None else LOGPROB_ENTRY_BYTES * (1 + logprobs))


def prompt_tokens_at_most(content: dict) -> int:
    """Tokens a prompt may have, at most: its ids, or the UTF-8 bytes of its text (a token is
    at least one byte); 0 for chat messages, which are never echoed."""
    prompt = content.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    return 0


def answer_bytes(params: GenerateParams, contents: Sequence[dict], choices: int, default_max_tokens: int) -> int:
    """Upper estimate of the answer's bytes: every prompt's `choices` choices, each its
    max_tokens (and, with echo, its prompt) at token_bytes(logprobs)."""
    max_tokens = default_max_tokens if params.max_tokens is None else params.max_tokens
    per = token_bytes(params.logprobs)
    echoed = sum(prompt_tokens_at_most(c) for c in contents) if params.echo else 0
    return choices * (len(contents) * max_tokens + echoed) * per


def check_answer(
    limits: LimitsConfig, params: GenerateParams, contents: Sequence[dict], choices: int, default_max_tokens: int
) -> None:
    """A request whose answer could pass limits.max_answer_bytes is a 400 naming what makes it
    large (ClientError), before any work."""
    size = answer_bytes(params, contents, choices, default_max_tokens)
    if size <= limits.max_answer_bytes:
        return
    max_tokens = default_max_tokens if params.max_tokens is None else params.max_tokens
    fields = []
    if choices > 1:
        fields.append(("n", f"n={choices}"))
    if len(contents) > 1:
        fields.append(("prompt", f"{len(contents)} prompts"))
    fields.append(("max_tokens", f"max_tokens={max_tokens}"))
    if params.echo:
        fields.append(("echo", f"echo with a prompt of up to {max(map(prompt_tokens_at_most, contents))} tokens"))
    if params.logprobs is not None:
        fields.append(("logprobs", f"{params.logprobs} alternatives per token (top_logprobs / logprobs)"))
    raise ClientError(
        f"the answer could reach {size / 2**20:.1f} MiB ({' x '.join(f for _, f in fields)}); the limit is "
        f"{limits.max_answer_bytes / 2**20:.0f} MiB (limits.max_answer_bytes): ask for fewer choices, tokens or "
        "alternatives, or split the request",
        # the field a client most likely lowers: the alternatives where asked, else the tokens
        "logprobs" if params.logprobs is not None else "max_tokens",
        code="answer_too_large",
    )
