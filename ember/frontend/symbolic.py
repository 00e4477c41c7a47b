"""Symbolic sizes in one capture: the ShapeEnv, the symbols of input dims, their graph placeholders, ints computed
from sizes as graph nodes, and the ShapeEnv's guards as Python over the inputs' sizes (docs/dynamic.md).

A symbolic size is a `torch.SymInt` of this capture's ShapeEnv, held by a ConstV like any int: Python arithmetic
on it (`x.shape[-1] // 2`) gives a SymInt whose expression is over the input symbols, and a decision on it
(`if n > 4`, `int(n)`, a list index) goes through SymInt's __bool__ / __int__ / __index__, which the ShapeEnv
records as a guard on the relation (or an equality: a specialization). So no Python decision escapes the
guards. Where an op receives a SymInt, the graph gets a node computing its expression from the symbols'
placeholders (`expr_node`), so the graph is correct at every size the guards admit.
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import sympy
import torch
import torch.fx
from torch._guards import SLoc, Source
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, free_unbacked_symbols
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod
from torch.utils._sympy.printers import PythonPrinter

from ember.errors import Unsupported
from ember.tools.logs import get_logger

log_dynamic = get_logger("dynamic")
SYM_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)


@dataclasses.dataclass(frozen=True)
class SizeSource(Source):
    """Where a symbol's value is read on a call: the Python text of an input's size (`x.shape[0]`)."""
    text: str

    @property
    def _name_template(self) -> str:
        return self.text


class _SourcePrinter(PythonPrinter):
    """Python over the inputs' sizes: each symbol printed as the first source that reads it."""

    def __init__(self, sources: dict):
        super().__init__()
        self.sources = sources

    def _print_Symbol(self, s) -> str:
        srcs = self.sources.get(s)
        if not srcs:
            raise Unsupported(f"a size ({s}) that no input's size gives")
        return f"({srcs[0]})"


# torch's printer writes these functions as `torch.sym_float(...)`, `math.floor(...)`: in an entry's namespace they are
# Python's float and ___math (a size turned float: `x.shape[0] / 2`, `(n - 1) ** 0.5`, guarded on its value)
for _name, _fn in (("ToFloat", "float"), ("OpaqueUnaryFn_sqrt", "___math.sqrt"), ("floor", "___math.floor"),
                   ("FloorToInt", "___math.floor"), ("ceiling", "___math.ceil"), ("CeilToInt", "___math.ceil"),
                   ("TruncToInt", "___math.trunc")):
    setattr(_SourcePrinter, f"_print_{_name}", lambda self, e, fn=_fn: f"{fn}({self._print(e.args[0])})")


class CaptureShapeEnv(ShapeEnv):
    """torch's ShapeEnv without its source lookup: torch finds a symbol's or guard's line by walking the Python
    stack past a set of "uninteresting" files, and building that set imports torch.export._trace and inductor
    (a tenth of a second of a loop's first compile). Under ember the frame it would find is the interpreter's,
    not the user's; ember notes each guard at the user's line itself (Frame.run, Symbols.note_guards)."""

    def _get_stack_summary(self, is_debug: bool = False, framework_loc: str | None = None) -> tuple[SLoc, str]:
        return SLoc(framework_loc, None), ""


class Symbols:
    """The symbols of one capture."""

    def __init__(self, cap):
        self.cap = cap
        # (static by default: a tensor faked by FakeTensorMode.from_tensor, which ember did not make symbolic, keeps
        # its sizes; the symbolic dims are created here, Symbols.fake)
        self.shape_env = CaptureShapeEnv(assume_static_by_default=True)
        self.shape_env._ember_symbols = self        # (a SymInt finds its capture through its ShapeEnv)
        self.sources: dict[sympy.Symbol, list[str]] = {}
        self.placeholders: dict[sympy.Symbol, torch.fx.Node] = {}
        self.nodes: dict[sympy.Expr, torch.fx.Node] = {}
        self.n_guards = 0                           # ShapeEnv guards already logged (note_guards)
        self.printer = _SourcePrinter(self.sources)

    @property
    def any(self) -> bool:
        return bool(self.sources)

    # -- inputs ------------------------------------------------------------------------------------------
    def fake(self, t: torch.Tensor, source: str, dims: dict):
        """A fake of `t` whose `dims` (dim -> (min, max)) are symbols, strides as expressions of them where `t`
        is dense in some dim order (a stride no product of sizes gives stays an int). Returns the fake and the
        Python texts of its sizes and strides (an int where static)."""
        se, mode = self.shape_env, self.cap.fake_mode
        sizes, texts = [], []
        for d, n in enumerate(t.shape):
            if d not in dims:
                sizes.append(int(n))
                texts.append(int(n))
                continue
            text = f"{source}.shape[{d}]"
            lo, hi = dims[d]
            # a symbol of a user-given range has its own symbol (no duck sizing), bounded by the range
            kind = DimDynamic.DUCK if lo is None and hi is None else DimDynamic.DYNAMIC
            sym = se.create_symbol(int(n), SizeSource(text), dynamic_dim=kind)
            if lo is not None or hi is not None:
                if (lo is not None and n < lo) or (hi is not None and n > hi):
                    raise ValueError(f"ember.mark_dynamic: {text} is {n}, outside the range min={lo}, max={hi} "
                                     f"it was marked with")
                se.constrain_symbol_range(sym, compiler_min=max(2, lo or 2),
                                          compiler_max=hi if hi is not None else int(2 ** 62))
            first = sym not in self.sources
            self.sources.setdefault(sym, []).append(text)
            symint = se.create_symintnode(sym, hint=int(n), source=SizeSource(text))
            if first:
                self._placeholder(sym, symint, text, int(n))
                log_dynamic.debug("%s is symbolic: %s", text, sym)
            else:
                log_dynamic.debug("%s is symbolic: %s, the symbol of %s (same size at capture; guarded equal)",
                                  text, sym, self.sources[sym][0])
            sizes.append(symint)
            texts.append(self.print(sym))
        strides: list = list(t.stride())
        stride_texts: list = list(strides)
        expected, expected_sym = 1, 1
        for d in sorted(range(t.dim()), key=lambda i: (t.stride(i), t.size(i))):
            if t.stride(d) == expected:
                strides[d] = expected_sym
                stride_texts[d] = self.print(_expr(expected_sym))
            expected = t.stride(d) * t.size(d)
            expected_sym = strides[d] * sizes[d]
        with mode:
            fake = torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
        return fake, texts, stride_texts

    def _placeholder(self, sym, symint, text: str, value: int) -> None:
        """The symbol's int input, appended to the graph's inputs just before the tensor input that first has it
        (inputs are passed in the order of their placeholders)."""
        from ember.frontend.capture import GraphInput
        node = self.cap.graph.placeholder(str(sym))
        node.meta["val"] = symint
        node.meta["source"] = text
        self.placeholders[sym] = node
        self.cap.inputs.append(GraphInput(text, value, node))

    def int_input(self, value: int, source: str) -> torch.SymInt:
        """A Python int argument that changes from call to call, as a symbol of its own."""
        se = self.shape_env
        sym = se.create_symbol(value, SizeSource(source), dynamic_dim=DimDynamic.DYNAMIC)
        symint = se.create_symintnode(sym, hint=value, source=SizeSource(source))
        self.sources.setdefault(sym, []).append(source)
        self._placeholder(sym, symint, source, value)
        log_dynamic.debug("%s is symbolic: %s (an int that changed between calls)", source, sym)
        return symint

    def drop_unused(self) -> None:
        """Remove the int inputs of symbols that neither a node nor a remaining tensor input's size uses."""
        cap = self.cap
        used = set()
        for inp in cap.inputs:
            val = inp.node.meta.get("val")
            if isinstance(val, torch.Tensor):
                for x in (*val.shape, *val.stride()):
                    if isinstance(x, torch.SymInt):
                        used |= x.node.expr.free_symbols
        for sym, node in list(self.placeholders.items()):
            if sym not in used and not node.users:
                cap.graph.erase_node(node)
                cap.inputs[:] = [inp for inp in cap.inputs if inp.node is not node]
                del self.placeholders[sym]

    # -- ints as graph nodes -----------------------------------------------------------------------------
    def sym_node(self, s: torch.SymInt):
        """The graph value of a SymInt: an int where the guards fix it, the placeholder of its symbol, or nodes
        computing its expression from the placeholders."""
        if not isinstance(s, torch.SymInt):
            raise Unsupported(f"a symbolic {type(s).__name__} passed to a torch op")
        return self.expr_node(self.shape_env.simplify(s.node.expr))

    def expr_node(self, e):
        if isinstance(e, sympy.Integer):
            return int(e)
        if e in self.nodes:
            return self.nodes[e]
        if isinstance(e, sympy.Symbol):
            node = self.placeholders.get(e)
            if node is None:
                raise Unsupported(f"a size ({e}) that is no input's size (data-dependent)")
            return node
        if isinstance(e, sympy.Add):
            fn, args = operator.add, e.args
        elif isinstance(e, sympy.Mul):
            fn, args = operator.mul, e.args
        elif isinstance(e, FloorDiv):
            fn, args = operator.floordiv, e.args
        elif isinstance(e, (Mod, PythonMod)):
            fn, args = operator.mod, e.args
        elif isinstance(e, Max):
            fn, args = torch.sym_max, e.args
        elif isinstance(e, Min):
            fn, args = torch.sym_min, e.args
        elif isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and e.exp >= 0:
            fn, args = operator.pow, e.args
        else:
            raise Unsupported(f"the size expression {e} in the graph")
        parts = [self.expr_node(a) for a in args]
        acc = parts[0]
        for p in parts[1:]:
            val = fn(_val(acc), _val(p))
            acc = self.cap.graph.call_function(fn, (acc, p))
            acc.meta["val"] = val
        self.nodes[e] = acc
        return acc

    # -- guards ------------------------------------------------------------------------------------------
    def print(self, e) -> str:
        return self.printer.doprint(e)

    def python(self, s) -> str:
        """Python over the inputs' sizes computing a SymInt (a value rebuilt by the entry: returned, or live at a
        graph break)."""
        e = self.shape_env.simplify(s.node.expr)
        if free_unbacked_symbols(e):
            raise Unsupported(f"a data-dependent size ({e}) as a Python value")
        return self.print(e)

    def guards(self) -> list[str]:
        """What the capture assumed about the symbols, as Python over the inputs' sizes: each symbol's range
        (>= 2: sizes 0 and 1 are specialized), equalities (one symbol for two sizes: duck sizing or a guard
        `s1 == s0`; a specialization `s0 == 8`), and the ShapeEnv's guards on relations (`s0 > 4`)."""
        se = self.shape_env
        out = []
        for sym, srcs in self.sources.items():
            canon = se.simplify(sym)
            if canon != sym:
                rhs = self.print(canon)
                out += [f"{src} == {rhs}" for src in srcs]
                continue
            out += [f"{src} == {srcs[0]}" for src in srcs[1:]]
            vr = se.var_to_range.get(sym)
            if vr is not None:
                if isinstance(vr.lower, sympy.Integer):
                    out.append(f"{srcs[0]} >= {int(vr.lower)}")
                if isinstance(vr.upper, sympy.Integer) and int(vr.upper) < 2 ** 62:
                    out.append(f"{srcs[0]} <= {int(vr.upper)}")
        for g in se.guards:
            e = se.simplify(g.expr)
            if e is sympy.true or free_unbacked_symbols(e):   # (a data-dependent size broke the graph before it)
                continue
            out.append(self.print(e))
        # the entry is made from these: a guard added later (a backend deciding on a size) would not be checked,
        # so the ShapeEnv takes no more (torch warns of one ignored)
        se.freeze()
        return list(dict.fromkeys(out))

    def note_guards(self, where: str) -> None:
        """Log the ShapeEnv guards added since the last call, at the user's line that made them."""
        se = self.shape_env
        new = se.guards[self.n_guards:]
        self.n_guards = len(se.guards)
        if not log_dynamic.isEnabledFor(logging.DEBUG):
            return
        for g in new:
            e = g.expr
            if isinstance(e, sympy.Eq) and isinstance(e.rhs, sympy.Integer) or \
                    isinstance(e, sympy.Eq) and isinstance(e.lhs, sympy.Integer):
                log_dynamic.debug("specialized %s at %s: the program needs its value (guard %s)",
                                  self.describe(e), where, self._printable(e))
            else:
                log_dynamic.debug("guard %s at %s", self._printable(e), where)

    def describe(self, e) -> str:
        syms = sorted(e.free_symbols, key=str)
        return ", ".join(f"{s} ({self.sources[s][0]})" if s in self.sources else str(s) for s in syms)

    def _printable(self, e) -> str:
        try:
            return self.print(e)
        except Unsupported:
            return str(e)


# Python functions that compute on symbolic sizes symbolically (a comparison gives a SymBool, decided at once as a
# guard on the relation). Everything else needs the int: the size is specialized (Frame.const_value).
SYMBOLIC_FUNCS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.pow,
                  operator.neg, operator.pos, operator.abs, operator.truediv, operator.eq, operator.ne, operator.lt,
                  operator.le, operator.gt, operator.ge, operator.getitem, operator.iadd, operator.isub,
                  operator.imul, operator.ifloordiv, operator.imod, abs, torch.sym_max, torch.sym_min}


def has_sym(x) -> bool:
    if isinstance(x, SYM_TYPES):
        return True
    if type(x) is slice:
        return any(isinstance(p, SYM_TYPES) for p in (x.start, x.stop, x.step))
    if type(x) in (tuple, list, torch.Size):
        return any(has_sym(p) for p in x)
    return False


def specialize(x):
    """x with each symbolic value replaced by its value at capture, guarded equal (SymInt.__int__: the ShapeEnv
    records `s0 == 8`; Frame.run logs where)."""
    if isinstance(x, torch.SymInt):
        return int(x)
    if isinstance(x, torch.SymBool):
        return bool(x)
    if isinstance(x, torch.SymFloat):
        return float(x)
    if type(x) is slice:
        return slice(specialize(x.start), specialize(x.stop), specialize(x.step))
    if type(x) in (tuple, list, torch.Size) and has_sym(x):
        return type(x)(specialize(p) for p in x)
    return x


def numeric(x) -> bool:
    """A value SymInt arithmetic may meet: numbers and symbolic numbers, and tuples of them (torch.Size)."""
    if isinstance(x, (int, float, *SYM_TYPES)):
        return True
    if type(x) in (tuple, torch.Size):
        return all(numeric(p) for p in x)
    return type(x) is slice


def symbols_of(s) -> Symbols | None:
    return getattr(s.node.shape_env, "_ember_symbols", None)


def check_no_unbacked(out, name: str) -> None:
    """Data-dependent output sizes (nonzero, boolean masks, unique) break the graph, as in torch.compile."""
    if free_unbacked_symbols(out):
        log_dynamic.debug("graph break: %s has a data-dependent output size", name)
        raise Unsupported(f"{name} has a data-dependent output size")


def _val(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


def _expr(x):
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(x)
