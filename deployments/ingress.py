"""Ingress deployment: OpenAI-compatible HTTP (FastAPI) and gRPC (Ray Serve's gRPC proxy;
the methods are ingress_grpc.py's GrpcMethods, a base of Ingress).

No model here. A request is validated at the edge (pydantic, then the configured limits
and API keys of `access.py`), sent to a SmallModel as a ServeRequest, and its stream of
items (Admitted, TokenEvent ..., GenerationResult) is turned into SSE chunks, one JSON
body, or protobuf messages. The first item decides the status: a Rejected request is a
400 / INVALID_ARGUMENT before anything is streamed, an Overloaded one (or Serve's
BackPressureError: a full queue) a 503 + Retry-After / RESOURCE_EXHAUSTED. Every client
mistake is a 4xx with an OpenAI-style error body, or INVALID_ARGUMENT / NOT_FOUND /
UNAUTHENTICATED / RESOURCE_EXHAUSTED on gRPC; 5xx / INTERNAL mean the server failed.

Failures after admission: a SmallModel replica that dies under a request (its stream
raises a Ray actor error) and a larger model that failed a request (on_large_failure =
fail) are "unavailable": HTTP 503 with an OpenAI error body for a unary request, an
in-band OpenAI error event then [DONE] for an SSE stream (its 200 is already sent), gRPC
UNAVAILABLE; other failures are 500 / INTERNAL. The client may retry either.
"""

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from backoff_core.engine.gc_heap import GCStats, GCWatch
from backoff_core.types import GenerationResult, TokenEvent
from clients.wire.openai import ModelCard, ModelList
from clients.wire.openai_requests import ChatCompletionRequest, CompletionRequest
from clients.wire.prompts import prompts_of
from clients.wire.types import GenerateParams
from deployments.http_errors import error_response, install_http_errors
from deployments.ingress_grpc import GrpcMethods
from deployments.serving.access import ClientError, Edge, EdgeGate, check_limits, peer_host
from deployments.serving.admission import Overloaded
from deployments.serving.completions import CompletionStream, Echo, check_batch, check_choices, completion_body, tagged
from deployments.serving.config import AppArgs, handle_options
from deployments.serving.exposition import scrape
from deployments.serving.formats import ReplyShape, chat_body, error_body, request_line
from deployments.serving.outcomes import Admitted, Failed, Rejected, internal_message
from deployments.serving.playground import mount_playground, routing_info
from deployments.serving.readiness import Readiness, missing
from deployments.serving.requests import ServeRequest, serve_request
from deployments.serving.sizes import check_answer
from deployments.serving.sse import ChatStream, sse
from deployments.streams import (
    OverloadedError,
    ServerFailure,
    collect_all,
    failure,
    guarded,
    holding,
    request_log,
    shared,
    token_events,
)

app = FastAPI(title="Backoff Serve", description="Backoff decoding: a small and a large LM, one live threshold.")
log = logging.getLogger(__name__)


def _replica_edge() -> Edge:
    # the app is built (and copied by @serve.ingress) before any replica exists; each
    # replica's Ingress holds its own Edge, found the way Serve finds `self` for a route
    return serve.get_replica_context().servable_object.edge


app.add_middleware(EdgeGate, edge=_replica_edge)


install_http_errors(app)  # outermost: an unhandled error is a 500 with the OpenAI body
mount_playground(app)  # GET /playground: the page (static files, no key needed to load it)


@dataclass(frozen=True)
class IngressInfo:
    pid: int
    replica: str
    open_by_client: dict[str, int]  # requests open per client id (key digest prefix or peer host)
    gc: GCStats | None = None  # the collector's pauses since start (Ray Serve's freeze included) and the heap frozen


@serve.deployment(max_ongoing_requests=512)
@serve.ingress(app)
class Ingress(GrpcMethods):
    def __init__(self, router: DeploymentHandle, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.edge = Edge.from_config(self.args.access, self.args.limits, self.args.admission)
        self.model_name = self.args.models.served_name
        self.router = router.options(stream=True, **handle_options(self.args.handle_transport))
        self.router_unary = router
        self._max_model_len: int | None = None  # _card's
        self.readiness = Readiness(self._deployments_up)  # 503 not_ready until the chain's replicas run
        self.gc = GCWatch.shared()  # Ray Serve freezes the startup heap once __init__ returns (gc_heap.py)

    def info(self) -> IngressInfo:
        return IngressInfo(
            pid=os.getpid(),
            replica=serve.get_replica_context().replica_id.unique_id,
            open_by_client=dict(self.edge.slots.open),
            gc=self.gc.stats(),
        )

    async def _deployments_up(self) -> str:
        """'' once every deployment of this app has a running replica (Serve's controller says)."""
        status = await asyncio.to_thread(serve.status)
        return missing(status.applications.get(serve.get_replica_context().app_name))

    async def _until_ready(self) -> None:
        """Refuse (503 + Retry-After, code not_ready) while the models load: a request sent
        then would wait in Serve's queues, silently, until their replicas ran."""
        if problem := await self.readiness.problem():
            retry = self.args.admission.retry_after_s
            raise OverloadedError(f"the server is starting ({problem}); retry shortly", retry, "not_ready")

    async def _chain_ok(self) -> str:
        """'' when a SmallModel answers within 5 s, else why not."""
        if problem := await self.readiness.problem():
            return problem
        try:
            await asyncio.wait_for(self.router_unary.info.remote(), 5.0)
            return ""
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return f"small router unavailable: {type(exc).__name__}"

    # -- HTTP -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        problem = await self._chain_ok()
        if problem:
            return error_response(503, problem, "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text: every model replica's series under their documented names (exposition.py)."""
        body, content_type = await scrape(self.router_unary)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(self) -> dict:
        await self._until_ready()
        return ModelList(data=[await self._card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict:
        if model_id != self.model_name:
            raise ClientError(f"the model {model_id!r} does not exist", "model", 404, "model_not_found")
        await self._until_ready()
        return (await self._card()).model_dump()

    async def _card(self) -> ModelCard:
        """The served model as OpenAI and vLLM list it (max_model_len: the SmallModel's context
        window, asked once)."""
        if self._max_model_len is None:
            try:
                self._max_model_len = (await self.router_unary.info.remote()).context_window
            except Exception:  # noqa: BLE001 - a card without it now, asked again next time
                log.warning("GET /v1/models: no SmallModel answered for max_model_len", exc_info=True)
        return ModelCard(id=self.model_name, root=self.args.models.root, max_model_len=self._max_model_len)

    @app.get("/v1/routing")
    async def routing(self) -> dict:
        """The chain's levels, the routers a request may name and the live routing config
        (what the playground's controls offer; an extension, not OpenAI's)."""
        await self._until_ready()
        policy = (await self.router_unary.info.remote()).policy
        return routing_info(self.args, self.model_name, policy).model_dump()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        prompts = prompts_of(body.prompt)  # one, or a batch: n choices each
        check_batch(self.edge.limits, prompts, body.n)
        return await self._http(body, request, chat=False, contents=[{"prompt": p} for p in prompts])

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        check_choices(self.edge.limits, 1, body.n)
        return await self._http(body, request, chat=True, contents=[{"messages": body.messages}])

    async def _http(self, body, request: Request, chat: bool, contents: list[dict]):
        if body.model and body.model != self.model_name:
            raise ClientError(
                f"model {body.model!r} is not served here; GET /v1/models lists {self.model_name!r}",
                "model",
                404,
                "model_not_found",
            )
        started = time.monotonic()
        params = body.generate_params()  # chat's (logprobs, top_logprobs) become one count
        shape = ReplyShape.of(body)  # include_usage, vLLM's return_token_ids / return_tokens_as_token_ids
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        client = getattr(request.state, "client", None) or f"peer:{peer_host(request.client)}"  # set by EdgeGate
        opened = await self._open(request_id, params, client, body.stream, contents, body.n, shape.token_ids)
        created = int(time.time())
        admitted = [a for a, _ in opened]
        if not body.stream:
            results = await collect_all([s for _, s in opened])
            request_log.info(request_line(request_id, results, time.monotonic() - started))
            if chat:
                return chat_body(request_id, self.model_name, created, results, shape, admitted[0].prompt_ids)
            echoes = [Echo.of(a, r) if params.echo else None for a, r in zip(admitted, results)]
            prompt_ids = [a.prompt_ids for a in admitted]
            return completion_body(request_id, self.model_name, created, list(zip(results, echoes)), shape, prompt_ids)
        if chat:
            out = ChatStream(request_id, self.model_name, created, body.n, shape, admitted[0].prompt_ids)
        else:
            echo_logprobs = params.echo and params.logprobs is not None
            out = CompletionStream(request_id, self.model_name, created, admitted, echo_logprobs, params.echo, shape)
        streams = [s for _, s in opened]
        return StreamingResponse(self._sse(streams, out, started), media_type="text/event-stream")

    async def _sse(
        self, streams: list[AsyncIterator], out: ChatStream | CompletionStream, started: float
    ) -> AsyncIterator[str]:
        """The SSE text of one stream or of a batch's (merged as their items come)."""
        merged = tagged(streams)
        try:
            if text := out.start():
                yield text
            async for i, item in merged:
                if isinstance(item, (TokenEvent, tuple)):
                    if text := out.tokens(i, token_events(item)):  # one write for the tokens of one router message
                        yield text
                elif isinstance(item, GenerationResult):
                    yield out.finished(i, item)
                elif isinstance(item, (Rejected, Failed)):
                    raise failure(item)
            if text := out.end():
                yield text
            request_log.info(request_line(out.request_id, out.results, time.monotonic() - started))
        except ServerFailure as exc:  # after admission (the 200 is out): report in-band, as OpenAI does
            yield sse(error_body(exc.message, "server_error", code=exc.code))
        except Exception:  # noqa: BLE001 - a bug here still ends the stream in the OpenAI shape
            log.exception("request %s: SSE stream failed", out.request_id)
            yield sse(error_body(internal_message(out.request_id), "server_error", code="internal_error"))
        finally:
            await merged.aclose()
            for stream in streams:  # closed early (a disconnect while a chunk was sent): cancels their requests
                await stream.aclose()
        yield "data: [DONE]\n\n"

    # -- both (GrpcMethods' too) -------------------------------------------------------------
    async def _open(
        self,
        request_id: str,
        params: GenerateParams,
        client: str,
        tokens: bool,
        contents: list[dict],
        choices: int = 1,
        prompt_ids: bool = False,
    ) -> list[tuple[Admitted, AsyncIterator]]:
        """Check the limits, take one of the client's slots and send one request per prompt and
        choice (`contents`: a batch's prompts; `choices`: n each, choice j seeded by
        requests.choice_seed; all at once) to the SmallModels; returns their streams once
        every one is admitted, in the order prompt i's choice j at i * n + j (OpenAI's
        `index`), else closes them and raises the first refusal. The slot is freed when the
        last stream ends or is closed. tokens=False (unary): no TokenEvents, only the result;
        prompt_ids: each Admitted carries its prompt's ids (return_token_ids), as with echo."""
        await self._until_ready()
        for content in contents:
            check_limits(self.edge.limits, params, **content)
        check_answer(self.edge.limits, params, contents, choices, self.args.default_max_tokens)
        each = [(c, j) for c in contents for j in range(choices)]
        ids = [request_id] if len(each) == 1 else [f"{request_id}-{i}" for i in range(len(each))]
        try:
            default = self.args.default_max_tokens
            requests = [
                serve_request(r, params, default_max_tokens=default, choice=j, prompt_ids=prompt_ids, **c)
                for r, (c, j) in zip(ids, each)
            ]
        except ValueError as exc:
            raise ClientError(str(exc)) from None
        release = self.edge.slots.take(client)
        tasks = [asyncio.ensure_future(self._admit(r, tokens)) for r in requests]
        try:
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # cancelled (the client went away) while waiting for admission
            release()
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    await task.result()[1].aclose()
            raise
        opened = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        if refused and len(contents) > 1 and isinstance(refused[0], ClientError):  # say which prompt
            i = next(i for i, o in enumerate(outcomes) if o is refused[0]) // choices
            refused[0] = ClientError(f"prompt {i}: {refused[0].message}", "prompt")
        if refused:
            release()
            for _, stream in opened:
                await stream.aclose()
            raise refused[0]
        release = shared(release, len(opened))
        return [(admitted, holding(stream, release)) for admitted, stream in opened]

    async def _admit(self, request: ServeRequest, tokens: bool) -> tuple[Admitted, AsyncIterator]:
        """One request sent to a SmallModel: (Admitted, its stream), or the refusal raised."""
        stream = guarded(self.router.generate.remote(request, tokens), request.request_id)
        try:
            first = await stream.__anext__()
        except BackPressureError as exc:  # Serve's queue for a SmallModel replica is full
            retry = self.args.admission.retry_after_s if exc.retry_after_s is None else exc.retry_after_s
            raise OverloadedError(exc.message, retry) from None
        if not isinstance(first, Admitted):
            await stream.aclose()
        if isinstance(first, Overloaded):  # the SmallModel replica's queue is full, or the wait ran out
            raise OverloadedError(first.message, first.retry_after_s, first.code)
        if isinstance(first, Rejected):
            raise ClientError(first.message)
        if isinstance(first, Failed):
            raise failure(first)
        assert isinstance(first, Admitted), first
        return first, stream
