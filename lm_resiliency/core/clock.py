"""Time as a value.

The core never reads a clock: callers pass `now` (seconds on a monotonic scale). The shell owns a real
clock; tests own a `ManualClock` and move it by hand.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock"]


@runtime_checkable
class Clock(Protocol):
    """A source of monotonic time in seconds."""

    def monotonic(self) -> float: ...


class ManualClock:
    """A clock that only moves when told to. For tests and simulations."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by `seconds` (never backwards) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back (advance by {seconds})")
        self._now += seconds
        return self._now

    def set(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"a monotonic clock cannot go back ({now} < {self._now})")
        self._now = float(now)
