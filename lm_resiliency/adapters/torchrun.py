"""`torchrun --rdzv-backend=lm_resiliency`: our own rendezvous handler with a leader-elected agent.

Every agent runs the same code. One JSON document in the control store (`core/rendezvous/state.py`)
holds the rendezvous and changes only by compare-and-set; a background "pulse" thread per agent bumps
this node's heartbeat counter, judges the others' counters on its own monotonic clock, elects a
leader when the leader's counter stalls, and -- on the leader -- turns lost nodes, worker exits and
agreed SCOUT verdicts into the next generation (same-node restart, or quarantine and admission of
the oldest live standby), choosing the step every rank restores from the GEMINI inventories the
workers publish. `num_nodes_waiting()` tells torchrun to restart the local workers when a restart
began or a newer generation is out.

The control store is a TCPStore hosted by a small detached process (`lm_resiliency.runtime.store_host`)
that outlives any one agent, so the leader's agent can die without taking the store with it; it exits
when the run closes or every heartbeat stopped. Losing the store's host machine is not survived.

Each generation, slot 0's agent serves a fresh worker TCPStore on a kernel-chosen port
(`use_agent_store`), so no worker ever reads a dead peer's address from an earlier generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any


def rendezvous_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: called with no arguments, returns the creator.

    Defined before torch's rendezvous package is imported: that import loads every
    `torchrun.handlers` entry point, this one too, and when this module is the first to import it
    (a script's `import lm_resiliency.adapters.torchrun`, a `RunManager`, `lm-resiliency monitor`)
    it finds this module half-initialized. So the entry point exists by then, and the creator it
    returns looks `create_handler` up when torchrun calls it."""
    return lambda params: create_handler(params)


# (After the entry point, on purpose: see rendezvous_handler_creator.)
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # noqa: E402
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402

from lm_resiliency._proc import StoppedMates, continue_stopped_children  # noqa: E402
from lm_resiliency.config import DAMAGE_FAILURES, DEFAULT_RESTART_IN_PLACE_ON, REPLACE_ONLY_FAILURES  # noqa: E402
from lm_resiliency.core.gemini.recovery import memory_checkpoint_id, plan_recovery, verified_steps  # noqa: E402
from lm_resiliency.core.rendezvous import state as rs  # noqa: E402
from lm_resiliency.core.scout.replay import DROPPED  # noqa: E402
from lm_resiliency.core.scout.verdicts import PEERS_WAIT, desync_in_trails  # noqa: E402
from lm_resiliency.runtime.control import exit_doc, exits_key, finished_key, named_key  # noqa: E402
from lm_resiliency.runtime.trail import read_trails  # noqa: E402

__all__ = ["BACKEND", "LmResiliencyRendezvousHandler", "create_handler", "rendezvous_handler_creator"]

log = logging.getLogger(__name__)

BACKEND = "lm_resiliency"
_OURS = {
    "lm_resiliency_restart_context_path": str,
    "lm_resiliency_worker_config": str,
    "lm_resiliency_join_timeout_ms": int,
    "lm_resiliency_poll_interval_ms": int,
    "lm_resiliency_heartbeat_timeout_ms": int,
}
_TORCH = {
    "store_type",
    "read_timeout",
    "timeout",
    "is_host",
    "join_timeout",
    "last_call_timeout",
    "local_addr",
}
_DEFAULTS = {
    "lm_resiliency_join_timeout_ms": 300_000,
    "lm_resiliency_poll_interval_ms": 250,
    "lm_resiliency_heartbeat_timeout_ms": 10_000,
}
# Failure kinds whose culprit node is quarantined and replaced by a standby (the rest restart in place).
# RecoveryPolicyConfig's
DEFAULT_REPLACE_ON = ("sdc", "hardware", "node_lost", "network_partition", "collective_desync")
# Failure kinds of corrupted state (or the device that holds it): a restart for them restores a
# recovery-verified step, and no restart's SIGTERM makes one.
STATE_FAILURES = frozenset({"sdc", "stale_state", "hardware"})
CONTROL_ENV = "LM_RESILIENCY_CONTROL_STORE"
# torch's exit barrier (torch.distributed.elastic.utils.store.barrier under the agent's
# "torchelastic/agent/terminal_state" prefix): agents whose workers ended count themselves, and the
# last sets the other key.
_TERMINAL_KEY = "torchelastic/agent/terminal_state/num_members"
_TERMINAL_LAST_KEY = "torchelastic/agent/terminal_state/last_member"


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return LmResiliencyRendezvousHandler(params)


def _bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "y", "t"):
        return True
    if text in ("0", "false", "no", "n", "f"):
        return False
    raise ValueError(f"--rdzv-conf {name}={raw!r}: expected true or false")


def parse_conf(config: dict[str, Any]) -> dict[str, Any]:
    """Validate `--rdzv-conf`; ValueError naming the bad key."""
    out: dict[str, Any] = dict(_DEFAULTS)
    for key, raw in config.items():
        if key in _OURS:
            tp = _OURS[key]
            if tp is int:
                try:
                    value = int(raw)
                except (TypeError, ValueError):
                    raise ValueError(f"--rdzv-conf {key}={raw!r}: expected an integer") from None
                if value <= 0:
                    raise ValueError(f"--rdzv-conf {key}={raw!r}: must be > 0")
                out[key] = value
            else:
                out[key] = str(raw)
        elif key in _TORCH:
            out[key] = raw
        else:
            known = ", ".join(sorted({*_OURS, *_TORCH}))
            raise ValueError(f"--rdzv-conf: unknown key {key!r} (known: {known})")
    if not out.get("lm_resiliency_restart_context_path"):
        raise ValueError("--rdzv-conf lm_resiliency_restart_context_path is required (a per-node JSON path)")
    store_type = str(out.get("store_type", "tcp")).lower()
    if store_type not in ("tcp", "file"):
        raise ValueError(f"--rdzv-conf store_type={store_type!r}: expected tcp or file")
    out["store_type"] = store_type
    if "is_host" in out:
        out["is_host"] = _bool("is_host", out["is_host"])
    for key in ("read_timeout", "timeout"):
        if key in out:
            try:
                out[key] = float(out[key])
            except (TypeError, ValueError):
                raise ValueError(f"--rdzv-conf {key}={out[key]!r}: expected seconds") from None
    return out


def policy_digest(path: str | None) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Digest of the parsed worker policy (whitespace and key order do not matter), its failure
    kinds that replace a node, and the kinds a job trains on through that restart it in place."""
    if not path:
        return "", DEFAULT_REPLACE_ON, DEFAULT_RESTART_IN_PLACE_ON
    from lm_resiliency.config import load_policy, policy_to_dict

    policy = load_policy(path)
    canon = json.dumps(policy_to_dict(policy), sort_keys=True, separators=(",", ":"))
    recovery = policy.recovery
    return (
        hashlib.sha256(canon.encode()).hexdigest(),
        tuple(recovery.replace_node_on),
        tuple(recovery.restart_in_place_on),
    )


def node_identity() -> str:
    from lm_resiliency.config import read_environment

    return read_environment().node_id()


def write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    """tmp + fsync + rename, mode 0600: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(doc, indent=2, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _Control:
    """The control store and our keys in it."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = store
        self.prefix = f"lmr/{run_id}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def read(self) -> tuple[bytes, rs.RdzvState] | None:
        k = self.key("state")
        if not self.store.check([k]):
            return None
        raw = self.store.get(k)
        return raw, rs.decode(raw)

    def update(self, fn: Callable[[rs.RdzvState], rs.RdzvState]) -> rs.RdzvState:
        """Apply `fn` by compare-and-set until it sticks (or `fn` changes nothing)."""
        k = self.key("state")
        for _ in range(1000):
            got = self.read()
            if got is None:
                raise RendezvousError("the rendezvous state is missing from the control store")
            raw, cur = got
            new = fn(cur)
            if new == cur:
                return cur
            enc = rs.encode(new)
            if self.store.compare_set(k, raw.decode(), enc) == enc.encode():
                return new
        raise RendezvousError("could not update the rendezvous state (too much contention)")

    def init(self, fresh: rs.RdzvState) -> rs.RdzvState:
        k = self.key("state")
        got = self.store.compare_set(k, "", rs.encode(fresh))
        return rs.decode(got)

    def beat(self, node: str) -> int:
        return int(self.store.add(self.key(f"hb/{node}"), 1))

    def counter(self, node: str) -> int:
        return int(self.store.add(self.key(f"hb/{node}"), 0))

    def json_get(self, name: str) -> Any:
        k = self.key(name)
        if not self.store.check([k]):
            return None
        try:
            return json.loads(self.store.get(k))
        except ValueError:
            log.warning("ignoring a malformed %s in the control store", name)
            return None


def _local_host(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        return True
    try:
        mine: set[Any] = {socket.gethostname(), socket.getfqdn()}
        mine |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return host in mine or bool(mine & theirs)


def connect_control_store(conf: dict[str, Any], endpoint: str, run_id: str, join_timeout_s: float) -> Store:
    """A client of the run's control store; starts the detached store host when there is none."""
    read_timeout = timedelta(seconds=float(conf.get("read_timeout", 60.0)))
    if conf["store_type"] == "file":
        from torch.distributed import FileStore  # type: ignore[attr-defined]

        if not endpoint:
            raise ValueError("--rdzv-endpoint must name the store file with store_type=file")
        store: Store = FileStore(endpoint, -1)
        store.set_timeout(read_timeout)
        return store
    host, _, port_s = endpoint.rpartition(":")
    if not host or not port_s.isdigit():
        raise ValueError(f"--rdzv-endpoint={endpoint!r}: expected HOST:PORT")
    port = int(port_s)
    may_host = bool(conf.get("is_host", _local_host(host)))
    deadline = time.monotonic() + join_timeout_s
    spawned = False
    while True:
        if _port_open(host, port):
            try:
                store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=read_timeout)
                store.set_timeout(read_timeout)
                return store
            except (RuntimeError, TimeoutError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise RendezvousError(f"cannot reach the control store at {endpoint}: {exc}") from exc
        elif may_host and not spawned:
            spawned = True
            _spawn_store_host(host, port, run_id)
        if time.monotonic() > deadline:
            raise RendezvousError(f"no control store answers at {endpoint} (lm_resiliency_join_timeout_ms)")
        time.sleep(0.05)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _spawn_store_host(host: str, port: int, run_id: str) -> None:
    bind = "0.0.0.0" if host not in ("localhost", "127.0.0.1") else host
    # Not a worker: it must not die with this agent, nor be instrumented.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LM_RESILIENCY_AGENT_PID", "LM_RESILIENCY_WORKER_CONFIG")
    }
    # (LM_RESILIENCY_STORE_HOST_PYTHON: a launcher's own interpreter for it, one with torch imported
    # already, say: the test suite's forks; else this agent's)
    python = os.environ.get("LM_RESILIENCY_STORE_HOST_PYTHON") or sys.executable
    subprocess.Popen(
        [python, "-m", "lm_resiliency.runtime.store_host", bind, str(port), run_id],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives this agent: the leader may die, the store must not
        close_fds=True,
        env=env,
    )


class _WorkerExits(logging.Handler):
    """The first failure of this agent's worker group, as torch logs it when its process context
    finds a worker ended failing (`failed (exitcode: E) local_rank: L (pid: P) ...`, its first
    three arguments): torch hands a rendezvous handler nothing of why the workers stopped. Read by
    `next_rendezvous` after the workers stopped (`take`). One per agent process."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"
    _installed: _WorkerExits | None = None

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self._lock_exits = threading.Lock()
        self._seen: list[tuple[int, int, int, float]] = []  # (local rank, exit code, pid, wall time)

    @classmethod
    def install(cls) -> _WorkerExits:
        if cls._installed is None:
            cls._installed = cls()
            logging.getLogger(cls.LOGGER).addHandler(cls._installed)
        return cls._installed

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if not str(record.msg).startswith("failed (exitcode: ") or not isinstance(args, tuple):
            return
        try:
            code, local, pid = (int(a) for a in args[:3])  # type: ignore[call-overload]
        except (TypeError, ValueError):  # (fewer than three unpacks as a ValueError)
            return
        with self._lock_exits:
            self._seen.append((local, code, pid, record.created))

    def take(self) -> tuple[int, int, int, float] | None:
        """The first failure logged since the last call (None: the workers were stopped, not failed)."""
        with self._lock_exits:
            seen, self._seen = self._seen, []
        return min(seen, key=lambda x: x[3]) if seen else None


def _agent_logging() -> None:
    """The agent's decisions are what an operator reads: show them unless logging is configured."""
    ours = logging.getLogger("lm_resiliency")
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lm_resiliency %(asctime)s] %(levelname)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


class LmResiliencyRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, node_id: str | None = None) -> None:
        _agent_logging()
        if params.backend != BACKEND:
            raise ValueError(f"backend {params.backend!r} is not {BACKEND!r}")
        self.params = params
        self.conf = parse_conf(dict(params.config))
        self.run_id = params.run_id
        self.min_nodes, self.max_nodes = params.min_nodes, params.max_nodes
        self.node_id = node_id or node_identity()
        self.addr = params.local_addr or self.conf.get("local_addr") or socket.gethostname()
        self.poll_s = self.conf["lm_resiliency_poll_interval_ms"] / 1000.0
        self.heartbeat_timeout_s = self.conf["lm_resiliency_heartbeat_timeout_ms"] / 1000.0
        self.join_timeout_s = self.conf["lm_resiliency_join_timeout_ms"] / 1000.0
        self.context_path = Path(self.conf["lm_resiliency_restart_context_path"])
        self.worker_config = self.conf.get("lm_resiliency_worker_config")
        self.policy_digest, self.replace_on, self.restart_on = policy_digest(self.worker_config)
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or _nproc_from_argv()
        # Who this agent is, for the node id it claims in the run (see _claim_node_id).
        self.refused_seen = ""  # the last agent refused this node's id that was logged here
        self.claim = json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "addr": self.addr,
                "nonce": os.urandom(6).hex(),
            },
            sort_keys=True,
        )
        self._control: _Control | None = None
        self._pulse: _Pulse | None = None
        self._held = -1  # the first rank whose in-memory checkpoints of the run this node holds
        self._generation = -1  # the generation this agent's workers belong to
        self._trails: Path | None = None  # see _trail_dir
        self._slot: int | None = None
        self._first_rank = 0  # the global rank of this node's local rank 0 in its generation
        self._exits = _WorkerExits.install()
        self._worker_store: TCPStore | None = None
        self._agent_store: Store | None = None
        self._ended_checked_at = float("-inf")  # when _end_if_others_ended last read the exit barrier
        self._closed = False
        self._copies: Any = None  # this node's replicas served to other nodes (_serve_copies)
        self._stopped = False  # _stop ran
        self.timings: list[float] = []  # seconds spent in each next_rendezvous that returned

    # -- torchrun's interface -------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to the fresh per-generation store as clients

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        t0 = time.monotonic()
        control = self._connect()
        if self._pulse is None:
            self._claim_node_id(control)
            self._held = self._held_rank()
            try:
                control.update(
                    lambda s: rs.register(
                        s, self.node_id, self.addr, self.local_world_size, self.policy_digest, self._held
                    )
                )
            except rs.RendezvousRefused as exc:
                raise RendezvousError(f"[{exc.code}] {exc}") from exc
            self._pulse = _Pulse(self)
            self._pulse.start()
            self._serve_copies(control)
            log.info("node %s registered with run %s", self.node_id, self.run_id)
            # Trails of an earlier launch of the run (an agent that was killed leaves them) would
            # read as this one's where a worker starts no new one.
            with contextlib.suppress(Exception):
                shutil.rmtree(self._trail_dir(), ignore_errors=True)
        else:
            gen = self._generation
            self._publish_trails(control, gen)
            self._publish_exit(control, gen)
            self._end_if_others_ended(control)
            control.update(lambda s: rs.arrive(s, self.node_id, gen))
        self._close_worker_store()
        state = self._wait_for_assignment(control, t0)
        return self._assign(control, state, t0)

    def is_closed(self) -> bool:
        got = self._safe_read()
        return got is not None and got.phase == rs.CLOSED

    def set_closed(self) -> None:
        if self._control is not None:
            self._control.update(rs.close)

    def num_nodes_waiting(self) -> int:
        """1 when this agent must restart its workers: a restart began or a newer generation is out."""
        pulse = self._pulse
        s = pulse.state if pulse is not None else None
        if s is None or self._generation < 0:
            return 0
        if (
            s.generation > self._generation
            or (s.phase == rs.RESTARTING and s.pending.get("from_generation") == self._generation)
            or (s.phase == rs.CLOSED and s.pending.get("gave_up"))  # the next rendezvous says why
        ):
            self.continued_stopped_workers(continue_stopped_children())
            return 1
        return 0

    def continued_stopped_workers(self, pids: list[int]) -> None:
        """torchrun stops the workers next (SIGTERM): a worker someone SIGSTOPped would take it only
        after torchrun's shutdown timeout, as a SIGKILL, and flush nothing. Or the job's other
        ranks have ended their scripts, and nobody waits for it any more. These were continued
        first: say so."""
        for pid in pids:
            log.warning(
                "node %s: worker pid %d was stopped (SIGSTOP/SIGTSTP); continued it so that it takes "
                "the restart's SIGTERM, or ends with the job",
                self.node_id,
                pid,
            )

    def shutdown(self) -> bool:
        """Close the run when this generation's agents all passed torch's exit barrier (success).
        When the agent exits failing (torchrun's restarts used up: `ChildFailedError`; torchrun
        calls this from the `finally` of its launch, the exception in flight) the node leaves the
        run: a standby takes its slot, or the run gives up with the reason. Otherwise only stop
        heart-beating (a signal: torchrun does not call this then)."""
        failed = sys.exc_info()[1]
        if self._stopped:  # (it ended on its own: the run closed, gave up, or its store went)
            return True
        try:
            s = self._safe_read()
            if s is None:
                pass
            elif (
                failed is not None
                and not isinstance(failed, SystemExit)
                and self._generation >= 0
                and s.phase != rs.CLOSED
            ):
                if type(failed).__name__ == "ChildFailedError":
                    reason, why = (
                        "restarts_exhausted",
                        "its workers failed and torchrun's --max-restarts are used up",
                    )
                else:
                    reason, why = (
                        "agent_failed",
                        f"its agent failed: {type(failed).__name__}: {str(failed)[:200]}",
                    )
                assert self._control is not None
                s = self._control.update(lambda cur: rs.leave(cur, self.node_id, reason, why))
                if s.phase == rs.CLOSED and s.pending.get("gave_up"):
                    log.error("run %s gave up: %s", self.run_id, s.pending["gave_up"])
                else:
                    log.warning("node %s left run %s: %s", self.node_id, self.run_id, why)
            elif (
                (failed is None or isinstance(failed, SystemExit))
                and self._agent_store is not None
                and self._control is not None
                and self._slot is not None
            ):
                done = self._agent_store.add(_TERMINAL_KEY, 0)
                if s.generation == self._generation and done >= len(s.slots):
                    self._control.update(rs.close)
                    if s.pending.get("ended_failing"):
                        log.warning(
                            "node %s's workers ended their scripts; run %s ended failing: %s",
                            self.node_id,
                            self.run_id,
                            s.pending["ended_failing"],
                        )
                    else:
                        log.info("run %s closed after generation %d succeeded", self.run_id, s.generation)
                    self._reclaim_memory()
        except Exception:  # shutdown runs on every exit path: never raise from it
            log.exception("closing the rendezvous failed")
        finally:
            self._stop()
        return True

    # -- internals -------------------------------------------------------------------------------

    def _connect(self) -> _Control:
        if self._control is None:
            store = connect_control_store(self.conf, self.params.endpoint, self.run_id, self.join_timeout_s)
            control = _Control(store, self.run_id)
            nonce = f"{self.run_id}-{os.getpid()}-{time.time_ns()}"
            fresh = rs.RdzvState.new(nonce, self.min_nodes, self.max_nodes, self.policy_digest)
            control.init(fresh)
            self._control = control
        return self._control

    def _claim_node_id(self, control: _Control) -> None:
        """Hold this node id in the run for this agent before registering with it. A node id held
        by an agent that still beats is another machine with the same identity (hosts cloned from
        one image carry one /etc/machine-id) or a second torchrun on this host: it is refused with
        the fix, and the holder is told (before, both registered as one node and the run waited
        for its missing nodes without a word). A holder that stopped beating was this node's agent
        before a restart: its claim passes to this one."""
        key = control.key(f"owner/{self.node_id}")
        held = control.store.compare_set(key, "", self.claim).decode()
        while held != self.claim:
            if node_id_in_use(control, self.node_id, max(1.0, 4 * self.poll_s)):
                control.store.set(control.key(f"refused/{self.node_id}"), self.claim)
                why = duplicate_node_id_message(self.node_id, held, self.run_id, "a live agent holds it")
                raise RendezvousError(f"[duplicate_node_id] {why}")
            held = control.store.compare_set(key, held, self.claim).decode()
        refused = control.key(f"refused/{self.node_id}")
        # A refusal some earlier agent of this node was told of is not this one's to repeat.
        self.refused_seen = control.store.get(refused).decode() if control.store.check([refused]) else ""

    def _release_node_id(self) -> None:
        """A clean exit frees the node id: the next agent on this machine need not wait out ours."""
        if self._control is not None and self._pulse is not None:
            with contextlib.suppress(Exception):
                self._control.store.compare_set(self._control.key(f"owner/{self.node_id}"), self.claim, "")

    def _safe_read(self) -> rs.RdzvState | None:
        try:
            got = self._control.read() if self._control is not None else None
        except Exception:
            return None
        return got[1] if got is not None else None

    def _wait_for_assignment(self, control: _Control, t0: float) -> rs.RdzvState:
        announced = False
        role = "unknown"
        while True:
            got = self._read_while_waiting(control, role)
            if got is None:
                raise RendezvousError("the rendezvous state vanished from the control store")
            s = got[1]
            role = rs.role_of(s, self.node_id)
            if self._generation >= 0 and (s.pending.get("ended_failing") or s.generation == self._generation):
                self._end_if_others_ended(control, s)
            if s.phase == rs.CLOSED and s.pending.get("gave_up"):
                self._stop()
                raise RendezvousError(f"run {self.run_id} gave up: {s.pending['gave_up']}")
            if s.phase == rs.CLOSED:
                log.info("run %s closed: node %s (%s) exits", self.run_id, self.node_id, role)
                self._stop()
                self._reclaim_memory()
                raise SystemExit(0)
            if role == "active" and s.phase == rs.RUNNING and s.generation > self._generation:
                return s
            if role == "unknown":  # registered, then dropped (e.g. judged lost while it was slow)
                s = control.update(
                    lambda cur: rs.register(
                        cur, self.node_id, self.addr, self.local_world_size, self.policy_digest, self._held
                    )
                )
                continue
            if role in ("standby", "quarantined") and not announced:
                log.info("node %s parked as %s in run %s", self.node_id, role, self.run_id)
                announced = True
            forming = s.generation < 0
            if forming and role == "active" and time.monotonic() - t0 > self.join_timeout_s:
                raise RendezvousError(
                    f"only {sum(n is not None for n in s.slots)} of {s.min_nodes} nodes joined run "
                    f"{self.run_id} within lm_resiliency_join_timeout_ms"
                )
            time.sleep(self.poll_s / 4)

    def _end_if_others_ended(self, control: _Control, s: rs.RdzvState | None = None) -> None:
        """Raise RendezvousError, the run closed failing, when no restart of this agent's generation
        can form: a node of it ended its scripts (its workers all exited 0), and its agent waits in
        torch's exit barrier, where it reads nothing of ours. So it is when a rank fails longer than
        `RuntimeConfig.finish_wait_s` after the others closed their sessions (an exception in its
        own final upload): before, the restart waited for those nodes for good. This agent closes
        the run (`rs.end_failing`: nobody else is asked to restart; an agent still running ends its
        script), counts itself in the exit barrier so that the ended nodes exit 0 once every node
        has, and fails saying why. Done also where another failed agent closed the run so."""
        store = self._agent_store
        if store is None or self._generation < 0:
            return
        if s is None:
            got = control.read()
            if got is None:
                return
            s = got[1]
        why = s.pending.get("ended_failing")
        if not why:
            now = time.monotonic()
            if s.generation != self._generation or now < self._ended_checked_at + self.poll_s:
                return  # (a newer generation formed: the restart reached everyone)
            self._ended_checked_at = now
            ended = store.add(_TERMINAL_KEY, 0)
            if ended <= 0:
                return
            why = (
                f"node {self.node_id}'s workers failed after {ended} node(s) of generation "
                f"{self._generation} had ended their scripts (their agents wait in torch's exit "
                f"barrier, which no restart reaches), so run {self.run_id} ends failing; the ranks "
                f"that ended saved what their scripts saved (see RuntimeConfig.finish_wait_s)"
            )
            gen = self._generation
            s = control.update(lambda cur: rs.end_failing(cur, why) if cur.generation == gen else cur)
            if s.pending.get("ended_failing") != why:
                return  # (a newer generation formed meanwhile)
        if store.add(_TERMINAL_KEY, 1) >= len(s.slots):
            store.set(_TERMINAL_LAST_KEY, "<val_ignored>")
        log.error("run %s: %s", self.run_id, why)
        self._stop()
        raise RendezvousError(str(why))

    def _read_while_waiting(self, control: _Control, role: str) -> tuple[bytes, rs.RdzvState] | None:
        """The state, read by an agent waiting for its part. Its store may be gone: the store host
        exits a few seconds after the run closes, and an agent that was not answering then (stopped,
        swapped out) wakes to find it gone. A standby has no workers whose outcome it owes: it says
        so and exits 0. An agent whose workers ran cannot tell how the run ended: it fails, saying
        so. A store that still answers on its port is retried until the read timeout."""
        deadline: float | None = None
        while True:
            try:
                return control.read()
            except Exception as exc:  # torch's DistNetworkError / DistStoreError, RuntimeError
                now = time.monotonic()
                deadline = (
                    deadline if deadline is not None else now + float(self.conf.get("read_timeout", 60.0))
                )
                if self._store_answers() and now < deadline:
                    time.sleep(self.poll_s)
                    continue
                why = (
                    f"the control store at {self.params.endpoint} is gone ({type(exc).__name__}: {exc}); "
                    f"it closes a few seconds after the run ends, so run {self.run_id} ended, or its "
                    f"store host died, while node {self.node_id} was not answering"
                )
                self._stop()
                if role in ("standby", "quarantined"):
                    log.warning(
                        "%s: node %s was parked as %s with no workers; it exits", why, self.node_id, role
                    )
                    raise SystemExit(0) from None
                raise RendezvousError(
                    f"{why}. This node cannot tell how run {self.run_id} ended: the other nodes' logs say"
                ) from exc

    def _store_answers(self) -> bool:
        if self.conf["store_type"] != "tcp":
            return os.path.exists(self.params.endpoint)
        host, _, port = self.params.endpoint.rpartition(":")
        return _port_open(host, int(port))

    def _assign(self, control: _Control, s: rs.RdzvState, t0: float) -> RendezvousInfo:
        slot = s.slot_of(self.node_id)
        assert slot is not None
        gen = s.generation
        master_key = f"worker_master/g{gen}"
        if slot == 0:
            self._worker_store = TCPStore(self.addr, 0, is_master=True, wait_for_workers=False)
            control.store.set(control.key(master_key), f"{self.addr}:{self._worker_store.port}")
        deadline = time.monotonic() + self.join_timeout_s
        while not control.store.check([control.key(master_key)]):
            cur = control.read()
            if cur is not None and (cur[1].generation != gen or cur[1].phase == rs.CLOSED):
                return self.next_rendezvous_again(control, t0)
            if time.monotonic() > deadline:
                raise RendezvousError(f"slot 0 never published the worker store of generation {gen}")
            time.sleep(self.poll_s / 4)
        host, _, port = control.store.get(control.key(master_key)).decode().rpartition(":")
        self._generation, self._slot, self._first_rank = gen, slot, s.first_global_rank(slot)
        self._exits.take()  # (a failure logged before this generation's workers started is not theirs)
        self._agent_store = PrefixStore(control.key(f"agent/g{gen}/"), control.store)
        self._publish_context(s, slot)
        self.timings.append(time.monotonic() - t0)
        log.info(
            "node %s: generation %d, slot %d of %d (rendezvous %.3f s)",
            self.node_id,
            gen,
            slot,
            len(s.slots),
            self.timings[-1],
        )
        return RendezvousInfo(self._agent_store, slot, len(s.slots), RendezvousStoreInfo(host, int(port)))

    def next_rendezvous_again(self, control: _Control, t0: float) -> RendezvousInfo:
        """The generation moved on while we waited for its worker store: take the newer one."""
        state = self._wait_for_assignment(control, t0)
        return self._assign(control, state, t0)

    def _publish_context(self, s: rs.RdzvState, slot: int) -> None:
        plan = dict(s.plan)
        step = int(plan.get("checkpoint_step", -1))
        env = os.environ
        env["LM_RESILIENCY_GENERATION"] = str(s.generation)
        env["LM_RESILIENCY_NODE_ID"] = self.node_id
        env["LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"] = str(max(step, 0))
        env[CONTROL_ENV] = _store_address(self.conf, self.params.endpoint)
        env["LM_RESILIENCY_AGENT_PID"] = str(os.getpid())
        boot = str(Path(__file__).resolve().parent.parent / "_boot")
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
        env["PYTHONPATH"] = os.pathsep.join([boot, *paths])
        if self.worker_config:
            env["LM_RESILIENCY_WORKER_CONFIG"] = str(Path(self.worker_config).resolve())
        with contextlib.suppress(Exception):  # a policy unreadable now fails the workers with its message
            env["LM_RESILIENCY_TRAIL_DIR"] = str(self._trail_dir())
        if s.generation == 0:  # no context in generation 0: a stale file from another run must go
            with contextlib.suppress(FileNotFoundError):
                self.context_path.unlink()
            env.pop("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT", None)
            return
        lws = s.nodes[self.node_id].local_world_size
        doc = {
            "schema_version": 1,
            "plan_id": f"{self.run_id}-g{s.generation}",
            "run_id": self.run_id,
            "generation": s.generation,
            "node_id": self.node_id,
            "logical_node_slot": slot,
            "first_global_rank": s.first_global_rank(slot),
            "local_world_size": lws,
            "expected_world_size": s.world_size(),
            "topology_digest": plan.get("topology_digest", ""),
            "recovery_mode": plan.get("recovery_mode", "latest"),
            "checkpoint_source": plan.get("checkpoint_source", "gemini"),
            "checkpoint_step": step,
            "checkpoint_id": plan.get("checkpoint_id", ""),
            "reason_code": plan.get("reason_code", "restart"),
            "failure_kind": plan.get("failure_kind", "process_failure"),
            "failure_kinds": plan.get("failure_kinds", [plan.get("failure_kind", "process_failure")]),
            "culprits": plan.get("culprits", []),
            "error": plan.get("error", ""),
            "admitted": plan.get("admitted", []),
            "worker_exits": plan.get("worker_exits", []),
            "leader": s.leader,
            "term": s.term,
        }
        write_json_atomic(self.context_path, doc)
        env["LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT"] = str(self.context_path.resolve())

    def _publish_exit(self, control: _Control, generation: int) -> None:
        """Which rank of this node ended failing first in `generation`, and how (torch's log of it):
        for the leader's plan (`worker_exits`), whose next generation reports a rank nobody saw go."""
        seen = self._exits.take()
        if seen is None:
            return
        local, code, pid, at = seen
        doc = {
            "rank": self._first_rank + local,
            "local_rank": local,
            "exitcode": code,
            "pid": pid,
            "at": at,
            "node": self.node_id,
        }
        try:
            control.store.set(control.key(exits_key(generation, self.node_id)), json.dumps(doc))
        except Exception as exc:  # the restart goes on without it
            log.warning("node %s: could not publish its workers' exit: %s", self.node_id, exc)

    def _close_worker_store(self) -> None:
        self._worker_store = None  # dropping the server object stops it

    def _memory_of_run(self) -> tuple[str, str]:
        """(shm_dir, run id) of the run's in-memory checkpoints on this node, as the workers name
        them: their run id is our --rdzv-id unless the environment or the policy names one."""
        from lm_resiliency.config import load_policy, read_environment

        env = read_environment()
        run = env.run_id if env.explicit_run_id else self.run_id
        if self.worker_config:
            run = load_policy(self.worker_config).checkpoint.run_id or run
        return env.shm_dir, run

    def _trail_dir(self) -> Path:
        """Where this node's workers write their collective trails (runtime/trail.py): beside the
        run's in-memory checkpoints of this node, in a folder of its own. Found once (it reads the
        policy); raises as `_memory_of_run` does until then."""
        if self._trails is None:
            from lm_resiliency.gemini.durable import path_name

            shm_dir, run = self._memory_of_run()
            self._trails = Path(shm_dir) / path_name(run) / f"{path_name(self.node_id)}.trail"
        return self._trails

    def _publish_trails(self, control: _Control, generation: int) -> None:
        """This node's workers of `generation` stopped: their last collective states go to the
        control store, where the leader compares them before it restarts the job (`_Pulse`)."""
        try:
            trails = read_trails(self._trail_dir(), generation)
            for rank, (group, states) in sorted(trails.items()):
                doc = {"group": group.hex(), "states": [[c, chain.hex()] for c, chain in states]}
                control.store.set(control.key(f"trail/g{generation}/{rank}"), json.dumps(doc))
        except Exception:  # the leader then judges without them: never fail the restart over it
            log.exception("publishing the workers' collective trails failed")

    def _serve_copies(self, control: _Control) -> None:
        """Serve the replicas this node holds of the run to the workers of other nodes, for the
        lifetime of this agent (`gemini/node_copies`: a worker that restores with no session, in a
        node that replaced a lost one, finds its copy there). Never fails the agent: without it,
        such a worker says it could not restore, as before."""
        try:
            from lm_resiliency.gemini.durable import path_name
            from lm_resiliency.gemini.node_copies import NodeCopies, endpoint_key, key_name

            shm_dir, run = self._memory_of_run()
            key = control.store.compare_set(control.key(key_name()), "", os.urandom(32).hex())
            folder = Path(shm_dir) / path_name(run) / path_name(self.node_id)
            self._copies = NodeCopies(folder, bytes.fromhex(key.decode()), self.addr)
            control.store.set(control.key(endpoint_key(self.node_id)), self._copies.endpoint)
        except Exception:
            log.exception("serving this node's in-memory replicas to the other nodes failed")

    def _held_rank(self) -> int:
        """The first rank whose in-memory checkpoints of this run this node holds (a relaunch of
        the run on the same machines), or -1: generation 0 gives the node those ranks again."""
        try:
            from lm_resiliency.gemini.durable import path_name
            from lm_resiliency.gemini.hygiene import held_first_rank

            shm_dir, run = self._memory_of_run()
            held = held_first_rank(shm_dir, path_name(run), path_name(self.node_id))
        except Exception:  # a policy unreadable now fails the workers with its own message
            log.exception("looking for this node's in-memory checkpoints of the run failed")
            return -1
        if held >= 0:
            log.info("node %s holds in-memory checkpoints of run %s from rank %d on", self.node_id, run, held)
        return held

    def _reclaim_memory(self) -> None:
        """The run is over: this node's in-memory checkpoints of it (GEMINI's slots and the replicas
        it holds) go now. Nothing restores from them any more (a new torchrun of the same run id
        starts afresh at generation 0); kept, they held /dev/shm until another job reclaimed them an
        hour later, and a job started on the node before then could find no room for its own."""
        try:
            from lm_resiliency.gemini.durable import path_name
            from lm_resiliency.gemini.hygiene import reclaim_node

            shutil.rmtree(self._trail_dir(), ignore_errors=True)
            shm_dir, run = self._memory_of_run()
            freed = reclaim_node(shm_dir, path_name(run), path_name(self.node_id))
            if freed:
                log.info(
                    "run %s: reclaimed %d bytes of in-memory checkpoints on node %s", run, freed, self.node_id
                )
        except Exception:  # never fail the agent's exit over it: the hour-old reclaim still applies
            log.exception("reclaiming the run's shared memory failed")

    def _stop(self) -> None:
        """This agent is done with the run (once): its pulse stops, and its node id is let go, which
        tells the store host, once the run closed, that it may go (`runtime/store_host`)."""
        if self._stopped:
            return
        self._stopped = True
        if self._pulse is not None:
            self._pulse.stop()
        self._release_node_id()
        self._close_worker_store()
        copies, self._copies = self._copies, None
        if copies is not None:
            copies.close()


def node_id_in_use(control: _Control, node: str, window_s: float) -> bool:
    """Whether an agent registered as `node` beats within `window_s` (live agents beat every poll)."""
    before = control.counter(node)
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        time.sleep(min(0.05, window_s))
        if control.counter(node) != before:
            return True
    return False


def duplicate_node_id_message(node: str, other: str, run_id: str, what: str) -> str:
    """Why two agents cannot both be node `node`; `other` is the other agent's claim, `what` says
    what it did."""
    try:
        who = json.loads(other)
        where = f"host {who['host']}, pid {who['pid']}, address {who['addr']}"
    except (ValueError, KeyError, TypeError):
        where = "an agent that does not say where"
    return (
        f"node id {node!r} in run {run_id}: {what} ({where}). Two agents have one node identity: "
        "give every machine its own /etc/machine-id (hosts cloned from one image share it: delete "
        "it and run systemd-machine-id-setup), or give each agent on one host its own "
        "LM_RESILIENCY_MACHINE_ID_PATH"
    )


def _store_address(conf: dict[str, Any], endpoint: str) -> str:
    return f"{conf['store_type']}://{endpoint}"


def _nproc_from_argv() -> int:
    """torchrun's --nproc-per-node of this agent (the handler is built before workers exist)."""
    argv = sys.argv
    for i, a in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if a == flag and i + 1 < len(argv):
                v = argv[i + 1]
            elif a.startswith(flag + "="):
                v = a.split("=", 1)[1]
            else:
                continue
            if v.isdigit():
                return int(v)
    return 1


class _Pulse:
    """Heartbeats, liveness, election and -- on the leader -- the decisions; one daemon thread."""

    def __init__(self, handler: LmResiliencyRendezvousHandler) -> None:
        self.h = handler
        self.state: rs.RdzvState | None = None
        self._stop_evt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lm-resiliency-rdzv", daemon=True)
        self._liveness = rs.Liveness(handler.heartbeat_timeout_s)
        # A connection of its own: a TCPStore client is not shared across threads.
        self._control: _Control | None = None
        self._verdicts_read = (-1, 0)  # (generation, verdicts of it already applied)
        self._trails_judged = -1  # the last failed generation whose collective trails were compared
        self._kept: set[tuple[int, str, tuple[int, ...]]] = set()  # slow-job verdicts logged as kept
        self._destinations_logged: set[tuple[int, str]] = set()  # restart_destinations not followed
        self._unfilled_since: float | None = None  # a restart waits for a lost node, no standby
        self._told_taken = False  # another agent took this node's id (logged once)
        # A worker that exits makes torchrun stop its siblings; a stopped one must be continued to.
        self._mates = StoppedMates(b"TORCHELASTIC_RUN_ID")  # (torchrun's workers have it)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop_evt.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        h = self.h
        try:
            store = connect_control_store(h.conf, h.params.endpoint, h.run_id, h.join_timeout_s)
        except Exception:
            log.exception("the rendezvous pulse cannot reach the control store")
            return
        self._control = _Control(store, h.run_id)
        failing = 0  # ticks failed in a row: the first is logged with its traceback, the rest counted
        while not self._stop_evt.is_set():
            try:
                h.continued_stopped_workers(self._mates.check(self._job_ending))
            except Exception:
                log.debug("could not look for stopped workers", exc_info=True)
            try:
                self._tick(time.monotonic())
            except Exception as exc:  # the store may be briefly unreachable; keep beating
                if not failing:
                    log.warning("rendezvous pulse failed", exc_info=True)
                else:
                    log.debug("rendezvous pulse failed again: %s", exc)
                failing += 1
            else:
                if failing:
                    log.info(
                        "rendezvous pulse reaches the control store again after %d failed beats", failing
                    )
                failing = 0
            # While a generation forms, decide at 5x the pace: the restart's latency, not the
            # store's load, matters then.
            s = self.state
            busy = s is not None and s.phase in (rs.FORMING, rs.RESTARTING)
            self._stop_evt.wait(h.poll_s / 5 if busy else h.poll_s)

    def _job_ending(self) -> bool:
        """Whether a rank of this node's generation closed its session at its script's end (its
        count in the control store: ControlChannel.finish)."""
        control, gen = self._control, self.h._generation
        if control is None or gen < 0:
            return False
        return int(control.store.add(control.key(finished_key(gen)), 0)) > 0

    def _tick(self, now: float) -> None:
        control = self._control
        assert control is not None
        h = self.h
        control.beat(h.node_id)
        self._check_node_id(control)
        got = control.read()
        if got is None:
            return
        s = got[1]
        for node in s.nodes:
            self._liveness.observe(node, control.counter(node), now)
        live = self._liveness.live(now) | {h.node_id}
        if s.leader != h.node_id:
            if s.leader is None or s.leader not in live:
                s = control.update(lambda cur: rs.elect(cur, h.node_id, live))
                if s.leader == h.node_id:
                    log.info("node %s leads run %s (term %d)", h.node_id, h.run_id, s.term)
            self.state = s
            return
        s = self._lead(control, s, now)
        self.state = s

    def _check_node_id(self, control: _Control) -> None:
        """Say once, in this agent's log too, that another agent has this node's id: one refused
        (it has the error), or one that took the id over while this agent's beats stalled."""
        h = self.h
        refused = control.key(f"refused/{h.node_id}")
        if control.store.check([refused]):
            who = control.store.get(refused).decode()
            if who != h.refused_seen:
                h.refused_seen = who
                what = "another agent asked for it and was refused"
                log.error("%s", duplicate_node_id_message(h.node_id, who, h.run_id, what))
        holder = control.store.compare_set(control.key(f"owner/{h.node_id}"), h.claim, h.claim).decode()
        if holder != h.claim and not self._told_taken:
            self._told_taken = True
            what = "another agent took it over while this agent's heartbeat stalled"
            log.error("%s", duplicate_node_id_message(h.node_id, holder, h.run_id, what))

    def _lead(self, control: _Control, s: rs.RdzvState, now: float) -> rs.RdzvState:
        h = self.h
        dead = self._liveness.dead(now) - {h.node_id}
        for node in sorted(dead):
            if node in s.standbys or s.slot_of(node) is not None:
                log.warning("node %s lost its heartbeat (> %.1f s)", node, h.heartbeat_timeout_s)
                s = control.update(partial(_if_leader, me=h.node_id, fn=rs.mark_dead, args=(node,)))
        s = self._apply_verdicts(control, s)
        s = self._judge_trails(control, s)
        if s.phase in (rs.FORMING, rs.RESTARTING):
            before = s

            def step(cur: rs.RdzvState) -> rs.RdzvState:
                if cur.leader != h.node_id or self._trails_due(cur):
                    return cur
                # Alive unless known dead: a node that registered after this tick's observation has
                # not been seen yet, and must not lose its slot for that.
                alive = {n for n in cur.nodes if n not in dead}
                formed = rs.form(cur, alive)
                if formed.phase != rs.RUNNING:
                    return formed
                return rs.form(cur, alive, self._plan(control, cur, formed))

            s = control.update(step)
            if s.phase == rs.RUNNING and s.generation != before.generation:
                log.info(
                    "run %s: generation %d published (slots %s, plan %s)",
                    h.run_id,
                    s.generation,
                    list(s.slots),
                    dict(s.plan),
                )
                if s.history and s.history[-1].get("kept"):
                    log.warning(
                        "run %s: no standby to replace %s: restarted in place instead",
                        h.run_id,
                        s.history[-1]["kept"],
                    )
        return self._wait_for_lost_nodes(control, s, now)

    def _trails_due(self, s: rs.RdzvState) -> bool:
        """A restart for workers' exits, every node back (their trails published), that this leader
        has not judged yet (`_judge_trails`). Publishing the next generation waits for it: the last
        node may arrive between a tick's read of the state (not every node back: nothing to judge)
        and its update, which then published a process failure of whichever rank gloo aborted,
        never judged (seen in CI: the culprit of a mismatched collective went unnamed)."""
        p = s.pending
        return (
            s.phase == rs.RESTARTING
            and p.get("failure_kind") == "process_failure"
            and p.get("from_generation") == s.generation
            and self._trails_judged != s.generation
            and all(n in s.arrived for n in s.slots if n is not None)
        )

    def _judge_trails(self, control: _Control, s: rs.RdzvState) -> rs.RdzvState:
        """A generation restarted for its workers' exits: once every node's workers stopped (each
        agent published their collective trails as it arrived), see whether a replica had entered
        another collective than its peers. Gloo aborts on a mismatch of sizes within milliseconds,
        often in another rank's process, and the peers die of the broken collective before SCOUT
        compares their chains: the exit named a casualty. The trails name the culprit instead
        (`collective_desync`: replaced, as SCOUT's own verdict is, while a standby can take its
        slot)."""
        h = self.h
        if not self._trails_due(s):
            return s
        self._trails_judged = s.generation
        failed = _as_published(s)
        trails: dict[int, tuple[bytes, list[tuple[int, bytes]]]] = {}
        for r in range(failed.world_size()):
            doc = control.json_get(f"trail/g{s.generation}/{r}")
            try:
                states = [(int(c), bytes.fromhex(chain)) for c, chain in doc["states"]]
                trails[r] = (bytes.fromhex(doc["group"]), states)
            except (TypeError, KeyError, ValueError):
                continue  # absent (its node was lost) or malformed: judged without it
        v = desync_in_trails(trails)
        if v is None:
            return s
        culprits = {n for n in (_node_of_rank(failed, r) for r in v.ranks) if n is not None}
        sure = v.kind == "collective_desync"  # else no majority: every side named, restarted in place
        quarantine = sure and "collective_desync" in h.replace_on and bool(culprits)
        log.warning(
            "run %s: the workers of generation %d exited after ranks %s (%s) entered another collective "
            "than their replicas (%s): %s",
            h.run_id,
            s.generation,
            list(v.ranks),
            sorted(culprits),
            v.reason,
            v.detail,
        )
        args = (s.generation, v.reason, culprits, quarantine)
        return control.update(partial(_if_leader, me=h.node_id, fn=rs.name_desync, args=args))

    def _wait_for_lost_nodes(self, control: _Control, s: rs.RdzvState, now: float) -> rs.RdzvState:
        """A restart that waits for a lost node (no standby for its slot) waits for it to come back
        (its agent restarted on the same machine) for `lm_resiliency_join_timeout_ms`, then gives up:
        every agent fails with the reason instead of waiting for ever."""
        h = self.h
        holes = rs.unfillable_slots(s)
        if not holes:
            self._unfilled_since = None
            return s
        if self._unfilled_since is None:
            self._unfilled_since = now
            log.warning(
                "run %s: slots %s wait for their lost node (no standby): giving up in %.0f s",
                h.run_id,
                holes,
                h.join_timeout_s,
            )
        if now - self._unfilled_since < h.join_timeout_s:
            return s
        why = (
            f"slots {holes} had no node for {h.join_timeout_s:.0f} s (lm_resiliency_join_timeout_ms) "
            "and no standby to take them"
        )
        s = control.update(partial(_if_leader, me=h.node_id, fn=rs.give_up, args=(why,)))
        if s.phase == rs.CLOSED:
            log.error("run %s gave up: %s", h.run_id, why)
        return s

    def _apply_verdicts(self, control: _Control, s: rs.RdzvState) -> rs.RdzvState:
        """Agreed SCOUT verdicts that workers posted: restart, or quarantine the culprits' nodes.

        While the failed generation is being restarted, only a worker's own report of the exception
        it died of is still read (it names why the agent saw the exit), and verdicts of corrupted
        state (`STATE_FAILURES`: an SDC named a moment before a rank was killed). A restart's
        SIGTERM makes none of those, and each needs a certified step and its device out: before, an
        SDC reported while a kill's restart formed was dropped, its node kept and the newest step
        restored (an outsider's run: the flip at step 9, the kill at 10)."""
        h = self.h
        restarting = s.phase == rs.RESTARTING and s.pending.get("from_generation") == s.generation
        if s.phase != rs.RUNNING and not restarting:
            return s
        gen, first = self._verdicts_read
        first = first if gen == s.generation else 0
        n = int(control.store.add(control.key(f"verdicts/g{s.generation}/n"), 0))
        for i in range(first, n):
            v = control.json_get(f"verdicts/g{s.generation}/{i}")
            self._verdicts_read = (s.generation, i + 1)
            if not isinstance(v, dict):
                continue
            kind = str(v.get("kind", "unknown"))
            if s.phase != rs.RUNNING and kind != "process_failure" and kind not in STATE_FAILURES:
                continue  # (a hang, a stall: the restart's own doing, its peers stopped)
            ranks = [int(r) for r in v.get("failed_ranks", []) if isinstance(r, int)]
            # Ranks of the generation that posted it: while it is restarted, the document's slots
            # may have a hole already (a node the first copy quarantined), which shifts the ranks.
            # Before, a second rank's copy of an SDC verdict named another node (a CI run: rank 1
            # taken for the node of slot 2 as well).
            layout = _as_published(s) if s.phase == rs.RESTARTING else s  # (s changes in this loop)
            culprits = {n for n in (_node_of_rank(layout, r) for r in ranks) if n is not None}
            quarantine = _quarantines(v, h.replace_on) and bool(culprits)
            quarantine, dest = self._destination(s, v, culprits, quarantine)
            if quarantine and kind == "sdc" and culprits >= {n for n in layout.slots if n is not None}:
                # Corruption named on every node (two lone replicas of two nodes): each node's
                # replicas are held by the others, so new nodes in every slot would find no copy in
                # memory and start over from disk or step 0. The nodes keep their slots and restart
                # from the verified step; a device that corrupts again is named again (and then
                # has healthy nodes beside it to take the copies from).
                log.warning(
                    "run %s: sdc named on every node %s: replacing them all would leave no in-memory "
                    "copy to resume from; restarting in place from a recovery-verified step",
                    h.run_id,
                    sorted(culprits),
                )
                quarantine, dest = False, ""
            if quarantine and kind == "network_partition" and len(s.standbys) < len(culprits):
                # A node cut off from its peers' messages may be reachable again after a restart
                # (a link that flapped); without a standby to take its slot, it keeps the slot.
                log.warning(
                    "run %s: node %s unreachable and no standby: restarting in place", h.run_id, culprits
                )
                quarantine = False
            fn: Callable[..., rs.RdzvState] = rs.request_restart
            trains_on = kind in DAMAGE_FAILURES or (
                kind in REPLACE_ONLY_FAILURES and not str(v.get("reason", "")).endswith(PEERS_WAIT)
            )
            parked = len(s.standbys) >= len(culprits)
            # Slow again (a straggler, a stall) on the nodes a restart in place was made for: the
            # node is slow, not its process. A parked standby takes its slot: another restart would
            # not fix what the first did not. Before, a straggler went on at the slow node's pace
            # with a standby idle, and a node whose loader stalled its peers in every generation
            # was restarted 30 times in 40 steps (outsider 56).
            again = (
                kind in REPLACE_ONLY_FAILURES
                and kind in h.restart_on
                and parked
                and v.get("restart_destination") not in culprits
                and rs.slow_again(s, kind, culprits)
            )
            if again and not trains_on:  # (a stall its peers wait on: a failure, restarted)
                quarantine = True
            if trains_on:
                # The job still trains (slowly, or with a damaged copy the memory tiers outlive): a
                # standby takes a slow node's slot where the policy says so and one is parked; else
                # a restart in place, once (`restart_in_place_on`); else it is only reported. (A
                # stall its peers wait on has stopped the job: that one restarts as a failure.)
                if quarantine and parked and kind in REPLACE_ONLY_FAILURES:
                    fn = rs.replace_with_standbys
                elif kind in h.restart_on and culprits and not rs.restarted_for(s, kind, culprits):
                    quarantine, dest = False, ""
                elif again:
                    fn, quarantine = rs.replace_with_standbys, True
                else:
                    seen = (s.generation, kind, tuple(sorted(ranks)))  # every rank posts its copy
                    if s.leader == h.node_id and seen not in self._kept:
                        self._kept.add(seen)
                        log.warning(
                            "run %s: verdict %s on ranks %s (%s) kept running: %s",
                            h.run_id,
                            kind,
                            ranks,
                            sorted(culprits),
                            "restarted for it already"
                            + (", no standby parked" if kind in REPLACE_ONLY_FAILURES else "")
                            if kind in h.restart_on
                            else "no standby to replace it"
                            if quarantine
                            else "recovery.replace_node_on and restart_in_place_on lack it",
                        )
                    continue
            log.warning("run %s: verdict %s on ranks %s -> %s", h.run_id, kind, ranks, sorted(culprits))
            error = str(v.get("error", ""))[:2000]
            args = (s.generation, kind, str(v.get("reason", kind)), culprits, quarantine, error, dest)
            s = control.update(partial(_if_leader, me=h.node_id, fn=fn, args=args))
        return s

    def _destination(
        self, s: rs.RdzvState, v: dict[str, Any], culprits: set[str], quarantine: bool
    ) -> tuple[bool, str]:
        """(quarantine, standby to admit first) as a verdict's `restart_destination` says (an
        orchestrator's answer, `OrchestrationHooks.restart_destination`): the culprit's own node
        restarts it in place, a parked standby takes its slot; anything else is logged and the
        policy decides."""
        dest = v.get("restart_destination")
        if not isinstance(dest, str) or not dest or not culprits:
            return quarantine, ""
        if culprits == {dest}:
            return False, ""
        if dest in s.standbys and dest not in s.excluded:
            return True, dest
        seen = (s.generation, dest)
        if s.leader == self.h.node_id and seen not in self._destinations_logged:
            self._destinations_logged.add(seen)
            log.warning(
                "run %s: restart_destination %r is neither the culprit's node %s nor a parked standby "
                "(%s): the policy decides",
                self.h.run_id,
                dest,
                sorted(culprits),
                list(s.standbys),
            )
        return quarantine, ""

    def _plan(self, control: _Control, old: rs.RdzvState, new: rs.RdzvState) -> dict[str, Any]:
        """The step every rank of the new generation restores, from the workers' GEMINI inventories."""
        pending = dict(old.pending)
        kind = str(pending.get("failure_kind", "none"))
        # An SDC reported while another failure of the generation (a killed rank) was being
        # handled still needs a certified step: the corruption may be in the newest capture.
        kinds = rs.also_kinds(pending)
        mode = "recovery_verified" if set(kinds) & STATE_FAILURES else "latest"
        plan: dict[str, Any] = {
            "failure_kind": kind,
            "reason_code": str(pending.get("reason", "startup")),
            "culprits": list(pending.get("culprits", [])),
            "error": str(pending.get("error", "")),
            "recovery_mode": mode,
            "failure_kinds": kinds,
            "checkpoint_source": "none",
            "checkpoint_step": -1,
            "admitted": [
                {"slot": i, "node": n}
                for i, n in enumerate(new.slots)
                if old.generation >= 0 and n not in old.slots
            ],
        }
        if old.generation < 0:
            return plan
        old = _as_published(old)
        try:
            exits = _worker_exits(control, old, culprits=set(pending.get("culprits", [])))
        except Exception as exc:  # advisory: the plan goes on without it
            log.warning("the workers' exits are unreadable; planned without them: %s", exc)
            exits = []
        if exits:
            plan["worker_exits"] = exits
        world = new.world_size()
        invs: dict[int, Any] = {}
        for r in range(world):
            inv = control.json_get(f"inv/{r}")
            if isinstance(inv, dict):
                invs[r] = inv
        if not invs:
            return plan
        keeps = {n for n in new.slots if n is not None and n in old.slots}  # same machine, same shm
        # The durable tier's folder may be each node's own disk: a rank that stays finds it. When
        # every node wrote to one folder (one id, several nodes), it is shared storage: a rank on a
        # node new to the job finds its copies there too (before, such a restart found no step
        # every rank held once the memory copies of the ranks had parted, and began from step 0).
        stores = {str(inv.get("disk_store", "")) for inv in invs.values()}
        shared = len(stores) == 1 and "" not in stores and len({_node_of_rank(old, r) for r in invs}) > 1
        local: dict[int, set[int]] = {}
        replicas: dict[int, dict[int, set[int]]] = {}
        disk: dict[int, set[int]] = {}
        certified: dict[int, set[int]] = {}
        groups: dict[int, list[int]] = {}
        for r, inv in invs.items():
            node = _node_of_rank(old, r)
            stays = node in keeps and _node_of_rank(new, r) == node
            if stays:
                local[r] = {int(x) for x in inv.get("local", [])}
            if stays or shared:
                disk[r] = {int(x) for x in inv.get("disk", [])}
            if node in keeps:
                replicas[r] = {int(o): {int(x) for x in st} for o, st in inv.get("replicas", {}).items()}
            # A certificate any rank of a replica group published holds for its group (publications
            # lag by a step or two); a step is verified when every group certified it.
            if inv.get("scout"):
                certified[r] = {int(x) for x in inv.get("certified", [])}
                groups[r] = [int(x) for x in inv.get("group", [])]
        allowed = verified_steps(certified, groups) if mode == "recovery_verified" and certified else None
        rp = plan_recovery(world, local, replicas, disk, allowed=allowed)
        if rp.step >= 0:
            tiers = {src.tier for src in rp.sources.values()}
            plan["checkpoint_source"] = "durable" if tiers == {"disk"} else "gemini"
            plan["checkpoint_step"] = rp.step
            plan["checkpoint_id"] = memory_checkpoint_id(rp.step)
            plan["sources"] = sorted({src.tier for src in rp.sources.values()})
        plan["plan_reason"] = rp.reason
        digests = {str(inv.get("topology", "")) for inv in invs.values()} - {""}
        if len(digests) == 1:
            plan["topology_digest"] = digests.pop()
        return plan


def _worker_exits(control: _Control, s: rs.RdzvState, culprits: set[str]) -> list[dict[str, Any]]:
    """The ranks of generation `s` whose processes ended failing, as their agents saw them
    (`_publish_exit`: the first on each node), each with `reported`: whether the job's own reports
    name it already (a report naming a failed process marks it: `ControlChannel.name_failed`), and
    `culprit`: whether its node is one the restart is for (`culprits`: the first node whose workers
    failed; the others' were most often casualties of its end). Peers that die of the broken
    collective report a rank killed mid-step, and a rank dying of an exception reports itself. A
    rank that ends after the others left their loops (a kill in the last step, an exception in the
    script's own saving after its loop) was seen by nobody: before, no fault report named it, only
    the agent's log."""
    out = []
    for node in s.slots:
        doc = exit_doc(control.json_get(exits_key(s.generation, node))) if node is not None else None
        if doc is not None:
            doc["reported"] = bool(control.store.check([control.key(named_key(s.generation, doc["rank"]))]))
            doc["culprit"] = doc.get("node") in culprits
            out.append(doc)
    return sorted(out, key=lambda d: float(d.get("at", 0.0)))


def _quarantines(verdict: dict[str, Any], replace_on: Iterable[str]) -> bool:
    """Whether an agreed verdict takes its culprits' nodes out. Not when SCOUT could not tell which
    replica was wrong (an ambiguous SDC names every replica with confidence below 1): the restart
    rolls back to a recovery-verified step and a recurrence will name the device."""
    confidence = verdict.get("confidence", 1.0)
    sure = not isinstance(confidence, (int, float)) or confidence >= 1.0
    kind = str(verdict.get("kind", ""))
    # Some of a node's ranks cut off from our transport while the rest are heard: their messages
    # were dropped (a restart renews their endpoints); the node's network works.
    if kind == "network_partition" and verdict.get("scope") != "node":
        return False
    # A tensor dropped (zeros where the replicas hold values) is the software's doing, not the device's.
    if kind == "sdc" and str(verdict.get("reason", "")).endswith(DROPPED):
        return False
    return kind in set(replace_on) and sure


def _as_published(s: rs.RdzvState) -> rs.RdzvState:
    """`s` with the slots its generation was published with: the rank numbers of the generation
    that failed (the current document may already have holes where lost or quarantined nodes
    were, which would shift the ranks)."""
    return dataclasses.replace(s, slots=tuple(s.history[-1]["slots"])) if s.history else s


def _node_of_rank(s: rs.RdzvState, rank: int) -> str | None:
    for i, n in enumerate(s.slots):
        if n is None:
            continue
        first = s.first_global_rank(i)
        if first <= rank < first + s.nodes[n].local_world_size:
            return n
    return None


def _if_leader(
    cur: rs.RdzvState, me: str, fn: Callable[..., rs.RdzvState], args: tuple[Any, ...]
) -> rs.RdzvState:
    """Only the leader of the current term decides: a deposed leader's update changes nothing."""
    return fn(cur, *args) if cur.leader == me else cur
