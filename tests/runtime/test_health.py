"""Hardware telemetry: the NVML source's logic against a stand-in NVML, and a scripted source in a session."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from lm_resiliency import enable_resiliency
from lm_resiliency.scout.health import (
    HealthEvent,
    NvmlHealthSource,
    ScriptedHealthSource,
    default_health_source,
)

pytestmark = pytest.mark.timeout(60)


def fake_nvml() -> types.SimpleNamespace:
    """The part of pynvml NvmlHealthSource uses, for a machine without an NVIDIA GPU."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    state = types.SimpleNamespace(
        ecc=0, nvlink=0, temp=60, reasons=0, xids=[], remap_failure=False, shut=False
    )

    def wait(events: object, timeout_ms: int) -> object:
        if not state.xids:
            raise NVMLError_Timeout()
        return types.SimpleNamespace(eventData=state.xids.pop(0), device="h0")

    def nvlink(h: object, link: int, kind: int) -> int:
        if link > 0:
            raise NVMLError_NotSupported()
        return state.nvlink

    return types.SimpleNamespace(
        state=state,
        NVMLError=NVMLError,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVMLError_Timeout=NVMLError_Timeout,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: setattr(state, "shut", True),
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetUUID=lambda h: b"GPU-1234",
        nvmlEventSetCreate=lambda: "set",
        nvmlEventSetFree=lambda s: None,
        nvmlDeviceRegisterEvents=lambda h, kind, s: None,
        nvmlEventTypeXidCriticalError=8,
        nvmlEventSetWait_v2=wait,
        nvmlDeviceGetTotalEccErrors=lambda h, t, c: state.ecc,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlDeviceGetRemappedRows=lambda h: (0, 1, 0, state.remap_failure),
        nvmlDeviceGetNvLinkErrorCounter=nvlink,
        NVML_NVLINK_MAX_LINKS=4,
        NVML_NVLINK_ERROR_DL_REPLAY=0,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2,
        nvmlDeviceGetTemperature=lambda h, s: state.temp,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: state.reasons,
        nvmlClocksEventReasonHwSlowdown=0x8,
        nvmlClocksEventReasonHwThermalSlowdown=0x40,
        nvmlClocksEventReasonHwPowerBrakeSlowdown=0x80,
    )


def test_nvml_source_turns_counters_and_events_into_health_events() -> None:
    nvml = fake_nvml()
    nvml.state.ecc = 2  # errors the device had before we started do not count
    src = NvmlHealthSource(nvml=nvml, temp_limit_c=85)
    assert src.poll() == []
    nvml.state.xids += [13, 79]
    nvml.state.ecc = 3
    nvml.state.nvlink = 5
    nvml.state.temp = 91
    nvml.state.reasons = 0x40
    nvml.state.remap_failure = True
    got = {(e.kind, e.fatal) for e in src.poll()}
    assert got == {
        ("xid", False),
        ("xid", True),
        ("ecc_uncorrectable", True),
        ("row_remap_failure", True),
        ("nvlink_errors", False),
        ("thermal", False),
        ("hw_slowdown", False),
    }
    assert all(e.device == "GPU-1234" for e in src.poll())
    src.close()
    assert nvml.state.shut and src.poll() == []


def test_no_nvml_here_means_no_source() -> None:
    assert default_health_source() is None  # this machine has no NVIDIA driver


def test_fatal_event_becomes_a_hardware_report_naming_the_device() -> None:
    source = ScriptedHealthSource()
    reports: list[dict] = []
    model = nn.Linear(2, 2)
    with enable_resiliency(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        fault_callback=reports.append,
        health_source=source,
    ) as s:
        source.push(HealthEvent("xid", "GPU-abcd", True, "XID 79", 79.0))
        source.push(HealthEvent("thermal", "GPU-abcd", False, "92 C", 92.0))
        deadline = __import__("time").monotonic() + 10
        while len(reports) < 2 and __import__("time").monotonic() < deadline:
            s.wait_for(lambda v: False, 0.05)  # the health task polls every second
    fatal = [r for r in reports if r.get("fatal")]
    assert fatal and fatal[0]["kind"] == "hardware" and fatal[0]["device"] == "GPU-abcd"
    assert fatal[0]["reason"] == "xid_fatal" and fatal[0]["failed_ranks"] == [0]
    assert any(r["reason"] == "thermal" and not r["fatal"] for r in reports)


def test_a_slow_fault_callback_does_not_stall_the_runtime() -> None:
    """User callbacks run on a thread of their own: one blocked in a slow call (a remote logger)
    must not stop the runtime that heartbeats and gossips for this rank."""
    import threading

    source = ScriptedHealthSource()
    release, called = threading.Event(), threading.Event()

    def slow(report: dict) -> None:
        called.set()
        release.wait(30)

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=1, fault_callback=slow, health_source=source) as s:
        source.push(HealthEvent("xid", "GPU-abcd", True, "XID 79", 79.0))
        assert called.wait(10)
        for _ in range(2):
            model(torch.randn(4, 2)).sum().backward()
            opt.step()
        try:
            assert s.wait_for(lambda v: v.telemetry_step(0) == 2, 5.0)  # gossiped while it waits
            # Whoever reaches a verdict (the runtime's event loop, for votes) hands it over and goes on.
            emitted = threading.Event()
            threading.Thread(
                target=lambda: (s._emit_fault({"kind": "straggler"}), emitted.set()), daemon=True
            ).start()
            assert emitted.wait(5)
        finally:
            release.set()


def test_the_report_file_is_open_from_the_start_and_opened_again_once_removed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A rank out of file descriptors still writes the report that says so: its report file was
    opened when the session started. Removed or rotated meanwhile, the next report opens it again."""
    import json
    import os
    import time

    from lm_resiliency import ReplayHarnessConfig

    source = ScriptedHealthSource()
    path = tmp_path / "reports" / "reports-rank0.jsonl"
    seen: list[dict] = []

    def held() -> bool:
        real = os.path.realpath(path)
        return any(os.path.realpath(f"/proc/self/fd/{fd}") == real for fd in os.listdir("/proc/self/fd"))

    model = nn.Linear(2, 2)
    with enable_resiliency(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        fault_callback=seen.append,
        health_source=source,
        replay=ReplayHarnessConfig(report_dir=str(tmp_path / "reports")),
    ) as s:
        assert path.exists() and held()  # before any report
        for n, reason in enumerate(["XID 48", "XID 79"], start=1):
            source.push(HealthEvent("xid", "GPU-abcd", True, reason, 79.0))
            deadline = time.monotonic() + 10
            while len(seen) < n:
                assert time.monotonic() < deadline, seen
                s.wait_for(lambda v: False, 0.05)  # the health task polls every second
            # The file is written before the callbacks run (in order, on one thread).
            lines = [json.loads(x) for x in path.read_text().splitlines()]
            assert [r["detail"] for r in lines] == [reason], lines
            path.unlink()  # rotated away: the next report starts a new file
    assert not held()
