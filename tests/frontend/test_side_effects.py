"""Side effects happen exactly as in Python (lists, dicts, attributes, globals, closure cells, in-place ops on
inputs), and outputs are rebuilt with their exact structure and identities."""
import collections
import dataclasses

import pytest
import torch

from tests.frontend.harness import Recorder, assert_same, case, check, compile, rand, run_case

Out = collections.namedtuple("Out", "value aux")


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    loss: torch.Tensor | None
    extras: dict
    step: int = 0


class Box:
    def __init__(self, t):
        self.t = t
        self.log = []


# --- mutations of inputs (harness compares the inputs after the call with eager's)
def s_list_append(xs): xs.append(xs[0] * 2); xs.append("tag"); return xs[-2]
def s_list_pop_insert(xs): last = xs.pop(); xs.insert(0, last + 1); return len(xs)
def s_list_setitem_del(xs): xs[0] = xs[1] * 3; del xs[1]; return xs[0].sum()
def s_list_clear_extend(xs): y = xs[0] + 1; xs.clear(); xs.extend([y, y]); return y
def s_list_slice_assign(xs): xs[1:] = [xs[0] * 2]; return xs
def s_dict_set_del(d): d["new"] = d["a"] * 2; del d["b"]; return d["new"].sum()
def s_dict_update_pop(d): d.update({"a": d["a"] + 1, "c": 3}); v = d.pop("b"); return v * 2
def s_attr_set_new(b): b.t = b.t * 2; b.extra = b.t.sum(); b.log.append("done"); return b.t
def s_attr_del(b): del b.log; return b.t + 1
def s_nested_container(d): d["xs"][0].append(d["t"] * 2); d["obj"].log.append(1); return d["t"]
def s_inplace_input(x): x.mul_(2); return x.sum()
def s_inplace_input_setitem(x): x[0] = 0.5; x[1:] *= 2; return x.mean()  # setitem; getitem, imul, setitem; mean
def s_inplace_in_list(xs): xs[0].add_(1); xs[1].zero_(); return xs[0] * 2
def s_inplace_in_attr(b): b.t.sub_(1); return b.t.abs()
def s_inplace_through_view(x): v = x[:, 0]; v.fill_(3.0); return x.sum()
def s_inplace_after_read(x): y = x * 2; x.add_(y); return y, x.sum()
def s_mutation_order(xs, d): xs.append(1); d["k"] = len(xs); xs.append(d["k"] * 10); return xs[0] + d["k"]
def s_default_list_untouched(x, acc=None): acc = [] if acc is None else acc; acc.append(x); return acc


# --- outputs rebuilt exactly
def o_nested(x): return (x, [x * 2, (x + 1, {"a": x - 1, "b": [x * 3]})])
def o_namedtuple(x): return Out(x.relu(), {"n": 3, "s": "ok"})
def o_dataclass(x): return Result(x * 2, None, {"t": x + 1, "k": (1, 2)}, step=4)
def o_python_values(x): return x + 1, 1, 2.5, "s", None, True, (), [], {}, torch.float64, torch.Size([2, 3])
def o_ordered_dict(x): return collections.OrderedDict([("z", x), ("a", x * 2)])
def o_dict_int_keys(x): return {2: x, 1: x * 2, (3, 4): x + 1}
def o_shape_and_tensor(x): return x.shape, x.size(0), x.sum()
def o_deeply_nested(x): return [[[[x + 1]]]], ((((x * 2,),),),)
def o_list_of_namedtuples(x): return [Out(x * i, i) for i in range(3)]


XS = lambda: (rand(3, 4),)
LIST = lambda: ([rand(3), rand(3), rand(3)],)
DICT = lambda: ({"a": rand(3), "b": rand(3)},)
BOX = lambda: (Box(rand(3)),)

CASES = [
    case(s_list_append, LIST, 1), case(s_list_pop_insert, LIST, 1), case(s_list_setitem_del, LIST, 2),
    case(s_list_clear_extend, LIST, 1), case(s_list_slice_assign, LIST, 1), case(s_dict_set_del, DICT, 2),
    case(s_dict_update_pop, DICT, 2), case(s_attr_set_new, BOX, 2), case(s_attr_del, BOX, 1),
    case(s_nested_container, lambda: ({"xs": [[]], "t": rand(3), "obj": Box(rand(1))},), 1),
    case(s_inplace_input, XS, 2), case(s_inplace_input_setitem, XS, 5), case(s_inplace_in_list, LIST, 3),
    case(s_inplace_in_attr, BOX, 2), case(s_inplace_through_view, XS, 3), case(s_inplace_after_read, XS, 3),
    case(s_mutation_order, lambda: ([rand(2)], {}), 1), case(s_default_list_untouched, XS, 0, graphs=0),
    case(o_nested, XS, 4), case(o_namedtuple, XS, 1), case(o_dataclass, XS, 2), case(o_python_values, XS, 1),
    case(o_ordered_dict, XS, 1), case(o_dict_int_keys, XS, 2), case(o_shape_and_tensor, XS, 1),
    case(o_deeply_nested, XS, 2), case(o_list_of_namedtuples, XS, 3),
]


@pytest.mark.parametrize("fn,args,ops,graphs", CASES)
def test_side_effect_or_output_program(fn, args, ops, graphs):
    run_case(fn, args, ops, graphs)


def test_returned_input_is_the_same_object():
    def f(x, xs):
        x.add_(1)
        xs.append(x * 2)
        return x, xs, x
    rec = Recorder()
    cf = compile(f, rec)
    x, xs = rand(3), []
    out = cf(x, xs)
    assert out[0] is x and out[2] is x and out[1] is xs
    assert len(xs) == 1 and rec.graphs == 1


def test_same_tensor_returned_twice_keeps_identity():
    def f(x):
        y = x * 2
        return y, [y], {"y": y}
    out = compile(f, Recorder())(rand(3))
    assert out[0] is out[1][0] is out[2]["y"]


def test_new_object_returned_is_fresh_each_call():
    def f(x):
        return Box(x * 2)
    cf = compile(f, Recorder())
    a, b = cf(rand(3)), cf(rand(3))
    assert a is not b and a.log is not b.log


COUNTER = 0
LOG = []
STATE = {}


def test_global_counter_list_dict_mutations():
    def f(x):
        global COUNTER
        COUNTER += 1
        LOG.append(COUNTER)
        STATE["last"] = x.sum()
        return x * COUNTER
    global COUNTER
    rec = Recorder()
    cf = compile(f, rec)
    COUNTER = 0
    LOG.clear()
    x = rand(3)
    for i in range(1, 4):
        assert_same(x * i, cf(x))
        assert COUNTER == i and LOG == list(range(1, i + 1))
        assert_same(x.sum(), STATE["last"])
    assert 1 <= rec.graphs <= 3   # COUNTER's value is read: specializing on it recompiles per call (torch does)


def test_global_rebinding_to_new_tensor():
    def f(x):
        global LAST
        LAST = x * 2
        return LAST + 1
    cf = compile(f, Recorder())
    x = rand(3)
    out = cf(x)
    assert_same(x * 2, globals()["LAST"])
    assert_same(x * 2 + 1, out)


def test_closure_cell_mutation_by_compiled_inner_function():
    def make():
        total = torch.zeros(3)
        calls = 0

        def step(x):
            nonlocal total, calls
            total = total + x
            calls += 1
            return total * 2

        return step, lambda: (total, calls)
    eager_step, eager_state = make()
    step, state = make()
    rec = Recorder()
    cstep = compile(step, rec)
    for _ in range(3):
        x = rand(3)
        assert_same(eager_step(x), cstep(x))
        assert_same(eager_state(), state())
    assert 1 <= rec.graphs <= 3  # `calls` is an int read by the frame: guarding on it may recompile per call


def test_mutable_default_argument_shared_across_calls():
    def make():
        def f(x, acc=[]):  # noqa: B006 (the point of the test)
            acc.append(x.sum())
            return len(acc)
        return f
    f_eager, f = make(), make()
    cf = compile(f, Recorder())
    for _ in range(3):
        x = rand(3)
        assert f_eager(x) == cf(x)
    assert len(f.__defaults__[0]) == 3


def test_attribute_mutation_on_module_inside_function():
    lin = torch.nn.Linear(3, 3)

    def f(x):
        lin.last_input_norm = x.norm()
        lin.calls = getattr(lin, "calls", 0) + 1
        return lin(x)
    cf = compile(f, Recorder())
    x = rand(2, 3)
    out = cf(x)
    assert_same(lin(x), out)
    assert lin.calls == 1
    assert_same(x.norm(), lin.last_input_norm)


def test_inplace_on_input_and_output_alias():
    """The output is a view of the mutated input: both the caller's tensor and the output see the values."""
    def f(x):
        x.mul_(2)
        return x[0]
    x_e, x_c = rand(3, 2), None
    x_c = x_e.clone()
    out_e, out_c = f(x_e), compile(f, Recorder())(x_c)
    assert_same(x_e, x_c)
    assert_same(out_e, out_c)
    out_c.fill_(9)   # out_c must be a view of x_c, as in eager
    assert (x_c[0] == 9).all()
