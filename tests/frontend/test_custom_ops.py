"""Operators of torch's dispatcher called in a program (issue 26, item 2): `torch.library.custom_op` (with
register_fake and register_autograd), ops defined through `torch.library.Library` with a Meta kernel, and
`torch.ops.aten.*` called directly are graph ops, as torch.compile records them; ember's codegen calls them as ATen
fallbacks. Values and gradients equal to eager through the eager, aot_eager and ember backends."""
import pytest
import torch

from tests.frontend.harness import BASELINE, Recorder, assert_same, check, compile, rand, reset

NS = "ember_frontend_test"


@torch.library.custom_op(f"{NS}::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


@scaled_add.register_fake
def _scaled_add_fake(x, y, alpha):
    return torch.empty_like(x)


def _scaled_add_setup(ctx, inputs, output):
    ctx.alpha = inputs[2]


def _scaled_add_backward(ctx, grad):
    return grad * 1.0, grad * ctx.alpha, None


scaled_add.register_autograd(_scaled_add_backward, setup_context=_scaled_add_setup)


@torch.library.custom_op(f"{NS}::add_into", mutates_args=("out",))
def add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


@add_into.register_fake
def _add_into_fake(x, out):
    return None


_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("twice_plus(Tensor x, int k) -> Tensor")
_lib.impl("twice_plus", lambda x, k: x * 2 + k, "CPU")
_lib.impl("twice_plus", lambda x, k: torch.empty_like(x), "Meta")
_lib.define("no_fake_kernel(Tensor x) -> Tensor")
_lib.impl("no_fake_kernel", lambda x: x.exp() - 1, "CPU")


def _custom_op_program(x, y):
    return scaled_add(x.sin(), y, 0.5).relu() + getattr(torch.ops, NS).scaled_add(x, y, 2.0)


def _library_op_program(x):
    return getattr(torch.ops, NS).twice_plus(x.cos(), 3).sum(-1)


def _aten_program(x, y):
    return torch.ops.aten.mul.Tensor(torch.ops.aten.add(x, y), 2.0)


@pytest.mark.parametrize("fn,make_args,ops", [
    (_custom_op_program, lambda: (rand(3, 4), rand(3, 4)), 5),
    (_library_op_program, lambda: (rand(3, 4),), 3),
    (_aten_program, lambda: (rand(3, 4), rand(3, 4)), 2),
], ids=["custom_op", "library_define_impl", "aten"])
def test_registered_ops_are_graph_ops(fn, make_args, ops):
    r = check(fn, *make_args())
    assert r.graphs == 1 and r.ops == [ops], r.describe()


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "ember"])
def test_custom_op_values_and_gradients_equal_eager(backend):
    if BASELINE and backend != "eager":
        pytest.skip("ember's backends")
    for requires_grad in (False, True):
        reset()
        x, y = rand(3, 4, requires_grad=requires_grad), rand(3, 4, requires_grad=requires_grad)
        x2, y2 = (a.detach().clone().requires_grad_(requires_grad) for a in (x, y))
        cfn = compile(_custom_op_program, backend=backend)
        out, expected = cfn(x, y), _custom_op_program(x2, y2)
        assert_same(expected, out)
        if requires_grad:
            out.sum().backward()
            expected.sum().backward()
            assert_same((x2.grad, y2.grad), (x.grad, y.grad))
        with torch.no_grad():
            assert_same(_library_op_program(x), compile(_library_op_program, backend=backend)(x))


@pytest.mark.skipif(BASELINE, reason="torch.compile functionalizes a mutating custom op into its graph")
def test_a_custom_op_that_writes_its_argument_runs_in_python():
    def f(x, acc):
        add_into(x.sin(), acc)
        return acc * 2
    r = check(f, rand(3), rand(3))   # compares acc afterwards too
    assert r.graphs == 2 and r.ops == [1, 1], r.describe()


@pytest.mark.skipif(BASELINE, reason="torch.compile raises for an op without a fake kernel")
def test_an_op_without_a_fake_kernel_runs_in_python():
    def f(x):
        return getattr(torch.ops, NS).no_fake_kernel(x.sin()) + 1
    r = check(f, rand(3))
    assert r.graphs == 2 and r.ops == [1, 1], r.describe()
