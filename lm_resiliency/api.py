"""The composition root: arguments -> settings -> adapter -> runtime -> session.

`enable_resiliency` is the one entry point users call (INTERFACE.md §1). GEMINI (checkpoints) and
SCOUT (detection) attach to the session through `Session.add_component`; until they are enabled the
session still runs the runtime (membership, telemetry gossip) and reports peer failures.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import gc
import inspect
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lm_resiliency._sigwatch import SigtermWatch
from lm_resiliency.adapters.base import (
    NUMERICS_KEYS,
    AdapterTopology,
    StepTimes,
    live_instances,
    numerics_settings,
    parameters_of,
)
from lm_resiliency.adapters.detect import FRAMEWORKS, detect_framework
from lm_resiliency.config import (
    DAMAGE_FAILURES,
    DEFAULT_RESTART_IN_PLACE_ON,
    REPLACE_ONLY_FAILURES,
    DurableCheckpointConfig,
    Environment,
    InMemoryCkptConfig,
    OrchestrationHooks,
    RecoveryDecision,
    RecoveryMode,
    ReplayHarnessConfig,
    RuntimeConfig,
    SCOUTFaultReport,
    load_policy,
    read_environment,
)
from lm_resiliency.core.gemini.recovery import memory_checkpoint_id
from lm_resiliency.core.membership import EventKind, MembershipEvent
from lm_resiliency.core.messages import StepTelemetry
from lm_resiliency.core.scout.verdicts import LEFT, PEERS_WAIT, final_steps_verdict
from lm_resiliency.core.taxonomy import (
    CANONICAL_TYPES,
    CLOSED,
    EXIT_FAILURES,
    FAILURE_KINDS,
    classify_exit,
    default_recovery_mode,
    kind_of,
)
from lm_resiliency.core.topology import ParallelDim, Topology, node_ids_by_machine, replica_groups_from
from lm_resiliency.errors import ConfigError, UnsupportedFrameworkError
from lm_resiliency.runtime.discovery import StoreDiscovery
from lm_resiliency.runtime.node import ClusterView, RankRuntime
from lm_resiliency.runtime.trail import CollectiveTrail
from lm_resiliency.runtime.transport import ZmqTransport

__all__ = ["ResiliencySession", "Session", "SessionComponent", "enable_resiliency"]

log = logging.getLogger(__name__)

# The reason of the report a restart makes of a rank of the generation before that ended failing
# where no peer saw it go (`Session._report_unwatched_exits`).
EXITED_UNWATCHED = "exited_unwatched"
# Verdicts the torchrun backend's leader acts on (restart in place, or replace the culprit's node),
# and a data-loader or checkpoint-I/O stall once its peers wait on it (the job stopped).
BACKEND_ACTIONABLE = frozenset(
    {"sdc", "stale_state", "hardware", "hang", "network_partition", "collective_desync"}
)


def unwatched_exit(e: Mapping[str, Any]) -> bool:
    """Whether a restart reports the exit `e` (one of the restart context's `worker_exits`): no
    report named the rank (`reported`), and its end was its own: its node's the restart is for
    (`culprit`), or a signal other than gloo's abort (a kill, a SIGTERM sent to it alone while
    another fault explained the group's stop). Another node's rank that ended of an exception or an
    abort was most often a casualty of the culprit's end: a broken collective."""
    rank, code = e.get("rank"), e.get("exitcode")
    if not isinstance(rank, int) or not isinstance(code, int) or e.get("reported", True):
        return False
    return bool(e.get("culprit")) or (code < 0 and code != -signal.SIGABRT)


def _unwatched_exits(ctx: Any, generation: int) -> list[tuple[int, Any, dict[str, Any]]]:
    """(rank, the node whose agent saw it end, the report's details) of each exit of the generation
    before that the restart context `ctx` holds and a restart reports (`unwatched_exit`)."""
    if not isinstance(ctx, dict) or not isinstance(ctx.get("worker_exits"), list):
        return []
    before = int(ctx.get("generation", generation)) - 1
    out = []
    for e in ctx["worker_exits"]:
        if not isinstance(e, dict) or not unwatched_exit(e):
            continue
        rank, code = int(e["rank"]), int(e["exitcode"])
        try:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        except ValueError:
            how = f"exit code {code}"
        at = e.get("at")
        latency = max(0.0, time.time() - float(at)) if isinstance(at, (int, float)) else None
        detail = (
            f"rank {rank}'s process of generation {before} ended ({how}) and no fault report "
            f"named it (its peers had left their loops, or another fault explained the stop); "
            f"its agent on node {e.get('node')} saw the exit"
        )[:MAX_ERROR_TEXT]
        out.append(
            (rank, e.get("node"), {"detection_latency_s": latency, "exit_code": str(code), "detail": detail})
        )
    return out


def _report_line(report: Mapping[str, Any], generation: int) -> str:
    """A report as a report file holds it (one JSON line). The generation tells a restarted
    worker's report from its predecessor's (scoring)."""
    head = {"time": time.time(), "pid": os.getpid(), "generation": generation}
    return json.dumps({**head, **report}, default=str)


def report_unwatched_exits(rank: int, report_dir: str | None) -> int:
    """What rank 0 of a restart reports as its session starts (`Session._report_unwatched_exits`),
    for a restart whose workers opened no session: a zero-import script with no step left to run
    (the failure came after the last step's capture) makes no forward to open one, so a rank that
    ended unseen in the generation before (SIGTERMed or killed in the last step) was named by no
    report. Appended to `<report_dir>/reports-rank0.jsonl` (the policy's, else
    LM_RESILIENCY_REPORT_DIR) as a session appends them, and logged; returns how many. Never
    raises: called at the script's exit."""
    try:
        env = read_environment()
        folder = report_dir or env.report_dir
        if rank != 0 or not env.restart_context_path:
            return 0
        ctx = json.loads(Path(env.restart_context_path).read_text())
        exits = _unwatched_exits(ctx, env.generation)
        lines = []
        for failed, node, details in exits:
            report = SCOUTFaultReport(
                kind="process_failure",
                failed_ranks=(failed,),
                sources=("agent",),
                reason=EXITED_UNWATCHED,
                node=node if isinstance(node, str) else None,
                confidence=1.0,
                detection_latency_s=details.pop("detection_latency_s"),
            ).to_dict()
            report.update(details)
            log.warning("rank 0: fault report (no session opened): %s", report["detail"])
            lines.append(_report_line(report, env.generation))
        if lines and folder:
            path = Path(folder) / f"reports-rank{rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write("".join(line + "\n" for line in lines))
        return len(lines)
    except (OSError, ValueError, TypeError, KeyError, ConfigError) as exc:
        log.error("rank %d: cannot report the generation before's unseen exits: %s", rank, exc)
        return 0


def stopped_by_restart(
    peers: Iterable[int], node_of: Callable[[int], str | None], culprits: set[str], first: Mapping[str, int]
) -> set[int]:
    """Of `peers` that went, those a restart stopped: ranks of nodes it is not for (`culprits`), and
    of a culprit node the ranks its agent stopped after its first one ended (`first`: that rank by
    node, where its agent said). Before, a culprit's node-mates were named `terminated` beside it."""
    return {p for p in peers if node_of(p) not in culprits or first.get(str(node_of(p)), p) != p}


def _actionable(report: dict[str, Any], also_on: frozenset[str] = frozenset()) -> bool:
    """Whether the torchrun backend's leader acts on `report` (it is posted to it): a failure kind,
    peers waiting on a rank, or a kind the job trains on through (a slow job, REPLACE_ONLY_FAILURES;
    damage, DAMAGE_FAILURES) that the run's policy replaces nodes for or restarts on (`also_on`)."""
    kind = report.get("kind")
    reason = str(report.get("reason", ""))
    return (
        kind in BACKEND_ACTIONABLE
        or kind in also_on
        or reason.endswith(PEERS_WAIT)
        # Torch settings drifted on some ranks (a restart starts them as the job's others); not
        # optimizer settings stepped differently by the script, which a restart would repeat.
        or (kind == "config_drift" and reason == "settings_differ")
    )


MAX_ERROR_TEXT = 2000  # characters of an uncaught exception's text carried in reports and goodbyes
# A peer that said it was terminated (SIGTERM) is reported this long after, unless this rank is
# being stopped too by then (the worker group stopped as a whole: nobody's fault) or a fault this
# rank reported shortly before explains it (a restart under way).
TERMINATION_REPORT_DELAY_S = 1.0
TERMINATION_EXPLAINED_S = 30.0
# A loop that ends this soon after a fault this rank posted to the torchrun backend's leader waits
# this long, at most, for the leader's restart before its session closes (see Session._settle).
HOLD_S = 10.0
# How long a rank at its loop's end waits for every peer's final step count (Session._settle). Its
# peers end their loops together with it, in lockstep; one that does not within this long (its own
# work after the loop, before it closes the session) is left out of the comparison.
FINALS_WAIT_S = 3.0

# Options each framework's adapter cannot take: the framework object owns them.
_FORBIDDEN_OPTIONS = {
    "deepspeed": ("optimizer", "opt_param_scheduler"),
    "torchtitan": ("optimizer", "opt_param_scheduler"),
    "megatron": (),
    "pytorch": (),
}


@runtime_checkable
class ResiliencySession(Protocol):
    """What `enable_resiliency` returns (INTERFACE.md §1)."""

    @property
    def step_count(self) -> int: ...
    @property
    def recovered_step(self) -> int: ...
    @property
    def last_recovery_decision(self) -> dict[str, Any] | None: ...
    def instrument_dataloader(self, dataloader: Any, name: str = "train") -> Any: ...
    def checkpoint_io(self, kind: str, name: str = "") -> contextlib.AbstractContextManager[None]: ...
    def prepare_recovery(self, failure_kind: str, all_ranks_accessible: bool = True) -> RecoveryMode: ...
    def flush_for_restart(self) -> int: ...
    def close(self) -> None: ...


class SessionComponent(Protocol):
    """A capability plugged into a session (GEMINI, SCOUT). Hooks run on the training thread."""

    name: str

    def on_step(self, session: Session, times: StepTimes) -> None: ...
    def newest_recoverable_step(self, mode: RecoveryMode) -> int: ...
    def flush_for_restart(self) -> int: ...
    def close(self) -> None: ...


def _warn_of_parameters_outside(model: Any, optimizer: Any) -> None:
    """A capture holds the model's state dict and the optimizer's: the values of parameters the
    optimizer steps that are not the model's are in neither (the optimizer's state dict holds their
    moments, not them). A restart would restore their moments onto fresh values."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return
    mine = {id(p) for p in parameters_of(model)}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    outside = [p for p in stepped if id(p) not in mine]
    if outside:
        shapes = ", ".join(str(tuple(p.shape)) for p in outside[:4]) + (", ..." if len(outside) > 4 else "")
        warnings.warn(
            f"enable_resiliency: {len(outside)} of the {len(stepped)} parameters the optimizer steps "
            f"are not the model's ({shapes}): a capture holds their optimizer state but not their "
            "values, so a restart resumes them from fresh values. Pass a module that holds them "
            "(an nn.ModuleDict of every model), or keep them in extra_state_fn.",
            stacklevel=3,
        )


def _check_callable(name: str, fn: Any, takes: str) -> None:
    """A caller's function must take the arguments it will be called with (`takes`: one positional
    argument by that name, or none). Most are called only on a fault or a restart: a wrong one
    would first raise then, inside the recovery, so it is refused here, naming it."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: not checkable
        return
    try:
        sig.bind(*([None] if takes else []))
    except TypeError:
        called = f"one argument ({name}({takes}))" if takes else f"no arguments ({name}())"
        raise TypeError(f"{name} is called with {called}, but its signature is {sig}") from None


def _warn_of_other_optimizers(model: Any, optimizer: Any, live: list[Any]) -> None:
    """Another optimizer stepping parameters of the model (Muon for the matrices and AdamW for the
    rest, a GAN's two): only the one passed is captured, so a restart resumes the other's state
    (momentum, step counts) from fresh and the run is not the one it would have been, silently."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return
    from lm_resiliency.adapters.chain import members_of

    inside = set()  # the passed optimizers' own (ZeroRedundancyOptimizer's inner one, a wrapper's)
    todo = list(members_of(optimizer))
    while todo:
        obj = todo.pop()
        if id(obj) not in inside:
            inside.add(id(obj))
            todo += [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, torch.optim.Optimizer)]
    mine = {id(p) for p in parameters_of(model)}
    for other in live:
        if not isinstance(other, torch.optim.Optimizer) or id(other) in inside:
            continue
        held = [p for group in getattr(other, "param_groups", ()) for p in group.get("params", ())]
        shared = sum(id(p) in mine for p in held)
        if shared:
            warnings.warn(
                f"enable_resiliency: another optimizer ({type(other).__name__}) steps {shared} "
                f"parameters of the model, and only the one passed ({optimizer!r}) is captured: a "
                "restart resumes the other's state (momentum, step counts) from fresh. Pass them "
                "all, as a list: optimizer=[first, second].",
                stacklevel=3,
            )


def _refuse_an_engines_module(model: Any, live: list[Any]) -> None:
    """The module of a DeepSpeed engine passed with the engine's optimizer: the engine's scheduler
    and step counters would not be captured, and a restart would resume them from the start (its
    ZeRO optimizer is no torch optimizer at all). The engine is what to pass."""
    for obj in live:
        if (
            "DeepSpeedEngine" in {c.__name__ for c in type(obj).__mro__}
            and getattr(obj, "module", None) is model
        ):
            raise TypeError(
                "enable_resiliency: the model is a DeepSpeed engine's module; pass the engine "
                "(enable_resiliency(engine)): it owns the optimizer, the scheduler and the step "
                "counters a restart must restore"
            )


def _schedulers_of_chain(chain: Any, given: Any, live: list[Any]) -> Any:
    """The schedulers to capture with an `OptimizerChain`: those given (one or a list), and for
    each member none of them steps, the one found stepping it; several as one `SchedulerChain`."""
    from lm_resiliency.adapters.chain import SchedulerChain, members_of

    given = list(given) if isinstance(given, (list, tuple)) else ([] if given is None else [given])
    out: list[Any] = []
    for m in chain.members:
        mine = [s for s in given if getattr(s, "optimizer", None) is m]
        out += [_scheduler_of(m, s, live) for s in mine] if mine else [_scheduler_of(m, None, live)]
    out += [s for s in given if not any(getattr(s, "optimizer", None) is m for m in chain.members)]
    out = [one for s in out for one in (members_of(s) if s is not None else ())]  # (one chain, flat)
    unique = list({id(s): s for s in out if s is not None}.values())
    if len(unique) <= 1:
        return unique[0] if unique else None
    return SchedulerChain(unique)


def _schedulers_for(optimizer: Any, given: Any, live: list[Any]) -> Any:
    """The scheduler(s) to capture with `optimizer` (an `OptimizerChain`: with each member)."""
    from lm_resiliency.adapters.chain import OptimizerChain

    if isinstance(optimizer, OptimizerChain):
        return _schedulers_of_chain(optimizer, given, live)
    return _scheduler_of(optimizer, given, live)


def captured_with(optimizer: Any) -> tuple[Any, Any, Any]:
    """What a session given `optimizer` (one, or a list: held as one) and no scheduler captures:
    (the optimizer as it holds it, the scheduler(s) stepping it, the job's GradScaler), found as
    `enable_resiliency` finds them (a restore without a session: `gemini.local`)."""
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    from lm_resiliency.adapters.chain import OptimizerChain

    if isinstance(optimizer, (list, tuple)):
        optimizer = OptimizerChain(optimizer) if len(optimizer) != 1 else optimizer[0]
    live = live_instances(Optimizer, LRScheduler, ReduceLROnPlateau)
    return optimizer, _schedulers_for(optimizer, None, live), _grad_scaler()


def _scheduler_of(optimizer: Any, given: Any, live: list[Any]) -> Any:
    """The scheduler to capture with `optimizer`: the one given, or the one found stepping it. One
    given that is part of a SequentialLR or ChainedScheduler is replaced by that one, whose state
    holds the schedule's position (and whose step() the loop calls)."""
    from lm_resiliency.adapters.pytorch import find_scheduler

    if given is not None and not hasattr(given, "state_dict"):
        return given  # not a torch scheduler: taken as given
    found, outer = find_scheduler(optimizer, live)
    if given is None:
        if found is not None:
            log.info("captured with the optimizer: its %s (opt_param_scheduler)", type(found).__name__)
        elif outer:
            # Several step it (a warm-up stepped per step and a ReduceLROnPlateau per epoch): every
            # one is captured, in an order every restart finds again (by type). Before,
            # none was, and a zero-import script (which cannot name them) restarted its schedule.
            from lm_resiliency.adapters.chain import SchedulerChain

            ordered = sorted(outer, key=lambda o: type(o).__name__)
            log.info(
                "captured with the optimizer: the schedulers stepping it, %s (opt_param_scheduler)",
                ", ".join(type(o).__name__ for o in ordered),
            )
            return SchedulerChain(ordered)
        return found
    parent = next((o for o in outer if any(c is given for c in getattr(o, "_schedulers", ()))), None)
    if parent is None:
        return given
    warnings.warn(
        f"enable_resiliency: opt_param_scheduler ({type(given).__name__}) is part of a "
        f"{type(parent).__name__} that steps this optimizer: that one is captured instead (its state "
        "holds the schedule's position).",
        stacklevel=3,
    )
    return parent


class _DeferredSignals:
    """Python handlers of some signals held back while a signal handler of ours does its work (main
    thread). torchrun stops a worker by sending SIGTERM to its whole process group: a DataLoader's
    worker processes die of it too, and the loader's SIGCHLD handler raises in the main thread,
    into the flush our SIGTERM handler is writing (it was cut short: no copy on disk, half a file)."""

    def __init__(self, signums: tuple[int, ...]) -> None:
        self.came: list[int] = []
        self.saved: dict[int, Any] = {}
        for signum in signums:
            try:
                previous = signal.getsignal(signum)
                if callable(previous):  # (a default or ignored one raises nothing into us)
                    signal.signal(signum, lambda n, f: self.came.append(n))
                    self.saved[signum] = previous
            except (ValueError, OSError):  # not the main thread, or no such signal here
                continue

    def restore(self) -> Callable[[], None]:
        """Put the handlers back; returns what delivers the signals that came meanwhile to them
        (run it last: they may raise, as they would have when the signal came)."""
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        came, self.came = sorted(set(self.came)), []

        def deliver() -> None:
            for signum in came:
                signal.raise_signal(signum)

        return deliver


def _is_process_group(group: Any) -> bool:
    import torch.distributed as dist

    return isinstance(group, dist.ProcessGroup)


def _grad_scaler() -> Any:
    """The job's loss scaler (torch.amp.GradScaler, enabled), when there is exactly one: captured
    with the optimizer and watched for the steps it skips (see adapters.amp)."""
    from lm_resiliency.adapters.amp import find_grad_scalers

    if find_grad_scalers():
        # Some may be garbage not collected yet (a closed session's, in a cycle): a scaler nothing
        # steps must not be taken for the job's. Only jobs that have one pay for the collection.
        gc.collect()
    found = find_grad_scalers()
    if len(found) > 1:
        warnings.warn(
            f"enable_resiliency: {len(found)} GradScalers exist: none is captured (a restart resets the "
            "loss scale) and the steps they skip are not counted. Keep one per job.",
            stacklevel=3,
        )
        return None
    if found:
        log.info("captured with the optimizer: its GradScaler (loss scale, skipped steps counted)")
    return found[0] if found else None


_OPEN: weakref.WeakSet[Session] = weakref.WeakSet()  # sessions started in this process
_STARTED = [0]  # how many, closed ones included


def sessions_started() -> int:
    """How many sessions this process started (closed ones included)."""
    return _STARTED[0]


def _check_device(device: Any, model: Any) -> None:
    """`device` (INTERFACE.md's option): a torch device, or a string or index naming one. What we run
    on is where the model's parameters are; a device that names another type is ignored, with a
    warning."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device: {device!r} names no torch device ({exc})") from None
    chunks = model if isinstance(model, (list, tuple)) else [model]  # Megatron-style chunks too
    kinds = {
        p.device.type for m in chunks if callable(getattr(m, "parameters", None)) for p in m.parameters()
    }
    if kinds and dev.type not in kinds:
        warnings.warn(
            f"enable_resiliency: device={device!r}, but the model's parameters are on "
            f"{'/'.join(sorted(kinds))}: SCOUT and GEMINI work where the parameters are",
            stacklevel=3,
        )


def open_session() -> Session | None:
    """This process's open session, if any (one per process; no reference to a closed one kept)."""
    return next((o for o in list(_OPEN) if not o._closed), None)


def enable_resiliency(
    model: Any,
    optimizer: Any = None,
    *,
    opt_param_scheduler: Any = None,
    framework: str = "auto",
    interval: int = 10,
    enable_checkpoint: bool = True,
    enable_detection: bool = True,
    checkpoint: InMemoryCkptConfig | None = None,
    replay: ReplayHarnessConfig | None = None,
    group: Any = None,
    device: Any = None,
    parallelism_info: dict[str, Any] | None = None,
    fault_callback: Callable[[dict[str, Any]], None] | None = None,
    orchestration: OrchestrationHooks | None = None,
    extra_state_fn: Callable[[], Any] | None = None,
    load_extra_state_fn: Callable[[Any], None] | None = None,
    load_fallback: Callable[[int | None], int | None] | None = None,
    durable_checkpoint: DurableCheckpointConfig | None = None,
    recovery_mode: RecoveryMode | str | None = None,
    runtime: RuntimeConfig | None = None,
    store: Any = None,
    health_source: Any = None,
) -> Session:
    """Attach lm-resiliency to a training job. Call once per rank, after `init_process_group` and after
    the model and optimizer exist, before the training loop.

    Args:
        model: an `nn.Module` (DDP, FSDP2, plain), a list of Megatron chunks, a DeepSpeed engine or a
            TorchTitan trainer.
        optimizer: the optimizer whose steps delimit training steps.
        framework: "auto" detects from `model`; or one of "pytorch", "torchtitan", "megatron", "deepspeed".
        interval: steps between GEMINI captures and SCOUT checks (> 0).
        runtime: heartbeat and transport settings (ours, beyond the 0.2 interface).
        store: a torch.distributed Store for discovery; defaults to the default process group's.
        health_source: a `lm_resiliency.scout.health.HealthSource` (hardware telemetry); default: NVML
            where an NVIDIA driver and GPU are present, none elsewhere; False disables it.
        load_fallback: on a restart where no in-memory, replica or durable copy is loadable for every
            rank, called with the requested step (or None); it restores the caller's own checkpoint
            and returns the step it restored (or None/-1 to start fresh).
        The other arguments are described in INTERFACE.md §1.

    Returns:
        The session (see `ResiliencySession`); also a context manager, closed at interpreter exit.

    Raises:
        ValueError: unknown framework, `interval <= 0`, bad `recovery_mode`, a `device` torch does not know.
        TypeError: an option the framework cannot take, or an argument of the wrong type.
        UnsupportedFrameworkError: a recognised framework this version has no adapter for.
        DiscoveryError: peers could not be found through the store.
    """
    if framework != "auto" and framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; expected 'auto' or one of {list(FRAMEWORKS)}")
    if type(interval) is not int:
        raise TypeError(f"interval must be an int, got {type(interval).__name__}")
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval}")
    for name, value, cls in (
        ("checkpoint", checkpoint, InMemoryCkptConfig),
        ("replay", replay, ReplayHarnessConfig),
        ("durable_checkpoint", durable_checkpoint, DurableCheckpointConfig),
        ("orchestration", orchestration, OrchestrationHooks),
        ("runtime", runtime, RuntimeConfig),
    ):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    hooks = orchestration or OrchestrationHooks()
    for name, fn, takes in (
        ("fault_callback", fault_callback, "report"),
        ("extra_state_fn", extra_state_fn, ""),
        ("load_extra_state_fn", load_extra_state_fn, "state"),
        ("load_fallback", load_fallback, "step"),
        ("orchestration.report_fault", hooks.report_fault, "report"),
        ("orchestration.report_recovery", hooks.report_recovery, "decision"),
        ("orchestration.restart_destination", hooks.restart_destination, "report"),
    ):
        if fn is not None:
            _check_callable(name, fn, takes)
    if parallelism_info is not None and not isinstance(parallelism_info, Mapping):
        raise TypeError(
            "parallelism_info must be a mapping ({'replica_group': [...], 'peer_group': [...], "
            f"'dims': {{...}}}}), got {type(parallelism_info).__name__}"
        )
    if group is not None and not _is_process_group(group):
        raise TypeError(
            "group must be a torch.distributed process group (dist.group.WORLD, dist.new_group(...)), "
            f"got {type(group).__name__}"
        )
    schedulers = (
        opt_param_scheduler if isinstance(opt_param_scheduler, (list, tuple)) else [opt_param_scheduler]
    )
    for sched in schedulers:
        if sched is not None and not callable(getattr(sched, "step", None)):
            raise TypeError(
                "opt_param_scheduler must be a scheduler with a step() (a torch LRScheduler, Megatron's "
                f"OptimizerParamScheduler), or a list of them for a list of optimizers; got "
                f"{type(sched).__name__}"
            )
    if extra_state_fn is not None and load_extra_state_fn is None:
        warnings.warn(
            "enable_resiliency: extra_state_fn without load_extra_state_fn: the caller's state is "
            "captured, but a restart cannot give it back. Pass both.",
            stacklevel=2,
        )
    elif load_extra_state_fn is not None and extra_state_fn is None:
        warnings.warn(
            "enable_resiliency: load_extra_state_fn without extra_state_fn: no caller's state is "
            "captured, so a restart has none to give it. Pass both.",
            stacklevel=2,
        )
    mode = RecoveryMode.parse(recovery_mode)
    _check_device(device, model)
    other = open_session()
    if other is not None:
        raise RuntimeError(
            f"enable_resiliency: this process already has an open session (rank {other.rank}, "
            f"model {type(other._adapter.model).__name__}); one per process: two would keep their "
            "in-memory checkpoints in the same slots and announce the same rank to its peers. "
            "Close the other first, or give one session a module holding every model (an "
            "nn.ModuleDict) and every optimizer, as a list (optimizer=[first, second])"
        )
    fw = detect_framework(model) if framework == "auto" else framework
    given = {"optimizer": optimizer, "opt_param_scheduler": opt_param_scheduler}
    bad = [k for k in _FORBIDDEN_OPTIONS[fw] if given.get(k) is not None]
    if bad:
        raise TypeError(f"framework {fw!r} cannot take {', '.join(bad)}: the {fw} object owns them")
    if fw not in ("pytorch", "megatron", "deepspeed"):
        raise UnsupportedFrameworkError(
            f"framework {fw!r} was recognised but this version has no {fw} adapter yet; "
            "wrap the underlying torch modules and optimizer with framework='pytorch'"
        )
    from lm_resiliency.adapters.pytorch import PyTorchAdapter

    step_ends: list[Any] = []
    if fw == "deepspeed":  # the engine's module, optimizer, scheduler, group and counters
        from lm_resiliency.adapters.deepspeed import engine_parts, with_progress

        parts = engine_parts(model)
        model, optimizer, opt_param_scheduler = parts.module, parts.optimizer, parts.scheduler
        group = group if group is not None else parts.group
        extra_state_fn, load_extra_state_fn = with_progress(parts.engine, extra_state_fn, load_extra_state_fn)
        step_ends.append(parts.engine)  # (a capture waits for engine.step() to return)
    elif fw == "megatron":  # model chunks: one module whose hooks fan out to every chunk
        from lm_resiliency.adapters.megatron import model_chunks, refuse_megatron_optimizer

        model = model_chunks(model)
        for member in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
            refuse_megatron_optimizer(member)
    elif isinstance(model, (list, tuple)):
        raise TypeError(
            "framework 'pytorch' takes one nn.Module; a list of model chunks is framework 'megatron' "
            "(or 'auto')"
        )
    from lm_resiliency.adapters.chain import OptimizerChain, SchedulerChain

    if isinstance(optimizer, (list, tuple)):  # Muon and AdamW, a GAN's two: held as one
        optimizer = OptimizerChain(optimizer) if len(optimizer) != 1 else optimizer[0]
    if isinstance(opt_param_scheduler, (list, tuple)) and not isinstance(optimizer, OptimizerChain):
        few = list(opt_param_scheduler)  # for one optimizer: one, none, or several as one
        opt_param_scheduler = (few[0] if few else None) if len(few) <= 1 else SchedulerChain(few)
    if optimizer is not None and not hasattr(optimizer, "register_step_post_hook"):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer is None:
        warnings.warn(
            "enable_resiliency: no optimizer given; a step is an optimizer.step(), so this session "
            "sees none: no captures, no per-step checks (liveness only). Pass the optimizer.",
            stacklevel=2,
        )
    grad_scaler = None
    data_iterators: list[weakref.ref[Any]] = []
    data_loaders: list[weakref.ref[Any]] = []
    if optimizer is not None:
        _warn_of_parameters_outside(model, optimizer)
        from torch.optim import Optimizer
        from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

        # One scan of the collector's objects for all (a large program's heap takes a while).
        engine_cls = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
        engines = (engine_cls,) if isinstance(engine_cls, type) and fw != "deepspeed" else ()
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        live = live_instances(
            Optimizer, LRScheduler, ReduceLROnPlateau, _BaseDataLoaderIter, DataLoader, *engines
        )
        # DataLoader iterators the loop made before this call (`it = iter(loader)` then `next(it)`
        # in the loop; a zero-import script's, whose session opens at its first forward): GEMINI
        # sees their fetches too (iterators made later it sees being made), and a restore matches
        # them to the capture's (IteratorWatch.observe).
        data_iterators = [weakref.ref(o) for o in live if isinstance(o, _BaseDataLoaderIter)]
        data_loaders = [weakref.ref(o) for o in live if isinstance(o, DataLoader)]
        live = [o for o in live if not isinstance(o, (_BaseDataLoaderIter, DataLoader))]
        _refuse_an_engines_module(model, live)
        _warn_of_other_optimizers(model, optimizer, live)
        opt_param_scheduler = _schedulers_for(optimizer, opt_param_scheduler, live)
        grad_scaler = _grad_scaler()
    adapter = PyTorchAdapter(model, optimizer, group=group, parallelism_info=parallelism_info)
    if fw == "deepspeed":  # its gradients before its own all-reduce, for SCOUT's replay
        from lm_resiliency.adapters.deepspeed import tap_contributions

        tap_contributions(parts.engine, adapter)
    session = Session(
        adapter=adapter,
        framework=fw,
        interval=interval,
        env=read_environment(),
        runtime_config=runtime or RuntimeConfig(),
        store=store,
        fault_callback=fault_callback,
        orchestration=orchestration,
        recovery_mode=mode,
        settings={
            "enable_checkpoint": enable_checkpoint,
            "enable_detection": enable_detection,
            "checkpoint": checkpoint or InMemoryCkptConfig(),
            "replay": replay or ReplayHarnessConfig(),
            "durable_checkpoint": durable_checkpoint,
            "device": device,
            "extra_state_fn": extra_state_fn,
            "load_extra_state_fn": load_extra_state_fn,
            "load_fallback": load_fallback,
            "opt_param_scheduler": opt_param_scheduler,
            "step_ends": step_ends,
            "data_iterators": data_iterators,
            "data_loaders": data_loaders,
            "grad_scaler": grad_scaler,
            "health_source": health_source,
        },
    )
    try:
        session._start()
    except BaseException:
        session.close()
        raise
    _OPEN.add(session)
    _STARTED[0] += 1
    # Marks the model for zero-import instrumentation (worker_boot): a script that enabled its own
    # session is not instrumented a second time.
    with contextlib.suppress(Exception):
        object.__setattr__(model, "_lm_resiliency_session", weakref.ref(session))
    return session


class Session:
    """The handle returned by `enable_resiliency`. Use `close()` or a `with` block to stop it."""

    def __init__(
        self,
        *,
        adapter: Any,
        framework: str,
        interval: int,
        env: Environment,
        runtime_config: RuntimeConfig,
        store: Any,
        fault_callback: Callable[[dict[str, Any]], None] | None,
        orchestration: OrchestrationHooks | None,
        recovery_mode: RecoveryMode | None,
        settings: dict[str, Any],
    ) -> None:
        self.framework = framework
        self.interval = interval
        self.env = env
        self.settings = settings
        self._adapter = adapter
        self._runtime_config = runtime_config
        self._store = store
        self._fault_callback = fault_callback
        self._orchestration = orchestration
        self._recovery_mode = recovery_mode
        self._runtime: RankRuntime | None = None
        self._topology: Topology | None = None
        self._components: list[SessionComponent] = []
        self._step_offset = 0
        self._steps = 0
        self._recovered_step = -1
        self._last_decision: RecoveryDecision | None = None
        # Recent framework checkpoint I/O (kind, name, seconds): bounded, for checkpoint-stall checks.
        self._io: collections.deque[tuple[str, str, float]] = collections.deque(maxlen=64)
        # The thread the loop runs on (it calls enable_resiliency): a loader's fetch or checkpoint
        # I/O on another thread of the script's (a prefetcher, an asynchronous save) is not where
        # the training thread is.
        self._training_thread = threading.get_ident()
        self._reports: list[dict[str, Any]] = []
        self._reports_lock = threading.Lock()
        self._callbacks = _CallbackThread()
        self._control: Any = None  # ControlChannel under the torchrun backend
        # Kinds the job trains on through that the run's policy replaces a node for or restarts on
        # (`[recovery]`): posted to its leader too.
        self._also_on: frozenset[str] = frozenset(DEFAULT_RESTART_IN_PLACE_ON)
        self._context: dict[str, Any] | None = None  # the backend's restart context, when restarted
        self._closed = False
        self._detection_paused = False
        self._uneven_from: int | None = None  # the first step inside DDP's Join (see _on_step)
        self._previous_excepthook: Any = None
        self._previous_sigterm: Any = None  # (our handler, the one before it)
        self._sigterm_watch: SigtermWatch | None = None  # a SIGTERM the main thread cannot take
        self._stopping = False  # SIGTERM received, and the process ends after our handler
        # SIGTERM received (a handler of the script's own may go on); an event: it ends _settle's hold.
        self._sigterm_seen = threading.Event()
        self._last_posted = float("-inf")  # monotonic time of the last report posted to the leader
        self._payload_reported: dict[int, float] = {}  # sender -> when its damaged chunk was reported
        self._components_closed = False  # close() got past GEMINI and SCOUT (see _terminating)
        self._close_reason = CLOSED  # what close() tells the peers
        self._terminated: dict[int, tuple[float, str]] = {}  # peers that said SIGTERM ended them
        self._last_fatal_report = float("-inf")  # monotonic time of the last restart-worthy report
        self._silent_nodes: set[str] = set()  # nodes reported silent as a whole (once per node)
        self._scaler_watch: Any = None  # adapters.amp.ScalerWatch of the job's GradScaler
        self._first_forward: Any = None  # the hook of _look_for_late_state
        # Each instrumented loader's current iterator: the global torch RNG state it was made at
        # (`iter(DataLoader)` draws from it), captured with a step taken as a batch is fetched.
        self._loader_positions: dict[str, Any] = {}
        replay_cfg = settings.get("replay")
        report_dir = getattr(replay_cfg, "report_dir", None) or self.env.report_dir
        self._report_dir = Path(report_dir) if report_dir else None
        # The report file, opened at the start and kept: a rank that dies of running out of file
        # descriptors could not open it for the report that says so. (file, path, (device, inode))
        self._report_file: tuple[Any, Path, tuple[int, int]] | None = None
        self.rank = 0
        self.world_size = 1

    # -- startup ----------------------------------------------------------------------------------
    def _start(self) -> None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        if self._report_dir is not None:
            with contextlib.suppress(OSError):  # (the first report tries again, and logs why not)
                self._open_report_file()
        local: AdapterTopology = self._adapter.topology()
        node_id = self.env.node_id()
        store = self._store
        if store is None and distributed and self.world_size > 1:
            store = dist.distributed_c10d._get_default_store()
        if store is not None:
            discovery = StoreDiscovery(
                store, self.env.run_id, self._round(distributed), self.rank, self.world_size
            )
            key, incarnation = discovery.shared_secret(), discovery.next_incarnation()
        elif self.world_size == 1:
            discovery, key, incarnation = None, os.urandom(32), 1
        else:
            raise ValueError(
                "a multi-rank job needs a store: initialise the default process group or pass store="
            )
        host = _bind_host(self._runtime_config, self.env)
        cfg = self._runtime_config
        self._runtime = RankRuntime(
            rank=self.rank,
            world_size=self.world_size,
            node_id=node_id,
            key=key,
            incarnation=incarnation,
            config=cfg,
            transport_factory=lambda: ZmqTransport(host, cfg.use_ipc, cfg.send_high_water_mark),
            replica_group=local.replica_group,
            peer_group=local.peer_group,
            dims=local.dims,
            settings=self._shared_settings(),
        )
        self._runtime.add_membership_listener(self._on_membership)
        self._runtime.add_corruption_listener(self._on_payload_corruption)
        ann = self._runtime.start()
        if discovery is not None:
            discovery.publish(ann)
            anns = discovery.wait_all(cfg.discovery_timeout_s)
            self._check_settings(anns)
            self._runtime.connect_peers(anns.values(), announce=True)
            self._topology = _assemble_topology(anns, self.world_size, self.rank)
        else:
            self._topology = Topology.build([node_id], [local.replica_group], peer_groups=[local.peer_group])
        self._check_restart_context()
        self._start_gemini(discovery, node_id)
        self._start_scout()
        self._connect_backend()
        self._report_unwatched_exits()
        self._open_trail(local.replica_group)
        self._adapter.attach(self._on_step)
        if self.env.fault_campaign:
            self._attach_campaign(self.env.fault_campaign, self.env.fault_ground_truth)
        scaler = self.settings.get("grad_scaler")
        if scaler is not None and self._adapter.optimizer is not None:
            self._watch_scaler(scaler)
        if self._adapter.optimizer is not None:
            self._first_forward = self._adapter.model.register_forward_pre_hook(
                self._look_for_late_state, prepend=True
            )
        if self.env.checkpoint_step > 0 and self._recovered_step != self.env.checkpoint_step:
            # A script that reads its data position from the variable after this call reads the
            # step restored; one that read it before resumes its data at the planned step.
            log.error(
                "restart context asks for step %d but step %d was restored: the session's step_count "
                "(and LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP from now on) say %d",
                self.env.checkpoint_step,
                self._recovered_step,
                max(self._recovered_step, 0),
            )
            os.environ["LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"] = str(max(self._recovered_step, 0))
        atexit.register(self.close)
        self._install_excepthook()
        self._install_sigterm()
        log.info(
            "lm-resiliency enabled on rank %d/%d (node %s, generation %d, replica group %s)",
            self.rank,
            self.world_size,
            node_id,
            self.env.generation,
            list(local.replica_group),
        )

    def _open_trail(self, group: Sequence[int]) -> None:
        """Under the torchrun backend, the collectives this rank enters are also written where its
        agent reads them after the worker stopped (runtime/trail.py): the leader names the rank that
        entered another collective when the mismatch killed the processes before SCOUT could. Part of
        detection: not written while it is off."""
        folder = self.env.trail_dir
        if not folder or self.world_size < 2 or not self._detects() or not hasattr(self._adapter, "trail"):
            return
        from lm_resiliency.gemini.hygiene import write_owner

        try:
            self._adapter.trail = CollectiveTrail(folder, self.rank, self.env.generation, group)
            # Owned by this process while it lives: another job short of shared memory reclaims
            # folders no live process owns (an mmap's writes need not touch the file's mtime).
            write_owner(Path(folder), self.rank)
        except (OSError, ValueError) as exc:  # the desync check loses this rank's trail, nothing else
            log.warning("rank %d: no collective trail in %s: %s", self.rank, folder, exc)

    def _attach_campaign(self, path: str, ground_truth: str | None) -> None:
        """Inject this rank's faults of the campaign `LM_RESILIENCY_FAULT_CAMPAIGN` names; the
        ground truth goes to `LM_RESILIENCY_FAULT_GROUND_TRUTH` (default: `ground-truth/<campaign>`
        next to the campaign file)."""
        from lm_resiliency.faults.campaign import load_campaign
        from lm_resiliency.faults.inject import attach_campaign

        campaign = load_campaign(path)
        folder = ground_truth or str(Path(path).resolve().parent / "ground-truth" / campaign.name)
        attach_campaign(self, campaign, folder)
        log.warning(
            "lm-resiliency: fault campaign %r armed on rank %d (ground truth in %s)",
            campaign.name,
            self.rank,
            folder,
        )

    def _watch_scaler(self, scaler: Any) -> None:
        from lm_resiliency.adapters.amp import ScalerWatch

        gem = self.gemini
        on_update = gem.on_scaler_update if gem is not None else None
        self._scaler_watch = ScalerWatch(scaler, self._adapter.optimizer, on_update)

    def _look_for_late_state(self, module: Any, args: Any) -> None:
        """The first forward: what the script made after enable_resiliency but before its loop. A
        loss scaler is adopted (it has not scaled anything yet: it gets this restart's restored
        state, its skipped steps count); a scheduler, whose state could not be restored (recovery
        happened inside enable_resiliency), is named in the log. Once per session."""
        self._first_forward.remove()
        if self.gemini is not None:  # iterators made from now on are no restored ones made again
            self.gemini.iterators.first_step()
        try:
            self._adopt_late_state()
        except Exception:  # a look for late objects must never fail the script's forward
            log.exception("rank %d: looking for a scaler or scheduler made late failed", self.rank)

    def _adopt_late_state(self) -> None:
        gem = self.gemini
        if self._scaler_watch is None:
            scaler = _grad_scaler()
            if scaler is not None:
                self._watch_scaler(scaler)
                if gem is not None:
                    gem.adopt_scaler(scaler)
        if gem is not None and gem.scheduler is None:
            from lm_resiliency.adapters.chain import members_of
            from lm_resiliency.adapters.pytorch import find_scheduler

            late = [s for m in members_of(self._adapter.optimizer) for s in find_scheduler(m)[1]]
            if late:
                log.warning(
                    "rank %d: %s steps the optimizer but was made after enable_resiliency: its state "
                    "is not captured, so a restart resets the learning rate. Make it before, or pass "
                    "it as opt_param_scheduler",
                    self.rank,
                    ", ".join(type(o).__name__ for o in late),
                )

    # Per rank by nature (paths of its own, callables): not compared across ranks.
    _LOCAL_SETTINGS = frozenset({"checkpoint.disk_folder", "replay.report_dir", "runtime.bind_host"})

    def _shared_settings(self) -> dict[str, str]:
        """The settings every rank of the job must share, flattened to strings for the announcement."""
        out = {
            "framework": self.framework,
            "interval": repr(self.interval),
            "enable_checkpoint": repr(bool(self.settings["enable_checkpoint"])),
            "enable_detection": repr(bool(self.settings["enable_detection"])),
            "recovery_mode": repr(self._recovery_mode.value if self._recovery_mode else None),
            # Torch's process-wide numerics (TF32, determinism, ...): a node started with another
            # environment computes otherwise; SCOUT's gossip names one that changes them later.
            "torch.numerics": ",".join(
                f"{k}={v}" for k, v in zip(NUMERICS_KEYS, numerics_settings().split(","), strict=True)
            ),
        }
        for prefix, cfg in (
            ("checkpoint", self.settings["checkpoint"]),
            ("replay", self.settings["replay"]),
            ("runtime", self._runtime_config),
        ):
            for f in dataclasses.fields(cfg):
                key = f"{prefix}.{f.name}"
                if key not in self._LOCAL_SETTINGS:
                    out[key] = repr(getattr(cfg, f.name))
        return out

    def _check_settings(self, anns: dict[int, Any]) -> None:
        """Config drift: ranks that started with other settings than the job's majority are named
        (a `config_drift` report) and every rank refuses to start, with the same error."""
        diffs = []
        odd: set[int] = set()
        for key in sorted({k for a in anns.values() for k in a.settings}):
            by_value: dict[str, list[int]] = {}
            for r, a in sorted(anns.items()):
                by_value.setdefault(a.settings.get(key, "<unset>"), []).append(r)
            if len(by_value) < 2:
                continue
            common = max(by_value.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))[0]
            parts = [f"ranks {ranks} have {value}" for value, ranks in by_value.items()]
            diffs.append(f"{key}: " + ", ".join(parts))
            odd |= {r for value, ranks in by_value.items() if value != common for r in ranks}
        if not diffs:
            return
        nodes = sorted({anns[r].node_id for r in odd})
        whole_node = len(nodes) == 1 and odd == {r for r, a in anns.items() if a.node_id == nodes[0]}
        report = SCOUTFaultReport(
            kind="config_drift",
            failed_ranks=tuple(sorted(odd)),
            scope="node" if whole_node else "rank",
            sources=("announcement",),
            reason="settings_mismatch",
            node=nodes[0] if len(nodes) == 1 else None,
            confidence=1.0,
        ).to_dict()
        report["detail"] = "; ".join(diffs)
        self._emit_fault(report)
        raise ConfigError(
            "settings",
            f"ranks started with different lm-resiliency settings (every rank must pass the same): "
            f"{'; '.join(diffs)}",
        )

    def _round(self, distributed: bool) -> int | str:
        """A name for this start of the job that every rank agrees on (the store keys' scope).

        Our backend exports one generation to every worker and a fresh store per generation. Under
        other launchers TORCHELASTIC_RESTART_COUNT differs between agents (membership restarts are
        free) and c10d may reuse the store across rounds: agree over the process group instead --
        the highest restart count (a restart is a restart for everyone) and rank 0's nonce."""
        if self.env.control_store or not distributed or self.world_size == 1:
            return self.env.generation
        import torch.distributed as dist

        mine = [self.env.generation, os.urandom(8).hex()]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        generation = max(int(g) for g, _ in everyone)
        if generation != self.env.generation:
            self.env = dataclasses.replace(self.env, generation=generation)
        return f"{generation}-{everyone[0][1]}"

    def _check_restart_context(self) -> None:
        """The backend's restart context must describe this job: same topology, same world."""
        path = self.env.restart_context_path
        if not path:
            return
        try:
            ctx = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT", f"cannot read {path}: {exc}") from exc
        if not isinstance(ctx, dict) or ctx.get("schema_version") != 1:
            raise ConfigError("restart context", f"{path}: not a schema_version 1 restart context")
        assert self._topology is not None
        # The shape (ranks per node, replica groups, parallel dims), not the machines: a standby that
        # replaced a node has another machine id but must fit the same layout.
        want = ctx.get("topology_digest") or ""
        if want and want != self._topology.shape_digest():
            raise ConfigError(
                "restart context",
                f"{path} was planned for topology {want} but this job has {self._topology.shape_digest()}: "
                "the job's parallel layout changed between generations",
            )
        expected = ctx.get("expected_world_size")
        if isinstance(expected, int) and expected != self.world_size:
            raise ConfigError(
                "restart context", f"{path} expects world size {expected}, the job has {self.world_size}"
            )
        self._context = ctx

    def _report_unwatched_exits(self) -> None:
        """Rank 0 of a restart reports each rank of the generation before whose process ended
        failing unseen (the restart context's `worker_exits`: `unwatched_exit`): it ended after the
        others closed their sessions (a kill in the last step, an exception in the script's own
        saving after its loop), or while another fault explained the group's stop, so no peer named
        it, and a killed rank cannot. Its agent saw the exit (`adapters/torchrun._publish_exit`).
        Before, no fault report named it."""
        if self.rank != 0:
            return
        for rank, _node, details in _unwatched_exits(self._context, self.env.generation):
            self._process_failure((rank,), EXITED_UNWATCHED, "agent", **details)

    def _connect_backend(self) -> None:
        """Under the torchrun backend: feed the leader inventories and actionable verdicts."""
        if not self.env.control_store:
            return
        from lm_resiliency.runtime.control import ControlChannel

        channel = ControlChannel(self.env.control_store, self.env.control_run_id())
        self._control = channel
        channel.beat(self.rank)  # peers that find this rank silent on our transport ask the store
        if self.scout is not None:
            self.scout.alive_counts = channel.alive
        if self.env.worker_config_path:  # the policy every node runs (the agents compared digests)
            try:
                recovery = load_policy(self.env.worker_config_path).recovery
            except (OSError, ConfigError) as exc:  # the agent read it at startup: it changed since
                log.warning(
                    "rank %d: worker policy unreadable, slow-job and damage reports only reported: %s",
                    self.rank,
                    exc,
                )
                self._also_on = frozenset()
            else:
                self._also_on = frozenset((*recovery.replace_node_on, *recovery.restart_in_place_on)) & {
                    *REPLACE_ONLY_FAILURES,
                    *DAMAGE_FAILURES,
                }
        gem = self.gemini
        if gem is None:
            return
        digest = self.topology.shape_digest()
        group = list(self.topology.replica_group_of(self.rank))

        def publish(inv: Any) -> None:
            cert = gem.certifier
            doc = {
                "local": list(inv.local),
                "replicas": {o: list(s) for o, s in inv.replicas.items()},
                "disk": list(inv.disk),
                "disk_store": gem.durable.store_id(),  # the same on every node: shared storage
                # (durable copies too: see Gemini.inventory)
                "certified": [s for s in sorted({*inv.local, *inv.disk}) if cert is not None and cert(s)],
                "scout": cert is not None,
                "group": group,  # whose certificates these are (verified_steps)
                "topology": digest,
                "generation": self.env.generation,
            }
            channel.publish_inventory(self.rank, doc)

        gem.on_inventory = publish
        gem.flush_inventory = channel.flush
        publish(gem.inventory())

    def _start_gemini(self, discovery: StoreDiscovery | None, node_id: str) -> None:
        ckpt: InMemoryCkptConfig = self.settings["checkpoint"]
        if not (self.settings["enable_checkpoint"] and ckpt.enable):
            return
        from lm_resiliency.gemini.component import Gemini

        assert self._runtime is not None and self._topology is not None
        run_id = ckpt.run_id or self.env.run_id
        durable: DurableCheckpointConfig | None = self.settings["durable_checkpoint"]
        gem = Gemini(
            rank=self.rank,
            world_size=self.world_size,
            node_id=node_id,
            run_id=run_id,
            topology=self._topology,
            runtime=self._runtime,
            model=self._adapter.model,
            optimizer=self._adapter.optimizer,
            scheduler=self.settings["opt_param_scheduler"],
            scaler=self.settings.get("grad_scaler"),
            extra_state_fn=self.settings["extra_state_fn"],
            load_extra_state_fn=self.settings["load_extra_state_fn"],
            config=ckpt,
            interval=self.interval,
            shm_dir=self.env.shm_dir,
            on_fault=self._emit_fault,
            load_fallback=self.settings["load_fallback"],
            disk_folder=durable.folder if durable else None,
            disk_interval=durable.interval if durable else None,
            keep_last=durable.keep_last if durable else 2,
            step_ends=self.settings.get("step_ends", ()),
        )
        self._components.append(gem)
        gem.loaders_fn = self._loader_snapshot
        gem.iterators.observe(
            (r() for r in self.settings.get("data_iterators", ())),
            [dl for dl in (r() for r in self.settings.get("data_loaders", ())) if dl is not None],
        )
        gem.claim()
        # Resume only when this is a restart (or the caller named the run): a fresh job that happens
        # to share a default run id must not silently load another job's state.
        restart = (
            self.env.generation > 0
            or self.env.checkpoint_step > 0
            or ckpt.run_id is not None
            or self.env.explicit_run_id
        )
        if not restart:
            gem.reclaim()
            gem.set_aside_earlier()
            gem.prepare()
            return
        if self.env.generation == 0 and self.env.checkpoint_step <= 0:
            gem.durable.forget_earlier()  # a launch that names its run continues all of it
        exchange = discovery.exchange if discovery is not None else (lambda name, value, timeout: {0: value})
        exact = self.env.checkpoint_step if self.env.checkpoint_step > 0 else None
        # Recovery-verified state (and no step named by an orchestrator): only a capture SCOUT
        # certified is restored. Asked for here, or else as the previous generation noted (an SDC
        # it found, or what its prepare_recovery decided). Without detection nothing is ever
        # certified: the latest step.
        asked = self._recovery_mode
        verified: bool | None = None if asked is None else asked is RecoveryMode.RECOVERY_VERIFIED
        ctx = self._context or {}
        if exact is not None and ctx.get("recovery_mode") == "recovery_verified":
            verified = True  # the plan chose the step among certified ones (and so would a retry)
        if not self._detects():
            if verified and exact is None:
                log.warning(
                    "rank %d: recovery_mode='recovery_verified' needs SCOUT's certificates, and "
                    "detection is off: restoring the latest step",
                    self.rank,
                )
            verified = False
        step, reason = gem.recover(
            exchange, exact, timeout=self._runtime_config.discovery_timeout_s, verified_only=verified
        )
        if step >= 0:
            self._step_offset = step
            self._recovered_step = step
            self._adapter.set_step(step)
        # What the restart recovers from: the plan's failure kind (the leader's, under the
        # torchrun backend), else what the previous generation noted (an SDC it found, its
        # prepare_recovery), else unknown (a restart nobody explained); none for a fresh start.
        planned = ctx.get("failure_kind")
        if not (isinstance(planned, str) and planned and planned != "none"):
            planned = gem.noted_kind or ("unknown" if step >= 0 or self.env.generation > 0 else "none")
        # A step the plan named is restored at the plan's trust level (its leader chose it among
        # certified steps, or not), whatever this session asked for; else as asked.
        named = ctx.get("recovery_mode") if 0 <= step == ctx.get("checkpoint_step") else None
        by_plan = RecoveryMode(named) if named in ("latest", "recovery_verified") else None
        self._last_decision = RecoveryDecision(
            failure_kind=planned,
            recovery_mode=RecoveryMode.RECOVERY_VERIFIED
            if gem.restored_verified
            else by_plan or self._recovery_mode or RecoveryMode.LATEST,
            # The tier the restore came from leads the reason: local, peer, disk (GEMINI's durable
            # tier), fallback (the caller's own checkpoint through load_fallback).
            checkpoint_source="none"
            if step < 0
            else "durable"
            if reason.startswith(("disk:", "fallback:"))
            else "gemini",
            checkpoint_step=step,
            checkpoint_id=None
            if step < 0 or reason.startswith("fallback:")
            else str(gem.durable.path(step))
            if reason.startswith("disk:")
            else memory_checkpoint_id(step),
            topology_digest=self._topology.shape_digest(),
            available=step >= 0,
            reason=reason,
        )
        hook = self._orchestration.report_recovery if self._orchestration is not None else None
        if hook is not None:
            try:
                hook(self._last_decision.to_dict())
            except Exception:  # the orchestrator's bug must not fail the restart; logged with its trace
                log.exception("report_recovery hook raised")
        gem.prepare()

    def _start_scout(self) -> None:
        replay: ReplayHarnessConfig = self.settings["replay"]
        if not self._detects():
            return
        timeout = _collective_timeout_s()
        if timeout is not None and replay.hang_stall_threshold_s > timeout / 2:
            # A hang is named within about twice the threshold: it must come before torch's own
            # collective timeout turns the hang into a crash that names nobody.
            log.warning(
                "rank %d: hang_stall_threshold_s %.1f s would not name a hang before the process "
                "group's collective timeout (%.1f s); using %.1f s",
                self.rank,
                replay.hang_stall_threshold_s,
                timeout,
                timeout / 2,
            )
            replay = dataclasses.replace(replay, hang_stall_threshold_s=timeout / 2)
        from lm_resiliency.scout.component import Scout

        assert self._runtime is not None and self._topology is not None
        from lm_resiliency.scout.health import default_health_source

        health = self.settings["health_source"]
        if health is None:
            health = default_health_source()
        elif health is False:
            health = None
        scout = Scout(
            health=health,
            step_source=lambda: self.step_count,
            paused=lambda: self._detection_paused or self._uneven_from is not None,
            rank=self.rank,
            topology=self._topology,
            runtime=self._runtime,
            adapter=self._adapter,
            config=replay,
            interval=self.interval,
            emit=self._emit_fault,
            heartbeat_s=self._runtime_config.heartbeat_interval_s,
            heartbeat_timeout_s=self._runtime_config.heartbeat_timeout_s,
        )
        self._components.append(scout)
        gem = self.gemini
        if gem is not None:
            gem.certifier, gem.awaiting = scout.certified, scout.awaiting_certificate
            gem.certifying = scout.certifying
            scout.on_certified, scout.on_revoked = gem.certify, gem.revoke
            # A capture taken when the next step begins: the parameters SCOUT certifies are
            # fingerprinted then too, not before the loop's code after the step could change them.
            scout.defer_evidence, gem.before_capture = gem.will_defer, scout.take_deferred_evidence
            # Certificates survive restarts: the marks on this node's own captures, and the restored
            # step itself when the plan that chose it picked recovery-verified steps only.
            restored = self._recovered_step
            carried = {s for s in gem.carried_certificates if 0 <= s <= restored}
            by_plan = (self._context or {}).get("recovery_mode") == "recovery_verified"
            if restored >= 0 and (by_plan or gem.restored_verified):
                carried.add(restored)
            scout.seed(carried)

    def _detects(self) -> bool:
        return bool(self.settings["enable_detection"] and self.settings["replay"].enable)

    @property
    def scout(self) -> Any:
        """The SCOUT component, or None when detection is off."""
        return next((c for c in self._components if getattr(c, "name", "") == "scout"), None)

    @property
    def gemini(self) -> Any:
        """The GEMINI component, or None when checkpointing is off."""
        return next((c for c in self._components if getattr(c, "name", "") == "gemini"), None)

    # -- the training-thread path -----------------------------------------------------------------
    def pause_detection(self, paused: bool = True) -> None:
        """Stop (or resume) per-step telemetry and SCOUT evidence; GEMINI and heartbeats go on.

        For side-by-side overhead measurements and maintenance windows."""
        self._detection_paused = paused

    def _uneven_at(self, step: int) -> None:
        """A step inside DDP's `Join` (uneven inputs): the ranks that run out of batches shadow the
        others' all-reduces without optimizer steps, so from here the ranks' step counts and states
        differ by the script's design. SCOUT's comparisons of the replicas' steps (fingerprints,
        collectives entered, step times) would name healthy ranks: they stop for good, the same on
        every rank (every rank enters the Join). Before, a 3-rank job with 10, 13 and 16 batches an
        epoch had healthy ranks named `stale_state` twice in its second epoch."""
        self._uneven_from = step
        (log.warning if self.rank == 0 else log.info)(
            "rank %d: step %d runs inside DDP's Join (uneven inputs): ranks take different numbers of "
            "optimizer steps from here, so SCOUT compares no step evidence across ranks any more "
            "(fingerprints, collectives, step times) and certifies no step; process failures and "
            "hangs are still caught. GEMINI's copies are per step count: with inputs that are uneven "
            "indeed, a restore takes each rank's copy of one step count, which is not one point of "
            "the training for every rank",
            self.rank,
            step,
        )

    def _on_step(self, times: StepTimes) -> None:
        self._steps += 1
        step = self._step_offset + self._steps
        rt = self._runtime
        if self._uneven_from is None and getattr(self._adapter, "uneven_inputs", bool)():
            self._uneven_at(step)
        if self._detection_paused or self._uneven_from is not None:
            for c in self._components:
                if getattr(c, "name", "") != "scout":
                    c.on_step(self, times)
            return
        detection = [c for c in self._components if getattr(c, "name", "") == "scout"]
        live = rt is not None and not self._closed
        # The step's telemetry and SCOUT's evidence leave as one batch (one receive per peer),
        # before a capture's copy, not after it.
        with rt.hold() if rt is not None and live else contextlib.nullcontext():
            if rt is not None and live:
                rt.set_progress(step)
                rt.submit(
                    StepTelemetry(
                        rank=self.rank,
                        step=step,
                        step_s=times.step_s,
                        input_s=times.input_s,
                        compute_s=times.compute_s,
                        comm_s=times.comm_s,
                        optimizer_s=times.optimizer_s,
                        extra={k: v for c in detection for k, v in getattr(c, "step_extra", dict)().items()},
                    )
                )
            for c in detection:
                c.on_step(self, times)
        for c in self._components:
            if c not in detection:
                c.on_step(self, times)

    def _on_membership(self, ev: MembershipEvent) -> None:
        topo = self._topology
        node = topo.node_of(ev.peer) if topo is not None else None
        if ev.kind is EventKind.DIED:
            if self._stopping:  # this rank is being stopped too (SIGTERM): the group stops, nobody's fault
                return
            if ev.reason.startswith("process_exited"):  # seen ending by us, on its host
                detail = ev.reason.partition(": ")[2]
                self._process_failure(
                    (ev.peer,), "process_exited", "pid", detection_latency_s=ev.silent_s, detail=detail
                )
            else:
                self._process_failure(
                    (ev.peer,), "heartbeat_timeout", "heartbeat", detection_latency_s=ev.silent_s
                )
            self._node_silent(node)
            return
        if ev.kind in (EventKind.JOINED, EventKind.REJOINED) and node is not None:
            self._silent_nodes.discard(node)  # back: its next silence is news again
        # A peer whose worker died of an uncaught exception says so in its goodbye (`_exiting`).
        reason, _, error = ev.reason.partition(": ")
        if ev.kind is EventKind.LEFT and reason in EXIT_FAILURES:
            self._process_failure((ev.peer,), reason, "goodbye", error=error)
        elif ev.kind is EventKind.LEFT and reason == "terminated":
            with self._reports_lock:
                self._terminated[ev.peer] = (time.monotonic(), error)
                first = len(self._terminated) == 1
            if first:  # one timer for all that go meanwhile (a job stopped whole: thousands)
                timer = threading.Timer(TERMINATION_REPORT_DELAY_S, self._report_terminated)
                timer.daemon = True
                timer.start()

    def _on_payload_corruption(self, sender: int, detail: str) -> None:
        """A chunk from `sender` failed its checksum in flight (it is asked for again): one report
        per sender per 10 s, naming the sending rank and the endpoint (a link or a NIC flipping bits)."""
        now = time.monotonic()
        with self._reports_lock:
            if now - self._payload_reported.get(sender, -1e9) < 10.0:
                return
            self._payload_reported[sender] = now
        topo = self._topology
        report = SCOUTFaultReport(
            kind="payload_corruption",
            failed_ranks=(sender,),
            scope="rank",
            sources=("transport",),
            endpoint_kind="bulk",
            endpoint_rank=sender,
            endpoint_id=topo.node_of(sender) if topo is not None else None,
            reason="payload_checksum_mismatch",
            confidence=0.5,
            node=topo.node_of(sender) if topo is not None else None,
        ).to_dict()
        report["detail"] = detail[:MAX_ERROR_TEXT]
        self._emit_fault(report)

    def _report_terminated(self) -> None:
        """Report the peers that said they were terminated (each once) unless that explains itself:
        this rank is being stopped too, or closed, or a fault it reported shortly before is why the
        group stops."""
        now = time.monotonic()
        with self._reports_lock:
            due, self._terminated = sorted(self._terminated.items()), {}
            quiet = (
                not self._sigterm_seen.is_set() and now - self._last_fatal_report > TERMINATION_EXPLAINED_S
            )
        if quiet and due:
            stopped = self._stopped_by_restart([p for p, _ in due])
            if stopped:
                log.info("rank %d: ranks %s were stopped by the run's restart", self.rank, sorted(stopped))
            due = [(p, v) for p, v in due if p not in stopped]
        for peer, (at, signal_name) in due:
            if quiet and not self._closed:
                self._process_failure(
                    (peer,),
                    "terminated",
                    "goodbye",
                    detection_latency_s=now - at,
                    detail=f"rank {peer} said it was terminated ({signal_name or 'a signal'})",
                )

    def _stopped_by_restart(self, peers: list[int]) -> set[int]:
        """Under the torchrun backend, of `peers` that went: those the leader's restart stopped (it
        stops every worker group, for a fault another replica group reported that this rank never
        heard of, or a worker's exit), not the nodes whose workers' going it restarts for (see
        `ControlChannel.restart_culprits`) but their ranks their agents stopped after the first
        one ended (`ControlChannel.first_exits`). Blocks on the store; never called on the loop."""
        control, topo = self._control, self._topology
        if control is None or topo is None:
            return set()
        culprits = control.restart_culprits(self.env.generation)
        if culprits is None:
            return set()
        first = control.first_exits(self.env.generation, culprits) if culprits else {}
        return stopped_by_restart(peers, topo.node_of, culprits, first)

    def _report_left(self, error: str) -> None:
        """A collective failed under this rank mid-step: the peers whose scripts had closed their
        sessions (a loop that ended early; gloo fails the collective at once where NCCL would wait,
        see hang_verdict's `left`) are why."""
        rt = self._runtime
        went = {r for r, why in rt.departed().items() if why == CLOSED} if rt else set()
        with self._reports_lock:  # named already while its peers waited (SCOUT's hang verdict)
            for named in self._reports:
                if named.get("reason") == LEFT:
                    went -= set(named.get("failed_ranks", ()))
        went -= self._stopped_by_restart(sorted(went)) if went else set()
        if not went:
            return
        report = SCOUTFaultReport(
            kind="hang",
            failed_ranks=tuple(sorted(went)),
            scope="rank",
            sources=("goodbye",),
            steps=(self.step_count + 1,),
            reason=LEFT,
            confidence=1.0,
        ).to_dict()
        report["detail"] = (
            f"ranks {sorted(went)} closed their sessions and left while rank {self.rank} was in step "
            f"{self.step_count + 1}, whose collective then failed: {error}"
        )[:MAX_ERROR_TEXT]
        self._emit_fault(report)

    def _process_failure(
        self,
        ranks: tuple[int, ...],
        reason: str,
        source: str,
        scope: str = "rank",
        detection_latency_s: float | None = None,
        steps: tuple[int, ...] = (),
        **extra: str,
    ) -> dict[str, Any]:
        """Report a process failure of `ranks` (one rank, or a whole node's with scope "node")."""
        topo = self._topology
        report = SCOUTFaultReport(
            kind="process_failure",
            failed_ranks=ranks,
            scope=scope,
            sources=(source,),
            steps=steps,
            reason=reason,
            node=topo.node_of(ranks[0]) if topo is not None and ranks else None,
            confidence=1.0,
            detection_latency_s=detection_latency_s,
        ).to_dict()
        report.update(extra)
        self._emit_fault(report)
        return report

    def _node_silent(self, node: str | None) -> None:
        """Every rank of another node fell silent: one report naming the node (lost, or cut off from
        us: from inside the job the two look the same), besides each rank's own."""
        topo, rt = self._topology, self._runtime
        if node is None or topo is None or rt is None or node == topo.node_of(self.rank):
            return
        ranks = topo.ranks_on(node)
        if node in self._silent_nodes or not set(ranks) <= rt.silent():
            return
        self._silent_nodes.add(node)
        detail = f"every rank of node {node} ({list(ranks)}) stopped sending heartbeats"
        self._process_failure(ranks, "node_silent", "heartbeat", scope="node", detail=detail)

    # -- a worker that dies of an uncaught exception says why ----------------------------------------
    def _install_excepthook(self) -> None:
        """Chain onto `sys.excepthook` (the main thread's uncaught exceptions, `@record` included:
        it re-raises): report our own failure with its error text, then let the previous hook print."""
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            try:
                self._exiting(value)
            except Exception:  # reporting must never hide the user's traceback
                log.exception("reporting the uncaught exception failed")
            previous(tp, value, tb)

        sys.excepthook = hook
        self._previous_excepthook = (hook, previous)

    # -- a worker being stopped (SIGTERM) says so ----------------------------------------------------
    def _install_sigterm(self) -> None:
        """Chain onto SIGTERM (torchrun stopping its worker group, a preemption, a fault campaign):
        first mark this rank as stopping (peers waiting for it in a collective do not call it
        hung), write GEMINI's newest committed capture to disk, and, when the previous handler
        is the default one (the process ends now), tell the peers it was terminated; then the
        previous handler runs. Main thread only (Python's rule for signal handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        ends = previous in (signal.SIG_DFL, None)
        owner = os.getpid()

        def pass_on(signum: int, frame: Any) -> None:
            """What SIGTERM did before us: the previous handler, or the default (the process ends)."""
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        handling = [False]  # this (the main) thread is in the handler below

        def on_sigterm(signum: int, frame: Any) -> None:
            if os.getpid() != owner:
                # A forked child (a DataLoader worker that its loader terminates) inherited the
                # handler, not the session: it ends as it would have without us.
                pass_on(signum, frame)
                return
            if handling[0]:
                # Another SIGTERM while this thread handles one (a preemption signals every
                # process, and torchrun passes it on to its workers' group): the handler under way
                # flushes and then ends the process. Before, this call waited for the signal's
                # claim, which the call under it holds: the worker hung until torchrun's SIGKILL 30
                # s later, nothing flushed to disk (outsider 57, every process of a job SIGTERMed).
                if not ends:
                    pass_on(signum, frame)  # the script's own handler decides, each time
                return
            watch = self._sigterm_watch
            if watch is not None and not watch.claim():
                # This thread came back from native code after the watcher took the signal over:
                # it ends the process once it has done the work.
                threading.Event().wait()
            handling[0] = True
            deferred = _DeferredSignals((signal.SIGCHLD,))
            try:
                self._terminating(ends)
            except Exception:  # stopping must go on whatever we failed to do first
                log.exception("rank %d: handling SIGTERM failed", self.rank)
            finally:
                restore = deferred.restore()
                try:
                    pass_on(signum, frame)
                finally:
                    handling[0] = False
                    restore()

        signal.signal(signal.SIGTERM, on_sigterm)
        self._previous_sigterm = (on_sigterm, previous)
        if ends:  # (a handler of the script's own decides what SIGTERM does: it runs on this thread)
            self._sigterm_watch = SigtermWatch.install(on_sigterm, lambda: self._terminating(True))

    def _terminating(self, ends: bool) -> None:
        # A SIGTERM may come while close() runs (a worker dying of an exception is stopped by
        # torchrun meanwhile): until the components are closed, GEMINI's newest capture may still
        # be committing, and the restart would miss it. Its goodbye keeps the reason it closes for.
        if self._components_closed or self._stopping:
            return
        closing = self._closed
        self._sigterm_seen.set()
        if ends:  # (a handler of the script's own may keep training: then nothing else changes)
            self._stopping = True
            if not closing:
                self._mark_phase("stopping")
        gem = self.gemini
        if gem is not None:
            step = gem.flush_for_restart(timeout=5.0, replicate=False)
            if step >= 0:
                log.warning("rank %d: SIGTERM, newest capture (step %d) flushed to disk", self.rank, step)
            else:
                log.warning("rank %d: SIGTERM, no capture flushed to disk", self.rank)
        if ends:
            if self._runtime is not None:
                reason = self._close_reason if closing else "terminated: SIGTERM"
                self._runtime.close(timeout=0.5, reason=reason)
            # The reports made so far reach the callbacks and the report file before the process
            # ends (the verdict that got the group stopped, often), and the leader's plan.
            self._callbacks.close(timeout=2.0)
            if self._control is not None:
                self._control.flush(timeout=1.0)

    def _exiting(self, exc: BaseException) -> None:
        """This worker is dying of `exc`: one process_failure report naming this rank (unless a collective
        failed under it: a peer's failure, not ours), then a goodbye that tells the peers the reason."""
        if self._closed:
            return
        reason = classify_exit(exc)
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
        if reason == "collective_error" and self._runtime is not None:
            # A peer's failure broke the collective: name it before this rank goes, if it is known
            # yet (its process ended on this host; it said it was terminated).
            # A peer that said goodbye (its loop ended, it was terminated, it died of its own
            # exception) explains it at once; otherwise its process may still be ending: look
            # again for up to 1 s.
            explained = bool(self._runtime.departed())
            self._runtime.check_exited_peers(timeout=0.5, settle_s=0.0 if explained else 1.0)
            self._report_terminated()
            self._report_left(error)
        if reason in EXIT_FAILURES:
            report = self._process_failure(
                (self.rank,), reason, "self", steps=(self.step_count,), error=error
            )
            if self._control is not None:  # the leader's restart says why
                self._control.post_verdict(self.env.generation, report)
        log.error("rank %d dies of an uncaught exception (%s): %s", self.rank, reason, error)
        self.close(reason=f"{reason}: {error}")

    def _emit_fault(self, report: dict[str, Any]) -> None:
        if (
            self._control is not None
            and report.get("kind") == "process_failure"
            and report.get("reason") != EXITED_UNWATCHED  # (of the generation before)
        ):
            ranks = [r for r in report.get("failed_ranks", ()) if isinstance(r, int)]
            self._control.name_failed(self.env.generation, ranks)
        with self._reports_lock:
            self._reports.append(report)
            if _actionable(report, self._also_on) or report.get("kind") == "process_failure":
                self._last_fatal_report = time.monotonic()
        # Hardware telemetry that is not fatal (thermal, throttling, NVLink counters) is reported,
        # never a reason for the leader to restart or replace a node.
        not_fatal = report.get("kind") == "hardware" and report.get("fatal") is False
        acted_on = _actionable(report, self._also_on) and not not_fatal
        ask = self._orchestration.restart_destination if self._orchestration is not None else None
        # The user's callbacks and the report file, in order, off the runtime's event loop: a slow
        # callback there would stop this rank's heartbeats and its peers would declare it dead.
        if ask is not None and acted_on:
            # Not behind the callbacks queue: a slow callback of the user's (its report of the
            # recovery at start-up, an HTTP call) held the leader's restart for as long (outsider 57,
            # 8 s callbacks: a corrupted replica trained on to the end of the run).
            threading.Thread(
                target=self._with_destination,
                args=(ask, report),
                name="lm-resiliency-destination",
                daemon=True,
            ).start()
        else:
            self._callbacks.submit(self._write_report, report)
            if self._control is not None and acted_on:
                self._control.post_verdict(self.env.generation, report)
        if self._control is not None and acted_on:
            self._last_posted = time.monotonic()
        for cb in (self._fault_callback, self._orchestration.report_fault if self._orchestration else None):
            if cb is not None:
                self._callbacks.submit(cb, dict(report))

    def _with_destination(self, ask: Callable[[dict[str, Any]], str | None], report: dict[str, Any]) -> None:
        """`OrchestrationHooks.restart_destination`: asked where the culprit's work should restart
        (a thread of its own), its answer goes with the report (`restart_destination`) to the report
        file and to the torchrun backend's leader: the culprit's own node restarts it in place, a
        parked standby's id takes its slot (quarantining the culprit's node), None lets the policy
        decide. An answer that is not a string, or a hook that raises, is logged and left out; so is
        one that takes longer than `RuntimeConfig.restart_destination_wait_s`: the report goes to the
        leader without it
        (the fault is acted on now, not when an orchestrator answers)."""
        answers: list[Any] = []

        def call() -> None:
            try:
                answers.append(ask(dict(report)))
            except Exception:
                log.exception("rank %d: restart_destination hook raised; the policy decides", self.rank)
                answers.append(None)

        asking = threading.Thread(target=call, name="lm-resiliency-destination-hook", daemon=True)
        asking.start()
        wait = self._runtime_config.restart_destination_wait_s
        asking.join(wait)
        if not answers:
            log.warning(
                "rank %d: restart_destination did not answer within %.1f s; the %s report goes to the "
                "leader without it (the policy decides)",
                self.rank,
                wait,
                report.get("kind"),
            )
        dest = answers[0] if answers else None
        if dest is not None and not isinstance(dest, str):
            log.warning(
                "rank %d: restart_destination returned %r, not a node id (str) or None: ignored",
                self.rank,
                dest,
            )
            dest = None
        if dest:
            with self._reports_lock:  # (the session's own list holds this dict: it shows the answer)
                report["restart_destination"] = dest
            log.info("rank %d: restart_destination for %s: %s", self.rank, report.get("kind"), dest)
        self._callbacks.submit(self._write_report, report)  # (the file in the callbacks' order)
        if self._control is not None:
            self._control.post_verdict(self.env.generation, report)

    # -- public surface ---------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Completed optimizer steps, the recovered offset included (the loop's start)."""
        return self._step_offset + self._steps

    @property
    def recovered_step(self) -> int:
        return self._recovered_step

    @property
    def last_recovery_decision(self) -> dict[str, Any] | None:
        return self._last_decision.to_dict() if self._last_decision is not None else None

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("session not started")
        return self._topology

    @property
    def runtime(self) -> RankRuntime:
        if self._runtime is None:
            raise RuntimeError("session not started")
        return self._runtime

    @property
    def fault_reports(self) -> list[dict[str, Any]]:
        with self._reports_lock:
            return [dict(r) for r in self._reports]

    def cluster_view(self) -> ClusterView:
        """What this rank's runtime knows now: peers' liveness, progress and last telemetry."""
        return self.runtime.view()

    def wait_for(self, predicate: Callable[[ClusterView], bool], timeout: float) -> bool:
        return self.runtime.wait_for(predicate, timeout)

    def add_component(self, component: SessionComponent) -> None:
        self._components.append(component)

    def instrument_dataloader(self, dataloader: Any, name: str = "train") -> Any:
        """Wrap `dataloader` so the time spent in `next()` counts as the step's input time."""
        note, mark = self._adapter.note_input_time, self._mark_phase
        return _TimedLoader(
            dataloader, name, note, mark, self._before_fetch, self._loader_position, self._on_training_thread
        )

    def _on_training_thread(self) -> bool:
        return threading.get_ident() == self._training_thread

    def _before_fetch(self) -> None:
        """A step is about to fetch its batch: GEMINI takes a capture it left for this moment."""
        gem = self.gemini
        if gem is not None and not self._closed:
            t0 = time.perf_counter()
            gem.on_fetch()
            self._adapter.note_own_time(time.perf_counter() - t0)

    def _loader_position(self, name: str, began: Any, ended: list[bool] | None = None) -> Any:
        """The current iterator of instrumented loader `name` was made at global RNG state `began`
        (None: it ended, or is about to be replaced); `ended[0]` says whether it has yielded its
        epoch. Returns, once after a restore, the state the restored capture's iterator of that
        name was made at, or None (see _TimedLoader)."""
        if began is None:
            self._loader_positions.pop(name, None)
        else:
            self._loader_positions[name] = (began, ended if ended is not None else [False])
        gem = self.gemini
        return gem.restored_loaders.pop(name, None) if gem is not None and began is None else None

    def _loader_snapshot(self) -> dict[str, Any]:
        """For a capture: where each instrumented loader's iterator was made, except one that has
        yielded its epoch (its StopIteration not raised yet: a capture at the fetch that ends the
        epoch, or as the worker dies after its last batch). The uninterrupted run made the next
        epoch's iterator after that capture, from the state restored: so does the resumed loop.
        Before, it was made at the ended one's state, and every random number after it (dropout)
        was one draw off the uninterrupted run's (outsider 56, a restart at an epoch's first step)."""
        return {
            name: {"torch": rng}
            for name, (rng, ended) in list(self._loader_positions.items())
            if not ended[0]
        }

    def _mark_phase(self, phase: str | None) -> None:
        """What the training thread is inside of, for out-of-band stall checks: one tuple, replaced whole.
        An evaluation's lasts to the end of the step after it (see PyTorchAdapter._evaluating)."""
        current = getattr(self._adapter, "phase", None)
        if current is not None and current[0] == "evaluation":
            return
        now = time.monotonic()
        self._adapter.phase = (phase, now) if phase else None
        if current is not None and hasattr(self._adapter, "last_progress"):
            self._adapter.last_progress = now  # out of its loader or checkpoint I/O: moving again

    @contextlib.contextmanager
    def checkpoint_io(self, kind: str, name: str = "") -> Iterator[None]:
        """Mark framework checkpoint I/O so it is not mistaken for a stall, or (between steps) for a
        slow input: a rank that saves a checkpoint of its own is no straggler for it."""
        if kind not in ("read", "write"):
            raise ValueError(f"checkpoint_io kind must be 'read' or 'write', got {kind!r}")
        t0 = time.perf_counter()
        if not self._on_training_thread():
            # An asynchronous save on a thread of the script's own: the training thread goes on
            # meanwhile, and a hang of it is no checkpoint I/O. Before, it was excused as one until
            # the save ended (outsider 50: a hang named after 21 s, not 6, beside a 15 s save).
            try:
                yield
            finally:
                self._io.append((kind, name, time.perf_counter() - t0))
            return
        outer = getattr(self._adapter, "phase", None)
        if outer is None:
            self._mark_phase("checkpoint_io")
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self._io.append((kind, name, took))
            if outer is None:
                self._mark_phase(None)
                excuse = getattr(self._adapter, "note_excused_time", None)  # optional: custom adapters
                if excuse is not None:
                    excuse(took)  # not input: no input straggler for it

    def prepare_recovery(self, failure_kind: str, all_ranks_accessible: bool = True) -> RecoveryMode:
        """Decide which checkpoint trust level a recovery from `failure_kind` needs: a report kind
        (`sdc`, `hang`, ...) or one of the 21 canonical failure types (`tensor_corruption`, ...)."""
        kind = kind_of(failure_kind)
        if kind is None:
            raise ValueError(
                f"unknown failure kind {failure_kind!r}; expected one of {sorted(FAILURE_KINDS)} "
                f"or a canonical failure type ({', '.join(sorted(CANONICAL_TYPES))})"
            )
        mode = self._recovery_mode or RecoveryMode(default_recovery_mode(kind))
        newest = self._newest_recoverable(mode)
        gem = self.gemini
        if gem is not None:  # a restart of this job (plain torchrun: no orchestrator) restores as decided
            gem.note_restart_mode(mode.value, failure_kind)
        if newest >= 0:
            reason = "recovery_verified_step" if mode is RecoveryMode.RECOVERY_VERIFIED else "latest_step"
        elif gem is None:
            reason = "no_checkpoint_component"
        elif mode is RecoveryMode.RECOVERY_VERIFIED:
            reason = "no_certified_step_loadable_by_every_rank"
        else:
            reason = "no_step_loadable_by_every_rank"
        self._last_decision = RecoveryDecision(
            failure_kind=failure_kind,
            recovery_mode=mode,
            checkpoint_source="gemini" if newest >= 0 else "none",
            checkpoint_step=newest,
            checkpoint_id=memory_checkpoint_id(newest) if newest >= 0 else None,
            topology_digest=self.topology.shape_digest() if self._topology else "",
            all_ranks_accessible=all_ranks_accessible,
            available=newest >= 0,
            reason=reason,
        )
        return mode

    def _newest_recoverable(self, mode: RecoveryMode) -> int:
        return max((c.newest_recoverable_step(mode) for c in self._components), default=-1)

    def flush_for_restart(self) -> int:
        """Write the newest recoverable state to disk; return its step, or -1 when there is none."""
        return max((c.flush_for_restart() for c in self._components), default=-1)

    def _report_path(self) -> Path:
        assert self._report_dir is not None
        return self._report_dir / f"reports-rank{self.rank}.jsonl"

    def _open_report_file(self) -> Any:
        """The kept report file; opened again where the path no longer names it (removed, rotated)."""
        path = self._report_path()
        kept = self._report_file
        if kept is not None:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if kept[1] == path and (st.st_dev, st.st_ino) == kept[2]:
                    return kept[0]
            self._report_file = None
            with contextlib.suppress(OSError):
                kept[0].close()
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")  # noqa: SIM115 (kept open until close)
        st = os.fstat(f.fileno())
        self._report_file = (f, path, (st.st_dev, st.st_ino))
        return f

    def _write_report(self, report: dict[str, Any]) -> None:
        """Append the report to `<report_dir>/reports-rank<R>.jsonl` (ReplayHarnessConfig.report_dir)."""
        if self._report_dir is None:
            return
        try:
            line = _report_line(report, self.env.generation)
            f = self._open_report_file()
            f.write(line + "\n")
            f.flush()
        except OSError as exc:
            log.error("cannot append the fault report to %s: %s", self._report_path(), exc)

    def close(self, reason: str = CLOSED) -> None:
        """Stop hooks, components and the runtime. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        if reason == CLOSED and not self._sigterm_seen.is_set():
            self._settle()
        if reason == CLOSED and self._sigterm_seen.is_set():
            reason = "terminated: SIGTERM"  # its own handler let it end after ours: peers name it
        self._close_reason = reason
        self._closed = True
        _OPEN.discard(self)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._previous_excepthook is not None and sys.excepthook is self._previous_excepthook[0]:
            sys.excepthook = self._previous_excepthook[1]
        self._adapter.detach()
        trail = getattr(self._adapter, "trail", None)
        if trail is not None:  # the file stays for the agent; no collective is tracked any more
            self._adapter.trail = None
            trail.close()
        if self._first_forward is not None:
            self._first_forward.remove()
        if self._scaler_watch is not None:
            self._scaler_watch.remove()
        remove_hooks = getattr(self._adapter.optimizer, "remove_hooks", None)
        if remove_hooks is not None:  # an OptimizerChain's on its members, a ZeroView's on ZeRO's step
            remove_hooks()
        for c in reversed(self._components):
            try:
                c.close()
            except Exception:  # closing one component must not leave the others open
                log.exception("closing component %s failed", getattr(c, "name", c))
        self._components_closed = True
        # Only now: a SIGTERM while the components closed still waited for GEMINI's commits.
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(signal.SIGTERM) is self._previous_sigterm[0]:
                    signal.signal(signal.SIGTERM, self._previous_sigterm[1])
        if self._sigterm_watch is not None:
            self._sigterm_watch.close()
        if self._runtime is not None:
            self._runtime.close(reason=reason)
        if self._control is not None:
            self._control.close()
        self._callbacks.close(timeout=10.0)  # the reports made so far reach the callbacks first
        kept, self._report_file = self._report_file, None
        if kept is not None:
            with contextlib.suppress(OSError):
                kept[0].close()
        if reason == CLOSED:
            self._finish()

    def _finish(self) -> None:
        """Under the torchrun backend, wait (at most `RuntimeConfig.finish_wait_s`) until every rank
        of this generation has closed its session too, still a live worker of torchrun's.

        A worker that ends puts its agent in torch's exit barrier once its node-mates have, where no
        restart reaches it. A rank that failed after that (an exception, a kill, in the script's own
        final save after its loop) had its run's restart wait for those nodes for good: the job
        never ended (outsider 58: an exception 10 s after the last step). Waiting here, the restart
        stops this worker (SIGTERM), and the next generation does the end of the script again from
        the newest capture. Nothing is left to flush: the goodbye was said, the components are closed."""
        control = self._control
        limit = self._runtime_config.finish_wait_s
        if control is None or self.world_size < 2 or self._sigterm_seen.is_set():
            return
        if limit <= 0:  # no wait, only counted: a rank that fails later is reported by the restart
            control.finish(self.env.generation, self.world_size, 0.0)
            return
        # A SIGTERM (the restart's) ends the wait: the default ends the process; a handler of the
        # script's own that returns lets the script go on to its end.
        stopped = threading.Event()
        previous = signal.getsignal(signal.SIGTERM)
        wrapped = threading.current_thread() is threading.main_thread() and previous not in (
            signal.SIG_DFL,
            None,
        )
        if wrapped:

            def on_sigterm(signum: int, frame: Any) -> None:
                stopped.set()
                if callable(previous):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, on_sigterm)
        t0 = time.monotonic()
        try:
            count = control.finish(self.env.generation, self.world_size, limit, stopped.is_set)
        finally:
            if wrapped:
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(signal.SIGTERM, previous)
        waited = time.monotonic() - t0
        if stopped.is_set():
            return
        if 0 <= count < self.world_size:
            log.warning(
                "rank %d: %d of %d ranks closed their sessions in %.0f s; ending without the others",
                self.rank,
                count,
                self.world_size,
                waited,
            )
        elif waited > 1.0:
            log.info("rank %d: waited %.1f s for every rank to close its session", self.rank, waited)

    def _settle(self) -> None:
        """The script closes the session at its loop's end: its last step is judged first (SCOUT's
        `settle`, at most SETTLE_S), so a fault in it is named, not left in the final weights. Under
        the torchrun backend, where this rank posted a fault to the leader within HOLD_S (in the
        last step, or the one before, whose restart had not come yet), the worker waits up to
        HOLD_S for the leader's restart (its SIGTERM ends the process): it ends only then, and the
        next generation does the last steps again from the step restored. Before, the workers
        ended with exit code 0 first, and the run ended with the fault in its state."""
        scout = self.scout
        if scout is None or self._steps == 0:
            return
        # Under the torchrun backend, the step counts the ranks end at are compared too (published
        # first: a peer's settle may take its whole wait).
        control = self._control
        compare = (
            control is not None
            and self.world_size >= 2
            and self._uneven_from is None
            and not self._detection_paused
            and control.publish_final(
                self.env.generation, self.rank, self.step_count, self._final_digest(scout)
            )
        )
        try:
            gem = self.gemini
            if gem is not None:  # (its capture of the last step, and SCOUT's evidence of it with it)
                gem.take_deferred()
            scout.settle(self.step_count)
            if compare:
                assert control is not None
                self._compare_final_steps(scout, control)
        except Exception:  # closing goes on whatever the wait met
            log.exception("rank %d: waiting for the last step's judgment failed", self.rank)
        since = time.monotonic() - self._last_posted
        if self._control is None or since > HOLD_S:
            return
        log.warning(
            "rank %d: the loop ended %.1f s after a fault this rank posted to the run's leader: "
            "waiting up to %.0f s for its restart before closing",
            self.rank,
            since,
            HOLD_S,
        )
        if not self._sigterm_seen.wait(HOLD_S):
            log.warning("rank %d: no restart came in %.0f s; closing", self.rank, HOLD_S)

    def _final_digest(self, scout: Any) -> bytes:
        """SCOUT's digest of this rank's final state (`final_digest`), b"" where it cannot be had."""
        try:
            return bytes(scout.final_digest())
        except Exception:  # advisory: published without it, compared among the others
            log.exception("rank %d: the digest of the final state failed", self.rank)
            return b""

    def _compare_final_steps(self, scout: Any, control: Any) -> None:
        """The step counts every rank ended its loop at: one for all in a synchronous job. A rank
        that stepped its optimizer once more than its peers after the last step they compared
        (twice in its last iteration, with no collective to pair it: nothing is compared after it),
        or once less, ended apart: voted `stale_state` (`final_steps_verdict`), so the leader
        restarts the run from the newest certified step before the workers end. Before, such a
        rank's extra update stayed in the final weights and the run ended with exit code 0. Not
        voted again in a generation restarted for it: a script that ends its ranks apart on
        purpose is told so, not restarted for good.

        Where they agree and SCOUT did not judge the last checked step with every replica's
        evidence (`compare_at_end`), the replicas' final states are compared here instead
        (`final_state_verdict`): a state that differs is voted SDC, and undone the same way."""
        finals = control.finals(
            self.env.generation, self.world_size, FINALS_WAIT_S, self._sigterm_seen.is_set
        )
        v = final_steps_verdict(finals)
        if v is None and scout.compare_at_end(self.step_count):
            # The last step was not compared (a replica's evidence missing): the states are, here.
            digests = control.final_digests(self.env.generation, scout.group)
            v = scout.final_state_verdict(self.step_count, digests)
            if v is None:
                log.info(
                    "rank %d: the last step went unjudged, but ranks %s agree on the state they ended at",
                    self.rank,
                    sorted(digests),
                )
        if v is None:
            return
        ctx = self._context or {}
        again = str(ctx.get("reason_code", "")).startswith("final_steps_differ")
        if again and v.reason.startswith("final_steps_differ"):
            log.warning(
                "rank %d: %s, again after a restart for it: the script ends its ranks apart; "
                "not restarted again",
                self.rank,
                v.detail,
            )
            return
        log.warning("rank %d: %s", self.rank, v.detail)
        scout.vote(v)
        scout.settle(self.step_count)  # (until its verdict is acted on: a few seconds at most)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, tp: type[BaseException] | None, value: BaseException | None, tb: Any) -> None:
        """An exception leaving the `with` block ends the worker as an uncaught one would, and is
        reported the same way (`_exiting`: its reason and text, to the peers in the goodbye); a
        close with no reason told the peers this rank was done, and nobody why it failed."""
        if value is None or (isinstance(value, SystemExit) and value.code in (None, 0)):
            self.close()
        else:
            self._exiting(value)


class _CallbackThread:
    """Runs calls in submission order on a thread of its own (started at the first call). A call
    that raises is logged, never propagated; after `close`, or where no thread can be started,
    calls run inline."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if not self._closed and self._thread is None:
                thread = threading.Thread(target=self._run, name="lm-resiliency-callbacks", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:  # no thread to be had: the worker is out of memory (RLIMIT_AS)
                    pass  # or of processes; the report of why it dies must still go out: inline
            if not self._closed and self._thread is not None:
                self._queue.put((fn, args))
                return
        self._call(fn, args)

    def close(self, timeout: float) -> None:
        with self._lock:
            self._closed, thread = True, self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("a fault callback still runs %.0f s after close; not waiting for it", timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._call(*item)

    @staticmethod
    def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:  # a user's callback must not take the runtime down; log its trace
            log.exception("fault callback raised")


class _TimedLoader:
    """A proxy that times `next()` on the wrapped loader's iterators, or on the wrapped iterator itself
    (Megatron-style loops pass `data_iterator` around and call `next()` on it); everything else
    passes through."""

    def __init__(
        self,
        loader: Any,
        name: str,
        sink: Callable[[float], None],
        mark: Callable[[str | None], None],
        before: Callable[[], None],
        position: Callable[..., Any] = lambda *a: None,
        here: Callable[[], bool] = lambda: True,
    ) -> None:
        self._loader = loader
        self.name = name
        self._sink = sink
        self._mark = mark
        self._before = before  # called before each `next()`, outside its timing
        self._position = position  # told where each iterator began in the RNG (see __iter__)
        self._started = False  # `next()` on the proxy: its first batch has been taken
        # On the training thread? A prefetching thread of the loop's that reads this proxy says
        # nothing of where the training thread is: its fetches are neither input time, nor a
        # phase, nor a step's end (GEMINI would have captured the state from that thread while
        # the training thread changed it).
        self._here = here

    def _timed_next(self, it: Any, first: bool) -> Any:
        if not self._here():
            return next(it)
        self._before()
        t0 = time.perf_counter()
        # An iterator's first batch waits for its workers to start: not a stall by its length alone
        # ("input_start" has no threshold), but where a hang is named, the data loader's.
        self._mark("input_start" if first else "input")
        try:
            return next(it)
        finally:
            self._sink(time.perf_counter() - t0)
            self._mark(None)

    def __iter__(self) -> Iterator[Any]:
        """Iterates the loader. `iter(DataLoader)` draws its workers' seed from the global torch RNG
        (and, with workers, a RandomSampler's permutation as it prefetches); a capture holds the RNG
        state after its step, long after those draws, and a loop that resumes mid-epoch calls
        `iter()` once more than the uninterrupted run did. So the first iterator after a restore
        is made at the RNG state the captured one was made at (the same seed and order), and the
        restored state then goes on: the random numbers after it are the uninterrupted run's."""
        import torch

        from lm_resiliency.gemini.iterators import draw_now, ended, untracked

        began = self._position(self.name, None)  # a restored capture's iterator, once
        after = None
        if began is not None:
            after = torch.get_rng_state()
            torch.set_rng_state(began)
        else:
            began = torch.get_rng_state()
        try:
            with untracked():  # (GEMINI's watch of other loaders' iterators leaves this one alone)
                it = iter(self._loader)
            if after is not None:
                draw_now(it)  # (without workers, a RandomSampler draws at its first batch: now)
        finally:
            if after is not None:
                torch.set_rng_state(after)
        done = [False]  # it has yielded its epoch (see Session._loader_snapshot)
        self._position(self.name, began, done)
        first = True
        while True:
            try:
                item = self._timed_next(it, first)
            except StopIteration:
                self._position(self.name, None)
                return
            first = False
            done[0] = ended(it)
            yield item

    def __next__(self) -> Any:
        """`next(proxy)` where the wrapped object is an iterator (a DataLoader is not: TypeError, as
        `next()` on it raises)."""
        first, self._started = not self._started, True
        return self._timed_next(self._loader, first)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _collective_timeout_s() -> float | None:
    """The default process group's collective timeout (the shortest of its backends), or None."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = dist.distributed_c10d._get_default_group()
    found = []
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except Exception:  # no backend for that device type
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is not None and hasattr(timeout, "total_seconds") and timeout.total_seconds() > 0:
            found.append(float(timeout.total_seconds()))
    return min(found) if found else None


def _assemble_topology(anns: dict[int, Any], world_size: int, rank: int = 0) -> Topology:
    groups = replica_groups_from({r: a.replica_group for r, a in anns.items()}, world_size)
    dim_groups: dict[str, set[tuple[int, ...]]] = {}
    for a in anns.values():
        for name, members in a.dims.items():
            dim_groups.setdefault(name, set()).add(tuple(members))
    dims = [ParallelDim(n, tuple(sorted(g))) for n, g in sorted(dim_groups.items())]
    nodes, shared = node_ids_by_machine(
        [anns[r].node_id for r in range(world_size)], [anns[r].host for r in range(world_size)]
    )
    if shared and rank == 0:
        log.warning(
            "node ids %s are shared by several machines (hosts cloned from one image share "
            "/etc/machine-id): told apart by boot id, so replicas still leave the machine. Give each "
            "machine its own machine id (or each rank LM_RESILIENCY_MACHINE_ID_PATH)",
            shared,
        )
    try:
        peers = replica_groups_from(
            {r: a.peer_group or a.replica_group for r, a in anns.items()}, world_size, "peer group"
        )
        return Topology.build(nodes, groups, dims, peer_groups=peers)
    except ValueError as exc:  # only timing comparisons lose peers: never worth failing the job
        log.warning("peer groups ignored (each replica group compares its own step times): %s", exc)
        return Topology.build(nodes, groups, dims)


def _bind_host(cfg: RuntimeConfig, env: Environment) -> str:
    """The address peers can reach us at: configured, else the interface that routes to MASTER_ADDR."""
    if cfg.bind_host:
        return cfg.bind_host
    if env.bind_host:
        return env.bind_host
    master = env.master_addr
    if not master or master in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # UDP connect sends nothing; it only selects the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
