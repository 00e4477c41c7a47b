"""Real models (tests/models/model_zoo.py configs) through ember.compile with the default "ember" backend:
frontend -> autograd -> decompositions -> fused C++ kernels, equal to eager in eval and train mode.

resnet18 in train mode is left out on purpose: with batch 2 at 32x32 its last BatchNorms normalize over 2
values, so float32 rounding is amplified ~1e3x (eager and ember are equally far from a float64 reference;
the float64 compiled model equals eager's float64).

mobilenet_v3_small in train mode (the same batch 2 at 32x32) is compared with a float64 run of the eager model
instead: its outputs are ~0.09 at most, and eager float32 is itself 6.5e-6 (one thread) to 8.6e-6 (two) from
float64, so eager and ember, each off in its own direction, differ by up to 1.4e-5, past assert_close's 1e-5.
ember must be within 4x eager's own error there (docs/evidence.md has the ratio measured)."""
import copy
import pathlib
import sys

import pytest
import torch

import ember

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))
from model_zoo import assert_same, build  # noqa: E402

CASES = [("resnet18", False), ("mobilenet_v3_small", False), ("mobilenet_v3_small", True), ("bert", False),
         ("bert", True), ("gpt2", False), ("t5", False)]


def _loss(out):
    t = getattr(out, "logits", None)
    t = getattr(out, "last_hidden_state", None) if t is None else t
    t = out if t is None else t
    return t.float().square().mean()


ROUNDING_AMPLIFIED = {("mobilenet_v3_small", True)}


def _assert_as_close_as_eager(eager_model, args, expected, actual):
    """actual (ember's float32) is no farther from a float64 run of the eager model than 4x eager's float32."""
    reference = copy.deepcopy(eager_model).double()
    torch.manual_seed(100)
    exact = reference(*[a.double() if a.is_floating_point() else a for a in args])
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eager_err = (expected.double() - exact).abs().max().item()
    ember_err = (actual.double() - exact).abs().max().item()
    assert ember_err <= 4 * eager_err + 1e-7, f"ember {ember_err:.3g} from float64, eager {eager_err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name,train", CASES, ids=[f"{n}-{'train' if t else 'eval'}" for n, t in CASES])
def test_model_through_ember_backend_equals_eager(name, train):
    eager_model, args = build(name, train)
    model, _ = build(name, train)
    ember.reset()
    compiled = ember.compile(model)
    torch.manual_seed(100)
    expected = eager_model(*args)
    torch.manual_seed(100)
    actual = compiled(*args)
    if (name, train) in ROUNDING_AMPLIFIED:
        _assert_as_close_as_eager(eager_model, args, expected, actual)
    else:
        assert_same(expected, actual)
    if train:
        _loss(expected).backward()
        _loss(actual).backward()
        for (n, p), q in zip(eager_model.named_parameters(), model.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"{n}: {m}")
    assert_same(dict(eager_model.state_dict()), dict(model.state_dict()), "state_dict")
