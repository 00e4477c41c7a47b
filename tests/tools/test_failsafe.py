"""A crash inside ember never reaches the user (ember.tools.failsafe): faults injected at code generation, at the
C++ build, at a library launch and at the Triton compile each run the graph eagerly, logged, equal to eager; an
error the user's program raises in eager still raises, with eager's type and side effects."""
import concurrent.futures
import logging

import pytest
import torch

import ember
from ember.backends import cpp_backend
from ember.codegen import cpp
from ember.runtime import cache
from ember.tools import failsafe


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    ember.reset()
    monkeypatch.delenv("EMBER_CHECK", raising=False)
    monkeypatch.setenv("EMBER_REPRO_DIR", str(tmp_path / "repros"))
    yield
    ember.reset()


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ember.fallbacks" and "runs eagerly" in r.getMessage()]


def program(x, w, buf):
    buf.add_(1.0)   # an input written in place: eager's rerun must start from its value before the call
    h = torch.tanh(x @ w) + buf
    return h.softmax(dim=-1) * 3


def _inputs():
    return torch.randn(6, 5), torch.randn(5, 5), torch.randn(6, 5)


def _check_falls_back(caplog, stage: str, count: str):
    x, w, buf = _inputs()
    buf_eager = buf.clone()
    expected = program(x, w, buf_eager)
    before = failsafe.STATS[count]
    with caplog.at_level(logging.WARNING, logger="ember.fallbacks"):
        got = ember.compile(program)(x, w, buf)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(buf, buf_eager)   # written once, as eager writes it
        again = ember.compile(program)(x, w, buf)      # a new compile (a new function object): same fault
    torch.testing.assert_close(again, program(x, w, buf_eager))
    assert failsafe.STATS[count] > before
    lines = _fallback_lines(caplog)
    assert lines and stage in lines[0] and "test_failsafe.py" in lines[0], lines
    return lines


def test_fault_at_code_generation_falls_back(monkeypatch, caplog, tmp_path):
    def broken(*_a, **_k):
        raise KeyError("injected: code generation")
    monkeypatch.setattr(cpp, "generate", broken)
    lines = _check_falls_back(caplog, "while compiling", "compile_fallbacks")
    assert "KeyError" in lines[0] and "repro saved in" in lines[0]
    assert any((p / "repro.py").exists() for p in (tmp_path / "repros").iterdir())


def test_fault_in_lowering_names_the_op_and_its_line(monkeypatch, caplog):
    from ember.codegen import lower

    class Choices(dict):   # lowering looks every op up here: a bug in lowering tanh
        def get(self, op, default=None):
            if op is torch.ops.aten.tanh.default:
                raise AssertionError("injected: lowering tanh")
            return super().get(op, default)
    monkeypatch.setattr(lower, "CHOICES", Choices(lower.CHOICES))
    lines = _check_falls_back(caplog, "while compiling", "compile_fallbacks")
    assert "while lowering tanh_default = aten.tanh.default(" in lines[0], lines[0]
    assert "test_failsafe.py:32" in lines[0], lines[0]   # the line of torch.tanh in `program`


def test_fault_at_the_cpp_build_falls_back(monkeypatch, caplog):
    def failing_build(_source):
        f = concurrent.futures.Future()
        f.set_exception(cache.BuildError("injected: the C++ compiler failed"))
        return f
    monkeypatch.setattr(cache, "build_cpp", failing_build)
    lines = _check_falls_back(caplog, "first launch", "launch_fallbacks")
    assert "BuildError" in lines[0]


def test_fault_at_a_library_launch_after_input_writes_falls_back(monkeypatch, caplog):
    """The compiled call writes its input, then a library kernel refuses an argument (as the memory-efficient
    attention kernel refuses a bias layout): eager reruns from the input's value before the call."""
    load = cpp_backend.CompiledGraph._load

    def load_then_refuse(self):
        load(self)
        call = self.call

        def refusing(args):
            call(args)   # every kernel ran, the input written in place
            raise RuntimeError("injected: attn_bias is not correctly aligned (strideH)")
        self.call = refusing
    monkeypatch.setattr(cpp_backend.CompiledGraph, "_load", load_then_refuse)
    lines = _check_falls_back(caplog, "first launch", "launch_fallbacks")
    assert "attn_bias" in lines[0]


def test_fault_in_the_backward_compile_falls_back(monkeypatch, caplog):
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 3, requires_grad=True)

    def f(x, w):
        return (torch.tanh(x @ w) * 2).sum()
    compiled = ember.compile(f)
    loss = compiled(x, w)
    monkeypatch.setattr(cpp, "generate", lambda *_a, **_k: (_ for _ in ()).throw(KeyError("injected: backward")))
    with caplog.at_level(logging.WARNING, logger="ember.fallbacks"):
        loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(loss, f(x, w))
    torch.testing.assert_close((gx, gw), (x.grad, w.grad))
    assert any("backward" in line for line in _fallback_lines(caplog))


def test_user_index_error_raises_as_eager_with_eager_side_effects():
    def f(x, buf, i):
        buf.mul_(2.0)
        return x[i] + 1

    x, buf = torch.randn(5, 3), torch.randn(4)
    i = torch.tensor([1, 7])   # out of range
    buf_eager = buf.clone()
    with pytest.raises(IndexError) as eager_error:
        f(x, buf_eager, i)
    compiled = ember.compile(f)
    launches = failsafe.STATS["launch_fallbacks"]
    with pytest.raises(type(eager_error.value)):
        compiled(x, buf, i)
    torch.testing.assert_close(buf, buf_eager)   # doubled once, as eager did before raising
    assert failsafe.STATS["launch_fallbacks"] == launches
    good = torch.tensor([0, 4])
    torch.testing.assert_close(compiled(x, buf, good), f(x, buf_eager, good))
    torch.testing.assert_close(buf, buf_eager)


def test_user_shape_error_raises_as_eager():
    def f(a, b):
        return torch.relu(a @ b) + 1

    a, b = torch.randn(3, 4), torch.randn(5, 2)
    with pytest.raises(RuntimeError) as eager_error:
        f(a, b)
    with pytest.raises(type(eager_error.value)):
        ember.compile(f)(a, b)


def test_user_backend_errors_reach_the_user(tmp_path):
    def refusing_backend(gm, example_inputs):
        raise ValueError("this backend refuses every graph")

    x = torch.randn(3)
    with pytest.raises(ember.BackendCompilerFailed) as e:
        ember.compile(lambda x: x.sin() + 1, backend=refusing_backend)(x)
    assert isinstance(e.value.__cause__, ValueError)
    saved = list((tmp_path / "repros").iterdir())
    assert len(saved) == 1 and (saved[0] / "repro.py").exists()


def test_with_the_fail_safe_off_the_crash_raises(monkeypatch):
    monkeypatch.setenv("EMBER_FAIL_SAFE", "0")
    monkeypatch.setattr(cpp, "generate", lambda *_a, **_k: (_ for _ in ()).throw(KeyError("injected")))
    with pytest.raises(ember.BackendCompilerFailed):
        ember.compile(lambda x: x.cos() * 2)(torch.randn(4))


def test_the_wrapper_leaves_the_entry_after_the_first_launch():
    def f(x):
        return torch.sigmoid(x) * 2

    compiled = ember.compile(f)
    x = torch.randn(7)
    entry_globals = lambda: [e.fn.__globals__ for e in compiled._frame.entries]   # noqa: E731
    torch.testing.assert_close(compiled(x), f(x))
    assert len(entry_globals()) == 1
    graph = entry_globals()[0]["___graph"]
    assert not isinstance(graph, failsafe.FirstCalls) and callable(graph)
    torch.testing.assert_close(compiled(x), f(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend compiles for CUDA devices only")
def test_fault_at_the_triton_compile_falls_back(monkeypatch, caplog):
    import random

    import triton.compiler
    import triton.compiler.compiler
    from triton.compiler.errors import CompilationError

    def failing_compile(*_a, **_k):
        raise CompilationError(None, None, "injected: Triton compile")
    # (a kernel's JITFunction binds triton.compiler.compile when it first compiles: this graph's are new)
    monkeypatch.setattr(triton.compiler, "compile", failing_compile)
    monkeypatch.setattr(triton.compiler.compiler, "compile", failing_compile)
    scale = 1.0 + random.random()   # a kernel source of its own: nothing in Triton's in-process caches

    def f(x, y):
        return torch.tanh(x * scale) + y.softmax(dim=-1)

    x, y = torch.randn(64, 33, device="cuda"), torch.randn(64, 33, device="cuda")
    with caplog.at_level(logging.WARNING, logger="ember.fallbacks"):
        got = ember.compile(f)(x, y)
    torch.testing.assert_close(got, f(x, y))
    lines = _fallback_lines(caplog)
    assert lines and "CompilationError" in lines[0], lines
