"""The campaign injector: this rank's faults of a campaign, injected into the live training job.

Attached by `enable_resiliency` when `LM_RESILIENCY_FAULT_CAMPAIGN` names a campaign file (or by
`attach_campaign`), so any script becomes a campaign's target with no code change. It counts
iterations as the session does (iteration i is the optimizer step that makes `step_count` i) and
acts at the point of the step a fault's surface names:

- before anything else of the first training forward of iteration i, in its input (the time
  SCOUT counts as the step's input, what a slow data loader takes): `delay` on the input or data
  surface;
- the first training forward of iteration i: `delay` on the compute surface;
- a watched module's output in the forward of iteration i: `tensor_corruption`, `drop`,
  `duplicate`, `reorder`, and `stale_state` (the output of the same call in iteration i - 1, where
  it had the same shape);
- before the optimizer of iteration i (gradients reduced): `tensor_corruption`, `drop`,
  `duplicate`, `reorder` of a gradient, `stale_state` of a gradient (iteration i - 1's reduced
  gradient reused), the parameters' snapshot for `stale_state` of a weight or bias;
- after the optimizer of iteration i (after GEMINI captured it): `hang`, `timeout`, `exception`,
  `process_termination`, `resource_exhaustion`, `tensor_corruption`
  of a weight, bias or optimizer state, `stale_state` (the step undone on this rank),
  `collective_desync` (a collective its peers do not issue), and the checkpoint faults on this
  rank's newest committed in-memory copy (captures in flight committed first).

Before it injects, it appends the ground truth (`GroundTruth`) to
`<ground truth dir>/ground-truth-rank<R>.jsonl` and syncs it, so even a SIGKILL it sends itself is on
record; SCOUT and the leader are never told. A restarted generation reads every rank's record to
replay the campaign's retrigger rules. A fault this version cannot inject fails at attach with a
`CampaignError` naming it, on every rank alike.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import random
import resource
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm_resiliency.adapters.base import is_dtensor, named_parameters_of
from lm_resiliency.faults.campaign import (
    Campaign,
    CampaignError,
    Fault,
    Incident,
    Occurrence,
    Schedule,
    load_campaign,
)
from lm_resiliency.faults.scoring import GroundTruth, jsonl_lines

__all__ = ["INJECTABLE", "CampaignInjector", "InjectedFault", "attach_campaign", "read_ground_truth"]

log = logging.getLogger(__name__)

# type -> the surfaces this version injects it on (FAILURES.md's other types and surfaces are
# refused at attach, never skipped silently).
INJECTABLE: dict[str, tuple[str, ...]] = {
    "hang": ("process", "compute", "collective"),
    "timeout": ("process", "compute", "collective"),
    "exception": ("process", "compute"),
    "process_termination": ("process",),
    "resource_exhaustion": ("process", "resource"),
    "delay": ("compute", "input", "data"),
    "tensor_corruption": ("weight", "bias", "gradient", "optimizer_state", "output"),
    "drop": ("gradient", "output"),
    "duplicate": ("gradient", "output"),
    "reorder": ("gradient", "output"),
    "stale_state": ("weight", "bias", "gradient", "output"),
    "resource_unavailable": ("resource", "compute"),
    "payload_corruption": ("checkpoint", "collective"),
    "io_error": ("checkpoint", "resource"),
    "message_drop": ("process", "collective"),
    "network_partition": ("process", "collective"),
    "config_drift": ("config", "process"),
    "collective_desync": ("collective", "process"),
    "checkpoint_corruption": ("checkpoint",),
    "checkpoint_truncation": ("checkpoint",),
    "checkpoint_missing": ("checkpoint",),
}
_CHECKPOINT_TYPES = ("checkpoint_corruption", "checkpoint_truncation", "checkpoint_missing")
_NODE_TYPES = ("network_partition", "config_drift")  # injected on every rank of the target's node
# config_drift's `setting`: a process-wide torch setting replicas must share, set the other way.
_DRIFTS = ("cudnn_benchmark", "matmul_precision", "deterministic")

_INPUT, _PRE_FORWARD, _OUTPUT, _PRE_OPTIMIZER, _POST = "input", "forward", "output", "pre_optimizer", "post"
_TENSOR_TYPES = ("tensor_corruption", "drop", "duplicate", "reorder")
_REUSED = ("gradient", "output")  # stale_state surfaces whose previous iteration's values are kept

# Bits of a float's mantissa and exponent, by dtype.
_LAYOUT = {
    torch.float16: (10, 5, torch.int16),
    torch.bfloat16: (7, 8, torch.int16),
    torch.float32: (23, 8, torch.int32),
    torch.float64: (52, 11, torch.int64),
}
_SCALE = {"catastrophic": 1e6, "large": 100.0, "medium": 2.0, "subtle": 1.01, "near_invisible": 1.0 + 1e-6}
_NOISE = {"catastrophic": 1e3, "large": 10.0, "medium": 1.0, "subtle": 1e-2, "near_invisible": 1e-6}
_VALUE = {"catastrophic": 1e30, "large": 1e3, "medium": 1.0, "subtle": 1e-3, "near_invisible": 0.0}


class InjectedFault(RuntimeError):
    """The `exception` a campaign injected (its text names the occurrence)."""


def _point(fault: Fault) -> str:
    s = fault.target.surface
    if fault.type == "delay" and s == "compute":
        return _PRE_FORWARD
    if fault.type == "delay":  # (input, data)
        return _INPUT
    if s == "output":
        return _OUTPUT
    if (fault.type in _TENSOR_TYPES or fault.type == "stale_state") and s == "gradient":
        return _PRE_OPTIMIZER
    return _POST


def _drift(setting: str) -> None:
    """Set a process-wide torch setting the other way (config_drift): what a node started with
    another environment, or a script that flips it on some ranks, runs with. It lasts as long as
    the process."""
    if setting == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    elif setting == "matmul_precision":
        now = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if now == "highest" else "highest")
    else:
        torch.use_deterministic_algorithms(not torch.are_deterministic_algorithms_enabled(), warn_only=True)


def check_injectable(campaign: Campaign, world_size: int | None = None, refuse_ranks: bool = True) -> None:
    """Refuse a campaign with a fault this version cannot inject, naming it; with `world_size`,
    also one that targets a rank the job does not have (it would never be injected). With
    `refuse_ranks` False (a later generation of an elastic job, which may have shrunk since the
    campaign was accepted) that is only logged: the job must not die of it."""
    for i, inc in enumerate(campaign.incidents):
        for j, f in enumerate(inc.faults):
            key = f"incidents[{i}].faults[{j}]"
            if world_size is not None and f.target.rank is not None and f.target.rank >= world_size:
                problem = CampaignError(
                    f"{key}.target.rank",
                    f"rank {f.target.rank} is not in this job of {world_size} ranks (0..{world_size - 1})",
                )
                if refuse_ranks:
                    raise problem
                log.warning("fault campaign %r: %s: not injected", campaign.name, problem)
            surfaces = INJECTABLE.get(f.type)
            if surfaces is None:
                raise CampaignError(
                    f"{key}.type",
                    f"{f.type!r} is not injected by this version (injected: {', '.join(sorted(INJECTABLE))})",
                )
            if f.target.surface not in surfaces:
                raise CampaignError(
                    f"{key}.target.surface",
                    f"{f.type} is injected on {list(surfaces)}, not {f.target.surface!r}",
                )
            if f.type == "process_termination":
                sig = f.parameters.get("signal", "SIGKILL")
                if sig not in ("SIGKILL", "SIGTERM", "SIGINT", "SIGABRT"):
                    raise CampaignError(
                        f"{key}.parameters.signal",
                        f"expected one of SIGKILL, SIGTERM, SIGINT, SIGABRT, got {sig!r}",
                    )
            if f.type == "config_drift" and f.parameters.get("setting", "cudnn_benchmark") not in _DRIFTS:
                raise CampaignError(
                    f"{key}.parameters.setting",
                    f"expected one of {', '.join(_DRIFTS)}, got {f.parameters.get('setting')!r}",
                )
            if f.type == "resource_exhaustion":
                res = f.parameters.get("resource", "file_descriptors")
                if res not in ("file_descriptors", "memory"):
                    raise CampaignError(
                        f"{key}.parameters.resource",
                        f"expected 'file_descriptors' or 'memory', got {res!r}",
                    )
            if f.parameters.get("errno", "EIO") not in ("EIO", "ENOSPC", "EROFS"):
                raise CampaignError(
                    f"{key}.parameters.errno",
                    f"expected 'EIO', 'ENOSPC' or 'EROFS', got {f.parameters.get('errno')!r}",
                )
            for name in ("chunks", "writes", "elements"):
                n = f.parameters.get(name, 1)
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise CampaignError(f"{key}.parameters.{name}", f"expected a JSON int >= 1, got {n!r}")
            for name in ("delay_ms", "duration_s", "value"):
                v = f.parameters.get(name)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                    raise CampaignError(f"{key}.parameters.{name}", f"expected a number >= 0, got {v!r}")


def _earlier(recorded: int | None, current: int | None) -> bool:
    """Whether a record of generation `recorded` is of a generation before `current` (unknown
    generations count as earlier: a job without them replays every record, as before)."""
    return recorded is None or current is None or recorded < current


def read_ground_truth(folder: str | os.PathLike[str], skipped: list[str] | None = None) -> list[GroundTruth]:
    """Every rank's ground-truth records in a folder. A torn last line (from a kill) is skipped;
    any other line that is no record is skipped too, and named in `skipped` ("<file> line N: why")."""
    out = []
    for path in sorted(Path(folder).glob("ground-truth-rank*.jsonl")):
        for n, line, torn in jsonl_lines(path):
            try:
                out.append(GroundTruth.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                if skipped is not None and not torn:
                    skipped.append(
                        f"{path} line {n}: not a ground-truth record ({type(exc).__name__}: {exc})"
                    )
    return out


@dataclass
class _Active:
    occurrence: Occurrence
    incident: Incident
    fault: Fault
    point: str
    calls: int = 0
    recorded: bool = False
    snapshot: list[torch.Tensor] = field(default_factory=list)
    since: int | None = None  # a held fault applied late: its lifetime counts from this iteration

    def active(self, iteration: int) -> bool:
        start = self.occurrence.iteration if self.since is None else self.since
        return self.incident.lifetime.active(start, iteration, self.calls)


def _draws(seed: int, a: _Active) -> random.Random:
    """The random draws of one fault's occurrence (which elements, which bytes): the same in every
    replay of the campaign. Each fault of an incident of several draws its own: two devices never
    corrupt one element alike. Before, the faults of one incident on two ranks flipped the same bit
    of the same element, so three replicas held two identical wrong values and the one right value
    was the minority named (and the two of four split in halves with no majority). An incident of
    one fault draws as it always did."""
    occ = f"{seed}/{a.occurrence.occurrence_id}"
    return random.Random(occ if len(a.incident.faults) == 1 else f"{occ}/{a.fault.fault_id}")


class CampaignInjector:
    """Injects one rank's faults of a campaign at the points of the training step."""

    name = "campaign"

    def __init__(
        self,
        campaign: Campaign,
        rank: int,
        ground_truth_dir: str | os.PathLike[str],
        model: Any,
        optimizer: Any,
        *,
        node: str | None = None,
        generation: int | None = None,
        step: int = 0,
        gemini: Any = None,
        runtime: Any = None,
        node_of: Any = None,
        scout: Any = None,
        control: Any = None,
        world_size: int | None = None,
    ) -> None:
        check_injectable(campaign, world_size, refuse_ranks=not generation)
        self.campaign = campaign
        self.rank = rank
        self.node = node
        self.generation = generation
        self.folder = Path(ground_truth_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = self.folder / f"ground-truth-rank{rank}.jsonl"
        self._held_file = self.folder / f"held-rank{rank}.jsonl"
        history = read_ground_truth(self.folder)
        # What fired before: in earlier generations (every rank's records: a rank on a standby
        # replays the campaign as the one it replaces would have), and this rank's own (a process
        # started again within its generation). Not other ranks' of this generation: a peer that
        # reached the incident's iteration while this rank was still starting had recorded it,
        # and this rank then never injected its own fault of it (a pace on every rank, not on one).
        self._schedule = Schedule(
            campaign,
            {
                Occurrence(g.incident_id, g.iteration, g.attempt)
                for g in history
                if g.rank == rank or _earlier(g.generation, generation)
            },
        )
        self._active: list[_Active] = []
        # A partition cuts off the target rank's whole node, and a config drift is the node's
        # environment: every rank there injects it.
        self._node_of = node_of
        self._runtime = runtime
        self._scout = scout
        self._control = control  # the torchrun backend's control channel, when there is one
        self._replaced = False  # (see _being_replaced)
        self._mine = {
            inc.incident_id: tuple(
                f
                for f in inc.faults
                if f in inc.faults_for(rank) or (f.type in _NODE_TYPES and self._same_node(f.target.rank))
            )
            for inc in campaign.incidents
        }
        self._model = model
        self._optimizer = optimizer
        self._gemini = gemini
        self._output: torch.Tensor | None = None  # a watched module's output, while its hook runs
        self._step = step  # completed steps (the session's step_count)
        self._iteration = -1  # the iteration whose schedule was read
        self._input_of = -1  # the iteration whose input (its first training forward) began
        self._handles: list[Any] = []
        # stale_state of a gradient or an output reuses the previous iteration's values: while such a
        # fault of this rank may come, each iteration's are kept (the targeted tensors only), by
        # (incident, fault): (iteration, one list of values per call in it).
        self._reused = {
            (inc_id, f.fault_id): f
            for inc_id, faults in self._mine.items()
            for f in faults
            if f.type == "stale_state" and f.target.surface in _REUSED
        }
        self._kept: dict[tuple[str, str], tuple[int, list[torch.Tensor]]] = {}
        self._before: dict[tuple[str, str], tuple[int, list[torch.Tensor]]] = {}
        # Faults that outlive their process: on again in this generation (already on record).
        for g in history:
            if g.rank != rank or g.incident_id not in self._mine:
                continue
            inc = campaign.incident(g.incident_id)
            until = inc.lifetime.until
            if until == "campaign_end" or (until == "replacement" and g.node == node):
                for f in self._mine[g.incident_id]:
                    if f.fault_id == g.fault_id:
                        occ = Occurrence(g.incident_id, g.iteration, g.attempt)
                        self._active.append(_Active(occ, inc, f, _point(f), recorded=True))
        # Faults held back by an earlier generation of this rank while its leader restarted it
        # (`_run`): where this generation resumed past their iteration, it never comes again, so
        # they are applied at this generation's first iteration (their occurrence ids kept).
        # Before, the restart resumed past a fault held at 21 (a hardware fault found at 18, the
        # job at 22 when it stopped): it was never injected, and the campaign failed.
        recorded = {(g.occurrence_id, g.fault_id) for g in history if g.rank == rank}
        self._late: list[_Active] = []
        for occ, fault_id, held_in in self._held():
            if (
                _earlier(held_in, generation)
                and occ.iteration <= step
                and (occ.occurrence_id, fault_id) not in recorded
            ):
                inc = campaign.incident(occ.incident_id)
                held = next((x for x in self._mine.get(occ.incident_id, ()) if x.fault_id == fault_id), None)
                if held is not None and all(a.occurrence != occ or a.fault != held for a in self._late):
                    self._late.append(_Active(occ, inc, held, _point(held), since=step + 1))
        names = {n for n, _ in _named_parameters(model)} | {
            n.removeprefix("module.") for n, _ in _named_parameters(model)
        }
        modules = dict(_named_modules(model))
        watched: dict[str, Any] = {}
        for i, inc in enumerate(campaign.incidents):
            for j, f in enumerate(inc.faults):
                if f not in self._mine[inc.incident_id]:
                    continue
                path = f.target.module_path
                key = f"incidents[{i}].faults[{j}].target.module_path"
                if f.target.surface == "output":
                    name = path or ""
                    if name not in modules and f"module.{name}" not in modules:
                        raise CampaignError(key, f"the model has no module named {name!r}")
                    watched[name] = modules.get(name, modules.get(f"module.{name}"))
                elif path is not None and path not in names:
                    raise CampaignError(
                        key, f"the model has no parameter named {path!r} (it has {sorted(names)[:8]}...)"
                    )
        for name, module in watched.items():
            self._handles.append(module.register_forward_hook(self._output_hook(name)))
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            self._handles.append(model.register_forward_pre_hook(self._on_forward))
            # First of all the model's pre-hooks (SCOUT's timing of the step's forward among them):
            # a delay there is the step's input, as a slow data loader's would be. (After the
            # optimizer's step it fell inside the session's own step-end work, counted as nobody's
            # phase: an input straggler the campaign made was never named.)
            self._handles.append(model.register_forward_pre_hook(self._on_input, prepend=True))
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            handle = optimizer.register_step_pre_hook(self._on_pre_optimizer)
            self._handles.append(handle)
            # First among the optimizer's pre-hooks: a gradient damaged after its reduction is what
            # every later reader of the step sees (SCOUT's gradient fingerprints included), as in
            # the fault it stands for. Registered last, it came after them.
            hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
            if isinstance(hooks, collections.OrderedDict) and handle.id in hooks:
                hooks.move_to_end(handle.id, last=False)

    def _same_node(self, rank: int | None) -> bool:
        if self._node_of is None:
            return False
        try:
            return bool(self._node_of(rank or 0) == self._node_of(self.rank))
        except (IndexError, KeyError, ValueError):
            return False

    # -- the session's component protocol ----------------------------------------------------------
    def on_step(self, session: Any, times: Any) -> None:
        self._step = int(getattr(session, "step_count", self._step + 1))
        self._run(self._step, _POST)

    def newest_recoverable_step(self, mode: Any) -> int:
        return -1

    def flush_for_restart(self) -> int:
        return -1

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks -------------------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            self._run(self._step + 1, _PRE_FORWARD)

    def _on_input(self, module: Any, args: Any) -> None:
        """The first training forward of an iteration (what comes before it is its input)."""
        if torch.is_grad_enabled() and self._input_of != self._step + 1:
            self._input_of = self._step + 1
            self._run(self._step + 1, _INPUT)

    def _output_hook(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return None
            self._output = output
            try:
                self._run(self._step + 1, _OUTPUT, name)
                return self._output if self._output is not output else None
            finally:
                self._output = None

        return hook

    def _on_pre_optimizer(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._run(self._step + 1, _PRE_OPTIMIZER)

    def _run(self, iteration: int, point: str, module: str | None = None) -> None:
        if iteration != self._iteration:
            self._iteration = iteration
            late, self._late = self._late, []
            for a in late:
                a.since = iteration
                self._active.append(a)
            for occ in self._schedule.due(iteration):
                inc = self.campaign.incident(occ.incident_id)
                for f in self._mine.get(occ.incident_id, ()):
                    self._active.append(_Active(occ, inc, f, _point(f)))
        fresh = self._keep_fresh(iteration, point, module) if self._reused else {}
        for a in list(self._active):
            if not a.active(iteration):
                self._active.remove(a)
                continue
            stale = a.fault.type == "stale_state"
            if stale and a.fault.target.surface not in _REUSED and point == _PRE_OPTIMIZER and not a.snapshot:
                a.snapshot = [t.detach().clone() for t in self._tensors(a.fault)]
                continue
            if a.point != point or (point == _OUTPUT and (a.fault.target.module_path or "") != module):
                continue
            if stale and a.fault.target.surface in _REUSED:
                a.snapshot = self._previous(a, iteration, fresh)
                if not a.snapshot:
                    continue
            if (
                a.fault.type in _TENSOR_TYPES
                and a.fault.target.surface != "output"
                and not self._tensors(a.fault)
            ):
                # Nothing to damage here: neither injected nor recorded (the ground truth would name
                # a fault nobody could find); the fault waits for a call that has one, in its lifetime.
                log.warning(
                    "campaign %s: %s (%s of a %s) not injected at iteration %d: this rank holds no such "
                    "tensor now (%s)",
                    self.campaign.name,
                    a.occurrence.occurrence_id,
                    a.fault.type,
                    a.fault.target.surface,
                    iteration,
                    "a parameter without a gradient: frozen, unused this step, or its gradient kept in "
                    "a partition (DeepSpeed ZeRO-2)"
                    if a.fault.target.surface == "gradient"
                    else "no optimizer state for it: none yet, or another rank's partition holds it "
                    "(DeepSpeed ZeRO)",
                )
                continue
            if not a.recorded and self._being_replaced():
                # Its processes are being stopped: the fault would hit nothing the run goes on with
                # and nobody would see it. Neither injected nor recorded: the next generation
                # replays this iteration (resumed from before it) and injects it there.
                log.warning(
                    "campaign %s: %s (%s) not injected at iteration %d: the run's leader is restarting "
                    "this generation; it comes in the next one",
                    self.campaign.name,
                    a.occurrence.occurrence_id,
                    a.fault.type,
                    iteration,
                )
                self._hold(a)
                self._active.remove(a)
                continue
            a.calls += 1
            if not a.recorded:
                a.recorded = True
                self._record(a)
            self._apply(a, iteration)

    def _hold(self, a: _Active) -> None:
        """Note a fault held back from a generation being restarted (see `_run`), synced: the next
        generation injects it at its first iteration if it resumes past this one."""
        doc = {
            "occurrence_id": a.occurrence.occurrence_id,
            "fault_id": a.fault.fault_id,
            "generation": self.generation,
        }
        try:
            with open(self._held_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(doc, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            log.warning("campaign %s: could not note the fault held back: %s", self.campaign.name, exc)

    def _held(self) -> list[tuple[Occurrence, str, int | None]]:
        """The faults this rank held back in earlier processes (`_hold`): occurrence, fault id,
        generation. A torn or foreign line is skipped."""
        out: list[tuple[Occurrence, str, int | None]] = []
        if not self._held_file.exists():
            return out
        for _, line, _ in jsonl_lines(self._held_file):
            try:
                doc = json.loads(line)
                gen = doc.get("generation")
                out.append(
                    (
                        Occurrence.parse(str(doc["occurrence_id"])),
                        str(doc["fault_id"]),
                        None if gen is None else int(gen),
                    )
                )
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
        return out

    def _being_replaced(self) -> bool:
        """Whether the torchrun leader has begun restarting this generation (a fault found a moment
        before: the workers are stopped within a second). Before, a campaign's next fault, due a few
        fast iterations after an SDC, was injected into the generation being stopped and never
        seen (outsider 45: a kill 75 ms after the SDC's verdict; no report, no restart of its own).
        Asked of the control store only when a fault is first due (its answer kept once yes)."""
        if self._replaced:
            return True
        if self._control is None or self.generation is None:
            return False
        self._replaced = self._control.restart_culprits(self.generation) is not None
        return self._replaced

    def _keep_fresh(self, iteration: int, point: str, module: str | None) -> dict[tuple[str, str], int]:
        """Keep the values of this call for the stale_state faults of gradients and outputs it
        concerns (before any fault changes them); returns their keys, each with this call's index
        in the iteration."""
        out = {}
        for key, f in self._reused.items():
            if _point(f) != point or (point == _OUTPUT and (f.target.module_path or "") != module):
                continue
            at, values = self._kept.get(key, (None, []))
            if at != iteration:
                if at is not None:
                    self._before[key] = (at, values)
                at, values = iteration, []
                self._kept[key] = (at, values)
            if point == _OUTPUT:
                assert self._output is not None
                values.append(self._output.detach().clone())
            else:
                values.extend(t.detach().clone() for t in self._tensors(f))
            out[key] = len(values) - 1
        return out

    def _previous(self, a: _Active, iteration: int, fresh: dict[tuple[str, str], int]) -> list[torch.Tensor]:
        """What a stale_state fault of a gradient or an output puts in place now: the values of the
        same call one iteration before. Empty where this process did not see that iteration (its
        first) or they do not fit (another shape): the fault waits, with a warning, for a call it
        can inject at."""
        key = (a.occurrence.incident_id, a.fault.fault_id)
        at, values = self._before.get(key, (None, []))
        now = self._kept.get(key, (None, []))[1]
        if a.fault.target.surface == "output":
            i = fresh.get(key, -1)
            values = values[i : i + 1] if i >= 0 else []
            now = now[i : i + 1] if i >= 0 else []
        elif values:
            now = now[-len(values) :]
        fits = len(values) == len(now) > 0 and all(
            v.shape == n.shape and v.dtype == n.dtype for v, n in zip(values, now, strict=True)
        )
        if at != iteration - 1 or not fits:
            log.warning(
                "campaign %s: %s (stale_state of a %s) not injected at iteration %d: %s",
                self.campaign.name,
                a.occurrence.occurrence_id,
                a.fault.target.surface,
                iteration,
                "this process did not see the iteration before"
                if at != iteration - 1
                else "the iteration before had no such values of the same shape",
            )
            return []
        return values

    # -- ground truth ----------------------------------------------------------------------------
    def _record(self, a: _Active) -> None:
        occ, f = a.occurrence, a.fault
        g = GroundTruth(
            occurrence_id=occ.occurrence_id,
            incident_id=occ.incident_id,
            fault_id=f.fault_id,
            type=f.type,
            iteration=occ.iteration,
            attempt=occ.attempt,
            rank=self.rank,
            injected_at=time.time(),
            surface=f.target.surface,
            node=self.node,
            generation=self.generation,
            expected_ranks=(self.rank,),
            detail=json.dumps(dict(f.parameters), sort_keys=True, default=str),
        )
        with open(self._file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(g.to_dict(), sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        log.warning(
            "campaign %s: injecting %s (%s) on rank %d",
            self.campaign.name,
            occ.occurrence_id,
            f.type,
            self.rank,
        )

    # -- the faults --------------------------------------------------------------------------------
    def _apply(self, a: _Active, iteration: int) -> None:
        f, p = a.fault, a.fault.parameters
        what = f"campaign {self.campaign.name!r} occurrence {a.occurrence.occurrence_id} ({f.fault_id})"
        if f.type == "hang":
            threading.Event().wait()  # the training thread never returns to the loop
        elif f.type == "timeout":
            time.sleep(float(p.get("duration_s", 3600.0)))
        elif f.type == "exception":
            raise InjectedFault(f"injected exception: {what}")
        elif f.type == "process_termination":
            os.kill(os.getpid(), getattr(signal, str(p.get("signal", "SIGKILL"))))
            if p.get("signal", "SIGKILL") == "SIGKILL":
                threading.Event().wait()
        elif f.type == "resource_exhaustion":
            self._exhaust(str(p.get("resource", "file_descriptors")))
        elif f.type == "delay":
            time.sleep(float(p.get("delay_ms", 200)) / 1000.0)
        elif f.type in _TENSOR_TYPES:
            rng = _draws(self.campaign.seed, a)
            if f.target.surface == "output":
                out = self._output
                assert out is not None
                bad = out.detach().clone()
                _tamper(f.type, bad, p, rng, rows=True)
                # The forward sees the damaged values; the backward is the undamaged one's.
                self._output = (out - out.detach()) + bad  # exactly `bad`
                return
            with torch.no_grad():  # (there is one: see _run)
                _tamper(f.type, self._tensors(f)[0], p, rng)
        elif f.type == "resource_unavailable":
            # The device reported lost by hardware telemetry (what NVML says of a GPU that fell
            # off the bus), through the path a real health event takes.
            from lm_resiliency.scout.health import HealthEvent

            if self._scout is None:
                log.warning("%s: no SCOUT in this job (enable_detection=False): nobody reads telemetry", what)
                return
            device = f.target.resource or f"gpu{f.target.index or 0}"
            self._scout.telemetry(HealthEvent("device_lost", device, True, f"injected: {what}"))
        elif f.type == "io_error":
            gem = self._gemini
            if gem is None:
                log.warning("%s: no GEMINI in this job (enable_checkpoint=False): no disk tier", what)
                return
            code = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS}[
                str(p.get("errno", "EIO"))
            ]
            gem.durable.fail_writes(int(p.get("writes", 1)), code)
        elif f.type == "payload_corruption":
            if self._runtime is None:
                log.warning("%s: no runtime whose payloads to damage (a single-process session)", what)
                return
            self._runtime.damage_outgoing(int(p.get("chunks", 1)))
        elif f.type in ("message_drop", "network_partition"):
            if self._runtime is None:
                log.warning("%s: no runtime to silence (a single-process session)", what)
                return
            self._runtime.mute(float(p.get("duration_s", 60.0)))
            if f.type == "network_partition" and self._control is not None:
                # The node is cut off from the network: its line to the control store too (a
                # message drop is our transport's alone; peers tell the two apart by that line).
                self._control.mute(float(p.get("duration_s", 60.0)))
        elif f.type == "config_drift":
            _drift(str(p.get("setting", "cudnn_benchmark")))
        elif f.type == "collective_desync":
            self._desync(int(p.get("elements", 1)), what)
        elif f.type in _CHECKPOINT_TYPES:
            self._damage_checkpoint(f.type, what, _draws(self.campaign.seed, a))
        elif f.type == "stale_state" and f.target.surface == "output":
            out = self._output
            assert out is not None
            # The forward sees the previous iteration's values; the backward is this one's.
            self._output = (out - out.detach()) + a.snapshot[0]  # exactly those values
        elif f.type == "stale_state":
            with torch.no_grad():
                for t, old in zip(self._tensors(f), a.snapshot, strict=False):
                    t.copy_(old)
            a.snapshot = []  # the next iteration of its lifetime reuses that one's start

    def _desync(self, elements: int, what: str) -> None:
        """Issue one collective the peers do not: a broadcast of `elements` from this rank on the
        default group, between steps, as a branch taken on some ranks only does (`if rank == 0:
        dist.broadcast(...)`). It goes through `torch.distributed` as the script's own call would.
        The peers' next collective is another op (their next step's all-reduce), so the ranks wait
        in different collectives (gloo pairs collectives of different ops with nothing; one of
        another size, it aborts on) until the process group's timeout, as an NCCL job waits for its
        watchdog."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            log.warning("%s: no process group to issue a collective in", what)
            return
        first = next(iter(_named_parameters(self._model)), None)
        device = first[1].device if first is not None else torch.device("cpu")
        dist.broadcast(torch.zeros(elements, device=device), src=dist.get_rank())

    def _damage_checkpoint(self, kind: str, what: str, rng: random.Random) -> None:
        """Damage this rank's newest committed in-memory copy: a flipped payload byte, the file cut
        to half its payload, or the file deleted. GEMINI finds it by its checksums (at once with
        `verify_integrity`, else at the restore that needs it) and uses another copy. A capture of
        the step that still waits for the loop's work after the step (its scheduler, its next
        fetch or back edge) is not taken early, which would change what it holds: the damage
        waits for it, and hits that step's copy."""
        gem = self._gemini
        if gem is None:
            log.warning("%s: no GEMINI in this job (enable_checkpoint=False): nothing to damage", what)
            return
        if gem.capture_waiting():
            gem.after_capture(lambda: self._damage_newest(kind, what, rng))
        else:
            self._damage_newest(kind, what, rng)

    def _damage_newest(self, kind: str, what: str, rng: random.Random) -> None:
        from lm_resiliency.runtime.shm import HEADER_SIZE, CorruptSlot, SlotFile

        gem = self._gemini
        # Captures in flight committed first (damage to one being written would be checksummed
        # with it: a silent corruption, restored). Bounded: a replication stuck on an unreachable
        # holder keeps GEMINI busy for minutes, and a committed copy is what gets damaged anyway
        # (one being sent then fails its checksums at the holder, as a damaged copy should).
        gem.settle(5.0)
        newest: tuple[int, Path, int] | None = None
        for path in sorted(Path(gem.dir).glob(f"own-r{self.rank}-s*")):
            try:
                slot = SlotFile.open_existing(path)
            except CorruptSlot:
                continue
            try:
                h = slot.read_header()
            except CorruptSlot:
                continue
            finally:
                slot.close()
            if newest is None or h.step > newest[0]:
                newest = (h.step, path, h.payload_len)
        if newest is None:
            log.warning("%s: rank %d holds no committed copy yet: nothing to damage", what, self.rank)
            return
        step, path, size = newest
        if kind == "checkpoint_missing":
            path.unlink()
        elif kind == "checkpoint_truncation":
            os.truncate(path, HEADER_SIZE + size // 2)
        else:
            with open(path, "r+b") as fh:
                fh.seek(HEADER_SIZE + rng.randrange(max(1, size)))
                byte = fh.read(1)
                fh.seek(-1, os.SEEK_CUR)
                fh.write(bytes([byte[0] ^ 0x10]) if byte else b"\x10")
        log.warning("%s: %s of rank %d's copy of step %d (%s)", what, kind, self.rank, step, path.name)

    def _exhaust(self, what: str) -> None:
        """Run out of a resource under a limit set on this process only (never the host's)."""
        if what == "memory":
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + (64 << 20), hard))
            hog = []
            while True:
                hog.append(bytearray(16 << 20))
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(len(os.listdir("/proc/self/fd")) + 16, hard), hard))
        held = []
        while True:  # until EMFILE ("Too many open files") ends the worker
            held.append(open(os.devnull))  # noqa: SIM115 - held open on purpose

    def _tensors(self, f: Fault) -> list[torch.Tensor]:
        """The tensors a fault's target names: a parameter (or its gradient, or its optimizer
        state) by `module_path` (a parameter name; DDP's `module.` prefix optional) or `index`."""
        named = list(_named_parameters(self._model))
        if f.target.module_path is not None:
            want = f.target.module_path
            picked = [p for n, p in named if n == want or n.removeprefix("module.") == want]
        elif f.target.surface == "bias":
            picked = [p for n, p in named if n.endswith("bias")][f.target.index or 0 :][:1]
        else:
            picked = [p for _, p in named if p.is_floating_point()][f.target.index or 0 :][:1]
        if f.target.surface == "gradient":
            found = [p.grad for p in picked if p.grad is not None]
        elif f.target.surface == "optimizer_state":
            state = getattr(self._optimizer, "state", {})
            found = [v for p in picked for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            fragments = getattr(self._optimizer, "state_fragments", None)
            if not found and fragments is not None:  # a partition (DeepSpeed ZeRO): this rank's part
                found = [v for p in picked for v in fragments(p)]
            found = [v for v in found if v.numel() > 1]  # (not a step count)
        else:
            found = [p.data for p in picked]
        # A sharded tensor (FSDP2's DTensor) is damaged in this rank's shard, in place; a rank whose
        # shard is empty has nothing to damage. (Whole, an unevenly sharded one could not even be
        # flattened: the injection raised in the training step.)
        return [t for t in map(_local, found) if t.numel() > 0]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 1 << 30


def _named_parameters(model: Any) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(model, (list, tuple)):
        for i, m in enumerate(model):
            for n, p in m.named_parameters():
                yield f"{i}.{n}", p
    elif hasattr(model, "named_parameters"):
        yield from named_parameters_of(model)


def _named_modules(model: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(model, (list, tuple)):
        for i, m in enumerate(model):
            for n, sub in m.named_modules():
                yield (f"{i}.{n}" if n else str(i)), sub
    elif hasattr(model, "named_modules"):
        yield from model.named_modules()


def _tamper(kind: str, t: torch.Tensor, params: Any, rng: random.Random, rows: bool = False) -> None:
    """In place: `drop` zeroes the tensor (a skipped bucket or output), `duplicate` repeats it (a
    gradient counted twice; an output's first row over its second, a repeated sample), `reorder`
    rolls it by one along its leading dimension; `tensor_corruption` as `corrupt` says. A sparse
    gradient (an `Embedding(sparse=True)`'s) is damaged in its entries: the rows it holds."""
    if t.layout == torch.sparse_coo:
        t = t._values()
    if kind == "drop":
        t.zero_()
    elif kind == "duplicate":
        if rows and t.dim() > 0 and t.shape[0] > 1:
            t[1] = t[0].clone()
        else:
            t.mul_(2)
    elif kind == "reorder":
        if t.dim() > 0 and t.shape[0] > 1:
            t.copy_(t.roll(1, 0))
        else:
            t.neg_()  # one element: nothing to permute; the order's sign, as a swapped operand
    else:
        corrupt(t, params, rng)


def corrupt(t: torch.Tensor, params: Any, rng: random.Random) -> None:
    """Corrupt a floating-point tensor in place as `params` says (operation, scope, magnitude)."""
    if t.layout == torch.sparse_coo:  # its entries (the rows it holds)
        t = t._values()
    if not t.is_contiguous():  # a channels_last or transposed weight: its elements in logical order
        work = t.contiguous()
        corrupt(work, params, rng)
        t.copy_(work)
        return
    op = params.get("operation", "single_bitflip")
    scope = params.get("scope", "single")
    magnitude = params.get("magnitude", "large")
    flat = t.view(-1)
    n = flat.numel()
    if scope == "single":
        idx = torch.tensor([rng.randrange(n)])
    elif scope == "row":
        rows = t.shape[0] if t.dim() > 1 else 1
        width = n // rows
        r = rng.randrange(rows)
        idx = torch.arange(r * width, (r + 1) * width)
    else:
        k = max(1, round(n * float(scope.rstrip("%")) / 100.0))
        idx = torch.tensor(sorted(rng.sample(range(n), k)))
    idx = idx.to(flat.device)
    if op in ("single_bitflip", "multi_bitflip"):
        mant, exp, itype = _LAYOUT.get(t.dtype, _LAYOUT[torch.float32])
        bit = {
            "catastrophic": mant + exp - 1,
            "large": mant + 2,
            "medium": mant - 1,
            "subtle": max(0, mant - 8),
            "near_invisible": 0,
        }[magnitude]
        bits = [bit] if op == "single_bitflip" else sorted({bit, max(0, bit - 1), max(0, bit - 3)})
        mask = 0
        for b in bits:
            mask |= 1 << b
        if mask >= 1 << (torch.iinfo(itype).bits - 1):
            mask -= 1 << torch.iinfo(itype).bits  # as a signed integer of the same width
        ints = flat.view(itype)
        ints[idx] = ints[idx] ^ torch.tensor(mask, dtype=itype, device=flat.device)
    elif op == "sign_flip":
        flat[idx] = -flat[idx]
    elif op == "scale":
        flat[idx] = flat[idx] * float(params.get("factor", _SCALE[magnitude]))
    elif op == "set_value":
        flat[idx] = float(params.get("value", _VALUE[magnitude]))
    elif op == "noise":
        std = float(params.get("std", _NOISE[magnitude])) * max(float(flat.abs().mean()), 1e-6)
        g = torch.Generator().manual_seed(rng.randrange(1 << 62))
        flat[idx] = flat[idx] + torch.randn(idx.numel(), generator=g, dtype=flat.dtype).to(flat.device) * std


def _node_of(session: Any) -> Any:
    topo = getattr(session, "_topology", None)
    return None if topo is None else topo.node_of


def attach_campaign(
    session: Any, campaign: Campaign | str | os.PathLike[str], ground_truth_dir: str | os.PathLike[str]
) -> CampaignInjector:
    """Inject a campaign's faults for this rank into a session's job (what the
    `LM_RESILIENCY_FAULT_CAMPAIGN` variable does at `enable_resiliency`)."""
    c = campaign if isinstance(campaign, Campaign) else load_campaign(campaign)
    adapter = getattr(session, "_adapter", None)
    env = getattr(session, "env", None)
    inj = CampaignInjector(
        c,
        session.rank,
        ground_truth_dir,
        getattr(adapter, "model", None),
        getattr(adapter, "optimizer", None),
        node=env.node_id() if env is not None else None,
        generation=env.generation if env is not None else None,
        step=session.step_count,
        gemini=getattr(session, "gemini", None),
        runtime=getattr(session, "_runtime", None),
        node_of=_node_of(session),
        scout=getattr(session, "scout", None),
        control=getattr(session, "_control", None),
        world_size=getattr(session, "world_size", None),
    )
    session.add_component(inj)
    return inj
