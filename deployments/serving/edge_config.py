"""What the edge lets in, the three configs `access.Edge.from_config` reads (pydantic, a
description on every field): who may call (AccessConfig), what one request may ask for and
how many requests a client may have open (LimitsConfig), and how much work one SmallModel
replica takes on before it refuses (AdmissionConfig). Fields of `AppArgs` (config.py), so
changing them redeploys the replicas. No Ray and no torch in this module.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr

from deployments.serving.admission import queue_depth
from deployments.serving.models_config import FrozenConfig as _Config


class AccessConfig(_Config):
    """Who may call. Without keys the service is open to whoever reaches its ports."""

    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="accepted API keys (HTTP `Authorization: Bearer <key>`, gRPC metadata "
        "`authorization: Bearer <key>`); prefer api_keys_env: a Serve config's "
        "args are visible to whoever can read the cluster's config",
    )
    api_keys_env: str | None = Field(
        None,
        description="name of an environment variable of the Ingress replicas holding more keys, "
        "comma-separated; the replica refuses to start when it is not set",
    )
    health_open: bool = Field(
        True, description="GET /health and the gRPC Health method need no key (load balancers probe them)"
    )


class LimitsConfig(_Config):
    """What one request may ask for, and how many requests one client may have open. A client
    is its API key where keys are set, else its peer address."""

    max_body_bytes: int = Field(
        1 << 20,
        ge=1,
        description="HTTP request body size in bytes (413 above; on gRPC "
        "the encoded request size, INVALID_ARGUMENT above)",
    )
    max_prompt_chars: int = Field(
        100_000, ge=1, description="characters of a text prompt, or of all chat messages together"
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="prompt tokens (token ids sent, or the tokenized text, counted by the "
        "SmallModel); none: only the models' context window bounds the prompt",
    )
    max_tokens: int = Field(
        4096,
        ge=1,
        description="largest max_tokens a request may ask for (prompt + max_tokens must also fit the context window)",
    )
    max_batch_prompts: int = Field(
        32,
        ge=1,
        description="requests one call opens: the prompts of a /v1/completions batch (a list of strings or of "
        "token-id lists) times n, or a chat's n choices; each is a request in the step loop, so the default "
        "stays within one SmallModel replica's admission",
    )
    max_batch_prompt_tokens: int = Field(
        32_768,
        ge=1,
        description="token ids of all the prompts of one /v1/completions request together (a batch of text "
        "prompts is bounded by max_prompt_chars for all of them together)",
    )
    max_answer_bytes: int = Field(
        64 << 20,
        ge=1,
        description="an answer's size, estimated before any work from what the request asks (choices x "
        "max_tokens, and an echoed prompt, x a token's bytes with its top_logprobs; deployments/serving/sizes.py): "
        "a 400 naming the fields above it. The Ingress holds a unary answer whole, and every answer crosses "
        "Serve's channels as a few messages: this keeps them well under max_message_bytes",
    )
    max_stop: int = Field(4, ge=0, description="stop strings per request (OpenAI allows 4)")
    max_stop_chars: int = Field(64, ge=1, description="characters of one stop string")
    max_concurrent_per_client: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto",
        description="requests one client may have open at once, counted in each Ingress replica "
        "(429 / RESOURCE_EXHAUSTED above); auto = none without API keys (a client is then only its "
        "address: a load balancer or a load tool would be one client), with keys one SmallModel "
        "replica's live slots and queue (admission.max_live_requests + its queue bound); none: unlimited",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) sent with a 429")

    def per_client(self, keys: bool, admission: AdmissionConfig) -> int | None:
        """max_concurrent_per_client with `auto` resolved: off without API keys, else one
        SmallModel replica's live slots and queue (192 at the defaults)."""
        limit = self.max_concurrent_per_client
        if limit != "auto":
            return limit
        return admission.max_live_requests + admission.waiting_bound() if keys else None


class AdmissionConfig(_Config):
    """How much work one SmallModel replica takes on (deployments/serving/admission.py): live
    requests, then a bounded FIFO queue that waits for them; past the queue, or after
    queue_timeout_s in it, a request is refused (HTTP 503 + Retry-After, gRPC
    RESOURCE_EXHAUSTED), never queued without bound."""

    max_live_requests: int = Field(
        48,
        ge=1,
        description="requests in a replica's step loop at once (fewer where M_S's static KV holds fewer "
        "sessions: budget // kv_max_len); each is in every batched step, so more make every request slower",
    )
    max_waiting_requests: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="requests more that wait in the replica, first come first served, for a live one to "
        "finish; auto = 3 x the live slots (144 at the defaults)",
    )
    queue_timeout_s: float = Field(
        60.0,
        gt=0.0,
        allow_inf_nan=False,
        description="the longest a request waits in the queue; then 503 + Retry-After, code queue_timeout",
    )
    retry_after_s: float = Field(1.0, ge=0.0, description="Retry-After of a refused request (seconds, rounded up)")

    def waiting_bound(self) -> int:
        """The most waiters a replica may queue (`auto` with the live slots at max_live_requests)."""
        return queue_depth(self.max_waiting_requests, self.max_live_requests)
