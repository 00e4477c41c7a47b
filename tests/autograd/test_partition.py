"""The partitioner's choice: cheap ops recomputed, random ops and matmuls never, bytes saved at most eager's."""
import copy

import pytest
import torch
import torch.fx

from ember.autograd import aot_eager


def saved_storage_bytes(call) -> int:
    """Bytes of the distinct storages autograd packs for backward during call()."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    del out
    return sum(seen.values())


def only_artifact(fn):
    (art,) = [a for a in fn.artifacts.values() if a is not None and a.training]
    return art


def test_pointwise_chain_is_recomputed_not_saved():
    def f(x, w):
        return (x @ w).sin().cos().exp().sum()
    x, w = torch.randn(64, 32), torch.randn(32, 128, requires_grad=True)
    fn = aot_eager(torch.fx.symbolic_trace(f), [x, w])
    art = only_artifact(fn)
    fw_outs = art.part.forward.graph.output_node().args[0]
    saved_ops = {n.target for n in fw_outs[art.part.num_forward_outputs:]}
    aten = torch.ops.aten
    assert aten.mm.default in saved_ops
    assert not {aten.sin.default, aten.cos.default, aten.exp.default} & saved_ops
    bw_ops = [n.target for n in art.part.backward.graph.nodes]
    assert bw_ops.count(aten.mm.default) == 1          # the grad of w; the forward matmul is not redone
    assert {"sin_default", "cos_default"} <= set(art.part.recomputed)
    ours = saved_storage_bytes(lambda: fn(x, w))
    eager = saved_storage_bytes(lambda: f(x, w))
    assert ours < eager
    g1 = torch.autograd.grad(fn(x, w), w)
    g2 = torch.autograd.grad(f(x, w), w)
    torch.testing.assert_close(g1, g2)


def _assert_log_softmax_recomputed(part):
    """The forward computes the log_softmax's row statistics and saves them, not its output; the backward
    recomputes the output (two subtractions) from the logits and the statistics."""
    aten = torch.ops.aten
    fw = {n.name: n for n in part.forward.graph.nodes}
    assert not any(n.target is aten._log_softmax.default for n in fw.values())
    saved_ops = {fw[name].target for name in part.saved if name in fw}
    assert aten.amax.default in saved_ops and aten.sub.Tensor not in saved_ops, part.saved
    assert sum(fw[name].target is aten.sub.Tensor for name in part.recomputed) == 2, part.recomputed


def test_log_softmax_of_returned_logits_is_recomputed_from_row_statistics():
    """A language model's loss: the logits are returned, so the forward saves them and the two row statistics
    (max, log of the exp sum) and the backward recomputes the log_softmax pointwise, instead of the forward
    saving a second logits-sized tensor. Values and gradients as eager's."""
    def f(h, w, target):
        logits = h @ w
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
        return loss, logits
    h, w = torch.randn(4, 6, 16, requires_grad=True), torch.randn(16, 50, requires_grad=True)
    target = torch.randint(0, 50, (4, 6))
    fn = aot_eager(torch.fx.symbolic_trace(f), [h, w, target])
    loss, logits = fn(h, w, target)
    loss.backward()
    _assert_log_softmax_recomputed(only_artifact(fn).part)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref, ref_logits = f(h2, w2, target)
    ref.backward()
    torch.testing.assert_close((loss, logits, h.grad, w.grad), (ref, ref_logits, h2.grad, w2.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_log_softmax_of_an_input_is_recomputed_from_row_statistics(dtype):
    """The loss in a graph of its own (after a graph break): the logits are an input, alive anyway; rows with
    ignored targets and large logits (the max shift matters). 16-bit logits: the parts are computed in float32
    and the output rounded once, as eager's kernel does (the statistics saved in float32)."""
    def f(logits, target):
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
    logits = (torch.randn(4, 6, 50, dtype=dtype) * 30).requires_grad_()
    target = torch.randint(0, 50, (4, 6))
    target[0, :2] = -100
    fn = aot_eager(torch.fx.symbolic_trace(f), [logits, target])
    loss = fn(logits, target)
    loss.backward()
    part = only_artifact(fn).part
    _assert_log_softmax_recomputed(part)
    amax = [n for n in part.forward.graph.nodes if n.target is torch.ops.aten.amax.default]
    assert [n.meta["val"].dtype for n in amax] == [torch.float64 if dtype == torch.float64 else torch.float32]
    ref_in = logits.detach().clone().requires_grad_()
    ref = f(ref_in, target)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    # 16-bit: a log-probability rounded the other way (float32 parts summed in another order than eager's kernel)
    # moves its row's gradient (p - [target]) / N by up to one rounding of p, over the N = 22 counted targets
    tol = {} if dtype in (torch.float32, torch.float64) else {"atol": torch.finfo(dtype).eps / 22, "rtol": 0}
    torch.testing.assert_close(logits.grad, ref_in.grad, **tol)


def test_dropout_mask_saved_and_same_as_eager():
    def f(x, w):
        return torch.nn.functional.dropout((x @ w).relu(), 0.5, True).tanh().sum()
    x, w = torch.randn(16, 8), torch.randn(8, 8, requires_grad=True)
    fn = aot_eager(torch.fx.symbolic_trace(f), [x, w])
    torch.manual_seed(3)
    (g1,) = torch.autograd.grad(fn(x, w), w)
    torch.manual_seed(3)
    (g2,) = torch.autograd.grad(f(x, w), w)
    torch.testing.assert_close(g1, g2)
    bw = only_artifact(fn).part.backward
    assert not [n for n in bw.graph.nodes if n.op == "call_function" and
                torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]


def test_value_a_backward_matmul_reads_is_saved_not_recomputed():
    """GELU's output feeds the next matmul in the forward and its weight gradient in the backward: recomputing it
    would write it out again in the backward, so it is saved (AOTAutograd's rule); the GELU input is saved for
    GELU's own backward, which is pointwise."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU("tanh"), torch.nn.Linear(32, 8))
    x = torch.randn(64, 16)
    fn = aot_eager(torch.fx.symbolic_trace(m), [x])
    part = only_artifact(fn).part
    fw = {n.name: n for n in part.forward.graph.nodes}
    assert torch.ops.aten.gelu.default in {fw[name].target for name in part.saved if name in fw}, part.saved
    assert not any(n.target is torch.ops.aten.gelu.default for n in part.backward.graph.nodes)
    ref = copy.deepcopy(m)
    fn(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_layer_norm_output_recomputed_from_statistics():
    """The layer norm's output is read in the backward only by GELU's (pointwise) backward: recomputed from the
    input and statistics instead of saved; the GELU output, read by the last matmul's weight gradient, is saved."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(64, 16)
    fn = aot_eager(torch.fx.symbolic_trace(m), [x])
    art = only_artifact(fn)
    bw_ops = {n.target for n in art.part.backward.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addcmul.default in bw_ops           # the recipe, not a second native_layer_norm
    assert torch.ops.aten.native_layer_norm.default not in bw_ops
    ref = copy.deepcopy(m)
    fn(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("model", ["resnet18", "gpt2"])
def test_saves_at_most_eager_bytes(model):
    torch.manual_seed(0)
    if model == "resnet18":
        tv = pytest.importorskip("torchvision")
        m = tv.models.resnet18(num_classes=10).train()
        inputs = [torch.randn(2, 3, 32, 32)]
        program = m
    else:
        tr = pytest.importorskip("transformers")
        cfg = tr.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=100, n_positions=64, bos_token_id=0,
                            eos_token_id=0, attn_implementation="eager")
        m = tr.GPT2LMHeadModel(cfg).train()
        ids = torch.randint(0, 100, (2, 32))
        inputs = [ids, ids]

        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lm = m

            def forward(self, i, labels):
                return self.lm(input_ids=i, labels=labels).loss
        program = Loss()
    fn = aot_eager(program, inputs)
    ours = saved_storage_bytes(lambda: fn(*inputs))
    eager = saved_storage_bytes(lambda: program(*inputs))
    assert ours <= eager, (ours, eager)


def test_expanded_value_a_backward_matmul_reads_is_saved_as_its_base():
    """An expanded value read by the backward's bmm: its base is saved and the backward takes the view again
    (saved as the view, it reached the backward as the forward's dense copy, which the host program could not
    copy back into the expanded layout: RuntimeError)."""
    import ember

    def f(x, w):
        b = torch.where(x > 0, x, 2.0).expand(8, 16, 16)
        return torch.bmm(b, w).sin()
    x, w = torch.randn(16, 16), torch.randn(8, 16, 4, requires_grad=True)
    cf = ember.compile(f)
    for _ in range(2):
        x = torch.randn(16, 16)
        g, = torch.autograd.grad(cf(x, w).sum(), w)
        ge, = torch.autograd.grad(f(x, w).sum(), w)
        torch.testing.assert_close(g, ge)
