"""The compiled module is an nn.Module standing for the original (issue 26, item 4), as torch.compile's
OptimizedModule is: isinstance, traversals, .apply/.to/.train, hooks, attributes, parameters.

The tests go through the harness's compile, so they run on either compiler (EMBER_TEST_BASELINE=torch); where
the two differ by design (state_dict keys: ember keeps the original's, torch prefixes `_orig_mod.`), the test
says so."""
import copy

import pytest
import torch
import torch.nn as nn

import ember
from tests.frontend.harness import BASELINE, Recorder, assert_same, compile, rand, reset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("offset", torch.randn(3))
        self.scale = 2.0

    def forward(self, x):
        return self.bn(self.lin(x)) * self.scale + self.offset


def _compiled(recorder=None):
    reset()
    m = Net()
    return m, compile(m, recorder or Recorder())


def test_is_an_nn_module():
    m, cm = _compiled()
    assert isinstance(cm, nn.Module)
    assert isinstance(cm, torch.nn.Module) and callable(cm)


def test_parameters_and_buffers_are_the_originals():
    m, cm = _compiled()
    assert all(a is b for a, b in zip(cm.parameters(), m.parameters()))
    assert len(list(cm.parameters())) == len(list(m.parameters())) == 4
    assert all(a is b for a, b in zip(cm.buffers(), m.buffers()))
    names = [n for n, _ in cm.named_parameters()]
    assert names == ([f"_orig_mod.{n}" for n, _ in m.named_parameters()] if BASELINE
                     else [n for n, _ in m.named_parameters()])
    # an optimizer built on the compiled module updates the original's parameters
    opt = torch.optim.SGD(cm.parameters(), lr=0.1)
    before = m.lin.weight.detach().clone()
    (cm(rand(5, 4)) ** 2).sum().backward()
    opt.step()
    assert not torch.equal(before, m.lin.weight.detach())


def test_modules_reach_every_submodule():
    m, cm = _compiled()
    found = list(cm.modules())
    assert any(x is m.lin for x in found) and any(x is m.bn for x in found)
    assert sum(isinstance(x, nn.BatchNorm1d) for x in found) == 1
    assert [x for x in cm.children() if isinstance(x, nn.Linear)] == [m.lin] or BASELINE


def test_apply_reaches_original_submodules():
    m, cm = _compiled()
    seen = []

    def init(mod):
        seen.append(type(mod).__name__)
        if isinstance(mod, nn.Linear):
            nn.init.constant_(mod.weight, 0.5)

    assert cm.apply(init) is cm
    assert torch.equal(m.lin.weight, torch.full_like(m.lin.weight, 0.5))
    assert "Linear" in seen and "BatchNorm1d" in seen and "Net" in seen


def test_to_train_eval_requires_grad_return_wrapper():
    m, cm = _compiled()
    assert cm.eval() is cm and not m.training and not cm.training and not m.bn.training
    assert cm.train() is cm and m.training and cm.training and m.bn.training
    cm.training = False  # a write of the flag reaches the original
    assert not m.training
    assert cm.to(torch.float64) is cm and m.lin.weight.dtype == torch.float64 and m.offset.dtype == torch.float64
    assert cm.double() is cm and cm.requires_grad_(False) is cm and not m.lin.weight.requires_grad
    x = rand(5, 4, dtype=torch.float64)
    cm.eval(), m.eval()
    assert_same(m(x), cm(x))


def test_train_eval_change_the_compiled_call():
    m, cm = _compiled()
    ref = copy.deepcopy(m)
    x = rand(6, 4)
    for mode in (True, False, True):
        cm.train(mode), ref.train(mode)
        assert_same(ref(x), cm(x))
    assert_same(dict(ref.state_dict()), dict(m.state_dict()))  # running stats updated in train mode only


def test_state_dict_keys_have_no_prefix_and_load_into_uncompiled():
    m, cm = _compiled()
    sd = cm.state_dict()
    if BASELINE:  # torch's wrapper registers the original as a child: every key is prefixed
        assert all(k.startswith("_orig_mod.") for k in sd)
        return
    assert list(sd) == list(m.state_dict())
    assert all(sd[k] is v or sd[k].data_ptr() == v.data_ptr() for k, v in m.state_dict().items())
    fresh = Net()
    fresh.load_state_dict(sd)  # a checkpoint of the compiled model loads into the uncompiled one
    assert_same(dict(sd), dict(fresh.state_dict()))


def test_ember_load_state_dict_reaches_original_and_accepts_torch_compile_prefix():
    m, cm = Net(), ember.compile(Net(), backend="eager")
    cm.load_state_dict(m.state_dict())
    assert_same(dict(m.state_dict()), dict(cm._orig_mod.state_dict()))
    other = Net()
    prefixed = {f"_orig_mod.{k}": v for k, v in other.state_dict().items()}  # torch.compile's checkpoint
    cm.load_state_dict(prefixed)
    assert_same(dict(other.state_dict()), dict(cm.state_dict()))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        cm.load_state_dict({**other.state_dict(), "extra": torch.zeros(1)})


def test_hooks_on_wrapper_and_on_original_run_once():
    m, cm = _compiled()
    calls = []
    h1 = m.register_forward_hook(lambda mod, args, out: calls.append("orig") or out * 2)
    h2 = cm.register_forward_pre_hook(lambda mod, args: calls.append("pre") or (args[0] + 1,))
    m.eval()
    x = rand(5, 4)
    expected = Net.forward(m, x + 1) * 2
    assert_same(expected, cm(x))
    assert calls == ["pre", "orig"]
    if not BASELINE:  # ember: a hook registered on the wrapper is the original's (torch keeps it on the wrapper)
        calls.clear()
        assert_same(expected, m(x))
        assert calls == ["pre", "orig"]
    h1.remove(), h2.remove()
    calls.clear()
    assert_same(m(x), cm(x))
    assert calls == []


def test_hook_on_a_submodule_through_the_wrapper():
    m, cm = _compiled()
    m.eval()
    seen = []
    cm.lin.register_forward_hook(lambda mod, args, out: seen.append(out.shape) or out.relu())
    x = rand(5, 4)
    expected = m(x)
    assert_same(expected, cm(x))
    assert seen == [torch.Size([5, 3])] * 2


def test_attribute_reads_and_writes_reach_original():
    m, cm = _compiled()
    m.eval()
    x = rand(5, 4)
    cm.scale = 3.0
    assert m.scale == 3.0
    assert_same(m(x), cm(x))
    cm.extra = nn.Linear(3, 3)  # a new submodule lands on the original
    assert m.extra is cm.extra and "extra" in dict(m.named_children())
    del cm.extra
    assert not hasattr(m, "extra")
    assert cm.lin is m.lin and cm.offset is m.offset


def test_len_of_a_compiled_sequential():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    cs = compile(seq, Recorder())
    assert len(cs) == 2
    with pytest.raises(TypeError):
        len(compile(Net(), Recorder()))


def test_compiled_module_inside_compiled_function_is_inlined():
    reset()
    rec = Recorder()
    inner = Net().eval()
    c_inner = compile(inner, rec)

    def outer(x):
        return c_inner(x).relu() + 1

    x = rand(5, 4)
    expected = inner(x).relu() + 1
    assert_same(expected, compile(outer, rec)(x))
    assert rec.graphs == 1 and rec.ops == [6]  # linear, batch_norm, mul, add; relu, add


def test_ember_deepcopy_of_compiled_module():
    m = Net().eval()
    cm = ember.compile(m, backend="eager")
    x = rand(5, 4)
    cm(x)
    twin = copy.deepcopy(cm)
    assert isinstance(twin, nn.Module) and twin._orig_mod is not m
    assert all(a is not b and torch.equal(a, b) for a, b in zip(twin.parameters(), m.parameters()))
    with torch.no_grad():
        twin.lin.weight.add_(1.0)
    assert_same(m(x), cm(x))
    assert_same(twin._orig_mod(x), twin(x))
