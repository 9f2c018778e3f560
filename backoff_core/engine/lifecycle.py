"""A request's way through BackoffEngine: admitted (checked, its prompt prefilled or planned
a chunk a step, chunked.py), stepped by the step loop (engine.py) until its last token is
committed, then collected (`finish`), or cancelled at any point; `generate`, `generate_many`
and `stream` drive the steps for callers that own no loop."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import backoff_core.engine.chunked as chunked
from backoff_core.engine.admission import checked
from backoff_core.engine.flight import on_loop_stream
from backoff_core.engine.prompt import admission_runs_large, prefill
from backoff_core.engine.state import Live
from backoff_core.routing.routers import DecisionFunction
from backoff_core.types import FinishReason, GenerationRequest, GenerationResult, TokenEvent


class RequestLifecycle:
    """BackoffEngine's requests, from admission to result (the attributes used here are the
    engine's)."""

    def submit(self, request: GenerationRequest, router: DecisionFunction | None = None) -> str:
        """Admit a request (M_S prompt prefill now, or a chunk per step); returns its id. Raises ValueError on bad input."""
        return self.submit_many([request], [router])[0]

    @on_loop_stream
    def submit_many(
        self, requests: Sequence[GenerationRequest], routers: Sequence[DecisionFunction | None] | None = None
    ) -> list[str]:
        """Admit requests together: every prompt prefill (and prompt scoring) batched
        (prompt.py); their ids, in order. All or none: a bad request raises ValueError (and a
        model's error is raised) before any of them is admitted. A prompt longer than a
        prefill chunk only opens its sessions here: the steps feed it, or score its rows, a
        chunk at a time (chunked.py)."""
        routers = routers or [None] * len(requests)
        lives = [self._admit(request, router) for request, router in zip(requests, routers, strict=True)]
        if len({r.request_id for r in lives}) != len(lives):
            raise ValueError("request ids must be distinct")
        chunk = self.prefill_chunk_tokens
        later = {r.request_id for r in lives if chunked.in_chunks(r, chunk) or chunked.scores_in_chunks(r, chunk)}
        if self.flights is not None and any(admission_runs_large(r) for r in lives):
            self.flights.settle()  # M_L runs in this thread now (flight.py)
        prefill(self.models, [r for r in lives if r.request_id not in later], self.token_texts, self.prompt_text)
        try:
            for r in lives:
                if r.request_id in later and chunked.scores_in_chunks(r, chunk):
                    chunked.open_scoring(self.models, r, self.token_texts, self.prompt_text)
                elif r.request_id in later:
                    chunked.plan_prompt(self.models, r)
        except Exception:
            for r in lives:
                self._close_sessions(r)
            raise
        for r in lives:
            if r.request.sampling.max_tokens == 0 and r.scoring is None:  # the prompt scored, nothing to generate
                r.finished = FinishReason.LENGTH
            self._live[r.request_id] = r
        return [r.request_id for r in lives]

    def _admit(self, request: GenerationRequest, router: DecisionFunction | None) -> Live:
        """A request's record, checked (ValueError on bad input); no session is opened yet."""
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already live")
        vocab = self.models[0].vocab_size
        return checked(
            request,
            request_id,
            router or self.routers(request),
            self.num_levels,
            self.context_window,
            vocab,
            self.eos_ids,
        )

    @on_loop_stream
    def cancel(self, request_id: str) -> None:
        if self.flights is not None and self.flights.cancel(request_id):
            return  # its sessions are closed when its catch-up lands
        live = self._live.pop(request_id, None)
        if live is not None:
            self._close_sessions(live)

    def _close_sessions(self, live: Live) -> None:
        for model in self.models:
            try:
                model.close(live.request_id)
            except Exception:  # a lost remote session is already gone
                pass

    def has_work(self) -> bool:
        return any(not r.done for r in self._live.values()) or (self.flights is not None and self.flights.busy)

    def live_ids(self) -> list[str]:
        return list(self._live) + (self.flights.ids() if self.flights is not None else [])

    def _done(self, request_id: str) -> bool:
        """Whether request_id's last token is committed (in flight: not yet)."""
        if self.flights is not None and request_id in self.flights:
            return False
        return self._live[request_id].done

    def finished_ids(self) -> list[str]:
        """Requests whose last token is committed (or that failed); `finish(rid)` collects each."""
        return [request_id for request_id, live in self._live.items() if live.done]

    @on_loop_stream
    def finish(self, request_id: str) -> GenerationResult:
        """The result of a finished (or cancelled mid-way) request; frees its sessions.
        Raises the error that ended a failed request: LargeUnavailable (on_large_failure =
        "fail") or what handling this one request raised (isolation.py)."""
        live = self._live.pop(request_id)
        self._close_sessions(live)
        if live.failure is not None:
            raise live.failure
        return live.result(self.detok.full_text(live))

    # -- conveniences ---------------------------------------------------------------------
    def generate(self, request: GenerationRequest, router: DecisionFunction | None = None) -> GenerationResult:
        return self.generate_many([request], routers=[router])[0]

    def generate_many(
        self, requests: Sequence[GenerationRequest], routers: Sequence[DecisionFunction | None] | None = None
    ) -> list[GenerationResult]:
        """Run requests together (batched steps); results in request order."""
        rids = self.submit_many(requests, routers)
        try:
            while not all(map(self._done, rids)):
                self.step()
            return [self.finish(request_id) for request_id in rids]
        except BaseException:
            for request_id in rids:
                self.cancel(request_id)
            raise

    def stream(self, request: GenerationRequest, router: DecisionFunction | None = None) -> Iterator[TokenEvent]:
        """Yields each committed token (with its source); the caller may stop early."""
        request_id = self.submit(request, router)
        try:
            while not self._done(request_id):
                event = self.step().get(request_id)
                if event is not None:
                    yield event
            if self._live[request_id].failure is not None:
                self.finish(request_id)  # raises its error
        finally:
            self.cancel(request_id)
