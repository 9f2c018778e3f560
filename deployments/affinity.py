"""Session affinity for LargeModel replicas: a Ray Serve request router.

Catch-up calls carry their session key as the multiplexed model id
(`handle.options(multiplexed_model_id=session_key)`), and a replica registers the sessions it
holds through `@serve.multiplexed`. Serve's default router prefers such replicas only once
their registration has reached it (a push every 0.1 s, then a broadcast) and otherwise
falls back to any replica -- too late for a session whose next catch-up follows within
milliseconds. This router is deterministic instead:
  1. a replica that registered the session key, if any;
  2. else rendezvous hashing of the session key over the live replicas: every SmallModel picks
     the same replica without waiting, and losing a replica moves only its own sessions.
A full replica is waited for (backoff), never swapped: swapping would lose the session.
Calls without a session key (stats, info) go to the least loaded replica.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def rendezvous(session_key: str, replicas: list[RunningReplica]) -> RunningReplica:
    """The replica with the highest hash of (session key, replica id): stable under churn."""
    return max(
        replicas,
        key=lambda r: hashlib.blake2b(f"{session_key}|{r.replica_id.unique_id}".encode(), digest_size=8).digest(),
    )


class SessionAffinity(RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        session_key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # sleep between retries
        if not session_key:
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        holders = [r for r in candidate_replicas if session_key in r.multiplexed_model_ids]
        return [[rendezvous(session_key, holders or candidate_replicas)]]
