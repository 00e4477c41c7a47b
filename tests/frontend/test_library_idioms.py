"""Idioms of model libraries captured without a break (issue 26, item 2): numpy on Python numbers, a module built
inside forward, attribute writes on a transformers ModelOutput, `in` over an iterator or a dict view, functions
marked constant for torch.compile, classes as dict keys. Counts as torch.compile's (EMBER_TEST_BASELINE=torch)."""
import functools

import numpy as np
import pytest
import torch

from tests.frontend.harness import BASELINE, check, rand


def test_numpy_on_python_numbers_is_evaluated_at_capture():
    def f(x):
        scale = np.sqrt(x.shape[-1])          # reformer, ctrl: np.sqrt(d_model)
        return x / scale + int(np.lcm(4, 6)) + float(np.float32(0.5) * 3)
    r = check(f, rand(3, 4))
    # torch.compile traces numpy as torch ops (torch._numpy): 2 graphs, [3, 6] ops
    assert BASELINE or r.graphs == 1 and r.ops == [3]


def test_numpy_keeps_its_own_semantics_at_capture():
    def f(x):
        v = np.float32(x.shape[0]) * np.float32(0.1)   # float32 arithmetic: not Python's 0.30000000000000004
        return x + float(v) if float(v) != x.shape[0] * 0.1 else x - 1
    r = check(f, rand(3))
    assert BASELINE or r.graphs == 1 and r.ops == [1]   # torch.compile: 1 graph of 8 ops (numpy as torch ops)


class _Doubling(torch.nn.Module):
    def __init__(self, factor: float = 2.0):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


_ACTIVATIONS = {"silu": torch.nn.SiLU, "gelu_tanh": functools.partial(torch.nn.GELU, approximate="tanh"),
                "double": _Doubling}


def test_a_stateless_module_built_in_forward():
    def f(x, name):
        act = _ACTIVATIONS[name]()      # transformers' ACT2FN[name]: a new activation module on every call
        return act(x).sum(-1) + torch.nn.Identity()(x).mean(-1)
    for name, ops in (("silu", 4), ("gelu_tanh", 4), ("double", 4)):
        r = check(f, rand(3, 4), name)
        assert r.graphs == 1 and r.ops == [ops], (name, r.describe())


def test_a_module_with_parameters_built_in_forward_runs_in_python():
    def f(x):
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)(x).relu()
    check(f, rand(3, 4))   # values equal eager's (the graph count differs: torch.compile traces the __init__)


def test_attribute_write_on_a_model_output():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")

    def f(x):
        out = modeling_outputs.BaseModelOutputWithPooling(last_hidden_state=x.sin(), pooler_output=x.sum(0))
        out.pooler_output = out.pooler_output * 2      # clip's text/vision projection
        out.last_hidden_state = out["last_hidden_state"] + 1
        return out
    r = check(f, rand(3, 4))
    assert r.graphs == 1 and r.ops == [4]
    assert list(r.result.keys()) == ["last_hidden_state", "pooler_output"]


def test_in_over_an_iterator_consumes_it_as_python():
    def f(x, names):
        it = iter(names)
        found = "b" in it
        rest = list(it)          # what is left after the match
        missing = "z" in it      # exhausts it
        return x + len(rest) + 10 * found + 100 * missing + len(list(it))
    r = check(f, rand(2), ["a", "b", "c", "d"])
    assert r.graphs == 1 and r.ops == [4]


def test_in_over_a_dict_view_does_not_consume_it():
    def f(x, d):
        keys = d.keys()
        n = ("b" in keys) + ("z" in keys) + (2 in d.values())
        for _ in keys:
            n += 1
        for _ in keys:           # a view is iterated anew each time
            n += 10
        return x * n
    r = check(f, rand(2), {"a": 1, "b": 2})
    assert r.graphs == 1 and r.ops == [1]


def _marked_constant(fn):
    fn._dynamo_marked_constant = True   # what torch._dynamo.assume_constant_result sets (transformers sets it too)
    return fn


@functools.lru_cache
@_marked_constant
def _library_version_at_least(version: str) -> bool:
    return tuple(map(int, version.split("."))) <= (2, 5)


def test_a_function_marked_constant_is_called_at_capture():
    def f(x):
        if _library_version_at_least("2.0"):
            return x.sin()
        return x.cos()
    r = check(f, rand(3))
    assert r.graphs == 1 and r.ops == [1]


_HANDLERS = {list: "list", tuple: "tuple", dict: "dict"}


def test_a_class_as_a_dict_key():
    def f(x, items):
        if type(items) in _HANDLERS and type(x) not in _HANDLERS:
            return x + len(items)
        return x
    r = check(f, rand(3), [1, 2])
    assert r.graphs == 1 and r.ops == [1]


def test_cuda_stream_capture_check_is_answered_and_guarded(monkeypatch):
    """transformers' is_tracing asks torch.cuda.is_current_stream_capturing() (which raises without a CUDA driver,
    and then the library's try answers False): answered at capture and guarded, no break. Here the CUDA call
    answers as on a GPU outside a capture, then as inside one: the guard fails, a graph of its own."""
    import torch.cuda.graphs as graphs
    from tests.frontend.harness import Recorder, assert_same, compile, reset
    capturing = [False]
    monkeypatch.setattr(graphs, "_cuda_isCurrentStreamCapturing", lambda: capturing[0])

    def f(x):
        try:
            skip = torch.cuda.is_current_stream_capturing()
        except Exception:
            skip = False
        return x * 2 if skip else (x + 1).sin()
    reset()
    rec = Recorder()
    cf = compile(f, rec)
    x = rand(3)
    assert_same(f(x), cf(x), "not capturing")
    assert BASELINE or rec.graphs == 1 and rec.ops == [2]
    capturing[0] = True
    assert_same(f(x), cf(x), "capturing")
    assert BASELINE or rec.graphs == 2 and rec.ops == [2, 1]
