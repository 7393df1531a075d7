"""A worker's line to the torchrun backend's control store (`LM_RESILIENCY_CONTROL_STORE`).

Workers publish what the leader needs to decide the next generation: each rank's GEMINI inventory
(which steps it can restore, for itself and for others, and which are recovery-verified) and the
SCOUT verdicts that call for a restart or a replacement. All store I/O happens on one daemon thread
of this channel: callers (the GEMINI worker, SCOUT on the runtime loop) only hand over a value and
never block on the network. Only the newest inventory matters, so a newer one replaces one not yet
sent. Failures are logged once and never stop training: the backend then falls back to the
workers' own agreement.

A rank that `beats` bumps its counter in the store every BEAT_S: its peers' SCOUT, finding it silent
on our transport, reads the counters (`alive`) to tell a node that reaches the network and lost
only its messages on our transport from one cut off.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["BEAT_S", "ControlChannel", "exit_doc", "exits_key", "finished_key", "named_key", "open_store"]

BEAT_S = 1.0  # a beating rank's counter in the store goes up this often


def finished_key(generation: int) -> str:
    """The key, under the run's prefix, that counts the sessions of `generation` closed at their
    script's end (ControlChannel.finish; the agents read it too)."""
    return f"finished/g{generation}"


def final_key(generation: int) -> str:
    """The keys, under the run's prefix, of the step counts the ranks ended their loops of
    `generation` at (ControlChannel.publish_final; compared by final_steps_verdict): `/r<rank>`
    each rank's, `/first` the first published, `/apart` set when one differs from it, `/n` how
    many published; `/d<rank>` each rank's final-state digest (hex)."""
    return f"final/g{generation}"


def exits_key(generation: int, node: str) -> str:
    """The key, under the run's prefix, where `node`'s agent puts the first of its workers of
    `generation` to end failing, and how (`adapters/torchrun._publish_exit`)."""
    return f"exits/g{generation}/{node}"


def exit_doc(doc: Any) -> dict[str, Any] | None:
    """An agent's exit document as read from the store (`exits_key`), or None where it is not one:
    its `rank` and `exitcode` integers, its `at` a number."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rank"), int):
        return None
    if not isinstance(doc.get("exitcode"), int) or not isinstance(doc.get("at", 0.0), (int, float)):
        return None
    return doc


def named_key(generation: int, rank: int) -> str:
    """The key, under the run's prefix, set when a fault report named `rank` a failed process in
    `generation` (ControlChannel.name_failed; the leader reads it)."""
    return f"named/g{generation}/r{rank}"


log = logging.getLogger(__name__)


def open_store(address: str, timeout: timedelta) -> Any:
    """A client of the control store at `address` (tcp://HOST:PORT or file://PATH)."""
    import torch.distributed as dist

    scheme, sep, where = address.partition("://")
    if scheme == "file" and where:
        return dist.FileStore(where, -1)  # type: ignore[attr-defined]
    host, _, port = where.rpartition(":")
    if scheme != "tcp" or not sep or not host or not port.isdigit():
        raise ValueError(f"LM_RESILIENCY_CONTROL_STORE={address!r}: expected tcp://HOST:PORT or file://PATH")
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)  # type: ignore[attr-defined]


def _count_until(
    store: Any,
    key: str,
    count: int,
    target: int,
    timeout_s: float,
    stop: Callable[[], bool],
    poll_s: tuple[float, float],
) -> int:
    """Read the counter `key` (now at `count`) until it reaches `target`, `timeout_s` ran out or
    `stop()`: its last value. Sleeps between reads (`poll_s`: first, then doubling up to at most),
    so a signal's handler runs on the waiting thread at once."""
    deadline = time.monotonic() + timeout_s
    wait = poll_s[0]
    while count < target and not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(wait, left))
        wait = min(2 * wait, poll_s[1])
        count = int(store.add(key, 0))
    return count


class ControlChannel:
    def __init__(self, address: str, run_id: str, timeout_s: float = 10.0) -> None:
        scheme, sep, rest = address.partition("://")
        if not sep or scheme not in ("tcp", "file") or not rest:
            raise ValueError(
                f"LM_RESILIENCY_CONTROL_STORE={address!r}: expected tcp://HOST:PORT or file://PATH"
            )
        self.scheme, self.where, self.prefix = scheme, rest, f"lmr/{run_id}/"
        self.timeout = timedelta(seconds=timeout_s)
        self._store: Any = None
        self._cond = threading.Condition()
        self._inventory: tuple[int, str] | None = None  # newest, not yet sent
        self._verdicts: deque[tuple[int, str]] = deque(maxlen=256)
        self._named: set[str] = set()  # keys of ranks named failed, not yet sent (name_failed)
        self._sending = False  # the thread took values out and has not finished sending them
        self._closed = False
        self._warned = False
        self._beat_rank: int | None = None
        self._next_beat = 0.0
        self._muted_until = float("-inf")  # monotonic: nothing is sent before (mute)
        self._reader: Any = None  # a connection of its own for `alive` (a store client is not shared)
        self._read_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lm-resiliency-control", daemon=True)
        self._thread.start()

    def publish_inventory(self, rank: int, doc: dict[str, Any]) -> None:
        with self._cond:
            self._inventory = (rank, json.dumps(doc, sort_keys=True))
            self._cond.notify()

    def post_verdict(self, generation: int, report: dict[str, Any]) -> None:
        with self._cond:
            self._verdicts.append((generation, json.dumps(report, sort_keys=True, default=str)))
            self._cond.notify()

    def name_failed(self, generation: int, ranks: Sequence[int]) -> None:
        """A fault report of this rank named `ranks` failed processes in `generation`: the leader's
        plan then knows the job's reports named them (`worker_exits`' `reported`)."""
        with self._cond:
            self._named.update(named_key(generation, r) for r in ranks)
            self._cond.notify()

    def beat(self, rank: int) -> None:
        """From now on, bump `rank`'s counter in the store every BEAT_S (on the channel's thread)."""
        with self._cond:
            self._beat_rank, self._next_beat = rank, 0.0
            self._cond.notify()

    def mute(self, seconds: float) -> None:
        """Send nothing for `seconds` (a fault campaign's network partition cuts this line too);
        what is handed over meanwhile waits and goes after."""
        with self._cond:
            self._muted_until = time.monotonic() + seconds
            self._cond.notify()

    def alive(self, ranks: list[int]) -> dict[int, int]:
        """The ranks' beat counters in the store (0: never beat); {} when the store cannot say.
        Blocks for a store round trip per rank: call it off any event loop."""
        with self._read_lock:
            try:
                if self._reader is None:
                    self._reader = self._open(timedelta(seconds=2))
                return {r: int(self._reader.add(f"{self.prefix}alive/{r}", 0)) for r in ranks}
            except Exception as exc:  # advisory: without it, silence is judged as before
                log.debug("control store %s unreadable: %s", self.where, exc)
                self._reader = None
                return {}

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything handed over has been sent (or failed): not only taken by the thread,
        which a process that ends right after (a worker that drains, then dies) would cut short."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (
                    self._inventory is None and not self._verdicts and not self._named and not self._sending
                ),
                timeout,
            )

    def restart_culprits(self, generation: int) -> set[str] | None:
        """When the run's leader has begun replacing `generation` (its restart stops every worker
        group), the nodes whose workers' going is why: the culprits of a restart on a process
        failure (a worker that exited, a SIGTERM sent to one); none for one on a verdict (a hang, an
        SDC: the restart stopped the culprits' workers too). None while it has not (or the store
        cannot say). Reads the rendezvous state through a connection of its own (a store client is
        not shared across threads).

        Before, a verdict's culprits counted too: a rank outside the replica group that named a
        hang (DDP over tensor parallel: outsider 43) saw the hung node's ranks go with "terminated"
        and reported each as a failed process."""
        from lm_resiliency.core.rendezvous import state as rs

        try:
            store = self._open(timedelta(seconds=2))  # (a dying worker asks: it must not wait long)
            key = f"{self.prefix}state"
            if not store.check([key]):
                return None
            s = rs.decode(store.get(key))
        except Exception as exc:  # advisory: a report too many, never a worker stopped by it
            log.debug("control store %s unreadable: %s", self.where, exc)
            return None
        if s.generation == generation and s.phase == rs.RESTARTING:
            why: dict[str, Any] = dict(s.pending)
        elif s.generation > generation:  # replaced already: what it was replaced for
            after = [h for h in s.history if isinstance(h, dict) and h.get("generation") == generation + 1]
            why = dict(after[0]) if after else {}
        else:
            return None
        kinds = {why.get("failure_kind"), *why.get("also", ())}
        return {str(n) for n in why.get("culprits", ())} if "process_failure" in kinds else set()

    def first_exits(self, generation: int, nodes: Iterable[str]) -> dict[str, int]:
        """The rank of each of `nodes` whose end its agent saw first in `generation` (the first of
        its workers to fail: the agent stopped the others then), where it has said so: {} when the
        store cannot say. Through a connection of its own, as `restart_culprits`."""
        out: dict[str, int] = {}
        try:
            store = self._open(timedelta(seconds=2))
            for node in nodes:
                key = self.prefix + exits_key(generation, node)
                try:
                    doc = exit_doc(json.loads(store.get(key))) if store.check([key]) else None
                except ValueError:  # (not JSON: that node's only; before, the nodes after it went too)
                    doc = None
                if doc is not None:
                    out[node] = doc["rank"]
        except Exception as exc:  # advisory: a report too many, never a worker stopped by it
            log.debug("control store %s unreadable: %s", self.where, exc)
        return out

    def publish_final(self, generation: int, rank: int, step: int, digest: bytes = b"") -> bool:
        """Put the step count this rank ended its loop of `generation` at where its peers read it
        (`finals`), at once (not through the channel's thread), and the digest of its final state
        (`final_digests`: read only by a rank whose last step was not compared). The first count
        published is kept apart; a rank that ends at another marks the generation's counts as
        differing, so that a job whose ranks agree (every one, all but never) reads three keys at
        its end, not one per rank. False when the store could not take it."""
        try:
            store = self._open(timedelta(seconds=2))
            base = self.prefix + final_key(generation)
            if digest:
                store.set(f"{base}/d{rank}", digest.hex())
            store.set(f"{base}/r{rank}", str(step))
            first = store.compare_set(f"{base}/first", "", str(step)).decode(errors="replace")
            if first != str(step):
                store.set(f"{base}/apart", "1")
            store.add(f"{base}/n", 1)  # (last: once counted, its mark is in)
            return True
        except Exception as exc:  # advisory: the comparison goes without this rank
            log.debug("control store %s unreadable: %s", self.where, exc)
            return False

    def finals(
        self,
        generation: int,
        world_size: int,
        timeout_s: float,
        stop: Callable[[], bool] = lambda: False,
        poll_s: tuple[float, float] = (0.02, 0.2),
    ) -> dict[int, int]:
        """The step counts the ranks ended their loops of `generation` at (`publish_final`), once
        all `world_size` published them, or when `timeout_s` ran out or `stop()` (those published
        by then): empty when they all agree, else rank -> count. A count that is not an integer is
        left out, with a warning."""
        out: dict[int, int] = {}
        try:
            store = self._open(timedelta(seconds=2))
            base = self.prefix + final_key(generation)
            _count_until(
                store, f"{base}/n", int(store.add(f"{base}/n", 0)), world_size, timeout_s, stop, poll_s
            )
            if not store.check([f"{base}/apart"]):
                return out
            for r in range(world_size):
                key = f"{base}/r{r}"
                if not store.check([key]):
                    continue
                raw = store.get(key).decode(errors="replace")
                try:
                    out[r] = int(raw)
                except ValueError:
                    log.warning("control store: rank %d's final step %r is not an integer: left out", r, raw)
        except Exception as exc:  # advisory: compared among those read
            log.debug("control store %s unreadable: %s", self.where, exc)
        return out

    def final_digests(self, generation: int, ranks: Iterable[int]) -> dict[int, bytes]:
        """The final-state digests `ranks` published with their step counts of `generation` (read
        after `finals`, which waits for them): rank -> digest, those present. One that is not hex
        is left out, with a warning."""
        out: dict[int, bytes] = {}
        try:
            store = self._open(timedelta(seconds=2))
            base = self.prefix + final_key(generation)
            for r in ranks:
                key = f"{base}/d{r}"
                if not store.check([key]):
                    continue
                raw = store.get(key).decode(errors="replace")
                try:
                    out[r] = bytes.fromhex(raw)
                except ValueError:
                    log.warning("control store: rank %d's final digest %r is not hex: left out", r, raw[:40])
        except Exception as exc:  # advisory: compared among those read
            log.debug("control store %s unreadable: %s", self.where, exc)
        return out

    def finish(
        self,
        generation: int,
        world_size: int,
        timeout_s: float,
        stop: Callable[[], bool] = lambda: False,
        poll_s: tuple[float, float] = (0.05, 0.5),
    ) -> int:
        """Count this rank's session as closed in `generation`, then wait up to `timeout_s` until all
        `world_size` ranks of it have, or `stop()`: the number counted when the wait ended (-1: the
        store could not say). Sleeps between reads (`poll_s`: first, then at most), so a signal's
        handler runs on the waiting thread at once.

        A worker that ends at once leaves its agent in torch's exit barrier, where no restart can
        reach it: a rank that fails after it (in the script's own saving after its loop) had its
        run's restart wait for this node forever."""
        try:
            store = self._open(timedelta(seconds=2))
            key = self.prefix + finished_key(generation)
            return _count_until(store, key, int(store.add(key, 1)), world_size, timeout_s, stop, poll_s)
        except Exception as exc:  # advisory: the worker ends as it did without it
            log.debug("control store %s unreadable: %s", self.where, exc)
            return -1

    def close(self) -> None:
        self.flush(timeout=2.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    # -- the channel's thread ------------------------------------------------------------------

    def _open(self, timeout: timedelta | None = None) -> Any:
        return open_store(f"{self.scheme}://{self.where}", timeout or self.timeout)

    def _connect(self) -> Any:
        if self._store is None:
            self._store = self._open()
        return self._store

    def _wait_for_work(self) -> bool:
        """(With the lock held.) Until something is to be sent and the line is not muted, or the
        channel closed: whether a beat is due."""
        while not self._closed:
            now = time.monotonic()
            if now >= self._muted_until:
                beat = self._beat_rank is not None and now >= self._next_beat
                if beat or self._inventory is not None or self._verdicts or self._named:
                    return beat
                wake = self._next_beat if self._beat_rank is not None else math.inf
            else:
                wake = self._muted_until
            self._cond.wait(None if wake == math.inf else max(0.0, wake - now))
        return False

    def _run(self) -> None:
        while True:
            with self._cond:
                beat = self._wait_for_work()
                if self._closed:
                    return
                verdicts = list(self._verdicts)
                self._verdicts.clear()
                named, self._named = sorted(self._named), set()
                inventory, self._inventory = self._inventory, None
                rank = self._beat_rank
                if beat:
                    self._next_beat = time.monotonic() + BEAT_S
                self._sending = True
            try:
                store = self._connect()
                for generation, raw in verdicts:
                    i = int(store.add(f"{self.prefix}verdicts/g{generation}/n", 1)) - 1
                    store.set(f"{self.prefix}verdicts/g{generation}/{i}", raw)
                for key in named:
                    store.set(self.prefix + key, "1")
                if inventory is not None:
                    store.set(f"{self.prefix}inv/{inventory[0]}", inventory[1])
                if beat and rank is not None:
                    store.add(f"{self.prefix}alive/{rank}", 1)
            except Exception as exc:  # the store is advisory for workers: log once, keep training
                if not self._warned:
                    log.warning("control store %s unreachable: %s", self.where, exc)
                    self._warned = True
                self._store = None
            with self._cond:
                self._sending = False
                self._cond.notify_all()  # flush() waiters
