"""Tensor programs: torch.* functions, methods, operators, in-place ops, indexing, nn.functional, attributes,
creation and random ops.  Each row is one program compared with eager (see harness.check); ops is the op
count of its single graph, as torch.compile captures it too (EMBER_TEST_BASELINE=torch)."""
import operator

import pytest
import torch
import torch.nn.functional as F

from tests.frontend.harness import case, check, rand, run_case


# --- torch.* functions
def t_sin_cos(x, y): return torch.sin(x) + torch.cos(y)
def t_matmul(x, y): return torch.matmul(x, y.t())
def t_cat_stack(x, y): return torch.cat([x, y], dim=0), torch.stack((x, y), dim=1)
def t_reductions(x): return torch.sum(x), torch.mean(x, dim=1), torch.amax(x, dim=0, keepdim=True)
def t_where(x, y): return torch.where(x > 0, x, y)
def t_clamp_exp(x): return torch.clamp(torch.exp(x), min=0.5, max=2.0)
def t_softmax_log(x): return torch.log_softmax(x, dim=-1), torch.softmax(x, -1)
def t_einsum(x, y): return torch.einsum("ij,kj->ik", x, y)
def t_split_chunk(x): a, b = torch.split(x, 2, dim=1); c, d = torch.chunk(x, 2); return a * b, c + d  # split, chunk, 4 getitems, mul, add
def t_bmm(x, y): return torch.bmm(x, y)
def t_max_with_indices(x): v, i = torch.max(x, dim=1); return v, i
def t_sort_topk(x): return torch.sort(x, dim=-1).values, torch.topk(x, 2).indices
def t_cumsum_flip(x): return torch.flip(torch.cumsum(x, dim=0), dims=[1])
def t_int_ops(x): return torch.bitwise_and(x, 3), x // 2, x % 3
def t_bool_ops(x, y): return torch.logical_and(x > 0, y > 0) | (x < -1)
def t_dtype_promotion(x, y): return x + y  # float32 + float64
def t_scalar_tensor_mix(x): return 2 * x - 1.5 + x / 3
def t_comparison_chain(x): return (x > 0) & (x < 1)
def t_outer_dot(x, y): return torch.outer(x, y), torch.dot(x, y)
def t_norm(x): return torch.linalg.vector_norm(x, dim=1)


# --- Tensor methods and operators
def m_view_reshape(x): return x.view(4, 3).reshape(2, 6).permute(1, 0).contiguous()
def m_unsqueeze_expand(x): return x.unsqueeze(0).expand(2, 3, 4).sum(0)
def m_transpose_matmul(x): return x @ x.transpose(0, 1)
def m_pow_neg_abs(x): return (-x).abs() ** 2
def m_type_conversions(x): return x.to(torch.float64), x.double().half().float(), x.int()
def m_chain(x): return x.relu().sigmoid().tanh().mean(dim=0)
def m_masked_fill(x): return x.masked_fill(x < 0, 0.0)
def m_sum_keepdim(x): return x.sum(dim=-1, keepdim=True) / x.shape[-1]
def m_flatten_squeeze(x): return x.flatten(), x.unsqueeze(1).squeeze(1)
def m_argmax_gather(x): idx = x.argmax(dim=1, keepdim=True); return x.gather(1, idx)
def m_clone_detach(x): return x.clone().detach() * 2
def m_new_ops(x): return x.new_zeros(2, 2), x.new_ones(3) * 2, x.new_full((2,), 7.0)
def m_rsub_rdiv(x): return 1 - x, 2 / (x.abs() + 1), 3 ** x.clamp(-1, 1)
def m_floordiv_mod(x): return x // 0.5, x % 0.7
def m_unary_ops(x): return ~(x > 0), -x, +x, abs(x)
def m_matmul_vec(x, v): return x @ v
def m_type_as(x, y): return x.type_as(y) + y
def m_identity_arith_promotes(i, b): return i + 0.0, b + 0, i * 1, b * 1.0, i - 0  # new tensors, promoted dtypes


# --- in-place ops (on intermediates and on inputs: the caller sees the latter)
def i_add_mul(x): y = x.clone(); y.add_(1); y.mul_(2); return y
def i_on_input(x): x.add_(1); return x * 2
def i_on_input_no_return(x): x.mul_(3).sub_(1)
def i_iadd_operator(x): y = x * 1; y += 2; y *= x; return y
def i_relu_(x): y = x + 0; torch.relu_(y); return y
def i_zero_fill(x): y = x.clone(); y.zero_(); y.fill_(3.0); return y + x
def i_inplace_view(x): x[0].add_(10); return x.sum()
def i_clamp_(x): x.clamp_(min=-0.5, max=0.5); return x
def i_copy_(x, y): x.copy_(y); return x + 1
def i_out_of_two(x, y): x.add_(y); y.mul_(x); return x - y


# --- indexing and __setitem__
def ix_basic(x): return x[0], x[:, 1], x[1:3, ::2], x[..., -1], x[None, 0]
def ix_tensor_index(x, i): return x[i]
def ix_bool_mask_assign(x): y = x.clone(); y[y > 0] = 0.0; return y
def ix_setitem_slice(x): x[:, 0] = 1.0; return x
def ix_setitem_tensor(x, v): x[1] = v; return x
def ix_index_select(x): return x.index_select(0, torch.tensor([2, 0]))
def ix_negative_step_via_flip(x): return x.flip(0)[1:]
def ix_int_from_shape(x): return x[x.shape[0] - 1]
def ix_setitem_scalar_on_clone(x): y = x.clone(); y[0, 0] = 5; y[-1] += 1; return y


# --- nn.functional
def nf_linear(x, w, b): return F.linear(x, w, b)
def nf_activations(x): return F.relu(x), F.gelu(x), F.silu(x), F.leaky_relu(x, 0.1), F.elu(x)
def nf_softmax_ce(x, t): return F.cross_entropy(x, t)
def nf_mse(x, y): return F.mse_loss(x, y), F.l1_loss(x, y, reduction="sum")
def nf_conv(x, w): return F.conv2d(x, w, padding=1)
def nf_pool(x): return F.max_pool2d(x, 2), F.avg_pool2d(x, 2), F.adaptive_avg_pool2d(x, 1)
def nf_layer_norm(x): return F.layer_norm(x, (4,))
def nf_pad_normalize(x): return F.normalize(F.pad(x, (1, 1)), dim=-1)
def nf_dropout_eval(x): return F.dropout(x, p=0.5, training=False)
def nf_one_hot(t): return F.one_hot(t, 5)
def nf_sdpa(q, k, v): return F.scaled_dot_product_attention(q, k, v)
def nf_embedding(i, w): return F.embedding(i, w)


# --- attributes used by Python (read at capture time, become guards, no ops of their own)
def a_shape_math(x): return x.reshape(x.shape[0] * x.shape[1]) + x.size(1)
def a_ndim_branch(x): return x.sum(0) if x.ndim == 2 else x.sum()
def a_dtype_branch(x): return x * 2 if x.dtype == torch.float32 else x * 3
def a_device(x): return torch.ones(4, device=x.device) + x[:2]
def a_requires_grad(x): return x + 1 if x.requires_grad else x - 1
def a_numel_len(x): return x * (x.numel() + len(x))
def a_is_floating(x): return x.float() * 2 if not x.is_floating_point() else x
def a_shape_tuple_out(x): return x.shape, x.dtype, x.ndim, x + 0


# --- creation ops
def c_zeros_ones(x): return torch.zeros(3, 4) + torch.ones(3, 4, dtype=torch.float64) + x
def c_arange(x): return torch.arange(12).reshape(3, 4) * x
def c_arange_float(x): return torch.arange(0.0, 1.0, 0.25) + x
def c_tensor_literal(x): return x + torch.tensor([1.0, 2.0, 3.0, 4.0])
def c_like(x): return torch.zeros_like(x), torch.ones_like(x) * 2, torch.full_like(x, 7.0), torch.empty_like(x).fill_(2.0)
def c_full_eye_linspace(x): return torch.full((4,), 2.5) * x, torch.eye(3) @ x, torch.linspace(0, 1, 4) + x
def c_from_shape(x): return torch.zeros(x.shape[0], 2, dtype=x.dtype)


# --- random ops: equal to eager under the same seed (harness seeds before each call)
def r_rand_randn(x): return torch.rand(4) + x, torch.randn(2, 3)
def r_like(x): return torch.rand_like(x), torch.randn_like(x) * x
def r_randint_perm(x): return torch.randint(0, 10, (4,)) + x, torch.randperm(5)
def r_dropout_train(x): return F.dropout(x, p=0.5, training=True)
def r_bernoulli_normal(x): return torch.bernoulli(x.sigmoid()), x.clone().normal_()
def r_multinomial(x): return torch.multinomial(x.softmax(-1), 2)


X = lambda: (rand(3, 4),)
XY = lambda: (rand(3, 4), rand(3, 4))

CASES = [
    case(t_sin_cos, XY, 3), case(t_matmul, XY, 2), case(t_cat_stack, XY, 2), case(t_reductions, X, 3),
    case(t_where, XY, 2), case(t_clamp_exp, X, 2), case(t_softmax_log, X, 2), case(t_einsum, XY, 1),
    case(t_split_chunk, lambda: (rand(4, 4),), 8), case(t_bmm, lambda: (rand(2, 3, 4), rand(2, 4, 5)), 1),
    case(t_max_with_indices, X, 3),  # max(dim) returns a pair: one op and a getitem node per element
    case(t_sort_topk, X, None),  # .values/.indices are attribute reads: counted as getattr ops by some capturers
    case(t_cumsum_flip, X, 2), case(t_int_ops, lambda: (rand(3, 4, dtype=torch.int64),), 3),
    case(t_bool_ops, XY, 5), case(t_dtype_promotion, lambda: (rand(3), rand(3, dtype=torch.float64)), 1),
    case(t_scalar_tensor_mix, X, 4), case(t_comparison_chain, X, 3),
    case(t_outer_dot, lambda: (rand(3), rand(3)), 2), case(t_norm, X, 1),
    case(m_view_reshape, X, 4), case(m_unsqueeze_expand, X, 3), case(m_transpose_matmul, X, 2),
    case(m_pow_neg_abs, X, 3), case(m_type_conversions, X, 5), case(m_chain, X, 4), case(m_masked_fill, X, 2),
    case(m_sum_keepdim, X, 2), case(m_flatten_squeeze, X, 3), case(m_argmax_gather, X, 2),
    case(m_clone_detach, X, 3), case(m_new_ops, X, 4), case(m_rsub_rdiv, X, 6), case(m_floordiv_mod, X, 2),
    case(m_unary_ops, X, 5), case(m_matmul_vec, lambda: (rand(3, 4), rand(4)), 1),
    case(m_type_as, lambda: (rand(3, dtype=torch.float64), rand(3)), 2),
    case(m_identity_arith_promotes, lambda: (rand(3, dtype=torch.int64), rand(3, dtype=torch.bool)), 5),
    case(i_add_mul, X, 3), case(i_on_input, X, 2), case(i_on_input_no_return, X, 2), case(i_iadd_operator, X, 3),
    case(i_relu_, X, 2), case(i_zero_fill, X, 4), case(i_inplace_view, X, 3), case(i_clamp_, X, 1),
    case(i_copy_, XY, 2), case(i_out_of_two, XY, 3),
    case(ix_basic, X, 5), case(ix_tensor_index, lambda: (rand(5, 2), torch.tensor([4, 0, 0])), 1),
    case(ix_bool_mask_assign, X, 3), case(ix_setitem_slice, X, 1), case(ix_setitem_tensor, lambda: (rand(3, 4), rand(4)), 1),
    case(ix_index_select, X, 2), case(ix_negative_step_via_flip, X, 2), case(ix_int_from_shape, X, 1),
    case(ix_setitem_scalar_on_clone, X, 5),
    case(nf_linear, lambda: (rand(2, 4), rand(3, 4), rand(3)), 1), case(nf_activations, X, 5),
    case(nf_softmax_ce, lambda: (rand(4, 5), torch.tensor([0, 4, 2, 1])), 1), case(nf_mse, XY, 2),
    case(nf_conv, lambda: (rand(1, 2, 5, 5), rand(3, 2, 3, 3)), 1), case(nf_pool, lambda: (rand(1, 2, 4, 4),), 3),
    case(nf_layer_norm, X, 1), case(nf_pad_normalize, X, 2), case(nf_dropout_eval, X, 1),
    case(nf_one_hot, lambda: (torch.tensor([0, 3, 4]),), 1),
    case(nf_sdpa, lambda: (rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4)), 1),
    case(nf_embedding, lambda: (torch.tensor([[0, 2], [1, 1]]), rand(3, 4)), 1),
    case(a_shape_math, X, 2), case(a_ndim_branch, X, 1), case(a_dtype_branch, X, 1),
    case(a_device, X, 3), case(a_requires_grad, X, 1), case(a_numel_len, X, 1), case(a_is_floating, X, 0, graphs=0),
    case(a_shape_tuple_out, X, 1),
    case(c_zeros_ones, X, 4), case(c_arange, X, 3), case(c_arange_float, X, 2), case(c_tensor_literal, X, 2),
    case(c_like, X, 6), case(c_full_eye_linspace, X, 6), case(c_from_shape, X, 1),
    case(r_rand_randn, X, 3), case(r_like, X, 3), case(r_randint_perm, X, 3), case(r_dropout_train, X, 1),
    case(r_bernoulli_normal, X, 4), case(r_multinomial, X, 2),
]


@pytest.mark.parametrize("fn,args,ops,graphs", CASES)
def test_tensor_program(fn, args, ops, graphs):
    run_case(fn, args, ops, graphs)


def test_requires_grad_input_output_keeps_grad_fn():
    """A graph on inputs that require grad gives outputs that require grad, and backward works through them."""
    def f(x, w):
        return (x @ w).tanh().sum()
    r = check(f, rand(2, 3, requires_grad=True), rand(3, 3, requires_grad=True))
    assert r.graphs == 1 and r.ops == [3]
    x, w = rand(2, 3, requires_grad=True), rand(3, 3, requires_grad=True)
    from tests.frontend.harness import compile, Recorder
    cf = compile(f, Recorder())
    cf(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_operator_module_functions():
    def f(x, y):
        return operator.add(x, y), operator.mul(x, 2), operator.neg(y), operator.getitem(x, 0)
    r = check(f, rand(3, 4), rand(3, 4))
    assert r.graphs == 1 and r.ops == [4]


def test_inplace_on_input_alias_seen_by_caller():
    """x and a view of x passed together: the in-place op through the view reaches both."""
    def f(x, v):
        v.mul_(2)
        return x.sum()
    base = rand(4)
    x_eager, x_comp = base.clone(), base.clone()
    from tests.frontend.harness import compile, Recorder
    rec = Recorder()
    cf = compile(f, rec)
    torch.testing.assert_close(cf(x_comp, x_comp[1:3]), f(x_eager, x_eager[1:3]))
    torch.testing.assert_close(x_comp, x_eager)
    assert rec.graphs == 1


def test_arith_with_identity_returns_a_new_tensor():
    """x + 0 is a new tensor in eager: the compiled result must not alias the input."""
    from tests.frontend.harness import compile, Recorder
    x = rand(3)
    out = compile(lambda t: t + 0, Recorder())(x)
    assert out is not x
    out.add_(1)
    assert not torch.equal(out, x)


def test_is_holds_where_an_op_returns_its_input_itself():
    """`x.to(x.dtype) is x` is True in eager (to, contiguous and the dtype casts return the tensor itself when
    nothing changes), and `x + 0 is x` False; torch.compile answers the same."""
    def f(x, w):
        y = x.to(x.dtype)
        same = (y is x, x.to(torch.float32) is x, x.contiguous() is x, x.float() is x, x.double() is x,
                (x + 0) is x, w.t().contiguous() is w.t(), y.sin() is y)
        return y.sin(), same
    r = check(f, rand(3, 2), rand(3, 2))
    assert r.graphs == 1, r.describe()


def test_a_torch_op_on_python_numbers_sizes_a_view_without_a_break():
    """torch.div on ints is a 0-d tensor in eager (Longformer's chunk count), read as an index where it sizes a view
    or a new tensor: recorded like a factory, its fake holds the value. One graph, as torch.compile."""
    def f(x):
        chunks = torch.div(x.size(1), 2, rounding_mode="trunc")
        count = torch.div(x.size(1), 4, rounding_mode="trunc") - 1
        y = x.view(x.size(0), chunks, 2)
        return y.sin(), y.new_zeros((2, count + 1, 3)), count, torch.add(2, 3.5)
    r = check(f, rand(3, 8))
    assert r.graphs == 1 and r.ops == [8], r.describe()
