"""Guards: every assumption a capture relied on, as Python expressions over the frame's arguments.

They are compiled into one generated function per cache entry, cheapest checks first (identity and type,
then constants and lengths, then tensor metadata), because guard evaluation is most of a compiled call's
overhead. Shapes are checked exactly here (static shapes); symbolic sizes will replace `tensor()` checks.
"""
from __future__ import annotations

import math
import re

import torch


def check_tensor(t, ty, dtype, device, shape, stride, requires_grad) -> bool:
    return (type(t) is ty and t.dtype is dtype and t.requires_grad is requires_grad and t.shape == shape
            and t.stride() == stride and t.device == device)


class Guards:
    def __init__(self, consts):
        self.consts = consts
        self.items: list[tuple[int, str]] = []
        self._seen: set[str] = set()

    def add(self, expr: str, cost: int = 1) -> None:
        if expr not in self._seen:
            self._seen.add(expr)
            self.items.append((cost, expr))

    def const(self, source: str, value) -> None:
        if value is None or isinstance(value, bool):
            self.add(f"{source} is {value!r}", 0)
        elif isinstance(value, float) and math.isnan(value):
            self.add(f"type({source}) is float and {source} != {source}", 1)
        elif type(value) in (int, float, str, bytes, complex):  # not subclasses (str enums...): no literal
            self.add(f"type({source}) is {type(value).__name__} and {source} == {value!r}", 1)
        else:
            self.add(f"{source} == {self.consts.ref(value)}", 1)

    def tensor(self, source: str, t: torch.Tensor) -> None:
        c = self.consts.ref
        self.add(f"___check_tensor({source}, {c(type(t))}, {c(t.dtype)}, {c(t.device)}, {tuple(t.shape)}, "
                 f"{tuple(t.stride())}, {t.requires_grad})", 2)

    def exprs(self) -> list[str]:
        return [e for _, e in sorted(self.items, key=lambda item: item[0])]


# A Python string literal (skipped: a path-like text inside one is not a path), or an attribute/subscript chain
# rooted at a name: `mod._modules['features']._parameters['weight']`, `___K3['opt'].state`, `x[0]`.
_SEGMENT = r"(?:\.[A-Za-z_]\w*|\[(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\])"
_TOKEN = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|(?<![\w.\])'"])([A-Za-z_]\w*""" + _SEGMENT + "+)")
_SEGMENTS = re.compile(_SEGMENT)
_CONDITIONAL = re.compile(r"\b(or|if|lambda|for)\b")


def share_paths(guards: list[str], after: list[str]) -> tuple[str, list[str]]:
    """The guards as one condition that evaluates each attribute path once: its first evaluation binds a local
    (`:=`) that later reads use, in the guards and in `after` (statements that run right after the guards
    passed, before any other code could change what the paths lead to). A module's guards read
    `mod._modules[...]...` chains thousands of times (densenet121: 5,600 guards); walking each chain once is
    most of a cached call's cost. A guard whose evaluation may be partial (`or`, `x if c else y`, a lambda or
    comprehension) binds nothing. Works on the text (a regex over paths, string literals skipped): parsing and
    unparsing the guards as a tree cost more than the rest of a resnet18 capture."""
    counts: dict[str, int] = {}
    found = []   # per text: [(start, end, segments of the path)] for its paths
    for text in [*guards, *after]:
        paths = []
        for m in _TOKEN.finditer(text):
            if m.group(2) is None:
                continue
            chain = m.group(2)
            root = re.match(r"[A-Za-z_]\w*", chain).group(0)
            segs = [root] + _SEGMENTS.findall(chain, len(root))
            prefix = root
            for seg in segs[1:]:
                prefix += seg
                counts[prefix] = counts.get(prefix, 0) + 1
            paths.append((m.start(2), m.end(2), segs))
        found.append(paths)
    bound: dict[str, str] = {}

    def rewrite(text: str, paths: list, may_bind: bool) -> str:
        out, pos = [], 0
        for start, end, segs in paths:
            expr = key = segs[0]
            for seg in segs[1:]:
                key += seg
                if key in bound:
                    expr = bound[key]
                    continue
                expr += seg
                if may_bind and counts[key] > 1:
                    bound[key] = f"___p{len(bound)}"
                    expr = f"({bound[key]} := {expr})"
            out += [text[pos:start], expr]
            pos = end
        out.append(text[pos:])
        return "".join(out)

    cond = [rewrite(g, paths, not _CONDITIONAL.search(g)) for g, paths in zip(guards, found)]
    rest = [rewrite(t, paths, False) for t, paths in zip(after, found[len(guards):])]
    return (" and ".join(cond) if cond else "True"), rest
