"""The collective trail: a rank's newest collective states in a file its agent reads after the
process ended, however it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from lm_resiliency.runtime.trail import SIZE, SLOTS, CollectiveTrail, group_digest, read_trail, read_trails

pytestmark = pytest.mark.timeout(60)


def _chain(n: int) -> bytes:
    return xxhash.xxh3_64_digest(str(n).encode())


def test_the_newest_states_of_the_generation_are_read_back_with_the_group(tmp_path: Path) -> None:
    t = CollectiveTrail(tmp_path / "trail", rank=3, generation=2, group=[5, 3, 1])
    for n in range(1, 41):
        t.record(n, _chain(n))
    t.close()
    t.record(41, _chain(41))  # closed: nothing more is written
    group, states = read_trail(tmp_path / "trail" / "r3", 2)  # type: ignore[misc]
    assert group == group_digest([1, 3, 5]) and len(group) == 8
    assert states == [(n, _chain(n)) for n in range(41 - SLOTS, 41)]
    assert read_trail(tmp_path / "trail" / "r3", 1) is None  # another generation's file
    assert read_trail(tmp_path / "trail" / "r9", 2) is None  # absent
    assert list(read_trails(tmp_path / "trail", 2)) == [3]
    assert read_trails(tmp_path / "missing", 2) == {}


def test_a_record_cut_short_or_a_file_that_is_no_trail_is_skipped(tmp_path: Path) -> None:
    t = CollectiveTrail(tmp_path, rank=0, generation=0, group=[0, 1])
    for n in range(1, 4):
        t.record(n, _chain(n))
    t.close()
    raw = bytearray((tmp_path / "r0").read_bytes())
    raw[24 + 2 * 24 + 8] ^= 0xFF  # collective 2's chain, as a process that died mid-write leaves it
    (tmp_path / "r0").write_bytes(bytes(raw))
    _, states = read_trail(tmp_path / "r0", 0)  # type: ignore[misc]
    assert [c for c, _ in states] == [1, 3]
    (tmp_path / "r1").write_bytes(b"\0" * SIZE)  # no magic
    (tmp_path / "r2").write_bytes(bytes(raw[:-1]))  # truncated
    (tmp_path / "notes").write_bytes(bytes(raw))  # not a rank's name
    assert list(read_trails(tmp_path, 0)) == [0]


def test_the_states_outlive_a_process_that_aborts(tmp_path: Path) -> None:
    """SIGABRT right after a record (as gloo aborts on a collective mismatch): nothing is flushed
    by the process, and the record is there."""
    code = (
        "import os, signal, sys\n"
        "from lm_resiliency.runtime.trail import CollectiveTrail\n"
        "t = CollectiveTrail(sys.argv[1], rank=1, generation=4, group=[0, 1, 2])\n"
        "t.record(7, b'abcdefgh')\n"
        "os.kill(os.getpid(), signal.SIGABRT)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=30, env={**os.environ})
    assert p.returncode == -signal.SIGABRT
    assert read_trail(tmp_path / "r1", 4) == (group_digest([0, 1, 2]), [(7, b"abcdefgh")])
