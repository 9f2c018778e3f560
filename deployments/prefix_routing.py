"""Prefix-aware routing of requests to SmallModel replicas: a Ray Serve request router.

A replica that served a prompt may still hold its prefix (a shared system prompt, the earlier
turns of a chat) in its prefix cache, so a caller (the Ingress) sends a request to the replica
that already served the longest prefix of its prompt. This is Ray Serve LLM's
`PrefixCacheAffinityRouter`, fed with our requests:
  1. the prompt of the ServeRequest becomes a string key (`prompt_key`): text as is, chat
     messages in the order the chat template renders them, token ids one character each;
  2. while the load is balanced (busiest replica's ongoing requests - least busy one's <=
     max_imbalance) the request goes to the replicas owning the longest match of its key in a
     prefix tree shared by all callers (a named actor per deployment), or, matching less than
     min_match of its key, to the replica holding the fewest characters (new prefixes spread);
  3. otherwise, and for calls without a prompt (info), power of two choices: a hot prefix
     spills over to the other replicas instead of queueing on its own.
The tree's replies are awaited (Ray's class blocks the caller's loop on them). After routing,
the key is inserted under the chosen replica; replicas that go away are removed
from the tree (Serve's update_replicas / on_replica_actor_died). PrefixRoutingConfig's
tree_chars bounds what the tree keeps per replica (LRU eviction in the actor).
Keys of the three prompt forms never match each other: text and token ids of the same prompt
are different keys (tokenizing in the Ingress would cost more than the match saves).
"""

from __future__ import annotations

import time

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from deployments.serving.config import PrefixRoutingConfig
from deployments.serving.requests import ServeRequest

TOKEN_BASE = 0xE000  # token id t -> chr(TOKEN_BASE + t): past the surrogates, valid up to ~1M ids
MESSAGE, FIELD, IDS = "\x1e", "\x1f", "\x1d"  # separators no prompt text is made of in practice


def prompt_key(request: ServeRequest, key_chars: int) -> str:
    """The head (key_chars) of a string whose prefixes follow the prompt's token prefixes."""
    if request.messages is not None:
        key = "".join(f"{MESSAGE}{role}{FIELD}{content}" for role, content in request.messages)
    elif request.prompt is not None:
        key = request.prompt
    else:
        ids = request.prompt_ids[:key_chars]
        key = IDS + "".join(chr(TOKEN_BASE + t) if 0 <= t < 0x100000 else "\ufffd" for t in ids)
    return key[:key_chars]


class PrefixAffinity(FIFOMixin, PrefixCacheAffinityRouter):
    # FIFOMixin (as in Serve's power of two choices): without it a pending request is matched to
    # a replica by its internal request id, which a batch's requests share (the HTTP request's):
    # all but one of them never left the Ingress
    def initialize_state(self, key_chars: int = 2048, **kwargs) -> None:
        self.key_chars = key_chars
        super().initialize_state(**kwargs)

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:
        """The prompt key of the call's ServeRequest; None for calls without one (info, stats):
        the base class then routes them by power of two choices."""
        for arg in pending_request.args:
            if isinstance(arg, ServeRequest):
                return prompt_key(arg, self.key_chars) or None
        return None

    async def _prefix_match_best_replicas(
        self, pending_request: PendingRequest | None, candidate_replicas: list[RunningReplica]
    ) -> list[list[RunningReplica]]:
        """Ray's choice (step 2 of the module's docstring), with the tree's replies awaited: the
        base class blocks the caller's event loop on them (`ray.get`)."""
        key = self._extract_text_from_request(pending_request) if pending_request is not None else None
        if key is None:
            return [[]]
        queue_lens = [self._replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas]
        unknown = [r for r, q in zip(candidate_replicas, queue_lens) if q is None or q >= r.max_ongoing_requests]
        known = [q for r, q in zip(candidate_replicas, queue_lens) if r not in unknown]
        if unknown:
            known += [q for _, q in await self._probe_queue_lens(unknown, 0) if q is not None]
        if known and max(known) - min(known) > self._imbalanced_threshold:
            return [[]]  # imbalanced: power of two choices
        ids = [r.replica_id.to_full_id_str() for r in candidate_replicas]
        matched, owners = await self._tree_actor.prefix_match.remote(key, ids)
        if len(matched) < self._match_rate_threshold * len(key):
            owners = await self._tree_actor.get_smallest_tenants.remote()
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        return [[by_id[i] for i in owners or () if i in by_id]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Insert the key under its replica without waiting (the base class blocks the caller's
        event loop on the reply). The actor runs one caller's calls in order, so this caller's
        next match sees the insert."""
        if pending_request is None or not pending_request.args:
            return
        key = self._extract_text_from_request(pending_request)
        if key is not None:
            self._tree_actor.insert.remote(key, replica_id.to_full_id_str(), time.time())


def prefix_router_config(cfg: PrefixRoutingConfig) -> RequestRouterConfig | None:
    """The SmallModel's request_router_config; None (Serve's power of two choices) when off."""
    if not cfg.enabled:
        return None
    return RequestRouterConfig(
        request_router_class="deployments.prefix_routing:PrefixAffinity",
        request_router_kwargs={
            "key_chars": cfg.key_chars,
            "imbalanced_threshold": cfg.max_imbalance,
            "match_rate_threshold": cfg.min_match,
            "do_eviction": True,
            "eviction_threshold_chars": cfg.tree_chars,
            "eviction_target_chars": cfg.tree_chars * 9 // 10,
        },
    )
