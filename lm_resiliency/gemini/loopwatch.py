"""Where the training loop comes back around after an optimizer step.

A capture of step s must hold what the loop's own code does after `optimizer.step()` (an EMA of the
weights it updates, a counter or data position it advances) and nothing of step s+1 (the batch it
draws next from the global RNG, the position it advances first). A loop that reads a DataLoader
every step marks that moment with its next fetch (see `gemini.iterators`); any other loop marks it
with its back edge: the jump back to the header of the loop that holds the step, in the frame that
called the optimizer (or a caller of it, when the step was taken in a helper that returned).

`LoopWatch` finds the back edge as a debugger's "step out" does: it sets a trace function on that
one frame (`frame.f_trace`, line events) and a global one that traces nothing else, from the step
until the back edge (a few line events a capture: the lines after the step), then removes both.
The jump targets come from the frame's bytecode (`dis`), once per code object: a line event at the
start of a loop that holds the step's call is the back edge; a `with` block's exit, a loop's
condition evaluated at its bottom, or a loop that follows the step are not.

It stands aside while another tracer runs (a debugger, a coverage tool: `sys.gettrace()`), where
the capture is taken at the step itself as before.
"""

from __future__ import annotations

import dis
import functools
import logging
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# Frames of torch and of this package are the step's machinery (the optimizer's and scheduler's
# wrappers, our hooks), not the loop: the watch starts at the first frame outside them (the
# quickstart's own loop, in `cli`, is a loop).
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LOOPS = _PACKAGE + "cli" + os.sep


def _machinery(code: types.CodeType) -> bool:
    name = code.co_filename
    return name.startswith((_TORCH, _PACKAGE)) and not name.startswith(_LOOPS)


@functools.lru_cache(maxsize=512)
def _loops(code: types.CodeType) -> tuple[tuple[int, int], ...]:
    """The (target, jump) byte offsets of `code`'s backward jumps: the loops, header to end."""
    out = []
    for ins in dis.get_instructions(code):
        jump = ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs
        if jump and isinstance(ins.argval, int) and ins.argval <= ins.offset:
            out.append((ins.argval, ins.offset))
    return tuple(out)


def _untraced(frame: types.FrameType, event: str, arg: Any) -> None:
    """The global trace function while a watch is armed: no other frame is traced."""
    return None


class LoopWatch:
    """Calls `on_edge` once, at the back edge of the loop that took the step (see the module)."""

    def __init__(self) -> None:
        self._frame: types.FrameType | None = None
        self._heads: frozenset[int] = frozenset()
        self._on_edge: Callable[[], None] | None = None

    @property
    def armed(self) -> bool:
        return self._on_edge is not None

    @staticmethod
    def available() -> bool:
        """No other tracer runs on this thread (ours, armed, counts as none)."""
        return sys.gettrace() in (None, _untraced)

    def arm(self, on_edge: Callable[[], None]) -> bool:
        """Watch the loop around the caller's step (call on the training thread, from inside the
        step's hooks). False where it cannot: another tracer runs, or no frame outside the step's
        machinery is found."""
        self.disarm()
        if not self.available():
            return False
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and _machinery(frame.f_code):
            frame = frame.f_back
        if frame is None:
            return False
        self._on_edge = on_edge
        self._watch(frame)
        sys.settrace(_untraced)
        return True

    def disarm(self) -> None:
        """Stop watching (the edge came, or the step ended another way); idempotent."""
        frame, self._frame, self._on_edge = self._frame, None, None
        if frame is not None:
            frame.f_trace = None
        if sys.gettrace() is _untraced:
            sys.settrace(None)

    def _watch(self, frame: types.FrameType) -> None:
        at = frame.f_lasti  # the call that is running in this frame: the step, or what took it
        self._heads = frozenset(head for head, end in _loops(frame.f_code) if head <= at <= end)
        self._frame = frame
        frame.f_trace_lines = True
        frame.f_trace = self._trace

    def _trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame is not self._frame:
            return None
        if event == "line":
            if frame.f_lasti in self._heads:
                on_edge = self._on_edge
                self.disarm()
                if on_edge is not None:
                    try:
                        on_edge()
                    except Exception:  # never into the user's loop
                        log.exception("the step's capture at the loop's back edge failed")
                return None
        elif event == "return":  # the step was taken in a helper: its caller's loop holds it
            frame.f_trace = None
            parent = frame.f_back
            if parent is None:
                self.disarm()
                return None
            self._watch(parent)
            return None
        return self._trace
