"""What every framework adapter provides to the session."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["AdapterTopology", "FrameworkAdapter", "StepTimes", "is_dtensor", "live_instances"]


def live_instances(*classes: type) -> list[Any]:
    """The objects the garbage collector tracks whose type is one of `classes` or a subclass of one.

    `gc.get_objects()` also returns tuples another thread is still building (CPython 3.11): one
    that resumes while a reference from that list is alive fails in `_PyTuple_Resize` with a
    SystemError (it killed a rank's runtime loop once). The list is filtered by C code alone
    (no bytecode, so no switch to another thread) and dropped at once."""
    import gc
    from itertools import compress

    kinds: set[type] = set()
    todo = list(classes)
    while todo:
        cls = todo.pop()
        if cls not in kinds:
            kinds.add(cls)
            todo += cls.__subclasses__()
    objs = gc.get_objects()
    found = list(compress(objs, map(kinds.__contains__, map(type, objs))))
    del objs
    return found


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
