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

ZeRO stages 1 and 2 (`ZeroView`): each rank holds a partition of the optimizer state and of the fp32
master weights in flat buffers. Each rank's capture holds its own partition (its `state_dict()`
but for what is no plain data: its loss scaler object, which in fp32 is the static one, and the
slice mappings of universal checkpoints), and a restore gives each rank its own back
(`load_from_fp32_weights`, so the master weights are the saved ones, not rounded from the model's).
The step the session sees is the ZeRO optimizer's whole `step()`, which ends after the updated
partitions were gathered into every rank's parameters: SCOUT compares those (replicated), not the
gradients or the optimizer state (partitions, different on every rank).

In bf16 the same holds (the master weights and state are fp32 partitions, the parameters bf16); the
`BF16_Optimizer` DeepSpeed steps for ZeRO-1 in bf16 with fp32 gradient accumulation partitions them
as ZeRO-1 does and is held the same way.

Not yet: ZeRO stage 3 (the parameters are partitioned too), fp16 (a dynamic loss scale and fp32
master weights in the engine's optimizer wrapper), bf16 with ZeRO stage 0 where the engine keeps
its fp32 master weights in an `FP16_UnfusedOptimizer`, an
elastic ZeRO checkpoint layout (`elastic_checkpoint`: a restore needs every rank's partition) and
the pipeline engine (`train_batch()`). They are refused by name, naming what works, rather than
captured without part of their state. Detection is duck-typed: DeepSpeed is never imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_resiliency.adapters.chain import StepHooks
from lm_resiliency.errors import UnsupportedFrameworkError

__all__ = [
    "ENGINE_COUNTERS",
    "EngineParts",
    "ZeroView",
    "engine_parts",
    "engine_progress",
    "restore_progress",
    "tap_contributions",
]

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
    optimizer: Any  # a torch optimizer (ZeRO stage 0 in fp32) or a ZeroView (a partitioned one)
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
        "this version captures DeepSpeed's data-parallel engine with a torch optimizer, in fp32 with "
        "ZeRO stage 0, 1 or 2, or in bf16 with ZeRO stage 1 or 2; or wrap the torch module and "
        "optimizer with framework='pytorch'"
    )
    if "PipelineEngine" in _names(engine):
        raise UnsupportedFrameworkError(f"DeepSpeed's pipeline engine is not captured yet: {works}")
    zero_stage = getattr(engine, "zero_optimization_stage", None)
    stage = int(zero_stage()) if callable(zero_stage) else 0
    if stage > 2:
        raise UnsupportedFrameworkError(
            f"DeepSpeed ZeRO stage {stage} is not captured yet (the parameters are partitioned too): {works}"
        )
    opt = getattr(engine, "optimizer", None)
    # bf16 is held where its fp32 master weights are partitions (ZeRO-1/2's optimizer, or the
    # BF16_Optimizer of ZeRO-1 with fp32 gradient accumulation); not in an FP16_UnfusedOptimizer.
    partitioned = stage > 0 or "BF16_Optimizer" in _names(opt)
    for what in ("fp16", "bfloat16"):
        enabled = getattr(engine, f"{what}_enabled", None)
        if callable(enabled) and enabled() and (what == "fp16" or not partitioned):
            raise UnsupportedFrameworkError(
                f"DeepSpeed with {what}{' and ZeRO stage 0' if what == 'bfloat16' else ''} is not "
                f"captured yet (its {type(opt).__name__} keeps fp32 master weights"
                f"{' and a dynamic loss scale' if what == 'fp16' else ''} outside what is captured "
                f"here): {works}"
            )
    if opt is not None and partitioned:
        if getattr(opt, "elastic_checkpoint", False):
            raise UnsupportedFrameworkError(
                "DeepSpeed ZeRO with zero_optimization.elastic_checkpoint is not captured yet (a "
                f"restore of that layout needs every rank's partition): {works}"
            )
        opt = ZeroView(opt)
    elif opt is not None and not isinstance(opt, torch.optim.Optimizer):
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


# What a ZeRO-1/2 optimizer's state_dict() holds that is no plain data, or not needed to resume on
# the same ranks: its loss scaler object (static in fp32) and the universal checkpoint's mappings.
_NOT_CAPTURED = ("loss_scaler", "param_slice_mappings", "universal_checkpoint_info")


def _fp32_partitions(zero: Any) -> list[torch.Tensor]:
    """This rank's partitions of the fp32 master weights (ZeRO-1/2's, or BF16_Optimizer's)."""
    found = getattr(zero, "single_partition_of_fp32_groups", None)
    return list(found if found is not None else zero.fp32_groups_flat_partition)


class ZeroView(StepHooks):
    """A DeepSpeed ZeRO stage 1 or 2 optimizer (or the BF16_Optimizer of ZeRO-1 in bf16) as the session
    holds an optimizer (see the module).

    Its step hooks run around the ZeRO optimizer's whole `step()` (observed through a per-instance
    subclass, as GEMINI observes a scheduler): before it, and after it gathered the updated
    partitions into the parameters. `partitioned`: SCOUT compares no optimizer state or gradients
    (its `param_groups` hold no parameters; its `state` is empty); its parameter groups' settings
    are the inner optimizer's (the learning rate a scheduler sets)."""

    partitioned = True

    def __init__(self, zero: Any) -> None:
        super().__init__()
        self.zero = zero
        view, base = self, type(zero)

        def step(this: Any, *args: Any, **kwargs: Any) -> Any:
            view._run_hooks(view._optimizer_step_pre_hooks, args, kwargs)
            out = super(observed, this).step(*args, **kwargs)  # type: ignore[misc, arg-type]
            view._run_hooks(view._optimizer_step_post_hooks, args, kwargs)
            return out

        observed = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})
        zero.__class__ = observed
        self._base = base

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.zero.param_groups
        ]

    @property
    def state(self) -> dict[Any, Any]:
        return {}

    def rest_tensors(self) -> list[torch.Tensor]:
        """This rank's partition (its fp32 master weights and its optimizer state) and its copy of
        the parameters, which SCOUT checks at rest, between two steps: no replica holds the
        partition, and a flip in a rank's parameters there is overwritten by the next gather,
        after its forward and backward used it (its gradients averaged into every rank's)."""
        state = self.zero.optimizer.state
        moments = [t for st in state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        return list(_fp32_partitions(self.zero)) + moments + self._parameters()

    def _parameters(self) -> list[torch.Tensor]:
        groups = getattr(self.zero, "bit16_groups", None) or getattr(self.zero, "bf16_groups", None) or []
        return [p for g in groups for p in g]

    def state_fragments(self, param: torch.Tensor) -> list[torch.Tensor]:
        """Views of this rank's part of `param`'s optimizer state (each moment's fragment in the
        flat partition); none when its partition holds none of `param`, or no state yet."""
        mapping = getattr(param, "_hp_mapping", None)  # (DeepSpeed links each parameter to its fragment)
        if mapping is None:
            return []
        address, group = mapping.get_hp_fragment_address(), mapping.param_group_index
        flat = _fp32_partitions(self.zero)[group]
        state = self.zero.optimizer.state.get(flat, {})
        return [
            v.narrow(0, address.start, address.numel)
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.shape == flat.shape
        ]

    def remove_hooks(self) -> None:
        """Stop observing the ZeRO optimizer's step (the session closed)."""
        if type(self.zero).__bases__ == (self._base,):
            self.zero.__class__ = self._base

    def state_dict(self) -> dict[str, Any]:
        """This rank's partition: the ZeRO optimizer's `state_dict()` as plain data."""
        out = {k: v for k, v in self.zero.state_dict().items() if k not in _NOT_CAPTURED}
        if "zero_stage" in out:
            out["zero_stage"] = int(out["zero_stage"])  # (an IntEnum)
        return out

    def load_state_dict(self, saved: Any) -> None:
        """This rank's partition back, its fp32 master weights the saved ones."""
        import torch.distributed as dist

        if not isinstance(saved, Mapping) or "single_partition_of_fp32_groups" not in saved:
            raise ValueError(
                "deepspeed: the checkpoint holds no ZeRO partition (it was taken with another "
                "optimizer than this engine's partitioned one)"
            )
        group = self.zero.dp_process_group
        ranks: list[Any] = [None] * dist.get_world_size(group=group)
        ranks[dist.get_rank(group=group)] = dict(saved)
        self.zero.load_state_dict(ranks, load_optimizer_states=True, load_from_fp32_weights=True)

    def __repr__(self) -> str:
        return f"ZeroView({self._base.__name__})"


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


class _ContributionTap:
    """Held by an engine whose gradients `tap_contributions` hands on; the adapter is the current
    session's (a later session on the same engine takes it over)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter


def tap_contributions(engine: Any, adapter: Any) -> None:
    """Hand this rank's gradients to `adapter.contribution_tap` just before the engine all-reduces
    them, as the PyTorch adapter's DDP comm hook does (SCOUT's replay record: two replicas that
    disagree on the reduced gradients are told apart by re-adding both contributions).

    Only where the engine reduces the gradients whole (`buffered_allreduce_fallback`, ZeRO stage 0
    with a torch optimizer, no MoE layers): a ZeRO optimizer reduces its partitions itself, and
    they are not replayed. Each parameter's contribution is its `.grad` as the engine sends it (a
    missing one: the zeros the engine reduces in its place)."""
    if getattr(engine, "has_moe_layers", False) or not isinstance(
        getattr(engine, "optimizer", None), torch.optim.Optimizer
    ):
        return
    held = engine.__dict__.get("_lm_resiliency_contributions")
    if isinstance(held, _ContributionTap):  # already wrapped by an earlier session
        held.adapter = adapter
        return
    cell = _ContributionTap(adapter)
    original = engine.buffered_allreduce_fallback

    def buffered_allreduce_fallback(*args: Any, **kwargs: Any) -> Any:
        tap = getattr(cell.adapter, "contribution_tap", None)
        grads = kwargs.get("grads", args[0] if args else None)
        if tap is not None and grads is None:
            params = [p for p in engine.module.parameters() if p.requires_grad and p.numel()]
            tap(params, [torch.zeros_like(p) if p.grad is None else p.grad for p in params])
        return original(*args, **kwargs)

    # On the instance (an nn.Module keeps plain attributes in its __dict__): this engine only.
    engine.__dict__["_lm_resiliency_contributions"] = cell
    engine.__dict__["buffered_allreduce_fallback"] = buffered_allreduce_fallback
