"""Guards: every assumption a capture relied on, as Python expressions over the frame's arguments.

They are compiled into one generated function per cache entry, cheapest checks first (identity and type,
then constants and lengths, then tensor metadata), because guard evaluation is most of a compiled call's
overhead. Shapes are checked exactly here (static shapes); symbolic sizes will replace `tensor()` checks.
"""
from __future__ import annotations

import ast
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


def _path(node: ast.AST) -> bool:
    """An attribute/subscript chain rooted at a name: `mod._modules['features']._parameters['weight']`."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Constant):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def _key(node: ast.AST) -> str:
    """The source of a path (`_path(node)` holds), spelled out directly: ast.unparse per node made share_paths
    quadratic-ish in practice (BERT's 21K path nodes: 10 s of a 26 s cold compile)."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        parts.append(f".{node.attr}" if isinstance(node, ast.Attribute) else f"[{node.slice.value!r}]")
        node = node.value
    return node.id + "".join(reversed(parts))


def share_paths(cond: str, after: list[str]) -> tuple[str, list[str]]:
    """Evaluate each attribute path the guards read once: its first evaluation binds a local (`:=`) that later
    reads use, in the guards and in `after` (statements that run right after the guards passed, before any
    other code could change what the paths lead to). A module's guards read `mod._modules[...]...` chains
    thousands of times (densenet121: 5,600 guards); walking each chain once is most of a cached call's cost.
    A path first read where evaluation is conditional (right of `or`, inside `x if c else y`) binds nothing."""
    tree = ast.parse(cond, mode="eval")
    rest = [ast.parse(s, mode="exec") for s in after]
    counts: dict[str, int] = {}
    for t in [tree, *rest]:
        for node in ast.walk(t):
            if isinstance(node, (ast.Attribute, ast.Subscript)) and _path(node):
                key = _key(node)
                counts[key] = counts.get(key, 0) + 1
    shared = {k for k, n in counts.items() if n > 1}
    if not shared:
        return cond, after
    bound: dict[str, str] = {}

    def rewrite(node: ast.AST, conditional: bool, top: bool = False) -> ast.AST:
        if isinstance(node, (ast.Attribute, ast.Subscript)) and _path(node):
            key = _key(node)
            if key in bound:
                return ast.Name(bound[key], ast.Load())
            node.value = rewrite(node.value, conditional)
            if key in shared and not conditional:
                bound[key] = f"___p{len(bound)}"
                return ast.NamedExpr(ast.Name(bound[key], ast.Store()), node)
            return node
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return node  # its own scope: leave as written
        if isinstance(node, ast.BoolOp):
            # Operands after the first run only if the first allowed it, except in the guards' top-level
            # `and`: `after` runs only when every one of those ran.
            seq = top and isinstance(node.op, ast.And)
            node.values = [rewrite(v, conditional or (i > 0 and not seq), seq) for i, v in enumerate(node.values)]
            return node
        if isinstance(node, ast.IfExp):
            node.test = rewrite(node.test, conditional)
            node.body, node.orelse = rewrite(node.body, True), rewrite(node.orelse, True)
            return node
        if isinstance(node, ast.Compare):
            node.left = rewrite(node.left, conditional)
            node.comparators = [rewrite(c, conditional or i > 0) for i, c in enumerate(node.comparators)]
            return node
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                setattr(node, field, [rewrite(v, conditional) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, rewrite(value, conditional))
        return node

    tree.body = rewrite(tree.body, False, True)
    done = set(bound)

    def use(node: ast.AST) -> ast.AST:  # `after` only reads names bound by the guards, binds none
        if isinstance(node, (ast.Attribute, ast.Subscript)) and _path(node):
            key = _key(node)
            if key in done:
                return ast.Name(bound[key], ast.Load())
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                setattr(node, field, [use(v) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, use(value))
        return node

    return ast.unparse(tree), [ast.unparse(use(t)) for t in rest]
