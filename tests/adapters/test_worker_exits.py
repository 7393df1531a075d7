"""The torchrun agent learns which worker failed first, and how, from torch's own process context
(`adapters/torchrun._WorkerExits`): torch hands a rendezvous handler nothing of why its workers
stopped. Real worker processes started by torch's elastic multiprocessing, as torchrun starts them."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from lm_resiliency.adapters.torchrun import _WorkerExits

pytestmark = pytest.mark.timeout(60)

# Local rank 0 waits to be stopped; local rank 1 ends as `how` says.
SCRIPT = """
import os, signal, sys, time
if sys.argv[1] == "wait":
    time.sleep(30)
elif sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
else:
    sys.exit(int(sys.argv[1]))
"""


def _run(tmp_path: Path, how: str) -> None:
    ctx = start_processes(
        name="trainer",
        entrypoint=sys.executable,
        args={0: ("-c", SCRIPT, "wait"), 1: ("-c", SCRIPT, how)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
    )
    try:
        deadline = time.monotonic() + 30
        while ctx.wait(0) is None:  # torch's agent polls the same way
            assert time.monotonic() < deadline, "the worker never ended"
            time.sleep(0.05)
    finally:
        ctx.close()


@pytest.mark.parametrize(("how", "code"), [("kill", -signal.SIGKILL), ("3", 3)])
def test_the_first_worker_to_fail_is_taken_with_its_exit_code(tmp_path: Path, how: str, code: int) -> None:
    exits = _WorkerExits.install()
    assert _WorkerExits.install() is exits  # one per agent process
    exits.take()
    t0 = time.time()
    _run(tmp_path, how)
    seen = exits.take()
    assert seen is not None
    local, exitcode, pid, at = seen
    assert (local, exitcode) == (1, code)
    assert pid > 0 and t0 <= at <= time.time()
    assert exits.take() is None  # taken once


def test_workers_that_end_well_leave_nothing(tmp_path: Path) -> None:
    exits = _WorkerExits.install()
    exits.take()
    ctx = start_processes(
        name="trainer",
        entrypoint=sys.executable,
        args={0: ("-c", "pass"), 1: ("-c", "pass")},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
    )
    try:
        deadline = time.monotonic() + 30
        while ctx.wait(0) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        ctx.close()
    assert exits.take() is None
