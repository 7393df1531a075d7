"""The collectives a training step issues through `torch.distributed`, seen by SCOUT.

DDP's gradient all-reduce is seen through our comm hook. A script's own collectives (`dist.all_reduce`
of gradients for a model without DDP, an all-to-all in a mixture-of-experts layer, a barrier inside the
step) are seen here: while a session is attached, the public `torch.distributed` functions below are
replaced by thin wrappers that tell the adapter a collective was entered (its op, size, dtype and
group size, chained for desync checks) and, for a blocking call, when it returned (how long peers
wait in it, for hang checks). Waits are tracked only for calls made *inside a step* (from the step's
first forward with gradients enabled to its optimizer step): what a script does between steps (an
evaluation, rank 0's save, a final barrier) may legitimately keep its peers waiting. The job-wide
calls between steps are chained all the same (a metric's all-reduce, a barrier): in a correct program
every rank issues them alike, and one that issues another (a different size) is a desync, which
would otherwise show up only as a hang naming the ranks stuck in it. (A subgroup's, between steps,
may be issued by some replicas only: not chained.)

Tensor parallelism (DTensor's redistributions, `parallelize_module`'s plans) issues *functional*
collectives (`torch.distributed._functional_collectives`): the call enqueues the collective and
returns at once, and the rank blocks later in `wait_tensor` (when the result is first used). Both
are wrapped: the call is an entered collective, the wait is time spent waiting in one.

A pipeline schedule (`torch.distributed.pipelining`) waits for its neighbour stages' activations and
gradients in point-to-point transfers (`_wait_batch_p2p`): that wait is waited in as a collective
is (not entered: the stages of one replica group issue other transfers than those of another), so
a stage whose neighbour hangs is seen waiting, not idle, even before its first forward of the step
(where it waits for its input: not its input time either). Before, a hang of rank 3 (stage 1)
named rank 2 too (stage 0, waiting for rank 3's gradients): outsider 44. A blocking `send`/`recv`
(a pipeline written by hand) is waited in the same way. `isend`/`irecv` are left alone (torch tells
a `P2POp`'s send from its receive by the function's identity), and so is the wait on what they
return.

Calls that bypass the `torch.distributed` attribute (`from torch.distributed import all_reduce`
before the session started, torch's internal calls) are not seen. `original(name)` is the unwrapped
function, for our own collectives.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
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
# Point-to-point calls that block until the peer takes part: waited in, never entered (see the doc).
P2P_WAITS = ("send", "recv")


# Functional collectives (tensor parallelism): a call enqueues one and returns, `wait_tensor` blocks.
# Some call others (`all_gather_tensor` is `all_gather_single`): only the outermost call counts.
_FUNCOL_SIZED = (
    "broadcast",
    "all_reduce",
    "all_gather_single",
    "all_gather_single_autograd",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_single",
    "reduce_scatter_single_autograd",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
)
FUNCOL_TRACKED = (
    *_FUNCOL_SIZED,
    "all_reduce_coalesced",
    "all_gather_single_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "permute_tensor",
)


class CollectiveTracker(Protocol):
    # The training thread (threading.get_ident()): calls from another thread of the script's own are
    # not its step's (see _foreign). None: any thread's.
    thread: int | None

    def in_step(self) -> bool: ...
    def enter_collective(self, signature: str, waits: bool) -> None: ...
    def wait_collective(self) -> None: ...  # blocks in one entered before (ended by exit_collective)
    def exit_collective(self) -> None: ...
    # Between steps a collective is entered (chained) but never waited in, and timed: waiting for
    # peers before the forward (rank 0 broadcasting the batch) is not this rank's input time.
    def waited_between_steps(self, seconds: float) -> None: ...


_PIPELINE = "torch.distributed.pipelining.schedules"
_PIPELINE_WAIT = "_wait_batch_p2p"

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_pipeline_original: list[Callable[..., Any]] = []
_funcol_originals: dict[str, Callable[..., Any]] = {}
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
            for name in P2P_WAITS:
                fn = getattr(dist, name, None)
                if fn is None or getattr(fn, "_lm_resiliency_wraps", None) is not None:
                    continue
                _originals[name] = fn
                setattr(dist, name, _wrap_p2p_wait(fn, f"torch.distributed.{name}"))
            funcol = _funcol_module()
            for name in (*FUNCOL_TRACKED, "wait_tensor") if funcol is not None else ():
                fn = getattr(funcol, name, None)
                if fn is None or getattr(fn, "_lm_resiliency_wraps", None) is not None:
                    continue
                _funcol_originals[name] = fn
                setattr(funcol, name, _wrap_wait(fn) if name == "wait_tensor" else _wrap_funcol(name, fn))
            schedules = sys.modules.get(_PIPELINE)  # (imported by a script that built a schedule)
            fn = getattr(schedules, _PIPELINE_WAIT, None)
            if fn is not None and getattr(fn, "_lm_resiliency_wraps", None) is None:
                _pipeline_original.append(fn)
                setattr(
                    schedules, _PIPELINE_WAIT, _wrap_p2p_wait(fn, "a pipeline schedule's point-to-point wait")
                )
        _trackers.append(tracker)


def uninstall(tracker: CollectiveTracker) -> None:
    """Stop tracking for `tracker`; the last one out restores torch's functions."""
    import torch.distributed as dist

    with _lock:
        if tracker in _trackers:
            _trackers.remove(tracker)
        if _trackers:
            return
        for module, originals in ((dist, _originals), (_funcol_module(), _funcol_originals)):
            for name, fn in originals.items():
                if getattr(getattr(module, name, None), "_lm_resiliency_wraps", None) is fn:
                    setattr(module, name, fn)  # never clobber what someone else put there since
            originals.clear()
        schedules = sys.modules.get(_PIPELINE)
        for fn in _pipeline_original:
            if getattr(getattr(schedules, _PIPELINE_WAIT, None), "_lm_resiliency_wraps", None) is fn:
                setattr(schedules, _PIPELINE_WAIT, fn)
        _pipeline_original.clear()


def _funcol_module() -> Any:
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:  # a torch without them (or without distributed support)
        return None
    return funcol


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    async_at = params.index("async_op") if "async_op" in params else None
    sized = name in _SIZED

    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        tracker = _tracking(f"torch.distributed.{name}")
        waits = not kwargs.get("async_op", _arg(args, async_at, False))
        if tracker is None:
            idle = _between_steps()
            if idle is None:
                return fn(*args, **kwargs)
            group = kwargs.get("group", _arg(args, group_at, None))
            if _whole_job(group):
                # Chained (every rank issues the job-wide ones, or they deadlock), never waited in:
                # waiting for a peer between steps (rank 0 saving) is no hang. A subgroup's (logging
                # among some ranks) may legitimately be issued by some replicas only.
                idle.enter_collective(_signature(name, args, _group_size(group), sized), False)
            if not waits:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                idle.waited_between_steps(time.perf_counter() - t0)
        group = kwargs.get("group", _arg(args, group_at, None))
        tracker.enter_collective(_signature(name, args, _group_size(group), sized), waits)
        if name == "all_reduce":
            tensor = args[0] if args else kwargs.get("tensor")
            note = getattr(tracker, "all_reduced", None)
            if note is not None and hasattr(tensor, "numel"):
                note(tensor, group)  # (before it runs: SCOUT's replay record may keep this rank's share)
        try:
            return fn(*args, **kwargs)
        finally:
            if waits:
                tracker.exit_collective()

    tracked._lm_resiliency_wraps = fn  # type: ignore[attr-defined]
    return tracked


def _whole_job(group: Any) -> bool:
    """Whether a collective on `group` involves every rank (the default group)."""
    import torch.distributed as dist

    return group is None or group is dist.group.WORLD


def _between_steps() -> CollectiveTracker | None:
    """The attached tracker outside its step (see CollectiveTracker.waited_between_steps)."""
    import torch

    tracker = _trackers[-1] if _trackers else None
    if tracker is None or torch.compiler.is_compiling() or _foreign(tracker):
        return None
    return tracker


def _foreign(tracker: CollectiveTracker) -> bool:
    """Whether the calling thread is one the script started beside its training thread (a metrics
    thread all-reducing a heartbeat over a group of its own, say). Its collectives are no part of
    the step: chained, they would interleave with the step's in whatever order the threads ran
    (a desync between healthy ranks), and their returns counted as the training thread's progress
    (a hung rank whose metrics thread went on was never named). Threads torch starts in C++ (the
    autograd engine's device threads, which run backward hooks: FSDP2's reduce-scatter on a GPU)
    are the step's: Python sees them as dummy threads."""
    owner = tracker.thread
    if owner is None or owner == threading.get_ident():
        return False
    return not isinstance(threading.current_thread(), threading._DummyThread)


def _tracking(what: str) -> CollectiveTracker | None:
    """The tracker to tell about a collective now, or None (raises where collectives are forbidden)."""
    import torch

    why = getattr(_local, "why", None)
    if why is not None:
        raise CollectiveForbidden(f"{what} inside {why}")
    tracker = _trackers[-1] if _trackers else None
    # Inside a graph torch.compile is tracing, the call is torch's own again (no graph break).
    if tracker is None or torch.compiler.is_compiling() or not tracker.in_step() or _foreign(tracker):
        return None
    return tracker


def _wrap_funcol(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    sized = name in _FUNCOL_SIZED

    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "funcol", False):  # called by another functional collective we track
            return fn(*args, **kwargs)
        tracker = _tracking(f"torch.distributed._functional_collectives.{name}")
        if tracker is None:
            return fn(*args, **kwargs)
        group = kwargs.get("group", _arg(args, group_at, None))
        tracker.enter_collective(_signature(name, args, _funcol_group_size(group), sized), waits=False)
        _local.funcol = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.funcol = False

    tracked._lm_resiliency_wraps = fn  # type: ignore[attr-defined]
    return tracked


def _wrap_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        tracker = _tracking("wait_tensor")
        if tracker is None:
            return fn(*args, **kwargs)
        tracker.wait_collective()
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.exit_collective()

    tracked._lm_resiliency_wraps = fn  # type: ignore[attr-defined]
    return tracked


def _wrap_p2p_wait(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """A wait for a point-to-point transfer: a pipeline schedule's, a blocking send or receive
    (see the module's doc)."""

    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        inside = _tracking(what)
        tracker = inside if inside is not None else _between_steps()
        if tracker is None:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        tracker.wait_collective()
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.exit_collective()
            if inside is None:
                tracker.waited_between_steps(time.perf_counter() - t0)

    tracked._lm_resiliency_wraps = fn  # type: ignore[attr-defined]
    return tracked


def _funcol_group_size(group: Any) -> int:
    """The size of a functional collective's group: a process group, a device mesh, (mesh, dim), a
    list of ranks or a group name (-1 when it does not resolve: the call itself will say why)."""
    import torch.distributed as dist

    try:
        if isinstance(group, dist.ProcessGroup):
            return int(group.size())
        if isinstance(group, tuple) and len(group) == 2:
            mesh, dim = group
            return int(mesh.size(dim))
        if isinstance(group, list):
            return len(group) if all(isinstance(r, int) for r in group) else sum(len(g) for g in group)
        if isinstance(group, str):
            return int(dist.distributed_c10d._get_group_size_by_name(group))  # type: ignore[arg-type]
        return int(group.size())  # a DeviceMesh: all of it
    except Exception:
        return -1


class CollectiveForbidden(RuntimeError):
    """A collective was called where it would wait for peers that never join (see `forbidden`)."""


def _arg(args: tuple[Any, ...], at: int | None, default: Any) -> Any:
    return args[at] if at is not None and len(args) > at else default


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(group)
    except Exception:  # a group this rank is not in: the call itself will say so
        return -1


def _signature(name: str, args: tuple[Any, ...], size: int, sized: bool) -> str:
    """What a collective is: its op, the size and dtype of its first tensor when that is the same on
    every rank of the group (`sized`), and the group's size."""
    import torch

    first = args[0] if args else None
    if sized and isinstance(first, torch.Tensor):
        return f"{name}:{first.numel()}:{first.dtype}:{size}"
    return f"{name}:{size}"
