"""Mixed precision with a loss scaler (`torch.amp.GradScaler`, also `torch.cuda.amp.GradScaler`).

A GradScaler multiplies the loss by its scale, skips `optimizer.step()` when the unscaled gradients
hold an inf or a NaN, and in `update()` halves the scale after a skip (doubles it after
`growth_interval` clean steps). Two things follow for a resiliency library:

- Its scale and growth tracker are training state. A restart without them starts from the initial
  scale again, skips other steps than the uninterrupted run did, and is not bitwise that run.
- A step it skipped is a step of the loop (the loop counts it, as DeepSpeed and Megatron count
  theirs): `step_count` counts it too, and the step ends (captures, SCOUT's checks) happen on it, or
  a resumed loop would start at another iteration than the one its state belongs to.

So the scaler of the job is found when the session starts (like its scheduler), captured without a
device sync (its scale is a tensor; `state_dict()` would read it with `.item()`), and watched: when
its `step()` did not run the optimizer's, our own optimizer hooks run as for a step that changed
nothing, and its `update()` is one of the calls that end a step (GEMINI captures after it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lm_resiliency.adapters.base import live_instances

__all__ = [
    "ScalerWatch",
    "find_grad_scalers",
    "load_scaler_state",
    "mark_ours",
    "scaler_state",
    "scaler_values",
]

log = logging.getLogger(__name__)

# Ids of the optimizer step hooks this library registered (handle ids are unique in the process):
# the ones a skipped step runs. A user's own hooks never see a step that did not happen.
_OURS: set[int] = set()


def mark_ours(handle: Any) -> Any:
    """Register `handle` (of an optimizer step pre- or post-hook) as ours; returns it."""
    _OURS.add(handle.id)
    return handle


def run_skipped_step(optimizer: Any) -> None:
    """The loss scaler skipped `optimizer.step()`: our pre- then post-hooks run, in the order they
    were registered, as for a step that left parameters and optimizer state as they were."""
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        for hook_id, hook in list(getattr(optimizer, name, {}).items()):
            if hook_id in _OURS:
                hook(optimizer, (), {})


def _scaler_type() -> type | None:
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:  # pragma: no cover - torch without amp
        return None
    return GradScaler


def find_grad_scalers() -> list[Any]:
    """The enabled GradScalers of this process (a disabled one scales nothing and skips nothing),
    looked up among the objects the garbage collector tracks."""
    kind = _scaler_type()
    if kind is None:
        return []
    return [obj for obj in live_instances(kind) if obj.is_enabled()]


def scaler_state(scaler: Any) -> dict[str, Any]:
    """The scaler's state as its `state_dict()` has it, but with the scale and the growth tracker
    as the tensors they live in (captured by the same copy as the parameters, no `.item()` sync);
    before its first `scale()` they do not exist yet and their initial values are taken."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    try:
        return {
            "scale": scale if scale is not None else float(scaler._init_scale),
            "growth_factor": float(scaler._growth_factor),
            "backoff_factor": float(scaler._backoff_factor),
            "growth_interval": int(scaler._growth_interval),
            "_growth_tracker": tracker if tracker is not None else int(scaler._init_growth_tracker),
        }
    except AttributeError:  # a torch whose scaler keeps these elsewhere: its own (syncing) state_dict
        return dict(scaler.state_dict())


def scaler_values(state: Any) -> dict[str, Any]:
    """What `scaler_state` captured, as the plain values `load_state_dict` takes (bitwise: a float32
    scale goes through a Python float exactly); no tensor of it is kept (they may view a slot)."""
    if not isinstance(state, dict) or "scale" not in state:
        raise ValueError(f"scaler: expected a GradScaler state with a 'scale', got {type(state).__name__}")
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def load_scaler_state(scaler: Any, state: Any) -> None:
    """Restore what `scaler_state` captured."""
    scaler.load_state_dict(scaler_values(state))


class ScalerWatch:
    """Watches one GradScaler stepping one optimizer (see the module's docstring).

    `on_update` is called after each `scaler.update()`. The scaler's class is swapped for a
    subclass of it for as long as the watch lives (patching the instance would put functions into
    what pickling a scaler saves); `remove()` puts it back."""

    def __init__(self, scaler: Any, optimizer: Any, on_update: Callable[[], None] | None = None) -> None:
        from lm_resiliency.adapters.chain import members_of

        self.scaler, self.optimizer = scaler, optimizer
        self.on_update = on_update
        self.skipped = 0  # steps the scaler skipped since the watch began
        self._stepped = False
        # An OptimizerChain's members are stepped by the scaler one by one: each is watched.
        members = members_of(optimizer)
        self._handles = [m.register_step_post_hook(self._mark_stepped) for m in members]
        base = type(scaler)
        watch = self

        def step(this: Any, opt: Any, *args: Any, **kwargs: Any) -> Any:
            if not any(opt is m for m in members) or not this.is_enabled():
                return super(watched, this).step(opt, *args, **kwargs)  # type: ignore[misc, arg-type]
            watch._stepped = False
            out = super(watched, this).step(opt, *args, **kwargs)  # type: ignore[misc, arg-type]
            if not watch._stepped:
                watch.skipped += 1
                run_skipped_step(opt)
            return out

        def update(this: Any, *args: Any, **kwargs: Any) -> Any:
            out = super(watched, this).update(*args, **kwargs)  # type: ignore[misc, arg-type]
            if watch.on_update is not None:
                watch.on_update()
            return out

        methods = {"step": step, "update": update, "__module__": base.__module__}
        watched = type(base.__name__, (base,), methods)
        scaler.__class__ = watched
        self._base = base

    def _mark_stepped(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True

    def remove(self) -> None:
        """Stop watching (idempotent). The subclass lives on until the garbage collector takes it:
        it must not keep the scaler alive (a later session would find two)."""
        for h in self._handles:
            h.remove()
        if self.scaler is not None and type(self.scaler).__bases__ == (self._base,):
            self.scaler.__class__ = self._base
        self.scaler = self.optimizer = self.on_update = None
