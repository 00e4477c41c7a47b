"""Symbolic sizes (docs/dynamic.md): a dynamic size is a sympy expression over the ShapeEnv's symbols (s0, s1, ...,
positive integers), the same Symbol objects the graph's SymInts carry, so the loop IR's sizes, strides and indices
are expressions the printers write as code over run-time values.

`HINTS` holds the example's value of each symbol while a symbolic graph is lowered, scheduled and printed: a
heuristic that needs a number (a block width, a threshold, whether a row fits a buffer) asks `hint(e)`, and the
code it chooses must be right at every size (the choice only decides speed).
"""
from __future__ import annotations

import contextlib

import sympy
import torch

HINTS: dict = {}   # sympy Symbol -> the example's int, for the graph being compiled (empty: a static graph)
SHAPE_ENV = None   # the ShapeEnv of the graph being compiled, whose guards facts may use (set and cleared with HINTS)


class SizeDecision(NotImplementedError):
    """Code under `no_new_guards` asked for a symbolic size's value (int() of a SymInt, a branch on a comparison the
    guards do not decide): code taking that decision would be right at one size only. (A NotImplementedError: a
    decomposition raising it keeps its op as an ATen call; elsewhere the backend runs the graph as its ATen graph.)"""


# the ShapeEnv methods through which every decision on a size's value reaches it: a guard (and the replacement or
# range it implies) is added there or nowhere (SymNode.guard_int/guard_bool/expect_true, torch._check, guard_or_*)
_DECIDING = ("evaluate_expr", "guard_or_defer_runtime_assert")


@contextlib.contextmanager
def no_new_guards(shape_env):
    """Within, `shape_env` takes no guard, replacement or runtime assert: a decision its guards and ranges already
    decide is answered, any other raises SizeDecision before the ShapeEnv changes. A compiler deciding on a size
    would otherwise leave its guard behind in the capture's ShapeEnv, so the frame's entry would pin the size even
    where the compiler then gave up on the graph (instance attributes shadow the methods: no torch internals are
    copied or restored, the same on every torch version)."""
    if shape_env is None or getattr(vars(shape_env).get("evaluate_expr"), "closes", None) is shape_env:
        yield   # (none, or closed already by an outer call)
        return

    def decided(expr, *args, **kwargs):
        known = None
        with contextlib.suppress(Exception):   # (a private method of torch's: what it cannot take, it cannot decide)
            known = shape_env._maybe_evaluate_static(expr)
        if known is None:
            raise SizeDecision(f"a decision on a symbolic size ({expr}) that holds at one size only")
        return known
    decided.closes = shape_env
    shadowed = {name: vars(shape_env)[name] for name in _DECIDING if name in vars(shape_env)}
    shape_env.evaluate_expr = decided
    shape_env.guard_or_defer_runtime_assert = lambda expr, *args, **kwargs: bool(decided(expr))
    try:
        yield
    finally:
        for name in _DECIDING:
            vars(shape_env).pop(name, None)
        vars(shape_env).update(shadowed)


def sym_expr(x):
    """A size as the loop IR holds it: an int or static SymInt -> sympy.Integer, a symbolic SymInt -> its
    expression in ember's index functions (torch's FloorDiv/Mod/ModularIndexing -> ir.FloorDiv/ModIndex)."""
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        if expr.is_Integer:
            return sympy.Integer(int(expr))
        return from_torch(expr)
    if isinstance(x, sympy.Basic):
        return x
    return sympy.Integer(int(x))


def has_symbols(v) -> bool:
    """Whether a tensor (a fake one of a symbolic graph) has a symbolic size or stride, or v is a SymInt."""
    if isinstance(v, torch.SymInt):
        return not v.node.expr.is_Integer
    if isinstance(v, torch.Tensor):
        return any(isinstance(x, torch.SymInt) and not x.node.expr.is_Integer
                   for x in (*v.shape, *v.stride(), v.storage_offset()))
    return False


def sym_sizes(xs) -> tuple:
    return tuple(sym_expr(x) for x in xs)


def from_torch(e):
    """A torch ShapeEnv expression (sizes are never negative) in the loop IR's functions; NotImplementedError for
    functions it has none of."""
    from ember.ir import FloorDiv, ModIndex
    if e.is_Integer or e.is_Symbol:
        return e
    args = [from_torch(a) for a in e.args]
    name = type(e).__name__
    if isinstance(e, sympy.Add):
        return sympy.Add(*args)
    if isinstance(e, sympy.Mul):
        return sympy.Mul(*args)
    if name in ("FloorDiv", "CleanDiv"):
        return FloorDiv(*args)
    if name in ("Mod", "PythonMod"):
        return ModIndex(*args)
    if name == "ModularIndexing":
        return ModIndex(FloorDiv(args[0], args[1]), args[2])
    if name in ("PowByNatural",) or isinstance(e, sympy.Pow) and args[1].is_Integer and int(args[1]) > 0:
        return sympy.Mul(*[args[0]] * int(args[1]))
    if name in ("Max", "Min"):
        return (sympy.Max if name == "Max" else sympy.Min)(*args)
    raise NotImplementedError(f"size expression {e} ({name})")


def is_static(e) -> bool:
    return not isinstance(e, sympy.Basic) or e.is_Integer


def hint(e) -> int:
    """The example's value of a size expression (an int for static sizes)."""
    if not isinstance(e, sympy.Basic):
        return int(e)
    if e.is_Integer:
        return int(e)
    v = sympy.sympify(e.xreplace(HINTS))
    if not v.is_Integer:
        v = sympy.simplify(v)   # (FloorDiv/ModIndex of integers evaluate as they are rebuilt)
    return int(v)


def free_symbols(e) -> set:
    """The size symbols in e (the ShapeEnv's, those with a hint)."""
    return {s for s in e.free_symbols if s in HINTS} if isinstance(e, sympy.Basic) else set()


def same(a, b) -> bool:
    """Whether two sizes are equal at every size (ints compared as ints)."""
    if is_static(a) and is_static(b):
        return int(a) == int(b)
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def ints(xs) -> tuple:
    """Sizes with the static ones as Python ints (what static layouts always held), symbolic ones as they are."""
    return tuple(int(x) if is_static(x) else x for x in xs)


def _at_least_two(e):
    """e with each size symbol s written s' + 2 (s' >= 0): sizes 0 and 1 are never symbolic (dynamic.md), which
    lets sympy's sign rules decide `s0 - 1 > 0` (it knows only that s0 is a positive integer)."""
    syms = [x for x in e.free_symbols if x in HINTS or x.is_positive]
    if not syms:
        return e
    return e.xreplace({x: sympy.Symbol(f"{x}_2", integer=True, nonnegative=True) + 2 for x in syms})


def _lower_bound(e):
    """A lower bound of e with its FloorDiv/ModIndex terms (of integer coefficients and divisors) replaced by
    their bounds, a // d in [(a - d + 1) / d, a / d] and a % d in [0, d - 1], for sympy's sign rules."""
    from ember.ir import FloorDiv, ModIndex
    if not e.has(FloorDiv, ModIndex):
        return e
    out = []
    for t in sympy.Add.make_args(sympy.expand(e)):
        c, rest = t.as_coeff_Mul()
        if isinstance(rest, (FloorDiv, ModIndex)) and rest.args[1].is_Integer and c.is_Integer:
            a, d = rest.args
            if isinstance(rest, FloorDiv):
                t = c * (a - d + 1) / d if c > 0 else c * a / d
            else:
                t = 0 if c > 0 else c * (d - 1)
        out.append(t)
    return sympy.Add(*out)


def _guards_prove(fact) -> bool:
    """Whether the graph's ShapeEnv proves `fact` (a sympy relation over its symbols) from its guards and the
    symbols' ranges (`s1 <= s0` where the program checked a length against a table's, `s0 <= 512`); False where
    it cannot, or the fact holds ember's own index functions."""
    from ember.ir import FloorDiv, ModIndex
    if SHAPE_ENV is None or fact.has(FloorDiv, ModIndex):
        return False
    try:
        return SHAPE_ENV._maybe_evaluate_static(fact) is sympy.true
    except Exception:   # (a private method of torch's: an expression it cannot take proves nothing)
        return False


def is_positive(e) -> bool:
    """Whether e > 0 at every size (False when sympy cannot tell)."""
    if not isinstance(e, sympy.Basic):
        return e > 0
    if e.is_Integer:
        return int(e) > 0
    return bool(e.is_positive) or bool(sympy.expand(_at_least_two(_lower_bound(e))).is_positive) or \
        _guards_prove(sympy.Gt(e, 0))


def is_nonnegative(e) -> bool:
    """Whether e >= 0 at every size (False when sympy cannot tell)."""
    if not isinstance(e, sympy.Basic):
        return e >= 0
    if e.is_Integer:
        return int(e) >= 0
    return bool(e.is_nonnegative) or bool(sympy.expand(_at_least_two(_lower_bound(e))).is_nonnegative) or \
        _guards_prove(sympy.Ge(e, 0))


def gt(a, b) -> bool:
    """a > b at every size (ints compared as ints)."""
    if is_static(a) and is_static(b):
        return int(a) > int(b)
    return is_positive(sympy.sympify(a) - b)


def python_code(e) -> str:
    """A size expression as Python over the symbols' names (the host program's locals)."""
    from ember.ir import FloorDiv, ModIndex
    if not isinstance(e, sympy.Basic) or e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return str(e)
    rec = python_code
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(rec(a) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(rec(a) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([rec(e.base)] * int(e.exp)) + ")"
    if isinstance(e, FloorDiv):
        return f"({rec(e.args[0])} // {rec(e.args[1])})"
    if isinstance(e, ModIndex):
        return f"({rec(e.args[0])} % {rec(e.args[1])})"
    if isinstance(e, (sympy.Min, sympy.Max)):
        return f"{'min' if isinstance(e, sympy.Min) else 'max'}({', '.join(rec(a) for a in e.args)})"
    raise NotImplementedError(f"size expression {e}")
