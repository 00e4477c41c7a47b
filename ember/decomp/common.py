"""What every decomposition family shares: registering a function for ATen ops in the family's ENTRIES, and the
meta value (shape, dtype) of the node being lowered, which decompositions compute their result in."""
from __future__ import annotations

from typing import Callable

import torch

from ember import ir
from ember.ir import symbols


def registrar(entries: dict) -> Callable:
    """The decorator `@reg(op, ...)` entering a function into `entries` for each op."""
    def reg(*ops):
        def deco(fn):
            for op in ops:
                entries[op] = fn
            return fn
        return deco
    return reg


def out():
    """The meta value of the node being lowered (its shape, dtype)."""
    return ir.GRAPH.val


def out_shape() -> tuple:
    """The node's (first) result's sizes as the loop IR holds them: sympy, symbolic ones over the graph's symbols
    (a SymInt of the meta value is never handed on: its int() or comparison would be a guard)."""
    v = out()
    return symbols.sym_sizes((v[0] if isinstance(v, (tuple, list)) else v).shape)


def odt() -> torch.dtype:
    """The dtype of the node's (first) result."""
    v = out()
    return (v[0] if isinstance(v, (tuple, list)) else v).dtype


def floaty(d: torch.dtype) -> bool:
    return d.is_floating_point
