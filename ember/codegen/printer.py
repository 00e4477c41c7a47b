"""The base of ember's two printers (C++ in cpp.py, Triton in triton/printer.py): Body prints an Expr DAG as
straight-line code, one statement per node and each node once (Exprs are interned: CSE by identity), looking
ops up in the printer's tables; kernel_args lists a fused group's pointer arguments. A printer subclasses Body
with its statement form, literal forms, op tables and the ops no table entry prints."""
from __future__ import annotations

import math
from typing import Callable

import torch

from ember.ir import Expr
from ember.codegen.schedule import FusedGroup, Member


class Body:
    """Straight-line code for Exprs, one statement per DAG node (CSE by identity, since Exprs are interned)."""

    prefix = "t"    # variables are named prefix + the number of the statement defining them
    TYPES: dict = {}    # dtype -> its type in the printed language (`{t}` in the literal forms)
    # literal forms, formatted with t (the type) and v (the value)
    TRUE, FALSE = "true", "false"
    NAN = INF = NEG_INF = FINITE = ""

    def __init__(self, scalars: dict, indent: str):
        self.scalars, self.indent = scalars, indent   # buffer -> the variable holding its one value
        self.lines: list[str] = []
        self.names: dict = {}    # id(Expr) -> the variable (or literal) holding its value
        self.stored: dict = {}   # (buffer, offset) -> the variable already holding that element (read as is)

    def emit(self, e: Expr) -> str:
        for x in e.walk():
            if id(x) not in self.names:
                self.names[id(x)] = self._node(x)
        return self.names[id(e)]

    def var(self, code: str, dtype: torch.dtype) -> str:
        n = f"{self.prefix}{len(self.lines)}"
        self.lines.append(self.assignment(n, code, dtype))
        return n

    def _node(self, x: Expr) -> str:
        if x.op == "const":
            return self.literal(x.args[0], x.dtype)
        if x.op == "load":
            name, off = x.args
            if name in self.scalars:
                return self.scalars[name]
            if (name, off) in self.stored:
                return self.stored[(name, off)]
            return self.load(x)
        if x.op == "index":
            return self.index(x)
        a = [self.names[id(y)] if isinstance(y, Expr) else y for y in x.args]
        if x.op == "cast":
            return self.cast(x, a)
        if x.op == "checked_index":
            return self.checked_index(x, a)
        if x.op == "rand":
            return self.rand(x, a)
        if x.op == "where":
            return self.where(x, a)
        return self.operation(x, a)

    def operation(self, x: Expr, a: list) -> str:
        """An op printed from the tables (`unary_tables`, `binary_tables`), formatted with its arguments and
        `format_fields` of its first argument's dtype."""
        dtype = x.args[0].dtype
        fields = self.format_fields(dtype)
        tables = self.unary_tables(dtype) if len(a) == 1 else self.binary_tables(dtype)
        for table in tables:
            if x.op in table:
                return self.var(table[x.op].format(*a, **fields), x.dtype)
        raise self.no_template(x.op, dtype, len(a))

    def literal(self, v, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return self.TRUE if v else self.FALSE
        if not dtype.is_floating_point:
            return self.integer_literal(int(v), dtype)
        v = float(v)
        form = self.NAN if math.isnan(v) else (self.NEG_INF if v < 0 else self.INF) if math.isinf(v) else self.FINITE
        return form.format(t=self.TYPES[dtype], v=v)

    # ---------------------------------------------------------------------------------- what a printer supplies
    def assignment(self, name: str, code: str, dtype: torch.dtype) -> str:
        """The statement defining variable `name` as `code`, at the body's indent."""
        raise NotImplementedError

    def integer_literal(self, v: int, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def unary_tables(self, dtype: torch.dtype) -> list[dict]:
        """The op -> format-string tables for an op of one argument of `dtype`, the first holding it wins."""
        raise NotImplementedError

    def binary_tables(self, dtype: torch.dtype) -> list[dict]:
        raise NotImplementedError

    def format_fields(self, dtype: torch.dtype) -> dict:
        """Named fields of the op tables' format strings for arguments of `dtype` (e.g. {t}: their type)."""
        raise NotImplementedError

    def no_template(self, op: str, dtype: torch.dtype, arity: int) -> Exception:
        """The error for an op no table holds."""
        return KeyError(op)

    def load(self, x: Expr) -> str:
        raise NotImplementedError

    def index(self, x: Expr) -> str:
        raise NotImplementedError

    def cast(self, x: Expr, a: list) -> str:
        raise NotImplementedError

    def checked_index(self, x: Expr, a: list) -> str:
        raise NotImplementedError

    def rand(self, x: Expr, a: list) -> str:
        raise NotImplementedError

    def where(self, x: Expr, a: list) -> str:
        raise NotImplementedError


def kernel_args(group: FusedGroup, in_kernel: Callable[[Member], bool]) -> tuple[list[str], list[str]]:
    """(pointer arguments of a group's kernel: the buffers it reads, then those it writes; the written ones).
    Members `in_kernel` holds keep their values inside the kernel (registers, row buffers): no pointer. A
    reduction's value is never read back from memory; an in-place member writes its input's pointer."""
    inside = {m.buf.name for m in group.members if in_kernel(m) or m.is_reduction}
    reads = sorted(set().union(*(m.reads for m in group.members)) - inside)
    writes = [m.target for m in group.members if not in_kernel(m)]
    return list(dict.fromkeys(reads + writes)), writes
