"""/v1/completions beyond one plain prompt: batches (one choice per prompt, `index` in order)
and echo (the prompt before the completion, with its routed teacher-forced logprobs).

A batch is one request per prompt, opened together, so the SmallModel's step loop batches
them as it batches any concurrent requests; their items are merged here as they come
(`tagged`). Ray-free: the Ingress hands in the admitted streams. No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from backoff_core.types import GenerationResult, TokenEvent, TokenLogprobs
from clients.wire import backoff_pb2 as pb
from clients.wire.logprobs import CompletionLogprobs
from clients.wire.openai import (
    BackoffTrace,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionResponse,
    PromptTrace,
)
from deployments.serving.access import ClientError
from deployments.serving.edge_config import LimitsConfig
from deployments.serving.formats import (
    PLAIN,
    ReplyShape,
    completion_logprobs,
    final_chunk_body,
    json_safe,
    pb_chunks,
    pb_echo_chunk,
    pb_final_chunk,
    summed_usage,
)
from deployments.serving.outcomes import Admitted
from deployments.serving.sse import TokenChunks, sse, usage_chunk


def check_choices(limits: LimitsConfig, prompts: int, n: int) -> None:
    """prompts x n requests within limits.max_batch_prompts (ClientError naming the field)."""
    if prompts * n <= limits.max_batch_prompts:
        return
    if n == 1:
        message = f"the batch has {prompts} prompts"
    else:
        message = f"{prompts} prompt{'s' if prompts > 1 else ''} x n={n} are {prompts * n} choices"
    raise ClientError(
        f"{message}; the limit is {limits.max_batch_prompts} (limits.max_batch_prompts)", "n" if n > 1 else "prompt"
    )


def check_batch(limits: LimitsConfig, prompts: Sequence[str | list[int]], n: int = 1) -> None:
    """A batch's own caps, its prompts counted n times each (ClientError naming the limit);
    each prompt also meets check_limits."""
    check_choices(limits, len(prompts), n)
    times = f" (x n={n})" if n > 1 else ""
    ids = n * sum(len(p) for p in prompts if isinstance(p, list))
    if ids > limits.max_batch_prompt_tokens:
        raise ClientError(
            f"the batch's prompts have {ids} tokens together{times}; the limit is {limits.max_batch_prompt_tokens} "
            "(limits.max_batch_prompt_tokens)",
            "prompt",
        )
    chars = n * sum(len(p) for p in prompts if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise ClientError(
            f"the batch's prompts have {chars} characters together{times}; the limit is {limits.max_prompt_chars} "
            "(limits.max_prompt_chars)",
            "prompt",
        )


async def tagged(streams: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) of every stream as its items come. One stream is read directly; several
    are each read by a task (closing this generator cancels them; the caller closes the streams)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the reader below
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Echo:
    """An echo request's prompt: its ids and text (the core's prompt_text when it scored the prompt)."""

    token_ids: tuple[int, ...]
    text: str

    @classmethod
    def of(cls, admitted: Admitted, result: GenerationResult | None = None) -> Echo | None:
        if admitted.prompt_ids is None:
            return None
        text = (result.prompt_text if result is not None else None) or admitted.prompt_text or ""
        return cls(admitted.prompt_ids, text)


def prompt_logprobs(
    entries: Sequence[TokenLogprobs | None], text: str, as_ids: bool = False, first_id: int | None = None
) -> CompletionLogprobs:
    """The prompt's entries in OpenAI's completions shape; the first token has no logprob
    (null, as OpenAI and vLLM), and its text is the prompt up to the second token's (as_ids:
    'token_id:{first_id}', as every other token's)."""
    first_end = entries[1].text_offset if len(entries) > 1 and entries[1] is not None else len(text)
    scored = completion_logprobs(tuple(e for e in entries[1:] if e is not None), as_ids)
    assert scored is not None and len(scored.tokens) == len(entries) - 1, "only the first prompt entry is None"
    return CompletionLogprobs(
        tokens=[f"token_id:{first_id}" if as_ids and first_id is not None else text[:first_end], *scored.tokens],
        token_logprobs=[None, *scored.token_logprobs],
        top_logprobs=[None, *scored.top_logprobs],
        text_offset=[0, *scored.text_offset],
    )


def echoed_logprobs(result: GenerationResult, echo: Echo | None, as_ids: bool = False) -> CompletionLogprobs | None:
    """The choice's logprobs: with echo the prompt's first, then the generated tokens' (their
    offsets moved past the prompt's text)."""
    generated = completion_logprobs(result.logprobs, as_ids)
    if echo is None or result.prompt_logprobs is None:
        return generated
    prompt = prompt_logprobs(result.prompt_logprobs, echo.text, as_ids, echo.token_ids[0])
    if generated is None:
        return prompt
    return CompletionLogprobs(
        tokens=prompt.tokens + generated.tokens,
        token_logprobs=prompt.token_logprobs + generated.token_logprobs,
        top_logprobs=prompt.top_logprobs + generated.top_logprobs,
        text_offset=prompt.text_offset + [o + len(echo.text) for o in generated.text_offset],
    )


def _trace(result: GenerationResult, echo: Echo | None) -> BackoffTrace:
    return BackoffTrace(
        token_ids=list(result.token_ids),
        sources=list(result.sources),
        thresholds=list(result.thresholds),
        prompt_token_ids=None if echo is None else list(echo.token_ids),
        prompt_sources=None if echo is None or result.prompt_sources is None else list(result.prompt_sources),
    )


def completion_choice(
    index: int,
    result: GenerationResult,
    echo: Echo | None,
    shape: ReplyShape = PLAIN,
    prompt_ids: Sequence[int] | None = None,
) -> CompletionChoice:
    """prompt_ids: the prompt's (shape.token_ids)."""
    return CompletionChoice(
        index=index,
        text=(echo.text if echo is not None else "") + result.text,
        finish_reason=result.finish_reason.value,
        logprobs=echoed_logprobs(result, echo, shape.ids_as_tokens),
        token_ids=list(result.token_ids) if shape.token_ids else None,
        prompt_token_ids=list(prompt_ids) if shape.token_ids and prompt_ids is not None else None,
        backoff=_trace(result, echo),
    )


def completion_body(
    request_id: str,
    model: str,
    created: int,
    results: Sequence[tuple[GenerationResult, Echo | None]],
    shape: ReplyShape = PLAIN,
    prompt_ids: Sequence[Sequence[int] | None] = (),
) -> dict:
    """The unary body of one prompt or a batch: choice i is prompt i's; usage sums them.
    prompt_ids: each choice's prompt (shape.token_ids)."""
    ids = list(prompt_ids) or [None] * len(results)
    choices = [completion_choice(i, r, e, shape, p) for i, ((r, e), p) in enumerate(zip(results, ids))]
    usage = summed_usage([r for r, _ in results])
    body = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
    return json_safe(body.model_dump())


class CompletionStream:
    """The SSE text of a streamed completion of one prompt or a batch. Each choice's chunks
    carry its `index`; an echo choice starts with one chunk of the prompt's text (with its
    logprobs and sources when asked: those come with the result, so that choice's tokens are
    held until then). Each choice's last chunk has its finish_reason; with
    stream_options.include_usage one more chunk ends the stream, with no choice and the usage
    (summed over a batch), as OpenAI's. echo: the requests echo their prompts (None: those
    whose Admitted carries the prompt's ids); shape.token_ids: a choice's first chunk carries
    the prompt's ids."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        admitted: Sequence[Admitted],
        prompt_logprobs: bool,
        echo: bool | None = None,
        shape: ReplyShape = PLAIN,
    ) -> None:
        self.request_id, self.model, self.created, self.shape = request_id, model, created, shape
        self.admitted = list(admitted)
        self.echo = [a.prompt_ids is not None and echo is not False for a in self.admitted]
        self.chunks = [
            TokenChunks(
                request_id, model, created, False, i, shape, None if self.echo[i] else a.prompt_ids
            )  # an echo's ids ride on its echo chunk
            for i, a in enumerate(self.admitted)
        ]
        self.hold = [e and prompt_logprobs for e in self.echo]
        self.held: list[list[TokenEvent]] = [[] for _ in self.admitted]
        self.results: list[GenerationResult | None] = [None] * len(self.admitted)

    def _echo_chunk(self, i: int, result: GenerationResult | None) -> str:
        echo = Echo.of(self.admitted[i], result)
        assert echo is not None
        sources = None if result is None or result.prompt_sources is None else list(result.prompt_sources)
        logprobs = None
        if result is not None and result.prompt_logprobs is not None:
            logprobs = prompt_logprobs(result.prompt_logprobs, echo.text, self.shape.ids_as_tokens, echo.token_ids[0])
        choice = CompletionChunkChoice(
            index=i,
            text=echo.text,
            logprobs=logprobs,
            prompt_token_ids=list(echo.token_ids) if self.shape.token_ids else None,
            backoff=PromptTrace(prompt_token_ids=list(echo.token_ids), prompt_sources=sources),
        )
        chunk = CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice])
        return sse(json_safe(chunk.model_dump(exclude=self.shape.exclude)))

    def start(self) -> str:
        """The echo chunks that need no result (text alone), before any token."""
        return "".join(self._echo_chunk(i, None) for i, echo in enumerate(self.echo) if echo and not self.hold[i])

    def tokens(self, i: int, events: tuple[TokenEvent, ...]) -> str:
        if self.hold[i]:
            self.held[i].extend(events)
            return ""
        return self.chunks[i].sse(events)

    def finished(self, i: int, result: GenerationResult) -> str:
        self.results[i] = result
        out = ""
        if self.hold[i]:
            out = self._echo_chunk(i, result)
            if self.held[i]:
                out += self.chunks[i].sse(tuple(self.held[i]))
        return out + sse(final_chunk_body(self.request_id, self.model, self.created, result, False, choice=i))

    def end(self) -> str:
        if not self.shape.include_usage:
            return ""
        return usage_chunk(self.request_id, self.model, self.created, self.results, chat=False)


class PbStream:
    """A gRPC GenerateStream's messages: the router's tokens as they come, the final chunk;
    with echo the prompt's chunk first (with logprobs it waits for their scores, which come
    with the result, and the tokens wait behind it)."""

    def __init__(self, request_id: str, admitted: Admitted, prompt_logprobs: bool) -> None:
        self.request_id, self.admitted = request_id, admitted
        self.hold = admitted.prompt_ids is not None and prompt_logprobs
        self.held: list[TokenEvent] = []

    def start(self) -> list[pb.GenerateChunk]:
        if self.admitted.prompt_ids is None or self.hold:
            return []
        return [pb_echo_chunk(self.request_id, self.admitted, None)]

    def tokens(self, events: tuple[TokenEvent, ...]) -> list[pb.GenerateChunk]:
        if self.hold:
            self.held.extend(events)
            return []
        return [pb_chunks(self.request_id, events)]

    def finished(self, result: GenerationResult) -> list[pb.GenerateChunk]:
        out = []
        if self.hold:
            out.append(pb_echo_chunk(self.request_id, self.admitted, result))
            if self.held:
                out.append(pb_chunks(self.request_id, tuple(self.held)))
        return [*out, pb_final_chunk(self.request_id, result)]
