"""The real clock, for the shell only (the core takes `now` as an argument)."""

from __future__ import annotations

import time

__all__ = ["SystemClock"]


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()
