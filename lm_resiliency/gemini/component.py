"""GEMINI, the session component: capture into shared memory, replicate to a peer node, recover.

Training thread: every `interval` steps, `on_step` flattens the state and copies its bytes into the
free one of two shared-memory slots (the only cost training pays). A worker thread then checksums the
slot, commits it, and replicates it to the holder chosen by `core.gemini.placement` through the
runtime's authenticated bulk transfers; the holder writes it into its own shared memory.

At startup `recover()` scans local slots and held replicas (verifying every checksum), exchanges the
inventory through the job store, runs `core.gemini.recovery.plan_recovery` (the same on every rank),
and restores the chosen step bitwise from local memory or by pulling the replica from its holder.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from lm_resiliency._proc import pid_alive
from lm_resiliency.adapters.amp import load_scaler_state, mark_ours, scaler_values
from lm_resiliency.adapters.base import collector_paused
from lm_resiliency.adapters.chain import members_of
from lm_resiliency.config import InMemoryCkptConfig, SCOUTFaultReport
from lm_resiliency.core.auth import frame_digest
from lm_resiliency.core.gemini.placement import replica_holders
from lm_resiliency.core.gemini.recovery import RecoveryPlan, plan_recovery, verified_steps
from lm_resiliency.core.membership import EventKind, MembershipEvent
from lm_resiliency.core.messages import GeminiInventory, ReplicaRequest
from lm_resiliency.core.taxonomy import VERIFIED_KINDS, kind_of
from lm_resiliency.core.topology import Topology
from lm_resiliency.errors import CheckpointMismatchError, DiscoveryError, SharedMemoryError
from lm_resiliency.gemini.copier import Completion, Copier, SyncCopier, copier_for
from lm_resiliency.gemini.durable import DurableError, DurableStore, path_name
from lm_resiliency.gemini.hygiene import owner_pid, reclaim_stale_runs, write_owner
from lm_resiliency.gemini.iterators import IteratorWatch
from lm_resiliency.gemini.loopwatch import LoopWatch
from lm_resiliency.gemini.state import (
    TensorSpec,
    aligned,
    apply_state,
    collect_state,
    decode_payload,
    flatten,
    loader_positions,
    materialize,
    rng_state,
)
from lm_resiliency.runtime.shm import (
    HEADER_SIZE,
    CorruptSlot,
    NotACopy,
    SlotFile,
    SlotHeader,
    chunk_digests,
    n_chunks,
    verify_image,
)
from lm_resiliency.runtime.transport import PeerLeft

__all__ = ["Gemini", "GeminiStats"]

log = logging.getLogger(__name__)
CAPTURE_WAIT_S = 2.0  # the longest a capture waits for a free slot before it is skipped
# A replica's transfer pins its slot until the holder acknowledges it. Its deadline: 120 s while no
# transfer has completed (the first may be a large state over a slow link), then 8x the last
# completed one's time (at least 10 s). After one that failed (a holder unreachable, or one that
# declared this rank dead and no longer answers it), replicas pause for a back-off (5 s, doubling
# to 60 s) while local captures go on; before, every capture for 120 s waited CAPTURE_WAIT_S for a
# slot and was skipped: the job crawled at 2 s a step and this rank's newest copy fell behind its
# peers' until no step was held by every rank. A capture that waited CAPTURE_WAIT_S for the slot a
# replica pins gives that replica up (see Gemini.capture): the deadline bounds the wait only when no
# capture needs the slot.
# Between durable copies, the durable folder is probed with a byte this often (on the commit after it):
# a disk that turns read-only or full is reported within seconds, not at the next copy.
DISK_PROBE_S = 0.5
REPLICA_TIMEOUT_S = 120.0
REPLICA_MIN_TIMEOUT_S = 10.0
REPLICA_BACKOFF_S = (5.0, 60.0)
# The longest a capture waits for SCOUT's verdict on the previous one (see Gemini._judging). Verdicts
# come within milliseconds; one that has not come by then is late for a reason (evidence lost while
# a restarted job's connections form, a peer gone) and training should not wait for it.
VERDICT_WAIT_S = 0.5
# Under pressure (a full shared-memory folder), copies of other runs that no live process owns are
# reclaimed once unchanged this long, not the hour `claim` waits (see Gemini._map).
PRESSURE_IDLE_S = 60.0
# An inventory goes to peers when it changes (each commit, each replica received), as gossip that a
# dropped message, a partition or a peer that connected late loses for good: a job that then stops
# capturing (it ended, it waits on a stalled peer, its interval is long) left peers planning a
# restart from a step this rank has long moved past, or from copies it no longer holds. So while
# none went out for this many heartbeat intervals, the worker hands the current one on again, and
# again after twice as long each time, up to REANNOUNCE_MAX_S: an idle rank of a large job adds one
# message a minute to each peer's load, not one every two seconds.
REANNOUNCE_HEARTBEATS = 4
REANNOUNCE_MAX_S = 60.0
Exchange = Callable[[str, bytes, float], dict[int, bytes]]


def _typed(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`part` (bytes of a slot) as a tensor of `like`'s dtype and shape, which the copy fills as it
    is; the bytes themselves where the dtype has no such view (the copy then takes `like`'s bytes)."""
    try:
        return part.view(like.dtype).view(like.shape)
    except RuntimeError:
        return part


def _observed(base: type, take: Callable[[str], None], name: str) -> type:
    """A subclass of `base` (a scheduler's class, an engine's) whose step() calls `take(name)` after it."""

    def step(this: Any, *args: Any, **kwargs: Any) -> Any:
        result = super(observed, this).step(*args, **kwargs)  # type: ignore[arg-type]
        take(name)
        return result

    observed = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})
    return observed


def _evaluating(module: Any) -> bool:
    """No training runs: gradients are off, or the module is in eval mode."""
    return not torch.is_grad_enabled() or not getattr(module, "training", True)


class ReplicaAbandoned(Exception):
    """A replica given up before its deadline: a capture needed its slot."""


@dataclass
class _Stream:
    """A replica being written into a slot chunk by chunk as it arrives."""

    owner: int
    step: int
    size: int
    chunk_size: int
    count: int
    keeps: int = -1
    header: bytes | None = None
    slot: SlotFile | None = None
    k: int = 0
    bad: str = ""


@dataclass
class GeminiStats:
    captures: int = 0
    skipped_busy: int = 0
    verdict_waits: int = 0  # captures that waited for SCOUT's verdict on the previous one
    verdict_wait_s: float = 0.0  # the training thread's time in those waits, in all
    replicated: int = 0
    replication_failures: int = 0
    replicas_received: int = 0
    replicas_rejected: int = 0
    rejected_copies: list[str] = field(default_factory=list)
    capture_block_s_last: float = 0.0
    bytes_per_capture: int = 0
    capture_failures: int = 0
    commit_s_last: float = 0.0  # checksumming + committing the last capture (worker thread)
    replication_s_last: float = 0.0  # sending the last capture to its holder, until acknowledged
    replication_paused: int = 0  # captures not replicated during a back-off after a failed replica
    disk_writes: int = 0
    disk_errors: int = 0
    last_disk_error: str = ""
    scrubbed: int = 0  # held copies verified again in the background (verify_integrity)
    scrub_failures: int = 0  # of those, copies found damaged (dropped and reported)


class Gemini:
    name = "gemini"

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        node_id: str,
        run_id: str,
        topology: Topology,
        runtime: Any,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        extra_state_fn: Callable[[], Any] | None,
        load_extra_state_fn: Callable[[Any], None] | None,
        config: InMemoryCkptConfig,
        scaler: Any = None,
        interval: int,
        shm_dir: str,
        on_fault: Callable[[dict[str, Any]], None] | None = None,
        copier: Copier | None = None,
        load_fallback: Callable[[int | None], Any] | None = None,
        disk_folder: str | None = None,
        disk_interval: int | None = None,
        keep_last: int = 2,
        step_ends: Sequence[Any] = (),
    ) -> None:
        self.rank, self.world_size = rank, world_size
        # Objects besides the scheduler whose step() ends a step after the optimizer's (a DeepSpeed
        # engine, which bumps its counters after its optimizer and scheduler stepped).
        self._step_ends = list(step_ends)
        self.run_id = run_id
        self.topology = topology
        self.runtime = runtime
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler  # a torch.amp.GradScaler (see adapters.amp)
        # A restored loss-scaler state with no scaler to take it yet (one made after enable_resiliency,
        # adopted at the first forward: see adopt_scaler).
        self._restored_scaler: dict[str, Any] | None = None
        # The global torch RNG state each instrumented loader's iterator was made at (the session's
        # snapshot): captured with every step; restored ones wait for that loader's next iter()
        # (the session's proxy makes it at that state).
        self.loaders_fn: Callable[[], dict[str, Any]] | None = None
        self.restored_loaders: dict[str, torch.Tensor] = {}
        # DataLoader iterators the loop makes (not through an instrumented loader): the RNG state
        # each was made at goes with a capture, and a resumed loop's makes them again at it.
        self.iterators = IteratorWatch()
        self.iterators.on_fetch = self._on_loader_fetch
        self.iterators.install()
        self.extra_state_fn, self.load_extra_state_fn = extra_state_fn, load_extra_state_fn
        self.config = config
        self.interval = config.interval or interval
        self.chunk = config.replication_chunk_size
        self._on_fault = on_fault
        self.load_fallback = load_fallback
        self.certifier: Callable[[int], bool] | None = None  # set by the session when SCOUT runs
        # SCOUT will judge this step soon (its fingerprints are due, no SDC is open): set with it.
        self.awaiting: Callable[[int], bool] | None = None
        # False once SCOUT certifies no more steps (replicas that the script made differ): the
        # newest capture is kept again, as without SCOUT, not the last certified one for ever.
        self.certifying: Callable[[], bool] | None = None
        # Called with the step right before each capture from the training loop (SCOUT's evidence
        # of a step whose capture waited for the next step to begin, see will_defer).
        self.before_capture: Callable[[int], None] | None = None
        self._committed_at: dict[int, float] = {}  # own slot index -> when its capture committed
        # Called with every new inventory (worker/receiver threads): the torchrun backend's feed.
        self.on_inventory: Callable[[GeminiInventory], None] | None = None
        self.flush_inventory: Callable[[float], bool] | None = None  # waits until on_inventory's sends left
        self._copier = copier
        self._pinned: dict[int, Any] = {}  # slot index -> mapping registered with the copier
        # Own slot index -> (mapping, payload offset, tensor layout, views of the slot typed and
        # shaped like the tensors a capture copies there): the same from one capture to the next
        # (see _slot_views).
        self._views: dict[int, tuple[Any, int, bytes, list[torch.Tensor | None]]] = {}
        self._fence: Completion | None = None
        self.dir = Path(shm_dir) / path_name(run_id) / path_name(node_id)
        self.holder = replica_holders(topology, config.replication_jump).get(rank)
        # The replica groups (SCOUT certifies each group's steps apart): with more than one, the
        # capture kept for a recovery-verified restart is one every group certified (_certified).
        self._groups = sorted({topology.replica_group_of(r.rank) for r in topology.ranks})
        self._own_group = topology.replica_group_of(rank)
        self.shape = topology.shape_digest()
        self.stats = GeminiStats()
        self._replica_backoff = 0.0  # seconds replicas pause after a failed one (0: none failed)
        self._replicate_after = float("-inf")  # monotonic time the pause ends
        self._holder_back_at = float("-inf")  # monotonic time the holder was last heard again
        self.disk_interval = disk_interval or config.disk_flush_interval
        self.durable = DurableStore(
            disk_folder or config.disk_folder, run_id, rank, keep_last, self._disk_due
        )
        self._on_disk: set[int] = set()
        # The durable folder is probed with a byte every DISK_PROBE_S between its copies; a failure
        # is reported when the last probe or write went well (not every few seconds while it lasts).
        self._probe_after = time.monotonic() + DISK_PROBE_S
        self._disk_failing = False
        # Reentrant: the SIGTERM handler runs on the training thread, possibly inside capture().
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._own = self._own_slots()
        self._own_step: dict[int, int] = {}  # slot index -> committed step
        # Steps whose own slot carried a SCOUT certificate when this worker started (a restart).
        self.carried_certificates: set[int] = set()
        # Copies of this run that the scan found taken with another topology: (step, world size).
        self._elsewhere: set[tuple[int, int]] = set()
        self.restored_verified = False  # recover() chose among certified steps, as noted before
        self.noted_kind: str | None = None  # the failure kind the previous generation noted
        self._plan_verified = False  # the restore was asked for (or noted) at recovery_verified
        self._busy: set[int] = set()
        self._released = False  # close() unmapped the slots
        self._flushing: set[int] = set()  # slots flush_for_restart is writing to disk (not to overwrite)
        self._announced: dict[int, int] = {}  # slot -> the step committed there and announced
        self._in_flight: dict[int, int] = {}  # busy slot -> the step being committed into it
        self._replica_slots: dict[int, list[SlotFile]] = {}
        self._replica_step: dict[int, dict[int, int]] = {}  # owner -> slot -> step
        # verify_integrity: slot path -> times a writer took the slot (a scrub that fails while a
        # capture or a received replica overwrites the slot found no damage).
        self._rewrites: dict[Path, int] = {}
        self._scrubbing = False  # the worker is verifying held copies again (drain waits for it)
        self._scrub_hold: int | None = None  # the own slot being verified again (not to overwrite)
        self._restore_waiters: dict[str, threading.Event] = {}
        # (slot, header, copy completion, step of the other own slot this capture left in place)
        self._jobs: queue.Queue[tuple[int, SlotHeader, Completion, int] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"lm-resiliency-gemini{rank}", daemon=True)
        # Checksums of a large capture on several cores (xxhash releases the GIL), so committing keeps
        # up with a capture every step; none on small machines, where the cores train.
        n_hash = min(8, (os.cpu_count() or 1) // 4)
        self._hash_pool = (
            ThreadPoolExecutor(n_hash, thread_name_prefix=f"lm-resiliency-hash{rank}") if n_hash > 1 else None
        )
        # Verifying copies before a restore: training has not started, so this node's cores are
        # shared only by its ranks, which all verify at the same time.
        n_verify = min(8, (os.cpu_count() or 1) // max(1, len(topology.ranks_on(topology.node_of(rank)))))
        self._verify_pool = (
            ThreadPoolExecutor(n_verify, thread_name_prefix=f"lm-resiliency-verify{rank}")
            if n_verify > 1
            else None
        )
        self._closed = False
        self._pending: int | None = None  # a step whose capture waits for the calls in _due (on_step)
        self._due: set[str] = set()
        self._scaler_trails = True  # scaler.update() follows each step (see _step_begins)
        # The scheduler does not step every iteration (learned in _step_begins); then a capture that
        # waits for it keeps what the loop's code changes as the next step begins -- the random
        # numbers and the caller's state -- as they were when the optimizer stepped (_step_end).
        self._scheduler_skips = False
        self._step_end: dict[str, Any] | None = None  # set and taken with _pending
        self._deferred: int | None = None  # a step whose capture waits for the next to begin (_boundary)
        # A loop that reads no DataLoader ends its step at its back edge (see LoopWatch); should
        # something else come first (the next forward, an optimizer step, a flush), the capture
        # keeps the random numbers and loader positions of the step's end (_deferred_end).
        self._loop = LoopWatch()
        self._deferred_end: dict[str, Any] | None = None
        self._after_capture: list[Callable[[], None]] = []  # see after_capture
        self._waiting: int | None = None  # a step whose capture waits for a verdict (see capture)
        # (thread, slot) of a capture between taking its slot and handing it to the worker: a
        # signal handler that runs on that thread meanwhile must not wait for it (see flush_for_restart)
        self._copying: tuple[int, int] | None = None
        # What wakes the worker's wait for a replica's acknowledgement (the acknowledgement, or a
        # capture that needs the replica's slot: see capture); None while it waits for none
        self._replica_wake: threading.Event | None = None
        self._fetched = False  # an instrumented loader was read during the current step
        self._fetching = 0  # steps in a row that read one (the loop reads it every step: >= 2)
        self._fetching_step = -1  # the step `_fetching` counts up to (see _count_fetches)
        self._training_thread = threading.get_ident()
        self._hooks: list[Any] = []
        self._install_boundary_hooks()
        runtime.add_transfer_listener(self._on_transfer)
        runtime.add_chunk_sink(self._on_chunk)
        self._streams: dict[tuple[int, str], _Stream] = {}  # replicas being written as they arrive
        # Slots `scan()` verified: (header, digest table) of the commit it checked, by path.
        self._verified: dict[Path, tuple[SlotHeader, list[bytes]]] = {}
        runtime.add_handler("rreq", self._on_replica_request)
        runtime.add_handler("ginv", self._on_inventory)
        runtime.add_membership_listener(self._on_membership)
        self._inventories: dict[int, GeminiInventory] = {}
        self._inventory_seq = 0  # inventories computed to announce (see _announce)
        self._announced_at = time.monotonic()  # when one last went to peers (see _reannounce)
        self._reannounce_after = 0.0  # how long after that it goes again (0: the first gap)
        self._worker.start()
        self._rx: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._rx_thread = threading.Thread(
            target=self._receive_writes, name=f"lm-resiliency-gemini-rx{rank}", daemon=True
        )
        self._rx_thread.start()

    # -- recovery (training thread, inside enable_resiliency) -------------------------------------
    def scan(self) -> dict[str, Any]:
        """Verify every copy on this node; return the inventory to share."""
        local: list[int] = []
        for k, slot in enumerate(self._own):
            h = self._check(slot.path, owner=self.rank)
            if h is not None:
                self._own_step[k] = h.step
                local.append(h.step)
        replicas: dict[int, list[int]] = {}
        for path in sorted(self.dir.glob(f"replica-r*-h{self.rank}-s*")) if self.dir.exists() else []:
            m = re.fullmatch(rf"replica-r(\d+)-h{self.rank}-s([01])", path.name)
            if not m:
                continue
            owner, k = int(m.group(1)), int(m.group(2))
            h = self._check(path, owner=owner)
            if h is not None:
                self._replica_step.setdefault(owner, {})[k] = h.step
                replicas.setdefault(owner, []).append(h.step)
        disk = self._scan_disk()
        return {
            "local": sorted(set(local)),
            "replicas": {str(o): sorted(set(s)) for o, s in replicas.items()},
            "disk": disk,
            # (a copy on disk SCOUT certified counts, for a relaunch whose node memory is gone)
            "certified": sorted(self.carried_certificates | (self.durable.certified() & set(disk))),
            "mode": self.noted_restart_mode() or "",
            "kind": self.noted_failure_kind() or "",
            "elsewhere": sorted(self._elsewhere),
        }

    def _scan_disk(self) -> list[int]:
        """The steps of this rank's state on the durable tier that a restore may choose: files of
        this run, rank and topology whose header and checksum table are intact (their chunks are
        verified when one is loaded). Held from now on in the inventory, as written ones are."""
        steps = []
        for step in self.durable.steps():
            try:
                h = self.durable.header(step)
            except DurableError as exc:
                self._reject(CorruptSlot(str(exc)), self.rank, step)
                continue
            if h.owner != self.rank or h.step != step or h.run_id != self.run_id[:64]:
                self._reject(NotACopy(f"{self.durable.path(step)}: holds rank {h.owner} step {h.step}"))
            else:
                try:
                    self._same_topology(h, self.durable.path(step))
                except NotACopy as exc:
                    self._reject(exc)
                    continue
                steps.append(step)
        self._on_disk |= set(steps)
        return steps

    def _check(self, path: Path, owner: int) -> SlotHeader | None:
        if not path.exists():
            return None
        try:
            slot = SlotFile.open_existing(path)
        except CorruptSlot as exc:
            self._reject(exc)
            return None
        h = None
        try:
            h = slot.read_header()
            if h.run_id != self.run_id[:64] or h.owner != owner:
                raise NotACopy(f"{path.name}: belongs to another run (run {h.run_id!r}, rank {h.owner})")
            self._same_topology(h, path)
            slot.verify(h, self._verify_pool)
            self._verified[path] = (h, slot.digest_table(h))
            if owner == self.rank and slot.certified(h):
                self.carried_certificates.add(h.step)
            return h
        except CorruptSlot as exc:
            claimed = h or exc.header  # a truncated copy's header still says whose step it was
            self._reject(exc, owner, None if claimed is None else claimed.step)
            return None
        finally:
            slot.close()

    def _same_topology(self, h: Any, path: Path) -> None:
        """Raise NotACopy for a copy of this run taken with another topology (noted for the plan's
        reason: an elastic job that shrank or grew finds its copies and cannot use them)."""
        if h.world_size == self.world_size and h.topology == self.shape:
            return
        self._elsewhere.add((h.step, h.world_size))
        raise NotACopy(
            f"{path.name}: step {h.step} taken with another topology (world size {h.world_size}, "
            f"topology {h.topology}; this job: {self.world_size}, {self.shape})"
        )

    def _reject(self, exc: CorruptSlot, owner: int | None = None, step: int | None = None) -> None:
        why = str(exc)
        self.stats.rejected_copies.append(why)
        if isinstance(exc, NotACopy):
            # Not damage: a kill during a capture, a slot never used, another run's leftover.
            # Reporting it named every rank of a restarted job as holding a corrupt checkpoint.
            log.info("rank %d: checkpoint slot holds no copy: %s", self.rank, why)
            return
        log.warning("rank %d: checkpoint copy skipped: %s", self.rank, why)
        known: dict[str, Any] = {"owner": owner} if owner is not None else {}
        if step is not None:  # the header held: whose copy of which step failed its checksums
            known["steps"] = [step]
        self._fault("checkpoint_corruption", "checkpoint_copy_invalid", why, **known)

    def _fault(self, kind: str, reason: str, detail: str, **extra: Any) -> None:
        if self._on_fault is not None:
            report = SCOUTFaultReport(kind, (self.rank,), "rank", ("gemini",), reason=reason).to_dict()
            self._on_fault({**report, "detail": detail, **extra})

    def recover(
        self,
        exchange: Exchange,
        exact_step: int | None,
        timeout: float = 120.0,
        verified_only: bool | None = False,
    ) -> tuple[int, str]:
        """Agree with every rank on a step and restore it. Returns (step, reason); step -1: fresh start.

        `verified_only` (no `exact_step`): only a step SCOUT certified. Every rank reaches the same
        certificates from the same evidence, so one any rank's own slot carries holds for the job
        (a rank whose memory was lost carries none). None: as the previous generation noted (an SDC
        it found, or its `prepare_recovery`), on any rank. The note is consumed once the restore is
        done (a rank that dies restoring keeps it for the next try)."""
        out = self._recover(exchange, exact_step, timeout, verified_only)
        self._forget_note()
        return out

    def _recover(
        self, exchange: Exchange, exact_step: int | None, timeout: float, verified_only: bool | None
    ) -> tuple[int, str]:
        # Copies a rank could not load when a plan chose them (a durable file whose chunks fail their
        # checksums: a scan reads only its header; a peer that did not send): (rank, tier, holder,
        # step). Every rank fetches and verifies its copy before any loads one, and the ranks agree
        # on the outcome: a copy that fails is left out and the ranks plan again (another tier of
        # the same step, an older step, the caller's fallback or a fresh start, the same on every
        # rank). Before, the rank raised: every restart chose the same copy until the run gave up.
        failed: set[tuple[int, str, int, int]] = set()
        for attempt in range(self.world_size + 3):  # each attempt rules out a copy of one rank at least
            plan = self._plan(exchange, exact_step, timeout, verified_only, failed, attempt)
            if plan.step < 0:
                return self._nothing_loadable(plan, exchange, exact_step, timeout)
            src = plan.sources[self.rank]
            k, why = self._fetch(src, plan.step, timeout)
            said = exchange(f"gemini/fetched/{attempt}", why.encode(), timeout)
            bad = {r: v.decode(errors="replace") for r, v in said.items() if v}
            if not bad:
                break
            for r, w in sorted(bad.items()):
                theirs = plan.sources[r]
                failed.add((r, theirs.tier, theirs.holder, plan.step))
                if self.rank == 0:
                    log.warning(
                        "GEMINI: rank %d could not load its %s copy of step %d (%s): planning without it",
                        r,
                        theirs.tier,
                        plan.step,
                        w,
                    )
        else:
            raise CheckpointMismatchError(
                f"rank {self.rank}: no restore plan held after {attempt + 1} attempts"
            )
        try:
            self._restore_from(self._own[k], plan.step)
        except CheckpointMismatchError as exc:
            raise CheckpointMismatchError(
                f"rank {self.rank}: the {src.tier} copy of step {plan.step} (run id {self.run_id!r}) does "
                f"not fit this model, nothing was loaded: {exc}. A model changed under the same run id? "
                "Give the job a new InMemoryCkptConfig.run_id (or LM_RESILIENCY_RUN_ID), or reclaim the "
                f"old copies (`lm-resiliency shm --clean`, and {self.durable.root})"
            ) from exc
        log.info("rank %d restored step %d from %s copy (%s)", self.rank, plan.step, src.tier, plan.reason)
        self._forget_after(plan.step)
        return plan.step, f"{src.tier}:{plan.reason}"

    def _plan(
        self,
        exchange: Exchange,
        exact_step: int | None,
        timeout: float,
        verified_only: bool | None,
        failed: set[tuple[int, str, int, int]],
        attempt: int,
    ) -> RecoveryPlan:
        """Every rank's inventory (scanned again after a failed attempt: a disk copy read into an
        own slot replaced what it held), less the copies that `failed`: the same plan on every rank."""
        inv = self.scan()
        name = "gemini/inventory" if attempt == 0 else f"gemini/inventory/{attempt}"
        raw = exchange(name, msgpack.packb(inv), timeout)
        local, replicas, disk = {}, {}, {}
        certs: dict[int, set[int]] = {}
        noted: set[str] = set()
        kinds: set[str] = set()
        elsewhere: set[tuple[int, int]] = set()
        for r, blob in raw.items():
            doc = msgpack.unpackb(blob)
            elsewhere |= {(int(st), int(ws)) for st, ws in doc.get("elsewhere", ())}
            local[r] = set(doc["local"])
            replicas[r] = {int(o): set(s) for o, s in doc["replicas"].items()}
            disk[r] = set(doc.get("disk", ()))
            certs[r] = {int(x) for x in doc.get("certified", ())}
            noted.add(str(doc.get("mode", "")))
            kinds.add(str(doc.get("kind", "")))
        for r, tier, holder, st in failed:
            if tier == "local":
                local.get(r, set()).discard(st)
            elif tier == "disk":
                disk.get(r, set()).discard(st)
            else:
                replicas.get(holder, {}).get(r, set()).discard(st)
        exact = exact_step if exact_step is not None and exact_step > 0 else None
        # Each replica group certifies its own ranks' state: a step is verified when every group
        # certified it (another group's certificate does not vouch for a corrupted one's copy).
        groups = {r: self.topology.replica_group_of(r) for r in certs if 0 <= r < self.world_size}
        certified = verified_steps(certs, groups)
        if attempt == 0:  # (the notes are consumed by the restore: the first inventories hold them)
            if verified_only is None:
                verified_only = "recovery_verified" in noted
            # Every rank reads the same notes: the same kind, one that may have corrupted state first.
            known = sorted(
                (k for k in kinds if kind_of(k) is not None), key=lambda k: (k not in VERIFIED_KINDS, k)
            )
            self.noted_kind = known[0] if known else None
            self._plan_verified = bool(verified_only)
            self.restored_verified = self._plan_verified and exact is None
        at_most = None
        if exact is not None and failed:
            # The step the restart asked for cannot be loaded by every rank: an older one, at the
            # trust level the request had (verified_only: it was chosen among certified steps).
            at_most, self.restored_verified = exact, self._plan_verified
            exact = None
        allowed = {exact} if exact is not None else certified if self.restored_verified else None
        plan: RecoveryPlan = plan_recovery(self.world_size, local, replicas, disk, at_most, allowed)
        if plan.step < 0 and exact is not None:
            # The step the restart asked for is not held for every rank here (a copy gone since
            # the plan was made): the newest older one at the plan's trust level, not a fresh start.
            self.restored_verified = self._plan_verified
            older = plan_recovery(
                self.world_size, local, replicas, disk, exact, certified if self._plan_verified else None
            )
            if older.step >= 0:
                if self.rank == 0:
                    log.warning(
                        "GEMINI: the restart asked for step %d, which not every rank holds (%s): "
                        "restoring step %d",
                        exact,
                        plan.reason,
                        older.step,
                    )
                plan = older
        if plan.step < 0 and self.restored_verified:
            plan = RecoveryPlan(-1, {}, f"no recovery-verified step: {plan.reason}")
        if plan.step < 0 and elsewhere:
            worlds = sorted({ws for _, ws in elsewhere})
            plan = RecoveryPlan(
                -1,
                {},
                f"{plan.reason}; copies of steps {sorted({st for st, _ in elsewhere})} taken with "
                f"another topology (world size {', '.join(map(str, worlds))}; this job: "
                f"{self.world_size}) are not used: a copy restores into the topology that took it",
            )
            if self.rank == 0:
                log.warning("GEMINI: nothing this topology can restore: %s", plan.reason)
        if plan.step < 0 and failed:
            left_out = ", ".join(f"rank {r} {t} step {st}" for r, t, _, st in sorted(failed))
            plan = RecoveryPlan(-1, {}, f"{plan.reason} (copies that failed to load: {left_out})")
        return plan

    def _fetch(self, src: Any, step: int, timeout: float) -> tuple[int, str]:
        """Bring this rank's copy of `step` from `src` into an own slot and verify it, loading
        nothing yet: (slot, "") or (-1, why it failed)."""
        try:
            if src.tier == "local":
                k = next(k for k, s in self._own_step.items() if s == step)
            elif src.tier == "peer":
                k = self._pull_from_peer(src.holder, step, timeout)
            else:
                k = self._load_from_disk(step)
            slot = self._own[k]
            fresh, close = self._reader_for(slot)
            try:
                self._checked(fresh, slot, step)
            finally:
                if close:
                    fresh.close()
            return k, ""
        except CorruptSlot as exc:
            where = (
                f"{src.tier} copy ({self.durable.path(step)})" if src.tier == "disk" else f"{src.tier} copy"
            )
            self._reject(CorruptSlot(f"{where}: {exc}"), self.rank, step)
            return -1, str(exc) or type(exc).__name__
        except (OSError, DiscoveryError) as exc:  # a disk that fails, a holder that did not send
            log.warning("rank %d: cannot fetch its %s copy of step %d: %s", self.rank, src.tier, step, exc)
            self._fault(
                "checkpoint_corruption", "checkpoint_copy_unreadable", str(exc), owner=self.rank, steps=[step]
            )
            return -1, str(exc) or type(exc).__name__

    def _nothing_loadable(
        self, plan: RecoveryPlan, exchange: Exchange, exact_step: int | None, timeout: float
    ) -> tuple[int, str]:
        """No step every rank can load: the caller's `load_fallback`, else a fresh start."""
        got = -1
        if self.load_fallback is not None:
            # The caller's own checkpoint (e.g. DCP on shared storage): it restores and says which step.
            restored = self.load_fallback(exact_step)
            if isinstance(restored, int) and not isinstance(restored, bool) and restored >= 0:
                got = restored
            elif restored is not None and not (type(restored) is int and restored == -1):
                log.error(
                    "rank %d: load_fallback returned %r (%s): expected the step it restored (an int "
                    ">= 0), or -1 or None for none; taken as none, so the run starts fresh",
                    self.rank,
                    restored,
                    type(restored).__name__,
                )
        # Every rank planned the same (the same inventories): all are here. A step the callers'
        # checkpoints restored on some ranks and not others (a rank's file written halfway, a
        # path per rank) would resume them at different steps: their collectives would pair
        # different steps' tensors, or hang.
        steps = {r: int(v) for r, v in exchange("gemini/fallback", str(got).encode(), timeout).items()}
        if len(set(steps.values())) > 1:
            by_step: dict[int, list[int]] = {}
            for r, st in sorted(steps.items()):
                by_step.setdefault(st, []).append(r)
            said = "; ".join(
                f"ranks {rs} step {st}" if st >= 0 else f"ranks {rs} none" for st, rs in by_step.items()
            )
            raise CheckpointMismatchError(
                f"rank {self.rank}: load_fallback restored different steps on different ranks ({said}): "
                "they cannot resume together. Make it restore one step every rank has (the newest "
                "checkpoint every rank wrote completely), or return -1 on every rank to start fresh"
            )
        if got >= 0:
            log.info("rank %d: restored step %d through load_fallback (%s)", self.rank, got, plan.reason)
            return got, f"fallback:{plan.reason}"
        log.info("rank %d: nothing to recover (%s)", self.rank, plan.reason)
        return -1, plan.reason

    def _forget_after(self, step: int) -> None:
        """Every rank restored `step`: this rank's copies of later steps (its own, those it holds
        for peers, on disk) are of a run this job left: the one an SDC corrupted, or steps not every
        rank reached. Dropped, so that no later recovery restores one (a node that loses its memory
        after this restart would otherwise find the corrupted step on disk, newer than the rest)."""
        dropped: list[tuple[int, int]] = []  # (owner, step)
        with self._lock:
            held = [(self.rank, self._own_step), *self._replica_step.items()]
            for owner, steps in held:
                for k, st in list(steps.items()):
                    if st <= step:
                        continue
                    del steps[k]
                    path = self._own[k].path if owner == self.rank else self._replica_path(owner, k)
                    self._uncommit(path)
                    dropped.append((owner, st))
            on_disk = set(self._on_disk)
            with contextlib.suppress(OSError):  # a damaged copy too, which each scan reports again
                on_disk |= set(self.durable.steps(partial=True))
            later = sorted(s for s in on_disk if s > step)
            self._on_disk -= set(later)
        for st in later:
            try:
                self.durable.remove(st)
            except OSError as exc:  # a failing disk: its copy of a left run stays, and is said to
                log.warning("rank %d: cannot remove the durable copy of step %d: %s", self.rank, st, exc)
            dropped.append((self.rank, st))
        if dropped:
            log.info(
                "rank %d: copies of steps after the restored step %d dropped: %s",
                self.rank,
                step,
                ", ".join(f"rank {o} step {st}" for o, st in sorted(set(dropped))),
            )
            self._announce()

    def _pull_from_peer(self, holder: int, step: int, timeout: float) -> int:
        tid = f"restore-r{self.rank}-s{step}"
        done = threading.Event()
        self._restore_waiters[tid] = done
        self.runtime.submit(ReplicaRequest(self.rank, self.rank, step, tid), peer=holder)
        if not done.wait(timeout):
            raise DiscoveryError(f"rank {holder} did not send the replica of rank {self.rank} step {step}")
        return 0

    def _load_from_disk(self, step: int) -> int:
        data = self.durable.read(step)
        if not self._write_file(
            self._own[0], [data[:HEADER_SIZE], data[HEADER_SIZE:]], len(data), self.rank, step
        ):
            raise DurableError(0, f"durable copy of rank {self.rank} step {step} is invalid")
        self._own_step[0] = step
        return 0

    def _reader_for(self, slot: SlotFile) -> tuple[SlotFile, bool]:
        """What a restore reads `slot` through, and whether to close it afterwards.

        The slot's own mapping when this process maps it (it captured or received into it: its pages
        are mapped in). With a GPU model, an unmapped own slot is mapped as a capture maps it and
        page-locked: the copies to the device run at full speed, and the next capture into the slot
        finds it ready. Else a mapping of its own."""
        k = next((k for k, own in enumerate(self._own) if own is slot), None)
        try:
            size = slot.path.stat().st_size
        except OSError as exc:
            raise CorruptSlot(f"{slot.path.name}: cannot open ({exc.strerror})") from exc
        if slot.mapping is None and k is not None and size >= HEADER_SIZE and self._wants_pinning():
            slot.ensure_size(size)
        if slot.mapping is None or size < slot.size:
            # (A file cut shorter than our mapping: reading past its end would raise SIGBUS; a
            # mapping of what is left finds it truncated.)
            return SlotFile.open_existing(slot.path), True
        if k is not None:
            self._pin(k)
        return slot, False

    def _wants_pinning(self) -> bool:
        """Whether captures copy from a GPU into page-locked slots (choosing the copier if not yet)."""
        if not self.config.pin_memory:
            return False
        if self._copier is None:  # before the first capture (a restore): the model's device decides
            chosen = copier_for([*self.model.parameters(), *self.model.buffers()])
            if isinstance(chosen, SyncCopier):
                return False  # (the first capture chooses from all the state it copies)
            self._copier = chosen
        return not isinstance(self._copier, SyncCopier)

    def _pin(self, k: int) -> None:
        """Page-lock own slot `k`'s current mapping for asynchronous copies (`pin_memory`)."""
        slot = self._own[k]
        if not self._wants_pinning() or self._pinned.get(k) is slot.mapping or slot.mapping is None:
            return
        assert self._copier is not None
        self._copier.register_host(slot.mapping, slot.size)
        self._pinned[k] = slot.mapping

    def _checked(self, fresh: SlotFile, slot: SlotFile, step: int) -> SlotHeader:
        """The header of `slot` (read through `fresh`), which must hold `step` and pass its
        checksums; raises CorruptSlot. A commit already verified (by the scan, or by the fetch
        before its restore) is not hashed again: the same header and checksum table."""
        h = fresh.read_header()
        if h.step != step:
            raise CorruptSlot(f"{slot.path.name}: holds step {h.step}, expected {step}")
        table = fresh.digest_table(h)
        if self._verified.get(slot.path) != (h, table):
            fresh.verify(h, self._verify_pool)
            self._verified[slot.path] = (h, table)
        return h

    def _restore_from(self, slot: SlotFile, step: int) -> None:
        fresh, close = self._reader_for(slot)
        try:
            h = self._checked(fresh, slot, step)
            self._verified.pop(slot.path, None)  # loaded: the next capture into it rewrites it
            payload = fresh.payload(h)
            state = decode_payload(payload, h.index_len)
            # One copy out of shared memory, into the live tensors where they exist: fresh memory
            # costs a page fault per 4 KiB, which made a restore slower than the copy itself.
            materialize(state, self.model, self.optimizer)
            apply_state(
                state, self.model, self.optimizer, self.scheduler, self.load_extra_state_fn, self.scaler
            )
            if self.scaler is None and "scaler" in state:  # for one made later (adopt_scaler)
                self._restored_scaler = scaler_values(state["scaler"])
            self.restored_loaders = loader_positions(state.get("loaders"))
            self.iterators.restore(state.get("iterators"))
            del state, payload
        finally:
            if close:
                fresh.close()

    def prepare(self) -> None:
        """Size and map both slots now (startup), so the first captures pay no page faults."""
        state = collect_state(self.model, self.optimizer, self.scheduler, self.extra_state_fn, 0, self.scaler)
        skeleton, _, specs = flatten(state)
        index_len = len(msgpack.packb([skeleton, [[s.dtype, list(s.shape), s.nbytes] for s in specs]]))
        payload = aligned(index_len + 4096) + sum(aligned(s.nbytes) for s in specs)
        size = HEADER_SIZE + payload + n_chunks(payload, self.chunk) * 16
        for k, slot in enumerate(self._own):
            if k not in self._own_step:
                self._map(slot, size)

    # -- capture (training thread) ----------------------------------------------------------------
    # The step boundary is after the optimizer step *and* the calls that follow it and belong to
    # the step: the scheduler's step() and the loss scaler's update(). A capture taken before them
    # would restore a learning rate or a loss scale one step behind. So the capture waits for them
    # (or, for a scheduler that does not step every iteration, for the next forward, before any
    # parameter changes).
    def on_step(self, session: Any, times: Any) -> None:
        step = session.step_count
        self._count_fetches(step)
        if step % self.interval != 0:
            return
        self._due = self._trailers()
        if self._due:
            self._pending = step
            # (A loop that reads an instrumented loader ends the step at its next fetch: no copy.)
            self._step_end = self._volatile_state() if self._scheduler_skips and not self._defers() else None
        else:
            self._boundary(step)

    def _boundary(self, step: int) -> None:
        """The end of `step`: the optimizer (and the scheduler) stepped.

        When the loop reads an instrumented loader every step (an evaluation loader read now and
        then does not count), the capture is taken when the next step begins instead: before its
        fetch (else its forward or optimizer step, else `flush_for_restart()` or `close()`). What
        the loop does after the optimizer step (a counter it bumps, a position it advances, random
        numbers it draws) then belongs to the step, as the loop resumed after it expects, and a
        loader position is still this step's. The next step's own changes come after the capture;
        SCOUT fingerprints this step's parameters right before it (see before_capture), so its
        certificate covers what the loop's code after the step left in them."""
        if self._defers():
            self._deferred = step
        elif self._watches_loop() and self._loop.arm(self._on_loop_edge):
            self._deferred = step
            self._deferred_end = {"rng": rng_state()}
            self._add_iterators(self._deferred_end)
        else:
            self._capture_from_hook(step)

    def _watches_loop(self) -> bool:
        """A loop that reads no DataLoader every step has its step end at its back edge (see
        LoopWatch): on the training thread, while no other tracer runs."""
        return not self._closed and threading.get_ident() == self._training_thread and LoopWatch.available()

    def _on_loop_edge(self) -> None:
        """The loop came back around after the step: what its code did after the step is the
        step's, and nothing of the next step has run (see LoopWatch)."""
        self._deferred_end = None
        self._take_deferred()

    def _trailers(self) -> set[str]:
        """The calls that end a step after the optimizer's: the capture waits for them."""
        names = {name for _, _, name in self._observed_steps}
        return names | ({"scaler"} if self.scaler is not None and self._scaler_trails else set())

    def will_defer(self, step: int) -> bool:
        """Whether the capture of `step`, which has just ended, will be taken later: when the
        scheduler (or the loss scaler) has stepped too, or when the next step begins (see
        _boundary). SCOUT asks as the step ends, before or after our on_step, and then fingerprints
        the state right before the capture: what the loop changes in between (a moment of the
        optimizer written wrongly, a weight it edits) is then judged with what is captured."""
        self._count_fetches(step)
        return step % self.interval == 0 and (
            self._defers() or self._watches_loop() or bool(self._trailers())
        )

    def _count_fetches(self, step: int) -> None:
        """Count `step` (once, whoever asks first) into the steps in a row that read a loader."""
        if step != self._fetching_step:
            self._fetching_step = step
            self._fetching = self._fetching + 1 if self._fetched else 0
            self._fetched = False

    def _defers(self) -> bool:
        """The loop read an instrumented loader in each of the last two steps: it reads it every step."""
        return self._fetching >= 2 and threading.get_ident() == self._training_thread

    def _take_pending(self, name: str) -> None:
        """scheduler.step() or scaler.update() returned: the step has ended when both did."""
        self._due.discard(name)
        if self._due:
            return
        step, self._pending, self._step_end = self._pending, None, None
        if step is not None and not self._closed:
            self._boundary(step)

    def take_deferred(self) -> None:
        """The loop has ended (the session closes): take a capture left for the next step now."""
        self._take_deferred()

    def _take_deferred(self) -> None:
        """The next step begins (or the session flushes or closes): take a capture left for it."""
        if self._deferred is None or threading.get_ident() != self._training_thread:
            return
        step, self._deferred = self._deferred, None
        end, self._deferred_end = self._deferred_end, None
        self._loop.disarm()
        if not self._closed:
            self._capture_from_hook(step, end=end)

    def _step_begins(self) -> None:
        """The model's forward or the optimizer's step: nothing of the last step may wait longer
        (a scheduler that did not step this iteration: its pending capture is taken now)."""
        step, self._pending = self._pending, None
        end, self._step_end = self._step_end, None
        if (
            step is not None
            and any(n.startswith("scheduler") for n in self._due)
            and not self._scheduler_skips
        ):
            self._scheduler_skips = True
            log.info(
                "rank %d: the scheduler did not step after step %d: captures waiting for it keep the "
                "random numbers and caller state of the optimizer's step",
                self.rank,
                step,
            )
        if step is not None and "scaler" in self._due:
            # A loss scaler's update() follows every step that uses it: this one is not the loop's.
            self._scaler_trails = False
            log.warning(
                "rank %d: the GradScaler found at enable_resiliency did not update() after step %d: "
                "captures no longer wait for it",
                self.rank,
                step,
            )
        if step is not None and not self._closed:
            if end is not None:
                self._capture_from_hook(step, end=end)
            elif self.before_capture is not None:
                # The loop's code for the next step already ran (its random draws, its counters):
                # a capture now would not be this step's. The previous one stays the newest.
                self.before_capture(step)
        self._take_deferred()

    def _forward_begins(self, module: Any) -> None:
        """The model's forward. One that does not train (under `no_grad` or `inference_mode`, or the
        model in eval mode: an evaluation, a metric) while a capture waits for the next fetch or
        the loop's back edge is the step's own work after the step, as what follows it is (an EMA
        updated after the evaluation): the capture keeps waiting. A training forward begins the
        next step. (Before, an evaluation between the step and an EMA update took the capture
        early, and the resumed EMA was one update behind.)"""
        if self._deferred is not None and self._pending is None and _evaluating(module):
            return
        self._step_begins()

    def _volatile_state(self) -> dict[str, Any]:
        """What the loop's own code may change before the next forward: the random numbers and
        the caller's state (a copy: the loop may change it in place)."""
        out: dict[str, Any] = {"rng": rng_state()}
        if self.extra_state_fn is not None:
            out["extra"] = copy.deepcopy(self.extra_state_fn())
        self._add_iterators(out)
        return out

    def _add_iterators(self, state: dict[str, Any]) -> None:
        """The live DataLoader iterators' states (see IteratorWatch.snapshot), where there are any."""
        iterators = self.iterators.snapshot()
        if iterators:
            state["iterators"] = iterators

    def on_fetch(self) -> None:
        """Before `next()` on an instrumented loader (training thread). A fetch under `no_grad` or
        `inference_mode`, or with the model in eval mode, is an evaluation's: the step's own work
        (see _forward_begins), neither a capture's moment nor a training fetch."""
        if _evaluating(self.model):
            return
        # The scheduler did not step before the next fetch: the step ended here all the same.
        step, self._pending, self._step_end = self._pending, None, None
        if step is not None and not self._closed:
            self._capture_from_hook(step)
        self._take_deferred()
        self._fetched = True

    def _on_loader_fetch(self) -> None:
        """A DataLoader iterator the loop made itself (no instrumented loader) is about to fetch a
        batch: on the training thread, the same moment as an instrumented loader's fetch, so a loop
        that iterates a DataLoader every step has its steps captured as the next one begins (a
        counter it bumps after `optimizer.step()` then goes with the step, as it expects on
        resume). A fetch on another thread (a prefetching thread of the loop's) says nothing of
        where the training thread is."""
        if not self._closed and threading.get_ident() == getattr(self, "_training_thread", None):
            self.on_fetch()

    def _capture_from_hook(
        self, step: int, wait_for_verdict: bool = True, end: dict[str, Any] | None = None
    ) -> None:
        """Captures run inside the user's optimizer/scheduler calls: a capture that cannot be taken
        (shared memory full, state we cannot serialise) is reported, never raised into training."""
        if self.before_capture is not None:
            self.before_capture(step)
        try:
            self.capture(step, wait_for_verdict, end=end)
        except Exception as exc:  # anything: training must not fail because a checkpoint did
            self.stats.capture_failures += 1
            if self.stats.capture_failures in (1, 10, 100) or self.stats.capture_failures % 1000 == 0:
                log.error(
                    "rank %d: capture of step %d failed (%d so far): %s",
                    self.rank,
                    step,
                    self.stats.capture_failures,
                    exc,
                )
                self._fault("checkpoint_capture_failed", "capture_failed", str(exc))
        then, self._after_capture = self._after_capture, []
        for fn in then:
            try:
                fn()
            except Exception:  # (a campaign's damage to the copy: never into training)
                log.exception("rank %d: a call waiting for the capture of step %d failed", self.rank, step)

    def capture_waiting(self) -> bool:
        """A step's capture waits for the loop's work after the step (its scheduler, its next
        fetch, its back edge): see on_step."""
        return self._pending is not None or self._deferred is not None

    def after_capture(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the training thread once the waiting capture is taken (see capture_waiting)."""
        self._after_capture.append(fn)

    def _install_boundary_hooks(self) -> None:
        self._pending = None
        self._hooks = []
        if self.optimizer is not None:
            self._hooks.append(mark_ours(self.optimizer.register_step_pre_hook(self._fence_before_step)))
        # First among the model's forward pre-hooks: before FSDP's unshard, the state is the step's.
        self._hooks.append(
            self.model.register_forward_pre_hook(
                lambda module, args: self._forward_begins(module), prepend=True
            )
        )
        # Observe scheduler.step() through a per-instance subclass: patching the instance would put a
        # function into scheduler.state_dict() (it returns the instance __dict__). A SchedulerChain's
        # members are each observed, and the objects in step_ends: the step ends when every one of
        # them has stepped.
        schedulers = members_of(self.scheduler) if self.scheduler is not None else ()
        names = ["scheduler" if i == 0 else f"scheduler{i}" for i in range(len(schedulers))]
        names += [f"end{i}" for i in range(len(self._step_ends))]
        self._observed_steps: list[tuple[Any, type, str]] = []
        for obj, name in zip([*schedulers, *self._step_ends], names, strict=True):
            self._observed_steps.append((obj, type(obj), name))
            obj.__class__ = _observed(type(obj), self._take_pending, name)

    def adopt_scaler(self, scaler: Any) -> None:
        """A loss scaler made after enable_resiliency, found before the first forward (before it
        scaled anything): captured from now on, and given the state this restart restored."""
        self.scaler = scaler
        restored, self._restored_scaler = self._restored_scaler, None
        if restored is not None:
            load_scaler_state(scaler, restored)

    def on_scaler_update(self) -> None:
        """The loss scaler's update() returned (see adapters.amp.ScalerWatch)."""
        self._take_pending("scaler")

    def _fence_before_step(self, *args: Any) -> None:
        """Optimizer pre-step: the parameters must not change before an async capture has read them."""
        self._step_begins()
        fence, self._fence = self._fence, None
        if fence is not None:
            fence.fence_device()

    # -- certificates (SCOUT's runtime thread) ------------------------------------------------------
    def certify(self, step: int) -> None:
        """SCOUT agreed on `step`: mark its committed own slot, so the certificate outlives us."""
        with self._lock:
            held = False
            for k, s in self._own_step.items():
                if s == step and not self._closed:
                    held = True
                    self._on_own_slot(k, lambda slot: slot.mark_certified(step))
            self._idle.notify_all()  # a capture may be waiting for this verdict
            digest = self._held_digest(step) if held and step in self._on_disk else None
        if digest is not None:  # (written before the certificate came: the record says so now)
            self._durable_trust(lambda: self.durable.certify(step, digest), f"the certificate of step {step}")
        if held and len(self._groups) > 1:
            self._announce()  # the other replica groups keep what every group certified (_certified)

    def _held_digest(self, step: int) -> bytes | None:
        """(lock held) The header digest of the own slot holding `step`."""
        got: list[bytes] = []
        for k, s in self._own_step.items():
            if s == step:
                with contextlib.suppress(CorruptSlot, OSError):
                    self._on_own_slot(k, lambda slot: got.append(slot.header_digest()))
        return got[0] if got else None

    def revoke(self, from_step: int, kind: str = "sdc") -> None:
        """SDC (or stale state: `kind`) found at `from_step`: no capture from it on is
        recovery-verified any more, and the next restart restores a certified capture (unless told
        otherwise)."""
        with self._lock:
            self.carried_certificates = {s for s in self.carried_certificates if s < from_step}
            for k, s in self._own_step.items():
                if s >= from_step and not self._closed:
                    self._on_own_slot(k, SlotFile.clear_certificate)
            self._idle.notify_all()  # an SDC: no capture waits for a verdict any more
        self._durable_trust(lambda: self.durable.revoke(from_step), f"the revocation from step {from_step}")
        self.note_restart_mode("recovery_verified", kind)
        # The inventory again: its certified steps go to the torchrun backend's leader, which picks
        # the restart step from them (a certificate an audit revoked would restore the corruption).
        self._announce()

    # -- the trust level the next restart needs (survives the process, like the slots) -------------
    def _mode_path(self) -> Path:
        return self.dir / f".restart-mode-r{self.rank}"

    def note_restart_mode(self, mode: str, kind: str | None = None) -> None:
        """Remember on this node which trust level the next restart needs, and for which failure
        kind: set by an SDC and by `prepare_recovery` (the caller's decision), read by the restarted
        rank's `recover` (its recovery decision names the kind)."""
        path = self._mode_path()
        tmp = path.with_name(path.name + ".tmp")
        note = f"{mode} {kind}" if kind else mode
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(note)
            os.replace(tmp, path)
        except OSError as exc:  # the slots' own folder: a failure here shows up there too
            log.warning("rank %d: cannot note the restart's recovery mode at %s: %s", self.rank, path, exc)
        # And with the copies on disk: a relaunch on nodes whose memory is gone reads it there.
        self._durable_trust(lambda: self.durable.note_mode(note), "the restart's recovery mode")

    def _durable_trust(self, write: Callable[[], None], what: str) -> None:
        try:
            write()
        except DurableError as exc:  # a relaunch from disk alone then takes no copy as verified
            log.warning("rank %d: %s is not recorded on disk: %s", self.rank, what, exc)

    def _forget_note(self) -> None:
        with contextlib.suppress(OSError):
            self._mode_path().unlink(missing_ok=True)
        self._durable_trust(lambda: self.durable.note_mode(""), "the consumed recovery mode")

    def _note(self) -> list[str]:
        try:
            return self._mode_path().read_text().split()
        except FileNotFoundError:
            return self.durable.noted_mode().split()  # a relaunch whose node memory is gone
        except (OSError, UnicodeDecodeError):
            return []

    def noted_restart_mode(self) -> str | None:
        mode = self._note()[:1]
        return mode[0] if mode and mode[0] in ("latest", "recovery_verified") else None

    def noted_failure_kind(self) -> str | None:
        """The failure kind noted with the mode (a note of an earlier version has none)."""
        note = self._note()
        return note[1] if len(note) == 2 and kind_of(note[1]) is not None else None

    def _on_own_slot(self, k: int, fn: Callable[[SlotFile], None]) -> None:
        """Apply `fn` to own slot `k`, mapping it for the call when this process has not yet."""
        slot = self._own[k]
        if slot.mapping is not None:
            fn(slot)
            return
        try:
            other = SlotFile.open_existing(slot.path)
        except CorruptSlot:
            return
        try:
            fn(other)
        finally:
            other.close()

    def _certified(self, step: int) -> bool:
        """Whether `step` is recovery-verified for the job (lock held): SCOUT certified it for this
        rank's replica group and, when the job has others (tensor, pipeline or expert parallelism,
        HSDP), a rank of every other group certified it too (their inventories say so). A group
        certifies its own ranks' state only: an SDC in another group makes the steps after it
        corrupt there, which this group certifies all the same. Kept by the own group's certificate
        alone, the healthy groups rotated past the last step every group certified before the other
        group's replay named its culprit, and no recovery-verified step was left in memory."""
        if self.certifier is None or not self.certifier(step):
            return False
        return all(
            g == self._own_group or any(step in getattr(self._inventories.get(r), "certified", ()) for r in g)
            for g in self._groups
        )

    def _judged_elsewhere(self, step: int) -> bool:
        """Whether another replica group holds a capture of `step` that none of its ranks has
        certified yet (lock held)."""
        invs = [[self._inventories.get(r) for r in g] for g in self._groups if g != self._own_group]
        return any(
            any(i is not None and step in i.local for i in g)
            and not any(i is not None and step in i.certified for i in g)
            for g in invs
        )

    def _slot_to_keep(self, steps: dict[int, int]) -> int | None:
        """Of two slots (index -> step), the one not to overwrite: the newest recovery-verified
        step (SCOUT certified it, every replica group did), or without certificates the newest."""
        off = self.certifying is not None and not self.certifying()
        certified = {} if off else {k: s for k, s in steps.items() if self._certified(s)}
        pool = certified or steps
        return max(pool.items(), key=lambda kv: kv[1], default=(None, -1))[0]

    def _free_slots(self) -> list[int]:
        """Slots a capture may overwrite (lock held): never a busy one, never the one to keep.

        Keep the newest recovery-verified capture (SCOUT certified it); without certificates, keep
        the newest one. After an SDC the certified slot stays put while the other rotates."""
        keep = self._slot_to_keep(self._own_step)
        return sorted(
            (
                k
                for k in (0, 1)
                if k != keep and k not in self._busy and k not in self._flushing and k != self._scrub_hold
            ),
            key=lambda k: self._own_step.get(k, -1),
        )

    def _judging(self) -> bool:
        """Whether an own slot holds a capture SCOUT is still judging, committed less than
        VERDICT_WAIT_S ago (lock held).

        Which slot a capture overwrites depends on the certificates (the newest certified capture
        stays). Decided before the verdict on the previous capture came, it would depend on when
        this rank's certificates happen to arrive: ranks would keep different verified steps, and
        an SDC would find none that every rank holds. Certificates come later than a capture
        interval when captures are taken every step of a loop with steps of a few ms, when the
        runtime thread is starved of CPU, or with `RuntimeConfig.publish_coalesce_s` above the step
        time. So a capture waits for that verdict (a certificate, or an SDC that ends all waiting),
        for VERDICT_WAIT_S at most: the loop runs at most one capture ahead of SCOUT."""
        if self.certifier is None or self.awaiting is None:
            return False
        now = time.monotonic()
        return any(
            now - self._committed_at.get(k, float("-inf")) < VERDICT_WAIT_S
            and (
                self.awaiting(s)
                # Certified here, and another replica group holds its capture but has not certified
                # it yet (its certificate comes a few ms later; none, an SDC there, ends the wait
                # after VERDICT_WAIT_S). A group that has not captured it yet is not waited for:
                # groups that do not step together would make every capture wait.
                or (len(self._groups) > 1 and self.certifier(s) and self._judged_elsewhere(s))
            )
            for k, s in self._own_step.items()
        )

    def capture(self, step: int, wait_for_verdict: bool = True, end: dict[str, Any] | None = None) -> bool:
        """Copy the state at `step` into a free slot; checksum and replication follow off-thread.
        `end`: parts of the state as they were when the step ended, taken earlier (_volatile_state)."""

        t0 = time.perf_counter()
        self.iterators.first_step()  # a step ran since a restore: iterators made now are new ones
        with self._idle:
            # A slot still being committed or replicated is busy. Wait briefly for one (backpressure
            # when the worker lags), then skip this capture rather than stall training for long.
            self._idle.wait_for(lambda: bool(self._free_slots()), CAPTURE_WAIT_S)
            wake = self._replica_wake
            if not self._free_slots() and wake is not None:
                # That slot's replica has had no acknowledgement for CAPTURE_WAIT_S at least (its
                # holder does not answer: its messages dropped, or it is gone). Giving it up frees
                # the slot: else every capture until the replica's deadline (10 s and more) was
                # skipped, and this rank's copies fell behind its peers', who captured on, until
                # no step was held by every rank and a restart began again from step 0.
                wake.set()
                self._idle.wait_for(lambda: bool(self._free_slots()), CAPTURE_WAIT_S)
            free = self._free_slots()
            if wait_for_verdict and free and all(k in self._own_step for k in free) and self._judging():
                # Which slot to overwrite hangs on that verdict (an empty slot is taken anyway).
                self.stats.verdict_waits += 1
                t1 = time.perf_counter()
                self._waiting = step
                try:
                    self._idle.wait_for(lambda: not self._judging() or self._waiting is None, VERDICT_WAIT_S)
                finally:
                    taken, self._waiting = self._waiting is None, None
                    self.stats.verdict_wait_s += time.perf_counter() - t1
                if taken:  # by the SIGTERM handler, meanwhile (see _take_waiting)
                    return True
            free = self._free_slots()
            if not free:
                self.stats.skipped_busy += 1
                return False
            k = free[0]
            self._busy.add(k)
            self._own_step.pop(k, None)
            self._taken(self._own[k].path)
            # The capture left in place: committed, or still being committed (replicated first).
            keeps = self._own_step.get(1 - k, self._in_flight.get(1 - k, -1))
            self._in_flight[k] = step
            self._copying = (threading.get_ident(), k)
        try:
            # With the collector off: the thousands of objects a capture makes and drops (the state
            # dicts, the walk's entries) are gone before it may run, so they never start a
            # collection that the training thread would pay for (and a full one, in a large job's
            # process, takes tens of ms).
            with collector_paused():
                header, completion = self._copy_into(k, step, end)
        except BaseException:
            with self._lock:
                self._busy.discard(k)
                self._in_flight.pop(k, None)
                self._copying = None
            raise
        self.stats.capture_block_s_last = time.perf_counter() - t0
        self.stats.bytes_per_capture = header.file_size
        self._jobs.put((k, header, completion, keeps))
        self._copying = None
        return True

    def _copy_into(self, k: int, step: int, end: dict[str, Any] | None) -> tuple[SlotHeader, Completion]:
        """Collect the state at `step` and copy it into own slot `k` (see capture)."""
        state = collect_state(
            self.model, self.optimizer, self.scheduler, self.extra_state_fn, step, self.scaler
        )
        state.update(end or {})
        if end is None or "rng" not in end:  # (else taken with the step's end state)
            self._add_iterators(state)
        # Not only at a fetch: a capture a dying worker takes (an exception, SIGTERM), or one at
        # the next forward, holds them too. Before, a restore of one made the loop's iterator anew,
        # a draw the uninterrupted run never made (outsider 56, an exception mid-epoch).
        if self.loaders_fn is not None:
            state["loaders"] = self.loaders_fn()
        skeleton, tensors, specs = flatten(state)
        layout = msgpack.packb([[s.dtype, list(s.shape), s.nbytes] for s in specs], use_bin_type=True)
        index = b"\x92" + msgpack.packb(skeleton, use_bin_type=True) + layout  # [skeleton, layout]
        payload_len = aligned(len(index)) + sum(aligned(s.nbytes) for s in specs)
        header = SlotHeader(
            step,
            self.rank,
            self.world_size,
            payload_len,
            len(index),
            self.chunk,
            n_chunks(payload_len, self.chunk),
            self.run_id[:64],
            self.shape,
        )
        slot = self._own[k]
        if self._copier is None:
            self._copier = copier_for(tensors)
        stale = slot.mapping is not None and not slot.intact()
        if stale or (slot.mapping is not None and slot.size < header.file_size):
            # The mapping is about to grow, or to be made again of the file as it is now (truncated,
            # removed or replaced from outside): let go of the old one.
            self._views.pop(k, None)
            if k in self._pinned:
                self._copier.unregister_host(self._pinned.pop(k))
            if stale:
                log.warning(
                    "rank %d: own slot %s was truncated, removed or replaced from outside: mapped anew",
                    self.rank,
                    slot.path.name,
                )
                slot.close()
        self._map(slot, header.file_size, checked=True)
        self._pin(k)
        slot.begin()
        view = slot.view()
        view[HEADER_SIZE : HEADER_SIZE + len(index)] = index
        del view
        dsts = self._slot_views(k, HEADER_SIZE + aligned(len(index)), layout, tensors, specs)
        pairs = [(d, t) for d, t in zip(dsts, tensors, strict=True) if d is not None]
        pairs, first = self._forward_mutable_first(pairs)
        completion = self._copier.copy(pairs, first)
        self._fence = completion
        return header, completion

    def _forward_mutable_first(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """`pairs` with the copies of the model's buffers first, and how many there are: the
        next forward changes them in place (a BatchNorm's running statistics, its batch count), so an
        asynchronous copy must read them before it runs, not only before the optimizer's step. On the
        host (SyncCopier) the copies are done when `copy` returns: as they are."""
        if self._copier is None or not self._copier.asynchronous:
            return pairs, 0
        mutable = {b.data_ptr() for b in self.model.buffers()}
        early = [p for p in pairs if p[1].data_ptr() in mutable]
        if not early:
            return pairs, 0
        return early + [p for p in pairs if p[1].data_ptr() not in mutable], len(early)

    def _slot_views(
        self, k: int, base: int, layout: bytes, tensors: list[torch.Tensor], specs: list[TensorSpec]
    ) -> list[torch.Tensor | None]:
        """Views of own slot `k` from `base` on, one per tensor (typed and shaped like it, at its
        aligned offset; None for an empty one), to copy the tensors into. Kept while the slot's
        mapping, the offset and the layout (dtypes, shapes, sizes) stay the same, as they do from one
        capture to the next: making them anew costs a few microseconds a tensor."""
        slot = self._own[k]
        held = self._views.get(k)
        if held is not None and held[0] is slot.mapping and held[1] == base and held[2] == layout:
            return held[3]
        self._views.pop(k, None)
        sizes: list[int] = []
        for spec in specs:
            sizes += (spec.nbytes, aligned(spec.nbytes) - spec.nbytes)
        buf = torch.frombuffer(slot.view(), dtype=torch.uint8)
        parts = buf[base : base + sum(sizes)].split_with_sizes(sizes)
        dsts: list[torch.Tensor | None] = [
            _typed(parts[2 * i], t) if spec.nbytes else None
            for i, (t, spec) in enumerate(zip(tensors, specs, strict=True))
        ]
        del buf, parts
        self._views[k] = (slot.mapping, base, layout, dsts)
        return dsts

    def _work(self) -> None:
        first = REANNOUNCE_HEARTBEATS * getattr(
            getattr(self.runtime, "config", None), "heartbeat_interval_s", 0.5
        )
        while True:
            gap = self._reannounce_after or first
            try:
                job = self._jobs.get(timeout=max(0.0, self._announced_at + gap - time.monotonic()))
            except queue.Empty:
                if time.monotonic() >= self._announced_at + gap:  # (else one went out meanwhile)
                    self._reannounce()
                    self._reannounce_after = min(REANNOUNCE_MAX_S, 2 * gap)
                continue
            if job is None:
                return
            k, header, completion, keeps = job
            try:
                try:
                    completion.wait_host()  # an async device-to-host copy must land before the checksums
                    self._commit_and_replicate(k, header, keeps)
                except Exception:  # keep capturing; the next capture retries replication
                    log.exception("rank %d: committing or replicating step %d failed", self.rank, header.step)
                if not self.config.verify_integrity:  # (the scrub below looks at every copy closer)
                    try:  # before the slot is free: what a drain waits for has been looked at too
                        self._look_at_held(k)
                    except Exception:  # a look never stops capturing
                        log.exception("rank %d: looking at a held copy failed", self.rank)
            finally:
                with self._lock:
                    self._busy.discard(k)
                    self._in_flight.pop(k, None)
                    self._scrubbing = self.config.verify_integrity and not self._closed
                    if not self._scrubbing:  # (the commit's hold lasts until the check, see _scrub)
                        self._scrub_hold = None
                    self._idle.notify_all()
            if self._scrubbing:
                try:
                    self._scrub(k)
                except Exception:  # a scrub never stops capturing
                    log.exception("rank %d: re-verifying a held copy failed", self.rank)
                finally:
                    with self._lock:
                        self._scrubbing = False
                        self._scrub_hold = None
                        self._idle.notify_all()

    def _taken(self, path: Path) -> None:
        """A writer is about to overwrite the slot at `path` (see _scrub)."""
        self._rewrites[path] = self._rewrites.get(path, 0) + 1

    def _scrub(self, committed: int) -> None:
        """`verify_integrity`: after each commit, verify every other copy this rank holds again
        (its other own slot and the replicas it holds for peers; not those being overwritten). A
        copy damaged in memory since it was committed (a bit flip at rest, something writing into
        /dev/shm) is dropped from the inventory and reported as `checkpoint_corruption` now, not
        found by the restart that needed it. Costs about three captures' checksums per commit."""
        with self._lock:
            held = [(self.rank, k, s) for k, s in sorted(self._own_step.items()) if k != committed]
            for o, steps in sorted(self._replica_step.items()):
                held += [(o, k, s) for k, s in sorted(steps.items())]
        for owner, k, step in held:
            if self._closed:
                return
            path = self._own[k].path if owner == self.rank else self._replica_path(owner, k)
            with self._lock:
                seen = self._rewrites.get(path, 0)
                steps = self._own_step if owner == self.rank else self._replica_step.get(owner, {})
                if steps.get(k) != step:
                    continue  # taken by a writer since
                # The next capture must not overwrite our other slot meanwhile (held since the
                # commit): a damaged copy it replaced would look like one being rewritten.
                self._scrub_hold = k if owner == self.rank else None
            try:
                self._verify_held(owner, k, step, path, seen)
            finally:
                with self._lock:
                    self._scrub_hold = None
                    self._idle.notify_all()

    def _look_at_held(self, committed: int) -> None:
        """After each commit, `verify_integrity` or not: every other copy this rank holds and has
        mapped is still the file it mapped, as long as it was (two stats a copy). One removed or
        truncated from outside (a cleanup script, a campaign's checkpoint_missing or
        checkpoint_truncation) is dropped and reported as `checkpoint_corruption` now, as the scrub
        would (see _scrub), not found by the restart that needed it. A flipped byte takes the
        scrub's checksums."""
        with self._lock:
            held = [(self.rank, k, s, self._own[k]) for k, s in self._own_step.items() if k != committed]
            for o, steps in self._replica_step.items():
                slots = self._replica_slots.get(o)
                held += [(o, k, s, slots[k]) for k, s in steps.items() if slots is not None]
            seen = {slot.path: self._rewrites.get(slot.path, 0) for _, _, _, slot in held}
        for owner, k, step, slot in held:
            if slot.mapping is not None and not slot.intact():
                why = f"{slot.path.name}: removed, truncated or replaced since step {step} was committed"
                self._drop_damaged(owner, k, step, slot.path, seen[slot.path], why)

    def _verify_held(self, owner: int, k: int, step: int, path: Path, seen: int) -> None:
        try:
            reader = SlotFile.open_existing(path)
        except CorruptSlot as exc:
            self._drop_damaged(owner, k, step, path, seen, str(exc))
            return
        try:
            h = reader.read_header()
            if h.step != step or h.owner != owner:
                raise CorruptSlot(f"{path.name}: holds rank {h.owner} step {h.step}, expected {step}")
            reader.verify(h, self._verify_pool)
            self.stats.scrubbed += 1
        except CorruptSlot as exc:
            self._drop_damaged(owner, k, step, path, seen, str(exc))
        finally:
            reader.close()

    def _uncommit(self, path: Path) -> None:
        """The copy in the slot file at `path` is never loaded again, not even by a restart's scan
        (lock held; the caller has taken it out of the inventory)."""
        self._verified.pop(path, None)
        with contextlib.suppress(CorruptSlot, OSError):
            slot = SlotFile.open_existing(path)
            try:
                slot.begin()
            finally:
                slot.close()

    def _drop_damaged(self, owner: int, k: int, step: int, path: Path, seen: int, why: str) -> None:
        with self._lock:
            if self._rewrites.get(path, 0) != seen or self._closed:
                return  # overwritten meanwhile by a newer copy: what we read was no damage
            steps = self._own_step if owner == self.rank else self._replica_step.get(owner, {})
            if steps.get(k) != step:
                return
            del steps[k]
            self._uncommit(path)
            self.stats.scrub_failures += 1
            self._idle.notify_all()
        whose = "its own" if owner == self.rank else f"rank {owner}'s"
        log.error("rank %d: %s copy of step %d is damaged, dropped: %s", self.rank, whose, step, why)
        self.stats.rejected_copies.append(why)
        self._fault(
            "checkpoint_corruption",
            "checkpoint_copy_invalid",
            why,
            steps=[step],
            owner=owner,  # whose state the copy holds (the report names its holder: this rank)
            endpoint_id=str(path),
        )
        self._announce()

    def _disk_due(self, step: int) -> bool:
        """Whether the capture of `step` goes to disk: the first capture at or past each multiple
        of the disk interval (captures every 3 steps, disk every 4: steps 6, 9, 12, 18, ...). Only
        the multiples themselves would be the common multiples of the two intervals (12, 24, ...;
        with captures every 7 steps and the default 100, one write in 700 steps). The same steps on
        every rank, whatever step a generation resumed at."""
        return step // self.disk_interval > max(step - self.interval, 0) // self.disk_interval

    def _commit_and_replicate(self, k: int, header: SlotHeader, keeps: int = -1) -> None:
        slot = self._own[k]
        t0 = time.perf_counter()
        digests = chunk_digests(slot.payload(header), header.chunk_size, self._hash_pool)
        slot.commit(header, digests)
        self.stats.commit_s_last = time.perf_counter() - t0
        with self._lock:
            self._own_step[k] = header.step
            self._committed_at[k] = time.monotonic()
            if self.config.verify_integrity and not self._closed and 1 - k in self._own_step:
                # The other slot is no longer the newest: a capture may overwrite it from now on,
                # and one during this commit's disk write or replication would erase a damaged
                # copy before the check that follows them (see _work) read it.
                self._scrub_hold = 1 - k
            if self.certifier is not None and self.certifier(header.step):
                slot.mark_certified(header.step)  # SCOUT agreed before the commit finished
        self.stats.captures += 1
        if self._disk_due(header.step):
            self._write_durable(slot, header)
        elif time.monotonic() >= self._probe_after:
            self._probe_durable()
        self._announce()
        with self._lock:
            self._announced[k] = header.step
            self._idle.notify_all()  # a flush on SIGTERM waits for this much only
        if self.holder is None or self._closed or not self.runtime.alive:
            return
        if time.monotonic() < self._replicate_after:
            self.stats.replication_paused += 1
            return
        buffers, frame_digests = self._file_chunks(slot, header, digests)
        meta = {
            "kind": "gemini-replica",
            "owner": str(self.rank),
            "step": str(header.step),
            "size": str(header.file_size),
            "chunk": str(header.chunk_size),  # lets the holder write each chunk where it belongs
            # The capture this one did not overwrite: the holder keeps its replica of it, so its two
            # replica slots mirror our slots (chosen after SCOUT's verdict, the same on every rank).
            "keeps": str(keeps),
        }
        t0, started = time.perf_counter(), time.monotonic()
        last = self.stats.replication_s_last
        deadline = (
            min(REPLICA_TIMEOUT_S, max(REPLICA_MIN_TIMEOUT_S, 8 * last)) if last > 0 else REPLICA_TIMEOUT_S
        )
        try:
            ack = self._acknowledged(
                self.runtime.send_bulk(
                    self.holder,
                    f"gem-r{self.rank}-s{header.step}",
                    buffers,
                    meta,
                    timeout=deadline,
                    digests=frame_digests,
                ),
                deadline + 5.0,
            )
        except Exception as exc:  # peer gone, timeout, given up for a capture: the local copy stands
            self.stats.replication_failures += 1
            if self._closed or not self.runtime.alive:  # the job's end: the transfer was cut off
                log.info("rank %d: replica of step %d not sent: the session closed", self.rank, header.step)
                return
            if isinstance(exc, PeerLeft):  # the holder's session closed first (the job's end)
                log.info("rank %d: replica of step %d not sent: %s", self.rank, header.step, exc)
                return
            if started < self._holder_back_at:  # sent while the holder was silent; it answers now
                log.info(
                    "rank %d: replica of step %d to rank %s failed while it was silent: %r; it is heard "
                    "again, so replicas go on",
                    self.rank,
                    header.step,
                    self.holder,
                    exc,
                )
                return
            low, high = REPLICA_BACKOFF_S
            self._replica_backoff = min(high, max(low, 2 * self._replica_backoff))
            self._replicate_after = time.monotonic() + self._replica_backoff
            log.warning(
                "rank %d: replica of step %d to rank %s failed: %r; replicas pause for %.0f s",
                self.rank,
                header.step,
                self.holder,
                exc,
                self._replica_backoff,
            )
            return
        self._replica_backoff = 0.0
        self.stats.replication_s_last = time.perf_counter() - t0
        if ack.ok:
            self.stats.replicated += 1
        else:
            self.stats.replication_failures += 1
            log.warning(
                "rank %d: rank %s refused replica of step %d: %s",
                self.rank,
                self.holder,
                header.step,
                ack.reason,
            )

    def _on_membership(self, ev: MembershipEvent) -> None:
        """The holder of this rank's replicas heard again after it was declared dead (its messages
        were dropped, a link flapped): replicas resume with the next capture. Before, the pause a
        failed replica began (doubling up to 60 s) ran its course: the holder's copies of this rank
        stayed behind long after it answered again, and a node lost meanwhile resumed from an old
        step, or from step 0 when no step older than that was held by every rank (loop thread)."""
        if ev.kind is not EventKind.REJOINED or ev.peer != self.holder:
            return
        with self._lock:
            paused = time.monotonic() < self._replicate_after
            self._replicate_after, self._replica_backoff = float("-inf"), 0.0
            self._holder_back_at = time.monotonic()
        if paused:
            log.info("rank %d: rank %d heard again: replicas resume", self.rank, ev.peer)

    def _acknowledged(self, fut: Any, timeout: float) -> Any:
        """The holder's acknowledgement of a replica, unless a capture that needs the replica's slot
        gives it up first (then ReplicaAbandoned)."""
        wake = threading.Event()  # (this wait's own: an abandoned transfer ends later, and sets its own)
        with self._lock:
            self._replica_wake = wake
        fut.add_done_callback(lambda _: wake.set())
        try:
            if not wake.wait(timeout):
                raise TimeoutError(f"no acknowledgement within {timeout:.0f} s")
            if not fut.done():
                raise ReplicaAbandoned(
                    f"no acknowledgement after {CAPTURE_WAIT_S:.0f} s; the next capture needed its slot"
                )
            return fut.result()
        finally:
            with self._lock:
                self._replica_wake = None

    def _probe_durable(self) -> None:
        """Between copies, whether the durable folder still takes a write (see DurableStore.probe):
        a disk that turned read-only or full is reported as `io_error` within DISK_PROBE_S of a
        capture, once until a probe or a copy succeeds again."""
        self._probe_after = time.monotonic() + DISK_PROBE_S
        try:
            self.durable.probe()
        except DurableError as exc:
            self._disk_failed(exc, "durable_probe_failed", report=not self._disk_failing)
            return
        self._disk_failing = False

    def _disk_failed(self, exc: DurableError, reason: str, report: bool = True) -> None:
        """A write to the durable folder failed: counted, and (when `report`) logged and reported
        as `io_error`; the memory tiers keep the run recoverable."""
        self.stats.disk_errors += 1
        self.stats.last_disk_error = str(exc)
        self._disk_failing = True
        if report:
            log.error("rank %d: %s; memory tiers keep the run recoverable", self.rank, exc)
            self._fault("io_error", reason, str(exc), endpoint_id=str(self.durable.root))

    def _write_durable(self, slot: SlotFile, header: SlotHeader) -> bool:
        if header.step in self._on_disk:
            return True
        try:
            written = self.durable.write(header.step, slot.view()[: header.file_size])
            if self.config.verify_integrity:
                # Read the file back from the disk and check every chunk: a write the disk or the
                # file system got wrong shows now, not at the restart that reads it.
                try:
                    verify_image(written.name, self.durable.read(header.step), self._verify_pool)
                except (CorruptSlot, DurableError) as exc:
                    written.unlink(missing_ok=True)
                    why = f"durable checkpoint of step {header.step} reads back damaged: {exc}"
                    raise DurableError(0, why) from exc
        except DurableError as exc:
            self._disk_failed(exc, "durable_write_failed")
            return False
        self._disk_failing = False
        self._on_disk.add(header.step)
        self._on_disk -= set(self.durable.pruned)  # what the write pruned is no longer held
        self.stats.disk_writes += 1
        if slot.certified(header):
            digest = slot.header_digest()
            self._durable_trust(
                lambda: self.durable.certify(header.step, digest), f"the certificate of step {header.step}"
            )
        return True

    def _file_chunks(
        self, slot: SlotFile, header: SlotHeader, digests: list[bytes]
    ) -> tuple[list[memoryview], list[bytes]]:
        view = slot.view()
        head = slot.header_page()
        payload = view[HEADER_SIZE : HEADER_SIZE + header.payload_len]
        table = view[HEADER_SIZE + header.payload_len : header.file_size]
        chunks = [payload[i : i + header.chunk_size] for i in range(0, header.payload_len, header.chunk_size)]
        if not chunks:
            chunks = [payload[0:0]]
        return [head, *chunks, table], [frame_digest(head), *digests, frame_digest(table)]

    # -- holder side (loop thread) ----------------------------------------------------------------
    def _on_chunk(
        self, sender: int, tid: str, meta: dict[str, str], index: int, count: int, chunk: Any
    ) -> bool:
        """A replica's chunk as it arrives: written into the replica slot on the receiving thread, so
        the holder never keeps a whole state in transfer buffers (and reuses the same few)."""
        if meta.get("kind") != "gemini-replica" or meta.get("owner") != str(sender) or count < 3:
            return False
        key = (sender, tid)
        st = self._streams.get(key)
        if st is None:
            try:
                step, size, chunk_size = int(meta["step"]), int(meta["size"]), int(meta["chunk"])
                keeps = int(meta.get("keeps", "-1"))
            except (KeyError, ValueError):
                return False  # a sender without chunk geometry: the whole transfer is written at the end
            for old in [k for k in self._streams if k[0] == sender]:
                del self._streams[old]  # an older transfer from this owner that never completed
            st = self._streams[key] = _Stream(sender, step, size, chunk_size, count, keeps)
            self._rx.put(functools.partial(self._stream_open, st))
        if index == 0:
            st.header = bytes(chunk)  # the committed header goes last
            return True
        off = HEADER_SIZE + (index - 1) * st.chunk_size if index < count - 1 else st.size - len(chunk)
        if count != st.count or off < HEADER_SIZE or off + len(chunk) > st.size:
            st.bad = f"chunk {index} of {count} ({len(chunk)} bytes) does not fit a {st.size}-byte copy"
            return True
        self._rx.put(functools.partial(self._stream_write, st, off, chunk))
        return True

    def _stream_open(self, st: _Stream) -> None:
        slots, k = self._replica_slot_for(st.owner, st.keeps)
        self._map(slots[k], st.size)
        slots[k].begin()
        st.slot, st.k = slots[k], k

    def _stream_write(self, st: _Stream, off: int, chunk: Any) -> None:
        if st.slot is not None and not st.bad:
            st.slot.write_raw(off, chunk)

    def _stream_close(self, st: _Stream) -> None:
        slot = st.slot
        if slot is None or st.bad or st.header is None or len(st.header) != HEADER_SIZE:
            log.warning(
                "rank %d: streamed copy of rank %d step %d is invalid: %s",
                self.rank,
                st.owner,
                st.step,
                st.bad or ("its slot could not be opened" if slot is None else "no header"),
            )
            if slot is not None:
                slot.begin()
            self.stats.replicas_rejected += 1
            return
        slot.write_raw(0, st.header)
        if self._check_written(slot, st.owner, st.step):
            self._replica_step.setdefault(st.owner, {})[st.k] = st.step
            self.stats.replicas_received += 1
            self._announce()
        else:
            self.stats.replicas_rejected += 1

    def _on_transfer(self, sender: int, tid: str, meta: dict[str, str], chunks: list[Any]) -> bool:
        kind = meta.get("kind")
        if kind == "gemini-replica":
            owner = int(meta.get("owner", "-1"))
            if owner != sender:
                self.stats.replicas_rejected += 1
                return True
            st = self._streams.pop((sender, tid), None)
            if st is not None:
                self._rx.put(functools.partial(self._stream_close, st))
                return True
            # Writing into shared memory (and, the first time, reserving it) takes long for a large
            # state: do it on the receiving thread, never on the runtime loop (heartbeats would stall).
            try:
                step, size = int(meta.get("step", "-1")), int(meta.get("size", "0"))
                keeps = int(meta.get("keeps", "-1"))
            except ValueError:
                self.stats.replicas_rejected += 1
                log.warning("rank %d: replica from rank %d has malformed metadata %r", self.rank, owner, meta)
                return True
            self._rx.put(lambda: self._store_replica(owner, step, size, chunks, keeps))
            return True
        if kind == "gemini-restore" and tid in self._restore_waiters:
            self._rx.put(
                lambda: self._store_restored(tid, int(meta.get("size", "0")), int(meta["step"]), chunks)
            )
            return True
        return False

    def _store_restored(self, tid: str, size: int, step: int, chunks: list[Any]) -> None:
        self._taken(self._own[0].path)
        if self._write_file(self._own[0], chunks, size, self.rank, step):
            self._own_step[0] = step
            self._restore_waiters.pop(tid).set()

    def _receive_writes(self) -> None:
        while True:
            job = self._rx.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a failed write loses one copy, never the runtime; logged with its trace
                self.stats.replicas_rejected += 1
                log.exception("rank %d: writing a received checkpoint copy failed", self.rank)

    def _replica_slot_for(self, owner: int, keeps: int) -> tuple[list[SlotFile], int]:
        """The replica slots of `owner` and the one its next copy overwrites (emptied for it).

        The one kept is the replica of `keeps`, the capture the owner left in place when it took
        this one: the owner chose it after SCOUT's verdict, so every holder keeps what every owner
        keeps, whatever time its own certificates came. Without that hint (a replica of it never
        arrived), like own slots: the newest certified replica stays, so a node replaced after an SDC
        can still restore a verified step from this peer."""
        slots = self._replica_slots.setdefault(
            owner, [SlotFile(self._replica_path(owner, k)) for k in (0, 1)]
        )
        steps = self._replica_step.setdefault(owner, {})
        kept = next((k for k, s in steps.items() if s == keeps), None)
        if kept is None:
            kept = self._slot_to_keep(steps)
        k = 1 if kept == 0 else 0
        with self._lock:
            steps.pop(k, None)
            self._taken(slots[k].path)
        return slots, k

    def _store_replica(self, owner: int, step: int, size: int, chunks: list[Any], keeps: int = -1) -> None:
        slots, k = self._replica_slot_for(owner, keeps)
        steps = self._replica_step[owner]
        if self._write_file(slots[k], chunks, size, owner, step):
            steps[k] = step
            self.stats.replicas_received += 1
            self._announce()
        else:
            self.stats.replicas_rejected += 1

    def _write_file(self, slot: SlotFile, chunks: list[Any], size: int, owner: int, step: int) -> bool:
        if len(chunks) < 2 or len(chunks[0]) != HEADER_SIZE or sum(len(c) for c in chunks) != size:
            return False
        self._map(slot, size)
        slot.begin()
        off = HEADER_SIZE
        for c in chunks[1:]:
            slot.write_raw(off, c)
            off += len(c)
        slot.write_raw(0, chunks[0])  # the committed header goes last
        return self._check_written(slot, owner, step)

    def _check_written(self, slot: SlotFile, owner: int, step: int) -> bool:
        # A copy from a peer or the disk never carries the owner's certificate: its holder would not
        # see the owner revoke it.
        slot.clear_certificate()
        try:
            h = slot.read_header()
        except CorruptSlot as exc:
            log.warning(
                "rank %d: received copy of rank %d step %d is invalid: %s", self.rank, owner, step, exc
            )
            slot.begin()
            return False
        if h.owner != owner or h.step != step or h.run_id != self.run_id[:64]:
            slot.begin()
            return False
        return True

    def _replica_path(self, owner: int, k: int) -> Path:
        return self.dir / f"replica-r{owner}-h{self.rank}-s{k}"

    def _on_replica_request(self, sealed: Any, msg: Any) -> None:
        steps = self._replica_step.get(msg.owner, {})
        k = next((k for k, s in steps.items() if s == msg.step), None)
        if k is None or msg.owner != msg.rank:
            log.warning("rank %d: no replica of rank %d step %d to send", self.rank, msg.owner, msg.step)
            return
        slots = self._replica_slots.setdefault(
            msg.owner, [SlotFile(self._replica_path(msg.owner, j)) for j in (0, 1)]
        )
        slot = SlotFile.open_existing(slots[k].path)
        h = slot.read_header()
        buffers, digests = self._file_chunks(slot, h, slot.digest_table(h))
        meta = {
            "kind": "gemini-restore",
            "owner": str(msg.owner),
            "step": str(h.step),
            "size": str(h.file_size),
        }

        async def send() -> None:
            try:
                await self.runtime.send_bulk_async(msg.rank, msg.transfer_id, buffers, meta, 120.0, digests)
            except Exception as exc:  # the requester times out and reports; nothing to undo here
                log.warning("rank %d: sending replica to rank %d failed: %r", self.rank, msg.rank, exc)

        self.runtime.loop.spawn(send)

    # -- inventory: who holds which step (gossiped, so any rank can find any copy) ---------------
    def inventory(self) -> GeminiInventory:
        with self._lock:
            local = tuple(sorted(set(self._own_step.values())))
            replicas = {str(o): tuple(sorted(set(s.values()))) for o, s in self._replica_step.items() if s}
            certifier = self.certifier
            disk = tuple(sorted(self._on_disk))
            # Durable copies too: the ranks of a group keep different in-memory captures when their
            # certificates differ (one whose messages were dropped certified what the others judged
            # without it), and then a disk copy every rank wrote was the only step all of them held;
            # left uncertified, a recovery-verified restart found none and began from step 0.
            certified = tuple(s for s in sorted({*local, *disk}) if certifier is not None and certifier(s))
        return GeminiInventory(self.rank, local, replicas, disk, certified)

    def _announce(self) -> None:
        """Hand the inventory on (gossip, the sink). Threads announce concurrently (the worker after a
        commit, the receiver after a replica): one that computed its inventory first may hand it on
        last, and the newest handed on is what peers and the torchrun backend's leader keep (a worker
        that died with the stale one left the restart a step back). So each checks afterwards that
        no inventory was computed meanwhile, else hands on a fresh one: the last one out is current."""
        for _ in range(16):  # (more only while other threads announce in a loop)
            with self._lock:
                inv = self.inventory()
                self._inventory_seq += 1
                seq = self._inventory_seq
                self._inventories[self.rank] = inv
            if not self._closed and self.runtime.alive:
                self.runtime.submit(inv)
            self._announced_at, self._reannounce_after = time.monotonic(), 0.0
            sink = self.on_inventory
            if sink is not None:
                try:
                    sink(inv)
                except Exception:  # the feed is advisory; captures go on
                    log.exception("rank %d: publishing the inventory failed", self.rank)
            with self._lock:
                if self._inventory_seq == seq:
                    return

    def _reannounce(self) -> None:
        """The inventory last handed on, to peers again (see REANNOUNCE_HEARTBEATS). Worker thread."""
        self._announced_at = time.monotonic()
        inv = self._inventories.get(self.rank)
        if inv is not None and not self._closed and self.runtime.alive:
            self.runtime.submit(inv)

    def _on_inventory(self, sealed: Any, msg: Any) -> None:
        self._inventories[msg.rank] = msg
        if msg.certified and len(self._groups) > 1:
            with self._idle:
                self._idle.notify_all()  # a capture may wait for this group's certificate

    def cluster_inventory(self) -> dict[int, GeminiInventory]:
        """The newest inventory heard from every rank (this one included)."""
        out = dict(self._inventories)
        out[self.rank] = self.inventory()
        return out

    def cluster_plan(self, allowed: set[int] | None = None) -> RecoveryPlan:
        """What a recovery would restore now (only `allowed` steps, if given), from gossiped inventories."""
        inv = self.cluster_inventory()
        return plan_recovery(
            self.world_size,
            {r: set(i.local) for r, i in inv.items()},
            {r: {int(o): set(s) for o, s in i.replicas.items()} for r, i in inv.items()},
            {r: set(i.disk) for r, i in inv.items()},
            allowed=allowed,
        )

    # -- session component ------------------------------------------------------------------------
    def newest_recoverable_step(self, mode: Any) -> int:
        """The newest step every rank can load, as far as this rank has heard.

        With `mode == "recovery_verified"`, only steps that `certifier` (SCOUT) certified count."""
        allowed = None
        if str(getattr(mode, "value", mode)) == "recovery_verified":
            if self.certifier is None:
                return -1
            allowed = {s for i in self.cluster_inventory().values() for s in i.local if self.certifier(s)}
        if len(set(self._inventories) | {self.rank}) < self.world_size:
            if self.world_size > 1:
                return -1
            steps = [s for s in self._own_step.values() if allowed is None or s in allowed]
            return max(steps, default=-1)
        return self.cluster_plan(allowed).step

    def _take_waiting(self) -> None:
        """SIGTERM (the worker group is being stopped) while the training thread waits in capture()
        for a verdict: the handler runs on that thread, inside the wait, and the process ends after
        it. The capture is taken now, without the verdict, rather than lost."""
        if self._waiting is None or threading.get_ident() != self._training_thread:
            return
        with self._lock:
            step, self._waiting = self._waiting, None
        if step is not None:
            self._capture_from_hook(step, wait_for_verdict=False)

    def flush_for_restart(self, timeout: float = 30.0, replicate: bool = True) -> int:
        """Write the newest committed capture to disk, and the older one unless every rank is known
        to hold the newest; return the newest step written, or -1 (nothing, or the disk failed).

        First every capture handed to the worker is committed, replicated and its inventory
        published (`drain`). Without `replicate` (SIGTERM: the process ends next), committed and
        published only: a replica to a peer that is being stopped too (or is gone) could hold the
        flush until `timeout`, and the group's restart with it."""
        self._take_deferred()
        self._take_waiting()
        deadline = time.monotonic() + timeout
        flush = self.flush_inventory
        # A SIGTERM's handler runs on the training thread, possibly in the middle of a capture's
        # copy: that capture goes on only after the handler returns (never, as the process ends
        # next). Waiting for it would hold the flush, and the group's restart, for `timeout`.
        copying = self._copying
        interrupted = copying[1] if copying is not None and copying[0] == threading.get_ident() else None
        if replicate and interrupted is None:
            self.drain(timeout)
        else:
            with self._idle:
                self._idle.wait_for(
                    lambda: all(
                        self._announced.get(k) == s for k, s in self._in_flight.items() if k != interrupted
                    ),
                    timeout,
                )
            if flush is not None:  # the torchrun backend's leader picks the restart step from it
                flush(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not self._own_step or self._released:
                return -1
            # Newest first; then the older capture too, unless every rank is known to hold the
            # newest: a signal finds some ranks one capture ahead of others, and the restart needs
            # a step every rank wrote (without it, the one before: a whole disk interval back).
            held = sorted(self._own_step.items(), key=lambda kv: kv[1], reverse=True)
            self._flushing.update(k for k, _ in held)
        try:
            written = []
            # A restart that must restore a recovery-verified step (an SDC was found) needs the
            # older one, certified, whoever holds the newest: after an SDC at step 16 every rank
            # flushed 17 and some not 15, and a relaunch on fresh nodes restored the corruption.
            verified_next = self.noted_restart_mode() == "recovery_verified"
            for i, (k, step) in enumerate(held):
                if i and not verified_next and self.cluster_plan().step >= held[0][1]:
                    break  # (gossip says every rank holds the newest: the restart needs no other)

                def write(slot: SlotFile, step: int = step) -> None:
                    if self._write_durable(slot, slot.read_header()):
                        written.append(step)

                try:  # (a restarted rank holds the copies its scan found before it maps the slots)
                    self._on_own_slot(k, write)
                except CorruptSlot as exc:
                    log.warning("rank %d: step %d not flushed to disk: %s", self.rank, step, exc)
            if written:  # the disk copies published too: for a node whose memory goes next
                self._announce()
                if flush is not None:
                    flush(max(0.0, deadline - time.monotonic()))
            return max(written, default=-1)
        finally:
            with self._lock:
                self._flushing.difference_update(k for k, _ in held)
                self._idle.notify_all()

    def settle(self, timeout: float = 60.0) -> bool:
        """Wait until the captures already taken are committed and replicated (and checked again,
        with `verify_integrity`); unlike `drain`, a capture still waiting for the loop's post-step
        work (its scheduler, the next fetch) is left waiting, so the step's content is unchanged."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy and not self._scrubbing, timeout)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every capture handed to the worker is committed, replicated and published
        (the inventory sent on, where a sink such as the torchrun backend's control store takes it),
        and the held copies checked again after it (`verify_integrity`)."""
        self._take_deferred()
        deadline = time.monotonic() + timeout
        if not self.settle(timeout):
            return False
        flush = self.flush_inventory
        return flush is None or flush(max(0.0, deadline - time.monotonic()))

    def held_bytes(self) -> int:
        total = 0
        for p in self.dir.glob("*"):
            with contextlib.suppress(FileNotFoundError):  # a peer rank dropping its old slots
                total += p.stat().st_size
        return total

    def close(self) -> None:
        if self._closed:
            return
        self._take_deferred()
        self._closed = True
        self.iterators.uninstall()
        for h in self._hooks:
            h.remove()
        for obj, base, _ in self._observed_steps:
            obj.__class__ = base
        self.drain(timeout=10.0)
        self._jobs.put(None)
        self._worker.join(timeout=5.0)
        self._rx.put(None)
        self._rx_thread.join(timeout=5.0)
        for pool in (self._hash_pool, self._verify_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        with self._lock:
            self._released = True  # a SIGTERM from here on has nothing to flush (see flush_for_restart)
        self._views.clear()  # (views export the mappings: a mapping with one cannot be closed)
        for mapping in self._pinned.values():
            if self._copier is not None:
                self._copier.unregister_host(mapping)
        self._pinned.clear()
        if self._worker.is_alive() or self._rx_thread.is_alive():
            # Still committing or receiving (a transfer that outlived the waits above): unmapping
            # its slots under it would fail its commit, or crash the process reading them. The
            # mappings end with the process.
            log.warning(
                "rank %d: closed while a commit or transfer still ran; its slots stay mapped", self.rank
            )
        else:
            for slot in self._own:
                slot.close()
            for slots in self._replica_slots.values():
                for slot in slots:
                    slot.close()
        owner = self.dir / f".owner-r{self.rank}"
        if owner_pid(owner) == os.getpid():  # the copies stay for a restart; the claim ends here
            owner.unlink(missing_ok=True)

    def claim(self, stale_after_s: float = 3600.0) -> None:
        """Record this process as an owner of the node directory; reclaim runs that are over."""
        pid = owner_pid(self.dir / f".owner-r{self.rank}")
        if pid > 0 and pid != os.getpid() and pid_alive(pid):
            # A worker of an earlier generation is gone by now; a live one is another job that runs
            # under the same run id on this node (torchrun's default run id is "none" for every
            # job), and the two would overwrite each other's copies. This job keeps its copies in a
            # folder of its own: it trains and checkpoints on, but a restart of it cannot find them
            # (peer replicas and disk still serve it).
            private = self.dir.parent.with_name(f"{self.dir.parent.name}.pid{os.getpid()}") / self.dir.name
            log.warning(
                "rank %d: another live process (pid %d) holds this rank's in-memory checkpoints of run %r "
                "on this node; this job keeps its own in %s, which a restart will not find. Give each "
                "concurrent job its own run id (torchrun --rdzv-id, LM_RESILIENCY_RUN_ID or "
                "InMemoryCkptConfig.run_id)",
                self.rank,
                pid,
                self.run_id,
                private,
            )
            self.dir = private
            self._own = self._own_slots()
        write_owner(self.dir, self.rank)
        for u in reclaim_stale_runs(self.dir.parent.parent, stale_after_s, keep_run=self.dir.parent.name):
            log.info(
                "reclaimed %d bytes of stale run %s (node %s, idle %.0fs)", u.bytes, u.run, u.node, u.idle_s
            )

    def _map(self, slot: SlotFile, size: int, *, checked: bool = False) -> None:
        """`slot.ensure_size(size, checked=checked)`; when the shared-memory folder is full, reclaim the
        copies of other runs that no live process owns and that have not changed for `PRESSURE_IDLE_S`, then
        try once more. A job that ended minutes ago (whose copies wait an hour for a restart that may come) no
        longer keeps the next job on the node from starting. A run whose worker group is being restarted right
        now changed seconds ago: its copies stay."""
        try:
            slot.ensure_size(size, checked=checked)
            return
        except SharedMemoryError as exc:
            if getattr(exc.__cause__, "errno", None) != errno.ENOSPC:
                raise
            freed = reclaim_stale_runs(self.dir.parent.parent, PRESSURE_IDLE_S, keep_run=self.dir.parent.name)
            if not freed:
                raise
            log.warning(
                "rank %d: shared memory is full; reclaimed copies no live process owns: %s",
                self.rank,
                ", ".join(
                    f"run {u.run} node {u.node} ({u.bytes} bytes, idle {u.idle_s:.0f}s)" for u in freed
                ),
            )
        slot.ensure_size(size)

    def _own_slots(self) -> list[SlotFile]:
        """This rank's two (double-buffered) capture slots in the node directory."""
        return [SlotFile(self.dir / f"own-r{self.rank}-s{k}") for k in (0, 1)]

    def reclaim(self) -> None:
        """Delete this node's slots of this run (a fresh run must not find an old one's state)."""
        for path in [*self.dir.glob(f"own-r{self.rank}-s*"), *self.dir.glob(f"replica-r*-h{self.rank}-s*")]:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # an earlier run's trust level is not this one's
            self._mode_path().unlink(missing_ok=True)

    def set_aside_earlier(self) -> None:
        """A fresh start: this rank's copies on disk under this run id are an earlier launch's (the
        same `--rdzv-id` again). Set aside, so that a restart of this launch never restores them
        (it restored an earlier experiment's step 15 into a new one that lost a worker at step 8),
        with a word on how to resume them instead."""
        try:
            steps = self.durable.set_aside_earlier()
        except DurableError as exc:
            log.warning("rank %d: %s; a restart of this launch may restore them", self.rank, exc)
            return
        if steps:
            (log.warning if self.rank == 0 else log.info)(
                "rank %d: %s holds this rank's copies of steps %s from an earlier launch of run %r. This "
                "launch starts afresh (generation 0, the run id not named) and never restores them; to "
                "resume them instead, launch with LM_RESILIENCY_RUN_ID=%s (or InMemoryCkptConfig.run_id)",
                self.rank,
                self.durable.root,
                steps,
                self.run_id,
                self.run_id,
            )
