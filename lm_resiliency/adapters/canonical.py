"""Gradient all-reduce in a layout that does not depend on DDP's buckets.

A ring all-reduce rounds each element according to where it sits in the reduced buffer and how
long that buffer is. DDP reduces one iteration in its initial bucket layout after every construction
and in a rebuilt one (the order gradients became ready) afterwards, so a resumed run would differ from
the uninterrupted one in the last bits of the step after the restart.

`CanonicalReduction` fixes the layout: the parameters are split once into canonical groups (reverse
registration order, per dtype and device, the first group up to DDP's first-bucket cap and the others
up to its bucket cap: the layout DDP rebuilds to when gradients become ready in reverse order, as they
do in most models). Every gradient is reduced as part of its group's flat buffer. When a DDP bucket is
exactly one canonical group (the common case after DDP's rebuild), its own buffer is reduced in place;
otherwise a group is staged into a buffer of its own once all its gradients arrived (possibly from later
buckets of the same backward), reduced, and copied back, with a bound on the staging memory in flight.
Either way each element is rounded the same way in every run.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lm_resiliency.adapters import collectives

__all__ = ["CanonicalReduction", "canonical_groups", "ddp_caps", "ddp_parameters"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


def canonical_groups(params: Sequence[torch.Tensor], first_cap: int, cap: int) -> list[list[int]]:
    """Indices into `params`, grouped as DDP groups gradients that become ready in reverse order.

    Pure function of the parameters' order, sizes, dtypes and devices and of the caps."""
    groups: list[list[int]] = []
    open_groups: dict[tuple[torch.dtype, str], tuple[list[int], int, int]] = {}  # members, bytes, n closed
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, str(p.device))
        members, size, closed = open_groups.get(key, ([], 0, 0))
        members.append(i)
        size += p.numel() * p.element_size()
        limit = first_cap if closed == 0 else cap
        if size >= limit:
            groups.append(members)
            open_groups[key] = ([], 0, closed + 1)
        else:
            open_groups[key] = (members, size, closed)
    groups.extend(members for members, _, _ in open_groups.values() if members)
    return groups


def ddp_parameters(ddp: nn.Module) -> list[torch.Tensor]:
    """The parameters a DDP module reduces, in registration order."""
    module = getattr(ddp, "module", ddp)
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    return [p for name, p in module.named_parameters() if p.requires_grad and name not in ignore]


def ddp_caps(ddp: nn.Module) -> tuple[int, int]:
    """(first bucket cap, bucket cap) in bytes, as this DDP module rebuilds its buckets with."""
    config = getattr(ddp, "_bucket_config", None)
    cap = int(getattr(ddp, "bucket_bytes_cap", 0) or DEFAULT_BUCKET_BYTES)
    first = int(getattr(config, "first_bucket_bytes_cap", 0) or min(cap, DEFAULT_FIRST_BUCKET_BYTES))
    return first, cap


@dataclass
class _Group:
    index: int
    members: list[int]  # canonical parameter indices, in layout order
    offsets: dict[int, int]  # parameter index -> element offset in the flat buffer
    numel: int
    dtype: torch.dtype
    # This backward's gradients of the group that arrived (views into DDP's bucket buffers, which
    # DDP leaves alone until our futures complete), and the future of the group's reduction.
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    done: torch.futures.Future[None] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class CanonicalReduction:
    """Sums a DDP bucket's gradients over a process group in the canonical layout (module doc).

    Called from DDP's comm hook, on the thread running backward. Staged groups are copied into a
    buffer of their own only when all their gradients have arrived, and at most `staging_bytes` of
    such buffers are in flight (a group waits for earlier ones beyond that): DDP's first iteration
    after construction hands over the whole model as one bucket, and staging all of it at once
    would need a second copy of every gradient on a device that training has filled."""

    def __init__(
        self, params: Sequence[torch.Tensor], first_cap: int, cap: int, staging_bytes: int | None = None
    ) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._groups: list[_Group] = []
        self._group_of: dict[int, _Group] = {}
        for members in canonical_groups(params, first_cap, cap):
            self._add_group(members, [params[i].numel() for i in members], params[members[0]].dtype)
        largest = max((g.nbytes for g in self._groups), default=0)
        self._budget = max(staging_bytes if staging_bytes is not None else 2 * cap, largest)
        self._inflight: deque[tuple[torch.futures.Future[None], int]] = deque()
        self._inflight_bytes = 0
        self._lock = threading.Lock()
        self._active = False  # a reduction ran since the last reset
        self.in_place = 0  # buckets reduced in their own buffer (statistics, tests)
        self.staged = 0
        self.peak_staging_bytes = 0

    @classmethod
    def for_ddp(cls, ddp: nn.Module) -> CanonicalReduction:
        # A parameter with sparse gradients has a bucket of its own, which the comm hook reduces.
        sparse = {
            id(m.weight)
            for m in getattr(ddp, "module", ddp).modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        }
        return cls([p for p in ddp_parameters(ddp) if id(p) not in sparse], *ddp_caps(ddp))

    def _add_group(self, members: list[int], numels: list[int], dtype: torch.dtype) -> None:
        offsets, n = {}, 0
        for i, numel in zip(members, numels, strict=True):
            offsets[i] = n
            n += numel
        g = _Group(len(self._groups), members, offsets, n, dtype)
        self._groups.append(g)
        for i in members:
            self._group_of[i] = g

    def reset(self) -> None:
        """Before a forward: forget partial arrivals (a backward that raised midway leaves some
        behind)."""
        with self._lock:
            if not self._active:  # no reduction since the last forward (gradient accumulation)
                return
            self._active = False
            for g in self._groups:
                g.views = {}
                g.done = None
            self._inflight.clear()
            self._inflight_bytes = 0

    def reduce(self, bucket: Any, group: Any) -> torch.futures.Future[torch.Tensor]:
        """Sum the bucket's gradients over `group` (the caller scaled them); a future of its buffer."""
        buffer: torch.Tensor = bucket.buffer()
        params: list[torch.Tensor] = list(bucket.parameters())
        grads: list[torch.Tensor] = list(bucket.gradients())
        indices = [self._param_index(p, g) for p, g in zip(params, grads, strict=True)]
        self._active = True
        whole = self._group_of[indices[0]] if indices else None
        if whole is None or (whole.members == indices and whole.numel == buffer.numel() and not whole.views):
            self.in_place += 1
            fut = collectives.original("all_reduce")(buffer, group=group, async_op=True).get_future()

            def reduced(f: Any) -> torch.Tensor:
                f.value()  # re-raises a failed all-reduce
                return buffer

            out: torch.futures.Future[torch.Tensor] = fut.then(reduced)
            return out
        self.staged += 1
        waits: list[torch.futures.Future[None]] = []
        ready: list[_Group] = []
        with self._lock:
            for i, grad in zip(indices, grads, strict=True):
                g = self._group_of[i]
                if g.done is None:
                    g.done = torch.futures.Future()
                g.views[i] = grad
                if len(g.views) == len(g.members):
                    ready.append(g)
                if g.done not in waits:
                    waits.append(g.done)
        # Every rank completes groups in the same order (DDP hands buckets over in the same order).
        for g in sorted(ready, key=lambda g: g.index):
            self._launch(g, group)

        def handed_back(_: Any) -> torch.Tensor:
            for w in waits:
                w.value()  # re-raises a failed all-reduce
            return buffer

        return torch.futures.collect_all(waits).then(handed_back)

    def _launch(self, g: _Group, group: Any) -> None:
        done, views = g.done, g.views
        assert done is not None
        g.views, g.done = {}, None
        nbytes = g.nbytes
        while self._inflight and (
            self._inflight[0][0].done() or self._inflight_bytes + nbytes > self._budget
        ):
            earlier, size = self._inflight.popleft()
            earlier.wait()  # its sums are back in the buckets and its buffer is free
            self._inflight_bytes -= size
        first = next(iter(views.values()))
        staging = torch.empty(g.numel, dtype=g.dtype, device=first.device)
        for i, grad in views.items():
            off = g.offsets[i]
            staging[off : off + grad.numel()].copy_(grad.reshape(-1))
        self._inflight.append((done, nbytes))
        self._inflight_bytes += nbytes
        self.peak_staging_bytes = max(self.peak_staging_bytes, self._inflight_bytes)
        work = collectives.original("all_reduce")(staging, group=group, async_op=True).get_future()

        def finish(f: Any) -> None:
            try:
                f.value()
                for i, grad in views.items():
                    off = g.offsets[i]
                    grad.view(-1).copy_(staging[off : off + grad.numel()])  # a view into a bucket
                if staging.is_cuda:
                    # The futures DDP gets carry no CUDA events (their values come from plain
                    # futures): the copies must have run before they complete. Staging is the rare
                    # path (DDP's first iteration after construction), so waiting costs little.
                    torch.cuda.current_stream(staging.device).synchronize()
            except Exception as exc:
                done.set_exception(exc)  # type: ignore[arg-type]  # typed as the result in torch
            else:
                done.set_result(None)

        work.then(finish)

    def _param_index(self, p: torch.Tensor, grad: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None:  # a parameter DDP reduces that we did not list: a group of its own
            with self._lock:
                i = self._index.setdefault(id(p), len(self._index))
                if i not in self._group_of:
                    self._add_group([i], [grad.numel()], grad.dtype)
        return i
