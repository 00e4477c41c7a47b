"""The cheaper forms of guards still fail whenever what they cover changes.

Tensor guards of plain tensors and parameters, and constant guards (`type(S) is int and S == 1`, `S is None`),
run in one call each of the C++ checker (ember.runtime.native_guards); with EMBER_NATIVE_GUARDS=0 they are the
Python checks. Every change below is made in both modes, to a module and
to an eager copy of it: the compiled result must equal eager's, and the graph count says whether the change was
seen (a change of metadata recompiles; a change of values only, or a new parameter with the same metadata, does
not need to)."""
import collections
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.frontend.harness import BASELINE, Recorder, assert_same, compile, rand

pytestmark = pytest.mark.skipif(BASELINE, reason="ember's guard implementation")


def native_checker():
    """The C++ checker, built if need be; the test is skipped where it cannot be built (no C++ compiler)."""
    from ember.runtime import native_guards
    checker = native_guards.checker(wait=True)
    if checker is None:
        pytest.skip("the C++ tensor checker could not be built here (no compiler?)")
    return checker


def use_guards(checker: str, monkeypatch) -> None:
    """"c++": entries use the C++ checker; "python": the Python guards only (EMBER_NATIVE_GUARDS=0)."""
    if checker == "c++":
        native_checker()
    else:
        monkeypatch.setenv("EMBER_NATIVE_GUARDS", "0")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.scale = nn.Parameter(torch.randn(4))
        self.register_buffer("shift", torch.randn(4))
        self.k = 2
        self.pad = (1, 2)
        self.coef = (1, 3)
        self.offset = None
        self.name = "plain"

    def forward(self, x):
        out = F.pad(self.bn(self.lin(x)) * self.scale + self.shift * self.k, self.pad)
        out = out * self.coef[0] + self.coef[1]
        if self.offset is not None:
            out = out + self.offset
        return out.exp() if self.name == "exp" else out


def _set_scale(m, t):
    m.scale = t


def _to_plain_tensor(m):
    t = m.scale.detach().clone()
    del m.scale
    m.scale = t


# (change applied to the module and to its eager copy, whether a new graph is needed)
CHANGES = {
    "values_only": (lambda m: m.scale.data.mul_(3), False),
    "same_metadata_new_parameter": (lambda m: _set_scale(m, nn.Parameter(torch.randn(4))), False),
    "data_shape": (lambda m: setattr(m.scale, "data", torch.randn(1)), True),
    "data_stride": (lambda m: setattr(m.scale, "data", torch.randn(8)[::2]), True),
    "data_dtype": (lambda m: setattr(m.scale, "data", m.scale.data.double()), True),
    "weight_transposed": (lambda m: setattr(m.lin.weight, "data", m.lin.weight.data.t().contiguous().t()), True),
    "requires_grad": (lambda m: m.scale.requires_grad_(False), True),
    "parameter_to_tensor": (_to_plain_tensor, True),
    "buffer_dtype": (lambda m: setattr(m, "shift", m.shift.double()), True),
    "buffer_shape": (lambda m: setattr(m, "shift", torch.randn(1)), True),
    "module_attribute": (lambda m: setattr(m, "k", 3), True),
    "attribute_equal_value_other_type": (lambda m: setattr(m, "k", 2.0), True),
    "tuple_item": (lambda m: setattr(m, "pad", (2, 2)), True),
    "tuple_item_bool_for_int": (lambda m: setattr(m, "coef", (True, 3)), True),
    "tuple_longer": (lambda m: setattr(m, "pad", (1, 2, 0, 0)), True),
    "tuple_to_list": (lambda m: setattr(m, "coef", [1, 3]), True),
    "tuple_item_float_for_int": (lambda m: setattr(m, "coef", (1, 3.0)), True),
    "none_to_number": (lambda m: setattr(m, "offset", 0.5), True),
    "string": (lambda m: setattr(m, "name", "exp"), True),
    "training_flag": (lambda m: m.bn.train(), True),
    "submodule_replaced": (lambda m: setattr(m, "bn", nn.LayerNorm(4)), True),
}


@pytest.mark.parametrize("checker", ["c++", "python"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_is_seen_or_harmless(change, checker, monkeypatch):
    use_guards(checker, monkeypatch)
    from ember.frontend.convert import FrameCompiler
    torch.manual_seed(0)
    m = Net().eval()
    ref = copy.deepcopy(m)
    rec = Recorder()
    cm = compile(m, rec, dynamic=False)
    x = rand(3, 4)
    assert_same(ref(x), cm(x))
    assert_same(ref(x), cm(x))
    sources = [e.source for fc in FrameCompiler._all for e in fc.entries]
    assert all(("___check_tensors(" in s and "___check_consts(" in s) == (checker == "c++") for s in sources), sources
    fn, recompiles = CHANGES[change]
    for module in (m, ref):   # the same change, random values included
        torch.manual_seed(1)
        fn(module)
    x = rand(3, 4)
    assert_same(ref(x), cm(x))
    assert_same(ref(x), cm(x))
    assert rec.graphs == 1 + recompiles, rec


def test_checker_rejects_each_property():
    """check() is false when any one of type, dtype, requires_grad, shape, stride, device differs, or when the
    tensors are fewer or more than the specs."""
    tc = native_checker()
    a, p = torch.randn(3, 4), nn.Parameter(torch.randn(2, 2))
    types, spec = (torch.Tensor, nn.Parameter), tc.spec(a) + tc.spec(p)
    assert tc.check((a, p), types, spec) is True
    assert tc.check((a, torch.randn(2, 2)), types, spec) is False                      # type
    assert tc.check((a.double(), p), types, spec) is False                             # dtype
    assert tc.check((a.requires_grad_(), p), types, spec) is False                     # requires_grad
    a.requires_grad_(False)
    assert tc.check((torch.randn(4, 3), p), types, spec) is False                      # shape
    assert tc.check((torch.randn(4, 3).t(), p), types, spec) is False                  # stride
    assert tc.check((torch.randn(3, 4, device="meta"), p), types, spec) is False       # device
    assert tc.check((a,), types[:1], spec) is False                                    # fewer tensors
    assert tc.check((a, p, a), types + (torch.Tensor,), spec) is False                 # more tensors
    assert tc.check((torch.randn(3, 4).to_sparse(), p), types, spec) is False          # not strided
    assert tc.spec(torch.randn(3).to_sparse()) is None
    p.data = torch.randn(2, 3)
    assert tc.check((a, p), types, spec) is False                                      # .data replaced


def test_const_and_falsy_checkers():
    tc = native_checker()
    expected = (1, 2.5, "a", b"b", 1j, None, True, False)
    assert tc.check_consts(tuple(expected), expected) is True
    for i, other in enumerate([True, 2, "b", "b", 1, False, 1, 0]):
        values = list(expected)
        values[i] = other
        assert tc.check_consts(tuple(values), expected) is False, (i, other)
    assert tc.check_consts((1, 2), (1,)) is False
    assert tc.check_consts((float("nan"),), (float("nan"),)) is False   # (NaN guards stay Python: `S != S`)
    nested = ((1, 2), (1, ("a", None)), ())     # tuples of constants, compared item by item, exact types
    assert tc.check_consts(((1, 2), (1, ("a", None)), ()), nested) is True
    for other in [((1, True), (1, ("a", None)), ()), ([1, 2], (1, ("a", None)), ()), ((1, 2), (1, ("a",)), ()),
                  ((1, 2), (1, ("a", None)), (0,)), ((1, 2), (1.0, ("a", None)), ())]:
        assert tc.check_consts(other, nested) is False, other
    assert tc.check_falsy(({}, [], 0, None, "")) is True
    for truthy in ({1: 2}, [0], 1, "x", object()):
        assert tc.check_falsy(({}, truthy)) is False


def test_dict_get_is_dict_get():
    """The checker's dict_get (an optimizer's `state[p]` without a Python Tensor.__hash__ call) finds what
    dict.get finds, for tensor keys and others, and like dict.get never calls a defaultdict's factory."""
    import collections
    tc = native_checker()

    class Hashed(torch.Tensor):
        def __hash__(self):
            return 5

    p, t, h = nn.Parameter(torch.randn(2)), torch.randn(3), torch.randn(1).as_subclass(Hashed)
    d = collections.defaultdict(dict, {p: {"step": 1}, t: 2, 5: "five", "k": 7})
    for key in (p, t, h, torch.randn(1), 5, "k", "missing", (1, 2)):
        assert tc.dict_get(d, key) is dict.get(d, key), key
    assert len(d) == 4
    with pytest.raises(TypeError):
        tc.dict_get(d, [1])             # unhashable, as dict.get
    with pytest.raises(TypeError):
        tc.dict_get([(p, 1)], p)        # not a dict


def test_data_ptrs_are_each_tensors_data_ptr():
    """data_ptrs (a CUDA graph replay's address checks) gives what Tensor.data_ptr() gives, for views at an
    offset, empty tensors and parameters; None for a sequence holding a non-tensor; a TypeError for a list.
    aligned_data_ptrs likewise, None where an address is not a multiple of 16."""
    tc = native_checker()
    a = torch.randn(10)
    ts = (a, a[3:], a[::2], torch.empty(0), nn.Parameter(torch.randn(2)))
    assert tc.data_ptrs(ts) == tuple(t.data_ptr() for t in ts)
    assert tc.data_ptrs(()) == ()
    assert tc.data_ptrs((a, 3)) is None
    with pytest.raises(TypeError):
        tc.data_ptrs([a])
    # aligned_data_ptrs (a Triton launch's pointers): the same, or None when one is not 16-byte aligned
    assert tc.aligned_data_ptrs((a, a[4:])) == (a.data_ptr(), a[4:].data_ptr())
    assert tc.aligned_data_ptrs((a, a[3:])) is None and tc.aligned_data_ptrs((a, 3)) is None


def test_a_tensor_subclass_keeps_the_python_check():
    """A subclass may define its metadata in Python: its guard stays Python, next to the batched ones. (Its
    __torch_function__ is off, as nn.Parameter's: a subclass whose torch calls go through it runs in Python,
    tests/frontend/test_bookkeeping.py.)"""
    native_checker()
    from ember.frontend.convert import FrameCompiler

    class Sub(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

    def f(x, y): return x + y
    rec = Recorder()
    cf = compile(f, rec, dynamic=False)
    x, y = rand(3), rand(3).as_subclass(Sub)
    assert_same(f(x, y), cf(x, y))
    src = next(e.source for fc in FrameCompiler._all for e in fc.entries)
    assert "___check_tensors((x, )" in src and "y.stride() == (1,)" in src, src
    y = rand(3)
    assert_same(f(x, y), cf(x, y))   # a plain tensor where the subclass was
    assert rec.graphs == 2


def _global_forward_hook(m):
    def hook(mod, args, out):
        return out * 2 if isinstance(mod, nn.Linear) else out
    return nn.modules.module.register_module_forward_hook(hook)


def _backward_hook(m):
    def hook(mod, grad_in, grad_out):
        return tuple(g * 3 if g is not None else None for g in grad_in)
    return m.lin.register_full_backward_hook(hook)


HOOKS = {
    "forward": (lambda m: m.lin.register_forward_hook(lambda mod, args, out: out + 1), False),
    "forward_pre": (lambda m: m.lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2,)), False),
    "global_forward": (_global_forward_hook, False),
    "backward": (_backward_hook, True),
}


@pytest.mark.parametrize("checker", ["c++", "python"])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_hook_registered_after_the_capture_runs(hook, checker, monkeypatch):
    """Hooks registered after a capture change what a call does (a backward hook: the gradients, so it is
    checked where grad mode is on): the cached entry must not be used."""
    use_guards(checker, monkeypatch)
    register, grads = HOOKS[hook]
    torch.manual_seed(0)
    m = Net().eval()
    ref = copy.deepcopy(m)
    cm = compile(m, Recorder(), dynamic=False)

    def run(f, x):
        out = f(x)
        if not grads:
            return out
        x.grad = None
        out.sum().backward()
        return out, x.grad

    x = rand(3, 4, requires_grad=grads)
    assert_same(run(ref, x), run(cm, x))
    handles = [register(m), register(ref)] if hook != "global_forward" else [register(m)]
    try:
        x = rand(3, 4, requires_grad=grads)
        assert_same(run(ref, x), run(cm, x))
    finally:
        for h in handles:
            h.remove()


DICT_CHANGES = {
    "same": (lambda d: d, False),
    "new_dict_same_keys": (lambda d: {"a": d["a"], "b": d["b"] * 3}, False),
    "reordered": (lambda d: {"b": d["b"], "a": d["a"]}, True),
    "extra_key": (lambda d: {**d, "c": 1}, True),
    "ordered_dict": (lambda d: collections.OrderedDict(d), True),
    "int_key_for_str": (lambda d: {"a": d["a"], 1: d["b"]}, True),
}


@pytest.mark.parametrize("checker", ["c++", "python"])
@pytest.mark.parametrize("change", list(DICT_CHANGES))
def test_a_dicts_keys_are_checked_in_order(change, checker, monkeypatch):
    """A dict's type and keys in order (an optimizer's state[p]): `type(S) is dict and tuple(S) == keys`, or
    the C++ check_dicts. The function iterates the dict, so a reordered or longer one is another program."""
    use_guards(checker, monkeypatch)

    def f(x, d):
        out = x
        for k, v in d.items():
            out = out * 2 + (v if isinstance(v, torch.Tensor) else v * x)
        return out
    rec = Recorder()
    cf = compile(f, rec, dynamic=False)
    x, d = rand(3), {"a": 1.5, "b": rand(3)}
    assert_same(f(x, d), cf(x, d))
    fn, recompiles = DICT_CHANGES[change]
    d = fn(d)
    try:
        expected = f(x, d)
    except Exception as e:
        with pytest.raises(type(e)):
            cf(x, d)
        return
    assert_same(expected, cf(x, d))
    assert rec.graphs == 1 + recompiles, rec


def test_checker_loaded_during_a_capture_is_used_by_its_entry(monkeypatch):
    """Whether the checker is loaded is asked when the entry is made: a capture during which the build ends
    (the backend's compile in between) gets batched checks, of the metadata the tensors had when guarded; a
    tensor whose metadata changed meanwhile keeps its Python check (here: the backend replaces .data)."""
    from ember.runtime import native_guards
    from ember.frontend.convert import FrameCompiler
    real = native_checker()
    state = {"loaded": False, "resize": False}
    monkeypatch.setattr(native_guards, "checker", lambda wait=False: real if state["loaded"] else None)

    def backend(gm, example_inputs):
        state["loaded"] = True   # the build ended while the backend compiled
        if state["resize"]:
            example_inputs[1].data = torch.randn(5)
        return gm.forward

    def f(x, w): return x * 2 + w.sum()
    cf = compile(f, backend=backend, dynamic=False)
    x, w = rand(3), rand(3)
    assert_same(f(x, w), cf(x, w))
    src = next(e.source for fc in FrameCompiler._all if fc.fn is f for e in fc.entries)
    assert "___check_tensors((x, w, )" in src, src

    def g(x, w): return x * w.shape[0] + w.sum()   # (a graph for 3-long w multiplies by 3)
    state["loaded"], state["resize"] = False, True
    cg = compile(g, backend=backend, dynamic=False)
    x, w = rand(3), rand(3)
    actual = cg(x, w)                    # w is 5 long now: the entry misses its own guards, runs as Python
    assert w.shape == (5,)
    assert_same(g(x, w), actual)
    src = next(e.source for fc in FrameCompiler._all if fc.fn is g for e in fc.entries)
    assert "___check_tensors((x, )" in src and "w.shape == (3,)" in src, src
    state["resize"] = False
    w2 = rand(5)
    assert_same(g(x, w2), cg(x, w2))   # recompiled for the new shape
