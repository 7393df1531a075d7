"""Moving tensor bytes into a capture slot: synchronously on CPU, asynchronously from a GPU.

`CudaCopier` issues device-to-host copies on a side stream into page-locked shared memory (the slot is
registered with `cudaHostRegister`), records an event, and returns at once: the training thread pays
only for issuing the copies. Two fences keep it correct:
- `fence_device()` (called by the optimizer's pre-step hook) makes the compute stream wait for the
  copy before the next optimizer step mutates the parameters: a GPU-side wait, no host block;
- `wait_host()` (called by the worker thread) blocks until the bytes are in host memory, before the
  slot is checksummed and committed.
`SyncCopier` is the CPU path: a plain copy, already complete when it returns.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["Completion", "Copier", "CudaCopier", "SyncCopier", "copier_for"]

log = logging.getLogger(__name__)


class Completion(Protocol):
    def wait_host(self) -> None: ...
    def fence_device(self) -> None: ...


class Copier(Protocol):
    asynchronous: bool  # whether copies may still be in flight when `copy` returns

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], first: int = 0) -> Completion:
        """Copy each source tensor's bytes into its destination (a uint8 view of the slot). The
        first `first` pairs hold what the next forward changes in place (a BatchNorm's running
        statistics): the compute that follows the call never runs ahead of their copies. The rest
        must land before `Completion.fence_device` returns (the optimizer's next step)."""
        ...

    def register_host(self, buffer: Any, nbytes: int) -> None:
        """Page-lock `buffer` for asynchronous copies (no-op where not needed)."""
        ...

    def unregister_host(self, buffer: Any) -> None: ...


class _Done:
    def wait_host(self) -> None:
        return None

    def fence_device(self) -> None:
        return None


DONE = _Done()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _source(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """What is copied into `dst`: `src` itself where `dst` is a view of the slot with its dtype and
    shape (the same bytes, copied as they are), else `src`'s bytes (`dst` a byte view)."""
    return src if dst.dtype == src.dtype and dst.shape == src.shape else _bytes_of(src)


class SyncCopier:
    """Copies in the calling thread: one `_foreach_copy_` for all of them (a model of a thousand
    tensors would otherwise pay the dispatch of a thousand `copy_` calls in Python)."""

    asynchronous = False

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], first: int = 0) -> Completion:
        if not pairs:  # (copied before the call returns: `first` needs nothing more)
            return DONE
        try:  # each destination typed and shaped like its source, as a capture's are
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        except RuntimeError:  # byte views, or sources foreach cannot take: one by one, all again
            for dst, src in pairs:
                dst.copy_(_source(dst, src))
        return DONE

    def register_host(self, buffer: Any, nbytes: int) -> None:
        return None

    def unregister_host(self, buffer: Any) -> None:
        return None


class _CudaCompletion:
    def __init__(self, event: Any, device: torch.device) -> None:
        self.event = event
        self.device = device

    def wait_host(self) -> None:
        self.event.synchronize()

    def fence_device(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CudaCopier:
    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._registered: dict[int, int] = {}

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], first: int = 0) -> Completion:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the copies read the state as the optimizer left it
        with torch.cuda.stream(self.stream):
            self._issue(pairs[:first])
            if first:
                # What the next forward changes in place is copied: the compute stream waits for
                # those copies only (small), the rest overlaps the forward and backward.
                compute.wait_event(_recorded(self.stream))
            self._issue(pairs[first:])
            event = _recorded(self.stream)
        return _CudaCompletion(event, self.device)

    def _issue(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The copies, on the current stream (the side stream)."""
        for dst, src in pairs:
            if src.is_cuda:
                dst.copy_(_source(dst, src), non_blocking=True)
                src.record_stream(self.stream)  # keep temporaries alive until the copy is done
            else:
                dst.copy_(_source(dst, src))

    def register_host(self, buffer: Any, nbytes: int) -> None:
        import ctypes

        ptr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        if ptr in self._registered:
            return
        nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # a mapping covers whole pages
        err = _cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            # The failure stays as the runtime's "last error" and would be reported by the next kernel
            # launch as if that kernel had failed: clear it. Still correct, only slower: copies into
            # pageable memory are synchronous.
            _clear_last_cuda_error()
            log.warning("cudaHostRegister of a %d-byte capture slot failed (error %d)", nbytes, int(err))
            return
        self._registered[ptr] = nbytes

    def unregister_host(self, buffer: Any) -> None:
        import ctypes

        try:
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        except (TypeError, ValueError):  # already unmapped
            return
        if self._registered.pop(ptr, None) is not None:
            _cudart().cudaHostUnregister(ptr)


def _recorded(stream: Any) -> Any:
    """A CUDA event recorded on `stream` now."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _clear_last_cuda_error() -> None:
    """cudaGetLastError() of the CUDA runtime torch loaded (torch's binding does not expose it)."""
    import ctypes

    fn = getattr(_cudart(), "cudaGetLastError", None)
    if fn is not None:
        fn()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
            return
    except OSError as exc:
        log.warning("could not clear the CUDA error left by cudaHostRegister: %s", exc)


def copier_for(tensors: Sequence[torch.Tensor]) -> Copier:
    """The CUDA copier when any tensor lives on a GPU, else the synchronous one."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    if device is None:
        return SyncCopier()
    return CudaCopier(device)
