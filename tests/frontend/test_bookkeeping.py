"""Bookkeeping calls are not graph breaks (frontend/policy.py AT_CAPTURE): torch._assert on a Python bool,
torch.overrides' has_torch_function checks on plain Python values, torch's API-usage logging, queries of state that
is fixed for the call (evaluated at capture, process settings guarded); nn.MultiheadAttention and a small
VisionTransformer as one graph; a __torch_function__ subclass argument runs in Python. Counts as torch.compile's
(EMBER_TEST_BASELINE=torch runs the same tests through it)."""
import inspect

import pytest
import torch
from torch.overrides import has_torch_function, has_torch_function_unary, has_torch_function_variadic

from tests.frontend.harness import BASELINE, assert_same, check, rand


def test_assert_on_a_python_bool_is_decided_at_capture():
    def f(x):
        y = x.cos()
        torch._assert(x.shape[0] == 4, "batch of four")
        return y.sin() + 1
    r = check(f, rand(4, 3))
    assert r.graphs == 1 and r.ops == [3]


@pytest.mark.skipif(BASELINE, reason="torch.compile appends its own lines to the assertion's message")
def test_a_failing_assert_on_a_python_bool_raises_as_eager():
    def f(x):
        y = x.cos()
        torch._assert(x.shape[0] == 5, "batch of five")
        return y
    check(f, rand(4, 3))   # compares the exception (type and message) with eager's


def test_has_torch_function_on_python_values_is_false_without_a_break():
    def f(x, flag):
        y = x + 1
        if has_torch_function((flag, None)) or has_torch_function_unary(flag) or has_torch_function_variadic(1, 2.0):
            return x
        return y * 2
    r = check(f, rand(3), True)
    assert r.graphs == 1 and r.ops == [2]


def test_api_usage_logging_is_skipped_like_torch_compile():
    torchvision = pytest.importorskip("torchvision")

    def f(x):
        torch._C._log_api_usage_once("a library op")
        return torchvision.ops.stochastic_depth(x.relu(), 0.5, "row", training=False) + 1
    r = check(f, rand(4, 8))
    assert r.graphs == 1 and r.ops == [2]


# ------------------------------------------------------------------ state probes (policy.AT_CAPTURE)

class _SelfAttention(torch.nn.Module):
    def __init__(self, batch_first: bool, need_weights: bool):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x):
        return self.mha(x, x, x, need_weights=self.need_weights)


# (batch_first, need_weights) -> ops of torch.compile's one graph, with grad mode on (eval or train) and off (eval:
# the fast path's checks, torch.is_grad_enabled() included, run; the decomposable path is taken, as torch.compile
# takes it, and its batch-first output made contiguous, as the fast path's is)
MHA_OPS = {(False, False): (2, 2), (False, True): (3, 3), (True, False): (4, 5), (True, True): (5, 6)}
# (torch before 2.12 has no such `contiguous` in MultiheadAttention.forward: one op fewer there, for both compilers)
_MHA_FAST_PATH_LAYOUT = "fast_path_blocked_by_tracing" in inspect.getsource(torch.nn.MultiheadAttention.forward)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval", "eval-no-grad"])
def test_multihead_attention_one_graph_as_torch_compile(batch_first, need_weights, mode):
    from tests.frontend.harness import check_module
    torch.manual_seed(0)
    m = _SelfAttention(batch_first, need_weights).train(mode == "train")
    with torch.set_grad_enabled(mode != "eval-no-grad"):
        r = check_module(m, rand(3, 5, 8), _rtol=1e-5, _atol=1e-5)
    no_grad = mode == "eval-no-grad"
    expected = MHA_OPS[batch_first, need_weights][no_grad] - (no_grad and batch_first and not _MHA_FAST_PATH_LAYOUT)
    assert r.graphs == 1 and r.ops == [expected], r.describe()


@pytest.mark.parametrize("grad", [True, False])
def test_small_vision_transformer_one_graph_as_torch_compile(grad):
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    from tests.frontend.harness import check_module
    torch.manual_seed(0)
    m = vision_transformer.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16,
                                             mlp_dim=32, num_classes=10).eval()
    from tests.frontend.harness import Recorder, compile
    rec = Recorder()
    cm = compile(m, rec)
    with torch.set_grad_enabled(grad):
        for _ in range(2):
            x = rand(2, 3, 32, 32)
            assert_same(m(x), cm(x), rtol=1e-5, atol=1e-5)
    assert rec.graphs == 1 and rec.ops == [38 if grad else 40], rec.describe()


def test_dispatch_mode_stack_read_at_capture():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def f(x):
        if _get_current_dispatch_mode_stack():
            return x - 1
        return x.sin() + 1
    r = check(f, rand(3))
    assert r.graphs == 1 and r.ops == [2]


def _mask_for(keep):
    """A library's mask helper: skipped when nothing is masked, except on its compile path (`.all()` is a
    data-dependent branch there), where it builds the full (b, n, n) mask."""
    if torch.compiler.is_compiling() or not bool(keep.all()):
        return (1.0 - keep[:, None, :].float()).expand(-1, keep.shape[1], -1) * -1e4
    return None


def _landmark_scores(x, keep):
    scores = x[:, :2] @ x.transpose(-1, -2)      # (b, 2, n): two landmark rows against n keys
    mask = _mask_for(keep)
    if mask is not None:
        scores = scores + mask                   # (b, 2, n) + (b, n, n): raises for n != 2, as eager would
    return scores.softmax(-1).sin()


@pytest.mark.skipif(BASELINE, reason="torch.compile answers is_compiling() True and raises on the mask's add")
def test_a_compile_only_path_that_raises_runs_as_eager():
    # is_compiling() True (torch.compile's answer) leads to an add that raises; eager never builds the mask. The
    # program then answers as eager: the scores, `keep.all()` in the helper compiled at the break, the softmax.
    keep = torch.ones(2, 6, dtype=torch.bool)
    r = check(_landmark_scores, rand(2, 6, 4), keep)
    assert r.graphs == 3 and r.ops == [3, 1, 2], r.describe()
    keep[0, -1] = False   # a masked position: eager raises too, and so does the compiled program
    check(_landmark_scores, rand(2, 6, 4), keep, _recompiles=True)


def test_a_compile_only_path_that_runs_keeps_torch_compiles_answer():
    def f(x, keep):   # the same helper where the mask fits the scores: one graph, as torch.compile
        scores = x @ x.transpose(-1, -2)
        mask = _mask_for(keep)
        return (scores if mask is None else scores + mask).softmax(-1)
    r = check(f, rand(2, 6, 4), torch.ones(2, 6, dtype=torch.bool))
    assert r.graphs == 1, r.describe()


def test_isinstance_of_fake_tensor_is_false_as_in_eager():
    from torch._subclasses.fake_tensor import FakeTensor

    def f(x, w):
        y = x.sin()   # the capture holds fakes, the program's tensors are none
        if isinstance(y, FakeTensor) or isinstance(x, (int, (FakeTensor,))):
            return y - 1
        return y + 1 if isinstance(w, torch.nn.Parameter) and isinstance(y, torch.Tensor) else y
    r = check(f, rand(3), torch.nn.Parameter(rand(3)))
    assert r.graphs == 1 and r.ops == [2], r.describe()


def test_a_process_setting_read_in_the_program_is_guarded():
    from tests.frontend.harness import compile, Recorder, reset

    def f(x):
        if torch.backends.mha.get_fastpath_enabled() and torch.get_default_dtype() is torch.float32:
            return x.sin()
        return x.cos()
    reset()
    rec = Recorder()
    cf = compile(f, rec)
    x = rand(3)
    torch.testing.assert_close(cf(x), x.sin())
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        torch.testing.assert_close(cf(x), x.cos())   # the setting changed: captured again
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(cf(x), x.sin())
    assert rec.graphs == 2


class _LoggingTensor(torch.Tensor):
    """A subclass whose torch calls run Python (records each function)."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.skipif(BASELINE, reason="torch.compile inlines a subclass's __torch_function__ into its graph")
def test_a_torch_function_subclass_argument_runs_in_python():
    from tests.frontend.harness import compile, Recorder, reset

    def f(x, w):
        return torch.nn.functional.linear(x, w).relu() + 1
    reset()
    rec = Recorder()
    cf = compile(f, rec)
    x, w = rand(3, 4).as_subclass(_LoggingTensor), rand(5, 4)
    for _ in range(2):
        _LoggingTensor.seen.clear()
        expected = f(x, w)
        eager_seen = list(_LoggingTensor.seen)
        _LoggingTensor.seen.clear()
        out = cf(x, w)
        assert _LoggingTensor.seen == eager_seen == ["linear", "relu", "add"]
        assert type(out) is type(expected) is _LoggingTensor
        torch.testing.assert_close(out, expected)
    assert rec.graphs == 0
    y = rand(3, 4)   # a plain tensor is captured
    torch.testing.assert_close(cf(y, w), f(y, w))
    assert rec.graphs == 1


@pytest.mark.skipif(BASELINE, reason="torch.compile traces a subclass with Tensor's __torch_function__")
def test_a_plain_subclass_keeps_its_type():
    class Sub(torch.Tensor):
        pass

    def f(x, y):
        return (x + y).sin()
    x, y = rand(3), rand(3).as_subclass(Sub)
    for backend in ("eager", "ember"):
        import ember
        ember.reset()
        out = ember.compile(f, backend=backend)(x, y)
        assert type(out) is Sub
        torch.testing.assert_close(out, f(x, y))


def test_torch_state_queries_do_not_recompile_and_a_changed_flag_does():
    from tests.frontend.harness import Recorder, compile, reset

    def f(x):
        flags = (torch._C._is_torch_function_mode_enabled(), torch._C._len_torch_function_stack() > 0,
                 torch._C._is_torch_function_enabled(), torch.are_deterministic_algorithms_enabled(),
                 torch._C._get_cudnn_enabled(), torch.is_inference_mode_enabled())
        return x + flags.count(True)
    reset()
    rec = Recorder()
    cf = compile(f, rec)
    x = rand(2)
    for _ in range(3):
        torch.testing.assert_close(cf(x), f(x))
    assert rec.graphs == 1
    torch.use_deterministic_algorithms(True)
    try:
        torch.testing.assert_close(cf(x), f(x))
    finally:
        torch.use_deterministic_algorithms(False)
    assert rec.graphs == 2
