"""The edge's own rules, shared by HTTP and gRPC: who may call (API keys), how big a request
may be, how many requests one client may have open. No Ray: the Ingress wires these in.

A client is its API key where keys are configured (two users of one key are one client),
else its peer address. Keys are compared by SHA-256 digest in constant time and never
appear in a message or a log line; a client id carries a digest prefix, not the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from clients.wire.types import ChatMessage, GenerateParams
from deployments.serving.edge_config import AccessConfig, AdmissionConfig, LimitsConfig
from deployments.serving.formats import error_body


class ClientError(ValueError):
    """A request refused for something the client did (4xx, never 5xx)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind, self.headers = kind, dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def peer_host(peer: str | tuple | None) -> str:
    """ASGI ("127.0.0.1", 5123) or gRPC "ipv4:127.0.0.1:5123" / "ipv6:[::1]:5123" -> the host
    (the port changes with every connection: it would make every connection a new client)."""
    if peer is None:
        return "unknown"
    if isinstance(peer, (tuple, list)):
        return str(peer[0])
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]").replace("%5B", "").replace("%5D", "")


class Access:
    """API-key check. No keys configured: everyone may call; the client is the peer host."""

    def __init__(self, config: AccessConfig, environ: Mapping[str, str] = os.environ) -> None:
        keys = [k.get_secret_value() for k in config.api_keys]
        if config.api_keys_env:
            value = environ.get(config.api_keys_env)
            if value is None:
                raise ValueError(
                    f"access.api_keys_env names {config.api_keys_env}, which is not set in the "
                    "Ingress replica's environment"
                )
            keys += [k.strip() for k in value.split(",")]
        self._digests = [_digest(k) for k in keys if k]
        self.health_open = config.health_open

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def client(self, authorization: str | None, peer: str | tuple | None) -> str:
        """The caller's client id; raises ClientError(401) when keys are set and it sent none
        that matches. `authorization` is the header / metadata value: "Bearer <key>"."""
        if not self.enabled:
            return f"peer:{peer_host(peer)}"
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ClientError(
                "no API key: send the header 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        digest = _digest(key.strip())
        # every key is compared, so the time taken does not tell which one came close
        if sum(hmac.compare_digest(digest, d) for d in self._digests) == 0:
            raise ClientError(
                "the API key is not valid", status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
            )
        return f"key:{digest[:12]}"


class ClientSlots:
    """Requests each client has open in THIS Ingress replica (Serve may run several: the
    limit a client meets is per replica). Single event loop: no lock needed."""

    def __init__(self, limit: int | None, retry_after_s: int) -> None:
        self.limit, self.retry_after_s = limit, retry_after_s
        self.open: Counter[str] = Counter()

    def take(self, client: str) -> Callable[[], None]:
        """One slot for `client`, or ClientError(429). Returns its release (idempotent)."""
        if self.limit is not None and self.open[client] >= self.limit:
            raise ClientError(
                f"too many concurrent requests: this client has {self.open[client]} open, the limit is "
                f"{self.limit} per ingress replica (limits.max_concurrent_per_client)",
                status=429,
                kind="rate_limit_error",
                code="too_many_concurrent_requests",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.open[client] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open[client] -= 1
                if self.open[client] <= 0:
                    del self.open[client]

        return release


def check_limits(
    limits: LimitsConfig,
    params: GenerateParams,
    prompt: str | list[int] | None = None,
    messages: list[ChatMessage] | None = None,
) -> None:
    """The configured caps a request must fit (ClientError naming the cap). The tokenized
    prompt length and the context window are the SmallModel's to check."""
    if params.max_tokens is not None and params.max_tokens > limits.max_tokens:
        raise ClientError(
            f"max_tokens {params.max_tokens} exceeds the limit of {limits.max_tokens} (limits.max_tokens)", "max_tokens"
        )
    stop = params.stop or []
    if len(stop) > limits.max_stop:
        raise ClientError(f"{len(stop)} stop strings; at most {limits.max_stop} (limits.max_stop)", "stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise ClientError(
            f"a stop string is longer than {limits.max_stop_chars} characters (limits.max_stop_chars)", "stop"
        )
    if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
        raise ClientError(
            f"the prompt has {len(prompt)} characters; the limit is {limits.max_prompt_chars} "
            "(limits.max_prompt_chars)",
            "prompt",
        )
    if isinstance(prompt, list) and limits.max_prompt_tokens is not None and len(prompt) > limits.max_prompt_tokens:
        raise ClientError(
            f"the prompt has {len(prompt)} tokens; the limit is {limits.max_prompt_tokens} (limits.max_prompt_tokens)",
            "prompt",
        )
    chars = sum(len(m.content) for m in messages or [])
    if chars > limits.max_prompt_chars:
        raise ClientError(
            f"the messages have {chars} characters; the limit is {limits.max_prompt_chars} (limits.max_prompt_chars)",
            "messages",
        )


@dataclass(frozen=True)
class Edge:
    """One Ingress replica's rules."""

    access: Access
    limits: LimitsConfig
    slots: ClientSlots

    @classmethod
    def from_config(
        cls, access: AccessConfig, limits: LimitsConfig, admission: AdmissionConfig | None = None
    ) -> "Edge":
        keys = Access(access)
        limit = limits.per_client(keys.enabled, admission or AdmissionConfig())  # `auto`: on with API keys only
        return cls(keys, limits, ClientSlots(limit, limits.retry_after_s))


def body_too_large(limit: int) -> ClientError:
    return ClientError(
        f"the request body exceeds {limit} bytes (limits.max_body_bytes)", status=413, code="request_too_large"
    )


class EdgeGate:
    """ASGI middleware in front of the HTTP routes: the API key (401) before anything of the
    request is read, then the body size: a declared Content-Length over max_body_bytes is
    refused unread, a body that grows past it while streaming is cut by Starlette's body
    limit (413 either way). The client id goes to `request.state.client`. `edge` returns
    the replica's Edge (the FastAPI app is built before any replica is)."""

    OPEN_PATHS = ("/health",)
    PAGE_PATH = "/playground"  # the playground's static files: code, no data (the page asks for the key)

    def __init__(self, app: ASGIApp, edge: Callable[[], Edge]) -> None:
        self.app, self.edge = app, edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        edge = self.edge()
        path = (
            scope["path"][len(scope.get("root_path", "")) :]
            if scope["path"].startswith(scope.get("root_path", ""))
            else scope["path"]
        )
        headers = Headers(scope=scope)
        try:
            if (
                (edge.access.health_open and path in self.OPEN_PATHS)
                or path == self.PAGE_PATH
                or path.startswith(self.PAGE_PATH + "/")
            ):
                client = f"peer:{peer_host(scope.get('client'))}"
            else:
                client = edge.access.client(headers.get("authorization"), scope.get("client"))
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > edge.limits.max_body_bytes:
                # Starlette's limiter would answer this one itself, in plain text
                raise body_too_large(edge.limits.max_body_bytes)
        except ClientError as exc:
            await JSONResponse(exc.body(), exc.status, headers=exc.headers)(scope, receive, send)
            return
        scope.setdefault("state", {})["client"] = client
        await RequestBodyLimitMiddleware(self.app, edge.limits.max_body_bytes)(scope, receive, send)
