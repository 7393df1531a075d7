"""Replay records and the replays themselves (torch side of `core.scout.replay`).

A record of step k is what a replica needs to re-derive step k's disputed values without trusting
what it held: this rank's contribution to each gradient all-reduce (its gradient before reduction,
taken in the DDP comm hook), and, just before the optimizer step, the parameters, the reduced
gradients and the optimizer's state and hyperparameters. Copies go to host memory; only steps that
SCOUT checks are recorded, and only in two-replica groups, the only ones where a disagreement has no
majority to settle it (`ReplayHarnessConfig.replay_on_ambiguous = false` turns recording off).

Replays run on a thread of their own (never the training or runtime thread) on the training device,
with the same optimizer class, hyperparameters and code path (foreach/fused flags) as training, so an
honest replica's replay is bitwise what an honest step computed; on CUDA they run on a side stream.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.utils._pytree import tree_map

from lm_resiliency.adapters.base import is_dtensor, parameters_of, zero_partition
from lm_resiliency.gemini.state import load_optimizer_state
from lm_resiliency.scout.fingerprint import fingerprint

__all__ = [
    "ReplayRecord",
    "ReplayRecorder",
    "optimizer_layout",
    "optimizer_tensors",
    "pack_contributions",
    "replay_grads",
    "replay_params",
]

log = logging.getLogger(__name__)


@dataclass
class ReplayRecord:
    step: int
    device: torch.device
    model_params: list[torch.Tensor]  # pre-step copies, in model.parameters() order
    opt_index: list[int]  # optimizer's params (flattened over groups) -> index into model_params
    grads: list[torch.Tensor | None]  # reduced gradients before the step, optimizer order
    contributions: dict[int, torch.Tensor]  # optimizer index -> this rank's pre-reduction gradient
    optimizer_cls: type
    hyper: list[dict[str, Any]]  # each param group without its params
    group_sizes: list[int]
    state: dict[str, Any]  # the optimizer's state_dict, host copies
    problem: str = ""  # why this record cannot be replayed ("" = it can)
    extra: dict[str, Any] = field(default_factory=dict)


def _optimizer_state(opt: Any) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(parameter index over the groups, key, tensor) of every state tensor, in parameter order and
    each parameter's in key order (the same order in a replay's rebuilt optimizer)."""
    for i, p in enumerate(p for group in opt.param_groups for p in group["params"]):
        st = opt.state.get(p, {})
        yield from ((i, str(k), st[k]) for k in sorted(st, key=str) if isinstance(st[k], torch.Tensor))


def optimizer_tensors(opt: Any) -> Iterator[torch.Tensor]:
    """The optimizer's state tensors: what its fingerprint is taken over."""
    return (t for _, _, t in _optimizer_state(opt))


def optimizer_layout(opt: Any) -> bytes:
    """A digest of which state tensors `optimizer_tensors` yields: each one's parameter, key, shape
    and dtype. Replicas of one optimizer hold the same layout; an optimizer that shards its state
    over them (ZeRO-like) does not."""
    h = xxhash.xxh3_64()
    for i, k, t in _optimizer_state(opt):
        h.update(f"{i}:{k}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.digest()


def optimizer_settings(opt: Any) -> bytes:
    """A digest of the optimizer's settings: each parameter group's hyperparameters (learning
    rate, betas, weight decay, ...; not its parameters). Replicas step with the same settings; a
    script that changes them per rank (ReduceLROnPlateau stepped with each rank's own loss) makes
    its replicas differ by design. A tensor setting on a device counts by shape and dtype (its value
    would need a device sync)."""
    h = xxhash.xxh3_64()
    for group in getattr(opt, "param_groups", ()):
        for key in sorted(group, key=str):
            v = _setting(group[key]) if key != "params" else None
            if v is not None:
                h.update(f"{key}={v!r};".encode())
        h.update(b"|")
    return h.digest()


def _setting(v: Any) -> Any:
    """A setting's value as it may count: numbers, strings, flags and tuples of them (a tensor on
    the host by its value, on a device by shape and dtype). Anything else (an object whose repr
    names its address) is left out: it would differ between processes that agree."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return v.item() if v.device.type == "cpu" and v.numel() == 1 else (tuple(v.shape), str(v.dtype))
    if isinstance(v, (tuple, list)):
        items = [_setting(x) for x in v]
        return (
            tuple(items) if all(x is not None or y is None for x, y in zip(items, v, strict=True)) else None
        )
    return None


def _local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2, HSDP: what this rank's optimizer steps and its replicas
    hold too); anything else as it is."""
    return t.to_local() if is_dtensor(t) else t


def _host(t: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = _local(t)
    return local.detach().to("cpu", copy=True)


def _host_tree(obj: Any) -> Any:
    return tree_map(lambda v: _host(v) if isinstance(v, torch.Tensor) else v, obj)


class ReplayRecorder:
    """Keeps the records of the last few checked steps (training thread writes, replay reads)."""

    KEEP = 3

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._armed_step: int | None = None
        self._contrib: dict[int, torch.Tensor] = {}  # id(param) -> contribution, for the armed step
        self._records: dict[int, ReplayRecord] = {}

    def arm(self, step: int) -> None:
        """Record step `step` (called before its backward; contributions arrive during it)."""
        if self._armed_step != step:
            self._armed_step = step
            self._contrib = {}

    def disarm(self) -> None:
        self._armed_step = None
        self._contrib = {}

    @property
    def armed(self) -> bool:
        return self._armed_step is not None

    def on_contributions(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], first: bool = False
    ) -> None:
        """This rank's gradients before the all-reduce: from the DDP comm hook (scaled), or, with
        `first`, from the script's own all-reduce of each (a gradient it reduces again in the same
        step keeps its first share)."""
        if self._armed_step is None:
            return
        for p, g in zip(params, grads, strict=True):
            if not (first and id(p) in self._contrib):
                self._contrib[id(p)] = _host(g)

    def capture(self, step: int) -> ReplayRecord | None:
        """Just before the optimizer step of `step`: keep what a replay of it needs."""
        if self._armed_step != step:
            return None
        opt = self.optimizer
        mparams = parameters_of(self.model)
        where = {id(p): i for i, p in enumerate(mparams)}
        oparams = [p for g in opt.param_groups for p in g["params"]]
        problem = ""
        # DTensor parameters (FSDP2, HSDP) are recorded and replayed as their local shards: a
        # torch optimizer steps each shard on its own (elementwise), and a replica of the shard
        # holds the same one. One that reduces over a whole tensor (a norm, a factored moment)
        # replays differently from the step: both replicas are off the replay, inconclusive.
        if hasattr(opt, "members"):
            problem = "several optimizers (an OptimizerChain) are not replayed"
        elif getattr(opt, "partitioned", False):
            problem = "DeepSpeed ZeRO partitions the optimizer state over the replicas: not replayed"
        elif zero_partition(opt) is not None:
            problem = "ZeroRedundancyOptimizer shards the optimizer state over the replicas: not replayed"
        elif any(id(p) not in where for p in oparams):
            problem = "the optimizer holds parameters that are not the model's"
        record = ReplayRecord(
            step=step,
            device=mparams[0].device if mparams else torch.device("cpu"),
            model_params=[] if problem else [_host(p) for p in mparams],
            opt_index=[] if problem else [where[id(p)] for p in oparams],
            grads=[] if problem else [None if p.grad is None else _host(p.grad) for p in oparams],
            contributions={}
            if problem
            else {i: self._contrib[id(p)] for i, p in enumerate(oparams) if id(p) in self._contrib},
            optimizer_cls=type(opt),
            hyper=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            group_sizes=[len(g["params"]) for g in opt.param_groups],
            state={} if problem else _host_tree(opt.state_dict()),
            problem=problem,
        )
        self._records[step] = record
        for old in sorted(self._records)[: -self.KEEP]:
            del self._records[old]
        self.disarm()
        return record

    def get(self, step: int) -> ReplayRecord | None:
        return self._records.get(step)


@contextlib.contextmanager
def _on_side_stream(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield
        stream.synchronize()
    else:
        yield


NO_SHARES = (
    "no pre-reduction gradient of every parameter recorded (no DDP comm hook, nor the script's own "
    "all-reduce of each gradient over the replica group)"
)


def _complete(record: ReplayRecord) -> bool:
    """Every optimizer parameter's pre-reduction gradient was recorded (a DDP comm hook ran, or the
    script all-reduced each gradient over the replica group itself)."""
    return not record.problem and len(record.contributions) == len(record.opt_index) > 0


def pack_contributions(record: ReplayRecord) -> list[bytes]:
    """This rank's contributions as one buffer per gradient, in optimizer order (empty: none)."""
    if not _complete(record):
        return []
    return [
        record.contributions[i].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for i in range(len(record.opt_index))
    ]


def _scaled_by_one_factor(reduced: list[torch.Tensor], grads: list[torch.Tensor | None]) -> bool:
    """True when `grads` equal `reduced` times one scalar, bitwise: what global-norm gradient clipping
    (`clip_grad_norm_`) or a loss scaler's unscale does between the all-reduce and the step."""
    pairs = [(r, g) for r, g in zip(reduced, grads, strict=True) if g is not None and r.numel()]
    if not pairs:
        return False
    if all(torch.equal(r, g) for r, g in pairs):
        return True
    # The factor from the largest reduced element, then its float32 neighbours (the division that
    # recovers it may be an ulp off the factor the step multiplied by).
    r0, g0 = max(pairs, key=lambda p: float(p[0].abs().max()))
    j = int(r0.abs().reshape(-1).argmax())
    if float(r0.reshape(-1)[j]) == 0.0:
        return False
    c = torch.tensor(float(g0.reshape(-1)[j]) / float(r0.reshape(-1)[j]), dtype=torch.float32)
    if not float(c) > 0.0:  # clipping and unscaling keep the sign: gradients zeroed or negated are not
        return False
    candidates, hi, lo = [c], c, c
    for _ in range(3):
        hi, lo = torch.nextafter(hi, c + 1), torch.nextafter(lo, c - 1)
        candidates += [hi, lo]
    return any(all(torch.equal(r * k, g) for r, g in pairs) for k in candidates)


def replay_grads(record: ReplayRecord, contributions: dict[int, list[bytes]]) -> tuple[bytes, str, bool]:
    """Recompute the all-reduce from both replicas' contributions (ours from the record, the peer's received).
    Returns the fingerprint of the result in the order of the gradients fingerprint ("" and why when
    it cannot), and whether this rank's gradients at the step are that result up to one uniform
    factor (clipping by global norm, unscaling), i.e. consistent with an honest reduction."""
    if record.problem:
        return b"", record.problem, False
    if not _complete(record):
        return b"", NO_SHARES, False
    if len(contributions) != 1:
        # Summation order decides the last bits for three or more terms, and the collective's order
        # is not ours to know: only pairs are recomputed bitwise.
        n = len(contributions) + 1
        return b"", f"{n} contributions: only two-replica reductions are replayed", False
    ((sender, bufs),) = contributions.items()
    mine = [record.contributions[i] for i in range(len(record.opt_index))]
    sizes = [t.numel() * t.element_size() for t in mine]
    if [len(b) for b in bufs] != sizes:
        return b"", f"rank {sender}'s contribution does not match this model's gradients", False
    reduced: list[torch.Tensor] = []
    for ref, buf in zip(mine, bufs, strict=True):
        if not buf:  # an empty gradient: nothing to add
            reduced.append(ref.clone())
            continue
        # Two terms: IEEE addition is commutative, so this is bitwise the all-reduce's sum.
        reduced.append(ref + torch.frombuffer(bytearray(buf), dtype=ref.dtype).reshape(ref.shape))
    consistent = _scaled_by_one_factor(reduced, record.grads)
    with _on_side_stream(record.device):
        on_device = [t.to(record.device) for t in reduced]
        # Parameters without a gradient keep None, as in the recorded fingerprint.
        ordered = [on_device[i] if record.grads[i] is not None else None for i in range(len(on_device))]
        return fingerprint(ordered), "", consistent


def replay_params(record: ReplayRecord, what: str = "params") -> tuple[bytes, str]:
    """Re-run the optimizer step from the recorded pre-step state with the recorded (agreed)
    gradients; the fingerprint of the resulting parameters in model order (`what` "params") or of
    the optimizer's resulting state (`what` "optim", as `optimizer_tensors` orders it), or ("", why)."""
    if record.problem:
        return b"", record.problem
    try:
        with _on_side_stream(record.device):
            params = [t.to(record.device, copy=True) for t in record.model_params]
            opt_params = [params[i] for i in record.opt_index]
            for p, g in zip(opt_params, record.grads, strict=True):
                p.grad = None if g is None else g.to(record.device, copy=True)
            groups, at = [], 0
            for hyper, n in zip(record.hyper, record.group_sizes, strict=True):
                groups.append({**hyper, "params": opt_params[at : at + n]})
                at += n
            opt = record.optimizer_cls(groups)
            # In the recorded dtypes, as training stepped; from a copy: torch's load keeps tensors
            # already of the parameter's dtype and device, and the step would rewrite the record.
            state = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, record.state)
            load_optimizer_state(opt, state)
            opt.step()
            return fingerprint(params if what == "params" else optimizer_tensors(opt)), ""
    except Exception as exc:  # a custom optimizer we cannot rebuild: the replay is inconclusive
        log.warning(
            "replay of step %d: cannot re-run %s: %s", record.step, record.optimizer_cls.__name__, exc
        )
        return b"", f"cannot re-run {record.optimizer_cls.__name__}: {type(exc).__name__}: {exc}"
