"""Control-flow signals inside the interpreter: a Python exception of the captured code, a frame's return, and
the stop at the root frame's break instruction."""
from __future__ import annotations

import dis
from typing import TYPE_CHECKING

from ember.errors import Unsupported
from ember.frontend.values import V

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


class PyError(Unsupported):
    """A Python exception the captured code raises. Handlers in the code (try/except, with) may catch it;
    one that escapes the root frame becomes a graph break, so Python raises it for real."""

    def __init__(self, exc: BaseException, where_: str = ""):
        super().__init__(f"{type(exc).__name__}: {exc}", where_)
        self.exc = exc


class Return(Exception):
    """A frame's return value, raised by the return opcodes to end the frame loop."""

    def __init__(self, value: V):
        self.value = value


class StopCapture(Exception):
    """Raised at the root frame's stop offset: the state there is what the entry code rebuilds."""

    def __init__(self, frame: "Frame", inst: dis.Instruction, reason: str):
        self.frame, self.inst, self.reason = frame, inst, reason

