"""The durable tier: committed slots written to disk off the training thread.

Format (versioned, loadable with `torch.load(weights_only=True)`):
    {"format": "lm_resiliency.gemini.slot/1", "run_id": str, "owner": int, "step": int,
     "slot": uint8 tensor holding the committed slot file (header, payload, checksums)}
Files are `<folder>/<run_id>/step-<step>/rank-<rank>.pt`, written to a temporary name, fsynced and
renamed, so a reader sees a whole file or none. A failing disk raises `DurableError`; the caller
reports it and training goes on with the memory tiers. The run's folder holds `.store-id`, a random
id the first writer gave it: ranks on different nodes that report the same id write to the same
storage, so a rank restarted on another node finds its copies there too.

A fresh launch under a run id whose folder holds copies of an earlier launch (the same `--rdzv-id`
used again, with no explicit run id) sets those aside (`set_aside_earlier`): each rank records its
files' identities (inode, mtime, size) in `.earlier-launch-rank-<R>.json`, and `steps()` never
lists them again, so a restart of the new launch cannot restore the earlier launch's state. The
files stay as they were; a launch that names the run explicitly continues it and lists them again
(`forget_earlier`).

What a restart needs to trust a copy survives with the copies, for a relaunch on machines whose
memory is gone: each rank's `.trust-rank-<R>.json` holds the copies SCOUT certified (by step and
the capture's header digest; an SDC's revocation drops them) and the trust level its next restart
needs (an SDC found, or `prepare_recovery`'s decision). Before, both lived only in the node's
shared memory, and a relaunch on fresh nodes after an SDC restored the newest flushed copy: the
corrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lm_resiliency.runtime.shm import CorruptSlot, SlotHeader, header_digest, parse_header

__all__ = ["FORMAT", "DurableError", "DurableStore", "path_name"]

FORMAT = "lm_resiliency.gemini.slot/1"
STORE_ID = ".store-id"  # in the run's folder: its id (see DurableStore.store_id)
EARLIER = ".earlier-launch-rank-{rank:05d}.json"  # a rank's copies of earlier launches, set aside
TRUST = ".trust-rank-{rank:05d}.json"  # a rank's certified copies and its next restart's trust level
log = logging.getLogger(__name__)


class DurableError(OSError):
    """The durable tier failed (read-only, full, I/O error)."""


def path_name(name: str) -> str:
    """`name` (a run id, a node id) as one path component: letters, digits and `_.-` kept, anything
    else `_`; one that is empty or only dots (`..` would be the folder above) gets a `_` in front."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return safe if safe.strip(".") else f"_{safe}"


class DurableStore:
    def __init__(
        self,
        folder: str,
        run_id: str,
        rank: int,
        keep_last: int = 2,
        regular: Callable[[int], bool] | None = None,
    ) -> None:
        """`regular(step)`: whether `step` is one the disk cadence writes on every rank (the others
        are flushes: at SIGTERM, for a restart), for the pruning (see `_prune`)."""
        self.root = Path(folder) / path_name(run_id)
        self.run_id = run_id
        self.rank = rank
        self.keep_last = keep_last
        self.regular = regular if regular is not None else (lambda step: True)
        self.pruned: list[int] = []  # the steps the last write removed
        self._failing: list[int] = []  # errnos the next writes fail with (see fail_writes)
        self._store_id = ""
        self._earlier: set[tuple[int, int, int]] | None = None  # identities set aside (read lazily)

    def store_id(self) -> str:
        """The id of the run's folder, written there by the first rank that wrote a copy into it:
        the same for every rank whose folder is the same one (shared storage), different for
        node-local disks; "" while none is known (nothing written, or the folder unreadable)."""
        if not self._store_id:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                self._store_id = (self.root / STORE_ID).read_text().strip()
        return self._store_id

    def _name_store(self) -> None:
        """The folder's id, unless it has one (`store_id`): a file linked into place, so that of
        ranks naming it at once (on several nodes of a shared file system) one wins, whole."""
        target = self.root / STORE_ID
        if self.store_id():
            return
        tmp = self.root / f"{STORE_ID}.tmp{os.getpid()}-{self.rank}"
        try:
            tmp.write_text(uuid.uuid4().hex)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, target)
        except OSError as exc:  # an id is a hint for restarts on other nodes; the copy is written
            log.warning("rank %d: cannot name the durable folder %s: %s", self.rank, self.root, exc)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self.store_id()

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:010d}" / f"rank-{self.rank:05d}.pt"

    def fail_writes(self, count: int = 1, code: int = errno.EIO) -> None:
        """The next `count` writes fail with `code` before touching the disk: a fault campaign's
        I/O error, confined to this rank's writer (the folder and its files stay as they are)."""
        self._failing += [code] * max(0, count)

    def probe(self) -> None:
        """Whether the folder takes a write now: a byte written to a file of this rank's, closed and
        removed (no fsync: microseconds). Raises DurableError naming the folder and the error. A
        read-only or full file system (or a campaign's I/O error, which a probe consumes as one of
        the next writes) shows here within seconds instead of at the next copy, which the disk
        cadence may write only minutes later."""
        probe = (
            self.root / f".probe-rank-{self.rank:05d}-{os.getpid()}"
        )  # (a dying worker of the rank may probe too)
        try:
            if self._failing:
                code = self._failing.pop(0)
                raise OSError(code, f"{os.strerror(code)} (injected)")
            self.root.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"\0")
            probe.unlink()
        except OSError as exc:
            raise _failed(exc, probe, f"durable folder {self.root} takes no write") from exc

    def write(self, step: int, slot_bytes: memoryview) -> Path:
        final = self.path(step)
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        try:
            if self._failing:
                code = self._failing.pop(0)
                raise OSError(code, f"{os.strerror(code)} (injected)")
            with warnings.catch_warnings():
                # torch.save only reads the tensor; a read-only source buffer is fine here.
                warnings.simplefilter("ignore", UserWarning)
                blob = (
                    torch.frombuffer(slot_bytes, dtype=torch.uint8)
                    if len(slot_bytes)
                    else torch.empty(0, dtype=torch.uint8)
                )
            with self._create(tmp) as f:
                torch.save(
                    {"format": FORMAT, "run_id": self.run_id, "owner": self.rank, "step": step, "slot": blob},
                    f,
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            dir_fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:  # the disk is failing; the error says so
            raise _failed(exc, tmp, f"durable checkpoint of step {step} to {final} failed") from exc
        self.pruned = self._prune(step) if self.regular(step) else []
        self._name_store()
        return final

    @staticmethod
    def _create(tmp: Path) -> BinaryIO:
        """`tmp` opened for writing, its step directory made. Another rank's prune may remove that
        directory between the two (a rank whose disk writes lag): made again, once."""
        for attempt in (0, 1):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                return open(tmp, "wb")
            except FileNotFoundError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _prune(self, newest: int) -> list[int]:
        """Keep this rank's newest `keep_last` copies of the disk cadence and any flush newer than
        the oldest of them; drop the older ones and what a writer killed mid-write left. A flush
        never prunes: it may be of a step other ranks did not write (they were stopped first), and
        it must not cost the cadence step every rank holds."""
        regular = sorted((s for s in self.steps() if self.regular(s)), reverse=True)
        if len(regular) < self.keep_last:
            return []
        cutoff = min(regular[self.keep_last - 1], newest)
        gone = [step for step in self.steps(partial=True) if step < cutoff]
        for step in gone:
            self.remove(step)
        return gone

    def remove(self, step: int) -> None:
        """Delete this rank's copy of `step` (and what a writer killed mid-write left of it); the
        last rank to leave the step's directory removes it."""
        final = self.path(step)
        final.unlink(missing_ok=True)
        for tmp in final.parent.glob(f"{final.name}.tmp*"):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other ranks' copies are still in it
            final.parent.rmdir()

    def steps(self, partial: bool = False) -> list[int]:
        """The steps this rank has a copy of (none an earlier launch's, set aside); `partial`: or the
        leftover of a write killed midway."""
        if not self.root.exists():
            return []
        out = []
        mine = f"rank-{self.rank:05d}.pt"
        earlier = self._earlier_ids()
        for d in self.root.glob("step-*"):
            m = re.fullmatch(r"step-(\d+)", d.name)
            try:
                whole = _identity(d / mine) not in earlier
            except OSError:  # none (or removed meanwhile)
                whole = False
            if m and (whole or (partial and any(d.glob(f"{mine}.tmp*")))):
                out.append(int(m.group(1)))
        return sorted(out)

    def set_aside_earlier(self) -> list[int]:
        """A fresh launch under this run id: the copies this rank holds on disk now are an earlier
        launch's. They are recorded by identity and never listed again (`steps`), the files left as
        they are; returns their steps. Raises DurableError when the record cannot be written."""
        with contextlib.suppress(DurableError):
            self.note_mode("")  # the earlier launch's trust level is not this one's
        steps = self.steps()
        if not steps:
            return []
        marker = self.root / EARLIER.format(rank=self.rank)
        earlier = self._earlier_ids()
        for step in steps:
            with contextlib.suppress(OSError):  # pruned by a node peer meanwhile: gone anyway
                earlier.add(_identity(self.path(step)))
        tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(sorted(earlier)))
            os.replace(tmp, marker)
        except OSError as exc:
            raise _failed(exc, tmp, f"cannot record the earlier launch's copies in {marker}") from exc
        return steps

    def forget_earlier(self) -> None:
        """The run named explicitly at its start continues it: copies set aside are listed again."""
        with contextlib.suppress(OSError):
            (self.root / EARLIER.format(rank=self.rank)).unlink(missing_ok=True)
        self._earlier = set()

    def _earlier_ids(self) -> set[tuple[int, int, int]]:
        if self._earlier is None:
            self._earlier = set()
            try:
                raw = json.loads((self.root / EARLIER.format(rank=self.rank)).read_text())
                self._earlier = {(int(a), int(b), int(c)) for a, b, c in raw}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError) as exc:
                log.warning(
                    "rank %d: the record of an earlier launch's copies in %s is unreadable (%s): "
                    "every copy there is listed",
                    self.rank,
                    self.root,
                    exc,
                )
        return self._earlier

    # -- trust: certificates and the next restart's mode, kept with the copies ----------------------
    def _trust(self) -> dict[str, Any]:
        path = self.root / TRUST.format(rank=self.rank)
        try:
            doc = json.loads(path.read_text())
            certified = {int(k): bytes.fromhex(v) for k, v in doc.get("certified", {}).items()}
            mode = doc.get("mode", "")
            if not isinstance(mode, str):
                raise TypeError(f"mode is a {type(mode).__name__}")
        except FileNotFoundError:
            return {"certified": {}, "mode": ""}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning(
                "rank %d: %s is unreadable (%s): no copy on disk is taken as recovery-verified",
                self.rank,
                path,
                exc,
            )
            return {"certified": {}, "mode": ""}
        return {"certified": certified, "mode": mode}

    def _write_trust(self, certified: dict[int, bytes], mode: str) -> None:
        path = self.root / TRUST.format(rank=self.rank)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        doc = {"certified": {str(k): v.hex() for k, v in sorted(certified.items())}, "mode": mode}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
        except OSError as exc:
            raise _failed(exc, tmp, f"cannot record what the copies in {self.root} are trusted for") from exc

    def _digest(self, step: int) -> bytes | None:
        """The header digest of this rank's copy of `step` on disk (None: none, or unreadable)."""
        with contextlib.suppress(DurableError):
            return header_digest(self._slot(step, mmap=True).numpy().data)
        return None

    def certify(self, step: int, digest: bytes) -> None:
        """SCOUT certified this rank's capture of `step` whose header digest is `digest`: recorded
        when the copy of `step` on disk is that capture (not an earlier lineage's copy of the same
        step, one a restart before went past). Raises DurableError when it cannot be recorded."""
        if self._digest(step) != digest:
            return
        doc = self._trust()
        listed = set(self.steps())  # (entries of pruned copies go; a rewritten one fails `certified`)
        live = {s: d for s, d in doc["certified"].items() if s != step and s in listed}
        self._write_trust({**live, step: digest}, doc["mode"])

    def revoke(self, from_step: int) -> None:
        """No copy from `from_step` on is recovery-verified any more (an SDC found at it)."""
        doc = self._trust()
        kept = {s: d for s, d in doc["certified"].items() if s < from_step}
        if len(kept) != len(doc["certified"]):
            self._write_trust(kept, doc["mode"])

    def certified(self) -> set[int]:
        """The steps of this rank's copies on disk that SCOUT certified (each the capture that was
        certified: its header digest the same)."""
        if not self.root.exists():
            return set()
        listed = set(self.steps())
        return {s for s, d in self._trust()["certified"].items() if s in listed and self._digest(s) == d}

    def note_mode(self, note: str) -> None:
        """The trust level (and failure kind) the next restart needs, "" when none. Raises
        DurableError when it cannot be written."""
        doc = self._trust()
        if doc["mode"] != note:
            self._write_trust(doc["certified"], note)

    def noted_mode(self) -> str:
        return str(self._trust()["mode"]) if self.root.exists() else ""

    def read(self, step: int) -> bytes:
        """The slot bytes of `step`; raises DurableError for a missing or malformed file."""
        return self._slot(step, mmap=False).numpy().tobytes()

    def header(self, step: int) -> SlotHeader:
        """The committed header of `step`'s slot, without reading the state: the file is mapped
        and only the header and the checksum table are read (the chunks are verified when the
        copy is loaded). Raises DurableError for a missing, malformed or truncated file."""
        blob = self._slot(step, mmap=True)
        try:
            return parse_header(self.path(step).name, blob.numpy().data, blob.numel())
        except CorruptSlot as exc:
            raise DurableError(0, f"{self.path(step)}: {exc}") from exc

    def _slot(self, step: int, mmap: bool) -> torch.Tensor:
        path = self.path(step)
        try:
            doc = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
        except Exception as exc:  # torch.load raises many types for a bad file; translate here
            raise DurableError(0, f"{path}: cannot load ({type(exc).__name__}: {exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise DurableError(0, f"{path}: not a {FORMAT} file")
        if doc.get("owner") != self.rank or doc.get("step") != step or doc.get("run_id") != self.run_id:
            raise DurableError(0, f"{path}: belongs to another rank, step or run")
        blob = doc["slot"]
        if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
            raise DurableError(0, f"{path}: slot is not a byte tensor")
        return blob


def _identity(path: Path) -> tuple[int, int, int]:
    """A file's identity on its file system: a copy written again at the same path is another."""
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _failed(exc: OSError, leftover: Path, what: str) -> DurableError:
    """`exc` as the DurableError saying `what` failed, once `leftover` (a temporary file of the
    failed write) is removed."""
    with contextlib.suppress(OSError):
        leftover.unlink(missing_ok=True)
    return DurableError(exc.errno, f"{what}: {exc.strerror or exc}")
