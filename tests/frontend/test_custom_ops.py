"""Operators of torch's dispatcher called in a program (issue 26, item 2): `torch.library.custom_op` (with
register_fake and register_autograd), ops defined through `torch.library.Library` with a Meta kernel, and
`torch.ops.aten.*` called directly are graph ops, as torch.compile records them; ember's codegen calls them as ATen
fallbacks. Values and gradients equal to eager through the eager, aot_eager and ember backends."""
import pytest
import torch

import ember

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


@torch.library.custom_op(f"{NS}::segment_scale", mutates_args=())
def segment_scale(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row segments [offs[i-1], offs[i]) of x times w[i] (a grouped product's shape, as transformers' MoE
    fallback): its gradient formula reads offs's values in Python."""
    out, start = torch.empty_like(x), 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] * w[i]
        start = end
    return out


@segment_scale.register_fake
def _segment_scale_fake(x, w, offs):
    return torch.empty_like(x)


def _segment_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _segment_scale_backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw, start = torch.empty_like(x), torch.empty_like(w), 0
    for i, end in enumerate(ctx.offs.tolist()):   # values in Python: fake tensors cannot trace this
        gx[start:end] = grad[start:end] * w[i]
        gw[i] = (grad[start:end] * x[start:end]).sum()
        start = end
    return gx, gw, None


segment_scale.register_autograd(_segment_scale_backward, setup_context=_segment_scale_setup)


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


@pytest.mark.skipif(BASELINE, reason="ember's capture-time check of a custom op's gradient formula")
def test_a_custom_op_whose_gradient_reads_values_is_a_break_in_a_symbolic_capture_too(caplog):
    """Under dynamic shapes the capture's fakes answer `.tolist()` with unbacked symbols instead of raising: the
    check still finds that the gradient reads values, and the op is a break, not an eager graph."""
    def f(x, w, offs):
        return getattr(torch.ops, NS).segment_scale(x.sin(), w * 2, offs).cos()
    offs = torch.tensor([2, 5, 8])
    reset()
    x, w = rand(8, 3, requires_grad=True), rand(3, requires_grad=True)
    x2, w2 = (a.detach().clone().requires_grad_(True) for a in (x, w))
    with caplog.at_level("WARNING", logger="ember.fallbacks"):
        out, expected = ember.compile(f, dynamic=True)(x, w, offs), f(x2, w2, offs)
        assert_same(expected, out)
        out.sum().backward()
        expected.sum().backward()
        assert_same((x2.grad, w2.grad), (x.grad, w.grad))
    assert not [m for m in caplog.messages if "eagerly" in m], caplog.messages


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


@pytest.mark.skipif(BASELINE, reason="ember's capture-time check of a custom op's gradient formula")
def test_a_custom_op_whose_gradient_reads_values_is_a_break_not_an_eager_graph(caplog):
    """Its gradient formula calls .tolist(), which ember's autograd cannot trace: the op runs in Python (with its
    own autograd) and the graphs around it compile, instead of the whole graph running eagerly. Without grad it
    is a graph op as any other."""
    def f(x, w, offs):   # (called as transformers calls its op: through the packet torch.ops.<ns>.<name>)
        return getattr(torch.ops, NS).segment_scale(x.sin(), w * 2, offs).cos()
    offs = torch.tensor([2, 5, 8])
    for requires_grad in (True, False):
        reset()
        x, w = rand(8, 3, requires_grad=requires_grad), rand(3, requires_grad=requires_grad)
        x2, w2 = (a.detach().clone().requires_grad_(requires_grad) for a in (x, w))
        with caplog.at_level("WARNING", logger="ember.fallbacks"):
            cfn = compile(f, backend="ember")
            out, expected = cfn(x, w, offs), f(x2, w2, offs)
            assert_same(expected, out)
            if requires_grad:
                out.sum().backward()
                expected.sum().backward()
                assert_same((x2.grad, w2.grad), (x.grad, w.grad))
        assert not [m for m in caplog.messages if "eagerly" in m], caplog.messages
        caplog.clear()
        reset()
        with torch.set_grad_enabled(True):
            ex = ember.explain(f)(x, w, offs)
        assert ex.graph_count == (2 if requires_grad else 1), ex
