"""Log-probabilities of committed tokens, for requests that ask for them (OpenAI's `logprobs`).

Which distribution: the raw next-token distribution of the model that produced the token
(its *source* level), i.e. log_softmax of that model's logits at temperature 1, before
temperature, top-k and top-p (OpenAI reports the same raw distribution). The top
alternatives come from that same distribution. A token whose raw probability underflows
(or whose logit is -inf, e.g. a padded vocabulary entry) reports LOGPROB_FLOOR instead of
-inf, so every value stays finite in JSON and protobuf (OpenAI uses -9999.0 likewise).

Token text: the token alone, as the tokenizer's vocabulary spells it in bytes (byte-level
BPE is mapped back to its raw bytes; SentencePiece's `<0xNN>` is one byte and `▁` a space).
`token` is those bytes as UTF-8, with bytes that are not a whole character written as
`\\xNN` escapes (a multi-byte character split over tokens); `token_bytes` are exact.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backoff_core.engine.host import to_host
from backoff_core.runners.scoring import LOGPROB_FLOOR
from backoff_core.types import Logprob, TokenLogprobs

__all__ = ["LOGPROB_FLOOR", "TokenTexts", "token_logprobs"]
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the printable stand-in of each byte) -> the byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars)}


class TokenTexts:
    """token id -> (text, bytes) of one tokenizer, cached (a vocabulary is finite)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        if (known := self._cache.get(token_id)) is not None:
            return known
        raw = self._bytes(token_id)
        self._cache[token_id] = known = (raw.decode("utf-8", errors="backslashreplace"), raw)
        return known

    def logprob(self, token_id: int, value: float) -> Logprob:
        """token_id's Logprob entry (1 + logprobs of them a request and step that asks)."""
        text, raw = self(token_id)
        return Logprob(token_id, text, raw, value)

    def _bytes(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # an id the vocabulary leaves unnamed
            return self.tokenizer.decode([token_id]).encode("utf-8")
        table = _byte_level_decoder()
        if self.byte_level and all(c in table for c in token):
            return bytes(table[c] for c in token)
        if m := _BYTE_TOKEN.fullmatch(token):
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True)
class LogprobValues:
    """One committed token's logprob figures as read to the host (before texts are attached)."""

    chosen: float  # the committed token's log-probability
    top_ids: list[int]  # the top_n most likely tokens, most likely first
    top_values: list[float]


def logprob_values(logits: Sequence[torch.Tensor], tokens: Sequence[int], top_n: Sequence[int]) -> list[LogprobValues]:
    """logits: one [V] row per committed token (raw, of its source model) -> its figures,
    the whole batch in one host copy (engine/host.py). Rows asking for the same top_n share
    one topk."""
    if not logits:
        return []
    logp = torch.log_softmax(torch.nan_to_num(torch.stack(list(logits)).float(), nan=float("-inf")), dim=-1)
    logp = logp.clamp_min(LOGPROB_FLOOR)  # [B, V]: -inf (and underflow) -> the finite floor
    index = torch.tensor(list(tokens), dtype=torch.long).to(logp.device, non_blocking=True)
    chosen = logp.gather(-1, index[:, None])[:, 0]  # [B]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(top_n):
        groups.setdefault(min(n, logp.shape[-1]), []).append(i)
    tops = {n: torch.topk(logp[rows] if len(rows) < len(top_n) else logp, n) for n, rows in groups.items()}
    parts = [chosen] + [t for top in tops.values() for t in (top.values, top.indices)]
    read = to_host(*parts)
    out: list[LogprobValues | None] = [None] * len(top_n)
    for g, (n, rows) in enumerate(groups.items()):
        values, ids = read[1 + 2 * g], read[2 + 2 * g]
        for j, i in enumerate(rows):
            out[i] = LogprobValues(read[0][i], ids[j] if n else [], values[j] if n else [])
    return out


def token_logprobs(
    logits: torch.Tensor,
    token: int,
    top_n: int,
    texts: TokenTexts,
    text_offset: int,
    values: LogprobValues | None = None,
) -> TokenLogprobs:
    """logits: [V] raw logits of the source model at this step -> the committed token's
    log-probability and the top_n most likely tokens, most likely first. values: what
    logprob_values read for this row (else it reads them: one host copy)."""
    if values is None:
        values = logprob_values([logits], [token], [top_n])[0]
    entry = texts.logprob
    return TokenLogprobs(entry(token, values.chosen), tuple(map(entry, values.top_ids, values.top_values)), text_offset)
