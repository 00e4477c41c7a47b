"""Per-op gradient checks: for each op of the set the code generator decomposes (issue 5's list), the forward and
backward ATen graphs built by ember.autograd give eager's outputs and gradients, on fresh random float64 inputs,
and both graphs are functional."""
import pytest
import torch
import torch.nn.functional as F

from ember.autograd import aot_module

D = torch.float64


def r(*shape):
    return torch.randn(*shape, dtype=D)


def pos(*shape):
    return torch.rand(*shape, dtype=D) + 0.5


# name -> (function, float inputs (all require grad), extra non-differentiable inputs)
OPS = {
    "add": (lambda a, b: a + b, [r(3, 4), r(4)], []),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=2), [r(3, 4), r(3, 4)], []),
    "mul": (lambda a, b: a * b, [r(3, 4), r(3, 1)], []),
    "div": (lambda a, b: a / b, [r(3, 4), pos(3, 4)], []),
    "neg_abs": (lambda a: (-a).abs(), [r(3, 4)], []),
    "exp_log": (lambda a: a.exp() + a.abs().add(1).log(), [r(3, 4)], []),
    "sin_cos": (lambda a: a.sin() * a.cos(), [r(3, 4)], []),
    "tanh_sigmoid": (lambda a: a.tanh() + a.sigmoid(), [r(3, 4)], []),
    "rsqrt_sqrt": (lambda a: a.rsqrt() + a.sqrt(), [pos(3, 4)], []),
    "relu": (F.relu, [r(3, 4)], []),
    "gelu": (F.gelu, [r(3, 4)], []),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), [r(3, 4)], []),
    "silu": (F.silu, [r(3, 4)], []),
    "leaky_relu": (lambda a: F.leaky_relu(a, 0.1), [r(3, 4)], []),
    "softmax": (lambda a: F.softmax(a, -1), [r(3, 5)], []),
    "log_softmax": (lambda a: F.log_softmax(a, 1), [r(3, 5)], []),
    "layer_norm": (lambda a, w, b: F.layer_norm(a, (5,), w, b), [r(3, 5), r(5), r(5)], []),
    "batch_norm_train": (lambda a, w, b, rm, rv: F.batch_norm(a, rm, rv, w, b, training=True),
                         [r(4, 3, 2), r(3), r(3)], [torch.zeros(3, dtype=D), torch.ones(3, dtype=D)]),
    "batch_norm_eval": (lambda a, w, b, rm, rv: F.batch_norm(a, rm, rv, w, b, training=False),
                        [r(4, 3, 2), r(3), r(3)], [r(3), pos(3)]),
    "group_norm": (lambda a, w, b: F.group_norm(a, 2, w, b), [r(2, 4, 3), r(4), r(4)], []),
    "embedding": (lambda w, i: F.embedding(i, w), [r(10, 4)], [torch.randint(0, 10, (3, 5))]),
    "cross_entropy": (lambda a, t: F.cross_entropy(a, t), [r(6, 5)], [torch.randint(0, 5, (6,))]),
    "nll_loss": (lambda a, t: F.nll_loss(F.log_softmax(a, 1), t, reduction="sum"), [r(6, 5)],
                 [torch.randint(0, 5, (6,))]),
    "mse_loss": (F.mse_loss, [r(3, 4), r(3, 4)], []),
    "mean_var_std": (lambda a: a.mean(0) + a.var(1, keepdim=True) + a.std(), [r(3, 4)], []),
    "sum_amax": (lambda a: a.sum(1) + a.amax(1), [r(3, 4)], []),
    "cat_stack": (lambda a, b: torch.cat([a, b], 0).sum(0) + torch.stack([a, b]).prod(0).sum(0), [r(3, 4), r(3, 4)],
                  []),
    "split_chunk": (lambda a: sum(t.sum(1) for t in a.split(2, 1)) + a.chunk(2, 0)[1].sum(), [r(4, 6)], []),
    "permute_transpose_expand": (lambda a: a.permute(2, 0, 1).transpose(0, 1).expand(2, 4, 3, 5) * 2, [r(4, 5, 3)],
                                 []),
    "view_reshape_flatten": (lambda a: a.view(6, 4).t().reshape(2, 12).flatten(), [r(2, 3, 4)], []),
    "slice_select_index": (lambda a, i: a[1:, ::2].select(1, 0) + a[i].sum(), [r(5, 4)], [torch.tensor([0, 3])]),
    "clamp": (lambda a: a.clamp(-0.5, 0.5), [r(3, 4)], []),
    "where": (lambda a, b: torch.where(a > 0, a, b * 2), [r(3, 4), r(3, 4)], []),
    "pow": (lambda a, b: a.pow(3) + a.abs().pow(b), [r(3, 4), r(3, 4)], []),
    "matmul_bmm": (lambda a, b: a @ b, [r(2, 3, 4), r(2, 4, 5)], []),
    "linear": (F.linear, [r(3, 4), r(5, 4), r(5)], []),
    "conv2d": (lambda a, w, b: F.conv2d(a, w, b, padding=1, stride=2), [r(2, 3, 6, 6), r(4, 3, 3, 3), r(4)], []),
    "max_pool2d": (lambda a: F.max_pool2d(a, 2), [r(2, 3, 4, 4)], []),
    "avg_pool_adaptive": (lambda a: F.avg_pool2d(a, 2) + F.adaptive_avg_pool2d(a, 2), [r(2, 3, 4, 4)], []),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             [r(2, 2, 5, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)], []),
    "masked_fill_tril": (lambda a: a.masked_fill(torch.ones(4, 4, dtype=torch.bool).tril().logical_not(), -1.0),
                         [r(4, 4)], []),
    "cumsum_logsumexp": (lambda a: a.cumsum(1) + a.logsumexp(1, keepdim=True), [r(3, 4)], []),
    "index_add_scatter": (lambda a, s, i: a.index_add(0, i, s) + a.scatter(1, i.view(-1, 1).expand(2, 4), s),
                          [r(5, 4), r(2, 4)], [torch.tensor([1, 3])]),
    "to_dtype": (lambda a: a.float().exp().double(), [r(3, 4)], []),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_gradient(name):
    fn, diff, extra = OPS[name]
    diff = [t.clone().requires_grad_() for t in diff]
    diff_ref = [t.detach().clone().requires_grad_() for t in diff]
    extra = [t.clone() for t in extra]
    extra_ref = [t.clone() for t in extra]
    graphs = []

    def compiler(gm, example_inputs):
        for n in gm.graph.nodes:
            t = n.target
            assert not (isinstance(t, torch._ops.OpOverload) and any(
                a.alias_info is not None and a.alias_info.is_write for a in t._schema.arguments)), n.format_node()
        graphs.append(gm.__class__.__name__)
        return gm.forward

    class Program(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    compiled = aot_module(Program(), diff + extra, compiler)
    out = compiled(*diff, *extra)
    want = fn(*diff_ref, *extra_ref)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, diff, g, allow_unused=True)
    want_grads = torch.autograd.grad(want, diff_ref, g, allow_unused=True)
    torch.testing.assert_close(got_grads, want_grads)
    for a, b in zip(extra, extra_ref):           # e.g. batch_norm's running stats
        torch.testing.assert_close(a, b)
    assert graphs == ["AtenForward", "AtenBackward"]
