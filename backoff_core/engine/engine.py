"""The backoff decoding step loop, for many requests at once.

One `step()` advances every live request by one committed token (or one rollback):
  1. levels known before M_S runs (speculative verify steps, always-large) skip M_S
  2. M_S forward for the others, batched: next-token logits (+ hidden state for the router)
  3. oracle routers: the largest model catches up first, to know KL(M_L||M_S)
  4. decide (propose.py): every stepped request's M_S token is drawn and the routers score,
     on the device, then ONE host copy reads both; score -> level on the host (thresholds
     read once per step)
  5. catch-up per level, batched over requests: ONE forward over each request's pending
     tokens and one host copy; verification may roll back; the step's token comes from
     that level. A plain routed request may wait a few ms, not stepping, for its
     catch-up to share a forward with others' (`catch_up_wait_ms`, hold.py), and, with
     `overlap_catch_ups`, that forward may run beside M_S's next steps (flight.py)
  6. commit: append, stream, stop (commit.py; one copy for the logprobs asked for)
With `launch_ahead` (ahead.py), stage 4 also queues the next step's M_S forward on the drawn
tokens before the host waits for them, and stage 2 takes its rows where they hold good.
Each mode is a step function of its own over the same stages (`_step_plain`, `_step_in_flight`,
`_step_ahead`), bound when its setting changes (settings.py), as vLLM binds its step_fn.
Every device-to-host read goes through host.py (to_host; start_read and its wait): once per stage.
A request's admission, cancellation and result are lifecycle.py's.
A request whose larger model could not answer (catchup.py) is `degraded`: from then on it
is routed nowhere but M_S, and a step whose catch-up failed takes M_S's token instead.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import backoff_core.engine.chunked as chunked
from backoff_core.engine.admission import Routers
from backoff_core.engine.ahead import LaunchAhead
from backoff_core.engine.backends import Backend
from backoff_core.engine.catchup import CatchUpper
from backoff_core.engine.commit import CommitContext, commit_many, settle_many
from backoff_core.engine.flight import Flights, Launcher, on_loop_stream
from backoff_core.engine.hold import CatchUpHold
from backoff_core.engine.lifecycle import RequestLifecycle
from backoff_core.engine.logprobs import TokenTexts
from backoff_core.engine.prompt import admission_runs_large
from backoff_core.engine.propose import (
    Decided,
    Launch,
    Opened,
    SmallOut,
    decide,
    forced_levels,
    propose,
    small_for_degraded,
    small_step,
)
from backoff_core.engine.settings import LiveSettings
from backoff_core.engine.state import Detokenizer, Live
from backoff_core.runners.factory import make_runner
from backoff_core.types import KVSpec, PrefixCacheSpec, TokenEvent, level_names

log = logging.getLogger(__name__)


# default positions prefilled per model and step (docs/chunked-prefill.md: why 128)
PREFILL_CHUNK_TOKENS = 128
# default time a routed request may wait for its catch-up to be batched (docs/batched-catch-ups.md)
CATCH_UP_WAIT_MS = 40.0


class BackoffEngine(RequestLifecycle, LiveSettings):
    """models: smallest first. Each is a ModelRunner or any Backend (e.g. a remote M_L)."""

    def __init__(
        self,
        models: Sequence[Backend],
        tokenizer,
        *,
        classifier_path: str | None = None,
        hidden_size: int | None = None,
        context_window: int | None = None,
        collect_kl: bool = False,
        prefill_chunk_tokens: int | None = PREFILL_CHUNK_TOKENS,
        catch_up_wait_ms: float | None = CATCH_UP_WAIT_MS,
        clock: Callable[[], float] = time.perf_counter,
        overlap_catch_ups: bool = False,
        launcher: Launcher | None = None,
        launch_ahead: bool = False,
    ) -> None:
        """prefill_chunk_tokens: positions each model prefills per step at most (chunked.py);
        longer prompts and first catch-ups are fed over several steps. 0 / None: off.
        catch_up_wait_ms: how long a request routed to a larger model may wait, while the
        others step, for its catch-up to run in one forward with others' (hold.py; clock:
        the time it is measured by, read once a step). 0 / None: every catch-up runs in the step
        that routes it. overlap_catch_ups: a batched catch-up runs beside M_S's next steps
        (flight.py; two models only), launched by `launcher` (default: a worker thread, on
        CUDA a stream of its own). launch_ahead: M_S's next step is queued before its tokens
        are read back (ahead.py; M_S on static KV, not with overlap_catch_ups; off here,
        `ahead.resolve("auto", ...)` is what serving and `backoff generate` choose by)."""
        if len(models) < 2:
            raise ValueError("backoff decoding needs at least two models (small and large)")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 (0: off), got {prefill_chunk_tokens}")
        if catch_up_wait_ms is not None and not catch_up_wait_ms >= 0:
            raise ValueError(f"catch_up_wait_ms must be >= 0 (0: off), got {catch_up_wait_ms}")
        self.prefill_chunk_tokens = prefill_chunk_tokens or 0
        self.models = list(models)
        self.tokenizer = tokenizer
        self.classifier_path = classifier_path
        self.hidden_size = hidden_size
        # a static KV slot holds max_positions: no longer request is admitted
        slots = [m.max_positions for m in models if getattr(m, "max_positions", None)]
        self.context_window = min([w for w in (context_window, *slots) if w], default=None)
        self.collect_kl = collect_kl
        self.hold = CatchUpHold(catch_up_wait_ms or 0.0, clock, collect_kl)
        self.eos_ids = _eos_ids(tokenizer)
        self.detok = Detokenizer(tokenizer)
        self.prompt_text = tokenizer.decode  # a scored prompt's text keeps its special tokens (vLLM's echo)
        self.token_texts = TokenTexts(tokenizer)
        self.catch_up = CatchUpper(self.models, collect_kl)
        self._live: dict[str, Live] = {}
        self.launcher = launcher
        self.flights: Flights | None = None  # overlap_catch_ups (settings.py)
        self.ahead: LaunchAhead | None = None  # launch_ahead (settings.py)
        self._bind_step()  # the plain step; the two settings rebind it (settings.py)
        self.overlap_catch_ups = overlap_catch_ups
        self.launch_ahead = launch_ahead
        self.routers = Routers(classifier_path, hidden_size)  # those requests name
        self._ids = itertools.count()

    @classmethod
    def from_chain(
        cls, chain, kv: KVSpec | None = None, prefix_cache: PrefixCacheSpec | None = PrefixCacheSpec(), **kwargs
    ) -> "BackoffEngine":
        """An in-process engine over a loaded Chain (backoff_core.models.loading). kv: static KV
        storage (and CUDA graphs on a GPU) for every model; None keeps per-session caches.
        prefix_cache: every model's prefix cache (runners/prefix_cache.py); None: off."""
        names = level_names(len(chain.models))
        kwargs.setdefault("context_window", chain.context_window)
        kwargs.setdefault("hidden_size", chain.models[0].config.hidden_size)
        if kwargs.get("classifier_path") is None:  # the default pair ships a trained router head
            from backoff_core.models.default_pair import default_head_dir

            kwargs["classifier_path"] = default_head_dir(chain)
        path = kwargs["classifier_path"]
        runners = [make_runner(chain.models[0], names[0], kv, True, path, prefix_cache)]
        runners += [make_runner(m, n, kv, prefix_cache=prefix_cache) for m, n in zip(chain.models[1:], names[1:])]
        return cls(runners, chain.tokenizer, **kwargs)

    @property
    def num_levels(self) -> int:
        return len(self.models)

    # -- the step -------------------------------------------------------------------------
    @on_loop_stream
    def step(self) -> dict[str, TokenEvent]:
        """Every live request one token on (or one rollback), by the mode's step function."""
        return self._step_fn(self)

    def _step_plain(self) -> dict[str, TokenEvent]:
        """The step: catch-ups run between M_S's steps, M_S's forward after the host's work."""
        opened = self._open()  # 0. open feed plans fed; 1. levels decided without M_S
        if opened is None:
            return {}
        live, levels, stepping, fed = opened
        # 2. M_S, batched
        small = small_step(self.models, stepping)
        # 3. oracle routers: the largest model catches up first, to know KL(M_L||M_S)
        # 4. decide: M_S's tokens and the routers' scores, one host copy; levels on the host
        step = self._decide(stepping, fed, small, levels)
        # 5. catch-ups, one batched forward per level; one that would read more than a chunk opens
        # its request's plan (its step is taken again once the plan is fed, chunked.py)
        live = self._catch_ups(self._plan_long(live, step), step)
        # 6. commit
        return self._commit(live, step)

    def _step_in_flight(self) -> dict[str, TokenEvent]:
        """The step with catch-ups in flight (`overlap_catch_ups`, flight.py): one that is back
        lands first, and a batched catch-up flies in stage 5 beside M_S's next steps."""
        landed = self.flights.land()
        if any(r.scoring is not None and admission_runs_large(r) for r in self._live.values()):
            self.flights.settle()  # stage 0 scores prompts with M_L in this thread (flight.py)
        opened = self._open()  # 0. and 1. (the landed ones' levels too: they are waiting)
        if opened is None:
            return {}
        live, levels, stepping, fed = opened
        small = small_step(self.models, stepping)  # 2. M_S, batched
        step = self._decide(stepping, fed, small, levels)  # 3. oracles first; 4. decide
        # 5. catch-ups (long ones planned first): the landed take up their step, a group that may wait flies
        live = self.flights.catch_ups(self._plan_long(live, step), step, landed, self.num_levels)
        return self._commit(live, step)  # 6. commit

    def _step_ahead(self) -> dict[str, TokenEvent]:
        """The step with M_S launched ahead (`launch_ahead`, ahead.py): stage 2 takes the rows
        of the last launch that hold good, and stage 4 launches the next before its read."""
        launched = self.ahead.settle(self._live)
        opened = self._open()  # 0. and 1.
        if opened is None:
            return {}
        live, levels, stepping, fed = opened
        # 2. M_S: launched in the last step where that holds good; deferred ride this step's launch
        small, deferred = self.ahead.small_step(self.models, stepping, launched)
        gone = {r.request_id for r in deferred}
        live = [r for r in live if r.request_id not in gone]
        # 3. oracles first; 4. decide, the next step launched behind the draw, before its read
        step = self._decide(stepping, fed, small, levels, self.ahead.launcher(small.of(stepping), deferred))
        self.ahead.read(step.proposal.tokens)
        live = self._catch_ups(self._plan_long(live, step), step)  # 5. catch-ups (long ones planned first)
        return self._commit(live, step)  # 6. commit

    # -- the stages' helpers, shared by the step functions ---------------------------------
    def _open(self) -> Opened | None:
        """Stages 0 and 1, every mode's; None when no request is live (the hold's clock is read
        once a step that has some)."""
        live = [r for r in self._live.values() if r.finished is None and r.failure is None]
        if not live:
            return None
        self.hold.tick()
        # 0. chunked prefill: at most one chunk per model toward each open feed plan (long
        # prompts, long catch-ups) and one window of rows of each prompt being scored; a
        # request whose plan is still open, or whose prompt is still scored, does not step
        live = self._feed(live)
        # 1. levels decided without M_S. From here on, an exception while handling one request
        # ends that request alone (isolation.py). A request waiting for its batched catch-up
        # does not step either (its level is decided).
        live, levels = forced_levels(self.models, live, self.num_levels, self._plans_catch_up)
        stepping = [r for r in live if r.request_id not in levels and r.waiting is None]
        fed = {r.request_id: r.fed[0] for r in stepping} if self.prefill_chunk_tokens else {}
        return Opened(live, levels, stepping, fed)

    def _feed(self, live: list[Live]) -> list[Live]:
        """Stage 0 (chunked.py): the requests that step after it."""
        chunk = self.prefill_chunk_tokens
        if scoring := [r for r in live if r.scoring is not None]:
            chunked.score(self.models, scoring, chunk, self.token_texts, self.prompt_text)
        if planned := [r for r in live if r.plan]:
            chunked.feed(self.models, planned, chunk, self.catch_up.give_up)
        if not (scoring or planned):
            return live
        return [r for r in live if not (r.plan or r.scoring is not None or r.done)]

    def _decide(
        self, stepping: list[Live], fed: dict[str, int], small: SmallOut, levels: dict[str, int], launch: Launch = None
    ) -> Decided:
        """Stages 3 and 4 over the requests M_S stepped. launch: M_S's next step, queued
        behind the draw (ahead.py)."""
        stepped = small.of(stepping)
        routed, outcomes = self.catch_up.for_oracles([r for r in stepped if not r.degraded])
        large = {request_id: outcome.logits for request_id, outcome in outcomes.items()}
        proposal = propose(self.models, stepped, routed, small, large, launch)
        scored = [r for r in routed if r.request_id in proposal.scores]
        decide(scored, proposal.scores, levels, outcomes, self.num_levels)
        return Decided(stepping, fed, small, routed, levels, outcomes, proposal)

    def _plan_long(self, live: list[Live], step: Decided) -> list[Live]:
        return chunked.plan_long_catch_ups(self.models, live, step, self.prefill_chunk_tokens, self.collect_kl)

    def _catch_ups(self, live: list[Live], step: Decided) -> list[Live]:
        """Stage 5: per level, the catch-up of the requests routed there (or waiting there)
        that the hold releases; step.outcomes gets theirs. Returns the requests that commit
        in this step (not the ones that wait)."""
        waiting = self.hold.take_waiting(live, step.levels)
        for level, group in self.hold.groups(live, step, waiting, self.num_levels):
            step.outcomes.update(self.catch_up.run(level, group))
        return [r for r in live if r.waiting is None] if waiting or self.hold.wait_ms else live

    def _commit(self, live: list[Live], step: Decided) -> dict[str, TokenEvent]:
        """Stage 6 (commit.py), a request whose catch-up failed taking M_S's token first."""
        small = small_for_degraded(self.models, live, step.small, step.proposal)
        ctx = CommitContext(self.detok, self.token_texts, self.eos_ids, self.collect_kl)
        return commit_many(settle_many(live, step.outcomes, small, step.proposal, ctx, self.models), ctx, self.models)

    def _plans_catch_up(self, r: Live, level: int) -> bool:
        return chunked.plans_catch_up(self.models, r, level, self.prefill_chunk_tokens, self.collect_kl)


def _eos_ids(tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return frozenset(ids)
