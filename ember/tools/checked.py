"""Checked mode (EMBER_CHECK=1): is a compiled graph as close to float64 as eager float32 is?

check(...) runs the captured graph eagerly on copies of a call's inputs (the RNG state the compiled call started
from) and again in float64 (floating inputs and constants widened, float64 the default dtype), then compares,
per output and per input the graph writes:
    compiled error = max |compiled - float64|,   eager error = max |eager - float64|
    diverges when compiled error > EMBER_CHECK_FACTOR (10) * eager error + 8 ulps of the dtype at the
    float64 value's largest magnitude (the floor for values eager gets exactly); non-floating values must equal
    eager's; NaNs must be where eager has them.
On a divergence it finds the first node that diverges: the graph cut after its k-th tensor node (every tensor
value up to it an output) is compiled by the same backend and compared the same way, the smallest such k found by
bisection (a cut diverges whenever an earlier one does). The report names the node, its torch call and the ATen
ops it runs, and the user's file:line (node.meta["where"], set by the frontend). Graphs that draw random numbers
are not checked (a compiled RNG need not draw eager's stream). Forward values only; gradients are not compared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ember.tools.logs import get_logger
from ember.tools.repro import copies

log = get_logger("check")


def factor() -> float:
    """How many times eager's error from float64 a compiled result may be (EMBER_CHECK_FACTOR, default 10)."""
    return float(os.environ.get("EMBER_CHECK_FACTOR", "10"))


def calls() -> int:
    """How many first calls of each graph are checked (EMBER_CHECK_CALLS, default 2)."""
    return int(os.environ.get("EMBER_CHECK_CALLS", "2"))


class AccuracyMismatch(AssertionError):
    """A compiled result further from float64 than eager's, by more than the rule allows."""


# -- RNG ---------------------------------------------------------------------------------------------------------
def rng_state(args) -> tuple:
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    for d, s in state[1]:
        torch.cuda.set_rng_state(s, d)


# -- comparing ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Divergence:
    index: int            # which compared value
    compiled_error: float
    eager_error: float
    what: str             # "max |difference| ..." in words


def divergence(got, eager, ref) -> tuple[float, float, str] | None:
    """None when `got` is as close to `ref` (float64) as the rule allows given `eager`'s error, else the errors."""
    if not isinstance(eager, torch.Tensor):
        return None if got == eager or not isinstance(got, (int, float, bool)) else (float("inf"), 0.0,
                                                                                     f"{got!r} != eager {eager!r}")
    if not isinstance(got, torch.Tensor) or got.shape != eager.shape or got.dtype != eager.dtype:
        return float("inf"), 0.0, (f"compiled gives {type(got).__name__} {getattr(got, 'dtype', '')} "
                                   f"{tuple(getattr(got, 'shape', ()))}, eager {eager.dtype} {tuple(eager.shape)}")
    got, eager = got.detach(), eager.detach()
    if not (eager.dtype.is_floating_point or eager.dtype.is_complex):
        return None if torch.equal(got.cpu(), eager.cpu()) else (float("inf"), 0.0, "values differ from eager's")
    if not isinstance(ref, torch.Tensor) or ref.shape != eager.shape:
        ref = eager
    g, e, r = (x.to(torch.complex128 if x.is_complex() else torch.float64).cpu() for x in (got, eager, ref))
    if not torch.equal(g.isnan(), e.isnan()):
        return float("inf"), 0.0, "NaNs where eager has none (or none where eager has them)"
    finite = r.isfinite() & e.isfinite()
    if not torch.equal(g[~finite], e[~finite]) if (~finite).any() else False:
        return float("inf"), 0.0, "infinities differ from eager's"
    g, e, r = g[finite], e[finite], r[finite]
    if not g.numel():
        return None
    err_c, err_e = float((g - r).abs().max()), float((e - r).abs().max())
    scale = float(r.abs().max())
    floor = 8 * torch.finfo(eager.dtype if eager.dtype.is_floating_point else torch.float32).eps * max(scale, 1e-30)
    if err_c > factor() * err_e + floor:
        return err_c, err_e, (f"compiled is {err_c:.3g} from float64, eager float32 {err_e:.3g} "
                              f"(largest |value| {scale:.3g}; allowed {factor():g}x eager + 8 ulps)")
    return None


def first_divergence(gots: list, eagers: list, refs: list) -> Divergence | None:
    for k, (g, e, r) in enumerate(zip(gots, eagers, refs)):
        d = divergence(g, e, r)
        if d is not None:
            return Divergence(k, *d)
    return None


def assert_as_close_as_eager(got, expected, f: Callable, make_inputs: Callable) -> None:
    """The check a repro script ends with: raises AccuracyMismatch when `got` (compiled) is further from f's
    float64 result than `expected` (eager float32) is, by more than the rule allows."""
    with torch.no_grad(), _float64_default():
        ref = f(*[_widen(x) for x in make_inputs()])
    d = first_divergence(_leaves(got), _leaves(expected), _leaves(ref))
    if d is not None:
        raise AccuracyMismatch(f"output {d.index}: {d.what}")


def _leaves(x) -> list:
    return pytree.tree_leaves(x)


def _widen(v):
    if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
        return v.detach().to(torch.complex128 if v.is_complex() else torch.float64)
    return v


@contextlib.contextmanager
def _float64_default():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


# -- running a graph node by node --------------------------------------------------------------------------------
class _Run(torch.fx.Interpreter):
    """gm run eagerly, every node's value kept; `widen`: floating values from attributes as float64."""

    def __init__(self, gm: torch.fx.GraphModule, widen: bool = False):
        super().__init__(gm, garbage_collect_values=False)
        self.widen = widen

    def get_attr(self, target, args, kwargs):
        v = super().get_attr(target, args, kwargs)
        return _widen(v) if self.widen else v


class _Ops(TorchDispatchMode):
    """The ATen ops that ran."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _eager(gm: torch.fx.GraphModule, inputs: list, rng: tuple):
    """(outputs, the inputs after the run, every node's value, whether it drew random numbers)."""
    ins = copies(inputs)
    set_rng_state(rng)
    run = _Run(gm)
    with torch.no_grad(), _Ops() as ops:
        out = run.run(*ins)
    random = any(torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()) for op in ops.ops)
    return out, ins, run.env, random


def _float64(gm: torch.fx.GraphModule, inputs: list):
    run = _Run(gm, widen=True)
    try:
        with torch.no_grad(), _float64_default():
            out = run.run(*[_widen(x) for x in inputs])
    except Exception as e:   # an op without float64 kernels: compare with eager alone
        log.debug("float64 run failed (%s: %s): compared with eager float32 only", type(e).__name__, e)
        return None, {}
    return out, run.env


@dataclasses.dataclass
class Report:
    where: str
    divergence: Divergence
    names: list
    node: torch.fx.Node | None = None
    node_divergence: Divergence | None = None
    aten_ops: list = dataclasses.field(default_factory=list)

    @property
    def summary(self) -> str:
        at = f"; first diverging node {self.node.name} at {self.node.meta.get('where', '?')}" if self.node else ""
        return f"{self.names[self.divergence.index]} differs: {self.divergence.what}{at}"

    def text(self, gm: torch.fx.GraphModule) -> str:
        lines = [f"ember check: the graph captured from {self.where} differs from eager: "
                 f"{self.names[self.divergence.index]}: {self.divergence.what}"]
        if self.node is not None:
            lines.append(f"  first diverging node: {describe(self.node)}")
            lines.append(f"    at {self.node.meta.get('where', '?')}; ATen "
                         f"{', '.join(dict.fromkeys(str(o) for o in self.aten_ops)) or '?'}; "
                         f"{self.node_divergence.what}")
        else:
            lines.append("  no single node diverges when the graph is cut after it: the difference comes from "
                         "compiling the whole graph together (a fusion); minify its repro")
        lines.append("  graph:\n" + "\n".join("    " + ln for ln in gm.code.strip().splitlines()))
        return "\n".join(lines)


def describe(node: torch.fx.Node) -> str:
    """A node as the line of Python it stands for: `tanh = torch.tanh(mul_27)`."""
    args = [str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()]
    if node.op == "call_method":
        return f"{node.name} = {args[0]}.{node.target}({', '.join(args[1:])})"
    target = node.target
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", "") or ""
    prefix = "torch." if module.startswith("torch") and not isinstance(target, torch._ops.OpOverload) else \
        f"{module}." if module and module != "builtins" else ""
    return f"{node.name} = {prefix if node.op == 'call_function' else ''}{name}({', '.join(args)})"


def check(gm: torch.fx.GraphModule, inputs: list, rng: tuple, out, after: list, backend: Callable | None
          ) -> Report | None:
    """Compare one compiled call (`out`, and `after`: its inputs after it) with eager and float64 runs of `gm`
    on `inputs` (copies taken before the call) from RNG state `rng`. None when it passes (or cannot be checked)."""
    where = gm.meta.get("ember_where", "?") if isinstance(getattr(gm, "meta", None), dict) else "?"
    eager_out, eager_after, eager_env, random = _eager(gm, inputs, rng)
    if random:
        log.debug("graph captured from %s draws random numbers: not checked", where)
        return None
    ref_out, ref_env = _float64(gm, inputs)
    written = [k for k, (a, b) in enumerate(zip(inputs, eager_after))
               if isinstance(a, torch.Tensor) and not torch.equal(a, b)]
    gots = _leaves(out) + [after[k] for k in written]
    eagers = _leaves(eager_out) + [eager_after[k] for k in written]
    refs = (_leaves(ref_out) if ref_out is not None else eagers[:len(_leaves(eager_out))]) + \
        [_widen(x) for x in eagers[len(_leaves(eager_out)):]]
    d = first_divergence(gots, eagers, refs)
    if d is None:
        return None
    names = [f"output {k}" for k in range(len(_leaves(eager_out)))] + [f"input {k} (written)" for k in written]
    report = Report(where, d, names)
    if backend is not None:
        found = first_diverging_node(gm, inputs, rng, backend, eager_env, ref_env)
        if found is not None:
            report.node, report.node_divergence = found
            report.aten_ops = _aten_ops(report.node, eager_env)
    return report


def _tensor_nodes(gm: torch.fx.GraphModule, env: dict) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and isinstance(env.get(n), torch.Tensor)]


def cut_after(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """gm up to the last of `nodes`, returning each of `nodes` (every placeholder kept)."""
    graph, env = torch.fx.Graph(), {}
    last = nodes[-1]
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        env[n] = graph.node_copy(n, lambda a: env[a])
        if n is last:
            break
    graph.output(tuple(env[n] for n in nodes))
    cut = torch.fx.GraphModule(gm, graph)
    cut.meta.update({k: v for k, v in gm.meta.items() if k == "ember_where"})
    return cut


def first_diverging_node(gm: torch.fx.GraphModule, inputs: list, rng: tuple, backend: Callable, eager_env: dict,
                         ref_env: dict) -> tuple[torch.fx.Node, Divergence] | None:
    """The first tensor node whose compiled value diverges, by bisection over cuts (module docstring)."""
    order = _tensor_nodes(gm, eager_env)
    tried: dict[int, Divergence | None] = {}

    def diverges(k: int) -> Divergence | None:
        if k not in tried:
            nodes = order[:k + 1]
            try:
                cut = cut_after(gm, nodes)
                ins = copies(inputs)
                compiled = backend(cut, ins)
                set_rng_state(rng)
                outs = compiled(*copies(inputs))
            except Exception as e:   # a cut the backend cannot compile says nothing about this node
                log.debug("checking the cut after %s: %s: %s", order[k].name, type(e).__name__, e)
                tried[k] = None
                return None
            tried[k] = first_divergence(_leaves(outs), [eager_env[n] for n in nodes],
                                        [ref_env.get(n) for n in nodes])
        return tried[k]

    if not order or diverges(len(order) - 1) is None:
        return None
    lo, hi = 0, len(order) - 1   # diverges(hi); the first diverging cut is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if diverges(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    d = diverges(hi)
    return order[d.index], Divergence(d.index, d.compiled_error, d.eager_error, d.what)


def _aten_ops(node: torch.fx.Node, env: dict) -> list:
    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: env[a], (node.args, node.kwargs))
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), (args, kwargs))   # (in-place ops)
    try:
        with torch.no_grad(), _Ops() as ops:
            if node.op == "call_function":
                node.target(*args, **kwargs)
            elif node.op == "call_method":
                getattr(args[0], node.target)(*args[1:], **kwargs)
    except Exception:
        return []
    return ops.ops
