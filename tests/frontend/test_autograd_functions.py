"""torch.autograd.Function subclasses in captured programs (issue 26, item 2; frontend/autograd_functions.py):
forward inlined where no gradient can flow, one graph op `Fn.apply` otherwise, whose forward and backward
ember.autograd traces on fakes. Values and gradients equal to eager, through the eager backend (the graph as
captured), aot_eager (ember's ATen trace, run eagerly) and ember."""
import pytest
import torch

from tests.frontend.harness import BASELINE, Recorder, assert_same, compile, rand, reset


class GeLUFunction(torch.autograd.Function):
    """transformers' bloom (modeling_bloom.GeLUFunction)."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return input * 0.5 * (1.0 + torch.tanh(0.79788456 * input * (1 + 0.044715 * input * input)))

    @staticmethod
    def backward(ctx, grad_output):
        input = ctx.saved_tensors
        x = input[0] if isinstance(input, tuple) else input
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * grad_output


class StraightThroughRound(torch.autograd.Function):
    """A backward that is not forward's derivative (round's is zero): only Fn.backward gives the identity."""

    @staticmethod
    def forward(ctx, x, scale: float):
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScaledMaxWithIndex(torch.autograd.Function):
    """Non-tensor arguments, two tensor inputs (one may need no grad), a non-differentiable output,
    needs_input_grad, tensors saved from forward and attributes on ctx."""

    @staticmethod
    def forward(ctx, x, w, scale: float, keepdim: bool):
        y = x * w * scale
        values, index = y.max(dim=-1, keepdim=keepdim)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(x, w, index)
        ctx.scale, ctx.keepdim = scale, keepdim
        return values, index

    @staticmethod
    def backward(ctx, grad_values, grad_index):
        x, w, index = ctx.saved_tensors
        if not ctx.keepdim:
            grad_values, index = grad_values.unsqueeze(-1), index.unsqueeze(-1)
        g = torch.zeros_like(x).scatter(-1, index, grad_values) * ctx.scale
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = g * x if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


class SetupContextMul(torch.autograd.Function):
    """The setup_context style (forward without ctx)."""

    @staticmethod
    def forward(x, y):
        return x * y + 1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, grad * x


def _bloom_mlp(x, w):
    return GeLUFunction.apply(x @ w).sum(-1)


def _straight_through(x):
    return StraightThroughRound.apply(x.sin(), 4.0).pow(2).sum()


def _max_with_index(x, w):
    values, index = ScaledMaxWithIndex.apply(x.cos(), w, 0.5, False)
    return values.sum() + index.sum()


def _max_with_index_keepdim(x, w):
    values, index = ScaledMaxWithIndex.apply(x, w, 2.0, True)
    return (values * 3).sum(), index


def _setup_context(x, y):
    return SetupContextMul.apply(x, y.exp()).mean()


PROGRAMS = [(_bloom_mlp, lambda: (rand(4, 6), rand(6, 5))),
            (_straight_through, lambda: (rand(3, 4),)),
            (_max_with_index, lambda: (rand(3, 5), rand(3, 5))),
            (_max_with_index_keepdim, lambda: (rand(2, 3, 4), rand(4))),
            (_setup_context, lambda: (rand(3), rand(3)))]


def _run_with_grads(fn, args, grad_mask):
    args = [a.detach().clone().requires_grad_(g) for a, g in zip(args, grad_mask)]
    out = fn(*args)
    loss = (out[0] if isinstance(out, tuple) else out).sum()
    if loss.requires_grad:
        loss.backward()
    return out, [a.grad for a in args]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "ember"])
@pytest.mark.parametrize("fn,make_args", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_function_values_and_gradients_equal_eager(fn, make_args, backend):
    if BASELINE and backend != "eager":
        pytest.skip("ember's backends")
    args = make_args()
    masks = [[True] * len(args), [False] * len(args)]
    if len(args) == 2:
        masks.append([True, False])   # needs_input_grad differs per input
    for mask in masks:
        reset()
        rec = Recorder()
        cfn = compile(fn, backend=backend) if backend != "eager" else compile(fn, rec)
        expected, expected_grads = _run_with_grads(fn, args, mask)
        for _ in range(2):   # the second call reuses the graph (Fn.apply is bound anew on each read)
            actual, grads = _run_with_grads(cfn, args, mask)
            assert_same(expected, actual, rtol=1e-5, atol=1e-5)
            assert_same(expected_grads, grads, "grads", rtol=1e-5, atol=1e-5)
        if backend == "eager":
            assert rec.graphs == 1, rec.describe()


def test_gradient_comes_from_the_functions_backward():
    x = rand(3, 4, requires_grad=True)
    cfn = compile(_straight_through, Recorder())
    cfn(x).backward()
    assert_same(2 * StraightThroughRound.apply(x.sin(), 4.0).detach() * x.cos().detach(), x.grad, rtol=1e-5,
                atol=1e-6)   # round's own derivative would give zeros


@pytest.mark.skipif(BASELINE, reason="torch.compile records a higher-order op and a getitem (4 ops)")
def test_one_op_where_a_gradient_flows_forward_inlined_where_none_can():
    rec = Recorder()
    cfn = compile(_bloom_mlp, rec)
    x, w = rand(4, 6), rand(6, 5, requires_grad=True)
    assert_same(_bloom_mlp(x, w), cfn(x, w))
    assert rec.ops == [3] and rec.describe() == "graph 0: ['matmul', 'GeLUFunction_apply', 'sum']"
    reset()
    rec = Recorder()
    cfn = compile(_bloom_mlp, rec)
    w = w.detach()
    with torch.no_grad():
        assert_same(_bloom_mlp(x, w), cfn(x, w))
    # matmul, forward's 9 ops, sum: torch.compile's graph too
    assert rec.graphs == 1 and rec.ops == [11], rec.describe()


@pytest.mark.skipif(BASELINE, reason="torch.compile inlines forward without apply's grad-mode switch: its output "
                                     "requires grad where eager's does not (torch 2.14.1)")
def test_inlined_forward_runs_without_grad_like_apply():
    """apply runs forward with grad mode off: a parameter forward reads gives an output without grad."""
    weight = torch.nn.Parameter(torch.randn(3))

    class UsesGlobalWeight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * weight

        @staticmethod
        def backward(ctx, g):
            return g

    def f(x):
        return UsesGlobalWeight.apply(x) + 1
    x = rand(3)
    expected = f(x)
    assert not expected.requires_grad
    assert_same(expected, compile(f, Recorder())(x))
