"""DataLoader iterators that a resumed loop makes again.

`iter(DataLoader)` draws its workers' base seed from the global torch RNG (with workers, a
`RandomSampler` draws its permutation there too, as they prefetch). A capture holds the RNG state
after its step, long after the draws of the epoch's iterator. A loop resumed mid-epoch makes its
iterator again to reach its position: one draw more than the uninterrupted run made, and every
random number after it (dropout) shifts, so the resumed run is no longer bitwise the uninterrupted
one. (`session.instrument_dataloader` handles this for the loaders it wraps; this does it for any
other DataLoader the loop iterates.)

While a GEMINI of this process is open, `DataLoader._get_iterator` is watched. A capture records
each live iterator: the global RNG state it was made at, and whether it had yielded its epoch.
After a restore, until the first forward, iterators are made without drawing: one the capture
recorded is made again at its state (the same seed), others at the state now. The first forward
then draws once for each iterator the uninterrupted run made after the capture: one the capture
did not record (a loader of another shape), or the next epoch's after one recorded at its end
(made again and skipped to its end first, or not). A loop resumed mid-epoch thus draws nothing
more, and one resumed where an epoch ended draws the next epoch's seed, as the uninterrupted run
did. Loaders with their own `generator=` draw from it, not from the global RNG: left alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["IteratorWatch", "untracked"]

log = logging.getLogger(__name__)

_BYPASS = threading.local()
_ACTIVE: list[weakref.ref[IteratorWatch]] = []  # the watch of the newest open GEMINI
_ORIGINAL: list[Callable[[Any], Any]] = []
_KEEP = 8  # iterators tracked at most (the newest): a loop has one or two live at a time


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Iterators made inside are not watched (an instrumented loader handles its own)."""
    before = getattr(_BYPASS, "on", False)
    _BYPASS.on = True
    try:
        yield
    finally:
        _BYPASS.on = before


def _shape(loader: Any) -> str:
    """What tells a loader from the loop's others across a restart: its dataset's and sampler's
    types, its batch size and its length (when it has one)."""
    try:
        n = str(len(loader))
    except TypeError:
        n = "?"
    dataset = type(getattr(loader, "dataset", None)).__name__
    sampler = type(getattr(loader, "sampler", None)).__name__
    return f"{dataset}/{sampler}/{getattr(loader, 'batch_size', None)}/{n}"


def _ended(it: Any) -> bool:
    """Whether a map-style loader's iterator has yielded its epoch (an iterable dataset's: never known)."""
    try:
        return int(it._num_yielded) >= len(it)
    except (AttributeError, TypeError, ValueError):
        return False


def _get_iterator(loader: Any) -> Any:
    make = _ORIGINAL[0]
    watch = _ACTIVE[0]() if _ACTIVE else None
    if watch is None or getattr(_BYPASS, "on", False) or getattr(loader, "generator", None) is not None:
        return make(loader)
    return watch.made(loader, make)


class IteratorWatch:
    """The DataLoader iterators of this process (see the module's doc); one per GEMINI."""

    def __init__(self) -> None:
        self._made: list[tuple[weakref.ref[Any], str, torch.Tensor]] = []
        # After a restore, until the first forward: the capture's iterators (shape, RNG state, at
        # its end), and what was made since (the iterator, the record it stands for).
        self._records: list[tuple[str, torch.Tensor, bool]] | None = None
        self._remade: list[tuple[weakref.ref[Any] | None, tuple[str, torch.Tensor, bool] | None]] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        from torch.utils.data import DataLoader

        with self._lock:
            if not _ORIGINAL:
                _ORIGINAL.append(DataLoader._get_iterator)
                DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign,assignment]
            _ACTIVE[:] = [weakref.ref(self)]

    def uninstall(self) -> None:
        """This watch stops (the DataLoader method stays patched, inert without a watch)."""
        with self._lock:
            if _ACTIVE and _ACTIVE[0]() is self:
                _ACTIVE.clear()
            self._records, self._remade = None, []

    def made(self, loader: Any, make: Callable[[Any], Any]) -> Any:
        shape = _shape(loader)
        with self._lock:
            record = None
            if self._records is not None:
                at = next((i for i, r in enumerate(self._records) if r[0] == shape), None)
                record = self._records.pop(at) if at is not None else None
            resuming = self._records is not None
        now = torch.get_rng_state()
        began = record[1] if record is not None else now
        if resuming:  # made without drawing (see first_step)
            torch.set_rng_state(began)
            try:
                it = make(loader)
            finally:
                torch.set_rng_state(now)
        else:
            it = make(loader)
        with self._lock:
            self._made = [m for m in self._made if m[0]() is not None][-(_KEEP - 1) :]
            try:
                ref: weakref.ref[Any] | None = weakref.ref(it)
            except TypeError:  # (an iterator that takes no weak reference)
                ref = None
            if ref is not None:
                self._made.append((ref, shape, began))
            if resuming:
                self._remade.append((ref, record))
        return it

    def snapshot(self) -> list[dict[str, Any]]:
        """For a capture: each live iterator's shape, RNG state it was made at, and whether it
        yielded its epoch, oldest first."""
        with self._lock:
            made = list(self._made)
        out = []
        for ref, shape, began in made:
            it = ref()
            if it is not None:
                out.append({"shape": shape, "torch": began.clone(), "ended": _ended(it)})
        return out

    def restore(self, saved: Any) -> None:
        """A restored capture's `iterators` entry, for the iterators made until the first forward.
        Entries of another shape are left out with a warning (they only make a resumed run's
        random numbers the uninterrupted run's)."""
        size = torch.get_rng_state().numel()
        records = []
        for entry in saved if isinstance(saved, list) else ([] if saved is None else [saved]):
            e = entry if isinstance(entry, dict) else {}
            shape, rng, ended = e.get("shape"), e.get("torch"), e.get("ended", False)
            if (
                isinstance(shape, str)
                and isinstance(rng, torch.Tensor)
                and rng.dtype == torch.uint8
                and rng.shape == (size,)
                and isinstance(ended, bool)
            ):
                records.append((shape, rng.clone(), ended))
            else:
                log.warning("the capture's RNG state of a DataLoader iterator is malformed: not used")
        with self._lock:
            self._records, self._remade = records, []

    def first_step(self, draw: bool = True) -> None:
        """The restored generation's first forward: the global RNG draws once for each iterator
        made since the restore that the uninterrupted run made after the capture (see the
        module's doc); iterators made from now on draw as they are made. `draw=False` where the
        forward already ran (a capture): nothing is drawn."""
        with self._lock:
            if self._records is None:
                return
            remade, self._records, self._remade = self._remade, None, []
        if not draw:
            return
        fresh = 0
        for ref, record in remade:
            it = ref() if ref is not None else None
            if record is None:
                fresh += 1  # not the capture's: the uninterrupted run made it too
            elif record[2] and it is not None and not _ended(it):
                # The next epoch's, after the captured one at its end (the captured one made again
                # was skipped to its end, or dropped, before this forward: it feeds no step).
                fresh += 1
        for _ in range(fresh):
            torch.empty((), dtype=torch.int64).random_()
