"""Configuration of the Serve application: pydantic models, a description on every field.

`AppArgs` are the builder's `args` in the Serve config YAML (changing them redeploys the
replicas). `RoutingConfig` is the SmallModel's `user_config` and `CatchUpConfig` the
LargeModel's: `serve deploy` of an edited config applies them live through
`reconfigure()`, replicas untouched. What the edge lets in (access, limits, admission) is
edge_config.py's. No Ray and no torch in this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from backoff_core.types import parse_thresholds
from clients.wire.types import Thresholds, refuse_both_spellings
from deployments.serving.edge_config import AccessConfig, AdmissionConfig, LimitsConfig
from deployments.serving.models_config import FrozenConfig as _Config
from deployments.serving.models_config import ModelsConfig


class RoutingConfig(_Config):
    """The live knob (SmallModel user_config). A request's own fields override it."""

    router: str = Field("entropy", description="decision function used when a request names none")
    thresholds: Thresholds | None = Field(
        None,
        validation_alias=AliasChoices("thresholds", "threshold"),
        description="thresholds, as a request's: a number, or a list with one per boundary between models, "
        "ascending, each in [-1e38, 1e38]; none = the router's default. `threshold`, the deprecated "
        "spelling, is still accepted (not both)",
    )
    target_backoff: float | None = Field(
        None, ge=0.0, le=1.0, description="ask for this backoff rate instead of a fixed threshold"
    )
    rate: float | None = Field(None, ge=0.0, le=1.0, description="backoff rate of the random router")
    large_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="a catch-up with no reply within this long (M_L slow, or no replica left) "
        "counts as a failure of the larger model (the wait includes its queue)",
    )
    on_large_failure: Literal["degrade", "fail"] = Field(
        "degrade",
        description="after such a failure: degrade = the request goes on with M_S alone and its "
        "usage says degraded; fail = it ends with an error (HTTP 503 / gRPC UNAVAILABLE)",
    )
    inject_fault_seed: int | None = Field(
        None,
        description="chaos / testing knob: a request with this seed fails inside the step loop (its M_S "
        "forwards raise from its third step on), beside the requests it shares steps with "
        "(deployments/serving/chaos.py); none in production",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_thresholds_spelling(cls, data):
        return refuse_both_spellings(data, "thresholds", "threshold")

    @field_validator("thresholds")
    @classmethod
    def _ascending(cls, value: list[float] | None) -> list[float] | None:
        return None if value is None else list(parse_thresholds(value))  # refused at load, not at each request


class CatchUpConfig(_Config):
    """How a LargeModel replica turns concurrent catch-up calls into forwards (its user_config)."""

    batching: bool = Field(
        True,
        description="merge concurrent catch-ups of many sessions into one forward; "
        "false runs one forward per call (the benchmark's baseline)",
    )
    max_batch_size: int = Field(64, ge=1, description="sessions in one forward at most")
    batch_wait_ms: float = Field(
        20.0,
        ge=0.0,
        description="how long a forward may wait for the rest of a router step's calls once the first has arrived",
    )
    batch_gap_ms: float = Field(
        5.0,
        ge=0.0,
        description="stop waiting when no call of the step arrived for this long (the rest went to other replicas)",
    )
    session_ttl_s: float = Field(600.0, gt=0.0, description="sessions idle this long are freed")
    lease_s: float = Field(
        30.0,
        gt=0.0,
        description="a SmallModel replica renews the lease on its sessions every lease_s / 3; "
        "the sessions of one that stopped renewing (it died) are freed after lease_s",
    )
    inject_delay_ms: float = Field(
        0.0,
        ge=0.0,
        description="chaos / testing knob: every catch-up call waits this long before it is served "
        "(a slow M_L); 0 in production",
    )


class ReplicaConfig(_Config):
    """Scaling and placement of one deployment."""

    num_replicas: int | None = Field(None, ge=1, description="fixed replica count (none: autoscale)")
    min_replicas: int = Field(1, ge=0, description="autoscaling lower bound")
    max_replicas: int = Field(2, ge=1, description="autoscaling upper bound")
    target_ongoing_requests: float = Field(8.0, gt=0, description="autoscaling target per replica")
    max_ongoing_requests: int = Field(256, ge=1, description="requests a replica accepts at once")
    max_queued_requests: int | None = Field(
        None,
        ge=1,
        description="requests that may wait in each caller for a replica below max_ongoing_requests "
        "(Serve's max_queued_requests); more are refused: HTTP 503 + Retry-After, gRPC "
        "RESOURCE_EXHAUSTED. none = unbounded, right for LargeModel: its callers are "
        "requests already admitted, at most one catch-up each in flight",
    )
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs reserved per replica")
    gpus: Literal["auto", "none"] | float = Field(
        "auto",
        description="GPUs per replica: auto = 1 on its own node type (custom_resource), else a share "
        "of the cluster's GPUs (one per model deployment if enough), 0 without GPUs; "
        "none = 0; or a number",
    )
    custom_resource: str | None = Field(
        None, description="cluster.yaml resource the replica needs where the cluster has it (small_gpu / large_gpu)"
    )


class StreamConfig(_Config):
    """How a SmallModel replica sends its streams' tokens to the Ingress. Each message costs
    the path (Ray's stream, the Ingress, the proxy) about as much whatever it carries, so a
    replica spends a budget of messages: a stream's next message waits until live streams /
    max_messages_per_s has passed since its last one, and the tokens committed meanwhile ride
    together. A stream's first token goes at once (and one stream alone may send every 4 ms),
    and so do its last tokens with the result: the wait ends when the request does."""

    # a message costs ~3 ms of CPU across Ray, the Ingress, the proxy and the client on a loaded
    # 2-core box (benchmarks/serve_overhead.py): 250 a second are most of a core
    max_messages_per_s: float = Field(
        250.0,
        gt=0.0,
        description="token messages per second one replica sends "
        "across all its streams (more: less latency, "
        "more CPU per token)",
    )
    max_delay_ms: float = Field(100.0, ge=0.0, description="the longest a committed token waits to be sent")


class PrefixRoutingConfig(_Config):
    """How callers (the Ingress) pick a SmallModel replica for a request (deployments/prefix_routing.py)."""

    enabled: bool = Field(
        True,
        description="send a request to the SmallModel replica that already served the longest prefix of its "
        "prompt (its prefix cache may hold it); false: Serve's power of two choices",
    )
    max_imbalance: int = Field(
        8,
        ge=0,
        description="prefix affinity holds while the busiest replica has at most this many more ongoing "
        "requests than the least busy one; above, power of two choices (a hot prefix spills over)",
    )
    min_match: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="a match shorter than this share of the prompt counts as none: the request goes to "
        "the replica that holds the fewest prompt characters",
    )
    key_chars: int = Field(
        2048, ge=16, description="characters of a prompt's key the callers remember (its head: where prefixes are)"
    )
    tree_chars: int = Field(
        400_000,
        ge=1000,
        description="prompt characters the shared prefix tree keeps per replica; beyond, the least recently "
        "used are evicted (checked every 10 s)",
    )


class AppArgs(_Config):
    """The application builder's arguments (`args:` in the Serve config YAML)."""

    models: ModelsConfig = Field(default_factory=ModelsConfig, description="which models form the chain")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="initial SmallModel user_config")
    catch_up: CatchUpConfig = Field(default_factory=CatchUpConfig, description="initial LargeModel user_config")
    small: ReplicaConfig = Field(
        default_factory=lambda: ReplicaConfig(
            custom_resource="small_gpu", max_ongoing_requests=256, max_queued_requests=32
        ),
        description="SmallModel replicas (M_S + decision function + step loop)",
    )
    large: ReplicaConfig = Field(
        default_factory=lambda: ReplicaConfig(custom_resource="large_gpu"),
        description="LargeModel replicas (M_L); medium models use the same settings",
    )
    ingress: ReplicaConfig = Field(
        default_factory=lambda: ReplicaConfig(
            num_cpus=0.25,
            gpus="none",
            max_replicas=4,
            target_ongoing_requests=32,
            max_ongoing_requests=512,
            max_queued_requests=256,
        ),
        description="Ingress replicas (HTTP + gRPC, no GPU)",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="per SmallModel replica: live and waiting requests at most"
    )
    stream: StreamConfig = Field(
        default_factory=StreamConfig, description="per SmallModel replica: how tokens are coalesced into messages"
    )
    default_max_tokens: int = Field(64, ge=1, description="max_tokens of a request that sets none")
    prefill_chunk_tokens: int = Field(
        128,
        ge=0,
        description="chunked prefill (docs/chunked-prefill.md): positions each model prefills per step at most; "
        "a longer prompt, and M_L's longer first catch-up, load over several steps between the live "
        "streams' tokens (smaller: steadier inter-token latency, later first token for the new request). "
        "0: off (a prompt is prefilled whole at admission)",
    )
    catch_up_wait_ms: float = Field(
        40.0,
        ge=0,
        allow_inf_nan=False,
        description="batched catch-ups (docs/batched-catch-ups.md): how long a request routed to the "
        "large model may wait, while the other streams step, for its catch-up to share one forward "
        "with others' (never past one step where a step takes longer, nor while it is half the live "
        "requests or more); more throughput under load, the same tokens. 0: every catch-up runs in "
        "the step that routes it",
    )
    overlap_catch_ups: bool = Field(
        False,
        description="catch-ups in flight (docs/batched-catch-ups.md): the large model's batched "
        "catch-up runs on a worker thread beside the small model's next steps, its requests "
        "committing when it lands; the same tokens. Pays where M_L has a GPU of its own; best "
        "with catch_up_wait_ms 0 (the flight itself batches the next catch-up)",
    )
    launch_ahead: Literal["auto"] | bool = Field(
        "auto",
        description="M_S's next step queued on the GPU before its tokens are read back, so the host's "
        "work between steps runs while the GPU does (docs/gpu.md); the same tokens. auto: where M_S "
        "is on static KV on CUDA and overlap_catch_ups is off (measured on an H200: +4-7% tok/s at "
        "64 streams); true: wherever M_S is on static KV (elsewhere it stays off, with a warning; "
        "not with overlap_catch_ups); false: never",
    )
    torch_threads: int | None = Field(None, ge=1, description="torch threads per model replica (none: Ray's default)")
    handle_transport: Literal["grpc", "actor"] = Field(
        "grpc",
        description="how the per-step calls between deployments travel (catch-ups to LargeModel, token "
        "streams from SmallModel): 'grpc', Serve's direct replica-to-replica gRPC "
        "(`_by_reference=False`, pickled; about 1 ms less per call), or 'actor', Ray actor calls",
    )
    max_message_bytes: int = Field(
        256 << 20,
        ge=4 << 20,
        le=(2 << 30) - 1,
        description="the largest message Serve's gRPC channels between this app's replicas accept "
        "(RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH in every replica's runtime_env; Serve's default, 4 MiB, "
        "failed answers within the documented limits: n=32 x 100 tokens x top_logprobs 20 is 4.95 MB, a "
        "scored 8,000-token prompt's result 4.4 MB). The proxy reads the same variable from its node's "
        "environment (serve_cli.SERVE_PATH_ENV, cluster.yaml): keep both at least 2 x limits.max_answer_bytes",
    )
    engine_factory: str | None = Field(
        None,
        description="'module:callable' that builds the SmallModel's engine instead of BackoffEngine (same "
        "arguments); benchmarks of the serving path alone inject a stand-in through it "
        "(benchmarks/standin.py). None: the BackoffEngine",
    )
    access: AccessConfig = Field(default_factory=AccessConfig, description="API keys (none: open)")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="request size and per-client limits")
    prefix_routing: PrefixRoutingConfig = Field(
        default_factory=PrefixRoutingConfig, description="which SmallModel replica a request goes to"
    )

    @model_validator(mode="after")
    def _admission_below_serve_limit(self) -> "AppArgs":
        # a refusal must reach the replica to be sent, and info() / health calls need a slot
        carried = self.admission.max_live_requests + self.admission.waiting_bound()
        if carried >= self.small.max_ongoing_requests:
            raise ValueError(
                f"admission.max_live_requests + max_waiting_requests ({carried}) must stay below "
                f"small.max_ongoing_requests ({self.small.max_ongoing_requests})"
            )
        return self

    @model_validator(mode="after")
    def _answers_fit_messages(self) -> "AppArgs":
        # a result is pickled (larger than its JSON) and the unary body is one message
        if 2 * self.limits.max_answer_bytes > self.max_message_bytes:
            raise ValueError(
                f"limits.max_answer_bytes ({self.limits.max_answer_bytes}) must be at most half of "
                f"max_message_bytes ({self.max_message_bytes})"
            )
        return self

    @model_validator(mode="after")
    def _one_overlap(self) -> "AppArgs":
        if self.launch_ahead is True and self.overlap_catch_ups:
            raise ValueError("launch_ahead and overlap_catch_ups do not go together: choose one")
        return self

    @model_validator(mode="after")
    def _default_within_cap(self) -> "AppArgs":
        if self.default_max_tokens > self.limits.max_tokens:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} exceeds limits.max_tokens {self.limits.max_tokens}"
            )
        return self


def handle_options(transport: str) -> dict:
    """DeploymentHandle.options for `AppArgs.handle_transport`."""
    if transport == "grpc":
        return {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}
    return {}
