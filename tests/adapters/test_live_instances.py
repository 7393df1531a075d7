"""`live_instances` (the GradScaler/scheduler/DDP lookups) while other threads build tuples.

CPython 3.11 lists tuples still being built in `gc.get_objects()`; a builder that resumes while
a reference from that list is alive fails with a SystemError. It killed ranks' runtime loops in
CI. Here a thread builds tuples from a generator (the resizing path) with the interpreter
switching threads as often as it can, while the main thread scans; cycles with finalizers make
the scans' allocations collect garbage (Python code) too."""

from __future__ import annotations

import sys
import threading

import pytest

from lm_resiliency.adapters.base import live_instances

pytestmark = pytest.mark.timeout(120)


class _Base:
    pass


class _Sub(_Base):
    pass


class _Meta(type):
    def __hash__(cls) -> int:  # Python code: a scan must not hash the types it meets
        return 1


class _Odd(metaclass=_Meta):
    pass


class _Finalized:
    def __del__(self) -> None:
        sum(range(20))


def test_scans_find_instances_of_subclasses_and_leave_tuples_being_built_alone() -> None:
    kept = [_Base(), _Sub(), _Odd()]
    errors: list[BaseException] = []
    stop = threading.Event()

    def build() -> None:
        while not stop.is_set():
            try:
                tuple(i for i in range(30))
            except SystemError as exc:
                errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    try:
        for _ in range(150):
            for _ in range(100):
                a = _Finalized()
                a.cycle = [a]  # type: ignore[attr-defined]
            found = live_instances(_Base)
    finally:
        stop.set()
        builder.join(timeout=30)
        sys.setswitchinterval(interval)
    assert not errors, f"{len(errors)} tuples failed to build: {errors[0]!r}"
    assert {id(o) for o in found} == {id(kept[0]), id(kept[1])}
    assert live_instances(_Odd) == [kept[2]]
