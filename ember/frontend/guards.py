"""Guards: every assumption a capture relied on, as Python expressions over the frame's arguments.

They are compiled into one generated function per cache entry, cheapest checks first (identity and type,
then constants and lengths, then tensor metadata), because guard evaluation is most of a compiled call's
overhead. Shapes are checked exactly here (static shapes); symbolic sizes will replace `tensor()` checks.
"""
from __future__ import annotations

import math

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
