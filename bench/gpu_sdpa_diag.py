"""Diagnostic (device): which ATen ops F.scaled_dot_product_attention becomes in ember's trace on CUDA."""
import collections

import torch

import ember
from ember.autograd.trace import trace_forward, trace_joint


def ops(g):
    return [str(n.target) for n in g.graph.nodes if n.op == "call_function" and
            any(s in str(n.target) for s in ("attention", "bmm", "softmax", "sdp"))]


def backend(gm, ex):
    for n in gm.graph.nodes:
        if "scaled_dot" in str(n.target):
            print("fx node:", n.target, [type(a).__name__ if not hasattr(a, "meta") else
                                         tuple(a.meta["val"].shape) if "val" in a.meta else a.name for a in n.args],
                  {k: (v if not hasattr(v, "meta") else "node") for k, v in n.kwargs.items()})
    g, _ = trace_forward(gm, ex)
    print("inference trace:", collections.Counter(ops(g)))
    return gm.forward


q = torch.randn(8, 12, 128, 64, device="cuda")
f = lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q)
with torch.no_grad():
    ember.compile(f, backend=backend)(q)
from transformers import BertConfig, BertModel
m = BertModel(BertConfig()).cuda().eval()
ids = torch.randint(0, 30522, (8, 128), device="cuda")
with torch.no_grad():
    ember.compile(m, backend=backend)(input_ids=ids)
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    fq = torch.randn(8, 12, 128, 64, device="cuda")
    print("fake cuda sdp choice:", torch.ops.aten._fused_sdp_choice(fq, fq, fq))
print("real sdp choice:", torch.ops.aten._fused_sdp_choice(q, q, q))
with FakeTensorMode():
    fq = torch.randn(2, 4, 37, 64, device="cuda")
    fm = torch.randn(2, 1, 37, 37, device="cuda")
    p = torch.backends.cuda.SDPAParams(fq, fq, fq, fm, 0.0, False, False)
    print("fake can_use_efficient with mask:", torch.backends.cuda.can_use_efficient_attention(p, True))
rq, rm = torch.randn(2, 4, 37, 64, device="cuda"), torch.randn(2, 1, 37, 37, device="cuda")
print("real sdp choice with mask:", torch.ops.aten._fused_sdp_choice(rq, rq, rq, rm))
