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
_ROOT = re.compile(r"[A-Za-z_]\w*")
_CONDITIONAL = re.compile(r"\b(or|if|lambda|for)\b")


def share_paths(guards: list[str], after: list[str]) -> tuple[str, list[str]]:
    """The guards as one condition that evaluates each attribute path once: its first evaluation binds a local
    (`:=`) that later reads use, in the guards and in `after` (statements that run right after the guards
    passed, before any other code could change what the paths lead to). A module's guards read
    `mod._modules[...]...` chains thousands of times (densenet121: 5,600 guards); walking each chain once is
    most of a cached call's cost. A guard whose evaluation may be partial (`or`, `x if c else y`, a lambda or
    comprehension) binds nothing. Works on the text (a regex over paths, string literals skipped): parsing and
    unparsing the guards as a tree cost more than the rest of a resnet18 capture."""
    # a path prefix is known by a small int (its parent's int and its last segment), not by its text: hashing
    # ever longer prefix strings was most of the work on densenet121's 3,500 guards
    prefix_ids: dict[tuple, int] = {}
    counts: list[int] = []
    parsed: dict[str, tuple] = {}   # chain text -> (segments, prefix ids of segments[1:])
    found = []   # per text: [(start, end, segments, prefix ids)] for its paths
    for text in [*guards, *after]:
        paths = []
        for m in _TOKEN.finditer(text):
            chain = m.group(2)
            if chain is None:
                continue
            p = parsed.get(chain)
            if p is None:
                root = _ROOT.match(chain).group(0)
                segs = [root] + _SEGMENTS.findall(chain, len(root))
                ids, parent = [], root
                for seg in segs[1:]:
                    key = (parent, seg)
                    pid = prefix_ids.get(key)
                    if pid is None:
                        pid = prefix_ids[key] = len(counts)
                        counts.append(0)
                    ids.append(pid)
                    parent = pid
                p = parsed[chain] = (segs, ids)
            for pid in p[1]:
                counts[pid] += 1
            paths.append((m.start(2), m.end(2), *p))
        found.append(paths)
    bound: dict[int, str] = {}

    def rewrite(text: str, paths: list, may_bind: bool) -> str:
        out, pos = [], 0
        for start, end, segs, ids in paths:
            expr = segs[0]
            for seg, pid in zip(segs[1:], ids):
                if pid in bound:
                    expr = bound[pid]
                    continue
                expr += seg
                if may_bind and counts[pid] > 1:
                    bound[pid] = f"___p{len(bound)}"
                    expr = f"({bound[pid]} := {expr})"
            out += [text[pos:start], expr]
            pos = end
        out.append(text[pos:])
        return "".join(out)

    # ("or"/"if"/"lambda" substrings first: the word regex is slow, and most guards contain none of them)
    cond = [rewrite(g, paths, not (("or" in g or "if" in g or "lambda" in g) and _CONDITIONAL.search(g)))
            for g, paths in zip(guards, found)]
    rest = [rewrite(t, paths, False) for t, paths in zip(after, found[len(guards):])]
    return (" and ".join(cond) if cond else "True"), rest
