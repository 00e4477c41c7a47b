"""The host-side bookkeeping of ember.runtime.cudagraphs that needs no GPU."""
import torch

from ember.runtime.cudagraphs import _saved_start


def test_saved_start_finds_where_the_backward_inputs_begin():
    outs = [torch.randn(3), torch.randn(2, 2), torch.randn(4), torch.randn(5)]
    sig = [(o.data_ptr(), o.shape) for o in outs]
    tangent = torch.randn(3)
    assert _saved_start(sig, [outs[2], outs[3], tangent]) == 2          # 2 user outputs, 2 saved
    assert _saved_start(sig, [tangent]) is None                         # nothing lines up: stay cloning
    assert _saved_start(sig, [outs[3]]) == 3
    assert _saved_start(sig, [outs[2], tangent]) is None                # a partial match is no match
