"""Python clients of Backoff Serve: HTTP (OpenAI-compatible) and gRPC, sync and async.

Imports neither Ray nor torch. The request/response types live in `clients.wire.types` and are
shared by every transport (and by the server's edge); errors map to the exceptions of
`clients.wire.errors` in one place.
"""

from clients.retry import Retry
from clients.wire.errors import (
    AuthenticationError,
    BackoffError,
    BadRequestError,
    NotFoundError,
    OverloadedError,
    RateLimitError,
    ServerError,
    TransportError,
)
from clients.wire.logprobs import TokenLogprob, TopLogprob
from clients.wire.types import ChatMessage, Delta, GenerateParams, Generation, Usage

__all__ = [
    "AuthenticationError",
    "BackoffError",
    "BadRequestError",
    "NotFoundError",
    "OverloadedError",
    "RateLimitError",
    "ServerError",
    "TransportError",
    "Retry",
    "ChatMessage",
    "Delta",
    "GenerateParams",
    "Generation",
    "Usage",
    "TokenLogprob",
    "TopLogprob",
]
