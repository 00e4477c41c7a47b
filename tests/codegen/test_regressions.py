"""Bugs found through real models, each kept fixed: compiled with the default "ember" backend against eager."""
import pytest
import torch

import ember


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_backward_when_the_input_needs_no_grad(train):
    """An unused input gradient is None: the generated host program must not restride it (AttributeError)."""
    torch.manual_seed(0)
    m, ref = torch.nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    ref.load_state_dict(m.state_dict())
    m.train(train)
    ref.train(train)
    x = torch.randn(2, 3, 4, 4)
    ember.compile(lambda mod, inp: mod(inp).sum().backward())(m, x)
    ref(x).sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    torch.testing.assert_close(m.bias.grad, ref.bias.grad)
    torch.testing.assert_close(m.running_mean, ref.running_mean)
    torch.testing.assert_close(m.running_var, ref.running_var)
