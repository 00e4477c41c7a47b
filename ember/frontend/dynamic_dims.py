"""Which dims of an input tensor are symbolic: the user's marks (`ember.mark_dynamic` & co.) and the policy of
`ember.compile(dynamic=...)`, with torch.compile's meaning.

- dynamic=False: every size is specialized (a changed size recompiles), except dims the user marked dynamic.
- dynamic=True: every dim of size >= 2 of every input tensor is symbolic from the first capture.
- dynamic=None (default): the first capture is static; a recompile makes the dims whose size changed since the
  earlier captures of the same function symbolic ("automatic dynamic"), so a second size compiles once more and
  later sizes reuse that graph.

Never symbolic: sizes 0 and 1 (broadcasting and empty tensors change what an op means there: a symbol must not
stand for both), parameters and buffers of modules (a model's weights have one size; torch's default too), dims
marked static, and tensors of other types than torch.Tensor / nn.Parameter or layouts (their metadata may be
defined in Python).
"""
from __future__ import annotations

from typing import Iterable

import torch

# set once any tensor was marked: captures then look for marks on every input tensor
_ANY_MARKED = False


def _dims(dim: int | Iterable[int]) -> list[int]:
    return [dim] if isinstance(dim, int) else list(dim)


def mark_dynamic(t: torch.Tensor, dim: int | Iterable[int], min: int | None = None, max: int | None = None) -> None:
    """Make `t.size(dim)` symbolic in every capture that reads `t` (as torch._dynamo.mark_dynamic). min/max bound
    the sizes the compiled code admits (a call outside them recompiles)."""
    global _ANY_MARKED
    marks = t.__dict__.setdefault("_ember_dynamic_dims", {})
    for d in _dims(dim):
        marks[d + t.dim() if d < 0 else d] = (min, max)
    _ANY_MARKED = True


def maybe_mark_dynamic(t: torch.Tensor, dim: int | Iterable[int]) -> None:
    """A hint that `t.size(dim)` varies: symbolic from the first capture, specialized without complaint where the
    program needs its value."""
    mark_dynamic(t, dim)


def mark_static(t: torch.Tensor, dim: int | Iterable[int]) -> None:
    """Never make `t.size(dim)` symbolic, whatever `dynamic=` says (a changed size recompiles)."""
    global _ANY_MARKED
    marks = t.__dict__.setdefault("_ember_static_dims", set())
    for d in _dims(dim):
        marks.add(d + t.dim() if d < 0 else d)
    _ANY_MARKED = True


def _is_module_state(t: torch.Tensor, source: str) -> bool:
    return isinstance(t, torch.nn.Parameter) or "._parameters[" in source or "._buffers[" in source


class DimPolicy:
    """The symbolic dims of each tensor one capture wraps. `frame_state` is the function's memory of the sizes
    its earlier captures saw, by source (None where a dim was already found to change): shared by every capture
    of one FrameCompiler and updated here."""

    def __init__(self, dynamic: bool | None, frame_state: dict, sizes_changed: bool = False):
        self.dynamic = dynamic
        self.frame_state = frame_state
        self.sizes_changed = sizes_changed   # (FrameCompiler.sizes_changed: this call's sizes differ from before)
        self.changed: dict[str, list[tuple[int, int | None, int]]] = {}   # source -> (dim, old, new) (for the log)

    def may_be_symbolic(self) -> bool:
        """Whether this capture may have a symbolic dim (a ShapeEnv is made only then)."""
        return self.dynamic is True or _ANY_MARKED or (self.dynamic is None and (self.sizes_changed or any(
            v is None or type(v) is tuple and None in v for v in self.frame_state.values())))

    def int_is_symbolic(self, source: str, value: int) -> bool:
        """Whether the Python int at `source` is a symbol in this capture: it changed since an earlier capture
        (automatic dynamic, as torch.compile does for ints: the sizes a resume function receives after a graph
        break, a length passed along with a tensor) and is not 0 or 1."""
        if self.dynamic is False:
            return False
        key = ("int", source)
        seen = self.frame_state.get(key, value)
        changed = seen is None or seen != value
        self.frame_state[key] = None if changed else value
        return changed and value not in (0, 1)

    def dims(self, t: torch.Tensor, source: str) -> dict[int, tuple[int | None, int | None]]:
        """dim -> (min, max) for the dims of `t` (read at `source`) that are symbolic in this capture."""
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided or \
                _is_module_state(t, source):
            return {}
        shape = tuple(t.shape)
        seen = self.frame_state.get(source)
        if self.dynamic is not False:
            # automatic dynamic: remember the sizes; a dim whose size changed since an earlier capture stays symbolic
            merged = shape if seen is None or len(seen) != len(shape) else \
                tuple(None if s is None or s != n else s for s, n in zip(seen, shape))
            self.frame_state[source] = merged
        out: dict[int, tuple[int | None, int | None]] = {}
        if self.dynamic is True:
            out = {d: (None, None) for d in range(len(shape))}
        elif self.dynamic is None and seen is not None and len(seen) == len(shape):
            for d, (s, n) in enumerate(zip(seen, shape)):
                if s is None or s != n:
                    out[d] = (None, None)
                    if s is not None:
                        self.changed.setdefault(source, []).append((d, s, n))
        marks = t.__dict__.get("_ember_dynamic_dims")
        if marks:
            out.update({d: b for d, b in marks.items() if d < len(shape)})
        static = t.__dict__.get("_ember_static_dims")
        for d in static or ():
            out.pop(d, None)
        # (a size outside the range its mark gives is static in this capture: a call outside the range recompiles)
        return {d: (lo, hi) for d, (lo, hi) in out.items()
                if shape[d] >= 2 and (lo is None or shape[d] >= lo) and (hi is None or shape[d] <= hi)}
