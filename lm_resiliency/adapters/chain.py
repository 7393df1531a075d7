"""Several optimizers (and their schedulers) that step one model in each iteration, as one.

LLM pre-training often steps two optimizers: Muon for the hidden matrices and AdamW for the
embeddings, norms and head; a GAN steps its generator's and its discriminator's. Both hold training
state (momentum, step counts), and a restart that restores one of them resumes the other from fresh.
`enable_resiliency(model, [muon, adamw])` holds them as an `OptimizerChain`:

- Its state is every member's, in torch's own format (`state` keyed by parameter index and
  `param_groups`), the indices running on from one member to the next, and `optimizers` giving
  each member's number of parameter groups, so a restore gives each member back its own part.
- Its step is the iteration's: the step begins when the first member of the iteration steps (its
  pre-hooks run then: GEMINI fences an asynchronous capture before any parameter changes) and ends
  when every member has stepped since the last end (its post-hooks run then: the step count, the
  capture, SCOUT's checks). A member stepped several times an iteration (a discriminator stepped
  k times a generator step) is fine as long as the one stepped once steps last.
- A loss scaler's skipped step of a member counts as that member's step (see adapters/amp.py).

`SchedulerChain` holds the schedulers of the members as one: its state is each one's, and GEMINI
waits for every one of them to step before it takes a capture.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["OptimizerChain", "SchedulerChain", "StepHooks", "members_of", "outermost"]

log = logging.getLogger(__name__)

# A member that steps this many times while another has not stepped since the last end: said once.
_LONE_STEPS = 16


def members_of(obj: Any) -> tuple[Any, ...]:
    """The members of a chain, or `(obj,)` for one optimizer or scheduler."""
    return tuple(obj.members) if isinstance(obj, (OptimizerChain, SchedulerChain)) else (obj,)


def outermost(optimizers: Sequence[Any]) -> list[Any]:
    """`optimizers` without those another of them wraps (ZeroRedundancyOptimizer's inner one)."""
    inner = {
        id(v)
        for o in optimizers
        for v in getattr(o, "__dict__", {}).values()
        if isinstance(v, torch.optim.Optimizer) and v is not o
    }
    return [o for o in optimizers if id(o) not in inner]


class _States(Mapping[Any, Any]):
    """The members' `state` as one read-only mapping (parameter -> its state), read live: a member's
    `load_state_dict` replaces its `state` object."""

    def __init__(self, members: Sequence[Any]) -> None:
        self._members = members

    def __getitem__(self, key: Any) -> Any:
        for m in self._members:
            st = m.state
            if key in st:  # (not st[key]: torch's state is a defaultdict, which would grow)
                return st[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for m in self._members:
            yield from m.state

    def __len__(self) -> int:
        return sum(len(m.state) for m in self._members)


class StepHooks:
    """Step pre- and post-hook tables, named and typed as torch's own (a RemovableHandle holds a
    weak reference to one; a fault injector moves its hook to the front of one, a loss scaler's
    skipped step runs ours in them), for an object the session holds as its optimizer."""

    def __init__(self) -> None:
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook(self, args, kwargs)` before the step."""
        handle = RemovableHandle(self._optimizer_step_pre_hooks)
        self._optimizer_step_pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook(self, args, kwargs)` after the step."""
        handle = RemovableHandle(self._optimizer_step_post_hooks)
        self._optimizer_step_post_hooks[handle.id] = hook
        return handle

    def _run_hooks(self, table: OrderedDict[int, Callable[..., Any]], args: Any, kwargs: Any) -> None:
        for hook in list(table.values()):
            hook(self, args, kwargs)


class OptimizerChain(StepHooks):
    """Torch optimizers stepped once each per iteration, as one optimizer (see the module).

    Its step pre-hooks run before the first member of an iteration steps, its post-hooks once
    every member has stepped since the last time."""

    def __init__(self, optimizers: Sequence[Any]) -> None:
        from lm_resiliency.adapters.amp import mark_ours
        from lm_resiliency.adapters.base import zero_partition

        members = list(optimizers)
        if not members:
            raise ValueError("optimizer: the list of optimizers is empty")
        for i, m in enumerate(members):
            if not isinstance(m, torch.optim.Optimizer):
                raise TypeError(f"optimizer[{i}] must be a torch.optim.Optimizer, got {type(m).__name__}")
            if zero_partition(m) is not None:
                raise TypeError(
                    f"optimizer[{i}] is a ZeroRedundancyOptimizer: it shards its state over the ranks "
                    "and cannot be one of several optimizers; pass it alone"
                )
        if len({id(m) for m in members}) != len(members):
            raise ValueError("optimizer: the same optimizer is listed twice")
        owner: dict[int, int] = {}
        for i, m in enumerate(members):
            for g in m.param_groups:
                for p in g["params"]:
                    if owner.setdefault(id(p), i) != i:
                        raise ValueError(
                            f"optimizer[{owner[id(p)]}] and optimizer[{i}] both step a parameter of "
                            f"shape {tuple(p.shape)}: each parameter is stepped by one optimizer"
                        )
        super().__init__()
        self.members = tuple(members)
        self._owner = owner  # id(param) -> member index
        self._stepped: set[int] = set()  # members stepped since the last end of a step
        self._lone = [0] * len(members)  # each member's steps since the last end
        self._lone_said = False
        # Ours (adapters/amp.py): a loss scaler's skipped step of a member runs them too.
        self._handles = [
            mark_ours(h)
            for i, m in enumerate(members)
            for h in (
                m.register_step_pre_hook(lambda opt, args, kwargs, i=i: self._member_pre(i, args, kwargs)),
                m.register_step_post_hook(lambda opt, args, kwargs, i=i: self._member_post(i, args, kwargs)),
            )
        ]

    # -- what the session reads -------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for m in self.members for g in m.param_groups]

    @property
    def state(self) -> Mapping[Any, Any]:
        return _States(self.members)

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.members[0].defaults)

    def member_of(self, param: Any) -> Any:
        """The member stepping `param` (None: none does)."""
        i = self._owner.get(id(param))
        return None if i is None else self.members[i]

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(m).__name__ for m in self.members)})"

    # -- the loop's calls, for code that makes them on the chain ----------------------------------
    def step(self, closure: Any = None) -> Any:
        out = None
        for m in self.members:
            out = m.step(closure) if closure is not None else m.step()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.members:
            m.zero_grad(set_to_none=set_to_none)

    # -- hooks ------------------------------------------------------------------------------------
    def _member_pre(self, i: int, args: Any, kwargs: Any) -> None:
        if not self._stepped:
            self._run_hooks(self._optimizer_step_pre_hooks, args, kwargs)

    def _member_post(self, i: int, args: Any, kwargs: Any) -> None:
        self._stepped.add(i)
        self._lone[i] += 1
        if len(self._stepped) < len(self.members):
            if self._lone[i] >= _LONE_STEPS and not self._lone_said:
                self._lone_said = True
                idle = [j for j in range(len(self.members)) if j not in self._stepped]
                log.warning(
                    "%s: optimizer[%d] stepped %d times while optimizer%s %s did not: a step ends "
                    "when every optimizer of the list has stepped, so none has ended since (no "
                    "captures, no checks). Pass only the optimizers the loop steps every iteration",
                    self,
                    i,
                    self._lone[i],
                    "s" if len(idle) > 1 else "",
                    ", ".join(f"[{j}]" for j in idle),
                )
            return
        self._stepped.clear()
        self._lone = [0] * len(self.members)
        self._run_hooks(self._optimizer_step_post_hooks, args, kwargs)

    def remove_hooks(self) -> None:
        """Take the chain's own hooks off its members (the session closed)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every member's `state_dict()`, as one in torch's format (see the module)."""
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        counts: list[int] = []
        offset = 0
        for m in self.members:
            sd = m.state_dict()
            for k, v in sd["state"].items():
                state[k + offset] = v
            for g in sd["param_groups"]:
                groups.append({**g, "params": [p + offset for p in g["params"]]})
            counts.append(len(sd["param_groups"]))
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups, "optimizers": counts}

    def split(self, saved: Any) -> list[dict[str, Any]]:
        """A `state_dict()` of the chain as its members' own; a clear error when it is not one of
        a chain of this many optimizers with these numbers of parameter groups and parameters."""
        if not isinstance(saved, Mapping) or not isinstance(saved.get("optimizers"), list):
            raise ValueError(
                f"optimizer: the checkpoint holds the state of one optimizer, and this session "
                f"steps {len(self.members)} ({self}); restore it into the optimizers it was taken with"
            )
        counts, groups, state = saved["optimizers"], saved.get("param_groups"), saved.get("state")
        if not isinstance(groups, list) or not isinstance(state, Mapping):
            raise ValueError("optimizer: the checkpoint's state of several optimizers has no state or groups")
        mine = [len(m.param_groups) for m in self.members]
        if counts != mine or len(groups) != sum(mine):
            raise ValueError(
                f"optimizer: the checkpoint holds {len(counts)} optimizers with {counts} parameter "
                f"groups, and this session steps {len(mine)} with {mine}"
            )
        out: list[dict[str, Any]] = []
        at = offset = 0
        for m, n in zip(self.members, counts, strict=True):
            own = groups[at : at + n]
            size = sum(len(g["params"]) for g in m.param_groups)
            if sum(len(g.get("params", ())) for g in own) != size:
                raise ValueError(
                    f"optimizer: the checkpoint's optimizer[{len(out)}] held "
                    f"{sum(len(g.get('params', ())) for g in own)} parameters, the live one {size}"
                )
            out.append(
                {
                    "state": {k - offset: v for k, v in state.items() if offset <= k < offset + size},
                    "param_groups": [{**g, "params": [p - offset for p in g["params"]]} for g in own],
                }
            )
            at += n
            offset += size
        return out

    def load_state_dict(self, saved: Any) -> None:
        for m, part in zip(self.members, self.split(saved), strict=True):
            m.load_state_dict(part)


class SchedulerChain:
    """The schedulers of a chain's members, as one (see the module)."""

    def __init__(self, schedulers: Sequence[Any]) -> None:
        self.members = tuple(schedulers)

    def step(self, *args: Any, **kwargs: Any) -> None:
        for s in self.members:
            s.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.members]}

    def load_state_dict(self, saved: Any) -> None:
        parts = saved.get("schedulers") if isinstance(saved, Mapping) else None
        if not isinstance(parts, list) or len(parts) != len(self.members):
            have = f"{len(parts)} schedulers" if isinstance(parts, list) else "one scheduler"
            raise ValueError(
                f"scheduler: the checkpoint holds {have}, and this session steps {len(self.members)}"
            )
        for s, part in zip(self.members, parts, strict=True):
            s.load_state_dict(part)

    def __repr__(self) -> str:
        return f"SchedulerChain({', '.join(type(s).__name__ for s in self.members)})"
