"""DeepSpeed: the engine `deepspeed.initialize` returns first, passed as the session's model.

`enable_resiliency(engine)` (or `framework="deepspeed"`) takes apart what the engine owns, and the
PyTorch adapter does the rest (as for Megatron's chunks):

- the model is `engine.module` (the engine's forward runs its forward: our hooks fire there);
- the optimizer is the torch optimizer the engine steps at each gradient-accumulation boundary
  (`engine.optimizer`); its step is the session's step, as `engine.global_steps` counts it;
- the scheduler is `engine.lr_scheduler` (DeepSpeed's own, WarmupLR and the like, or a torch one);
- the replica group is the engine's data-parallel group (`engine.data_parallel_group`): its ranks
  hold the same weights, and SCOUT compares them;
- the engine's progress counters (`global_steps`, `global_samples`, `skipped_steps`,
  `micro_steps`) are captured with the caller's state and restored, and a capture waits for
  `engine.step()` to return: the engine steps its scheduler and bumps its counters inside it,
  after the optimizer's step.

DeepSpeed's gradient all-reduce goes through `torch.distributed` (its communication backend calls
it), so SCOUT sees it as the step's collective: its time is the step's communication, and a rank
that never enters it is named by the hang check.

Not yet: ZeRO stages 1-3 (each rank holds a partition of the optimizer state in flat buffers, and
gradients are reduce-scattered into them), fp16 and bf16 (the engine's optimizer wrappers keep fp32
master weights outside the torch optimizer) and the pipeline engine (`train_batch()`). They are
refused by name, naming what works, rather than captured without part of their state. Detection is
duck-typed: DeepSpeed is never imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_resiliency.errors import UnsupportedFrameworkError

__all__ = ["ENGINE_COUNTERS", "EngineParts", "engine_parts", "engine_progress", "restore_progress"]

# The engine's counters of the training's progress (DeepSpeed's own checkpoints keep the first
# three); `_unmanaged_backward_count` only exists where the caller owns the accumulation boundary.
ENGINE_COUNTERS = (
    "global_steps",
    "global_samples",
    "skipped_steps",
    "micro_steps",
    "_unmanaged_backward_count",
)

# Where the engine keeps its own key in the caller's state (see `with_progress`).
_KEY = "deepspeed_engine"


@dataclass
class EngineParts:
    engine: Any
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    group: Any  # the data-parallel process group (None: the default group)


def _names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def engine_parts(engine: Any) -> EngineParts:
    """What the session holds of `engine`; `UnsupportedFrameworkError` for what it cannot hold yet,
    `TypeError` for what is no DeepSpeed engine."""
    module = getattr(engine, "module", None)
    if not isinstance(engine, nn.Module) or not isinstance(module, nn.Module):
        raise TypeError(
            f"framework 'deepspeed' takes the engine deepspeed.initialize() returns first, got "
            f"{type(engine).__name__}"
        )
    works = (
        "this version captures DeepSpeed's data-parallel engine in fp32 with ZeRO stage 0 and a torch "
        "optimizer; or wrap the torch module and optimizer with framework='pytorch'"
    )
    if "PipelineEngine" in _names(engine):
        raise UnsupportedFrameworkError(f"DeepSpeed's pipeline engine is not captured yet: {works}")
    zero_stage = getattr(engine, "zero_optimization_stage", None)
    stage = int(zero_stage()) if callable(zero_stage) else 0
    if stage:
        raise UnsupportedFrameworkError(
            f"DeepSpeed ZeRO stage {stage} is not captured yet (each rank's optimizer state is a "
            f"partition in flat buffers): {works}"
        )
    for what in ("fp16", "bfloat16"):
        enabled = getattr(engine, f"{what}_enabled", None)
        if callable(enabled) and enabled():
            raise UnsupportedFrameworkError(
                f"DeepSpeed with {what} is not captured yet (its optimizer wrapper keeps fp32 master "
                f"weights outside the torch optimizer): {works}"
            )
    opt = getattr(engine, "optimizer", None)
    if opt is not None and not isinstance(opt, torch.optim.Optimizer):
        raise UnsupportedFrameworkError(
            f"the engine's optimizer is a {type(opt).__name__}, not a torch optimizer: {works}"
        )
    return EngineParts(
        engine=engine,
        module=module,
        optimizer=opt,
        scheduler=getattr(engine, "lr_scheduler", None),
        group=getattr(engine, "data_parallel_group", None),
    )


def engine_progress(engine: Any) -> dict[str, int]:
    """The engine's progress counters, as plain ints."""
    return {k: int(getattr(engine, k)) for k in ENGINE_COUNTERS if hasattr(engine, k)}


def restore_progress(engine: Any, saved: Any) -> None:
    """Set the counters `engine_progress` captured; a clear error for anything else."""
    if not isinstance(saved, Mapping) or not all(
        isinstance(k, str) and k in ENGINE_COUNTERS and type(v) is int and v >= 0 for k, v in saved.items()
    ):
        raise ValueError(
            f"deepspeed: the checkpoint's engine counters are not {list(ENGINE_COUNTERS)} as "
            f"non-negative ints: {saved!r}"
        )
    for k, v in saved.items():
        if hasattr(engine, k):
            setattr(engine, k, v)


def with_progress(
    engine: Any, get: Callable[[], Any] | None, put: Callable[[Any], None] | None
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """The caller's `extra_state_fn` / `load_extra_state_fn` with the engine's counters beside
    their state: `{"deepspeed_engine": counters, "caller": their state}`."""

    def get_both() -> Any:
        out: dict[str, Any] = {_KEY: engine_progress(engine)}
        if get is not None:
            out["caller"] = get()
        return out

    def put_both(saved: Any) -> None:
        if not isinstance(saved, Mapping) or _KEY not in saved:
            raise ValueError(
                "deepspeed: the checkpoint holds no engine counters (it was not taken from a "
                "DeepSpeed engine's session)"
            )
        restore_progress(engine, saved[_KEY])
        if put is not None and "caller" in saved:
            put(saved["caller"])

    return get_both, put_both
