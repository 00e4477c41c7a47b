"""A crash inside ember never reaches the user, and EMBER_CHECK=1 checks the first calls of every graph.

`compile_graph(cfg, gm, example_inputs)` is how the frontend turns a captured graph into what its entry calls;
`compile_backward` is the same for the backward graph autograd compiles on the first backward. The rule, here
for every backend:
- ember's own backends (a backend function with `fail_safe = True`: "ember", "aot_eager", "eager"): an exception
  while compiling a graph or during its first launch (decomposition, lowering, code generation, the C++ build, a
  Triton compile, a library kernel refusing a layout ember chose) runs the graph eagerly instead (the captured fx
  graph as it is), logged under EMBER_LOGS=fallbacks with the op where the compiler named it and the user's
  file:line, and saved as a repro under EMBER_REPRO_DIR (repro.py). That graph then runs eagerly on every call.
- the first launch is judged by eager: the inputs the compiled call may write (`compiled.written_inputs(args)`,
  the graph's input mutations) are copied before it and the RNG state kept; when it raises they are put back and
  the graph runs eagerly on the same inputs. Eager raising too means the error is the user's program's (an index
  out of range, a shape mismatch): eager's exception propagates, with eager's side effects, as without ember, and
  the compiled graph stays for the next call. A graph the backend already runs as it is (no `written_inputs`) is
  not wrapped: its errors are eager's.
- a user's backend (any other callable) is excluded, as under torch.compile: its errors reach the user
  (BackendCompilerFailed when compiling); with EMBER_REPRO_DIR set the graph is saved first.
- EMBER_CHECK=1 (read when a graph is compiled, so for every backend): the first EMBER_CHECK_CALLS (2) calls also run
  the graph eagerly and in float64 (checked.py) and report a divergence.
The switches are read from the environment when a graph is compiled or first called, never on later calls.
Wrapped graphs (`FirstCalls`) take themselves out of the entry's namespace once their first calls are done, so
nothing here runs on later calls, and nothing at all when the check is off and the backend is a user's.
EMBER_FAIL_SAFE=0 raises instead of falling back: repro scripts and ember's tests.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from ember.tools import checked, repro
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
STATS = {"compile_fallbacks": 0, "launch_fallbacks": 0, "user_errors": 0}   # for tests
# copies of the inputs a first launch may write go to the CPU past this size (an optimizer step writes every
# parameter and its state: a second copy on the GPU could run it out of memory)
SNAPSHOT_ON_DEVICE_BYTES = 1 << 30


def _on(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ("0", "", "false", "off", "no")


def checking() -> bool:
    return _on("EMBER_CHECK", "0")


def fail_safe_on() -> bool:
    return _on("EMBER_FAIL_SAFE", "1")


def is_fail_safe(backend: Callable) -> bool:
    """Whether a backend is one of ember's own (its crashes are ember's bugs, never the user's)."""
    while backend is not None:
        if getattr(backend, "fail_safe", False):
            return True
        backend = getattr(backend, "__wrapped__", None)
    return False


def compile_graph(cfg: Any, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """cfg.backend(gm, example_inputs), under the rule above. `cfg` has backend, backend_name, mode, options."""
    fail_safe = is_fail_safe(cfg.backend)
    target = repro.Target.of(cfg)
    try:
        compiled = cfg.backend(gm, example_inputs)
    except Exception as e:
        if not fail_safe or not fail_safe_on():
            repro.save(gm, example_inputs, "crash", e, target, "the backend raised while compiling")
            raise
        _fall_back(gm, example_inputs, e, "compiling", target)
        STATS["compile_fallbacks"] += 1
        return gm.forward
    checks = checked.calls() if checking() else 0
    launch_safe = fail_safe and callable(getattr(compiled, "written_inputs", None))
    if not checks and not launch_safe:
        return compiled
    return FirstCalls(compiled, gm, target, launch_safe, checks)


def compile_backward(compiler: Callable, gm: torch.fx.GraphModule, example_inputs: list, name: str,
                     settle: Callable[[Callable], None]) -> Callable:
    """The backward graph compiled (autograd calls this on the first backward): its compile and first launch under
    the fail-safe rule. A backward graph is functional (it writes none of its inputs), so a rerun is safe.
    `settle(f)` puts the final callable where autograd keeps it, once the first launch passed."""
    target = repro.Target(None, "ember", None, None)
    try:
        compiled = compiler(gm, example_inputs)
    except Exception as e:
        if not fail_safe_on():
            raise
        gm.meta.setdefault("ember_where", f"the backward of {name}")
        _fall_back(gm, example_inputs, e, "compiling the backward", target)
        STATS["compile_fallbacks"] += 1
        return gm.forward
    if compiled == gm.forward:   # (a bound method: equal, never the same object)
        return compiled
    gm.meta.setdefault("ember_where", f"the backward of {name}")
    first = FirstCalls(compiled, gm, target, True, 0, written=lambda args: [])
    first.settle = settle
    return first


class FirstCalls:
    """A compiled graph for its first calls: the first launch falls back to eager (`launch_safe`), and the first
    `checks` calls are compared with eager and float64. Once done it puts `compiled` (or the eager graph, after a
    fallback) into each namespace in `slots` (the frontend's entries call it through their global ___graph)."""

    def __init__(self, compiled: Callable, gm: torch.fx.GraphModule, target: "repro.Target", launch_safe: bool,
                 checks: int, written: Callable | None = None):
        self.compiled, self.gm, self.target = compiled, gm, target
        self.launch_safe, self.checks = launch_safe, checks
        self.written = written or getattr(compiled, "written_inputs", None)
        self.slots: list[dict] = []
        self.settle: Callable[[Callable], None] | None = None

    def __call__(self, *args):
        if self.checks:
            self.checks -= 1
            out = self._checked(args)
        else:
            out = self._launch(args)
        if not self.checks and not self.launch_safe:
            for ns in self.slots:
                if ns.get("___graph") is self:
                    ns["___graph"] = self.compiled
            if self.settle is not None:
                self.settle(self.compiled)
        return out

    def _launch(self, args: tuple):
        if not self.launch_safe or not fail_safe_on():
            return self.compiled(*args)
        before = _Snapshot(self.written(list(args)), args)
        try:
            out = self.compiled(*args)
        except Exception as e:
            before.restore()
            saved = repro.copies(args) if repro.directory() else None
            try:
                out = self.gm(*args)
            except Exception:   # eager raises too: the user's program's error, raised as eager raises it
                STATS["user_errors"] += 1
                raise
            _fall_back(self.gm, saved, e, "its first launch", self.target)
            STATS["launch_fallbacks"] += 1
            self.compiled, self.launch_safe = self.gm, False
            return out
        self.launch_safe = False
        return out

    def _checked(self, args: tuple):
        inputs = repro.copies(args)
        rng = checked.rng_state(args)
        out = self._launch(args)
        if self.compiled is self.gm:   # it fell back: eager is what ran
            return out
        after = checked.rng_state(args)
        try:
            report = checked.check(self.gm, inputs, rng, out, list(args), self.target.backend)
        except Exception as e:   # the check must not break the program it checks
            checked.log.warning("EMBER_CHECK could not check the graph captured from %s: %s: %s",
                                self.gm.meta.get("ember_where", "?"), type(e).__name__, e)
            report = None
        finally:
            checked.set_rng_state(after)
        if report is not None:
            path = repro.save(self.gm, inputs, "accuracy", None, self.target, report.summary)
            checked.log.warning("%s%s", report.text(self.gm), f"\nrepro saved in {path}" if path else
                                "\n(set EMBER_REPRO_DIR to save a repro; docs/when_results_differ.md)")
        return out


class _Snapshot:
    """The inputs a first launch may write, copied, and the RNG state: what eager's rerun starts from."""

    def __init__(self, written: list, args: tuple):
        tensors = [t for t in written if isinstance(t, torch.Tensor)]
        on_device = sum(t.numel() * t.element_size() for t in tensors) <= SNAPSHOT_ON_DEVICE_BYTES
        self.copies = [(t, t.detach().clone() if on_device else t.detach().to("cpu", copy=True)) for t in tensors]
        self.rng = checked.rng_state(args)

    def restore(self) -> None:
        with torch.no_grad():
            for t, c in self.copies:
                t.copy_(c)
        checked.set_rng_state(self.rng)


def _fall_back(gm: torch.fx.GraphModule, inputs: list | None, e: BaseException, stage: str,
               target: "repro.Target") -> None:
    where = gm.meta.get("ember_where", "?") if isinstance(getattr(gm, "meta", None), dict) else "?"
    path = repro.save(gm, inputs, "crash", e, target, f"ember raised while {stage}") if inputs is not None else None
    op = next((n for n in getattr(e, "__notes__", ()) if n.startswith("ember: while")), "")
    fallback_log.warning(
        "graph captured from %s runs eagerly: ember raised %s while %s: %s%s%s", where, type(e).__name__, stage,
        str(e)[:300], f" ({op[7:]})" if op else "",
        f"; repro saved in {path} (python -m ember minify {path})" if path else "; set EMBER_REPRO_DIR to keep a "
        "repro", exc_info=fallback_log.isEnabledFor(10))
