"""Megatron-style model chunks: a list (or tuple) of modules, one per virtual pipeline stage.

Megatron Core hands its training loop `model` as a list of chunks, each usually wrapped in a
data-parallel module, and calls them one by one (the pipeline schedule decides the order). The
session sees them as one `ModelChunks` module: its state is every chunk's (keys `0.*`, `1.*`, ...),
its parameters are every chunk's, and a hook registered on it is registered on every chunk, so the
step's first forward, whichever chunk runs it, opens the step. From there the PyTorch adapter does
the rest: chunks wrapped in torch's DistributedDataParallel reduce through our canonical comm hook
(a resumed run is bitwise), and their process group is the replica group.

The optimizer is a torch optimizer over the chunks' parameters. Megatron's own optimizer wrappers
(`Float16OptimizerWithFloat16Params`, `DistributedOptimizer`, `ChainedOptimizer`) keep fp32 main
parameters and sharded state outside the torch optimizer's `state_dict()`; capturing them needs
their own state API on a GPU, and they are refused by name rather than restored without their
main parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["MEGATRON_OPTIMIZER_WRAPPERS", "ModelChunks", "model_chunks", "refuse_megatron_optimizer"]

MEGATRON_OPTIMIZER_WRAPPERS = ("MegatronOptimizer", "MixedPrecisionOptimizer", "ChainedOptimizer")


class _Handles:
    """The handles of one hook registered on every chunk: removed together."""

    def __init__(self, handles: Iterable[Any]) -> None:
        self._handles = list(handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> _Handles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class ModelChunks(nn.ModuleList):
    """Model chunks as one module. Not callable (the schedule calls the chunks); hooks fan out."""

    def register_forward_pre_hook(self, hook: Callable[..., Any], **kwargs: Any) -> Any:
        return _Handles(chunk.register_forward_pre_hook(hook, **kwargs) for chunk in self)

    def register_forward_hook(self, hook: Callable[..., Any], **kwargs: Any) -> Any:
        return _Handles(chunk.register_forward_hook(hook, **kwargs) for chunk in self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("model chunks are called one by one (each chunk is a module), not as a whole")


def model_chunks(model: Any) -> ModelChunks:
    """`model` (a list or tuple of chunks, or one module: a single chunk) as a `ModelChunks`."""
    if isinstance(model, ModelChunks):
        return model
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("framework 'megatron': the list of model chunks is empty")
    for i, c in enumerate(chunks):
        if not isinstance(c, nn.Module):
            raise TypeError(
                f"framework 'megatron': model chunk {i} is not an nn.Module (got {type(c).__name__})"
            )
    if len({id(c) for c in chunks}) != len(chunks):
        raise ValueError("framework 'megatron': the same module is listed as two model chunks")
    return ModelChunks(chunks)


def refuse_megatron_optimizer(optimizer: Any) -> None:
    """A Megatron optimizer wrapper: refused, naming what to do (see the module's docstring)."""
    names = {c.__name__ for c in type(optimizer).__mro__}
    if names & set(MEGATRON_OPTIMIZER_WRAPPERS) or type(optimizer).__module__.startswith("megatron."):
        raise TypeError(
            f"framework 'megatron': {type(optimizer).__name__} is a Megatron optimizer wrapper; this "
            "version captures a torch optimizer over the chunks' parameters (fp32 training). A "
            "wrapper's fp32 main parameters and sharded state are not in the torch optimizer's "
            "state_dict, and restoring without them would not be bitwise"
        )
