"""Bookkeeping calls are not graph breaks (frontend/policy.py): torch._assert on a Python bool, torch.overrides'
has_torch_function checks on plain Python values, torch's API-usage logging. Counts as torch.compile's
(EMBER_TEST_BASELINE=torch runs the same tests through it)."""
import pytest
import torch
from torch.overrides import has_torch_function, has_torch_function_unary, has_torch_function_variadic

from tests.frontend.harness import BASELINE, check, rand


def test_assert_on_a_python_bool_is_decided_at_capture():
    def f(x):
        y = x.cos()
        torch._assert(x.shape[0] == 4, "batch of four")
        return y.sin() + 1
    r = check(f, rand(4, 3))
    assert r.graphs == 1 and r.ops == [3]


@pytest.mark.skipif(BASELINE, reason="torch.compile appends its own lines to the assertion's message")
def test_a_failing_assert_on_a_python_bool_raises_as_eager():
    def f(x):
        y = x.cos()
        torch._assert(x.shape[0] == 5, "batch of five")
        return y
    check(f, rand(4, 3))   # compares the exception (type and message) with eager's


def test_has_torch_function_on_python_values_is_false_without_a_break():
    def f(x, flag):
        y = x + 1
        if has_torch_function((flag, None)) or has_torch_function_unary(flag) or has_torch_function_variadic(1, 2.0):
            return x
        return y * 2
    r = check(f, rand(3), True)
    assert r.graphs == 1 and r.ops == [2]


def test_api_usage_logging_is_skipped_like_torch_compile():
    torchvision = pytest.importorskip("torchvision")

    def f(x):
        torch._C._log_api_usage_once("a library op")
        return torchvision.ops.stochastic_depth(x.relu(), 0.5, "row", training=False) + 1
    r = check(f, rand(4, 8))
    assert r.graphs == 1 and r.ops == [2]
