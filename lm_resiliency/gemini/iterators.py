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
After a restore, until the first forward, the iterators the loop makes stand for the captured ones
in turn (by the loader's shape):

- one captured mid-epoch is made again at its own state, and the restored state goes on after it
  (no draw: the uninterrupted run made none there);
- one captured at its epoch's end is made as torch makes it (a draw: the uninterrupted run made the
  next epoch's iterator after the capture, from the restored state). If the loop skips it to its
  end (or drops it) and makes another, that one is made from the state before the first: one draw,
  as the uninterrupted run made. (A loader with persistent workers starts its next epoch without
  making an iterator: its iterator is made again at its own state, then reset to its next epoch from
  the restored state, as the uninterrupted run's was: a RandomSampler draws the epoch's order there.)

Without workers, a `RandomSampler` draws its permutation at the iterator's first batch, not as it is
made: the RNG state at that first batch goes with a capture too, and an iterator made again
mid-epoch draws it at once (its first batch of indices taken and put back, no data fetched), at that
state. (Not at the state it was made at: a loop that reads two loaders made the second's iterator,
which drew its workers' seed, between the first's making and its first batch.) One captured before
its first batch (or as it fetches it: a step's capture is taken at the next step's first fetch,
where an epoch begins) draws it at its first batch, from the restored state, as the uninterrupted
run did after the capture.

Loaders with their own `generator=` draw from it, not from the global RNG, and are left alone.

Every iterator made while a watch is open (its own `generator=` or not) also says when it is about
to fetch a batch (`IteratorWatch.on_fetch`): GEMINI then takes a capture it left for the next
step's beginning, as for an instrumented loader, so what the loop does after the optimizer's step
(a position it counts) goes with that step.

Such an iterator with workers that the garbage collector finalizes on one of this library's threads
(a collection runs on whichever thread allocates when it is due) shuts its workers down on a thread
of its own: torch joins each worker for up to 5 s there, and the runtime's event loop stalled that
long (its heartbeats, a session's start: 10 s timed out in a test).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["IteratorWatch", "draw_now", "ended", "untracked"]

log = logging.getLogger(__name__)

_BYPASS = threading.local()
_ACTIVE: list[weakref.ref[IteratorWatch]] = []  # the watch of the newest open GEMINI
_ORIGINAL: list[Callable[[Any], Any]] = []
_KEEP = 8  # iterators tracked at most (the newest): a loop has one or two live at a time
_UNKNOWN = "unknown"  # the RNG state at an iterator's first batch, when it was not seen


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


def ended(it: Any) -> bool:
    """Whether a map-style loader's iterator has yielded its epoch (an iterable dataset's: never known)."""
    try:
        return int(it._num_yielded) >= len(it)
    except (AttributeError, TypeError, ValueError):
        return False


def _datapipe(loader: Any) -> bool:
    """A loader of a datapipe: making its iterator creates a process group (a collective)."""
    try:
        from torch.utils.data.datapipes.datapipe import IterDataPipe
    except ImportError:  # (a torch without datapipes: none)
        return False
    return isinstance(getattr(loader, "dataset", None), IterDataPipe)


def draw_now(it: Any) -> None:
    """A single-process iterator of a map-style dataset: its sampler's lazy draw (a RandomSampler's
    permutation, at the first batch) made now, at the RNG state it was made at. Its first batch of
    indices is taken and put back in front; no data is fetched."""
    from torch.utils.data.dataloader import _DatasetKind

    if getattr(it, "_num_workers", None) != 0 or getattr(it, "_dataset_kind", None) != _DatasetKind.Map:
        return
    indices = getattr(it, "_sampler_iter", None)
    if indices is None:
        return
    try:
        first = next(indices)
    except StopIteration:
        it._sampler_iter = iter(())
        return
    it._sampler_iter = itertools.chain([first], indices)


def _get_iterator(loader: Any) -> Any:
    make = _ORIGINAL[0]
    watch = _ACTIVE[0]() if _ACTIVE else None
    if watch is None or getattr(_BYPASS, "on", False):
        return make(loader)
    it = make(loader) if getattr(loader, "generator", None) is not None else watch.made(loader, make)
    return _observed(it)


_FETCHING: dict[type, type] = {}  # iterator class -> its subclass that says when it fetches
_SEEN = "_lm_resiliency_seen"  # an iterator's [fetched a batch, yielded its epoch], its entry's too


def _seen(it: Any) -> list[bool]:
    """`it`'s [fetched a batch, yielded its epoch], kept up to date at each fetch (see _observed)
    and shared with its entry in the watch, which outlives the iterator."""
    seen = [int(getattr(it, "_num_yielded", 0) or 0) > 0, ended(it)]
    with contextlib.suppress(AttributeError, TypeError):
        it.__dict__[_SEEN] = seen
    return seen


def _observed(it: Any) -> Any:
    """`it`, its `__next__` first telling the open watch a batch is about to be fetched (see
    IteratorWatch.on_fetch). Through a subclass made per iterator class (the instance's class is
    swapped): other iterators of that class are untouched."""
    base = type(it)
    if base in _FETCHING.values():
        return it
    sub = _FETCHING.get(base)
    if sub is None:

        def __next__(self: Any) -> Any:
            watch = _ACTIVE[0]() if _ACTIVE else None
            if watch is not None and getattr(self, "_num_yielded", None) == 0:
                watch.fetching_first(self)
            fetch = watch.on_fetch if watch is not None else None
            if fetch is not None:
                fetch()
            batch = base.__next__(self)
            seen = self.__dict__.get(_SEEN)
            if seen is not None:  # (how far it got, should the loop drop it: see snapshot)
                seen[:] = [True, ended(self)]
            return batch

        methods: dict[str, Any] = {"__next__": __next__, "__module__": base.__module__}
        finalize = getattr(base, "__del__", None)
        if finalize is not None:
            methods["__del__"] = _off_our_threads(finalize)
        sub = type(base.__name__, (base,), methods)
        _FETCHING[base] = sub
    with contextlib.suppress(TypeError):  # (instances that cannot change class: left as they are)
        it.__class__ = sub
    return it


def _off_our_threads(finalize: Callable[[Any], None]) -> Callable[[Any], None]:
    """`finalize` (an iterator's `__del__`: it joins its workers), run on a thread of its own when
    called on one of this library's threads (see the module's doc)."""

    def __del__(self: Any) -> None:
        if threading.current_thread().name.startswith("lm-resiliency"):
            try:  # (the thread holds the iterator until its workers are down)
                threading.Thread(
                    target=finalize, args=(self,), name="lm-resiliency-loader-shutdown", daemon=True
                ).start()
                return
            except RuntimeError:  # (no thread can start: interpreter shutdown, a thread limit)
                pass
        finalize(self)

    return __del__


# A restored capture's iterator: its loader's shape, the RNG state it was made at (None: not known),
# whether it had yielded its epoch, and the RNG state at its first batch (None: not fetched yet;
# _UNKNOWN: not recorded)
_Record = tuple[str, torch.Tensor | None, bool, Any]


class IteratorWatch:
    """The DataLoader iterators of this process (see the module's doc); one per GEMINI."""

    def __init__(self) -> None:
        # [iterator, its loader's shape, the RNG state it was made at (None: made before this
        # watch), the RNG state at its first batch (None: not fetched yet; _UNKNOWN: not seen),
        # [fetched a batch, yielded its epoch] as of its last fetch (see _seen)]
        self._made: list[list[Any]] = []
        # After a restore, until the first forward: the capture's iterators (shape, RNG state, at
        # its end, RNG state at its first batch), and per shape the one made for a record at its
        # end, with the RNG state before.
        self._records: list[_Record] | None = None
        self._undo: dict[str, tuple[weakref.ref[Any] | None, torch.Tensor]] = {}
        # Iterators the loop made before this watch opened, with their loaders (see observe)
        self._premade: list[tuple[weakref.ref[Any], weakref.ref[Any]]] = []
        self._lock = threading.Lock()
        # Called before each batch an iterator made while this watch is open fetches (GEMINI's
        # capture of a step left for the next step's beginning; see Gemini._on_loader_fetch).
        self.on_fetch: Callable[[], None] | None = None

    def install(self) -> None:
        from torch.utils.data import DataLoader

        with self._lock:
            if not _ORIGINAL:
                _ORIGINAL.append(DataLoader._get_iterator)
                DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign,assignment]
            _ACTIVE[:] = [weakref.ref(self)]

    def observe(self, iterators: Iterable[Any], loaders: Iterable[Any] = ()) -> None:
        """DataLoader iterators made before this watch opened: their fetches are seen too (their
        RNG states at making are not known: not recorded for a resumed loop), and those of the
        `loaders` given are matched to a restored capture's iterators (see restore)."""
        by_sampler = {id(getattr(dl, "_index_sampler", None)): dl for dl in loaders}
        for it in iterators:
            if it is not None:
                _observed(it)
                loader = by_sampler.get(id(getattr(it, "_index_sampler", None)))
                if loader is not None:
                    first = None if getattr(it, "_num_yielded", None) == 0 else _UNKNOWN
                    with contextlib.suppress(TypeError), self._lock:
                        self._premade.append((weakref.ref(it), weakref.ref(loader)))
                        self._made.append([weakref.ref(it), _shape(loader), None, first, _seen(it)])

    def fetching_first(self, it: Any) -> None:
        """`it` is about to fetch its first batch: the RNG state now is where a single-process
        RandomSampler draws its permutation (see draw_now), kept for a capture."""
        with self._lock:
            for entry in self._made:
                if entry[0]() is it:
                    if entry[3] is None:
                        entry[3] = torch.get_rng_state()
                    return

    def uninstall(self) -> None:
        """This watch stops (the DataLoader method stays patched, inert without a watch)."""
        with self._lock:
            if _ACTIVE and _ACTIVE[0]() is self:
                _ACTIVE.clear()
            self._records, self._undo = None, {}

    def made(self, loader: Any, make: Callable[[Any], Any]) -> Any:
        shape = _shape(loader)
        persistent = bool(getattr(loader, "persistent_workers", False))
        now = torch.get_rng_state()
        again: torch.Tensor | None = None  # made at this state, the global one restored after
        first: Any = None  # a record's RNG state at its first batch (see _Record)
        next_epoch = False  # a persistent-workers iterator captured at its epoch's end
        with self._lock:
            record = None
            if self._records is not None:
                at = next((i for i, r in enumerate(self._records) if r[0] == shape), None)
                record = self._records.pop(at) if at is not None else None
            undo = self._undo.pop(shape, None) if record is None else None
            if record is not None and (not record[2] or persistent):
                # (one made at a state not known: made again without a draw, as none was made)
                again = record[1] if record[1] is not None else now
                first = record[3]
                next_epoch = record[2]
            elif record is not None:
                self._undo[shape] = (None, now)  # (its iterator filled in below)
        if again is not None:
            torch.set_rng_state(again)
            try:
                it = make(loader)
                if first is _UNKNOWN:  # (drawn as the making left the state: a capture of old)
                    first = torch.get_rng_state()
                if first is not None:  # (None: the capture was before its first batch, as now)
                    torch.set_rng_state(first)
                    draw_now(it)
            finally:
                torch.set_rng_state(now)
            if next_epoch and callable(getattr(it, "_reset", None)):
                self._next_epoch(it, loader, now)
            began = again
        else:
            if undo is not None:
                earlier = undo[0]() if undo[0] is not None else None
                if earlier is None or ended(earlier):  # skipped to its end, or dropped: no step used it
                    now = undo[1]
                    torch.set_rng_state(now)
            began = now
            it = make(loader)
        with self._lock:
            self._made = [m for m in self._made if m[0]() is not None][-(_KEEP - 1) :]
            try:
                ref: weakref.ref[Any] | None = weakref.ref(it)
            except TypeError:  # (an iterator that takes no weak reference)
                ref = None
            if ref is not None:
                self._made.append([ref, shape, began, first, _seen(it)])
            if shape in self._undo and self._undo[shape][0] is None:
                self._undo[shape] = (ref, self._undo[shape][1])
        return it

    def _next_epoch(self, it: Any, loader: Any, before: torch.Tensor) -> None:
        """A persistent-workers iterator made again for one captured at its epoch's end: the
        uninterrupted run's went on to its next epoch after the capture, from the restored state
        `before` (its sampler's next order drawn there: a RandomSampler's from the global RNG; its
        workers kept), and so does this one. If the loop skips it to its end before any step and
        asks for the next epoch (it iterates the ended epoch again to reach its position), that
        reset is made from `before` again: one draw in all, as the uninterrupted run made."""
        reset = type(it)._reset
        it._reset(loader)

        def once(loader_: Any, *args: Any, **kwargs: Any) -> Any:
            it.__dict__.pop("_reset", None)
            if self._records is not None and ended(it):  # (skipped to its end: no step used it)
                torch.set_rng_state(before)
            return reset(it, loader_, *args, **kwargs)

        with contextlib.suppress(AttributeError, TypeError):
            it._reset = once

    def snapshot(self) -> list[dict[str, Any]]:
        """For a capture: each iterator's shape, RNG state it was made at, and whether it yielded
        its epoch, oldest first. One the loop has dropped counts as it was at its last fetch, unless
        the loop made another of its loader since: a capture taken as the worker dies of an
        exception raised in its loop, which unwound the loop's iterator first. (Before, that one was
        left out, and the resumed loop's iterator drew its seed from the state before the restore:
        an exception right after an epoch's last step, and every random number of the resumed run
        was one draw off the uninterrupted run's.)"""
        with self._lock:
            made = [list(m) for m in self._made]
        out = []
        for i, (ref, shape, began, first, seen) in enumerate(made):
            it = ref()
            if it is not None:
                fetched, at_end = int(getattr(it, "_num_yielded", 0) or 0) > 0, ended(it)
            elif any(m[1] == shape for m in made[i + 1 :]):
                continue
            else:
                fetched, at_end = seen
            rng = began.clone() if began is not None else None
            entry = {"shape": shape, "torch": rng, "ended": at_end}
            if not fetched:
                # Its first batch not drawn yet (a capture taken as it fetches it: where an
                # epoch begins): the resumed loop's first fetch draws it, from the restored state.
                entry["first"] = None
            elif first is not _UNKNOWN:
                entry["first"] = first.clone() if isinstance(first, torch.Tensor) else None
            out.append(entry)
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
            first = e.get("first", _UNKNOWN)  # (a capture of an older version: not recorded)

            def state(x: Any) -> bool:
                return isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.shape == (size,)

            if (
                isinstance(shape, str)
                and (rng is None or state(rng))
                and isinstance(ended, bool)
                and (first is None or first is _UNKNOWN or state(first))
            ):
                records.append(
                    (
                        shape,
                        rng.clone() if rng is not None else None,
                        ended,
                        first.clone() if isinstance(first, torch.Tensor) else first,
                    )
                )
            else:
                log.warning("the capture's RNG state of a DataLoader iterator is malformed: not used")
        records = self._made_before(records)
        with self._lock:
            self._records, self._undo = records, {}

    def _made_before(self, records: list[_Record]) -> list[_Record]:
        """A record of an iterator captured at its epoch's end is taken by an iterator the loop has
        already made (before the session opened: a zero-import script's session opens at its first
        forward, after the loop made the epoch's iterator and fetched its first batch), not by one
        made later.

        One captured at its epoch's end stands for the next epoch's iterator, which the
        uninterrupted run made after the capture, from the state just restored: the draws of its
        making (its workers' seed; without workers, a RandomSampler's permutation, as at its first
        batch) are made again now from that state, and the loop's iterator takes its seed. Before,
        they had been drawn before the restore, and every random number after it (dropout) was one
        draw off the uninterrupted run's. (A RandomSampler's own order, drawn before the restore,
        stays as it was: give the loader a `generator=` or a DistributedSampler.) With workers a
        throwaway iterator would start more of them: its draws are made as torch makes them
        instead (the workers' seed, unless they persist: the uninterrupted run's went on to their
        next epoch without one; then the first indices, a RandomSampler's order drawn as the workers
        prefetch). The loop's workers keep the seed they started with: randomness inside them (an
        augmentation) is not the uninterrupted run's. Before, such a loader was left alone, and a
        restart at an epoch's end ended one draw off (outsider 56, 2 workers). Left alone: loaders
        with their own generator (nothing drawn from the global RNG) and of datapipes (a throwaway
        iterator would create a process group)."""
        premade, self._premade = self._premade, []
        left = list(records)
        for it_ref, loader_ref in premade:
            it, loader = it_ref(), loader_ref()
            if (
                it is None
                or loader is None
                or ended(it)  # (an iterator of an earlier run in this process, say)
                or int(getattr(it, "_num_yielded", 0)) > 1
                or getattr(loader, "generator", None) is not None
                or _datapipe(loader)
                or not _ORIGINAL
            ):
                continue
            shape = _shape(loader)
            at = next((i for i, r in enumerate(left) if r[0] == shape and r[2]), None)
            if at is None:
                continue
            left.pop(at)
            if getattr(loader, "num_workers", 0) != 0:
                if not getattr(loader, "persistent_workers", False):
                    torch.empty((), dtype=torch.int64).random_()  # (its workers' seed)
                with contextlib.suppress(Exception):  # (a sampler that fails says so to the loop)
                    next(iter(loader._index_sampler))
                continue
            with untracked():
                again = _ORIGINAL[0](loader)
            draw_now(again)
            if hasattr(again, "_base_seed"):
                it._base_seed = again._base_seed
        return left

    def first_step(self) -> None:
        """The restored generation's first forward (or capture): iterators made from now on are
        new ones, made as torch makes them."""
        with self._lock:
            self._records, self._undo = None, {}
