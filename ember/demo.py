"""python -m ember demo: the seed tutorial ("Introduction to torch.compile") run through ember.

Every example of the tutorial (foo, MyModule, f1, f2, f3 with scipy, bar with the tutorial's custom backend,
densenet121 inference and a training step) is compiled with ember on the best device present, checked against
eager with assert_close, and timed beside eager and torch.compile (default backend). A recording wrapper around
the backend counts the graphs and ops ember captured; ember.explain gives the graph breaks.

The torch.compile column comes from bench/frontend.py (ember/ itself may not touch torch.compile, see
tests/test_rules.py); run from the repository root, as `make demo` does, to get it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import time
import warnings
from typing import Any, Callable

import torch
from torch.testing import assert_close

import ember
from ember.backends import lookup_backend


# ---------------------------------------------------------------- the tutorial's code, as written there

def foo(x, y):
    a = torch.sin(x)
    b = torch.cos(y)
    return a + b


class MyModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(100, 10)

    def forward(self, x):
        return torch.nn.functional.relu(self.lin(x))


def f1(x, y):
    if x.sum() < 0:
        return -y
    return y


def f2(x, y):
    return x + y


def f3(x):
    import scipy.fft
    x = x * 2
    x = scipy.fft.dct(x.numpy())
    x = torch.from_numpy(x)
    x = x * 2
    return x


def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def custom_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    print("custom backend called with FX graph:")
    try:
        gm.graph.print_tabular()  # needs the `tabulate` package, as the tutorial says
    except ImportError:
        print(gm.graph)
    return gm.forward


def generate_data(b: int, device: str, size: int):
    # The tutorial uses 128x128 images and batch 16 on a GPU; smaller here so the demo stays short.
    return torch.randn(b, 3, size, size, device=device), torch.randint(1000, (b,), device=device)


def init_model(device: str):
    from torchvision.models import densenet121
    return densenet121().to(torch.float32).to(device)


def make_train(opt: torch.optim.Optimizer) -> Callable:
    def train(mod, data):
        opt.zero_grad(True)
        pred = mod(data[0])
        loss = torch.nn.CrossEntropyLoss()(pred, data[1])
        loss.backward()
        opt.step()
    return train


# ---------------------------------------------------------------- counting and timing

@dataclasses.dataclass
class Recorder:
    """Wraps a backend `(gm, example_inputs) -> callable` and keeps every graph it was given."""
    inner: Callable
    graphs: list = dataclasses.field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **mode_and_options):
        # (mode= and options= as ember.compile passes them on, like torch.compile: to backends that take them)
        self.graphs.append(gm)
        return self.inner(gm, example_inputs, **mode_and_options)

    @property
    def ops(self) -> int:
        return sum(n.op in ("call_function", "call_method", "call_module") for g in self.graphs for n in g.graph.nodes)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable, runs: int, device: str) -> float:
    times = []
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _why(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


@dataclasses.dataclass
class Case:
    """One example of the tutorial: how to build it under a compiler, and the calls that check it.

    build(compile) -> callable: `compile(fn_or_module, **kwargs)` is ember.compile (with a recording backend) or
    torch.compile; the returned callable takes one entry of `calls` and returns what is compared with eager.
    """
    name: str
    device: str
    build: Callable[[Callable], Callable]
    calls: list[tuple]
    explain: Callable[[], Any]  # ember.explain on the example's first call
    runs: int = 20
    backend: Callable | None = None  # the backend ember uses (the tutorial's custom backend for bar)
    torch_compile_skip: str = ""  # why torch.compile is not timed on the machine running the demo, if it is not
    # compare(expected, actual) -> the "equals eager" cell, raising AssertionError when they differ.
    compare: Callable[[Any, Any], str] = lambda expected, actual: assert_close(actual, expected) or "yes"


def _cases(device: str, size: int, batch: int, slow_cpu: bool) -> list[Case]:
    def fn_case(name, fn, calls, dev=device, **kw):
        return Case(name, dev, lambda compile: compile(fn), calls,
                    lambda: ember.explain(fn)(*calls[0]), **kw)

    r = lambda *shape, dev=device: torch.randn(*shape, device=dev)  # noqa: E731
    cases = [fn_case("foo", foo, [(r(10, 10), r(10, 10))])]

    def decorated(compile):
        @compile
        def opt_foo2(x, y):
            a = torch.sin(x)
            b = torch.cos(y)
            return a + b
        return opt_foo2
    xy = (r(10, 10), r(10, 10))
    cases.append(Case("@compile foo", device, decorated, [xy], lambda: ember.explain(foo)(*xy)))

    torch.manual_seed(0)
    mod = MyModule().to(device)
    x = r(10, 100)
    cases.append(Case("MyModule", device, lambda compile: compile(mod), [(x,)], lambda: ember.explain(mod)(x)))
    x1, y1 = r(5, 5), r(5, 5)
    cases.append(fn_case("f1 (both signs)", f1, [(x1, y1), (-x1, y1)]))
    cases.append(fn_case("f2 (y=3)", f2, [(r(5, 5), 3)]))
    cases.append(fn_case("f3 (scipy dct)", f3, [(r(5, 5, dev="cpu"),)], dev="cpu"))  # .numpy() needs CPU
    a, b = r(10), r(10)
    cases.append(fn_case("bar (custom_backend)", bar, [(a, b), (a, -b)], backend=custom_backend))

    skip = ("torch.compile not timed: inductor compiles densenet121 for minutes on a CPU with few cores; "
            "`python -m ember demo --full` times it" if slow_cpu else "")
    torch.manual_seed(0)
    data = generate_data(batch, device, size)
    torch.manual_seed(0)
    net = init_model(device).eval()

    def infer(compile):
        m = compile(net, mode="reduce-overhead")

        def call(x):
            with torch.no_grad():
                return m(x)
        return call
    cases.append(Case(f"densenet121 eval b{batch} {size}px", device, infer, [(data[0],)],
                      lambda: _no_grad(ember.explain(net), data[0]), runs=3 if device == "cpu" else 10,
                      torch_compile_skip=skip))

    def train_case(compile, dtype=torch.float32):
        torch.manual_seed(0)  # every copy starts from the same weights
        model = init_model(device).to(dtype)
        opt = torch.optim.Adam(model.parameters())
        step = compile(make_train(opt), mode="reduce-overhead")

        def call(x, target):
            step(model, (x.to(dtype), target))
            return [p.grad.detach().clone() for p in model.parameters()]  # this step's gradients (kept after it)
        return call

    reference = train_case(lambda f, **kw: f, torch.float64)(*data)  # the same step in float64, eagerly
    # eager float32 once more with another thread count: its sums in another order, as accurate a float32 result
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)
    try:
        other_order = train_case(lambda f, **kw: f)(*data)
    finally:
        torch.set_num_threads(threads)

    def grads_as_accurate_as_eager(eager_grads: list, grads: list) -> str:
        """Whether ember's gradients are about as close to the float64 ones as eager float32's are.

        assert_close against eager float32 cannot decide it here: through 120 BatchNorms in train mode over few
        values (batch 2, 2x2 pixels at the end), eager float32's own gradients are off from float64 by up to
        tens of percent (relative to each parameter's largest gradient), and any reordering of float sums moves
        them by as much. (The weights after Adam's first step differ by 2*lr wherever a near-zero gradient
        flips sign, so comparing them decides nothing either.) Eager float32's own error depends on its
        summation order: on this model one thread count's and another's differ per parameter by up to the
        factor below. So eager's error is taken as the larger of two orders (this run's
        thread count and another). Fails if any parameter's gradient is much further from float64 under ember
        (> 30x and > 1e-3 relative) than under eager float32.
        """
        def errors(gs):
            return [((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                    for g, r in zip(gs, reference)]
        e = [max(a, b) for a, b in zip(errors(eager_grads), errors(other_order))]
        m = errors(grads)
        worse = [i for i in range(len(e)) if m[i] > 1e-3 and m[i] > 30 * e[i]]
        summary = (f"gradients vs float64, largest relative error over {len(e)} parameters: ember {max(m):.1e}, "
                   f"eager float32 {max(e):.1e}")
        assert not worse, f"{len(worse)} parameters' gradients much less accurate than eager's: {summary}"
        return f"yes ({summary})"

    def explain_train():
        torch.manual_seed(0)
        model = init_model(device)
        return ember.explain(make_train(torch.optim.Adam(model.parameters())))(model, data)
    cases.append(Case(f"densenet121 train step b{batch} {size}px", device, train_case, [data],
                      explain_train, runs=3 if device == "cpu" else 10, torch_compile_skip=skip,
                      compare=grads_as_accurate_as_eager))
    return cases


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def _torch_compile_baseline():
    """torch.compile and its reset, from bench/frontend.py (None with the reason when not importable)."""
    try:
        from bench.frontend import torch_compiled, torch_reset
        return torch_compiled, torch_reset
    except Exception as e:
        return None, f"n/a (bench/frontend.py not importable: run from the repository root; {type(e).__name__})"


# ---------------------------------------------------------------- running a case

def run_case(case: Case, baseline) -> list[str]:
    identity = lambda f, **kw: f  # noqa: E731  (eager: the function itself)
    eager = case.build(identity)

    ember.reset()
    rec = Recorder(case.backend or lookup_backend("ember"))
    compiled = None
    try:
        compiled = case.build(lambda f, **kw: ember.compile(f, backend=rec, **kw))
        for args in case.calls:
            torch.manual_seed(1)
            expected = eager(*args)
            torch.manual_seed(1)
            actual = compiled(*args)
            equal = case.compare(expected, actual)
    except AssertionError as e:  # ran, but differs: still timed (the table says it is wrong)
        equal = f"no ({_why(e)})"
    except Exception as e:  # did not run: nothing to time
        equal, compiled = f"no ({_why(e)})", None
    graphs, ops = len(rec.graphs), rec.ops
    try:
        breaks = str(case.explain().graph_break_count)
    except Exception as e:
        breaks = f"n/a ({type(e).__name__})"

    t_eager = median_ms(lambda: eager(*case.calls[0]), case.runs, case.device)
    t_ember = _ms(median_ms(lambda: compiled(*case.calls[0]), case.runs, case.device)) if compiled is not None else "n/a"
    compile_torch, reset_torch = baseline
    if compile_torch is None:
        t_torch = reset_torch  # the reason
    elif case.torch_compile_skip:
        t_torch = f"n/a ({case.torch_compile_skip})"
    else:
        try:
            reset_torch()
            tc = case.build(lambda f, **kw: compile_torch(f, **kw))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tc(*case.calls[0])  # compile
                tc(*case.calls[0])  # warm (reduce-overhead records CUDA graphs on the first calls)
                t_torch = _ms(median_ms(lambda: tc(*case.calls[0]), case.runs, case.device))
        except Exception as e:
            t_torch = f"n/a ({_why(e)})"
    return [case.name, case.device, equal, str(graphs), breaks, str(ops), _ms(t_eager), t_torch, t_ember]


def table(header: list[str], rows: list[list[str]]) -> str:
    """Plain-text table; a cell with a long explanation ("n/a (why)", "no (error)") shows "n/a [k]" and its
    text goes into footnote k below the table, so that the columns stay narrow."""
    notes: list[str] = []

    def short(c: str) -> str:
        if len(c) <= 24 or " (" not in c:
            return c
        head, why = c.split(" (", 1)
        why = why[:-1] if why.endswith(")") else why
        if why not in notes:
            notes.append(why)
        return f"{head} [{notes.index(why) + 1}]"

    cells = [header] + [[short(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    lines = [fmt(cells[0]), "-" * (sum(w) + 2 * len(w) - 2)] + [fmt(r) for r in cells[1:]]
    return "\n".join(lines + [f"[{i + 1}] {n}" for i, n in enumerate(notes)])


def machine(device: str) -> str:
    gpu = f", {torch.cuda.get_device_name()}" if device == "cuda" else ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = (f"\nnote: load average {load:.1f} on {os.cpu_count()} CPUs: other processes share them, so CPU "
            f"timings are noisy" if device == "cpu" and load > 0.75 * (os.cpu_count() or 1) else "")
    return (f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs{gpu}, torch threads "
            f"{torch.get_num_threads()}, load {load:.1f}), Python {platform.python_version()}, torch "
            f"{torch.__version__}, {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}{busy}")


def _ms(t: float) -> str:
    return f"{t:.3f}" if t < 1 else f"{t:.1f}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m ember demo", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full", action="store_true", help="also time torch.compile on densenet121 on a CPU")
    p.add_argument("--size", type=int, default=None, help="densenet121 image size (default: 64 on CPU, 128 on GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: 1 on a CPU with at most 4 cores, where OpenMP threads that "
                        "wait for each other on a shared machine make small ops take milliseconds; else torch's)")
    p.add_argument("--batch", type=int, default=None, help="densenet121 batch (default: 2 on CPU, 16 on GPU)")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    threads = a.threads or (1 if cpu and (os.cpu_count() or 1) <= 4 else None)
    if threads:
        torch.set_num_threads(threads)
    cpu = a.device == "cpu"
    size, batch = a.size or (64 if cpu else 128), a.batch or (2 if cpu else 16)
    print(f"ember demo: the torch.compile tutorial's examples on {a.device}\n{machine(a.device)}\n", flush=True)
    baseline = _torch_compile_baseline()
    rows = []
    for case in _cases(a.device, size, batch, slow_cpu=cpu and not a.full):
        print(f"-- {case.name}", flush=True)
        rows.append(run_case(case, baseline))
    print()
    print(table(["example", "device", "equals eager", "graphs", "breaks", "ops", "eager ms", "torch.compile ms",
                 "ember ms"], rows))
    print("\ngraphs/ops: captured by ember (recording wrapper around the backend: 'ember', or the tutorial's "
          "custom_backend for bar), over all checking calls; breaks: ember.explain on the first call.\n"
          "times: median of a few calls after the first (compilation excluded); torch.compile with its default "
          "backend and the tutorial's mode.")
    return 0 if all(r[2].startswith("yes") for r in rows) else 1
