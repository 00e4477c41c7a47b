"""Symbolic sizes in ATen graphs (docs/dynamic.md): which graphs are symbolic, SymInts as fx nodes, and the sizes
the runtime computes from a call's inputs.

A torch-level graph is symbolic when a placeholder's meta["val"] is a SymInt or a fake tensor with free symbols.
It is traced on those fakes, in their FakeTensorMode and ShapeEnv. Every SymInt an ATen op takes (a view's
sizes, a factory's shape, a slice's end) becomes an fx node of the ATen graph: the placeholder of its symbol
(or `aten.sym_size.int` of a tensor input that has the symbol as a dim, where no int input carries it), or
arithmetic nodes (operator.add/mul/floordiv, torch.sym_max, ...) over those for a compound expression, one node
per expression. Every such node's meta["val"] is its SymInt.

Numbers a heuristic needs (the partitioner's byte costs) are the example's: `hint` evaluates an expression at
the ShapeEnv's example values and adds no guard.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Callable

import sympy
import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_symbols
from torch.utils._sympy.functions import FloatPow, FloatTrueDiv, FloorDiv, IntTrueDiv, Max, Min, Mod, PowByNatural, \
    PythonMod, ToFloat

from ember.autograd.trace_meta import TraceError

aten = torch.ops.aten
SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic_value(v) -> bool:
    """A SymInt (or SymFloat/SymBool) with free symbols, or a tensor with symbolic sizes, strides or offset."""
    if isinstance(v, SYM_TYPES):
        return bool(free_symbols(v))
    if isinstance(v, torch.Tensor):
        return v._has_symbolic_sizes_strides and bool(free_symbols(v))
    return False


def placeholder_values(gm: torch.nn.Module) -> list | None:
    """meta["val"] of each placeholder of a symbolic torch-level graph (None where a placeholder has none), or
    None when the graph is not symbolic."""
    if not isinstance(gm, torch.fx.GraphModule):
        return None
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return vals if any(is_symbolic_value(v) for v in vals) else None


def shape_env_of(values) -> ShapeEnv | None:
    for v in values:
        if isinstance(v, SYM_TYPES):
            return v.node.shape_env
        if isinstance(v, torch.Tensor):
            for s in (*v.shape, *v.stride(), v.storage_offset()):
                if isinstance(s, SYM_TYPES):
                    return s.node.shape_env
    return None


def dispatch_context(fake_mode):
    """What running ops on a FakeTensorMode's tensors needs: for symbolic sizes, the Python dispatcher (the meta
    functions of many ops, addcmul's among them, are Python ones; their C++ kernels take only ints)."""
    return enable_python_dispatcher() if fake_mode.shape_env is not None else contextlib.nullcontext()


def example_values(shape_env: ShapeEnv) -> dict:
    """Symbol -> its value in the example the ShapeEnv was made from."""
    d = getattr(shape_env, "backed_var_to_val", None)   # (torch >= 2.14 names it so; var_to_val is deprecated)
    return d if d is not None else shape_env.var_to_val


def hint(x) -> int:
    """An int, or a SymInt's value at the example (no guard: for heuristics and costs only)."""
    if isinstance(x, int):
        return x
    expr = x.node.expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    return int(expr.xreplace(example_values(x.node.shape_env)))


def expr_of(s) -> sympy.Expr:
    return s.node.expr


# ------------------------------------------------------------------------------ SymInts as fx nodes

_BINARY = {FloorDiv: operator.floordiv, Mod: operator.mod, PythonMod: operator.mod, FloatTrueDiv: operator.truediv,
           IntTrueDiv: operator.truediv, FloatPow: operator.pow, PowByNatural: operator.pow}
_LATTICE = {Max: torch.sym_max, Min: torch.sym_min}


class SymNodes:
    """The fx nodes of one graph's symbolic values: a symbol's source (an int placeholder, or a dim of a tensor
    placeholder), and one node per compound expression, made at its first use."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.nodes: dict[sympy.Expr, torch.fx.Node] = {}
        self.dims: dict[sympy.Symbol, tuple[torch.fx.Node, int, torch.SymInt]] = {}

    def bind(self, s: torch.SymInt, node: torch.fx.Node) -> None:
        """An int placeholder: the node of its symbol."""
        e = expr_of(s)
        if isinstance(e, sympy.Symbol) and e not in self.nodes:
            self.nodes[e] = node

    def bind_dims(self, t: torch.Tensor, node: torch.fx.Node) -> None:
        """A tensor placeholder: each dim whose size is a bare symbol can give that symbol (sym_size), used
        where no int placeholder carries it."""
        for d, s in enumerate(t.shape):
            if isinstance(s, torch.SymInt) and isinstance(expr_of(s), sympy.Symbol):
                self.dims.setdefault(expr_of(s), (node, d, s))

    def to_node(self, s):
        """A SymInt (SymFloat) argument of an op -> an int (float) constant or the fx node computing it."""
        e = expr_of(s)
        if not e.free_symbols:
            return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(s)](e)
        if isinstance(s, torch.SymBool):
            raise TraceError(f"a symbolic SymBool argument ({e}) has no fx form here")
        return self._expr(e)

    def _expr(self, e: sympy.Expr):
        if isinstance(e, sympy.Integer):
            return int(e)
        if isinstance(e, sympy.Number):
            return float(e)
        node = self.nodes.get(e)
        if node is not None:
            return node
        if isinstance(e, sympy.Symbol):
            if e not in self.dims:
                raise TraceError(f"size {e} is not computed from the graph's inputs (a data-dependent size?)")
            ph, d, s = self.dims[e]
            return self._emit(e, aten.sym_size.int, (ph, d), s)
        if isinstance(e, sympy.Add):
            terms = sorted(e.args, key=lambda a: (a.could_extract_minus_sign(), sympy.default_sort_key(a)))
            acc = self._expr(terms[0])
            for t in terms[1:]:
                if t.could_extract_minus_sign():
                    acc = self._op(operator.sub, acc, self._expr(-t))
                else:
                    acc = self._op(operator.add, acc, self._expr(t))
            return self._memo(e, acc)
        if isinstance(e, sympy.Mul):
            coeff, factors = e.as_coeff_mul()
            acc = None
            for f in sorted(factors, key=sympy.default_sort_key):
                v = self._expr(f)
                acc = v if acc is None else self._op(operator.mul, acc, v)
            if coeff != 1:
                acc = self._op(operator.mul, acc, self._expr(coeff))
            return self._memo(e, acc)
        if isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and e.exp > 0:
            base = self._expr(e.base)
            acc = base
            for _ in range(int(e.exp) - 1):
                acc = self._op(operator.mul, acc, base)
            return self._memo(e, acc)
        if type(e) is ToFloat:
            return self._memo(e, self._unary(torch.sym_float, self._expr(e.args[0])))
        for cls, fn in _BINARY.items():
            if type(e) is cls:
                return self._memo(e, self._op(fn, self._expr(e.args[0]), self._expr(e.args[1])))
        for cls, fn in _LATTICE.items():
            if type(e) is cls:
                args = sorted(e.args, key=sympy.default_sort_key)
                acc = self._expr(args[0])
                for a in args[1:]:
                    acc = self._op(fn, acc, self._expr(a))
                return self._memo(e, acc)
        raise TraceError(f"size expression {e} ({type(e).__name__}) has no fx form here")

    def _memo(self, e, v):
        if isinstance(v, torch.fx.Node):
            self.nodes.setdefault(e, v)
        return v

    def _op(self, fn, a, b):
        val = fn(self._val(a), self._val(b))
        if not isinstance(val, SYM_TYPES):
            return val
        e = expr_of(val)
        if e in self.nodes:
            return self.nodes[e]
        return self._emit(e, fn, (a, b), val)

    def _unary(self, fn, a):
        val = fn(self._val(a))
        if not isinstance(val, SYM_TYPES):
            return val
        e = expr_of(val)
        return self.nodes[e] if e in self.nodes else self._emit(e, fn, (a,), val)

    def _val(self, x):
        return x.meta["val"] if isinstance(x, torch.fx.Node) else x

    def _emit(self, e, fn, args, val) -> torch.fx.Node:
        node = self.graph.call_function(fn, args)
        node.meta["val"] = val
        self.nodes[e] = node
        return node


def is_sym_node(n) -> bool:
    return isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), SYM_TYPES)


def is_symbol_source(n: torch.fx.Node) -> bool:
    """A SymInt node that is not arithmetic over other SymInts: an int placeholder, or a size read off a tensor.
    The backward gets these as inputs, saved by the forward, and recomputes the arithmetic over them."""
    return is_sym_node(n) and (n.op == "placeholder" or not all(is_sym_node(a) for a in n.all_input_nodes))


# ------------------------------------------------------------------------------ sizes at run time

class SymArg:
    """A symbolic size in what the runtime replays (a view of an input returned as an output, an int output):
    computed at each call from the graph's inputs, as the graph computes it."""

    def __init__(self, node: torch.fx.Node, input_index: dict):
        self.fn = _evaluator(node, input_index)
        self.name = str(expr_of(node.meta["val"]))

    def __call__(self, inputs: list) -> int:
        return self.fn(inputs)

    def __repr__(self):
        return f"SymArg({self.name})"


def _evaluator(node: torch.fx.Node, input_index: dict) -> Callable[[list], int]:
    if node.op == "placeholder":
        i = input_index[node]
        return lambda inputs: inputs[i]
    if node.op != "call_function":
        raise TraceError(f"size {node.format_node()} is not computed from the graph's inputs")
    parts = [_evaluator(a, input_index) if isinstance(a, torch.fx.Node) else (lambda inputs, a=a: a)
             for a in node.args]
    fn = node.target
    return lambda inputs: fn(*[p(inputs) for p in parts])


def resolve(x, inputs: list):
    """x (an op's arguments) with each SymArg computed from the inputs."""
    if isinstance(x, SymArg):
        return x(inputs)
    t = type(x)
    if t is list or t is tuple:
        return t(resolve(y, inputs) for y in x)
    if t is dict:
        return {k: resolve(y, inputs) for k, y in x.items()}
    return x


class SymbolicSignature:
    """What a symbolic trace assumed of its inputs: each tensor's dtype, device and sizes/strides as expressions
    of the symbols, the ShapeEnv's ranges and guards. `admits(inputs)` says whether a call's real inputs satisfy
    it (checked per call for graphs nobody guards, e.g. symbolic_trace ones; ember's frontend guards its own)."""

    def __init__(self, values: list, shape_env: ShapeEnv):
        self.values, self.shape_env = values, shape_env
        self.sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
        for i, v in enumerate(values):
            if isinstance(v, torch.SymInt) and isinstance(expr_of(v), sympy.Symbol):
                self.sources.setdefault(expr_of(v), (i, None))
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    if isinstance(s, torch.SymInt) and isinstance(expr_of(s), sympy.Symbol):
                        self.sources.setdefault(expr_of(s), (i, d))

    def specialized(self) -> dict[str, int]:
        """The symbols the ShapeEnv has since fixed to one value (an op without a symbolic form guarded on it)."""
        reps = self.shape_env.replacements
        return {str(sym): int(reps[sym]) for sym in self.sources
                if sym in reps and isinstance(reps[sym], sympy.Integer)}

    def bind(self, inputs: list) -> dict | None:
        env = {}
        for sym, (i, d) in self.sources.items():
            x = inputs[i]
            if d is None:
                if type(x) is not int:
                    return None
                env[sym] = x
            else:
                if not isinstance(x, torch.Tensor) or x.dim() <= d:
                    return None
                env[sym] = x.shape[d]
        return env

    def admits(self, inputs: list) -> bool:
        env = self.bind(inputs)
        if env is None:
            return False

        def ev(s) -> int:
            return s if isinstance(s, int) else int(expr_of(s).xreplace(env))
        try:
            for v, x in zip(self.values, inputs):
                if isinstance(v, torch.SymInt):
                    if type(x) is not int or ev(v) != x:
                        return False
                elif isinstance(v, torch.Tensor):
                    if not isinstance(x, torch.Tensor) or x.dtype != v.dtype or x.device != v.device or \
                            x.dim() != v.dim() or x.layout != v.layout:
                        return False
                    if tuple(map(ev, v.shape)) != tuple(x.shape):
                        return False
                    # strides only matter where the dim has more than one element
                    if any(n > 1 and ev(s) != xs for s, xs, n in zip(v.stride(), x.stride(), x.shape)):
                        return False
            se = self.shape_env
            for sym, val in env.items():
                r = se.var_to_range.get(sym)
                if r is not None and not (r.lower <= val <= r.upper):
                    return False
            for sym, rep in se.replacements.items():
                if sym in env and sympy.sympify(rep).xreplace(env) != env[sym]:
                    return False
            for g in se.guards:
                if not g.expr.free_symbols <= set(env):
                    return False
                if not bool(g.expr.xreplace(env)):
                    return False
        except (TypeError, ValueError):     # an expression over a symbol no input carries
            return False
        return True
