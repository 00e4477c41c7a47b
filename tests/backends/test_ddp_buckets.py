"""ember.backends.ddp_buckets on one process: where graphs captured under DDP are cut, and that the pieces compute
what the graph computes (forward and gradients). tests/frontend/test_distributed.py trains under DDP itself."""
import torch
import torch.nn as nn

import ember
from ember.backends import ddp_buckets, lookup_backend


class Chain(nn.Module):
    def __init__(self, inplace_at: int | None = None):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])
        self.inplace_at = inplace_at

    def forward(self, x):
        y = None
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if y is not None:      # an activation of the layer before, written in place after this layer
                y.mul_(3)
                x, y = x + y, None
            if i == self.inplace_at:
                y = x * 2
        return x.sum()


def captured(model, x):
    """The torch-level graph ember captures for model(x), and its example inputs."""
    got = []

    def record(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm.forward
    ember.compile(model, backend=record)(x)
    (gm, example_inputs), = got
    return gm, example_inputs


def pieces_of(model, x, cap):
    gm, ex = captured(model, x)
    params = {id(p) for p in model.parameters()}
    return gm, ex, ddp_buckets.piece_of_nodes(gm, ex, params, cap, cap)


def test_pieces_hold_about_one_bucket_and_compute_the_graph():
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(4, 32)
    layer_bytes = 33 * 32 * 4
    gm, ex, pieces = pieces_of(model, x, 2 * layer_bytes)
    assert sorted(set(pieces.values())) == [0, 1, 2], pieces   # 6 layers, 2 per bucket
    order = [pieces[n] for n in gm.graph.nodes if n in pieces]
    assert order == sorted(order)                              # pieces follow the graph's order
    compiled = ddp_buckets.compile_pieces(gm, ex, pieces, lookup_backend("aot_eager"))
    expected, got = gm(*ex), compiled(*ex)
    torch.testing.assert_close(got, expected)
    params = [t for t in ex if isinstance(t, nn.Parameter)]
    torch.testing.assert_close(torch.autograd.grad(got[0], params), torch.autograd.grad(expected[0], params))


def test_no_cut_between_a_value_and_its_in_place_write():
    torch.manual_seed(0)
    model, x = Chain(inplace_at=2), torch.randn(4, 32)
    gm, ex, pieces = pieces_of(model, x, 33 * 32 * 4)
    nodes = [n for n in gm.graph.nodes if n in pieces]
    write = next(n for n in nodes if n.target == "mul_")
    written = write.args[0]
    assert pieces[written] == pieces[write]   # y and y.mul_(3) in one piece, though a layer lies between them
    assert len(set(pieces.values())) >= 3     # the other layers still cut
    compiled = ddp_buckets.compile_pieces(gm, ex, pieces, lookup_backend("aot_eager"))
    torch.testing.assert_close(compiled(*ex), gm(*ex))


def test_a_graph_with_one_bucket_stays_whole():
    model, x = Chain(), torch.randn(4, 32)
    assert pieces_of(model, x, 10 * 2**20)[2] is None
