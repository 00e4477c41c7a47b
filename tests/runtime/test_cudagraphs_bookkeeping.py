"""The host-side bookkeeping of ember.runtime.cudagraphs (no GPU needed), and on a GPU its one-launch copy."""
import pytest
import torch


def test_fresh_outputs_share_one_aligned_allocation_per_dtype():
    """The clones of a replay's outputs: contiguous ones are 64-byte aligned views of one allocation per dtype
    and device, others (a transposed output) their own; shapes, strides and dtypes as the sources'."""
    from ember.runtime.cudagraphs import FreshLike
    torch.manual_seed(0)
    src = [torch.randn(3, 5), torch.randn(7), torch.randn(4, 4).t(), torch.randn(2, dtype=torch.float64),
           torch.randn(0), torch.randn(9)]
    fresh = FreshLike(src)
    out = fresh.copies()
    assert fresh.copies()[0].data_ptr() != out[0].data_ptr()   # new memory on each call
    for s, o in zip(src, out):
        assert (o.shape, o.stride(), o.dtype) == (s.shape, s.stride(), s.dtype)
        assert o.data_ptr() % 64 == 0
        torch.testing.assert_close(o, s)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr() == \
        out[5].untyped_storage().data_ptr()
    assert out[2].untyped_storage().data_ptr() != out[0].untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-launch copy is a Triton kernel for NVIDIA GPUs; "
                                                          "none is visible here")
def test_fresh_outputs_on_cuda_are_copied_in_one_launch():
    """On CUDA the sources of a group are copied by gather_copy's one launch (blocks of many sizes: under one
    block, several blocks with a partial last one, one element); the values are the sources' at each call."""
    from ember.runtime.cudagraphs import FreshLike
    sizes = [(128,), (32, 128, 3, 3), (1000, 1024), (), (5, 7), (3000,)]
    src = [torch.randn(s, device="cuda") for s in sizes] + [torch.randint(0, 9, (1500,), device="cuda"),
                                                           torch.randint(0, 9, (3,), device="cuda")]
    fresh = FreshLike(src)
    assert all(g[-1] is not None for g in fresh.groups)
    for _ in range(2):
        for s in src:   # new values in the same (graph) memory
            s.copy_(torch.randn(s.shape, device="cuda") if s.is_floating_point() else torch.randint_like(s, 0, 9))
        out = fresh.copies()
        for s, o in zip(src, out):
            assert (o.shape, o.stride(), o.dtype) == (s.shape, s.stride(), s.dtype)
            assert o.data_ptr() != s.data_ptr()
            torch.testing.assert_close(o, s, rtol=0, atol=0)
