"""Resume functions (ember/frontend/bytecode_gen.py) against CPython itself, on 3.11 and 3.12, without torch.

The main check is exhaustive: for every program below and every offset where a resume function may start,
run an instrumented copy of the program that stops when it first reaches the offset and records the real
operand stack (NULL slots included), locals and cells; call the resume function with them; the result,
raised exception and logged side effects must equal one uninterrupted run of the original.

Under 3.12 without torch (tests/frontend/conftest.py imports it), from the repository root:
    python3.12 -m pytest -p no:cacheprovider --noconftest tests/frontend/test_bytecode_gen.py
"""
from __future__ import annotations

import contextlib
import dis
import importlib.util
import inspect
import io
import pathlib
import sys
import traceback
import types

import pytest
from bytecode import Bytecode, CellVar, Instr

# Loaded by path: importing the ember package would import torch, which the 3.12 run does not have.
_path = pathlib.Path(__file__).resolve().parents[2] / "ember" / "frontend" / "bytecode_gen.py"
_spec = importlib.util.spec_from_file_location("ember_bytecode_gen_under_test", _path)
bg = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bg
_spec.loader.exec_module(bg)
PY312 = sys.version_info >= (3, 12)

LOG: list = []


def log(*xs):
    LOG.append(xs)
    return xs[-1] if xs else None


# -- the harness --------------------------------------------------------------------------------------------
class _Stop:
    pass


STOP = _Stop()


def _snapshot_code(code: types.CodeType, offset: int, depth: int, sink: list) -> types.CodeType:
    """``code`` that, on first reaching ``offset``, pops the stack into locals (STORE_FAST accepts NULL),
    copies every cell object into a local, hands its frame's locals to ``sink`` and returns STOP."""
    bc = Bytecode.from_code(code, conserve_exception_block_stackdepth=True)
    target, _ = bg._locate(code, bc, offset)
    # Probe where the stack is the same but no call is pending: a probe between KW_NAMES and CALL would
    # eat the names, and 3.11 specializes PRECALL into versions that do the call and skip the next
    # instruction, assumed to be the CALL.
    instrs = [item for item in bc if isinstance(item, Instr)]
    k = next(i for i, instr in enumerate(instrs) if instr is target)  # Instr's == compares values
    if target.name == "CALL" and instrs[k - 1].name == "PRECALL":
        k -= 1
    if instrs[k - 1].name == "KW_NAMES":
        k -= 1
    where = instrs[k]

    def record():
        sink.append(dict(sys._getframe(1).f_locals))
        return STOP

    probe = [Instr("STORE_FAST", f"__snap_s{k}") for k in reversed(range(depth))]
    for c in code.co_cellvars:
        probe += [Instr("LOAD_CLOSURE", CellVar(c)), Instr("STORE_FAST", f"__snap_cell_{c}")]
    probe += [Instr("PUSH_NULL"), Instr("LOAD_CONST", record)]
    probe += [Instr("CALL", 0)] if PY312 else [Instr("PRECALL", 0), Instr("CALL", 0)]
    probe += [Instr("RETURN_VALUE")]
    for instr in probe:
        instr.location = where.location
    items = []
    for item in bc:
        if item is where:
            items += probe
        items.append(item)
    new = Bytecode(items)
    for attr in ("argcount", "posonlyargcount", "kwonlyargcount", "flags", "first_lineno", "name", "qualname",
                 "filename", "docstring", "argnames"):
        setattr(new, attr, getattr(bc, attr))
    new.cellvars, new.freevars = list(bc.cellvars), list(bc.freevars)
    return new.to_code(stacksize=code.co_stacksize + 3, compute_exception_stack_depths=False)


def outcome(thunk):
    LOG.clear()
    try:
        result = ("return", thunk())
    except Exception as e:  # noqa: BLE001 - the exception is the outcome
        result = ("raise", type(e), str(e))
    return result, list(LOG)


def resume_at(fn, offset: int, args_factory, cells_as_values: bool = False):
    """Stop ``fn`` at ``offset`` (None if never reached), then finish it in the resume function."""
    code = fn.__code__
    depth = bg.stack_depth_at(code, offset)
    sink: list = []
    stopper = types.FunctionType(_snapshot_code(code, offset, depth, sink), fn.__globals__, fn.__name__,
                                 fn.__defaults__, fn.__closure__)
    stopper.__kwdefaults__ = fn.__kwdefaults__
    args, kwargs = args_factory()
    LOG.clear()
    try:
        stopped = stopper(*args, **kwargs) is STOP and sink
    except Exception:  # noqa: BLE001 - raised before reaching the offset
        stopped = False
    if not stopped:
        return None
    frame_locals = sink[0]
    nulls = [k for k in range(depth) if f"__snap_s{k}" not in frame_locals]
    stack = [frame_locals[f"__snap_s{k}"] for k in range(depth) if k not in nulls]
    names = [n for n in code.co_varnames if n in frame_locals and n not in code.co_cellvars]
    values = [frame_locals[n] for n in names]
    for c in code.co_cellvars:
        cell = frame_locals[f"__snap_cell_{c}"]
        if not cells_as_values:
            names.append(c)
            values.append(cell)
        elif c in frame_locals:  # bound: pass the value, the prologue makes a fresh cell
            names.append(c)
            values.append(cell.cell_contents)
    passed = [] if cells_as_values else list(code.co_cellvars)
    rc = bg.make_resume_code(code, offset, depth, names, null_positions=nulls, passed_cells=passed)
    assert rc.argnames[len(stack):] == tuple(names) and len(rc.argnames) == len(stack) + len(names)
    resumed = types.FunctionType(rc.code, fn.__globals__, rc.code.co_name, None, fn.__closure__)
    prefix = list(LOG)

    def run():
        LOG[:] = prefix
        return resumed(*stack, *values)

    return outcome(run), nulls


def check_all_offsets(fn, args_factory=lambda: ((), {}), min_reached=5, **kw):
    """Resume at every offset reached by this call; return how many offsets were checked."""
    args, kwargs = args_factory()
    expected = outcome(lambda: fn(*args, **kwargs))
    reached = 0
    for offset in bg.resume_offsets(fn.__code__):
        got = resume_at(fn, offset, args_factory, **kw)
        if got is None:
            continue
        reached += 1
        assert got[0] == expected, f"{fn.__name__} resumed at {offset} (NULL slots {got[1]})\n" + "\n".join(
            f"{'>>' if i.offset == offset else '  '} {i.offset:4} {i.opname} {i.argrepr}"
            for i in dis.get_instructions(fn))
    assert reached >= min_reached, f"only {reached} offsets of {fn.__name__} were reached"
    return reached


# -- programs ----------------------------------------------------------------------------------------------
def g(x):
    return log("g", x) + 1 if isinstance(x, int) else x


def h(x, *, k=0, m=1):
    log("h", x, k, m)
    return x * m + k


class Box:
    def __init__(self, v):
        self.v = v

    def get(self, plus=0):
        log("get", self.v)
        return self.v + plus

    def __eq__(self, other):
        return isinstance(other, Box) and other.v == self.v


class CM:
    def __init__(self, name, swallow=False):
        self.name, self.swallow = name, swallow

    def __enter__(self):
        log("enter", self.name)
        return self

    def __exit__(self, typ, val, tb):
        log("exit", self.name, typ)
        return self.swallow


def straight(a, b):
    x = g(a) + h(b, k=a)
    y = Box(x).get(plus=b)
    log("y", y)
    z = [a, b, *[x, y]]
    return {"x": x, "y": y, "z": z, "s": f"{x}-{y!r}"}


def branches(a, b):
    if a > b:
        r = log("gt", a - b)
    elif a == b or b < 0:
        r = log("eq-or-neg", a)
    else:
        r = -1 if a < 0 else (a and b) or 7
    while r < 20:
        r += g(1)
        if r % 3 == 0:
            continue
        log("r", r)
    return r if not (0 < a < b) else -r


def loops(xs):
    total = 0
    for i, x in enumerate(xs):
        if i < 2:
            continue
        for j in range(x):
            if j == 2:
                break
            total += h(j, m=i)
        else:
            log("no break", i)
    log("total", total)
    return total


def with_blocks(n):
    out = []
    with CM("a") as a:
        log("in a", a.name)
        for i in range(n):
            with CM(f"b{i}"):
                if i >= 1:
                    out.append(g(i))
    with CM("swallow", swallow=True):
        g(n)
        raise KeyError(n)
    log("after swallow")
    return out


def try_blocks(x):
    try:
        log("try", x)
        y = 10 // x
    except ZeroDivisionError as e:
        log("caught", str(e))
        y = -1
    else:
        log("else", y)
    finally:
        log("finally")
    try:
        try:
            if y < 0:
                raise ValueError(y)
            r = g(y)
        finally:
            log("inner finally", y)
    except (ValueError, TypeError) as e:
        log("outer caught", type(e).__name__)
        r = h(y, k=3)
    return r


def raises_later(x):
    y = g(x)
    with CM("c"):
        z = h(y, k=1)
    if z > 3:
        raise ValueError(f"too big: {z}")
    return z


def try_return_in_finally(xs):
    for x in xs:
        try:
            if x == 2:
                return log("ret", x)
            log("x", x)
        finally:
            log("fin", x)
            if x == 3:
                break
    return "end"


def closures(a):
    y = a * 2

    def inner(k):
        return y + k + a

    log("inner", inner(1))
    y = g(y)
    r = inner(2)

    def bump():
        nonlocal y
        y += 100

    bump()
    return r, inner(0), y


def make_counter(start):
    count = start
    step = 2

    def counter(n):
        nonlocal count
        acc = []
        for _ in range(n):
            count += step
            acc.append(g(count))
        return acc, count

    return counter


def varargs(a, *args, k=3, **kwargs):
    s = a + sum(args) + k
    log("s", s)
    for name, v in sorted(kwargs.items()):
        s += h(v, k=len(name))
    return s, args, kwargs


def comprehensions(xs):
    x = "outer"
    ys = [x * 2 for x in xs if g(x) > 1]
    d = {k: g(k) for k in xs}
    s = {z % 3 for z in ys}
    gen = sum(g(w) for w in xs)
    return x, ys, d, s, gen


def comprehension_unbound_outer(xs):
    ys = [log("c", v) for v in xs]  # v is unbound outside: 3.12 saves NULL on the stack
    return ys, [b for b in [v * 2 for v in ys]]


def calls_and_methods(b):
    box = Box(b)
    r = box.get(plus=g(b))
    r += h(box.get(), k=box.v, m=2)
    args = (r, )
    r2 = h(*args, **{"k": 1})
    return max(r, r2, key=lambda t: -t), sorted([3, 1, 2], reverse=True)


def data_ops(seq):
    a, *rest = seq
    d = {"a": a, **{"n": len(rest)}}
    d["a"] += g(a)
    lst = list(seq)
    lst[1:3] = [g(0)]
    first, second = lst[0], lst[-1]
    del lst[0]
    assert first <= 100, "first too big"
    t = (first, second) if 0 < a < 10 < 20 else None
    if (n := len(lst)) > 2:
        log("walrus", n)
    return d, lst, t, rest[::2], n


def matcher(cmd):
    match cmd:
        case ["go", direction] if direction in ("n", "s"):
            r = g(1)
        case ["go", _]:
            r = log("bad direction")
        case {"x": x, **rest}:
            r = h(x, k=len(rest))
        case Box(v=v):
            r = g(v)
        case _:
            r = None
    return r


def long_jumps(n):
    # enough code between a loop's head and its end that jumps need EXTENDED_ARG
    t = 0
    for i in range(n):
        if i % 2:
            t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2  # noqa: E702
            t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2  # noqa: E702
            t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2  # noqa: E702
            t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2  # noqa: E702
            t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2  # noqa: E702
            t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2; t += i; t -= 1; t *= 2  # noqa: E702
            t %= 1000003
        else:
            t = g(t)
    return t


def global_and_del(x):
    global COUNTER
    COUNTER = COUNTER + g(x)
    y = x
    del x
    try:
        return x  # noqa: F821 - UnboundLocalError on purpose
    except UnboundLocalError:
        return y, COUNTER


COUNTER = 0


def with_raise_caught(x):
    try:
        with CM("outer"):
            with CM("inner"):
                g(x)
                if x > 1:
                    raise IndexError(x)
                r = log("no raise", x)
            return r  # return inside with: both __exit__ run first
    except IndexError as e:
        log("caught", e.args)
        return -x
    finally:
        log("finally")


class Base:
    def describe(self, k):
        return log("base", k)


class Derived(Base):
    def describe(self, k):  # zero-argument super(): __class__ is a free variable
        head = g(k)
        return super().describe(head) + super().describe(k + 1) * 2


def comp_closure_cells(xs):
    fns = [lambda: x * 10 for x in xs]  # x is a cell inside the (3.12: inlined) comprehension
    x = g(len(fns))
    return [f() for f in fns], x


def nested_calls(a, b, c):
    return h(g(a), k=g(b), m=h(g(c), k=h(1, m=g(a)))) + len([g(a), *[g(b)], *(g(c),)])


def _fresh_global(x):
    def factory():
        global COUNTER
        COUNTER = 0
        return (x,), {}
    return factory


def _a(*args, **kwargs):
    return lambda: (args, kwargs)


counter = make_counter(10)


def _fresh_counter(n):
    """``counter`` keeps state in its closure: restart it at 10 before each run."""
    def factory():
        dict(zip(counter.__code__.co_freevars, counter.__closure__))["count"].cell_contents = 10
        return (n,), {}
    return factory


PROGRAMS = [
    (straight, _a(3, 4)), (straight, _a(-1, 2)),
    (branches, _a(5, 2)), (branches, _a(2, 2)), (branches, _a(1, 3)), (branches, _a(-2, 3)), (branches, _a(0, 0)),
    (loops, _a([3, 1, 4, 1, 5])), (loops, _a([])),
    (with_blocks, _a(3)),
    (try_blocks, _a(2)), (try_blocks, _a(0)), (try_blocks, _a("s")),
    (raises_later, _a(1)), (raises_later, _a(5)),
    (try_return_in_finally, _a([1, 2])), (try_return_in_finally, _a([1, 3, 2])),
    (closures, _a(5)),
    (counter, _fresh_counter(3)),
    (varargs, _a(1, 2, 3, k=4, beta=5, alpha=6)), (varargs, _a(1)),
    (comprehensions, _a([1, 2, 3])),
    (comprehension_unbound_outer, _a([4, 5])),
    (calls_and_methods, _a(4)),
    (data_ops, _a([5, 6, 7, 8, 9])), (data_ops, _a([500, 1, 2])),
    (matcher, _a(["go", "n"])), (matcher, _a(["go", "x"])), (matcher, _a({"x": 3, "y": 4})),
    (matcher, _a(Box(7))), (matcher, _a(42)),
    (long_jumps, _a(5)),
    (with_raise_caught, _a(1)), (with_raise_caught, _a(2)),
    (Derived.describe, _a(Derived(), 3)),
    (comp_closure_cells, _a([1, 2, 3])),
    (nested_calls, _a(1, 2, 3)),
    (global_and_del, _fresh_global(2)),
]


@pytest.mark.parametrize("fn, args_factory", PROGRAMS, ids=lambda p: getattr(p, "__qualname__", ""))
def test_resume_everywhere(fn, args_factory):
    check_all_offsets(fn, args_factory, min_reached=3)


def test_long_jumps_use_extended_arg():
    ops = [i.opname for i in dis.get_instructions(long_jumps)]
    assert "EXTENDED_ARG" in ops
    ext = [i.offset for i in dis.get_instructions(long_jumps) if i.opname == "EXTENDED_ARG"]
    # the prefix offset and the instruction offset name the same resume point
    offsets = bg.resume_offsets(long_jumps.__code__)
    assert ext[0] in offsets and ext[0] + 2 in offsets
    assert offsets[ext[0]] == offsets[ext[0] + 2]


def test_cells_passed_as_values():
    # without closures made before the break, values are enough: the prologue makes the cells
    def f(a):
        y = g(a)
        z = h(y)

        def inner():
            return y + z
        return inner() + a

    check_all_offsets(f, _a(3), cells_as_values=True)


def test_cell_shared_with_closure_made_before_break():
    def f(a):
        y = a

        def read():
            return y
        y = g(y)  # resume right after this CALL: `read` must see the resumed function's writes to y
        y += 10
        return read()

    call = [i for i in dis.get_instructions(f) if i.opname == "CALL"][0]  # g(y)
    after = next(i.offset for i in dis.get_instructions(f) if i.offset > call.offset)
    cell = types.CellType(5)
    read = types.FunctionType(f.__code__.co_consts[1] if isinstance(f.__code__.co_consts[1], types.CodeType)
                              else next(c for c in f.__code__.co_consts if isinstance(c, types.CodeType)),
                              globals(), "read", None, (cell,))
    rc = bg.make_resume_code(f.__code__, after, 1, ["a", "read", "y"], passed_cells=["y"])
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    assert resumed(g(5), 5, read, cell) == f(5) == 16
    assert cell.cell_contents == 16
    with pytest.raises(TypeError, match="passed_cells"):
        resumed(g(5), 5, read, 5)  # a value where a cell was promised: an error, not a crash
    by_value = bg.make_resume_code(f.__code__, after, 1, ["a", "read", "y"])
    cell.cell_contents = 5
    assert types.FunctionType(by_value.code, globals())(g(5), 5, read, 5) == 5  # `read` keeps the old cell
    with pytest.raises(ValueError, match="passed_cells"):
        bg.make_resume_code(f.__code__, after, 1, ["a", "read"], passed_cells=["y"])


# -- the way the frontend uses it: values known from the source ------------------------------------------
def test_resume_after_call_in_loop_body():
    def f(xs, k):
        total = 0
        for v in xs:
            total += g(v) * k  # graph break at this call
        return total, log("done")

    call = next(i for i in dis.get_instructions(f) if i.opname == "CALL")
    after = next(i.offset for i in dis.get_instructions(f) if i.offset > call.offset)
    # stack: iterator, total, result of g(v)   (CALL consumed NULL/g/v)
    assert bg.stack_depth_at(f.__code__, after) == 3
    rc = bg.make_resume_code(f.__code__, after, 3, ["xs", "k", "v"])
    assert rc.code.co_name == f"__resume_at_{after}_f" and rc.argnames == ("___stack0", "___stack1", "___stack2",
                                                                        "xs", "k", "v")
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    xs = [1, 2, 3, 4]
    it = iter(xs)
    next(it), next(it)  # the break is at g(2), in the second iteration; total was g(1) * 10 == 20
    expected = outcome(lambda: f(xs, 10))
    g_result = g(2)
    got = outcome(lambda: resumed(it, 20, g_result, xs, 10, 2))
    assert got[0] == expected[0] == ("return", (140, "done"))
    assert got[1] == [("g", 3), ("g", 4), ("done",)]


def test_resume_with_null_slot_mid_call():
    def f(a):
        return h(a, g(a), k=a)  # break at g(a): NULL and h are already on the stack

    ins = list(dis.get_instructions(f))
    g_call = [i for i in ins if i.opname == "CALL"][0]
    after = next(i.offset for i in ins if i.offset > g_call.offset)
    assert bg.stack_depth_at(f.__code__, after) == 4  # NULL, h, a, g(a)
    rc = bg.make_resume_code(f.__code__, after, 4, ["a"], null_positions=[0])
    assert rc.argnames == ("___stack1", "___stack2", "___stack3", "a")
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    assert outcome(lambda: resumed(h, 3, 4, 3))[0] == outcome(lambda: f(3))[0]


def test_resume_between_kw_names_and_call():
    def f(a):
        return h(a, k=2, m=g(a))

    ins = list(dis.get_instructions(f))
    kw = next(i for i in ins if i.opname == "KW_NAMES")
    call = next(i for i in ins if i.offset > kw.offset and i.opname == "CALL")
    d = bg.stack_depth_at(f.__code__, call.offset)
    rc = bg.make_resume_code(f.__code__, call.offset, d, [], null_positions=[0])
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    assert outcome(lambda: resumed(h, 1, 2, 9))[0] == ("return", 1 * 9 + 2)


def test_resume_inside_except_body_needs_the_exception_being_handled():
    def f(x):
        try:
            return 1 / x
        except ZeroDivisionError:
            log("handling")  # break here
            raise

    off = next(i.offset for i in dis.get_instructions(f) if i.opname == "LOAD_GLOBAL" and i.argval == "log")
    d = bg.stack_depth_at(f.__code__, off)
    assert d == 1  # the previously handled exception, pushed by PUSH_EXC_INFO
    rc = bg.make_resume_code(f.__code__, off, d, ["x"])
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    try:
        1 / 0
    except ZeroDivisionError as e:
        caught = e
        with pytest.raises(ZeroDivisionError) as info:
            resumed(None, 0)
    assert info.value is caught
    assert sys.exc_info() == (None, None, None)  # POP_EXCEPT restored the state we passed


def test_traceback_shows_user_lines():
    def f(x):
        y = g(x)
        z = h(y)
        raise RuntimeError(f"bad {z}")

    call = [i for i in dis.get_instructions(f) if i.opname == "CALL"][1]
    after = next(i.offset for i in dis.get_instructions(f) if i.offset > call.offset)
    rc = bg.make_resume_code(f.__code__, after, 1, ["x", "y"])
    assert rc.code.co_filename == f.__code__.co_filename and rc.code.co_firstlineno == f.__code__.co_firstlineno
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    with pytest.raises(RuntimeError) as info:
        resumed(7, 1, 2)
    last = traceback.extract_tb(info.value.__traceback__)[-1]
    assert last.filename == f.__code__.co_filename and last.name == rc.code.co_name
    assert last.lineno == f.__code__.co_firstlineno + 3 and 'raise RuntimeError(f"bad {z}")' in last.line


def test_missing_live_local_is_unbound_local_error_not_a_crash():
    def f(a):
        b = g(a)
        return a + b

    call = next(i for i in dis.get_instructions(f) if i.opname == "CALL")
    after = next(i.offset for i in dis.get_instructions(f) if i.offset > call.offset)
    rc = bg.make_resume_code(f.__code__, after, 1, [])  # forgot "a"
    with pytest.raises(UnboundLocalError):
        types.FunctionType(rc.code, globals())(4)


def test_validation_and_cache():
    def f(a, *rest):
        return g(a) + len(rest)

    code = f.__code__
    call = next(i for i in dis.get_instructions(f) if i.opname == "CALL")
    after = next(i.offset for i in dis.get_instructions(f) if i.offset > call.offset)
    rc = bg.make_resume_code(code, after, 1, ["rest"])
    assert rc is bg.make_resume_code(code, after, 1, ("rest",))
    assert rc.code.co_flags & (0x4 | 0x8) == 0 and rc.code.co_argcount == 2  # *rest is a plain parameter
    assert types.FunctionType(rc.code, globals())(5, (1, 2)) == 7
    with pytest.raises(ValueError, match="stack depth at offset"):
        bg.make_resume_code(code, after, 2, ["rest"])
    with pytest.raises(ValueError, match="live locals"):
        bg.make_resume_code(code, after, 1, ["nope"])
    with pytest.raises(ValueError, match="NULL slots"):
        bg.make_resume_code(code, after, 1, ["rest"], null_positions=[1])
    with pytest.raises(ValueError, match="cannot resume at offset"):
        bg.stack_depth_at(code, after + 1)
    with pytest.raises(ValueError, match="cannot resume at offset"):
        bg.stack_depth_at(code, 0)  # the prologue

    async def coro():
        return 1

    with pytest.raises(ValueError, match="coroutines"):
        bg.resume_offsets(coro.__code__)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="generator resume code is built on Python 3.11 only "
                    "(break_frames.compilable_generator)")
def test_generator_resumes_after_a_yield():
    """A generator's resume code is a generator: called, it continues after the yield with the value sent in."""
    def gen(x, n):
        for i in range(n):
            got = yield x * i
            print("got", got)
        return "done"

    code = gen.__code__
    after = next(i.offset for i in dis.get_instructions(code) if i.opname == "YIELD_VALUE")
    after = next(i.offset for i in dis.get_instructions(code) if i.offset > after)
    depth = bg.stack_depth_at(code, after)
    assert depth == 2   # the loop's iterator, the value sent in
    rc = bg.make_resume_code(code, after, depth, ["x", "n", "i"])
    resumed = types.FunctionType(rc.code, gen.__globals__)(iter([5, 6]), "sent", 10, 7, 4)
    assert inspect.isgenerator(resumed)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert list(resumed) == [50, 60]
        with pytest.raises(StopIteration) as stop:
            g = types.FunctionType(rc.code, gen.__globals__)(iter(()), "last", 10, 7, 4)
            next(g)
    assert stop.value.value == "done"
    assert out.getvalue() == "got sent\ngot None\ngot None\ngot last\n"


def test_stdlib_functions_analyse_and_assemble():
    """The dataflow is consistent and resume code assembles for every function of a few stdlib modules."""
    import argparse
    import json.decoder
    import textwrap

    codes, built = [], 0
    for mod in (argparse, json.decoder, textwrap):
        for obj in vars(mod).values():
            for fn in [obj, *vars(obj).values()] if isinstance(obj, type) else [obj]:
                if isinstance(fn, types.FunctionType) and fn.__module__ == mod.__name__:
                    codes.append(fn.__code__)
    for code in codes:
        if code.co_flags & 0x3a0:  # generator / coroutine
            continue
        offsets = list(bg.resume_offsets(code).items())
        for offset, depth in offsets[:: max(1, len(offsets) // 4)]:
            rc = bg.make_resume_code(code, offset, depth, list(code.co_varnames), null_positions=range(depth))
            assert rc.code.co_name.startswith("__resume_at_")
            built += 1
    assert len(codes) > 100 and built > 300


def test_resume_of_a_resume_function():
    """A resume function breaks again: its own resume functions work the same way (offsets are its own)."""
    code = loops.__code__
    first_for = next(i for i in dis.get_instructions(loops) if i.opname == "FOR_ITER")
    rc = bg.make_resume_code(code, first_for.offset, 1, ["xs", "total"])  # loop head: the iterator is on the stack
    resumed = types.FunctionType(rc.code, globals(), rc.code.co_name)
    xs = [3, 1, 4, 1, 5]
    partly = lambda: ((iter(list(enumerate(xs))[1:]), xs, 0), {})  # noqa: E731 - after the first element
    assert outcome(lambda: resumed(*partly()[0]))[0] == outcome(lambda: loops(xs))[0]
    assert check_all_offsets(resumed, partly) > 20


def test_zero_argument_super_needs_self():
    code = Derived.describe.__code__
    call = next(i for i in dis.get_instructions(code) if i.opname == "CALL")  # g(k)
    after = next(i.offset for i in dis.get_instructions(code) if i.offset > call.offset)
    with pytest.raises(ValueError, match="super"):
        bg.make_resume_code(code, after, 1, ["k"])  # `self` is not read by any LOAD_FAST in 3.11, yet needed
    rc = bg.make_resume_code(code, after, 1, ["k", "self"])  # slot 0 is the stack value: the prologue fixes it
    LOG.clear()
    assert types.FunctionType(rc.code, globals(), None, None, Derived.describe.__closure__)(g(3), 3, Derived()) == 12
    assert LOG == [("g", 3), ("base", 4), ("base", 4)]


def _stdlib_programs():
    import difflib
    import json.decoder
    import posixpath
    import shlex
    import textwrap
    import urllib.parse

    wrapper = lambda: textwrap.TextWrapper(width=12)  # noqa: E731
    chunks = lambda: wrapper()._split_chunks("The quick brown fox jumps over the lazy dog, twice and again.")  # noqa
    return [
        (textwrap.TextWrapper._wrap_chunks, lambda: ((wrapper(), chunks()), {})),
        (shlex.shlex.read_token, lambda: ((shlex.shlex("a 'b c' \\\"d\\\" # e", posix=True),), {})),
        (difflib.SequenceMatcher.find_longest_match,
         lambda: ((difflib.SequenceMatcher(None, "abxcdefgh", "xxcdefab"), 0, 9, 0, 8), {})),
        (json.decoder.py_scanstring, lambda: (('"a\\nb\\u00e9\\"c" tail', 1), {})),
        (posixpath.normpath, lambda: (("/a//b/./c/../d/",), {})),
        (getattr(urllib.parse.urlsplit, "__wrapped__", urllib.parse.urlsplit),
         lambda: (("https://user@host:8080/p/a?q=1#frag",), {})),
    ]


@pytest.mark.parametrize("fn, args_factory", _stdlib_programs(), ids=lambda p: getattr(p, "__qualname__", ""))
def test_stdlib_function_resume_everywhere(fn, args_factory):
    """Real-world code: every reached offset of a few stdlib functions, resumed, gives the same result."""
    check_all_offsets(fn, args_factory, min_reached=10)
