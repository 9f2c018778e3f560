"""What the Ingress makes of a SmallModel's stream of items (Admitted, TokenEvent ...,
GenerationResult; or Rejected / Failed / Overloaded): the failures a client is told about,
a guard that turns a lost router into one of them and cancels an abandoned request, and
the two ways a stream is consumed (collected for a unary reply, or held open while it
holds one of the client's slots). REPLICA_LOST, what a call to a lost replica raises, serves
the SmallModel's calls to the LargeModels too.
"""

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentResponseGenerator

from backoff_core.types import GenerationResult, TokenEvent
from deployments.serving.outcomes import Failed, Rejected, internal_message

log = logging.getLogger(__name__)
# one INFO line per answered request (formats.request_line): under Serve's logger, so its
# handlers and the app's logging_config.log_level (`backoff serve --log-level`) apply
request_log = logging.getLogger("ray.serve.backoff.requests")


class ServerFailure(RuntimeError):
    """Serving failed; status 503 when a part of the chain is down or too slow."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


# what a handle call raises when the replica serving it is gone (died, or its node did):
# the Ingress's calls to a SmallModel and a SmallModel's to a LargeModel alike
REPLICA_LOST = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


KV_RETRY_AFTER_S = 1.0  # a KV refusal: room frees as soon as a request ends


def failure(item: Rejected | Failed) -> ServerFailure:
    if isinstance(item, Failed) and item.code == "kv_capacity":  # at capacity: 503 + Retry-After
        return OverloadedError(item.message, KV_RETRY_AFTER_S, item.code)
    if isinstance(item, Failed) and item.unavailable:
        return ServerFailure(item.message, 503, item.code)
    return ServerFailure(item.message)


async def guarded(stream: DeploymentResponseGenerator, request_id: str = "") -> AsyncIterator:
    """A SmallModel's stream. The router failing under it becomes a ServerFailure (its
    detail logged under `request_id`, never told to the client); a caller that stops early
    (disconnect, cancel) cancels the router's request here, not trusting Ray's recursive
    cancel from this replica (under load it misses some)."""
    ended = False
    try:
        async for item in stream:
            ended = isinstance(item, (GenerationResult, Rejected, Failed))
            yield item
    except BackPressureError:  # not admitted: the caller answers 503 + Retry-After
        ended = True
        raise
    except REPLICA_LOST as exc:
        ended = True
        raise ServerFailure(
            f"the small router serving this request was lost ({type(exc).__name__}); retry the request",
            503,
            "router_unavailable",
        ) from exc
    except Exception as exc:  # noqa: BLE001 - reported to the client, not a broken connection
        ended = True
        log.error("request %s: the small router's stream failed", request_id or "?", exc_info=exc)
        raise ServerFailure(internal_message(request_id), code="internal_error") from exc
    finally:
        if not ended:
            stream.cancel()


class OverloadedError(ServerFailure):
    """The chain is at capacity: refused before admission, the client may retry."""

    def __init__(self, message: str, retry_after_s: float, code: str = "overloaded") -> None:
        super().__init__(message, 503, code)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:  # RFC 9110 delay-seconds: an integer, rounded up
        return str(max(0, math.ceil(self.retry_after_s)))

    def __reduce__(self):  # the gRPC path pickles it to the proxy: keep both arguments
        return type(self), (str(self), self.retry_after_s, self.code)


def token_events(item: TokenEvent | tuple[TokenEvent, ...]) -> tuple[TokenEvent, ...]:
    """The tokens of one message of a stream: one TokenEvent, or several coalesced in a tuple."""
    return item if isinstance(item, tuple) else (item,)


async def collect(stream: AsyncIterator) -> GenerationResult:
    try:
        async for item in stream:
            if isinstance(item, GenerationResult):
                return item
            if isinstance(item, (Rejected, Failed)):
                raise failure(item)
        raise ServerFailure("the stream ended without a result")
    finally:
        await stream.aclose()


async def holding(stream: AsyncIterator, release: Callable[[], None]) -> AsyncIterator:
    """The router's stream, holding the client's slot until it ends or is closed."""
    try:
        async with aclosing(stream):
            async for item in stream:
                yield item
    finally:
        release()


async def collect_all(streams: list[AsyncIterator]) -> list[GenerationResult]:
    """Every stream's result, in order; the first failure cancels the others (closing them)."""
    if len(streams) == 1:
        return [await collect(streams[0])]
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def shared(release: Callable[[], None], holders: int) -> Callable[[], None]:
    """`release` called once `holders` holders have each called theirs once (a batch's
    streams share the client's one slot). Each holder calls at most once (holding does)."""
    left = holders

    def one() -> None:
        nonlocal left
        left -= 1
        if left == 0:
            release()

    return one
