"""The prefix cache of a remote M_L (the LargeModel replica's runner, through RemoteLarge and
the catch-up batcher, no Ray) and the per-request switch on the wire and in the config."""

from __future__ import annotations

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import PrefixCacheSpec, Verification
from clients.wire.openai_requests import CompletionRequest
from clients.wire.proto import params_from_pb, request_to_pb
from clients.wire.types import GenerateParams
from deployments.serving.config import RoutingConfig
from deployments.serving.models_config import ModelsConfig
from deployments.serving.remote import RemoteLarge
from deployments.serving.requests import generation_request, serve_request
from tests.support.helpers import request
from tests.support.remote_fakes import FakeEndpoint, LoopThread, remote_engine

SYSTEM = [5 + (7 * i) % 41 for i in range(40)]  # 40 tokens: one 32-token block and a part
USERS = [[11, 12, 13], [20, 21], [11, 12, 30, 31], [2]]


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


def _off(pair, tokenizer) -> BackoffEngine:
    return BackoffEngine([ModelRunner(m, n, prefix_cache=None) for m, n in zip(pair, ("small", "large"))], tokenizer)


@pytest.mark.parametrize("routing", [{}, {"verification": Verification.KL, "tolerance": 0.5}], ids=["plain", "kl"])
def test_the_replica_starts_a_fresh_session_from_its_cached_prefix(pair, tokenizer, loop_thread, routing):
    endpoint = FakeEndpoint(pair[1], loop_thread, replicas=1)
    engine, _ = remote_engine(pair, tokenizer, endpoint)
    off = _off(pair, tokenizer)
    for user in USERS:
        req = request(SYSTEM + user, max_tokens=8, router="random", rate=0.5, seed=1, **routing)
        a, b = engine.generate(req), off.generate(req)
        assert (a.token_ids, a.sources) == (b.token_ids, b.sources)
    firsts = {}
    for call in endpoint.calls:  # a session's first call names the prompt's length, later ones 0
        firsts.setdefault(call.session_key, call)
        if call is not firsts[call.session_key]:
            assert call.prefix_cache == 0
    assert sorted(c.prefix_cache for c in firsts.values()) == sorted(len(SYSTEM + u) for u in USERS)
    s = endpoint.replicas[0].runner.prefix_stats()
    if routing:  # verification reads every row of the first catch-up: nothing skipped, nothing stored
        assert (s.lookups, s.stored_blocks) == (0, 0)
    else:  # the first request stores SYSTEM's block, the others adopt it
        assert (s.lookups, s.hits, s.cached_tokens, s.stored_blocks) == (4, 3, 3 * 32, 1)


def test_the_per_request_switch_reaches_the_replica(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread, replicas=1)
    engine, _ = remote_engine(pair, tokenizer, endpoint)
    for user in USERS[:2]:
        engine.generate(request(SYSTEM + user, max_tokens=4, router="always-large", prefix_cache=False))
    assert all(c.prefix_cache == 0 for c in endpoint.calls)
    assert endpoint.replicas[0].runner.prefix_stats().lookups == 0
    assert engine.models[0].prefix_stats().lookups == 0


def test_the_switch_on_http_and_grpc_params():
    policy = RoutingConfig()
    for value in (True, False):
        params = GenerateParams(prefix_cache=value)
        assert params_from_pb(request_to_pb(params, prompt="hi")).prefix_cache is value
        req = generation_request(serve_request("r", params, prompt=[1, 2]), [1, 2], policy)
        assert req.routing.prefix_cache is value
    assert GenerateParams().prefix_cache is True and params_from_pb(request_to_pb(GenerateParams(), prompt="x"))
    assert CompletionRequest.model_validate({"prompt": "x", "prefix_cache": None}).prefix_cache is True
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": "x", "prefix_cache": "sometimes"})


def test_the_config_switch():
    assert ModelsConfig().prefix_spec() == PrefixCacheSpec(8192, 32)
    assert ModelsConfig(prefix_cache_tokens=0).prefix_spec() is None
    assert ModelsConfig(prefix_cache_tokens=64, prefix_block_tokens=16).prefix_spec() == PrefixCacheSpec(64, 16)
    with pytest.raises(ValueError):
        ModelsConfig(prefix_cache_tokens=-1)
    with pytest.raises(ValueError):
        ModelsConfig(prefix_block_tokens=0)


LONG_SYSTEM = [5 + (7 * i) % 41 for i in range(80)]  # two 32-token blocks and a part


@pytest.mark.parametrize("router", [{"router": "always-large"}, {"router": "random", "rate": 0.5}])
def test_a_prompt_fed_in_chunks_starts_from_the_replicas_cached_prefix(pair, tokenizer, loop_thread, router):
    """Chunks of 16: M_L's first catch-up is fed in chunks, each its own call. The replica
    looks the prompt up before the first (an adopt_only call), stores every block as the
    chunks come, and a later prompt with the same system prompt starts from it: outputs as
    with no cache, no chunks, no remote."""
    endpoint = FakeEndpoint(pair[1], loop_thread, replicas=1)
    small, large = pair
    remote = RemoteLarge(endpoint, "large", ModelRunner(large).vocab_size)
    engine = BackoffEngine([ModelRunner(small, "small"), remote], tokenizer, prefill_chunk_tokens=16)
    off = _off(pair, tokenizer)
    off.prefill_chunk_tokens = 0
    for user in USERS:
        req = request(LONG_SYSTEM + user, max_tokens=6, seed=3, **router)
        a, b = engine.generate(req), off.generate(req)
        assert (a.token_ids, a.sources) == (b.token_ids, b.sources)
    adopts = [c for c in endpoint.calls if c.adopt_only]
    assert sorted(c.prefix_cache for c in adopts) == sorted(len(LONG_SYSTEM + u) for u in USERS)
    firsts = {}  # the call after each adopt: past = what the replica found cached
    for call in endpoint.calls:
        if not call.adopt_only and call.session_key not in firsts:
            firsts[call.session_key] = call
    assert sorted(c.past for c in firsts.values()) == [0, 64, 64, 64]
    assert all(c.prefix_cache == 0 and len(c.ids) <= 16 for c in firsts.values())
    s = endpoint.replicas[0].runner.prefix_stats()
    assert (s.lookups, s.hits, s.misses, s.cached_tokens, s.stored_blocks) == (4, 3, 1, 3 * 64, 2)
