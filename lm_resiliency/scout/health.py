"""Hardware telemetry: a `HealthSource` yields `HealthEvent`s; fatal ones become SCOUT verdicts.

- `NvmlHealthSource` (nvidia-ml-py's `pynvml`): critical XID events (an event set, polled without
  waiting), uncorrectable ECC errors and row-remap failures (counters that must not grow), NVLink
  error counters, temperature and hardware slowdown (thermal or power brake). A check the device
  does not support is skipped for good; any other NVML error is reported once and retried.
- `ScriptedHealthSource`: events a test or a fault campaign queues; the same interface.
- `default_health_source()`: NVML when the library and a GPU are there, else None.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["HealthEvent", "HealthSource", "NvmlHealthSource", "ScriptedHealthSource", "default_health_source"]

log = logging.getLogger(__name__)

# XIDs that mean the device (or its memory) can no longer be trusted: restart is not enough.
FATAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


@dataclass(frozen=True)
class HealthEvent:
    kind: str  # xid, ecc_uncorrectable, row_remap_failure, nvlink_errors, thermal, hw_slowdown, device_lost
    device: str  # the physical device: its UUID when known, else "gpu<index>"
    fatal: bool
    detail: str
    value: float | None = None


class HealthSource(Protocol):
    def poll(self) -> list[HealthEvent]: ...
    def close(self) -> None: ...


class ScriptedHealthSource:
    """Events queued by a test or a campaign, returned by the next `poll()`."""

    def __init__(self, events: Iterable[HealthEvent] = ()) -> None:
        self._queue: deque[HealthEvent] = deque(events)
        self.polls = 0

    def push(self, event: HealthEvent) -> None:
        self._queue.append(event)

    def poll(self) -> list[HealthEvent]:
        self.polls += 1
        out = list(self._queue)
        self._queue.clear()
        return out

    def close(self) -> None:
        self._queue.clear()


class NvmlHealthSource:
    """Polls NVML for the given device indices (default: all). `nvml` is the `pynvml` module."""

    def __init__(
        self, indices: Iterable[int] | None = None, temp_limit_c: float = 90.0, nvml: Any = None
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        nvml.nvmlInit()
        self._closed = False
        count = nvml.nvmlDeviceGetCount()
        self.indices = list(range(count)) if indices is None else [i for i in indices if 0 <= i < count]
        self.handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices}
        self.names = {i: self._uuid(i) for i in self.indices}
        self.temp_limit_c = temp_limit_c
        self._unsupported: set[tuple[int, str]] = set()
        self._baseline: dict[tuple[int, str], float] = {}
        self._events = None
        try:
            self._events = nvml.nvmlEventSetCreate()
            for h in self.handles.values():
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events)
        except nvml.NVMLError as exc:
            log.info("NVML XID events unavailable: %s", exc)
            self._events = None
        for i in self.indices:  # counters start from what the device already has
            for what in ("ecc", "nvlink"):
                value = self._counter(i, what)
                if value is not None:
                    self._baseline[(i, what)] = value

    def _uuid(self, i: int) -> str:
        try:
            u = self.nvml.nvmlDeviceGetUUID(self.handles[i])
            return u.decode() if isinstance(u, bytes) else str(u)
        except self.nvml.NVMLError:
            return f"gpu{i}"

    def _try(self, i: int, what: str, fn: Any, *args: Any) -> Any:
        if (i, what) in self._unsupported:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError_NotSupported:
            self._unsupported.add((i, what))
            return None
        except self.nvml.NVMLError as exc:
            log.warning("NVML %s on %s failed: %s", what, self.names.get(i, i), exc)
            return None

    def _counter(self, i: int, what: str) -> float | None:
        n, h = self.nvml, self.handles[i]
        if what == "ecc":
            ecc = self._try(
                i,
                "ecc",
                n.nvmlDeviceGetTotalEccErrors,
                h,
                n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                n.NVML_VOLATILE_ECC,
            )
            return None if ecc is None else float(ecc)
        total, seen = 0.0, False
        for link in range(n.NVML_NVLINK_MAX_LINKS):
            for kind in (n.NVML_NVLINK_ERROR_DL_REPLAY, n.NVML_NVLINK_ERROR_DL_CRC_FLIT):
                try:
                    total += n.nvmlDeviceGetNvLinkErrorCounter(h, link, kind)
                    seen = True
                except n.NVMLError:
                    continue
        return total if seen else None

    def poll(self) -> list[HealthEvent]:
        if self._closed:
            return []
        n = self.nvml
        out: list[HealthEvent] = []
        if self._events is not None:
            while True:
                try:
                    data = n.nvmlEventSetWait_v2(self._events, 0)
                except n.NVMLError_Timeout:
                    break
                except n.NVMLError as exc:
                    log.warning("NVML event wait failed: %s", exc)
                    break
                xid = int(getattr(data, "eventData", 0))
                index = next((i for i, h in self.handles.items() if h == getattr(data, "device", None)), -1)
                device = self.names.get(index, f"gpu{index}")
                out.append(HealthEvent("xid", device, xid in FATAL_XIDS, f"XID {xid}", float(xid)))
        for i, h in self.handles.items():
            device = self.names[i]
            ecc = self._counter(i, "ecc")
            if ecc is not None and ecc > self._baseline.get((i, "ecc"), 0.0):
                out.append(
                    HealthEvent(
                        "ecc_uncorrectable", device, True, f"{int(ecc)} uncorrectable ECC errors", ecc
                    )
                )
                self._baseline[(i, "ecc")] = ecc
            rows = self._try(i, "remap", n.nvmlDeviceGetRemappedRows, h)
            if rows is not None and len(rows) >= 4 and rows[3]:
                out.append(HealthEvent("row_remap_failure", device, True, "row remapping failed", None))
            links = self._counter(i, "nvlink")
            if links is not None and links > self._baseline.get((i, "nvlink"), 0.0):
                out.append(
                    HealthEvent(
                        "nvlink_errors", device, False, f"NVLink error counters at {int(links)}", links
                    )
                )
                self._baseline[(i, "nvlink")] = links
            temp = self._try(i, "temperature", n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
            if temp is not None and temp >= self.temp_limit_c:
                out.append(
                    HealthEvent("thermal", device, False, f"{temp} C >= {self.temp_limit_c} C", float(temp))
                )
            reasons = self._try(i, "clocks", n.nvmlDeviceGetCurrentClocksEventReasons, h)
            slow = n.nvmlClocksEventReasonHwSlowdown | n.nvmlClocksEventReasonHwThermalSlowdown
            slow |= n.nvmlClocksEventReasonHwPowerBrakeSlowdown
            if reasons is not None and reasons & slow:
                out.append(
                    HealthEvent(
                        "hw_slowdown",
                        device,
                        False,
                        f"hardware slowdown (reasons {reasons:#x})",
                        float(reasons),
                    )
                )
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("NVML shutdown: %s", exc)


def default_health_source() -> HealthSource | None:
    """NVML on a machine with an NVIDIA driver and GPU; None elsewhere (this is not an error)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no device: no hardware telemetry here
        return None
    return NvmlHealthSource() if count else None
