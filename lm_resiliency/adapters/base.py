"""What every framework adapter provides to the session."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "NUMERICS_KEYS",
    "AdapterTopology",
    "FrameworkAdapter",
    "StepTimes",
    "collector_paused",
    "is_dtensor",
    "live_instances",
    "named_parameters_of",
    "numerics_settings",
    "parameters_of",
    "thread_stack_files",
    "unregistered_parameters",
]

_gc_lock = threading.Lock()
_gc_pauses = 0  # threads inside collector_paused()
_gc_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The garbage collector off for the block, in any number of threads at once: back on (if it
    was on) when the last one leaves. Our calls into the interpreter that must not run a collection
    (finalizers, which run Python code and tensor deallocations that release the GIL) go through it;
    another thread's `gc.disable()` meanwhile is undone by the last one out."""
    global _gc_pauses, _gc_was_enabled
    import gc

    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def thread_stack_files(ident: int | None, limit: int = 256) -> list[str]:
    """The source files of thread `ident`'s stack, innermost first (empty for no such thread).

    `sys._current_frames()` holds the interpreter's thread-list lock while it makes frame
    objects (CPython 3.11), and making one may start a collection. A finalizer that releases the
    GIL inside it (a tensor's deallocation may) lets a thread that is ending take the GIL and wait
    for that lock, while this thread waits for the GIL: both stop for good. A session's close()
    hung once so under heavy load: its worker thread ending, stuck on that lock with the GIL, and
    the runtime thread in a tensor's deallocation, waiting for the GIL. With the collector paused,
    no collection starts inside the call.

    The walk up the stack stays inside the pause too: each `f_back` makes the frame object of a
    frame still running on the other thread, and a collection started by that allocation may run
    a finalizer that releases the GIL. The other thread may then return from that very frame while
    its object is being made, which is then left pointing into the other thread's freed stack: the
    process's memory is corrupted (a rank's progress task once read a list where the frame was,
    and the worker died of SIGSEGV moments later). Paused, nothing runs Python code inside the
    walk's allocations, and between its bytecodes the other thread may return only from frames
    whose objects are complete, which the interpreter handles."""
    files: list[str] = []
    with collector_paused():
        frame = sys._current_frames().get(ident) if ident is not None else None
        while frame is not None and len(files) < limit:
            files.append(frame.f_code.co_filename)
            frame = frame.f_back
        del frame
    return files


def live_instances(*classes: type) -> list[Any]:
    """The objects the garbage collector tracks whose type is one of `classes` or a subclass of one.

    `gc.get_objects()` also returns tuples another thread is still building (CPython 3.11): one
    that resumes while a reference from that list is alive fails in `_PyTuple_Resize` with a
    SystemError (it killed ranks' runtime loops). The interpreter may switch threads whenever
    Python code runs, even between a call's return and the next statement, so the list never
    reaches Python code: `_scan` is a lazy pipeline of C iterators that fetches, filters and drops
    it inside the one `list()` call that runs it, with the collector off (a collection would run
    finalizers and weakref callbacks meanwhile)."""

    kinds: set[type] = set()
    todo = list(classes)
    while todo:
        cls = todo.pop()
        if cls not in kinds:
            kinds.add(cls)
            todo += cls.__subclasses__()
    scan = _scan({id(k) for k in kinds})
    with collector_paused():
        return list(scan)


def _scan(type_ids: set[int]) -> Iterator[Any]:
    """The objects whose type's id is in `type_ids`, as a lazy pipeline: `gc.get_objects()` is
    called by `map` when first iterated; `repeat` hands the list on twice, to `compress` (the
    objects) and to a chain of `map`s (their types' ids, looked up: a type itself is not hashed,
    since a metaclass's `__hash__` or `__eq__` would be Python code). Once exhausted nothing holds
    the list: the pipeline's own objects are in it, so a `tee` buffering it, or anything else
    still holding it or its last items, would form a cycle that keeps it alive until a collection."""
    import gc
    from itertools import chain, compress, repeat

    lists = chain.from_iterable(map(repeat, map(gc.get_objects, repeat(None, 1)), repeat(2)))
    wanted = map(map, repeat(type_ids.__contains__), map(map, repeat(id), map(map, repeat(type), lists)))
    return chain.from_iterable(map(compress, lists, wanted))


@dataclass(frozen=True)
class AdapterTopology:
    """This rank's view of the parallel layout, in global ranks.

    `replica_group`: the ranks holding bitwise-identical state to ours after each step (ours included).
    `dims`: for each named parallel dimension, the ranks of our group along it.
    `replicated_dims`: names of the dimensions along which state is identical.
    `peer_group`: the ranks doing the same work as ours each step (same model part, same
    collectives), whether or not they hold the same state: every rank of an FSDP2/TP mesh. Empty:
    the replica group.
    """

    replica_group: tuple[int, ...]
    dims: dict[str, tuple[int, ...]] = field(default_factory=dict)
    replicated_dims: tuple[str, ...] = ()
    source: str = ""
    peer_group: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepTimes:
    """Phase durations of one optimizer step, in seconds, measured on the training thread."""

    step: int
    step_s: float
    input_s: float
    compute_s: float
    comm_s: float
    optimizer_s: float


StepSink = Callable[[StepTimes], None]


class FrameworkAdapter(Protocol):
    name: str

    def topology(self) -> AdapterTopology: ...

    def attach(self, on_step: StepSink) -> None:
        """Install hooks; call `on_step` on the training thread after every optimizer step."""
        ...

    def note_input_time(self, seconds: float) -> None:
        """Time spent in an instrumented data loader's next() since the last step."""
        ...

    def note_own_time(self, seconds: float) -> None:
        """Time the library spent on the training thread between two steps (a capture taken as the
        next step fetches its batch): not the script's input time."""
        ...

    def note_excused_time(self, seconds: float) -> None:
        """Time the loop spent in marked checkpoint I/O between two steps: not its input time.
        Optional: an adapter without it (one of a policy's `adapter = "pkg.mod:factory"`) counts
        that time as input."""
        ...

    def detach(self) -> None:
        """Remove every hook this adapter installed. Idempotent."""
        ...


def uncompiled(module: Any) -> Any:
    """The module under `torch.compile`'s wrappers (`OptimizedModule._orig_mod`, repeatedly).

    Its state_dict keys are the plain model's (no `_orig_mod.` prefix), so a capture restores into
    the model with or without compile; hooks that must run eagerly stay on the wrapper."""
    while type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        module = module._orig_mod
    return module


def _tp_under_ddp(module: Any) -> bool:
    """Whether `module` is a DDP over a tensor-parallel model (`DDP(model, device_mesh=dp)`, `dp` a
    slice of a 2-D mesh). Torch then swaps each tensor-parallel parameter for a DTensor attribute in
    every forward (`_pre_dp_module_transform`) and its forward hook never registers it back: after
    the first forward the model's `parameters()` and `state_dict()` lack them (torch 2.x), while DDP
    and the optimizer still train them."""
    mesh = getattr(module, "device_mesh", None)
    if mesh is None or not isinstance(getattr(module, "_module_parameters", None), list):
        return False
    ddp = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    return ddp is not None and isinstance(module, ddp)


def parameters_of(module: Any) -> list[Any]:
    """`module.parameters()` (under `torch.compile`'s wrappers), the ones a DDP over a tensor-parallel
    model trains included (see `_tp_under_ddp`): DDP's own list, in the model's order, then those it
    was told to ignore; the same list before the first forward and after."""
    m = uncompiled(module)
    if not _tp_under_ddp(m):
        return list(m.parameters())
    kept = list(m._module_parameters)
    ids = {id(p) for p in kept}
    return kept + [p for p in m.parameters() if id(p) not in ids]


def unregistered_parameters(module: Any) -> dict[str, Any]:
    """Of a DDP over a tensor-parallel model (see `_tp_under_ddp`), each parameter its forward took
    out of the model's registry, by its `state_dict()` key: the parameter DDP and the optimizer hold
    (this rank's local shard, which the DTensor left in its place views). Empty for any other
    module, and before the first forward. Before, a capture after the first step lacked them, and
    every restore refused it (the model's keys missing from the checkpoint): outsider 43's DDP + TP
    job gave up after a hang."""
    m = uncompiled(module)
    if not _tp_under_ddp(m):
        return {}
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return {}
    held = {(p.untyped_storage().data_ptr(), tuple(p.shape)): p for p in m._module_parameters}
    out: dict[str, Any] = {}
    for prefix, sub in m.named_modules():
        for k, v in vars(sub).items():
            if isinstance(v, dtensor) and k not in sub._parameters:
                local = v._local_tensor
                p = held.get((local.untyped_storage().data_ptr(), tuple(local.shape)))
                if p is not None:
                    out[f"{prefix}.{k}" if prefix else k] = p
    return out


def named_parameters_of(module: Any) -> list[tuple[str, Any]]:
    """`module.named_parameters()`, the ones a DDP over a tensor-parallel model took out of the
    registry included (see `unregistered_parameters`)."""
    named = list(module.named_parameters())
    known = {id(p) for _, p in named}
    return named + [(k, p) for k, p in unregistered_parameters(module).items() if id(p) not in known]


def zero_partition(optimizer: Any) -> Any | None:
    """A ZeroRedundancyOptimizer's wrapped optimizer, which holds this rank's partition of the state
    (the wrapper's own `state_dict()` needs a collective consolidation first); None for others."""
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    return optimizer.optim if zero is not None and isinstance(optimizer, zero) else None


def is_compiled(module: Any) -> bool:
    """True when `module` or a module under a DDP/FSDP-style `.module` wrapper is torch.compile'd."""
    seen = 0
    while module is not None and seen < 8:
        if uncompiled(module) is not module:
            return True
        module, seen = getattr(module, "__dict__", {}).get("_modules", {}).get("module"), seen + 1
    return False


def is_dtensor(t: object) -> bool:
    """True for a DTensor (FSDP2, TP, HSDP): it has a local shard (`to_local`)."""
    return callable(getattr(t, "to_local", None))


# The torch settings of `numerics_settings`, in the order their values are gossiped.
NUMERICS_KEYS = (
    "tf32_matmul",
    "tf32_cudnn",
    "matmul_precision",
    "deterministic",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "default_dtype",
)


def numerics_settings() -> str:
    """The process-wide torch settings that change what a replica computes, as their values
    joined by "," in the order of NUMERICS_KEYS (some 30 bytes, gossiped every heartbeat): TF32 in
    matmuls and convolutions, float32 matmul precision, deterministic algorithms, cuDNN's
    determinism and autotuning, the default dtype. Replicas must share them to agree bit for bit;
    one set differently (a node started with another environment, a script that flips one on
    some ranks) is a config drift."""
    import torch

    b = torch.backends
    return ",".join(
        (
            str(int(b.cuda.matmul.allow_tf32)),
            str(int(b.cudnn.allow_tf32)),
            torch.get_float32_matmul_precision(),
            str(int(torch.are_deterministic_algorithms_enabled())),
            str(int(b.cudnn.deterministic)),
            str(int(b.cudnn.benchmark)),
            str(torch.get_default_dtype()).removeprefix("torch."),
        )
    )
