"""Library kernels that check their arguments' layouts get layouts they take (ember.codegen.layout
ALIGNED_ARGUMENTS): the fused CUDA attention's bias with rows 16 bytes apart, a bias broadcast over the batch stored
once. The decision is checked on the CPU on a traced graph (meta tensors); on CUDA, attention with a
relative-position bias of odd size (197 tokens: a 14x14 ViT and its class token) compiled and equal to eager."""
import pytest
import torch
import torch.nn.functional as F

from ember.codegen import layout, lower
from ember.ir import ExternBuffer
from tests.codegen.aten_trace import trace_aten

aten = torch.ops.aten
CUDA = torch.cuda.is_available()


def test_aligned_strides_pad_rows_to_16_bytes_and_keep_broadcast_dims():
    assert layout.aligned_strides((2, 4, 197, 197), torch.float32) == (4 * 197 * 200, 197 * 200, 200, 1)
    assert layout.aligned_strides((2, 4, 1, 17), torch.bfloat16) == (4 * 24, 24, 24, 1)
    assert layout.aligned_strides((2, 4, 65, 65), torch.float32, broadcast={0}) == (0, 65 * 68, 68, 1)
    assert layout.is_aligned((2, 4, 65, 65), (0, 65 * 68, 68, 1), 0, torch.float32)
    assert not layout.is_aligned((2, 4, 197, 197), (4 * 197 * 197, 197 * 197, 197, 1), 0, torch.float32)
    assert not layout.is_aligned((2, 4, 8, 8), (256, 64, 1, 8), 0, torch.float32)   # last dim not dense
    assert layout.is_aligned((2, 4, 1, 8), (32, 8, 3, 1), 0, torch.float32)         # a size-1 dim takes no step


def _attention_args(n: int, table_dtype=torch.float32):
    b, h, d = 2, 4, 8
    return [torch.empty(b, h, n, d, device="meta") for _ in range(3)] + [torch.empty(n, n, h, device="meta",
                                                                                    dtype=table_dtype)]


def _extern_args(gm, target):
    low, _, _ = lower.lower(gm, [], target="gpu")
    call = next(b for b in low.buffers if isinstance(b, ExternBuffer) and b.target is target)
    return call.args, {b.name: b for b in low.buffers}


@pytest.mark.parametrize("n", [65, 197])
def test_relative_position_bias_of_odd_size_reaches_the_kernel_padded_and_stored_once(n):
    """A [N, N, H] table permuted into a [1, H, N, N] bias and broadcast over the batch: the kernel gets rows of
    N rounded up to 4 float32s, the batch at stride 0 (the bias stored once, not per batch element); query, key
    and value already suit it and are passed as they are, with no copy."""
    op = aten._scaled_dot_product_efficient_attention.default

    def f(q, k, v, table):
        bias = (table * 2).permute(2, 0, 1).unsqueeze(0).expand(2, 4, n, n)
        return op(q, k, v, bias, False)[0]
    gm, _ = trace_aten(f, _attention_args(n))
    args, bufs = _extern_args(gm, op)
    bias = args[3]
    padded = -(-n // 4) * 4
    assert bias.size == (2, 4, n, n) and bias.stride == (0, n * padded, padded, 1), bias
    assert tuple(bufs[bias.buffer].size) == (1, 4, n, n)
    assert [a.buffer for a in args[:3]] == ["arg0", "arg1", "arg2"]
    assert all(layout.is_aligned(a.size, a.stride, a.offset, torch.float32) for a in args[:4])


def test_an_aligned_bias_is_passed_as_it_is():
    """A bias whose rows are already 16 bytes apart (64 keys) is handed over without a copy."""
    op = aten._scaled_dot_product_efficient_attention.default
    gm, _ = trace_aten(lambda q, k, v, bias: op(q, k, v, bias, False)[0],
                       [torch.empty(2, 4, 64, 8, device="meta") for _ in range(3)] +
                       [torch.empty(2, 4, 64, 64, device="meta")])
    args, _ = _extern_args(gm, op)
    assert args[3].buffer == "arg3" and args[3].stride == (4 * 64 * 64, 64 * 64, 64, 1)


class RelativePositionAttention(torch.nn.Module):
    """Attention with a learned relative-position bias as vision transformers build it (BEiT, Swin): a table
    indexed by the pairwise offset of the tokens, the class token at index 0, broadcast over the batch."""

    def __init__(self, grid: int, heads: int = 4, dim: int = 32):
        super().__init__()
        self.heads, self.n = heads, grid * grid + 1
        coords = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (grid - 1)
        index = torch.zeros(self.n, self.n, dtype=torch.long)
        index[1:, 1:] = rel[..., 0] * (2 * grid - 1) + rel[..., 1]
        index[0, :], index[:, 0], index[0, 0] = (2 * grid - 1) ** 2, (2 * grid - 1) ** 2 + 1, (2 * grid - 1) ** 2 + 2
        self.register_buffer("index", index)
        self.table = torch.nn.Parameter(torch.randn((2 * grid - 1) ** 2 + 3, heads))
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


@pytest.mark.skipif(not CUDA, reason="the fused attention kernels that check the bias layout run on CUDA only")
@pytest.mark.parametrize("grid,train", [(14, False), (14, True), (8, True)])
def test_relative_position_bias_attention_matches_eager_on_cuda(grid, train):
    import ember
    from ember.backends import triton_backend
    torch.manual_seed(0)
    model = RelativePositionAttention(grid).cuda().train(train)
    compiled = ember.compile(model)
    before = triton_backend.STATS["eager_graphs"]
    for _ in range(2):
        x = torch.randn(2, grid * grid + 1, 32, device="cuda", requires_grad=train)
        xe = x.detach().clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            got, want = compiled(x), model(xe)
        torch.testing.assert_close(got, want)
        if train:
            got.square().sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            want.square().sum().backward()
            torch.testing.assert_close(x.grad, xe.grad)
            for g, p in zip(grads, model.parameters()):
                torch.testing.assert_close(g, p.grad)
            model.zero_grad()
    assert triton_backend.STATS["eager_graphs"] == before


@pytest.mark.skipif(not CUDA, reason="the fused attention kernels that check the bias layout run on CUDA only")
@pytest.mark.parametrize("keys", [17, 30])
def test_one_query_against_an_odd_number_of_keys_with_a_float_mask_matches_eager_on_cuda(keys):
    """A decoding step (GPT-2 with a cache: one query, `keys` keys) with an additive mask per batch element: the
    bias [B, H, 1, keys] with keys not a multiple of 4 ("attn_bias.stride(1) = 17")."""
    import ember
    torch.manual_seed(0)

    def step(q, k, v, mask):
        bias = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None, :].expand(-1, 4, 1, -1)) * 2
    compiled = ember.compile(step)
    for _ in range(2):
        q = torch.randn(2, 4, 1, 16, device="cuda")
        k, v = torch.randn(2, 4, keys, 16, device="cuda"), torch.randn(2, 4, keys, 16, device="cuda")
        mask = torch.rand(2, keys, device="cuda") > 0.3
        mask[:, 0] = True
        torch.testing.assert_close(compiled(q, k, v, mask), step(q, k, v, mask))


def test_a_symbolic_bias_is_padded_at_every_size():
    """A bias over a symbolic number of keys (a growing KV cache: 17 keys at the example) is stored with its rows
    padded to ((n + 3) // 4) * 4 float32s, a multiple of 16 bytes at every n, not sent to the ATen graph."""
    from ember.ir import FloorDiv, symbols
    from tests.codegen.symbolic_graphs import symbolic_graph
    op = aten._scaled_dot_product_efficient_attention.default

    def f(s0, q, k, v, mask):
        return op(q, k, v, aten.mul.Tensor(mask, 2.0), False)[0]
    n = 17
    gm, _ = symbolic_graph(f, [n, torch.randn(2, 4, 1, 8), torch.randn(2, 4, n, 8), torch.randn(2, 4, n, 8),
                               torch.randn(2, 4, 1, n)], dynamic={2: [2], 3: [2], 4: [3]})
    with lower.LOWERING_LOCK:
        try:
            args, _ = _extern_args(gm, op)
        finally:
            symbols.HINTS.clear()
    bias = args[3]
    row = bias.stride[2]
    assert row.has(FloorDiv) and all(int(row.subs(bias.size[3].free_symbols.pop(), m)) == -(-m // 4) * 4
                                     for m in (2, 17, 64, 1001)), bias
    assert layout.is_aligned(bias.size, bias.stride, bias.offset, torch.float32)


def test_cudnn_attention_lowers_with_its_int_results_as_constants():
    """cuDNN attention (eager's choice for bfloat16 on Hopper) also returns max_q and max_k, plain ints in a graph of
    guarded sizes: the call stays a library call, an int read from it is a constant of the compiled graph."""
    op = aten._scaled_dot_product_cudnn_attention.default

    def f(q, k, v):
        r = op(q, k, v, None, False, 0.0, False, False)
        return r[0] * 2, r[4]
    gm, _ = trace_aten(f, [torch.empty(2, 4, 64, 32, device="meta", dtype=torch.bfloat16) for _ in range(3)])
    low, _, _ = lower.lower(gm, [], target="gpu")
    assert any(isinstance(b, ExternBuffer) and b.target is op for b in low.buffers)
    assert low.outputs[1] == 64


@pytest.mark.skipif(not CUDA, reason="cuDNN attention runs on CUDA only")
def test_bfloat16_attention_on_cuda_compiles_and_matches_eager():
    import ember
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v).relu() * 2
    from ember.backends import triton_backend
    before = triton_backend.STATS["eager_graphs"]
    torch.testing.assert_close(ember.compile(f)(q, k, v), f(q, k, v))
    assert triton_backend.STATS["eager_graphs"] == before
