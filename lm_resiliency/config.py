"""Settings: the only reader of TOML policies and of the environment.

Everything is parsed once into frozen, validated dataclasses. A wrong key or a wrong type fails with a
`ConfigError` that names the key (`checkpoint.interval: expected int, got str`).
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import os
import socket
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from lm_resiliency.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "DurableCheckpointConfig",
    "Environment",
    "InMemoryCkptConfig",
    "OrchestrationHooks",
    "RecoveryDecision",
    "RecoveryMode",
    "ReplayHarnessConfig",
    "RuntimeConfig",
    "SCOUTFaultReport",
    "WorkerPolicy",
    "load_policy",
    "parse_policy",
    "read_environment",
]

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SHM_DIR = "/dev/shm/lm_resiliency"  # GEMINI's slots, unless LM_RESILIENCY_SHM_DIR names another
T = TypeVar("T")


class RecoveryMode(str, enum.Enum):
    """Which checkpoint a recovery may use."""

    LATEST = "latest"
    RECOVERY_VERIFIED = "recovery_verified"

    @classmethod
    def parse(cls, value: RecoveryMode | str | None, key: str = "recovery_mode") -> RecoveryMode | None:
        if value is None or isinstance(value, RecoveryMode):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(key, f"expected one of {[m.value for m in cls]}, got {value!r}") from None


def _check_types(obj: Any, prefix: str) -> None:
    """Every field of settings dataclass `obj` holds a value of its annotated type (a number where a
    number goes: its range checks then compare numbers), else a ConfigError naming the field. As
    lenient as Python is: any integral number (not a bool) is an int, any real one a float, any
    path-like a string (a folder given as a `Path`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        problem = _type_problem(value, hints[f.name])
        if problem:
            raise ConfigError(f"{prefix}{f.name}", problem)
        if isinstance(value, os.PathLike):  # held as the string it names, as a str field is used
            object.__setattr__(obj, f.name, os.fspath(value))


def _type_problem(value: Any, tp: Any) -> str:
    """Why `value` is not of type `tp` ("" when it is, or when `tp` is not a plain one)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return ""
        problems = [_type_problem(value, a) for a in args if a is not type(None)]
        return "" if not all(problems) else " or ".join(problems)
    given = f"got {type(value).__name__} {value!r}"
    if tp is bool:
        return "" if isinstance(value, bool) else f"expected bool, {given}"
    if tp is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return "" if ok else f"expected int, {given}"
    if tp is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and value != value:  # NaN: every range check (value <= 0, ...) would let it through
            return "expected a number, got NaN"
        return "" if ok else f"expected a number, {given}"
    if tp is str:
        return "" if isinstance(value, str | os.PathLike) else f"expected string, {given}"
    return ""


def _positive(key: str, value: float | int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(key, f"must be > 0, got {value!r}")


def _non_negative_int(key: str, value: int) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(key, f"must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class InMemoryCkptConfig:
    """GEMINI: in-memory checkpoints, peer replication and the durable tier.

    `interval=None` uses the session's `interval`. `replication_jump=-1` lets placement choose the
    peer; a positive value sends rank r's copy to the rank `jump` slots away on another node.
    """

    enable: bool = True
    interval: int | None = None
    replication_jump: int = -1
    replication_chunk_size: int = 16 * MiB
    disk_flush_interval: int = 100
    disk_folder: str = "./checkpoints"
    run_id: str | None = None
    verify_integrity: bool = False
    skip_replication_if_hsdp: bool = True
    pin_memory: bool = True

    def __post_init__(self) -> None:
        _check_types(self, "checkpoint.")
        _positive("checkpoint.interval", self.interval)
        _positive("checkpoint.replication_chunk_size", self.replication_chunk_size, allow_none=False)
        if self.replication_chunk_size > 4 * GiB:  # a chunk is one message and one checksum
            raise ConfigError(
                "checkpoint.replication_chunk_size",
                f"must be at most 4 GiB, got {self.replication_chunk_size}",
            )
        _positive("checkpoint.disk_flush_interval", self.disk_flush_interval, allow_none=False)
        if self.replication_jump == 0 or self.replication_jump < -1:
            raise ConfigError(
                "checkpoint.replication_jump", f"must be -1 or > 0, got {self.replication_jump}"
            )
        if not self.disk_folder:
            raise ConfigError("checkpoint.disk_folder", "must not be empty")


@dataclass(frozen=True)
class ReplayHarnessConfig:
    """SCOUT: cadence and thresholds of detection and replay."""

    enable: bool = True
    interval: int | None = None
    straggler_ratio: float = 1.5
    straggler_min_ms: float = 20.0
    straggler_confirmations: int = 3
    hang_stall_threshold_s: float = 30.0
    dataloader_latency_threshold_s: float = 10.0
    checkpoint_io_latency_threshold_s: float = 120.0
    # Ours: how long a rank may run its model with gradients off between steps (an evaluation, rank
    # 0 sampling alone) while its peers wait in the next step's collective, before it is named hung.
    evaluation_latency_threshold_s: float = 600.0
    temporal_window: int = 16
    replay_on_ambiguous: bool = True
    deterministic_replay: bool = True
    report_dir: str | None = None  # ours: fault reports appended as JSON lines (reports-rank<R>.jsonl)
    # Ours: every this many seconds each rank times a `link_probe_bytes` transfer to peers of its
    # replica group on other nodes, so a slow node or link is named (0 turns probing off).
    link_probe_interval_s: float = 5.0
    link_probe_bytes: int = 256 * 1024
    # Ours: replay records (two-replica groups) are host copies of about 5x the parameters' bytes on
    # checked steps; above this size they are not kept and disagreements stay ambiguous.
    replay_record_max_mib: int = 2048
    # Ours: every this many steps each rank's micro-batches are re-executed by one replica peer (an
    # audit), which finds corruption before the all-reduce (forward outputs, local gradients) that
    # fingerprints cannot see; costs about one forward+backward per rank per audited step (0 = off).
    audit_interval: int = 0
    # Ours: a rank no replica holds (FSDP2 without HSDP replicas, tensor parallelism) checks, every
    # this many steps, that its parameters and optimizer state did not change between that optimizer
    # step and the next (two passes over its shards; 0 = off).
    rest_interval: int = 1
    # Ours: an audit sends the audited micro-batches' inputs, buffers and output gradients; above
    # this size only the forward is audited, and above it without output gradients not at all.
    audit_max_mib: int = 256

    def __post_init__(self) -> None:
        _check_types(self, "replay.")
        _positive("replay.interval", self.interval)
        if self.straggler_ratio <= 1.0:
            raise ConfigError("replay.straggler_ratio", f"must be > 1.0, got {self.straggler_ratio}")
        _positive("replay.straggler_min_ms", self.straggler_min_ms, allow_none=False)
        _positive("replay.straggler_confirmations", self.straggler_confirmations, allow_none=False)
        _positive("replay.hang_stall_threshold_s", self.hang_stall_threshold_s, allow_none=False)
        _positive("replay.dataloader_latency_threshold_s", self.dataloader_latency_threshold_s, False)
        _positive("replay.checkpoint_io_latency_threshold_s", self.checkpoint_io_latency_threshold_s, False)
        _positive("replay.evaluation_latency_threshold_s", self.evaluation_latency_threshold_s, False)
        _positive("replay.temporal_window", self.temporal_window, allow_none=False)
        if self.link_probe_interval_s < 0:
            raise ConfigError(
                "replay.link_probe_interval_s", f"must be >= 0, got {self.link_probe_interval_s}"
            )
        _positive("replay.link_probe_bytes", self.link_probe_bytes, allow_none=False)
        _positive("replay.replay_record_max_mib", self.replay_record_max_mib, allow_none=False)
        _non_negative_int("replay.audit_interval", self.audit_interval)
        _positive("replay.audit_max_mib", self.audit_max_mib, allow_none=False)
        _non_negative_int("replay.rest_interval", self.rest_interval)


@dataclass(frozen=True)
class DurableCheckpointConfig:
    """The disk tier: where and how often GEMINI writes captures for a full-job restart."""

    folder: str = "./checkpoints"
    interval: int = 100
    keep_last: int = 2
    fsync: bool = True

    def __post_init__(self) -> None:
        _check_types(self, "durable.")
        if not self.folder:
            raise ConfigError("durable.folder", "must not be empty")
        _positive("durable.interval", self.interval, allow_none=False)
        _positive("durable.keep_last", self.keep_last, allow_none=False)


@dataclass(frozen=True)
class RuntimeConfig:
    """The per-rank runtime: heartbeats, discovery and transport."""

    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    discovery_timeout_s: float = 120.0
    bind_host: str | None = None
    use_ipc: bool = True
    send_high_water_mark: int = 10000
    # Messages other threads submit within this long of the last send go out together at its end
    # (0: each at once; at most heartbeat_interval_s is used). For loops whose steps are shorter
    # than this: the training thread no longer wakes the runtime every step (~1.5 ms a step less
    # on 2 cores), but evidence, verdicts and certificates arrive up to this much later. Keep it
    # under two steps: replicas in pairs replay from records of their last 3 checked steps only.
    publish_coalesce_s: float = 0.0
    # Ours: a step's telemetry (its times, for straggler consensus and liveness) submitted within
    # this long of the last send waits for the next one (the next check's evidence, a later step's
    # telemetry, at most a heartbeat interval): a loop of short steps no longer wakes the runtime
    # and sends and receives a message every step (~1 ms of CPU a step a rank, ~8% of a 25 ms step
    # of 4 ranks on 2 cores). Evidence, votes and anything else still go out at once (0: telemetry
    # too).
    telemetry_batch_s: float = 0.05
    # Ours: under the torchrun backend, how long a session closed at its script's end waits for
    # every rank of its generation to close its own (a restart still reaches it meanwhile: see
    # docs/torchrun.md, a fault after some ranks ended). 0: no wait.
    finish_wait_s: float = 120.0
    # Ours: how long a report the torchrun backend's leader acts on waits for
    # `OrchestrationHooks.restart_destination`'s answer before it goes without one (the fault is
    # acted on then, not when an orchestrator's API answers). 0: not waited for.
    restart_destination_wait_s: float = 2.0

    def __post_init__(self) -> None:
        _check_types(self, "runtime.")
        if not self.finish_wait_s >= 0:
            raise ConfigError("runtime.finish_wait_s", f"must be >= 0, got {self.finish_wait_s}")
        if not self.restart_destination_wait_s >= 0:
            raise ConfigError(
                "runtime.restart_destination_wait_s", f"must be >= 0, got {self.restart_destination_wait_s}"
            )
        if not self.telemetry_batch_s >= 0:
            raise ConfigError("runtime.telemetry_batch_s", f"must be >= 0, got {self.telemetry_batch_s}")
        _positive("runtime.heartbeat_interval_s", self.heartbeat_interval_s, allow_none=False)
        _positive("runtime.heartbeat_timeout_s", self.heartbeat_timeout_s, allow_none=False)
        if not self.publish_coalesce_s >= 0:
            raise ConfigError("runtime.publish_coalesce_s", f"must be >= 0, got {self.publish_coalesce_s}")
        _positive("runtime.discovery_timeout_s", self.discovery_timeout_s, allow_none=False)
        _positive("runtime.send_high_water_mark", self.send_high_water_mark, allow_none=False)
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(
                "runtime.heartbeat_timeout_s",
                f"must be at least twice heartbeat_interval_s ({self.heartbeat_interval_s}), "
                f"got {self.heartbeat_timeout_s}",
            )


@dataclass(frozen=True)
class OrchestrationHooks:
    """Callbacks for an external orchestrator. Each is optional and called off the training thread."""

    report_fault: Callable[[dict[str, Any]], None] | None = None
    report_recovery: Callable[[dict[str, Any]], None] | None = None
    restart_destination: Callable[[dict[str, Any]], str | None] | None = None


@dataclass(frozen=True)
class RecoveryDecision:
    """Which checkpoint a recovery uses and why (INTERFACE.md §4)."""

    failure_kind: str
    recovery_mode: RecoveryMode
    checkpoint_source: str = "none"  # "gemini" | "durable" | "none"
    checkpoint_step: int = -1
    checkpoint_id: str | None = None
    topology_digest: str = ""
    all_ranks_accessible: bool = True
    available: bool = False
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["recovery_mode"] = self.recovery_mode.value
        return out


@dataclass(frozen=True)
class SCOUTFaultReport:
    """A fault report (INTERFACE.md §4); `to_dict` drops unset keys."""

    kind: str
    failed_ranks: tuple[int, ...] = ()
    scope: str = "rank"
    sources: tuple[str, ...] = ()
    straggler_type: str | None = None
    confirmations: int | None = None
    steps: tuple[int, ...] = ()
    stall_duration_s: float | None = None
    endpoint_kind: str | None = None
    endpoint_id: str | None = None
    endpoint_rank: int | None = None
    confidence: float | None = None
    reason: str = ""
    node: str | None = None
    device: str | None = None
    incident_id: str | None = None
    detection_latency_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or v == ():
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


FAILURE_ACTIONS = (
    "sdc",
    "stale_state",
    "hardware",
    "node_lost",
    "process_failure",
    "hang",
    "network_partition",
    "collective_desync",
    "straggler",
    "data_stall",
    "checkpoint_stall",
)
# Verdicts on a job that still trains (slowly): replaced where the policy says to replace the
# culprit's node (`recovery.replace_node_on`) and a standby can take its slot; otherwise restarted in
# place once where `recovery.restart_in_place_on` lists them, else only reported.
REPLACE_ONLY_FAILURES = ("straggler", "data_stall", "checkpoint_stall")
# Damage the memory tiers outlive (a checkpoint copy that fails its checks, a durable tier that
# fails, a chunk corrupted in flight): the job trains on. Restarted in place once where
# `recovery.restart_in_place_on` lists them (the restart recovers from a copy that passes its checks
# and captures anew), else only reported.
DAMAGE_FAILURES = ("checkpoint_corruption", "io_error", "payload_corruption")
# What FAILURES.md's resiliency cycle does for them: a slow rank (a `delay`), a damaged copy, a failing
# disk, a corrupted payload restart once; a checkpoint-I/O stall is only reported.
DEFAULT_RESTART_IN_PLACE_ON = ("straggler", "data_stall", *DAMAGE_FAILURES)


@dataclass(frozen=True)
class RecoveryPolicyConfig:
    """What the torchrun backend's leader does per failure kind.

    `replace_node_on`: the kinds that replace the culprit's node with a standby (and quarantine
    it); every other failure restarts in place. A slow-job kind (REPLACE_ONLY_FAILURES: straggler,
    data_stall, checkpoint_stall) listed there replaces only while a standby is parked.

    `restart_in_place_on`: kinds on which the job still trains (slow-job kinds not replaced, and
    DAMAGE_FAILURES) that restart the worker group in place, once per run for the same kind and
    culprit nodes (a recurrence is only reported: a second restart would not fix what the first did
    not), and RESTART_IN_PLACE_MAX (3) times per kind at most. Unlisted, they are only reported."""

    replace_node_on: tuple[str, ...] = (
        "sdc",
        "hardware",
        "node_lost",
        "network_partition",
        "collective_desync",
    )
    restart_in_place_on: tuple[str, ...] = DEFAULT_RESTART_IN_PLACE_ON

    def __post_init__(self) -> None:
        for kind in self.replace_node_on:
            if kind not in FAILURE_ACTIONS:
                raise ConfigError(
                    "recovery.replace_node_on", f"unknown failure kind {kind!r} (known: {FAILURE_ACTIONS})"
                )
        known = (*REPLACE_ONLY_FAILURES, *DAMAGE_FAILURES)
        for kind in self.restart_in_place_on:
            if kind not in known:
                raise ConfigError(
                    "recovery.restart_in_place_on",
                    f"{kind!r} is not a kind the job trains on through (those: {known}; every other "
                    "failure restarts in place or replaces a node already)",
                )


@dataclass(frozen=True)
class WorkerPolicy:
    """The worker policy TOML (`schema_version = 1`)."""

    schema_version: int = 1
    interval: int = 10
    enable_checkpoint: bool = True
    enable_detection: bool = True
    adapter: str | None = None
    recovery_mode: str | None = None
    checkpoint: InMemoryCkptConfig = field(default_factory=InMemoryCkptConfig)
    replay: ReplayHarnessConfig = field(default_factory=ReplayHarnessConfig)
    durable: DurableCheckpointConfig | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    recovery: RecoveryPolicyConfig = field(default_factory=RecoveryPolicyConfig)

    def __post_init__(self) -> None:
        if self.schema_version != 1:
            raise ConfigError("schema_version", f"only version 1 is supported, got {self.schema_version}")
        _positive("interval", self.interval, allow_none=False)
        RecoveryMode.parse(self.recovery_mode)
        if self.adapter is not None and ":" not in self.adapter:
            raise ConfigError("adapter", f"expected 'package.module:factory', got {self.adapter!r}")


_SECTIONS: dict[str, type[Any]] = {
    "checkpoint": InMemoryCkptConfig,
    "replay": ReplayHarnessConfig,
    "durable": DurableCheckpointConfig,
    "runtime": RuntimeConfig,
    "recovery": RecoveryPolicyConfig,
}


def policy_kwargs(policy: WorkerPolicy) -> dict[str, Any]:
    """The `enable_resiliency` keyword arguments a worker policy stands for."""
    return {
        "interval": policy.interval,
        "enable_checkpoint": policy.enable_checkpoint,
        "enable_detection": policy.enable_detection,
        "checkpoint": policy.checkpoint,
        "replay": policy.replay,
        "durable_checkpoint": policy.durable,
        "recovery_mode": policy.recovery_mode,
        "runtime": policy.runtime,
    }


def policy_to_dict(policy: WorkerPolicy) -> dict[str, Any]:
    """A JSON-ready, canonical form of a policy (what nodes compare by digest)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, Enum):
            return v.value
        return v

    out: dict[str, Any] = plain(policy)
    return out


def parse_policy(data: Mapping[str, Any], source: str = "<policy>") -> WorkerPolicy:
    """Build a WorkerPolicy from a parsed TOML mapping. Raises ConfigError naming the key."""
    if "schema_version" not in data:
        raise ConfigError("schema_version", f"missing in {source} (expected schema_version = 1)")
    root: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(key, f"expected a [{key}] table, got {type(value).__name__}")
            root[key] = build_section(_SECTIONS[key], value, prefix=f"{key}.")
        else:
            root[key] = value
    return build_section(WorkerPolicy, root, prefix="", nested_ok=True)


def load_policy(path: str | os.PathLike[str]) -> WorkerPolicy:
    """Read and validate a worker policy TOML file."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError("policy", f"cannot read {p}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("policy", f"{p} is not valid TOML: {exc}") from exc
    return parse_policy(data, source=str(p))


def build_section(cls: type[T], values: Mapping[str, Any], prefix: str = "", nested_ok: bool = False) -> T:
    """Construct dataclass `cls` from `values`, checking every key and type against its annotations."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(name, f"unknown key (known: {', '.join(sorted(fields))})")
        tp = hints[key]
        if nested_ok and dataclasses.is_dataclass(value):
            kwargs[key] = value
            continue
        kwargs[key] = _coerce(value, tp, name)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(prefix.rstrip(".") or cls.__name__, str(exc)) from exc


def _coerce(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(tp)):
                return None
            raise ConfigError(name, "must not be empty")
        problems = []
        for arg in args:
            try:
                return _coerce(value, arg, name)
            except ConfigError as exc:
                problems.append(exc.problem)
        raise ConfigError(name, "; ".join(problems))
    if tp is bool:
        if type(value) is not bool:
            raise ConfigError(name, f"expected bool, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if type(value) is not int:
            raise ConfigError(name, f"expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise ConfigError(name, f"expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        if not isinstance(value, list | tuple):
            raise ConfigError(name, f"expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(v, typing.get_args(tp)[0], f"{name}[{i}]") for i, v in enumerate(value))
    if tp is str:
        if type(value) is not str:
            raise ConfigError(name, f"expected string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(name, f"cannot be set from a policy file (type {tp})")


# ---------------------------------------------------------------------------------------------------
# Environment: read in one place, once, into a value.


@dataclass(frozen=True)
class Environment:
    """What the process environment says about this worker."""

    generation: int = 0
    run_id: str = "default"
    restart_context_path: str | None = None
    checkpoint_step: int = 0
    machine_id_path: str = "/etc/machine-id"
    worker_config_path: str | None = None
    bind_host: str | None = None
    master_addr: str | None = None
    local_rank: int = 0
    hostname: str = ""
    explicit_run_id: bool = False
    shm_dir: str = DEFAULT_SHM_DIR
    control_store: str | None = None  # set by the torchrun backend: tcp://HOST:PORT or file://PATH
    fault_campaign: str | None = None  # a campaign JSON whose faults this rank injects (faults/)
    fault_ground_truth: str | None = None  # where the injector records what it did
    report_dir: str | None = None  # fault reports' folder when the replay settings name none
    trail_dir: str | None = None  # set by the torchrun backend: where this rank writes its collective trail
    # torchrun's run id (its --rdzv-id): the backend's keys in the control store are under it, also
    # where LM_RESILIENCY_RUN_ID names the run's checkpoints otherwise
    rdzv_run_id: str | None = None
    # the torchrun backend's name for this node (its agent's id: the one its control-store keys use)
    agent_node_id: str | None = None

    def control_run_id(self) -> str:
        """The run id the torchrun backend's keys in the control store are under."""
        return self.rdzv_run_id or self.run_id

    def node_id(self) -> str:
        """This machine's identity: the machine-id file's content, or the hostname if it has none."""
        try:
            text = Path(self.machine_id_path).read_text().strip()
        except OSError:
            text = ""
        return text or self.hostname


def _env_int(environ: Mapping[str, str], key: str, default: int) -> int:
    raw = environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(key, f"expected an integer, got {raw!r}") from None


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Parse the variables torchrun and our backend set. Raises ConfigError naming a bad variable."""
    env = os.environ if environ is None else environ
    return Environment(
        # Our backend exports its generation; under plain torchrun, its restart count plays that role.
        generation=_env_int(env, "LM_RESILIENCY_GENERATION", _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0)),
        explicit_run_id=bool(env.get("LM_RESILIENCY_RUN_ID")),
        shm_dir=env.get("LM_RESILIENCY_SHM_DIR") or DEFAULT_SHM_DIR,
        control_store=env.get("LM_RESILIENCY_CONTROL_STORE") or None,
        fault_campaign=env.get("LM_RESILIENCY_FAULT_CAMPAIGN") or None,
        fault_ground_truth=env.get("LM_RESILIENCY_FAULT_GROUND_TRUTH") or None,
        report_dir=env.get("LM_RESILIENCY_REPORT_DIR") or None,
        trail_dir=env.get("LM_RESILIENCY_TRAIL_DIR") or None,
        run_id=env.get("LM_RESILIENCY_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or "default",
        rdzv_run_id=env.get("TORCHELASTIC_RUN_ID") or None,
        agent_node_id=env.get("LM_RESILIENCY_NODE_ID") or None,
        restart_context_path=env.get("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT") or None,
        checkpoint_step=_env_int(env, "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", 0),
        machine_id_path=env.get("LM_RESILIENCY_MACHINE_ID_PATH") or "/etc/machine-id",
        worker_config_path=env.get("LM_RESILIENCY_WORKER_CONFIG") or None,
        bind_host=env.get("LM_RESILIENCY_BIND_HOST") or None,
        master_addr=env.get("MASTER_ADDR") or None,
        local_rank=_env_int(env, "LOCAL_RANK", 0),
        hostname=socket.gethostname(),
    )
