"""ir/symbols.py: SymInts as the loop IR's sympy sizes, and the facts proved at every size."""
import sympy
import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from ember import ir
from ember.ir import FloorDiv, ModIndex, symbols
from tests.codegen.symbolic_graphs import ArgSource


def _symint(env, value, i):
    sym = env.create_symbol(value, ArgSource(i), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(sym, hint=value, source=ArgSource(i)), sym


def test_symint_expressions_in_ember_functions():
    env = ShapeEnv()
    a, sa = _symint(env, 6, 0)
    b, sb = _symint(env, 4, 1)
    assert symbols.sym_expr(a) == sa and symbols.sym_expr(7) == sympy.Integer(7)
    assert symbols.sym_expr(a * b + 2) == sa * sb + 2
    assert symbols.sym_expr(a // 2) == FloorDiv(sa, 2)
    assert symbols.sym_expr(a % b) == ModIndex(sa, sb)
    assert not env.guards   # (nothing was decided on a value)


def test_hints_and_python_code():
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    symbols.HINTS.update({s0: 10, s1: 3})
    try:
        e = FloorDiv(s0 * s1 + 1, 2)
        assert symbols.hint(e) == 15
        assert eval(symbols.python_code(e), {"s0": 10, "s1": 3}) == 15
        assert eval(symbols.python_code(ModIndex(s0, s1) + s1 ** 2), {"s0": 10, "s1": 3}) == 10
    finally:
        symbols.HINTS.clear()


def test_facts_at_every_size():
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    symbols.HINTS.update({s0: 10, s1: 3})
    try:
        assert symbols.gt(s0, 1) and symbols.gt(s0 * s1, 1) and not symbols.gt(s0, 2)   # sizes are >= 2
        assert symbols.is_nonnegative(s0 - FloorDiv(s0, 2)) and not symbols.is_nonnegative(s1 - s0)
        assert symbols.same(s0 * (s1 + 1), s0 * s1 + s0) and not symbols.same(s0, s1)
        # x // s0 for x < s0 * s1 is below s1: a reshape's index loses its modulo
        r = sympy.Symbol("r0", integer=True, nonnegative=True)
        ranges = {r: s0 * s1}
        assert ir.simplify_index(s0 * ModIndex(FloorDiv(r, s0), s1) + ModIndex(r, s0), ranges) == r
    finally:
        symbols.HINTS.clear()


def test_an_index_over_a_plane_of_computed_sizes_simplifies_as_a_static_one():
    """A stride-2 convolution's output plane of a symbolic image, n = (s0 - 1) // 2 + 1 on a side, walked as one
    loop r0 < n * n: the unmerged index n * ((r0 // n) % n) + r0 % n is r0 again (its coefficient n, expanded to
    (s0 - 1) // 2 + 1, is one of sizes), so the inner loop reads contiguously with no division."""
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    r, x = sympy.Symbol("r0", integer=True, nonnegative=True), sympy.Symbol("x0", integer=True, nonnegative=True)
    n = 1 + FloorDiv(s0 - 1, 2)
    symbols.HINTS.update({s0: 32})
    try:
        unmerged = n * ModIndex(FloorDiv(r, n), n) + ModIndex(r, n)
        assert ir.simplify_index(unmerged + x * n * n, {r: n * n}) == ir.expand_index(r + x * n * n)
    finally:
        symbols.HINTS.clear()


def test_facts_the_guards_prove():
    """Facts the graph's guards prove (symbols.SHAPE_ENV: `s1 <= s0`, a length the program checked against a
    table's; `s1 <= 512`, a range) hold, and nothing beyond them; without the ShapeEnv nothing is claimed."""
    env = ShapeEnv()
    a, sa = _symint(env, 64, 0)
    b, sb = _symint(env, 9, 1)
    c, sc = _symint(env, 30, 2)
    assert b <= a and c <= 512   # (the program's checks: guards)
    symbols.HINTS.update({sa: 64, sb: 9, sc: 30})
    try:
        assert not symbols.is_nonnegative(sa - sb) and not symbols.is_nonnegative(512 - sc)
        symbols.SHAPE_ENV = env
        assert symbols.is_nonnegative(sa - sb) and not symbols.is_positive(sa - sb)
        assert symbols.is_nonnegative(512 - sc) and symbols.is_positive(513 - sc) and not symbols.is_nonnegative(511 - sc)
        assert not symbols.is_nonnegative(sb - sa) and not symbols.is_nonnegative(sa - sc)
    finally:
        symbols.HINTS.clear()
        symbols.SHAPE_ENV = None


def test_no_new_guards_leaves_the_shape_env_as_it_was():
    """Under symbols.no_new_guards a decision on a symbol's value (int(), a comparison the guards do not decide,
    torch._check) raises SizeDecision and the ShapeEnv keeps no guard, replacement or range from it; what its
    guards and ranges decide is answered; after it, the ShapeEnv decides (and guards) again."""
    import pytest
    env = ShapeEnv()
    a, sa = _symint(env, 17, 0)
    b, sb = _symint(env, 9, 1)
    assert b < a   # (the program's check: a guard from before)
    guards, reps, ranges = list(env.guards), dict(env.replacements), dict(env.var_to_range)
    with symbols.no_new_guards(env):
        for decide in (lambda: int(a + 1), lambda: bool(a == 18), lambda: bool(a > 20),
                       lambda: torch._check(a + 1 == 18), lambda: bool(a * 2 == b + 7)):
            with pytest.raises(symbols.SizeDecision):
                decide()
        assert bool(b < a) and bool(a >= 2) and not bool(a == 1) and bool(a + 1 > a)   # (decided already)
        with symbols.no_new_guards(env):   # (nested: the outer one stays in force)
            with pytest.raises(symbols.SizeDecision):
                int(b)
        with pytest.raises(symbols.SizeDecision):
            int(b)
    assert env.guards == guards and env.replacements == reps and env.var_to_range == ranges
    assert not vars(env).keys() & {"evaluate_expr", "guard_or_defer_runtime_assert"}
    assert int(a + 1) == 18 and env.replacements.get(sa) == 17   # (open again: a guard, as before)
