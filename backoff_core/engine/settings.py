"""The engine's settings that may change between steps (a deployment's config changes them
live): how long a routed request may wait for a batched catch-up (hold.py), whether batched
catch-ups fly beside M_S's next steps (flight.py), and whether M_S's next step is launched
before its tokens are read back (ahead.py). BackoffEngine holds them. The two modes each
have a step function of their own, bound here when the setting changes (`_bind_step`)."""

from __future__ import annotations

from backoff_core.engine.ahead import LaunchAhead
from backoff_core.engine.flight import Flights, ThreadLauncher, side_stream_device


class LiveSettings:
    """BackoffEngine's settings (the attributes used here are the engine's)."""

    @property
    def catch_up_wait_ms(self) -> float:
        """How long a routed request may wait for a batched catch-up (hold.py); may change
        between steps (0: the waiting ones catch up in the next step)."""
        return self.hold.wait_ms

    @catch_up_wait_ms.setter
    def catch_up_wait_ms(self, value: float) -> None:
        self.hold.wait_ms = value or 0.0

    @property
    def overlap_catch_ups(self) -> bool:
        """Whether batched catch-ups run beside M_S's next steps (flight.py); may change
        between steps while no catch-up is in flight."""
        return self.flights is not None

    @overlap_catch_ups.setter
    def overlap_catch_ups(self, on: bool) -> None:
        if on == self.overlap_catch_ups:
            return
        if on and self.ahead is not None:
            raise ValueError("launch_ahead and overlap_catch_ups do not go together: choose one")
        if on and len(self.models) != 2:
            raise ValueError(f"overlap_catch_ups takes two models (small and large), got {len(self.models)}")
        if self.flights is not None and self.flights.busy:
            raise RuntimeError("a catch-up is in flight: step until it lands first")
        if on and self.launcher is None:
            self.launcher = ThreadLauncher(side_stream_device(self.models[-1]))
        self.flights = (
            Flights(self.launcher, self._live, self.hold, self.catch_up, self._close_sessions) if on else None
        )
        self._bind_step()

    @property
    def launch_ahead(self) -> bool:
        """Whether M_S's next step is queued before its tokens are read back (ahead.py); may
        change between steps (off: a launched step's rows are cropped back)."""
        return self.ahead is not None

    @launch_ahead.setter
    def launch_ahead(self, on: bool) -> None:
        if on == self.launch_ahead:
            return
        if on and self.flights is not None:
            raise ValueError("launch_ahead and overlap_catch_ups do not go together: choose one")
        if self.ahead is not None:
            self.ahead.drop(self._live)
        self.ahead = LaunchAhead(self.models[0], self.hold.may_wait) if on else None
        self._bind_step()

    def _bind_step(self) -> None:
        """step()'s function for the mode on (engine.py), as vLLM binds its step_fn: the
        class's function, called with the engine (a bound method kept on the engine would
        be a reference cycle, the engine freed by the cyclic collector only)."""
        engine = type(self)
        if self.flights is not None:
            self._step_fn = engine._step_in_flight
        elif self.ahead is not None:
            self._step_fn = engine._step_ahead
        else:
            self._step_fn = engine._step_plain
