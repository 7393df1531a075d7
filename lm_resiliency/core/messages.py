"""Every wire message, as a frozen dataclass.

Rules of this file:
- One class per message, registered under a short, stable type tag (`TAG`) and a schema version
  (`VERSION`). Renaming a field is a schema change: bump `VERSION` and teach the codec the old one.
- Field annotations are the schema the codec enforces. Allowed: `int`, `float`, `str`, `bytes`,
  `bool`, `X | None`, `tuple[T, ...]` and `dict[str, T]` of those.
- Bulk bytes (tensor data, checkpoint chunks) go in a field marked `frames=True`: they travel as their
  own ZeroMQ frames next to the msgpack header and are never copied into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "MESSAGE_TYPES",
    "AuditResult",
    "Batch",
    "BulkAck",
    "BulkChunk",
    "Evidence",
    "GeminiInventory",
    "Goodbye",
    "Heartbeat",
    "LinkReport",
    "Message",
    "PeerAnnouncement",
    "Progress",
    "ReplayResult",
    "ReplicaRequest",
    "StepTelemetry",
    "Vote",
    "frames_field",
    "register",
]

Buffer = bytes | memoryview


def frames_field() -> Any:
    """Declare a field whose items travel as separate frames (zero-copy)."""
    return field(default=(), metadata={"frames": True})


@dataclass(frozen=True)
class Message:
    """Base class: subclasses set `TAG` and `VERSION` and are registered with `register`."""

    TAG: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1


MESSAGE_TYPES: dict[str, type[Message]] = {}


def register(cls: type[Message]) -> type[Message]:
    if not cls.TAG or cls.TAG in MESSAGE_TYPES:
        raise ValueError(f"message tag {cls.TAG!r} of {cls.__name__} is empty or taken")
    MESSAGE_TYPES[cls.TAG] = cls
    return cls


@register
@dataclass(frozen=True)
class PeerAnnouncement(Message):
    """Where a rank's runtime listens. Written to the job store and sent to peers on (re)join."""

    TAG: ClassVar[str] = "peer"
    rank: int
    incarnation: int
    node_id: str
    pid: int
    pub: tuple[str, ...]
    router: tuple[str, ...]
    replica_group: tuple[int, ...] = ()
    dims: dict[str, tuple[int, ...]] = field(default_factory=dict)
    peer_group: tuple[int, ...] = ()  # ranks doing the same work each step (empty: the replica group)
    settings: dict[str, str] = field(default_factory=dict)  # what every rank must agree on (config drift)
    # Boot id and pid namespace: a peer with the same one can see this rank's pid end ("" unknown).
    host: str = ""


@register
@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness and progress of one rank, published every heartbeat interval."""

    TAG: ClassVar[str] = "hb"
    rank: int
    incarnation: int
    step: int
    progress: int


@register
@dataclass(frozen=True)
class Goodbye(Message):
    """A rank leaving on purpose (close()); peers mark it left at once instead of waiting for silence."""

    TAG: ClassVar[str] = "bye"
    rank: int
    incarnation: int
    reason: str = ""


@register
@dataclass(frozen=True)
class StepTelemetry(Message):
    """What one rank measured over one optimizer step. Durations in seconds."""

    TAG: ClassVar[str] = "step"
    rank: int
    step: int
    step_s: float
    input_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    optimizer_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@register
@dataclass(frozen=True)
class BulkChunk(Message):
    """One chunk of a bulk transfer; the bytes travel in `buffers`."""

    TAG: ClassVar[str] = "bulk"
    rank: int
    transfer_id: str
    index: int
    count: int
    total_bytes: int
    meta: dict[str, str] = field(default_factory=dict)
    buffers: tuple[Buffer, ...] = frames_field()


@register
@dataclass(frozen=True)
class BulkAck(Message):
    """Receipt of one bulk chunk (or of a whole transfer when `index == -1`)."""

    TAG: ClassVar[str] = "ack"
    rank: int
    transfer_id: str
    index: int
    ok: bool
    reason: str = ""


@register
@dataclass(frozen=True)
class ReplicaRequest(Message):
    """Ask a holder to send the replica of `owner`'s state at `step` (a replaced rank restoring)."""

    TAG: ClassVar[str] = "rreq"
    rank: int
    owner: int
    step: int
    transfer_id: str


@register
@dataclass(frozen=True)
class GeminiInventory(Message):
    """Which captured steps a rank holds: its own in memory and on disk, and replicas of others."""

    TAG: ClassVar[str] = "ginv"
    rank: int
    local: tuple[int, ...]
    replicas: dict[str, tuple[int, ...]]
    disk: tuple[int, ...] = ()
    certified: tuple[int, ...] = ()  # the steps of `local` and `disk` SCOUT certified (for the rank's group)


@register
@dataclass(frozen=True)
class Evidence(Message):
    """SCOUT fingerprints of one step: gradients after reduction, parameters after the step, and the
    optimizer's state after the step (empty where replicas do not hold the same optimizer state: a
    ZeroRedundancyOptimizer's partition, or no optimizer)."""

    TAG: ClassVar[str] = "evid"
    rank: int
    step: int
    grads: bytes
    params: bytes
    optim: bytes = b""
    # Which state tensors (parameter, key, shape, dtype) the optimizer holds: replicas whose layouts
    # differ shard it (a ZeRO-like optimizer of the script's own), and their states are not compared.
    optim_layout: bytes = b""
    # Per state (gradients, parameters, optimizer state), this rank's tensors that held at this step
    # what they held at the step before, both checked: (how many, XXH3-64 of their indices), -1 when
    # unknown. Stale state in some tensors only (one gradient reused) shows as more of them.
    reused: tuple[tuple[int, bytes], ...] = ()
    # XXH3-64 of the optimizer's settings (each group's hyperparameters: learning rate, betas, ...):
    # replicas step with the same ones unless the script sets them per rank.
    settings: bytes = b""
    # Per state, as `reused`: this rank's tensors that hold only zeros at this step. A gradient
    # dropped (a bucket skipped, zeroed) shows as more of them than its replicas hold.
    zeroed: tuple[tuple[int, bytes], ...] = ()
    # The torch settings its numerics depend on as the step left them (as `Progress.settings`):
    # compared at the same step on every replica, a drift is told at once (no flip in progress).
    numerics: str = ""
    # Collectives this rank had entered when its step ended (-1 unknown). Replicas run the same
    # program: one that entered more at the same step ran a step's collectives without its optimizer
    # step (it skipped one: behind its replicas), which no corruption does.
    collectives: int = -1


@register
@dataclass(frozen=True)
class Progress(Message):
    """Out-of-band progress of a rank's training thread, published by its runtime thread."""

    TAG: ClassVar[str] = "prog"
    rank: int
    step: int
    collectives: int
    in_collective_s: float
    idle_s: float
    chain: bytes = b""  # hash chain over every collective entered (op, size, dtype, group)
    phase: str = ""  # "input" / "input_start" (data loader), "checkpoint_io", "evaluation", "stopping", ""
    in_phase_s: float = 0.0
    # (collectives entered, chain) before the current ones, newest last: peers sampled a collective
    # or two apart still share a count to compare chains at.
    recent: tuple[tuple[int, bytes], ...] = ()
    # the torch settings its numerics depend on, their values joined by "," (adapters.base.numerics_settings)
    settings: str = ""
    # how long its process (the library's threads aside) has used no CPU while its training thread
    # sat idle in no collective and no phase (0 otherwise): hung, not at work (waiting_peers_verdict)
    quiet_s: float = 0.0


@register
@dataclass(frozen=True)
class Vote(Message):
    """A rank's vote for a SCOUT verdict; the group acts once a majority voted for the same key."""

    TAG: ClassVar[str] = "vote"
    rank: int
    key: str
    kind: str
    ranks: tuple[int, ...]
    step: int
    reason: str
    detail: str = ""
    straggler_type: str | None = None
    confirmations: int | None = None
    stall_duration_s: float | None = None
    endpoint: str = ""


@register
@dataclass(frozen=True)
class ReplayResult(Message):
    """A replica's replay of a step its group disagreed on (SCOUT, ambiguous SDC)."""

    TAG: ClassVar[str] = "rply"
    rank: int
    step: int
    what: str  # "grads" | "params" | "optim"
    replayed: bytes  # fingerprint of the recomputed value; empty when this rank could not replay
    recorded: bytes  # fingerprint of the value this rank held at the step
    note: str = ""
    drifted: int = (
        -1
    )  # parameters changed outside the optimizer since the last checked step: 1, 0, -1 unknown


@register
@dataclass(frozen=True)
class LinkReport(Message):
    """How long this rank's link probes to peers on other nodes took (seconds, by target rank)."""

    TAG: ClassVar[str] = "link"
    rank: int
    round: int
    seconds: dict[str, float]


@register
@dataclass(frozen=True)
class AuditResult(Message):
    """An auditor found that the rank it audited computed something its inputs do not give (SCOUT)."""

    TAG: ClassVar[str] = "audt"
    rank: int  # the auditor
    step: int
    audited: int
    finding: str  # "output" | "grads" (core.scout.audit.AUDIT_FINDINGS)
    detail: str = ""


@register
@dataclass(frozen=True)
class Batch(Message):
    """Several gossip messages of one sender sealed and sent as one: the encoded header frame of
    each (messages without buffers only; never a batch inside a batch)."""

    TAG: ClassVar[str] = "bat"
    rank: int
    items: tuple[bytes, ...]
