"""Framework auto-detection, in the documented order:
DeepSpeed engine, TorchTitan trainer, a list/tuple of Megatron model chunks, an `nn.Module`.

Detection is by duck typing on the object's class and module, so it never imports DeepSpeed,
Megatron or TorchTitan (importing them costs seconds).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FRAMEWORKS", "detect_framework"]

FRAMEWORKS = ("pytorch", "torchtitan", "megatron", "deepspeed")


def _module_of(obj: Any) -> str:
    return type(obj).__module__ or ""


def _mro_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def detect_framework(model: Any) -> str:
    """Return the framework name for `model`. Raises TypeError for an object we cannot place."""
    names = _mro_names(model)
    module = _module_of(model)
    if "DeepSpeedEngine" in names or module.startswith("deepspeed."):
        return "deepspeed"
    if module.startswith("torchtitan.") or ("Trainer" in names and hasattr(model, "model_parts")):
        return "torchtitan"
    import torch.nn as nn

    if isinstance(model, (list, tuple)):
        return "megatron"  # its chunks are checked by the adapter, which names a bad one
    if isinstance(model, nn.Module):
        return "pytorch"
    raise TypeError(
        f"cannot detect the framework of a {type(model).__qualname__}: expected a DeepSpeed engine, a "
        "TorchTitan trainer, a list of Megatron model chunks or a torch.nn.Module"
    )
