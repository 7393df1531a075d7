"""A stand-in for the CUDA copier on machines without a GPU.

`DeferredCopier` behaves like device-to-host copies on a side stream: `copy()` returns at once and the
bytes move only later, when `fence_device()` (the optimizer's pre-step fence) or `wait_host()` (the
worker thread) runs. Tests use it to show that an asynchronous capture is fenced before the optimizer
mutates the parameters, and waited for before it is checksummed. The first `first` pairs of a
`copy()` (what the next forward changes in place) are copied before it returns, as the compute stream
waits for those copies on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from lm_resiliency.gemini.copier import _source

__all__ = ["DeferredCopier"]


class _Pending:
    def __init__(self, owner: DeferredCopier, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.owner = owner
        self.pairs = pairs
        self.done = False

    def _run(self) -> None:
        with self.owner.lock:  # the fence (training thread) and the worker may both ask
            if not self.done:
                for dst, src in self.pairs:
                    dst.copy_(_source(dst, src))
                self.done = True
                self.owner.completed += 1

    def wait_host(self) -> None:
        self.owner.host_waits += 1
        self.owner.release.wait(30)  # a test holds the "device" back to order events
        self._run()

    def fence_device(self) -> None:
        self.owner.fences += 1
        self._run()


class DeferredCopier:
    asynchronous = True

    def __init__(self) -> None:
        self.issued = 0
        self.completed = 0
        self.fences = 0
        self.host_waits = 0
        self.registered: list[int] = []
        self.early: list[int] = []  # each copy's `first`
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.release.set()

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], first: int = 0) -> _Pending:
        self.issued += 1
        self.early.append(first)
        for dst, src in pairs[:first]:
            dst.copy_(_source(dst, src))
        return _Pending(self, list(pairs[first:]))

    def register_host(self, buffer: Any, nbytes: int) -> None:
        self.registered.append(nbytes)

    def unregister_host(self, buffer: Any) -> None:
        return None
