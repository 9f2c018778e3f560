"""What a catch-up call and its reply carry between the router (SmallModel, remote.py) and
the large model's batcher (LargeModel, batcher.py): plain frozen data that Ray pickles, and
the batcher's records for metrics. torch is imported where rows become tensors: Serve's app
builder imports this module and runs no model (tests/test_layout.py)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from backoff_core.runners.scoring import Scored, Scoring


@dataclass(frozen=True)
class CatchUpCall:
    session_key: str  # request id + epoch (a re-prefill starts a new epoch)
    past: int  # positions the caller believes the session holds
    ids: tuple[int, ...]  # the pending ids, k >= 1
    group: str = ""  # the caller's step: its calls are merged when they arrive together
    group_size: int = 1  # calls the caller issued in that step
    owner: str = ""  # the caller (a SmallModel replica) whose lease keeps the session; "": TTL only
    last_only: bool = False  # reply with the logits after the last id only ([1, V]: 1/k of the bytes)
    refill: bool = False  # past 0 rebuilding a lost session of a live request: never refused for KV room
    # rows to score (prompt logprobs: a target's log-probability and the top-n, runners/scoring.py),
    # answered in CatchUpReply.scored instead of full logits; None (every ordinary catch-up): none
    scoring: Scoring | None = None
    # prefix cache (backoff_core/runners/prefix_cache.py): a fresh session (past 0) replied
    # last_only starts from the replica's longest cached prefix within ids[:prefix_cache] (the
    # caller's prompt length) and the forward reads only the rest; 0: no lookup, nothing stored
    prefix_cache: int = 0
    # with prefix_cache, past 0: open the session and load its cached prefix, no forward; the
    # reply says how many positions it holds (chunked prefill then feeds the rest in chunks)
    adopt_only: bool = False
    # with scoring: reply with the scored rows and no logits rows ([0, V]): the caller reads only
    # those (prompt scoring), so the reply is a few numbers a row (ScoredRows)
    scored_only: bool = False


@dataclass(frozen=True)
class ScoredRows:
    """Scored rows on the wire (numpy: the cheapest to ship): 4·(1 + 2n) bytes a row (+ 4 with
    the KL of an oracle's scoring), not 4·V."""

    target: np.ndarray  # [m] float32: log-probability of each scored row's target
    top_ids: np.ndarray  # [m, n] int32: the n most likely ids, most likely first
    top: np.ndarray  # [m, n] float32: their log-probabilities
    kl: np.ndarray | None = None  # [m] float32: KL(M_L || M_S) a row (Scoring.against), else None

    @classmethod
    def of(cls, scored: Scored) -> "ScoredRows":
        import torch

        kl = None if scored.kl is None else scored.kl.numpy()
        return cls(scored.target.numpy(), scored.top_ids.to(torch.int32).numpy(), scored.top.numpy(), kl)

    def scored(self) -> Scored:
        import torch

        from backoff_core.runners.scoring import Scored

        return Scored(
            torch.from_numpy(np.array(self.target, dtype=np.float32)),
            torch.from_numpy(np.array(self.top_ids, dtype=np.int64)),
            torch.from_numpy(np.array(self.top, dtype=np.float32)),
            None if self.kl is None else torch.from_numpy(np.array(self.kl, dtype=np.float32)),
        )


@dataclass(frozen=True)
class CatchUpReply:
    # [k, V] float32 next-token logits after each new id ([1, V]: last_only; [0, V]: scored_only;
    # numpy: the cheapest to ship); None: lost
    logits: np.ndarray | None
    lost: str = ""  # why the session is not usable here
    refused: str = ""  # a new session with no KV room here: why (the request may retry later)
    scored: ScoredRows | None = None  # the rows the call's scoring named
    adopted: int = 0  # an adopt_only call: positions the session now holds ([0, 0] logits)


@dataclass(frozen=True)
class ForwardRecord:
    """One forward of the large model, for metrics."""

    batch_size: int  # sessions in the forward
    lengths: tuple[int, ...]  # new ids per session
    seconds: float


@dataclass
class BatcherStats:
    forward_passes: int = 0
    calls: int = 0
    lost: int = 0
    waited_s: float = 0.0  # total time forwards waited for the rest of a step's calls
    forward_s: float = 0.0  # total time in forwards
    orphans_freed: int = 0  # sessions freed because their owner's lease expired
    refused: int = 0  # new sessions refused for want of KV room
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
