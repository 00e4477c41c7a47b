"""The host-side bookkeeping of ember.runtime.cudagraphs that needs no GPU."""
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
