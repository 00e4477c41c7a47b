"""Test harness of the frontend: compile a program, run it eagerly and compiled, compare everything.

    r = check(fn, x, [1, 2], flag=True)     # compares outputs, mutated inputs, stdout; returns a Recorder
    assert r.graphs == 1 and r.ops == [3]

`Recorder` is a torch.compile-contract backend `(gm, example_inputs) -> gm.forward` that keeps every
graph it is given.  Set EMBER_TEST_BASELINE=torch to run the same suite through torch.compile with the
same recorder: every count asserted here was checked against torch.compile that way (see BASELINE).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import math
import os
import types
import warnings
from typing import Any, Callable

import pytest
import torch

import ember

BASELINE = os.environ.get("EMBER_TEST_BASELINE", "") == "torch"
# check(), check_module() and check_many() run each program a second time compiled with dynamic=True (every input
# dim of size >= 2 symbolic), compared with eager the same way (graph counts are asserted on the first run only);
# EMBER_TEST_DYNAMIC=0 skips that run
DYNAMIC_PASS = os.environ.get("EMBER_TEST_DYNAMIC", "1") != "0"
OP_KINDS = ("call_function", "call_method", "call_module")


class Recorder:
    """A backend that records each graph (and its example inputs) and runs it as captured."""

    def __init__(self):
        self.gms: list[torch.fx.GraphModule] = []
        self.example_inputs: list[list] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.gms.append(gm)
        self.example_inputs.append(list(example_inputs))
        return gm.forward

    @property
    def graphs(self) -> int:
        """How many graphs the backend was given (each compile of each frame or resume function)."""
        return len(self.gms)

    @property
    def ops(self) -> list[int]:
        """Op count of each graph: its call_function / call_method / call_module nodes."""
        return [op_count(gm) for gm in self.gms]

    def targets(self, i: int = -1) -> list:
        """The targets of graph i's op nodes (functions, method names, module paths), in order."""
        return [n.target for n in self.gms[i].graph.nodes if n.op in OP_KINDS and n.target not in NOT_OPS]

    def placeholders(self, i: int = -1) -> int:
        return sum(n.op == "placeholder" for n in self.gms[i].graph.nodes)

    def clear(self) -> None:
        self.gms.clear()
        self.example_inputs.clear()

    def describe(self) -> str:
        """Each graph's op targets, for failure messages."""
        names = lambda ts: [t if isinstance(t, str) else getattr(t, "__name__", str(t)) for t in ts]  # noqa: E731
        return "; ".join(f"graph {i}: {names(self.targets(i))}" for i in range(self.graphs)) or "no graphs"

    def __repr__(self):
        return f"Recorder(graphs={self.graphs}, ops={self.ops})"


# Bookkeeping calls torch.compile leaves in graphs (e.g. slicing a ModuleList logs API usage): not ops.
NOT_OPS = (torch._C._log_api_usage_once,)


def op_count(gm: torch.fx.GraphModule) -> int:
    return sum(n.op in OP_KINDS and n.target not in NOT_OPS for n in gm.graph.nodes)


def has_target(gm: torch.fx.GraphModule, name: str) -> bool:
    """Whether an op of the graph calls something named `name` (e.g. "sin": torch.sin, Tensor.sin, "sin")."""
    for n in gm.graph.nodes:
        if n.op in OP_KINDS:
            t = n.target
            t = t if isinstance(t, str) else getattr(t, "__name__", str(t))
            if t == name or t.rstrip("_") == name:
                return True
    return False


# ---------------------------------------------------------------- compile / reset under either compiler

def compile(fn=None, recorder: Recorder | None = None, **kw):
    """ember.compile(fn, backend=recorder, **kw), or torch.compile under EMBER_TEST_BASELINE=torch."""
    backend = recorder if recorder is not None else kw.pop("backend", "eager")
    if BASELINE:
        return torch.compile(fn, backend=backend, **kw) if fn is not None else torch.compile(backend=backend, **kw)
    return ember.compile(fn, backend=backend, **kw)


def reset() -> None:
    if BASELINE:
        import torch._dynamo
        torch._dynamo.reset()
    else:
        ember.reset()


def disable(fn):
    if BASELINE:
        import torch._dynamo
        return torch._dynamo.disable(fn)
    return ember.disable(fn)


def mark_dynamic(t, dim, **bounds):
    if BASELINE:
        import torch._dynamo
        return torch._dynamo.mark_dynamic(t, dim, **bounds)
    return ember.mark_dynamic(t, dim, **bounds)


def mark_static(t, dim):
    if BASELINE:
        import torch._dynamo
        return torch._dynamo.mark_static(t, dim)
    return ember.mark_static(t, dim)


def maybe_mark_dynamic(t, dim):
    if BASELINE:
        import torch._dynamo
        return torch._dynamo.maybe_mark_dynamic(t, dim)
    return ember.maybe_mark_dynamic(t, dim)


def graph_break_error() -> type | tuple[type, ...]:
    """The exception fullgraph=True raises at a break (torch: Unsupported, or UserError for data-dependent guards)."""
    if BASELINE:
        import torch._dynamo.exc
        return torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError
    return ember.GraphBreakError


def backend_failed_error() -> type:
    if BASELINE:
        import torch._dynamo.exc
        return torch._dynamo.exc.BackendCompilerFailed
    return ember.BackendCompilerFailed


def explain(fn, *args, **kwargs):
    """ember.explain(fn)(*args); the torch baseline maps torch._dynamo.explain's names onto ember's."""
    if BASELINE:
        import torch._dynamo
        out = torch._dynamo.explain(fn)(*args, **kwargs)
        out.guards = out.out_guards
        return out
    return ember.explain(fn)(*args, **kwargs)


def reason_text(reason) -> str:
    """A break reason as text with its file:line (ember: str(reason); torch: reason + user_stack)."""
    if BASELINE:
        stack = "".join(f" {f.filename}:{f.lineno}" for f in reason.user_stack)
        return f"{reason.reason}{stack}"
    return str(reason)


# ---------------------------------------------------------------- inputs and comparison

def rand(*shape, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(*shape, dtype=dtype)
    elif dtype == torch.bool:
        t = torch.rand(*shape) > 0.5
    else:
        t = torch.randint(-5, 6, shape, dtype=dtype)
    return t.requires_grad_(requires_grad)


def assert_same(expected: Any, actual: Any, path: str = "out", rtol=None, atol=None) -> None:
    """Same type and structure all the way down; tensors equal in values, dtype, shape, requires_grad."""
    assert type(actual) is type(expected), f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.requires_grad == expected.requires_grad, f"{path}: requires_grad differs"
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{path}: {m}")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]", rtol, atol)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]", rtol, atol)
    elif isinstance(expected, (set, frozenset)):
        assert actual == expected, f"{path}: {actual} != {expected}"
    elif isinstance(expected, float):
        assert (math.isnan(expected) and math.isnan(actual)) or math.isclose(actual, expected, rel_tol=1e-6,
                                                                               abs_tol=1e-9), \
            f"{path}: {actual} != {expected}"
    elif isinstance(expected, torch.nn.Module):
        assert_same(dict(expected.state_dict()), dict(actual.state_dict()), f"{path}.state_dict()", rtol, atol)
        assert_same(_plain_attrs(expected), _plain_attrs(actual), f"{path}.__dict__", rtol, atol)
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for f in dataclasses.fields(expected):
            assert_same(getattr(expected, f.name), getattr(actual, f.name), f"{path}.{f.name}", rtol, atol)
    elif hasattr(expected, "__dict__") and not isinstance(expected, (type, types.FunctionType, types.MethodType,
                                                                     types.ModuleType, functools.partial)):
        assert_same(vars(expected), vars(actual), f"{path}.__dict__", rtol, atol)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _plain_attrs(m: torch.nn.Module) -> dict:
    return {k: v for k, v in vars(m).items() if not k.startswith("_")}


def _copy_inputs(args, kwargs):
    """A deep copy of the inputs that shares nn.Modules (copying one would change the identity ember guards on;
    modules whose state the program changes are tested through check_module)."""
    memo = {}
    stack = [args, kwargs]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.nn.Module):
            memo[id(v)] = v
        elif isinstance(v, (list, tuple)):
            stack += list(v)
        elif isinstance(v, dict):
            stack += list(v.values())
    return copy.deepcopy((args, kwargs), memo)


def _run(fn, args, kwargs, seed):
    """Run fn on its own deep copy of the inputs; returns (result or exception, inputs after, stdout)."""
    a, kw = _copy_inputs(args, kwargs)
    buf = io.StringIO()
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(buf):
        try:
            out = fn(*a, **kw)
        except Exception as e:  # compared with eager's exception by type and message
            out = e
    return out, (a, kw), buf.getvalue()


def _compare(expected, actual, where, rtol=None, atol=None, same_message=True):
    if isinstance(expected, Exception):
        assert isinstance(actual, Exception), f"{where}: eager raised {expected!r}, compiled returned {actual!r}"
        assert type(actual) is type(expected), f"{where}: raised {actual!r}, eager raised {expected!r}"
        if same_message:
            assert str(actual) == str(expected), f"{where}: raised {actual!r}, eager raised {expected!r}"
    else:
        if isinstance(actual, Exception):
            raise AssertionError(f"{where} raised, eager returned {type(expected).__name__}") from actual
        assert_same(expected, actual, f"{where}: result", rtol, atol)


def check(fn: Callable, *args, _calls: int = 2, _rtol=None, _atol=None, _recompiles: bool = False,
          _compile_kw: dict | None = None, _dynamic: bool = True, **kwargs) -> Recorder:
    """Compile fn with a Recorder; call eager and compiled `_calls` times each, every call on a fresh deep copy
    of the inputs with the same RNG seed; compare call k with call k: results, the inputs afterwards
    (mutations), stdout, and exceptions (type and message).  Unless _recompiles, calls after the first must
    reuse the first call's graphs.  Then the same again compiled with dynamic=True (DYNAMIC_PASS; not with
    _dynamic=False: a test that counts what compiling does).  Returns the Recorder of the first run
    (rec.result = eager's first result)."""
    reset()
    rec = Recorder()
    cfn = compile(fn, rec, **(_compile_kw or {}))
    graphs_after_first = None
    for call in range(_calls):
        where = f"call {call + 1}"
        expected, inputs_after, stdout = _run(fn, args, kwargs, seed=1234 + call)
        actual, c_inputs_after, c_stdout = _run(cfn, args, kwargs, seed=1234 + call)
        _compare(expected, actual, where, _rtol, _atol)
        assert_same(inputs_after, c_inputs_after, f"{where}: inputs after the call", _rtol, _atol)
        assert c_stdout == stdout, f"{where}: stdout {c_stdout!r} != eager's {stdout!r}"
        if call == 0:
            rec.result = expected
            graphs_after_first = rec.graphs
        elif not _recompiles:
            assert rec.graphs == graphs_after_first, f"{where} recompiled: {rec}"
    if _dynamic and _dynamic_pass(_compile_kw):
        check(fn, *args, _calls=_calls, _rtol=_rtol, _atol=_atol, _recompiles=_recompiles,
              _compile_kw={**(_compile_kw or {}), "dynamic": True}, **kwargs)
    return rec


def _dynamic_pass(compile_kw: dict | None) -> bool:
    return DYNAMIC_PASS and "dynamic" not in (compile_kw or {})


def check_module(mod: torch.nn.Module, *args, _calls: int = 2, _compile_kw: dict | None = None,
                 _rtol=None, _atol=None, _recompiles: bool = False, **kwargs) -> Recorder:
    """compile(mod) against a deep copy of mod run eagerly: results, and module state (state_dict and plain
    attributes) after each call, so buffer updates and attribute writes are compared too."""
    reset()
    rec = Recorder()
    eager_mod = copy.deepcopy(mod)
    cmod = compile(mod, rec, **(_compile_kw or {}))
    first = None
    for call in range(_calls):
        where = f"call {call + 1}"
        a, kw = copy.deepcopy((args, kwargs))
        ca, ckw = copy.deepcopy((args, kwargs))
        torch.manual_seed(99 + call)
        expected = eager_mod(*a, **kw)
        torch.manual_seed(99 + call)
        actual = cmod(*ca, **ckw)
        assert_same(expected, actual, f"{where}: result", _rtol, _atol)
        assert_same((a, kw), (ca, ckw), f"{where}: inputs after the call", _rtol, _atol)
        assert_same(eager_mod, mod, f"{where}: module after the call", _rtol, _atol)
        if call == 0:
            first = rec.graphs
            rec.result = expected
        elif not _recompiles:
            assert rec.graphs == first, f"{where} recompiled: {rec}"
    if _dynamic_pass(_compile_kw):
        check_module(eager_mod, *args, _calls=_calls, _compile_kw={**(_compile_kw or {}), "dynamic": True},
                     _rtol=_rtol, _atol=_atol, _recompiles=_recompiles, **kwargs)
    return rec


def check_many(fn: Callable, arg_lists: list[tuple], **compile_kw) -> Recorder:
    """One compiled fn called on each argument tuple in turn (fresh copies), each compared with eager."""
    reset()
    rec = Recorder()
    cfn = compile(fn, rec, **compile_kw)
    for i, args in enumerate(arg_lists):
        expected, after, stdout = _run(fn, args, {}, seed=i)
        actual, c_after, c_stdout = _run(cfn, args, {}, seed=i)
        _compare(expected, actual, f"call {i}")
        assert_same(after, c_after, f"call {i}: inputs after")
        assert c_stdout == stdout, f"call {i}: stdout {c_stdout!r} != eager's {stdout!r}"
    if _dynamic_pass(compile_kw):
        check_many(fn, arg_lists, **compile_kw, dynamic=True)
    return rec


# ---------------------------------------------------------------- tables of small programs

def case(fn: Callable, args: Callable[[], tuple], ops: int | list[int] | None, graphs: int = 1, **marks):
    """One row of a table of programs: fn, a factory of fresh inputs, the expected op count(s) and graph count.
    ops=None: count not asserted (a comment at the row says why)."""
    return pytest.param(fn, args, ops, graphs, id=fn.__name__, **marks)


def run_case(fn, args, ops, graphs, **check_kw) -> Recorder:
    r = check(fn, *args(), **check_kw)
    assert r.graphs == graphs, f"expected {graphs} graph(s), got {r}: {r.describe()}"
    if ops is not None:
        want = ([ops] if graphs else []) if isinstance(ops, int) else list(ops)
        assert r.ops == want, f"expected ops {want}, got {r}: {r.describe()}"
    return r
