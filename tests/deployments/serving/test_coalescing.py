"""Coalesced token messages keep the bookkeeping of one token per message (no Ray).

A router message of several TokenEvents becomes one SSE write (still one `data:` event per
token) or one protobuf GenerateChunk with `tokens`; both must decode to exactly what one
message per token decodes to -- text, sources, indices, retractions, logprobs -- the
step loop hands a step's tokens over in one wake-up without reordering a stream, and a
stream held back by the message budget ends without waiting it out.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from backoff_core.types import FinishReason, GenerationResult, Logprob, Timings, TokenEvent, TokenLogprobs
from clients.wire import backoff_pb2 as pb
from clients.wire.openai import delta_from_chunk
from clients.wire.proto import delta_from_pb, deltas_from_pb
from deployments.serving.config import StreamConfig
from deployments.serving.engine_loop import Items, _deliver, _Sink
from deployments.serving.formats import chunk_body, pb_chunk, pb_chunks
from deployments.serving.sse import TokenChunks

RID, MODEL, CREATED = "cmpl-1", "backoff", 1700000000


def _logprobs(token: int) -> TokenLogprobs:
    chosen = Logprob(token, f"t{token}", f"t{token}".encode(), -0.25)
    return TokenLogprobs(chosen, (chosen, Logprob(9, "nine", b"nine", -float("inf"))), 3)


# a stream as a router sends it: the first token, a rollback, text split mid-character,
# logprobs on one token, a retraction that is not the batch's first event
EVENTS = (
    TokenEvent(11, 0, "Hel", 0),
    TokenEvent(12, 1, "lo", 1),
    TokenEvent(13, 0, "", 2),
    TokenEvent(14, 1, " wörld", 2, retracted=1, retracted_text=""),
    TokenEvent(15, 0, "!", 3, logprobs=_logprobs(15)),
    TokenEvent(16, 1, " ok", 3, retracted=1, retracted_text="!"),
    TokenEvent(17, 0, "\n", 4),
)


def _one_per_message(events, chat: bool) -> str:
    return "".join(f"data: {json.dumps(chunk_body(RID, MODEL, CREATED, e, chat), allow_nan=False)}\n\n" for e in events)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3, len(EVENTS)])
def test_sse_of_a_batch_is_one_chunk_per_token_as_before(chat, split):
    chunks = TokenChunks(RID, MODEL, CREATED, chat)
    batches = [EVENTS[i : i + split] for i in range(0, len(EVENTS), split)]
    text = "".join(chunks.sse(b) for b in batches)
    assert text == _one_per_message(EVENTS, chat)  # byte for byte, whatever the batching
    deltas = [delta_from_chunk(json.loads(line[6:])) for line in text.split("\n\n") if line]
    assert [(d.token_id, d.source, d.index, d.text, d.retracted, d.retracted_text) for d in deltas] == [
        (e.token_id, e.source, e.index, e.text, e.retracted, e.retracted_text) for e in EVENTS
    ]
    assert deltas[4].logprobs is not None and deltas[4].logprobs.logprob == -0.25


@pytest.mark.parametrize("chat", [False, True])
def test_sse_escapes_any_text_as_json_dumps_does(chat):
    texts = ['"quoted"', "back\\slash", "new\nline\ttab", "\x00\x1f", "日本語", "emoji 🙂", "</script>", ""]
    events = tuple(
        TokenEvent(20 + i, i % 3, t, i + 1, retracted=i % 2, retracted_text=t[::-1]) for i, t in enumerate(texts)
    )
    assert TokenChunks(RID, MODEL, CREATED, chat).sse(events) == _one_per_message(events, chat)


def test_a_batch_body_is_not_shared_between_tokens():
    chunks = TokenChunks(RID, MODEL, CREATED, chat=True)
    a, b = chunks.body(EVENTS[1]), chunks.body(EVENTS[2])
    assert a["choices"][0]["delta"]["content"] == "lo" and b["choices"][0]["delta"]["content"] == ""
    assert chunks.template["choices"][0]["backoff"]["token_id"] == 0  # the template itself unchanged


@pytest.mark.parametrize("split", [1, 2, len(EVENTS)])
def test_a_protobuf_chunk_of_several_tokens_decodes_like_one_per_message(split):
    one_each = [delta_from_pb(pb_chunk(RID, e)) for e in EVENTS]
    got = []
    for i in range(0, len(EVENTS), split):
        wire = pb_chunks(RID, EVENTS[i : i + split]).SerializeToString()
        msg = pb.GenerateChunk.FromString(wire)
        batch = EVENTS[i : i + split]
        assert len(msg.tokens) == (0 if len(batch) == 1 else len(batch))
        got += deltas_from_pb(msg)
    assert got == one_each  # ids, text, sources, indices, retractions, logprobs


def test_a_single_token_travels_as_a_plain_chunk():
    assert pb_chunks(RID, EVENTS[:1]) == pb_chunk(RID, EVENTS[0])  # what older clients read


def test_the_last_chunk_is_still_one_delta():
    last = pb.GenerateChunk(id=RID, finish_reason="length", usage=pb.Usage(completion_tokens=5))
    [delta] = deltas_from_pb(last)
    assert delta.finish_reason == "length" and delta.usage.completion_tokens == 5 and delta.token_id is None


class _Loop:
    """call_soon_threadsafe recorded; callbacks run on `run()` in order, like an event loop."""

    def __init__(self) -> None:
        self.calls = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        for fn, args in self.calls:
            fn(*args)


class _Queue(list):
    put_nowait = list.append


def test_a_step_wakes_each_event_loop_once_and_keeps_each_stream_in_order():
    loops = [_Loop(), _Loop()]
    sinks = [_Sink(loops[i % 2], _Queue(), True) for i in range(6)]
    for step in range(3):
        _deliver([(s, (step, k)) for k, s in enumerate(sinks)])
    sinks[0].put("result")  # a finished request's result comes after its tokens
    assert [len(loop.calls) for loop in loops] == [4, 3]  # one per step and loop (+ the result)
    for loop in loops:
        loop.run()
    assert sinks[0].queue == [(0, 0), (1, 0), (2, 0), "result"]
    assert all(s.queue[:3] == [(step, k) for step in range(3)] for k, s in enumerate(sinks))


def _result(n: int) -> GenerationResult:
    return GenerationResult(
        "r", "", tuple(range(n)), (0,) * n, 2, FinishReason.LENGTH, 3, (), 0, Timings(0, (), (), 0, 0)
    )


def test_a_stream_held_by_the_message_budget_is_sent_as_soon_as_it_ends():
    """A stream waiting out its message budget (here 16 s between messages) sends its last
    tokens and the result the moment the result is queued, not when the wait is over."""
    pytest.importorskip("ray")
    from deployments.small import SmallModel

    class Loop:
        def __init__(self) -> None:
            self.items = Items()

        def submit(self, request, tokens):
            return self.items

        def live(self) -> int:
            return 16

        def stop(self) -> None:  # SmallModel.__del__
            pass

    router = object.__new__(SmallModel.func_or_class)  # the stream alone: no models, no Ray
    router.loop = Loop()
    router.args = SimpleNamespace(stream=StreamConfig(max_messages_per_s=1.0, max_delay_ms=60_000))

    async def main():
        stream = router._stream(SimpleNamespace(request_id="r"), True)
        router.loop.items.put_nowait(EVENTS[0])
        first = await asyncio.wait_for(anext(stream), 1.0)  # the first token goes at once
        nxt = asyncio.ensure_future(anext(stream))
        router.loop.items.put_nowait(EVENTS[1])
        await asyncio.sleep(0.2)
        assert not nxt.done()  # held: the budget's wait has begun
        started = time.perf_counter()
        router.loop.items.put_nowait(EVENTS[2])
        router.loop.items.put_nowait(_result(3))
        batch = await asyncio.wait_for(nxt, 1.0)
        last = await asyncio.wait_for(anext(stream), 1.0)
        return first, batch, last, time.perf_counter() - started

    first, batch, last, waited = asyncio.run(main())
    assert first == EVENTS[0] and batch == EVENTS[1:3] and last == _result(3)
    assert waited < 0.5
