"""Audits: record one step's micro-batches, ship them, re-execute a peer's (torch side of
`core.scout.audit`).

On an audited step the recorder keeps, per micro-batch that runs with gradients: device clones of
the module's inputs, the CPU (and CUDA) RNG state, the autocast setting, the module's buffers as the
forward saw them, a fingerprint of the outputs and the gradients that reached the outputs in
backward; and this rank's gradients before the all-reduce (the DDP comm hook's contribution). At
the optimizer pre-hook they become a package (host tensors, `torch.save`, loaded by the auditor
with `weights_only=True`).

The auditor replays a package on its training thread at its own optimizer pre-hook of the same
step: its parameters are then the pre-step parameters the group agreed on, nothing runs
concurrently on the module, and `.grad` is untouched (gradients come from `torch.autograd.grad`).
Buffers are passed through `torch.func.functional_call`, so the live ones never change. The
forward runs on the inner module (below DDP), so DDP's reducer never sees a replay.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lm_resiliency.adapters import collectives
from lm_resiliency.adapters.base import is_dtensor
from lm_resiliency.scout.fingerprint import fingerprint

__all__ = ["AuditRecorder", "AuditReplay", "dump_package", "load_package", "replay_package"]

log = logging.getLogger(__name__)
PACKAGE_VERSION = 1


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a module output, in a fixed order (tensors, tuples, lists, mappings such as a
    HuggingFace ModelOutput; anything else holds none)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


class _Unwrappable(Exception):
    pass


def _rewrap(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with each tensor `t` replaced by `fn(t)`, visited in `_tensors` order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: _rewrap(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(**items)  # OrderedDict, HuggingFace ModelOutput
        except Exception as exc:
            raise _Unwrappable(type(obj).__name__) from exc
    if isinstance(obj, (tuple, list)):
        seq = [_rewrap(v, fn) for v in obj]
        if type(obj) in (tuple, list):
            return type(obj)(seq)
        try:
            return type(obj)(*seq) if hasattr(obj, "_fields") else type(obj)(seq)
        except Exception as exc:
            raise _Unwrappable(type(obj).__name__) from exc
    return obj


class _Body(torch.nn.Module):
    """Calls a module's own `forward`, not the module: none of its hooks run (FSDP2's would
    all-gather; a replay runs on one rank)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.forward(*args, **kwargs)


def _canonical(t: torch.Tensor) -> torch.Tensor:
    # -0.0 + 0.0 == +0.0: a gradient accumulated into a zeroed `.grad` and the same gradient taken
    # fresh differ only in the sign of zeros.
    return t + 0.0


@dataclass
class MicroBatch:
    args: Any
    kwargs: dict[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    autocast: str | None  # dtype name when the forward ran under autocast
    buffers: dict[str, torch.Tensor]
    out_fp: bytes = b""
    grad_out: dict[int, torch.Tensor] = field(default_factory=dict)
    grads_seen: bool = True  # False: the gradients reaching the outputs could not be isolated


@dataclass
class AuditRecord:
    step: int
    micro: list[MicroBatch] = field(default_factory=list)
    contrib: dict[int, torch.Tensor] = field(default_factory=dict)  # parameter index -> contribution
    problem: str = ""
    grads_problem: str = ""  # why this step's gradients cannot be compared (its forward still is)
    # A sharded unit's parameters as its forward saw them (gathered), by name: what a replay of a
    # peer's micro-batches of the same step computes with.
    params: dict[str, torch.Tensor] | None = None
    # A sharded unit's gradients of micro-batches whose reduce-scatter already freed them, summed.
    carry: dict[int, torch.Tensor] = field(default_factory=dict)

    def fold(self) -> None:
        """Add `contrib` into `carry` (in micro-batch order, as `.grad` accumulates) and clear it."""
        for i, g in self.contrib.items():
            self.carry[i] = self.carry[i] + g if i in self.carry else g
        self.contrib = {}


class AuditRecorder:
    """Records the micro-batches of the steps `due()` names (training thread).

    `local_grads`: the module's gradients are this rank's own `.grad` as backward accumulated it,
    before whatever reduces them (an expert's replicas, a framework's own all-reduce), taken by
    post-accumulate hooks. Otherwise they come from the DDP comm hook (`on_contributions`).

    `gathered`: an FSDP2 unit, whose parameters exist whole only inside its forward (between
    FSDP2's all-gather and its reshard). The record keeps a copy of them as the forward saw them,
    taken by our pre-hook, which runs after FSDP2's. Its gradients are this rank's own, whole, as
    backward accumulated them into the gathered parameters before FSDP2 reduce-scatters them (and
    frees them: those of earlier micro-batches are summed here as `.grad` would have summed them)."""

    MAX_MICRO_BATCHES = 64

    def __init__(
        self,
        module: torch.nn.Module,
        due: Callable[[], int | None],
        local_grads: bool = False,
        gathered: bool = False,
        outer: torch.nn.Module | None = None,
    ) -> None:
        self.module = module
        self._due = due
        self.local_grads = local_grads
        self.gathered = gathered
        self.params = list(module.parameters())
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.replaying = False
        self._record: AuditRecord | None = None
        # The output is taken where the caller gets it: `outer`'s (the DDP wrapping `module`), else
        # `module`'s. Taken inside DDP, what changed the model's output after it (a campaign's drop
        # of the root output, a forward hook of the script's own) went unseen: the replay matched,
        # and the gradients, seeded with the changed output's, matched too.
        self._post_module: Any = outer if outer is not None else module
        self._post_handle = self._post_module.register_forward_hook(self._post)
        self._handles = [module.register_forward_pre_hook(self._pre, with_kwargs=True), self._post_handle]
        self._grad_handles: list[Any] = []  # post-accumulate hooks, held only while recording
        self._live: list[torch.Tensor] = []  # a gathered unit's whole parameters in this forward

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._watch_grads(False)
        self._record = None

    def _watch_grads(self, on: bool) -> None:
        """Hook `.grad` accumulation only while a step is recorded: a step that is not audited
        pays no call per parameter in backward."""
        if on and not self._grad_handles:
            self._grad_handles = [
                p.register_post_accumulate_grad_hook(self._accumulated)  # type: ignore[no-untyped-call]
                for p in (self._live if self.gathered else self.params)
                if p.requires_grad
            ]
        elif not on:
            for h in self._grad_handles:
                h.remove()
            self._grad_handles = []

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.replaying or not torch.is_grad_enabled():
            return
        if torch._C._current_graph_task_id() != -1:
            return  # inside backward: activation checkpointing recomputing a forward already recorded
        step = self._due()
        if step is None:
            if self._record is not None:
                self._record = None
                self._watch_grads(False)
            return
        if self._record is None or self._record.step != step:
            self._watch_grads(False)
            self._record = AuditRecord(step)
            if self.gathered:
                params = dict(module.named_parameters())
                if any(is_dtensor(p) for p in params.values()):
                    # Still distributed after the gather (tensor parallel inside the unit): its
                    # forward holds collectives, which a replay on one rank cannot join.
                    self._record.problem = "tensor-parallel parameters inside the unit"
                    return
                self._record.params = {n: p.detach().clone() for n, p in params.items()}
                self._live = list(params.values())
                self._index = {id(p): i for i, p in enumerate(self._live)}
            own = self._live if self.gathered else self.params
            if (self.local_grads or self.gathered) and any(
                p.grad is not None and bool(p.grad.any()) for p in own
            ):
                # `.grad` will hold more than this step's gradients: nothing to compare them with.
                self._record.grads_problem = "gradients were not zeroed before the step"
            self._watch_grads(self.local_grads or self.gathered)
        elif self.gathered and self._record.contrib and all(p.grad is None for p in self._live):
            self._record.fold()  # FSDP2 reduce-scattered and freed the last micro-batch's gradients
        rec = self._record
        if rec.problem:
            return
        if len(rec.micro) >= self.MAX_MICRO_BATCHES:
            rec.problem = f"more than {self.MAX_MICRO_BATCHES} micro-batches"
            return
        # Our output hook runs after every other forward hook (one registered after ours included):
        # it must see what the call returns, as the caller gets it.
        with contextlib.suppress(AttributeError, KeyError):
            self._post_module._forward_hooks.move_to_end(self._post_handle.id)
        device = self.params[0].device if self.params else torch.device("cpu")
        autocast = None
        if torch.is_autocast_enabled(device.type):
            autocast = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
        rec.micro.append(
            MicroBatch(
                args=tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, args),
                kwargs=tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, kwargs),
                cpu_rng=torch.get_rng_state(),
                cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                autocast=autocast,
                buffers={n: b.detach().clone() for n, b in module.named_buffers()},
            )
        )

    def _post(self, module: Any, args: Any, output: Any) -> Any:
        rec = self._record
        if self.replaying or rec is None or rec.problem or not rec.micro or rec.micro[-1].out_fp:
            return None
        mb = rec.micro[-1]
        mb.out_fp = fingerprint(_tensors(output))
        # The caller gets a view of each output: what reaches a view in backward is exactly what the
        # caller's use of that output sends back (a gradient taken on the output itself would also
        # hold what flows into it from other outputs computed from it, e.g. a loss from the logits).
        index = iter(range(1 << 30))

        def watch(t: torch.Tensor) -> torch.Tensor:
            i = next(index)
            if not t.requires_grad:
                return t
            view = t.view_as(t)

            def keep(g: torch.Tensor) -> None:
                mb.grad_out[i] = g.detach()

            view.register_hook(keep)  # type: ignore[no-untyped-call]
            return view

        try:
            return _rewrap(output, watch)
        except _Unwrappable as exc:
            mb.grads_seen = False
            log.info("audit: output type %s cannot be rebuilt; gradients are not audited", exc)
            return None

    def on_contributions(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """From the DDP comm hook: this rank's gradients, scaled, before the all-reduce."""
        rec = self._record
        if rec is None or rec.problem or self.replaying:
            return
        for p, g in zip(params, grads, strict=True):
            i = self._index.get(id(p))
            if i is not None:
                rec.contrib[i] = g.detach().clone()

    def _accumulated(self, p: torch.Tensor) -> None:
        """Backward accumulated into `p.grad`: keep what it holds (the last call, after the last
        micro-batch, holds the step's sum)."""
        rec = self._record
        if rec is None or rec.problem or rec.grads_problem or self.replaying or p.grad is None:
            return
        if p.grad.layout != torch.strided:
            rec.grads_problem = f"{p.grad.layout} gradients"
            rec.contrib.clear()
            return
        i = self._index.get(id(p))
        if i is not None:
            rec.contrib[i] = p.grad.detach().clone()

    def finish(self, step: int) -> AuditRecord | None:
        """The record of `step`, if it was recorded (at its optimizer pre-hook)."""
        rec, self._record = self._record, None
        self._watch_grads(False)
        self._live = []
        if rec is not None and rec.carry:
            rec.fold()
            rec.contrib, rec.carry = rec.carry, {}
        return rec if rec is not None and rec.step == step and rec.micro else None


def _host(obj: Any) -> tuple[Any, list[bool]]:
    """Host copies of the tensors in `obj`, and which of them lived on an accelerator."""
    leaves, spec = tree_flatten(obj)
    on_device = [isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in leaves]
    host = [v.detach().to("cpu") if isinstance(v, torch.Tensor) else v for v in leaves]
    return tree_unflatten(host, spec), on_device


def package(rec: AuditRecord, scale: float | None, limit_bytes: int) -> tuple[dict[str, Any] | None, str]:
    """The record as host data for an auditor (None and why when it cannot be audited).

    `scale`: the factor the comm hook multiplied this rank's gradients by before the all-reduce
    (1.0 for a `local_grads` recorder; None: no gradients to compare, only the forward is
    audited). Above `limit_bytes`, the output gradients are left out (only the forward is
    audited)."""
    if rec.problem:
        return None, rec.problem
    # Fingerprints travel as hex strings: a weights_only load refuses how torch.save pickles b"".
    grads_fp = ""
    grad_index: list[int] = []
    if scale is not None and rec.contrib and not rec.grads_problem and all(mb.grads_seen for mb in rec.micro):
        grad_index = sorted(rec.contrib)
        grads_fp = fingerprint(_canonical(rec.contrib[i]) for i in grad_index).hex()
    micro = []
    for mb in rec.micro:
        inputs, on_device = _host((mb.args, mb.kwargs))
        micro.append(
            {
                "inputs": inputs,
                "on_device": on_device,
                "cpu_rng": mb.cpu_rng,
                "cuda_rng": mb.cuda_rng,
                "autocast": mb.autocast,
                "buffers": {n: b.to("cpu") for n, b in mb.buffers.items()},
                "out_fp": mb.out_fp.hex(),
                # Output gradients matter only when gradients are compared.
                "grad_out": {str(i): g.to("cpu") for i, g in mb.grad_out.items()} if grads_fp else {},
            }
        )
    payload = {
        "scale": scale,
        "grads_fp": grads_fp,
        "grad_index": grad_index,
        "micro": micro,
    }
    size = _bytes(payload)
    if size > limit_bytes and grads_fp:
        for m in micro:
            m["grad_out"] = {}
        payload["grads_fp"], payload["grad_index"] = "", []
        size = _bytes(payload)
    if size > limit_bytes:
        return None, f"its micro-batches take {size / 2**20:.0f} MiB (audit_max_mib {limit_bytes >> 20})"
    return payload, ""


def _bytes(obj: Any) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(v.numel() * v.element_size() for v in leaves if isinstance(v, torch.Tensor))


def dump_package(step: int, modules: Mapping[str, dict[str, Any]]) -> bytes:
    """One step's packages, by audited module ("" = the whole model), as bytes for the auditor."""
    buf = io.BytesIO()
    torch.save({"version": PACKAGE_VERSION, "step": step, "modules": dict(modules)}, buf)
    return buf.getvalue()


def load_package(blob: bytes) -> tuple[int, dict[str, dict[str, Any]]]:
    """A peer's packages of one step: (step, module name -> package), loaded with
    `weights_only=True` and checked; ValueError names what is wrong with a malformed one."""
    try:
        bundle = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ValueError(f"not a loadable audit package: {type(exc).__name__}: {exc}") from exc
    if not isinstance(bundle, dict) or bundle.get("version") != PACKAGE_VERSION:
        raise ValueError(f"not an audit package of version {PACKAGE_VERSION}")
    step, modules = bundle.get("step"), bundle.get("modules")
    if type(step) is not int or not isinstance(modules, dict) or not modules:
        raise ValueError("an audit package without a step or without modules")
    for name, payload in modules.items():
        if not isinstance(name, str) or not isinstance(payload, dict):
            raise ValueError("an audit package with a malformed module entry")
        _check_payload(payload)
    return step, modules


def _check_payload(payload: dict[str, Any]) -> None:
    micro = payload.get("micro")
    if not isinstance(micro, list) or not micro:
        raise ValueError("an audit package without micro-batches")
    for m in micro:
        if not isinstance(m, dict) or not isinstance(m.get("out_fp"), str):
            raise ValueError("an audit package with a malformed micro-batch")
        inputs = m.get("inputs")
        if not (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict)):
            raise ValueError("an audit package whose inputs are not (args, kwargs)")
        if not isinstance(m.get("cpu_rng"), torch.Tensor) or not isinstance(m.get("buffers"), dict):
            raise ValueError("an audit package without RNG state or buffers")
        autocast = m.get("autocast")
        if autocast is not None and not isinstance(getattr(torch, str(autocast), None), torch.dtype):
            raise ValueError(f"an audit package with autocast {autocast!r}, not a torch dtype")
    if not isinstance(payload.get("grads_fp"), str) or not isinstance(payload.get("grad_index"), list):
        raise ValueError("an audit package with malformed gradients")


@dataclass(frozen=True)
class AuditReplay:
    """What a replay of a package computed."""

    out_fps: tuple[str, ...]  # hex
    grads_fp: str  # hex; "" when the package carries no gradients to compare

    def finding(self, payload: Mapping[str, Any]) -> str:
        """ "output" or "grads" where the package's own fingerprints differ from ours, else "ok"."""
        if self.out_fps != tuple(m["out_fp"] for m in payload["micro"]):
            return "output"
        if payload["grads_fp"] and self.grads_fp != payload["grads_fp"]:
            return "grads"
        return "ok"


@contextlib.contextmanager
def _rng(device: torch.device, cpu_state: torch.Tensor, cuda_state: torch.Tensor | None) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None and devices:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


def replay_package(
    recorder: AuditRecorder, payload: Mapping[str, Any], gathered: Mapping[str, torch.Tensor] | None = None
) -> AuditReplay:
    """Re-execute a package's micro-batches on the recorder's module with its current parameters,
    or, for a gathered unit, with `gathered` (this rank's copy of the same step's parameters)."""
    module = recorder.module
    params: Sequence[torch.Tensor] = recorder.params
    if recorder.gathered and gathered is None:
        raise ValueError("no gathered parameters of this step to replay with")
    if gathered is not None:
        # Whole copies as leaves of their own, which the replay's gradients are taken for.
        trains = {n: p.requires_grad for n, p in module.named_parameters()}
        gathered = {n: t.detach().requires_grad_(trains.get(n, False)) for n, t in gathered.items()}
        params = list(gathered.values())
    device = params[0].device if params else torch.device("cpu")
    grad_index: list[int] = list(payload["grad_index"])
    if any(type(i) is not int or not 0 <= i < len(params) for i in grad_index):
        raise ValueError("the package's gradients do not match this model's parameters")
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    acc: dict[int, torch.Tensor] = {}
    out_fps = []
    recorder.replaying = True
    try:
        for m in payload["micro"]:
            leaves, spec = tree_flatten(m["inputs"])
            if len(leaves) != len(m["on_device"]):
                raise ValueError("the package's inputs do not match their device list")
            leaves = [v.to(device) if d else v for v, d in zip(leaves, m["on_device"], strict=True)]
            args, kwargs = tree_unflatten(leaves, spec)
            buffers = {n: b.to(device) for n, b in m["buffers"].items()}
            autocast = (
                torch.autocast(device.type, dtype=getattr(torch, m["autocast"]))
                if m["autocast"]
                else contextlib.nullcontext()
            )
            with (
                _rng(device, m["cpu_rng"], m["cuda_rng"]),
                autocast,
                torch.enable_grad(),
                collectives.forbidden("an audit replay"),
            ):
                if gathered is not None:
                    state = {f"inner.{n}": t for n, t in {**gathered, **buffers}.items()}
                    out = torch.func.functional_call(_Body(module), state, tuple(args), dict(kwargs))
                else:
                    out = torch.func.functional_call(module, buffers, tuple(args), dict(kwargs))
            outs = _tensors(out)
            out_fps.append(fingerprint(outs).hex())
            if not payload["grads_fp"] or not m["grad_out"]:
                continue
            picked = [(int(i), g) for i, g in m["grad_out"].items()]
            if any(not 0 <= i < len(outs) for i, _ in picked):
                raise ValueError("the package's output gradients do not match this model's outputs")
            grads = torch.autograd.grad(
                [outs[i] for i, _ in picked],
                [params[i] for i in trainable],
                grad_outputs=[g.to(device) for _, g in picked],
                allow_unused=True,
            )
            for i, g in zip(trainable, grads, strict=True):
                if g is not None:
                    acc[i] = g if i not in acc else acc[i] + g  # as `.grad` accumulates
    finally:
        recorder.replaying = False
    grads_fp = ""
    if payload["grads_fp"]:
        scale = float(payload["scale"])
        grads_fp = fingerprint(
            _canonical(acc[i].mul(scale) if i in acc else torch.zeros_like(params[i])) for i in grad_index
        ).hex()
    return AuditReplay(tuple(out_fps), grads_fp)
