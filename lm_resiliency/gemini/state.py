"""Training state <-> (msgpack skeleton, list of tensors).

`collect_state` gathers model, optimizer, scheduler, loss scaler, RNG (torch CPU and CUDA, Python,
NumPy), the caller's extra state, and which parameters hold a gradient tensor (see `grads_held`).
`flatten` replaces every tensor by a reference, so the skeleton is small msgpack and the tensors
can be copied byte for byte into shared memory; `unflatten` reverses it exactly (tuples stay
tuples, int dict keys stay ints). Unsupported objects fail with the path to them.

Sharded state (DTensor: FSDP2, TP, HSDP) is captured as this rank's local shard plus the global shape
and placements. It comes back as a `LocalShard`, and `apply_state` turns each one into a DTensor
on the live model's mesh and placements (the parameter's, for optimizer state), after checking that
the shape and placements are the ones captured: a rank restores exactly its own shard, bitwise.
"""

from __future__ import annotations

import io
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import msgpack
import numpy as np
import torch

from lm_resiliency.adapters.amp import load_scaler_state, scaler_state
from lm_resiliency.adapters.base import parameters_of, uncompiled, unregistered_parameters, zero_partition
from lm_resiliency.adapters.chain import OptimizerChain
from lm_resiliency.errors import CheckpointMismatchError

__all__ = [
    "LocalShard",
    "TensorSpec",
    "aligned",
    "apply_state",
    "check_fits",
    "collect_state",
    "decode_payload",
    "flatten",
    "load_optimizer_state",
    "loader_positions",
    "materialize",
    "rng_state",
    "unflatten",
]

log = logging.getLogger(__name__)

SKELETON_VERSION = 1
ALIGN = 64  # each tensor's bytes start on a multiple of this in a capture's payload


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LocalShard:
    """A captured DTensor: this rank's local tensor, the global shape and the placements."""

    local: torch.Tensor
    shape: tuple[int, ...]
    placements: str


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def _rebuild(value: LocalShard, template: Any, where: str) -> Any:
    """A DTensor like `template` (mesh, placements, global shape) holding the captured shard."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(template, dtensor):
        raise ValueError(f"{where}: the checkpoint holds a sharded tensor, the live job a plain one")
    got = (tuple(template.shape), str(tuple(template.placements)))
    if got != (value.shape, value.placements):
        raise ValueError(
            f"{where}: captured with shape {value.shape} {value.placements}, "
            f"the live job has {got[0]} {got[1]}"
        )
    local = value.local.to(template.to_local().device)
    return dtensor.from_local(
        local,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


def _holder(optimizer: Any) -> Any:
    """The optimizer whose `state_dict()` a capture takes: ZeRO's partition, else the optimizer."""
    if optimizer is None:
        return None
    partition = zero_partition(optimizer)
    return optimizer if partition is None else partition


def _resolve_shards(
    state: dict[str, Any], model: torch.nn.Module, optimizer: Any, live: dict[str, Any] | None = None
) -> None:
    """Replace every LocalShard in `state` by a DTensor on the live job's mesh (in place); `live`:
    the model's `state_dict()` when the caller has it already."""
    model_state = state.get("model")
    if isinstance(model_state, dict) and any(isinstance(v, LocalShard) for v in model_state.values()):
        live = model.state_dict() if live is None else live
        for k, v in model_state.items():
            if isinstance(v, LocalShard):
                model_state[k] = _rebuild(v, live.get(k), f"model.{k}")
    opt_state = state.get("optimizer")
    if optimizer is None or not isinstance(opt_state, dict) or not isinstance(opt_state.get("state"), dict):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, entry in opt_state["state"].items():
        if not isinstance(entry, dict):
            continue
        for k, v in entry.items():
            if isinstance(v, LocalShard):
                param = params[pid] if isinstance(pid, int) and 0 <= pid < len(params) else None
                entry[k] = _rebuild(v, param, f"optimizer.state[{pid}].{k}")


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, LocalShard):
        return LocalShard(obj.local.clone(), obj.shape, obj.placements)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tree(v) for v in obj)
    return obj


def _into(value: Any, live: Any, device: torch.device | None = None) -> Any:
    """`value` (a view into a checkpoint buffer) as a tensor of our own: copied into the live tensor
    it replaces when that has the same shape and dtype (no new memory, no page faults), else copied
    to `device` when that is another one (where the optimizer's `load_state_dict` would move it),
    else cloned."""
    if isinstance(value, LocalShard):
        local = live.to_local() if callable(getattr(live, "to_local", None)) else None
        return LocalShard(_into(value.local, local, device), value.shape, value.placements)
    if not isinstance(value, torch.Tensor):
        return _clone_tree(value)
    if value.layout != torch.strided:
        return value.to(device) if device is not None and device != value.device else value.clone()
    if (
        isinstance(live, torch.Tensor)
        and type(live) is torch.Tensor
        and live.shape == value.shape
        and live.dtype == value.dtype
        and live.is_contiguous()
    ):
        return live.copy_(value)
    if device is not None and device != value.device:
        # One copy, straight from the slot (page-locked on a GPU node) to the device: a clone in host
        # memory first would cost a page fault per 4 KiB and a second, pageable, copy.
        return value.to(device)
    return value.clone()


def _state_device(optimizer: Any, param: Any) -> torch.device | None:
    """Where `optimizer.load_state_dict` puts a parameter's state (other than "step"): the
    parameter's device, for optimizers that keep torch's own loading policy; None otherwise."""
    if isinstance(optimizer, OptimizerChain) and param is not None:  # its member loads it
        optimizer = optimizer.member_of(param)
    if param is None or type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return None
    to_local = getattr(param, "to_local", None)
    local = to_local() if callable(to_local) else param
    return local.device if isinstance(local, torch.Tensor) else None


def materialize(state: dict[str, Any], model: torch.nn.Module, optimizer: Any) -> None:
    """Make `state`, whose tensors view a checkpoint buffer, independent of it (in place), at the cost
    of one copy: the model's tensors stay views (`load_state_dict` copies them into the parameters),
    optimizer state is copied into the live optimizer's tensors where they exist (a resumed process
    that already stepped), else straight to its parameter's device when that is not the host, and
    everything else is cloned."""
    optimizer = _holder(optimizer)
    for key in list(state):
        if key not in ("model", "optimizer"):
            state[key] = _clone_tree(state[key])
    opt_state = state.get("optimizer")
    if not isinstance(opt_state, dict):
        return
    entries = opt_state.get("state")
    params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    for key in list(opt_state):
        if key != "state" or not isinstance(entries, dict):
            opt_state[key] = _clone_tree(opt_state[key])
    if not isinstance(entries, dict):
        return
    for pid, entry in entries.items():
        param = params[pid] if isinstance(pid, int) and 0 <= pid < len(params) else None
        live = optimizer.state.get(param, {}) if param is not None else {}
        if not isinstance(entry, dict):
            entries[pid] = _clone_tree(entry)
            continue
        device = _state_device(optimizer, param)
        for k, v in entry.items():
            # torch keeps "step" where it was saved (on the host) unless the group is fused or
            # capturable: the optimizer's own load_state_dict moves it when needed.
            entry[k] = _into(v, live.get(k), None if k == "step" else device)


def load_optimizer_state(optimizer: Any, saved: Any) -> None:
    """`optimizer.load_state_dict(saved)`, undoing the dtype cast of torch's own: it converts every
    floating state tensor but "step" to its parameter's dtype, so a float32 `mu_product` (NAdam) or
    a float32 master copy or moment that an optimizer keeps for a bfloat16 parameter came back
    bfloat16, and the resumed run (or a replay of the step) was not the uninterrupted one. The
    state keeps the dtype it was saved in (a copy, on the device the load chose). Optimizers that
    load their own way are left alone. An `OptimizerChain` loads each member's part so."""
    if isinstance(optimizer, OptimizerChain):
        for member, part in zip(optimizer.members, optimizer.split(saved), strict=True):
            load_optimizer_state(member, part)
        return
    optimizer.load_state_dict(saved)
    if type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return
    entries = saved.get("state") if isinstance(saved, dict) else None
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(entries, dict) or not isinstance(groups, list):
        return
    params = {
        pid: p
        for sg, g in zip(groups, optimizer.param_groups, strict=False)
        for pid, p in zip(sg.get("params", ()), g["params"], strict=False)
    }
    for pid, entry in entries.items():
        live = optimizer.state.get(params.get(pid)) if pid in params else None
        if not isinstance(entry, dict) or not isinstance(live, dict):
            continue
        for k, v in entry.items():
            now = live.get(k)
            if (
                type(v) is torch.Tensor
                and type(now) is torch.Tensor
                and v.dtype != now.dtype
                and v.shape == now.shape
            ):
                live[k] = v.to(device=now.device, copy=v.device == now.device)


class TensorSpec(NamedTuple):
    """A flattened tensor's dtype name, shape and size in bytes (a tuple: a capture makes one per
    tensor, thousands for a large model, on the training thread)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def rng_state() -> dict[str, Any]:
    """The process's random number generators' states: torch (CPU, and CUDA once initialised),
    Python's and NumPy's global ones."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def collect_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    extra_state_fn: Callable[[], Any] | None,
    step: int,
    scaler: Any = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"step": step, "model": model_state_dict(model), "rng": rng_state()}
    state["grads_held"] = grads_held(model)
    if optimizer is not None:
        # ZeRO: this rank's partition, which every restart of this rank restores (the partition is a
        # function of the parameters and the world size), and the wrapper's hyperparameters, which a
        # scheduler sets and the step hands to the partition.
        state["optimizer"] = _holder(optimizer).state_dict()
        if zero_partition(optimizer) is not None:
            state["zero_param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
            ]
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler_state(scaler)
    if extra_state_fn is not None:
        state["extra"] = extra_state_fn()
    return state


def model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """`model.state_dict()` (under `torch.compile`'s wrappers), with the tensor-parallel parameters a
    DDP over them took out of the registry (`unregistered_parameters`)."""
    state: dict[str, Any] = uncompiled(model).state_dict()
    for k, p in unregistered_parameters(model).items():
        state.setdefault(k, p.detach())
    return state


def grads_held(model: torch.nn.Module) -> torch.Tensor:
    """Which of the model's parameters (in `parameters()` order) hold a gradient tensor.

    A loop that zeroes with `zero_grad(set_to_none=False)` keeps a zero gradient on a parameter its
    step did not use (a task head, with `find_unused_parameters`), and optimizers step every
    parameter whose gradient is not None: Adam moves it by its moments and weight decay. A resumed
    process starts with no gradient at all, and skipped those parameters until they were used
    again: it ended off the uninterrupted run (outsider 40). `restore_grads` puts zero gradients
    back where they were held (the values do not matter: the loop zeroes them before its next
    backward, or they are already zero)."""
    return torch.tensor([p.grad is not None for p in parameters_of(model)], dtype=torch.bool)


def restore_grads(model: torch.nn.Module, held: Any) -> None:
    """Zero gradients on the parameters `held` (see `grads_held`) says held one, none on the others.
    A mask of another length (another model) is left alone: `check_fits` judged the model."""
    params = parameters_of(model)
    if not isinstance(held, torch.Tensor) or held.dtype != torch.bool or held.shape != (len(params),):
        return
    for p, has in zip(params, held.tolist(), strict=True):
        if has and p.grad is None:
            p.grad = torch.zeros_like(p)
        elif not has and p.grad is not None:
            p.grad = None


def loader_positions(saved: Any) -> dict[str, torch.Tensor]:
    """A capture's `loaders` entry (name -> {"torch": the global RNG state that instrumented
    loader's iterator was made at}) as name -> state; entries of any other shape are left out with
    a warning (they only make a resumed run's random numbers the uninterrupted run's)."""
    out: dict[str, torch.Tensor] = {}
    if saved is None:
        return out
    size = torch.get_rng_state().numel()
    for name, entry in saved.items() if isinstance(saved, dict) else [("?", saved)]:
        rng = entry.get("torch") if isinstance(entry, dict) else None
        if (
            isinstance(name, str)
            and isinstance(rng, torch.Tensor)
            and rng.dtype == torch.uint8
            and rng.shape == (size,)
        ):
            out[name] = rng.clone()
            continue
        log.warning("the capture's RNG state of loader %r is malformed: not used", name)
    return out


def check_fits(saved: Any, model: torch.nn.Module) -> dict[str, Any] | None:
    """Raise `CheckpointMismatchError` naming what differs when the captured model state does not
    fit `model` (a parameter or buffer missing, unexpected, of another shape or dtype): checked
    before anything is loaded, so a model changed under the same run id is told so, not left half
    restored by a size mismatch deep inside `load_state_dict`. Returns the live `state_dict()` it
    compared with (None for FSDP1, which is not checked here)."""
    if not isinstance(saved, dict):
        raise CheckpointMismatchError("the checkpoint holds no model state")
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
        return None  # its state_dict() gathers (collectives, memory): load_state_dict checks as it loads
    live = model_state_dict(model)
    problems = [f"{k} is missing from the checkpoint" for k in live if k not in saved]
    problems += [f"{k} is in the checkpoint, not in the model" for k in saved if k not in live]
    for k, v in saved.items():
        now = live.get(k)
        if not isinstance(now, torch.Tensor) or not isinstance(v, (torch.Tensor, LocalShard)):
            continue
        shape = tuple(v.shape)
        dtype = v.local.dtype if isinstance(v, LocalShard) else v.dtype
        if shape != tuple(now.shape) or dtype != now.dtype:
            problems.append(
                f"{k} is {list(shape)} {str(dtype).removeprefix('torch.')} in the checkpoint, "
                f"{list(now.shape)} {str(now.dtype).removeprefix('torch.')} in the model"
            )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointMismatchError("; ".join(problems[:3]) + more)
    return live


def apply_state(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    load_extra_state_fn: Callable[[Any], None] | None,
    scaler: Any = None,
) -> None:
    model = uncompiled(model)
    live = check_fits(state.get("model"), model)
    _resolve_shards(state, model, _holder(optimizer), live)
    unregistered = unregistered_parameters(model)  # (restored after a forward: see there)
    registered = {k: v for k, v in state["model"].items() if k not in unregistered}
    model.load_state_dict(registered)
    with torch.no_grad():
        for k, p in unregistered.items():
            p.copy_(state["model"][k])
    if "grads_held" in state and live is not None:  # (an older capture: not recorded; FSDP1 keeps its own)
        restore_grads(model, state["grads_held"])
    if optimizer is not None and "optimizer" in state:
        partition = zero_partition(optimizer)
        if (partition is None) != ("zero_param_groups" not in state):
            raise ValueError(
                "optimizer: the checkpoint was taken with"
                + (" a ZeroRedundancyOptimizer" if partition is None else "out ZeroRedundancyOptimizer")
                + f", the live optimizer is {type(optimizer).__name__}"
            )
        load_optimizer_state(_holder(optimizer), state["optimizer"])
        if partition is not None:
            for group, saved in zip(optimizer.param_groups, state["zero_param_groups"], strict=True):
                group.update(saved)
            cast(Any, optimizer)._sync_param_groups(optimizer.param_groups, partition.param_groups)
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and "scaler" in state:
        load_scaler_state(scaler, state["scaler"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if load_extra_state_fn is not None and "extra" in state:
        try:
            load_extra_state_fn(state["extra"])
        except Exception as exc:  # the caller's code: its error, with where it came from
            if hasattr(exc, "add_note"):  # (Python 3.11+)
                exc.add_note(
                    f"raised by load_extra_state_fn, restoring step {state.get('step', '?')}: it was "
                    f"given what extra_state_fn returned then ({_shape_of(state['extra'])})"
                )
            raise


def _shape_of(obj: Any) -> str:
    """A short account of a restored value: its type, and a dict's keys."""
    if isinstance(obj, dict):
        keys = list(obj)
        return f"a dict with keys {keys[:8]}{' ...' if len(keys) > 8 else ''}"
    return f"a {type(obj).__name__}"


def _plain_numbers(items: tuple[Any, ...] | list[Any]) -> bool:
    """Whether every item is a float or an int msgpack takes as it is (64 bits), checked in C where
    the items are all of one type (Python's RNG state: 625 ints, walked at every capture)."""
    kinds = set(map(type, items))
    if kinds == {int}:
        return bool(min(items) >= -(2**63) and max(items) < 2**64)
    if kinds <= {float}:
        return True
    return all(type(v) is float or (type(v) is int and -(2**63) <= v < 2**64) for v in items)


def _spell(path: Any) -> str:
    """A path `flatten` walked, as the error names it: the root's name, or (parent, ".", key) for
    a dict entry, (parent, "[]", key) for an item, (parent, "{}", member) for a set's member. Built
    as tuples and spelled only for an error: a capture walks thousands of entries."""
    parts = []
    while isinstance(path, tuple):
        path, how, key = path
        parts.append(f".{key}" if how == "." else f"[{key!r}]" if how == "[]" else f"{{{key!r}}}")
    return str(path) + "".join(reversed(parts))


def _plain_hint(obj: Any, where: str = "") -> str:
    """What to return instead of `obj` (from extra_state_fn, most likely): its plain state."""
    import dataclasses

    if "._extra_state" in where:  # a module's get_extra_state(), not the caller's extra_state_fn
        return (
            "return plain data from the module's get_extra_state() (dicts, lists, numbers, str, "
            "bytes, tensors, io.BytesIO) and rebuild the object in its set_extra_state()"
        )
    if isinstance(obj, torch.Generator):
        return "return its get_state() (a tensor) and set_state() it in load_extra_state_fn"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "return dataclasses.asdict() of it and rebuild it in load_extra_state_fn"
    if callable(getattr(obj, "state_dict", None)):
        return "return its state_dict() and load_state_dict() it in load_extra_state_fn"
    return (
        "return plain data (dicts, lists, tuples, sets, str, bytes, numbers, None, tensors, numpy "
        "arrays) and rebuild the object in load_extra_state_fn"
    )


def flatten(state: Any) -> tuple[bytes, list[torch.Tensor], list[TensorSpec]]:
    """Return (skeleton, tensors, specs). Tensors are detached, contiguous, on their own device."""
    tensors: list[torch.Tensor] = []
    specs: list[TensorSpec] = []
    dtensor = _dtensor_type()
    # The common case first, with as little Python per tensor as it takes: a model of a thousand
    # tensors is walked on the training thread at every capture.
    plain, strided = torch.Tensor, torch.strided
    dtype_names: dict[torch.dtype, str] = {}
    device_names: dict[torch.device, str] = {}

    def dense(obj: torch.Tensor, path: Any) -> dict[str, Any]:
        t = obj.detach() if obj.requires_grad else obj
        if t.layout != strided:
            raise TypeError(f"{_spell(path)}: only dense tensors can be checkpointed (got {t.layout})")
        if not t.is_contiguous():
            t = t.contiguous()
        dt, dev = t.dtype, obj.device
        name = dtype_names.get(dt)
        if name is None:
            name = dtype_names[dt] = str(dt).removeprefix("torch.")
        where = device_names.get(dev)
        if where is None:
            where = device_names[dev] = str(dev)
        tensors.append(t)
        specs.append(TensorSpec(name, tuple(t.shape), t.nbytes))
        return {"__t": len(tensors) - 1, "device": where}

    def walk(obj: Any, path: Any) -> Any:  # path: see _spell
        if type(obj) is plain and obj.layout == strided:
            return dense(obj, path)
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            if isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
                return {"__bigint": str(obj)}
            return obj
        if dtensor is not None and isinstance(obj, dtensor):
            local = walk(obj.to_local(), path)
            return {"__dt": local, "shape": list(obj.shape), "placements": str(tuple(obj.placements))}
        if isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo:
            # SGD's momentum for a sparse embedding's gradient: indices and values as they are
            # (coalesced or not), so the restored tensor is the same one, entry for entry.
            t = obj.detach()
            return {
                "__coo": walk(t._indices(), (path, ".", "indices")),
                "values": walk(t._values(), (path, ".", "values")),
                "shape": list(t.shape),
                "coalesced": t.is_coalesced(),
            }
        if isinstance(obj, torch.Tensor):
            return dense(obj, path)
        if isinstance(obj, np.ndarray):
            return {"__np": walk(torch.from_numpy(np.ascontiguousarray(obj)), path)}
        if isinstance(obj, np.generic):
            return walk(obj.item(), path)
        if isinstance(obj, io.BytesIO):
            # A module's get_extra_state() may return one (TransformerEngine's FP8 metadata, as
            # torch's distributed checkpoint takes it): its bytes, restored as a new one at 0.
            return {"__bytesio": obj.getvalue()}
        if isinstance(obj, (tuple, list)):
            if _plain_numbers(obj):
                items = list(obj)  # fast path: Python's RNG state is 625 ints, walked every capture
            else:
                items = [walk(v, (path, "[]", i)) for i, v in enumerate(obj)]
            return {"__tuple": items} if isinstance(obj, tuple) else items
        if isinstance(obj, (set, frozenset)):  # a caller's seen-sample ids and the like
            members = [walk(v, (path, "{}", v)) for v in sorted(obj, key=repr)]
            return {"__set": members, "frozen": isinstance(obj, frozenset)}
        if isinstance(obj, dict):
            if all(type(k) is str for k in obj) and not any(k.startswith("__") for k in obj):
                return {k: walk(v, (path, ".", k)) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(
                        f"{_spell(path)}: dict key {k!r} of type {type(k).__name__} cannot be checkpointed"
                    )
                items.append([k, walk(v, (path, "[]", k))])
            return {"__dict": items}
        raise TypeError(
            f"{_spell(path)}: objects of type {type(obj).__name__} cannot be checkpointed; "
            f"{_plain_hint(obj, _spell(path))}"
        )

    tree = walk(state, "state")
    skeleton = msgpack.packb({"v": SKELETON_VERSION, "tree": tree}, use_bin_type=True)
    return skeleton, tensors, specs


def unflatten(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
    doc = msgpack.unpackb(skeleton, raw=False, strict_map_key=False)
    if not isinstance(doc, dict) or doc.get("v") != SKELETON_VERSION:
        raise ValueError("checkpoint skeleton has an unknown version")

    def walk(obj: Any) -> Any:
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, dict):
            if "__t" in obj:
                t = tensors[obj["__t"]]
                device = obj.get("device", "cpu")
                return t if device == "cpu" else t.to(device)
            if "__np" in obj:
                return walk(obj["__np"]).numpy()
            if "__coo" in obj:
                values = walk(obj["values"])
                return torch.sparse_coo_tensor(
                    walk(obj["__coo"]).to(values.device),
                    values,
                    tuple(obj["shape"]),
                    is_coalesced=bool(obj["coalesced"]),
                    check_invariants=True,  # indices within the shape: a bad copy raises, never crashes
                )
            if "__dt" in obj:
                return LocalShard(walk(obj["__dt"]), tuple(obj["shape"]), str(obj["placements"]))
            if "__tuple" in obj:
                return tuple(walk(v) for v in obj["__tuple"])
            if "__set" in obj:
                members = [walk(v) for v in obj["__set"]]
                return frozenset(members) if obj.get("frozen") else set(members)
            if "__dict" in obj:
                return {k: walk(v) for k, v in obj["__dict"]}
            if "__bigint" in obj:
                return int(obj["__bigint"])
            if "__bytesio" in obj:
                return io.BytesIO(obj["__bytesio"])
            return {k: walk(v) for k, v in obj.items()}
        return obj

    return walk(doc["tree"])


def decode_payload(payload: memoryview, index_len: int) -> Any:
    """The state a capture's payload holds (`index_len`: its header's), with its tensors views of
    `payload`: no copy yet (`materialize` then `apply_state` copy them into the live ones)."""
    skeleton, raw_specs = msgpack.unpackb(bytes(payload[:index_len]), raw=False)
    specs = [TensorSpec(d, tuple(s), n) for d, s, n in raw_specs]
    tensors: list[torch.Tensor] = []
    off = aligned(index_len)
    for spec in specs:
        dt = dtype_from_name(spec.dtype)
        if spec.nbytes == 0:
            tensors.append(torch.empty(spec.shape, dtype=dt))
        else:
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=spec.nbytes, offset=off)
            tensors.append(raw.view(dt).reshape(spec.shape))
        off += aligned(spec.nbytes)
    return unflatten(skeleton, tensors)


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint")
    return dt
