"""Bounded retries of requests the server refused for lack of capacity (OverloadedError).

Only those are retried: the server refused them before starting them, so sending them again
repeats nothing. Any other error, and an error after a stream has begun, goes to the caller.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from clients.wire.errors import BackoffError, OverloadedError


@dataclass(frozen=True)
class Retry:
    """`BackoffHTTPClient(url, retry=Retry(attempts=3))`: up to 3 more tries, each after the
    server's Retry-After (else 0.5 s, 1 s, 2 s ...), never longer than max_wait_s."""

    attempts: int = 3  # tries after the first
    max_wait_s: float = 30.0
    jitter: float = 0.1  # waits are stretched by up to this share, so refused clients spread out

    def delay(self, error: BackoffError, attempt: int) -> float | None:
        """Seconds to wait before try `attempt + 1` (attempt 0 = the first), None: give up."""
        if not isinstance(error, OverloadedError) or attempt >= self.attempts:
            return None
        wait = error.retry_after_s if error.retry_after_s is not None else 0.5 * 2**attempt
        return min(self.max_wait_s, wait) * (1.0 + self.jitter * random.random())

    def wait(self, error: BackoffError, attempt: int) -> float:
        """`delay`, raising `error` where there is no further try (the clients' retry loops)."""
        wait = self.delay(error, attempt)
        if wait is None:
            raise error
        return wait


NO_RETRY = Retry(attempts=0)
