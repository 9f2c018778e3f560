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

import torch

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
        if token_id not in self._cache:
            raw = self._bytes(token_id)
            self._cache[token_id] = (raw.decode("utf-8", errors="backslashreplace"), raw)
        return self._cache[token_id]

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


def token_logprobs(logits: torch.Tensor, token: int, top_n: int, texts: TokenTexts, text_offset: int) -> TokenLogprobs:
    """logits: [V] raw logits of the source model at this step -> the committed token's
    log-probability and the top_n most likely tokens, most likely first (one host copy)."""
    logp = torch.log_softmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=-1)  # [V]
    logp = logp.clamp_min(LOGPROB_FLOOR)  # -inf (and underflow) -> the finite floor
    top = torch.topk(logp, min(top_n, logp.shape[-1]))  # sorted, descending
    values = torch.cat([logp[token : token + 1], top.values]).tolist()  # [1 + n]
    ids = top.indices.tolist()

    def entry(token_id: int, value: float) -> Logprob:
        text, raw = texts(token_id)
        return Logprob(token_id=token_id, token=text, token_bytes=raw, logprob=value)

    return TokenLogprobs(
        chosen=entry(token, values[0]), top=tuple(entry(i, v) for i, v in zip(ids, values[1:])), text_offset=text_offset
    )
