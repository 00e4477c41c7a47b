"""torch.vmap inside a compiled program (ember.frontend.vmap): inlined as torch.compile inlines it, the batching
done by torch's own rules when the graph runs (and, for the ember backend, when its ATen graph is traced). Counts
as torch.compile's (EMBER_TEST_BASELINE=torch): each vmap call is 1 decomposition load + enter + exit around its
add_batch_dim / remove_batch_dim per mapped input and output."""
import functools

import pytest
import torch

import ember
from tests.frontend.harness import BASELINE, check, explain, rand, reset

# torch refuses combine_mode="pointwise" on CPU tensors where a GPU is present
SCAN_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_vmap_of_a_closure_over_a_pointwise_function():
    def f(a, b, w):
        def combine(x, y):
            return x * y + w                       # w: an unmapped tensor of the enclosing frame
        return torch.vmap(combine)(a, b)
    r = check(f, rand(4, 3), rand(4, 3), rand(3))
    # 3 bookkeeping + 2 add_batch_dim + 2 ops + 1 remove_batch_dim
    assert r.graphs == 1 and r.ops == [8]


def test_vmap_batching_rules_of_reductions_and_products():
    def f(x, m):
        def row(v):
            return (v @ m).softmax(-1).sum(0) + v.mean()
        return torch.vmap(row, in_dims=1, out_dims=0)(x)
    r = check(f, rand(5, 4, 3), rand(3, 6))
    assert r.graphs == 1 and r.ops == [10]


def test_vmap_in_dims_none_nested_tuples_and_two_outputs():
    def f(pair, s):
        def g(xy, scale):
            x, y = xy
            return x * scale, (y - x).abs()
        a, b = torch.vmap(g, in_dims=((0, 1), None), out_dims=(1, 0))(pair, s)
        return a + 1, b * 2
    r = check(f, (rand(4, 3), rand(3, 4)), rand(3))
    assert r.graphs == 1 and r.ops == [12]


def test_vmap_over_a_named_tuple():
    import collections
    Pair = collections.namedtuple("Pair", "a b")

    def f(p):
        out = torch.vmap(lambda q: Pair(q.a + q.b, q.a * q.b))(p)
        return out.a - out.b
    r = check(f, Pair(rand(4, 3), rand(4, 3)))
    assert r.graphs == 1 and r.ops == [10]


def test_nested_vmap():
    def f(x, y):
        return torch.vmap(torch.vmap(lambda a, b: a * b + 1))(x, y)
    r = check(f, rand(2, 3, 4), rand(2, 3, 4))
    assert r.graphs == 1


def test_vmap_made_before_the_compiled_call():
    mapped = torch.vmap(lambda x, y: torch.dot(x, y))

    def f(x, y):
        return mapped(x, y).relu()
    r = check(f, rand(6, 5), rand(6, 5))
    assert r.graphs == 1 and r.ops == [8]


def test_torch_pytree_flatten_and_unflatten_inside_the_program():
    import torch.utils._pytree as pytree

    def f(x, y):
        leaves, spec = pytree.tree_flatten({"a": (x, y), "b": [x * 2]})
        doubled = pytree.tree_unflatten([t + 1 for t in leaves], spec)
        return doubled["a"][1] * doubled["b"][0], spec.num_leaves, torch.Size([2, 3, 4]).numel()
    r = check(f, rand(3), rand(3))
    assert r.graphs == 1 and r.ops == [5]


def test_break_inside_the_mapped_function_runs_the_vmap_as_python():
    def f(x, y):
        def g(a, b):
            print("mapped")                        # a break: vmap runs it eagerly, once per call
            return a * b
        return torch.vmap(g)(x, y).sum(0) + x[0]
    r = check(f, rand(4, 3), rand(4, 3))
    # ember: the vmap call runs as Python, the rest is one graph (sum, x[0], add); torch.compile: 1 graph, no break
    assert BASELINE or r.graphs == 1 and r.ops == [3]
    reset()
    ex = explain(f, rand(4, 3), rand(4, 3))
    assert BASELINE or ex.graph_break_count == 1 and "print" in str(ex.break_reasons[0])


def test_vmap_errors_as_eager():
    def wrong_in_dims(x):
        return torch.vmap(torch.sin, in_dims=(0, 0))(x)

    def sizes_differ(x, y):
        return torch.vmap(torch.mul)(x, y)

    def random_inside(x):
        return torch.vmap(lambda v: v + torch.rand(3))(x)
    check(wrong_in_dims, rand(3, 2))
    check(sizes_differ, rand(3, 2), rand(4, 2))
    check(random_inside, rand(3, 3))


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_vmap_gradients_and_values_through_the_whole_pipeline(backend):
    """The scan of transformers' Mamba under a compiler (torch's associative_scan, generic mode: a vmapped
    combine function applied over slices), forward and backward, against eager."""
    from torch._higher_order_ops.associative_scan import associative_scan   # (the test's own use of torch)

    def scan(a, b):
        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]
        return associative_scan(combine, (a, b), dim=1, combine_mode="generic")[1].square().sum()

    a, b = rand(2, 7, 3), rand(2, 7, 3)
    ember.reset()
    compiled = ember.compile(scan, backend=backend)
    ea, eb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ca, cb = a.clone().requires_grad_(), b.clone().requires_grad_()
    expected, actual = scan(ea, eb), compiled(ca, cb)
    torch.testing.assert_close(actual, expected)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(ca.grad, ea.grad)
    torch.testing.assert_close(cb.grad, eb.grad)
    ember.reset()
    ex = ember.explain(functools.partial(scan, a, b))()
    assert ex.graph_count == 1 and ex.graph_break_count == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "ember"])
def test_vmap_randomness_same_draws_as_eager(backend):
    """randomness="different" draws one batched sample, "same" one shared: as eager, and the generator after."""
    def f(x):
        return (torch.vmap(lambda v: v * torch.rand(3), randomness="different")(x),
                torch.vmap(lambda v: v + torch.randn(()), randomness="same")(x))
    x = rand(4, 3)
    ember.reset()
    compiled = ember.compile(f, backend=backend)
    for _ in range(2):
        torch.manual_seed(0)
        expected, after = f(x), torch.rand(2)
        torch.manual_seed(0)
        actual, c_after = compiled(x), torch.rand(2)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(c_after, after)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "ember"])
def test_vmap_writing_a_mapped_input_in_place(backend):
    """v.add_(w) on a batched input writes the caller's tensor, as in eager."""
    def f(x, y):
        return torch.vmap(lambda v, w: v.add_(w).mul(2))(x, y), x * 3
    x, y = rand(4, 3), rand(4, 3)
    ember.reset()
    compiled = ember.compile(f, backend=backend)
    for _ in range(2):
        ex, cx = x.clone(), x.clone()
        torch.testing.assert_close(compiled(cx, y), f(ex, y))
        torch.testing.assert_close(cx, ex)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_vmap_with_symbolic_sizes(backend):
    """dynamic=True: the mapped size is specialized (guarded), the others stay symbolic; each new shape equal."""
    def f(x, y, w):
        return torch.vmap(lambda a, b: (a * b + w).sum(-1), in_dims=(0, 1))(x, y)
    ember.reset()
    compiled = ember.compile(f, backend=backend, dynamic=True)
    for n, m in [(4, 3), (5, 3), (4, 6), (7, 2)]:
        x, y, w = rand(n, m), rand(m, n), rand(m)
        torch.testing.assert_close(compiled(x, y, w), f(x, y, w))


def test_associative_scan_pointwise_mode_is_one_graph():
    """combine_mode="pointwise" (transformers' choice on CUDA) calls torch's associative_scan higher-order op with
    the combine function as an argument: ember inlines the op's dense kernel, one graph, the values as eager's."""
    from torch._higher_order_ops.associative_scan import associative_scan   # (the test's own use of torch)

    def scan(a, b):
        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]
        return associative_scan(combine, (a.exp(), b), dim=1, combine_mode="pointwise")[1] + 1
    r = check(scan, rand(2, 7, 3).to(SCAN_DEVICE), rand(2, 7, 3).to(SCAN_DEVICE))
    assert BASELINE or r.graphs == 1


def _ssm_combine(left, right):   # Mamba's recurrence state = a * state + b, as an associative operator
    return left[0] * right[0], right[0] * left[1] + right[1]


@pytest.mark.parametrize("mode", ["pointwise", "generic"])
def test_associative_scan_is_inlined_and_differentiated_like_its_recurrence(mode):
    # combine_mode="pointwise" is a higher-order op call with the combine function as an argument: ember inlines the
    # op's dense kernel (torch's generic scan over torch ops) and differentiates its ops; eager torch's own
    # gradient of the pointwise mode is wrong, so the reference is the recurrence the scan computes
    from torch._higher_order_ops.associative_scan import associative_scan

    def scanned(a, b):
        _, states = associative_scan(_ssm_combine, (a.exp(), b), dim=2, combine_mode=mode)
        return (states * states).sum()

    def recurrence(a, b):
        state, states = torch.zeros_like(b[:, :, 0]), []
        for i in range(a.shape[2]):
            state = a[:, :, i].exp() * state + b[:, :, i]
            states.append(state)
        return (torch.stack(states, 2) ** 2).sum()

    reset()
    a = (-torch.rand(2, 3, 8, 4, device=SCAN_DEVICE)).requires_grad_()
    b = torch.randn(2, 3, 8, 4, device=SCAN_DEVICE, requires_grad=True)
    ex = ember.explain(scanned)(a, b)
    assert ex.graph_count == 1 and not ex.break_reasons
    got = ember.compile(scanned)(a, b)
    want = recurrence(a, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got, (a, b)), torch.autograd.grad(want, (a, b))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
