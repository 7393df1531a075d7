"""The collectives a training step issues through `torch.distributed`, seen by SCOUT.

DDP's gradient all-reduce is seen through our comm hook. A script's own collectives (`dist.all_reduce`
of gradients for a model without DDP, an all-to-all in a mixture-of-experts layer, a barrier inside the
step) are seen here: while a session is attached, the public `torch.distributed` functions below are
replaced by thin wrappers that tell the adapter a collective was entered (its op, size, dtype and
group size, chained for desync checks) and, for a blocking call, when it returned (how long peers
wait in it, for hang checks). Only calls made *inside a step* (from the step's first forward with
gradients enabled to its optimizer step) are tracked: every rank issues those in the same order,
while what a script does between steps (an evaluation, rank 0's save, a final barrier) may
legitimately keep its peers waiting.

Calls that bypass the `torch.distributed` attribute (`from torch.distributed import all_reduce`
before the session started, torch's internal calls) are not seen. `original(name)` is the unwrapped
function, for our own collectives.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = [
    "TRACKED",
    "CollectiveForbidden",
    "CollectiveTracker",
    "forbidden",
    "install",
    "original",
    "uninstall",
]

# Ops whose first tensor has the same size on every rank of the group (so it is part of what a
# collective is); the others (all-to-all with uneven splits, gathers into lists) are identified by
# op and group size.
_SIZED = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",  # FSDP2's all-gather and reduce-scatter (torch >= 2.12); absent ones are skipped
    "reduce_scatter_single",
)
TRACKED = (
    *_SIZED,
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
)


class CollectiveTracker(Protocol):
    def in_step(self) -> bool: ...
    def enter_collective(self, signature: str, waits: bool) -> None: ...
    def exit_collective(self) -> None: ...


_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_trackers: list[CollectiveTracker] = []  # attached sessions' adapters; the newest is the active one
_local = threading.local()  # `forbidden`: why this thread may not issue a collective now


@contextlib.contextmanager
def forbidden(why: str) -> Iterator[None]:
    """Inside the block, a tracked collective on this thread raises instead of running: an audit
    replays one rank's work alone, and a collective there would wait for peers that never join."""
    before = getattr(_local, "why", None)
    _local.why = why
    try:
        yield
    finally:
        _local.why = before


def original(name: str) -> Callable[..., Any]:
    """`torch.distributed.<name>` as torch defines it, wrapped or not."""
    import torch.distributed as dist

    fn = _originals.get(name)
    return fn if fn is not None else getattr(dist, name)


def install(tracker: CollectiveTracker) -> None:
    """Track the collectives of `tracker`'s steps (wrapping `torch.distributed` on first use)."""
    import torch.distributed as dist

    with _lock:
        if not _trackers:
            for name in TRACKED:
                fn = getattr(dist, name, None)
                if fn is None or getattr(fn, "_lm_resiliency_wraps", None) is not None:
                    continue
                _originals[name] = fn
                setattr(dist, name, _wrap(name, fn))
        _trackers.append(tracker)


def uninstall(tracker: CollectiveTracker) -> None:
    """Stop tracking for `tracker`; the last one out restores torch's functions."""
    import torch.distributed as dist

    with _lock:
        if tracker in _trackers:
            _trackers.remove(tracker)
        if _trackers:
            return
        for name, fn in _originals.items():
            if getattr(getattr(dist, name, None), "_lm_resiliency_wraps", None) is fn:
                setattr(dist, name, fn)  # never clobber what someone else put there since
        _originals.clear()


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    async_at = params.index("async_op") if "async_op" in params else None
    sized = name in _SIZED

    import torch

    compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        why = getattr(_local, "why", None)
        if why is not None:
            raise CollectiveForbidden(f"torch.distributed.{name} inside {why}")
        tracker = _trackers[-1] if _trackers else None
        # Inside a graph torch.compile is tracing, the call is torch's own again (no graph break).
        if tracker is None or compiling() or not tracker.in_step():
            return fn(*args, **kwargs)
        group = kwargs.get("group", _arg(args, group_at, None))
        waits = not kwargs.get("async_op", _arg(args, async_at, False))
        tracker.enter_collective(_signature(name, args, group, sized), waits)
        try:
            return fn(*args, **kwargs)
        finally:
            if waits:
                tracker.exit_collective()

    tracked._lm_resiliency_wraps = fn  # type: ignore[attr-defined]
    return tracked


class CollectiveForbidden(RuntimeError):
    """A collective was called where it would wait for peers that never join (see `forbidden`)."""


def _arg(args: tuple[Any, ...], at: int | None, default: Any) -> Any:
    return args[at] if at is not None and len(args) > at else default


def _signature(name: str, args: tuple[Any, ...], group: Any, sized: bool) -> str:
    import torch
    import torch.distributed as dist

    try:
        size = dist.get_world_size(group)
    except Exception:  # a group this rank is not in: the call itself will say so
        size = -1
    first = args[0] if args else None
    if sized and isinstance(first, torch.Tensor):
        return f"{name}:{first.numel()}:{first.dtype}:{size}"
    return f"{name}:{size}"
