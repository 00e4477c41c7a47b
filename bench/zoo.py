"""Model zoo: ember against eager and torch.compile(backend="eager") on every torchvision classification model and
50+ transformers architectures (bench/zoo_models.py), in eval and train mode.

    .venv/bin/python bench/zoo.py [--models sub,...] [--mode eval|train|both] [--backend ember|eager]
                                  [--device cpu|cuda] [--shard i/n] [--jobs N] [--budget S] [--timeout S]
                                  [--recount-torch] [--json FILE]
    .venv/bin/python bench/zoo.py --merge a.json b.json ...     # one table and summary from shards' JSON

Each (model, mode) row:
- counts: graphs, graph breaks and captured ops (call_function/call_method/call_module nodes of the graphs, less
  calls that compute nothing: NOT_OPS, torch's API-usage logging, which torch.compile records in its graphs; for
  ember, plus the ops it captured and then dropped as dead, the "dead" column: torch.compile's graphs keep them) of
  ember (ember.explain with the chosen backend) and of torch.compile (torch._dynamo.explain, the eager backend),
  with each one's first break reason and the user's file:line. torch.compile's counts are cached per torch version
  in bench/zoo_counts/torch-<version>.json (recomputed only with --recount-torch or when missing).
- equal: eval runs forward under torch.no_grad and compares ember's outputs with eager's (assert_close at its
  default tolerances, dtypes, keys and output types included). train runs forward + backward of a scalar (the sum
  of mean(output * fixed random weights) over the floating outputs; on the GPU ember compiles the three as one
  function, a training step whose backward runs inside ember's graph; on the CPU the model) and compares the outputs and the mutated
  buffers with eager float32 (same check), and every parameter's gradient with a float64 eager run (same weights,
  same dropout masks, float inputs cast): over all gradients together, ember at most twice as far from float64
  (2-norm) as eager float32 is, and each parameter's gradient within 10x eager float32's error plus a small
  allowance (check_grads has the bounds and why); eager float32's error there is the largest over the main
  eager run and eager_variants' runs in other summation orders (2 threads; channels_last for image inputs). An output (either mode) or buffer that fails assert_close
  with the same structure passes if it is at most twice as far from a float64 eager run as eager float32 is, plus
  1e-5 of the largest float64 value (within_f64); such rows say "yes (vs float64)". Large outputs need it:
  random-weight resnet34's logits reach 42, and a different summation order is off by 4e-5 there.
- f64 ratio (every row, both modes): ember's error against a float64 run of the same model (same weights and
  inputs, TF32 off for it) over eager float32's, err = max|x - f64| over the floating outputs (train: the larger
  of that and the gradients' 2-norm error ratio of check_grads); eager's error is floored at 1e-6 of the largest
  float64 value, so an output eager gets exactly does not divide by zero. The rule: ember passes when the ratio
  is at most F64_RATIO (2): as close to the exact result as eager float32 is, within a factor of two. The table
  has it per row, the summary its distribution and the rows over it. On CUDA, eager and ember both run under
  torch's default TF32 settings (cuDNN convolutions in TF32), which is what the ratio measures against. In eval,
  eager float32's error is the largest over the main run and the same eager_variants orders as train's gradients
  (2 threads; channels_last for image inputs): on CUDA, cuDNN takes TF32 algorithms for some channels-last
  convolutions it runs exactly in NCHW, so a compiler that lays a network out channels-last is off by TF32's
  rounding exactly as eager channels-last is.
- --backend ember (default): the whole pipeline (autograd, decompositions, codegen); --backend eager: ember's
  frontend alone (its captured graphs run as they are), fast, for counts.
Every row runs in a worker process with a per-row timeout: a crash or timeout is a row, not an abort; --jobs
runs that many workers at once (a GPU machine's cores compile in parallel), --budget stops starting rows after
that many seconds (the rows not run are listed), so a shard fits a time limit.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import fcntl
import json
import os
import pathlib
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
COUNTS_DIR = ROOT / "bench" / "zoo_counts"
RESULT_TAG = "@@ZOO "
SITE = "site-packages/"


# ---------------------------------------------------------------- helpers run inside a worker

def short_path(path: str) -> str:
    """A file under site-packages or this repository, by its path from there."""
    if SITE in path:
        return path.split(SITE, 1)[1]
    return os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else path


# Graph calls that compute nothing: torch.compile records torch's API-usage logging (torchvision ops call it) as a
# call_function node, ember drops it at capture. Counting it would score a compiler for recording a no-op.
NOT_OPS = ("_log_api_usage_once",)


def op_count(gm, all_calls: bool = False) -> int:
    """call_function/call_method/call_module nodes of a graph, those in NOT_OPS left out unless all_calls."""
    return sum(n.op in ("call_function", "call_method", "call_module")
               and (all_calls or getattr(n.target, "__name__", str(n.target)) not in NOT_OPS)
               for n in gm.graph.nodes)


def tensors(out) -> list:
    """The tensors of a nested output (tuples, lists, dicts, HF ModelOutputs), in order."""
    import torch
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    return []


def skeleton(out):
    """The output with each tensor replaced by its shape and dtype: containers, keys and types kept."""
    import torch
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else t, out)


def scalar_loss(out, weights: list | None = None):
    """The scalar train mode differentiates: sum over the floating outputs that carry a gradient of mean(t * w),
    w fixed random weights of t's shape (the same in float32 and float64 runs; `weights`: loss_weights(out),
    made ahead). A plain mean would be degenerate: the mean of a LayerNorm's output does not depend on its input,
    so most gradients would be rounding noise."""
    import torch
    ts = [t for t in tensors(out) if t.is_floating_point() and t.requires_grad]
    if not ts:
        raise ValueError("no floating output carries a gradient")
    total = 0
    for t, w in zip(ts, weights if weights is not None else loss_weights(out)):
        term = t * w.to(t.device, t.dtype)
        total = total + (term.mean() if t.dtype == torch.float64 else term.float().mean())
    return total


def loss_weights(out) -> list:
    """scalar_loss's weights for out's floating outputs that carry a gradient, on their devices and dtypes."""
    import torch
    ts = [t for t in tensors(out) if t.is_floating_point() and t.requires_grad]
    return [torch.randn(t.shape, generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64).to(
        t.device, t.dtype) for i, t in enumerate(ts)]


def forward_backward(m, kw: dict, weights: list | None = None):
    """The model's outputs after the forward and the backward of scalar_loss."""
    out = m(**kw)
    scalar_loss(out, weights).backward()
    return out


def within_f64(actual, eager32, f64) -> tuple[bool, str]:
    """ember at most twice as far from float64 as eager float32 (a tensor, or a list of eager runs in different
    summation orders: the largest of their errors), plus 1e-5 of the largest float64 value."""
    f64 = f64.detach()
    err_e = (actual.detach().double() - f64).abs().max().item()
    err_32 = max((e.detach().double() - f64).abs().max().item() for e in _runs(eager32))
    scale = f64.abs().max().item()
    ok = err_e <= 2 * err_32 + 1e-5 * scale
    return ok, f"err {err_e:.2e} vs eager32 {err_32:.2e} (max|f64| {scale:.2e})"


F64_RATIO = 2.0      # ember passes when its error against float64 is at most this multiple of eager float32's
F64_FLOOR = 1e-6     # eager's error floored at this fraction of the largest float64 value (module doc)


def _runs(eager32) -> list:
    return eager32 if isinstance(eager32, list) else [eager32]


def _transposed(eager32s: list) -> list:
    """Eager runs' outputs (a list of nested outputs) as, per output tensor, the list of its runs' values."""
    return [list(ts) for ts in zip(*(tensors(o) for o in eager32s))]


def f64_ratio(actual, eager32, f64, variants: list = ()) -> float | None:
    """ember's error against float64 over eager float32's (the largest over eager32 and the outputs of eager runs
    in other summation orders, `variants`), over the floating output tensors (the worst), or None when there is
    none to compare."""
    worst = None
    for a, e32s, e64 in zip(tensors(actual), _transposed([eager32, *variants]), tensors(f64)):
        if not (a.is_floating_point() and e64.is_floating_point()) or a.shape != e64.shape or a.numel() == 0:
            continue
        e64 = e64.detach()
        err_e = (a.detach().double() - e64).abs().max().item()
        err_32 = max((e32.detach().double() - e64).abs().max().item() for e32 in e32s)
        ratio = err_e / max(err_32, F64_FLOOR * e64.abs().max().item(), 1e-30)
        worst = ratio if worst is None or not ratio <= worst else worst   # (a NaN error is the worst)
    return worst


def run_f64(model, kwargs, fn=None):
    """The model's output (or fn(model, kwargs)'s) in float64: a copy cast, floating inputs cast, TF32 off."""
    import torch
    m64 = model if next(model.parameters(), torch.empty(0)).dtype == torch.float64 else copy.deepcopy(model).double()
    kw64 = {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(100)
        return m64(**kw64) if fn is None else fn(m64, kw64)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def values_vs_f64(actual, eager32, f64, variants: list = ()) -> str | None:
    """None when every floating output tensor passes within_f64 (against eager32 and the eager `variants`' outputs),
    else the first that does not."""
    for i, (a, e32, e64) in enumerate(zip(tensors(actual), _transposed([eager32, *variants]), tensors(f64))):
        if a.is_floating_point():
            ok, msg = within_f64(a, e32, e64)
            if not ok:
                return f"output {i}: {msg}"
    return None


def same(expected, actual) -> str | None:
    """None when assert_same (the test suite's comparison) passes, else its message's first line."""
    from model_zoo import assert_same
    try:
        assert_same(expected, actual)
        return None
    except AssertionError as e:
        return str(e).strip().split("\n")[0][:160]


def first_torch_break(explained) -> str:
    if not explained.break_reasons:
        return ""
    b = explained.break_reasons[0]
    where = f" at {short_path(b.user_stack[-1].filename)}:{b.user_stack[-1].lineno}" if b.user_stack else ""
    return f"{b.reason.strip().splitlines()[0][:200]}{where}"


def first_ember_break(explained) -> str:
    if not explained.break_reasons:
        return ""
    b = explained.break_reasons[0]
    where = b.where
    if ":" in where:
        f, line = where.rsplit(":", 1)
        where = f"{short_path(f)}:{line}"
    return f"{b.reason.strip().splitlines()[0][:200]} at {where}"


def _build(name: str, train: bool, device: str = "cpu"):
    import torch
    import zoo_models
    torch.manual_seed(0)
    model, kwargs = zoo_models.all_models()[name]()
    return model.to(device).train(train), {k: v.to(device) for k, v in kwargs.items()}


def _skip_reason(name: str, device: str = "cpu") -> str | None:
    import zoo_models
    most = zoo_models.MAX_PARAMS_CUDA if device == "cuda" else zoo_models.MAX_PARAMS
    n, most = zoo_models.param_count(name), int(os.environ.get("ZOO_MAX_PARAMS") or most)
    return f"{n / 1e6:.0f}M parameters > {most / 1e6:.0f}M" if n > most else None


def torch_counts(name: str, mode: str, device: str = "cpu") -> dict:
    """torch.compile(backend="eager")'s graphs, breaks and ops on the model, as torch._dynamo.explain reports them."""
    import torch
    import torch._dynamo
    train = mode == "train"
    model, kwargs = _build(name, train, device)
    torch._dynamo.reset()
    with torch.set_grad_enabled(train):
        torch.manual_seed(100)
        ex = torch._dynamo.explain(model)(**kwargs)
    return dict(graphs=len(ex.graphs), breaks=ex.graph_break_count, ops=sum(op_count(g) for g in ex.graphs),
                calls=sum(op_count(g, all_calls=True) for g in ex.graphs), first_break=first_torch_break(ex))


def ember_row(name: str, mode: str, backend: str, check_train: bool = True, device: str = "cpu") -> dict:
    """ember's counts (ember.explain with `backend`), whether its results equal eager's (train mode: only when
    check_train; else forward and backward run, unchecked) and its float64 error ratio (f64_ratio)."""
    import torch
    import ember
    train = mode == "train"
    model, kwargs = _build(name, train, device)
    ember.reset()
    if not train:
        eager = copy.deepcopy(model)
        with torch.no_grad():
            torch.manual_seed(100)
            expected = eager(**kwargs)
            torch.manual_seed(100)
            ex = ember.explain(model, backend=backend)(**kwargs)
        row = counts(ex)
        diff = same(expected, ex.result)
        out64 = None
        if same(skeleton(expected), skeleton(ex.result)) is None:
            try:
                with torch.no_grad():
                    out64 = run_f64(eager, kwargs)
            except Exception as e:  # noqa: BLE001 - a model that cannot run in float64: no ratio
                row["f64_error"] = f"{type(e).__name__}: {str(e)[:80]}"
        variants = eval_variants(eager, kwargs) if out64 is not None else []
        if out64 is not None:
            row["f64_ratio"] = f64_ratio(ex.result, expected, out64, variants)
        if diff is not None and out64 is not None:
            # values only: ember's rounding against float64's, as large as eager float32's
            bad = values_vs_f64(ex.result, expected, out64, variants)
            diff = None if bad is None else f"{diff}; {bad}"
            row["vs_f64"] = diff is None
        row["equal"] = ("yes (vs float64)" if row.get("vs_f64") else "yes") if diff is None else f"no: {diff}"
        return row

    def step(weights: list | None = None):
        """On the GPU, forward, loss and backward compiled as one function, as a training step is written (ember
        runs the backward inside its graph there); on the CPU the model compiled and the backward run after."""
        if device == "cuda":
            return ember.explain(forward_backward, backend=backend)(model, kwargs, weights)
        ex = ember.explain(model, backend=backend)(**kwargs)
        scalar_loss(ex.result).backward()
        return ex
    if not check_train:
        return dict(counts(step()), equal="not checked")
    m32, m64 = copy.deepcopy(model), copy.deepcopy(model).double()
    others = eager_variants(model, kwargs)
    torch.manual_seed(100)
    out32 = m32(**kwargs)
    scalar_loss(out32).backward()
    torch.manual_seed(100)
    ex = step(loss_weights(out32))
    row = counts(ex)
    try:
        out64 = run_f64(m64, kwargs, forward_backward)
    except Exception as e:  # noqa: BLE001 - a model that cannot run in float64: gradients against eager float32
        out64, note = None, f"(no float64 run: {type(e).__name__}) "
    else:
        note = ""
        ratios = [r for r in (f64_ratio(ex.result, out32, out64), grad_norm_ratio(model, [m32] + others, m64))
                  if r is not None]
        if ratios:
            row["f64_ratio"] = max(ratios, key=lambda r: (r != r, r))   # (NaN the worst)
    problems = []
    # outputs and buffers: assert_close against eager float32, else the float64 criterion
    diff = same(out32, ex.result)
    if diff is not None:
        shape_diff = same(skeleton(out32), skeleton(ex.result))
        if out64 is None or shape_diff is not None:  # the float64 criterion is for values, not structure
            problems.append(f"outputs: {shape_diff or diff}")
        else:
            bad = values_vs_f64(ex.result, out32, out64)
            if bad is not None:
                problems.append(bad)
            else:
                row["vs_f64"] = True
    bufs32, bufs64 = dict(m32.named_buffers()), dict(m64.named_buffers())
    for bname, b in model.named_buffers():
        diff = same(bufs32[bname], b)
        if diff is not None and not (out64 is not None and b.is_floating_point() and b.shape == bufs32[bname].shape
                                     and within_f64(b, bufs32[bname], bufs64[bname])[0]):
            problems.append(f"buffer {bname}: {diff}")
            break
    problem = check_grads(model, [m32] + others, m64 if out64 is not None else None)
    if problem:
        problems.append(problem)
    ok = "yes (vs float64)" if row.get("vs_f64") else "yes"
    row["equal"] = ok if not problems else f"no: {note}{problems[0][:200]}"
    return row


def _variant_inputs(kwargs) -> list:
    """(kind, inputs) of eager runs in other summation orders than the main one's: 2 threads, and channels_last
    where an input is an image batch (cuDNN then takes other algorithms, TF32 ones where allowed: a compiler that
    lays a convolution out channels-last gets that run's rounding)."""
    import torch
    image = lambda v: isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()  # noqa: E731
    runs = [("2 threads", kwargs)]
    if any(image(v) for v in kwargs.values()):
        runs.append(("channels_last", {k: v.contiguous(memory_format=torch.channels_last) if image(v) else v
                                       for k, v in kwargs.items()}))
    return runs


def _variant_runs(model, kwargs, run) -> list:
    """run(copy of model, inputs) for each of _variant_inputs' orders (2 threads, channels_last), seeded as the
    main run; the results in order."""
    import torch
    out, threads = [], torch.get_num_threads()
    for kind, kw in _variant_inputs(kwargs):
        m = copy.deepcopy(model)
        if kind == "channels_last":
            m = m.to(memory_format=torch.channels_last)
        else:
            torch.set_num_threads(2)
        try:
            torch.manual_seed(100)
            out.append(run(m, kw))
        finally:
            torch.set_num_threads(threads)
    return out


def eval_variants(model, kwargs) -> list:
    """The outputs of eager float32 eval runs in _variant_inputs' other summation orders (no_grad)."""
    import torch

    def forward(m, kw):
        with torch.no_grad():
            return m(**kw)
    return _variant_runs(model, kwargs, forward)


def eager_variants(model, kwargs) -> list:
    """Copies of `model` after eager float32 forward + backward runs in other summation orders than the main
    eager run's: at 2 threads, and in channels_last where an input is an image batch. Eager float32's error on a
    gradient depends on the order (train-mode batch norm over few values), so one eager run is a poor estimate
    of it: check_grads takes the largest of these runs' errors."""
    def trained(m, kw):
        forward_backward(m, kw)
        return m
    return _variant_runs(model, kwargs, trained)


def check_grads(model, m32s: list, m64) -> str | None:
    """None when ember's gradients are as close to float64 as eager float32's, else the first problem.

    eager32: the runs in m32s (the main one first, eager_variants' after), each error below taken as the largest
    over them. err(x) = max|x - grad_f64| per parameter, G = the largest |grad_f64| of the model, n(x) = the
    2-norm of x - f64 over every gradient together:
      whole model:    n(ember) <= 2 * n(eager32) + 1e-6 * |grad_f64|
      each parameter: err(ember) <= 10 * err(eager32) + 1e-4 * max|grad_f64 of it| + 1e-7 * G
    The per-parameter bound is looser: a gradient that is zero in exact arithmetic (a key projection's bias under
    softmax) is float32 rounding noise of size ~1e-7 G, different in every summation order, so one eager run is a
    poor estimate of it; a wrong gradient is off by its own size and fails either bound.
    Without a float64 run (m64 None) each gradient must pass assert_close against eager float32.
    """
    p32s = [dict(m.named_parameters()) for m in m32s]
    p64 = dict(m64.named_parameters()) if m64 is not None else {}
    pairs = []
    for name, p in model.named_parameters():
        g32 = p32s[0][name].grad
        if (p.grad is None) != (g32 is None):
            state = lambda g: "None" if g is None else "set"  # noqa: E731
            return f"grad {name}: {state(p.grad)} where eager's is {state(g32)}"
        if p.grad is None:
            continue
        if m64 is None:
            diff = same(g32, p.grad)
            if diff is not None:
                return f"grad {name}: {diff}"
            continue
        g32s = [ps[name].grad.detach().double() for ps in p32s if ps[name].grad is not None]
        pairs.append((name, p.grad.detach().double(), g32s, p64[name].grad.detach()))
    if not pairs:
        return None
    big = max(g64.abs().max().item() for *_, g64 in pairs)
    n_e = sum(((ge - g64) ** 2).sum().item() for _, ge, _, g64 in pairs) ** 0.5
    n_32 = max(sum(((g32s[k] - g64) ** 2).sum().item() for _, _, g32s, g64 in pairs) ** 0.5
               for k in range(min(len(t[2]) for t in pairs)))
    n_64 = sum((t[3] ** 2).sum().item() for t in pairs) ** 0.5
    if n_e > 2 * n_32 + 1e-6 * n_64:
        return f"gradients' norm error {n_e:.2e} vs eager32 {n_32:.2e} (norm {n_64:.2e})"
    for name, ge, g32s, g64 in pairs:
        err_e, err_32 = (ge - g64).abs().max().item(), max((g - g64).abs().max().item() for g in g32s)
        if err_e > 10 * err_32 + 1e-4 * g64.abs().max().item() + 1e-7 * big:
            return f"grad {name}: err {err_e:.2e} vs eager32 {err_32:.2e} (max|f64| {g64.abs().max().item():.2e}, " \
                   f"model's {big:.2e})"
    return None


def grad_norm_ratio(model, m32s: list, m64) -> float | None:
    """check_grads' whole-model measure as a ratio: ||ember - f64|| / ||eager32 - f64|| over every gradient
    together (eager's the largest over the runs m32s, floored as f64_ratio's at F64_FLOOR of the float64
    gradients' norm)."""
    p32s, p64 = [dict(m.named_parameters()) for m in m32s], dict(m64.named_parameters())
    e, e32s, n64 = 0.0, [0.0] * len(m32s), 0.0
    for name, p in model.named_parameters():
        g, g64 = p.grad, p64[name].grad
        g32s = [ps[name].grad for ps in p32s]
        if g is None or g64 is None or any(g32 is None for g32 in g32s):
            continue
        g64 = g64.detach()
        e += ((g.detach().double() - g64) ** 2).sum().item()
        for k, g32 in enumerate(g32s):
            e32s[k] += ((g32.detach().double() - g64) ** 2).sum().item()
        n64 += (g64 ** 2).sum().item()
    if n64 == 0:
        return None
    return e ** 0.5 / max(max(e32s) ** 0.5, F64_FLOOR * n64 ** 0.5, 1e-30)


def counts(ex) -> dict:
    # ops: those ember captured, the dead ones its graphs drop included (torch.compile's graphs keep dead ops)
    return dict(graphs=ex.graph_count, breaks=ex.graph_break_count,
                ops=sum(op_count(g) for g in ex.graphs) + ex.dead_op_count, dead=ex.dead_op_count,
                calls=sum(op_count(g, all_calls=True) for g in ex.graphs), first_break=first_ember_break(ex))


class FallbackRecords:
    """ember's `fallbacks` log records (a graph run eagerly, an op kept as an ATen call is not one) while a row runs:
    each is a miss, since issue 32 asks for no graph to fall back."""

    def __enter__(self):
        import logging

        class Keep(logging.Handler):
            def emit(h, record):
                msg = record.getMessage()
                if "eagerly" in msg or "ATen graph" in msg:
                    self.lines.append(msg.strip().splitlines()[0][:300])
        self.lines, self.handler = [], Keep(logging.WARNING)
        logging.getLogger("ember.fallbacks").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        import logging
        logging.getLogger("ember.fallbacks").removeHandler(self.handler)


def run_task(task: dict) -> dict:
    import torch
    t0 = time.perf_counter()
    out = dict(task)
    print(f"== zoo row {task['name']} {task['mode']} ({task['kind']})", file=sys.stderr, flush=True)
    with FallbackRecords() as fallbacks:
        try:
            skip = _skip_reason(task["name"], task.get("device", "cpu"))
            if skip:
                out["skipped"] = skip
            elif task["kind"] == "torch":
                out["counts"] = torch_counts(task["name"], task["mode"], task.get("device", "cpu"))
            else:
                out["counts"] = ember_row(task["name"], task["mode"], task["backend"], task["check_train"],
                                          task.get("device", "cpu"))
        except Exception as e:  # noqa: BLE001 - a failure is a row
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {short_path(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
            out["error"] = (f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                            f"{where}")
    if fallbacks.lines and task["kind"] == "ember":
        out["fallbacks"] = fallbacks.lines
    try:
        import torch._dynamo
        torch._dynamo.reset()
        import ember
        ember.reset()
    except Exception:  # noqa: BLE001
        pass
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def worker() -> int:
    """Read one task (JSON) a line from stdin, write its result on the original stdout; prints go to stderr."""
    import warnings
    warnings.filterwarnings("ignore")
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch
    torch.set_num_threads(int(os.environ.get("ZOO_THREADS", "1")))
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "models"), str(ROOT)]
    for line in sys.stdin:
        results.write(RESULT_TAG + json.dumps(run_task(json.loads(line))) + "\n")
    return 0


# ---------------------------------------------------------------- the parent: workers, timeouts, the counts cache

class Worker:
    """A `zoo.py --worker` process; a task that outlasts its timeout kills it (and its session), a new one follows."""

    def __init__(self, log):
        # (the repository first, then what the caller's PYTHONPATH holds: the device machine's installed wheels)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env,
                                     cwd=ROOT, start_new_session=True)

    def run(self, task: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(task) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.kill()
                return dict(task, error=f"timeout after {timeout:.0f} s", seconds=timeout)
            line = self.proc.stdout.readline()
            if not line:  # the worker died: a crash (segfault, out of memory, abort)
                self.proc.wait()
                return dict(task, error=f"worker crashed (exit {self.proc.returncode})",
                            seconds=round(timeout - left, 1))
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG):])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


DEVICE = "cpu"   # the device the rows run on (--device): torch.compile's counts are cached per device


def counts_file() -> pathlib.Path:
    import torch
    return COUNTS_DIR / f"torch-{torch.__version__.split('+')[0]}{'' if DEVICE == 'cpu' else '-' + DEVICE}.json"


def versions() -> dict:
    import torch
    import torchvision
    import transformers
    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "transformers": transformers.__version__}


def load_counts() -> dict:
    path = counts_file()
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("versions") != versions():
        print(f"note: {path.name} was measured with {data.get('versions')}, installed {versions()}; "
              f"--recount-torch measures again", file=sys.stderr)
    return data.get("counts", {})


def save_count(key: str, value: dict) -> None:
    """Add one row to the cache file; shards running at once take turns through a lock file."""
    COUNTS_DIR.mkdir(exist_ok=True)
    path = counts_file()
    with open(pathlib.Path(tempfile.gettempdir()) / f"ember-zoo-{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {"versions": versions(), "counts": {}}
        data["counts"][key] = value
        data["counts"] = dict(sorted(data["counts"].items()))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)


# ---------------------------------------------------------------- table and summary

def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i in (0, 1, len(r) - 1, len(r) - 2) else c.rjust(w[i])  # noqa: E731
                              for i, c in enumerate(r)).rstrip()
    return "\n".join([fmt(cells[0]), "-" * min(sum(w) + 2 * len(w) - 2, 160)] + [fmt(r) for r in cells[1:]])


def meets_goal(e: dict, t: dict) -> bool:
    return e["graphs"] <= t["graphs"] and e["ops"] >= 0.98 * t["ops"]


def report(rows: list[dict]) -> str:
    """The per-row table, then a summary per mode; `rows` are {name, mode, backend, ember: ..., torch: ...}."""
    lines, out = [], []
    for r in rows:
        e, t = r.get("ember", {}), r.get("torch", {})
        if "skipped" in e or "skipped" in t:
            out.append([r["name"], r["mode"], *["-"] * 8, "skipped",
                        e.get("skipped", t.get("skipped"))])
            continue
        ec, tc = e.get("counts", {}), t.get("counts", {} if t else None)
        col = lambda c, k: "-" if c is None else c.get(k, "err")  # noqa: E731  (-: not measured)
        if "error" in e:
            equal = f"error: {e['error']}"
        else:
            equal = ec.get("equal", "?")
        brk = ec.get("first_break", "") if ec else ""
        if not ec:
            brk = ""
        if "error" in t:
            brk = (brk + " | " if brk else "") + f"torch.compile: {t['error']}"
        out.append([r["name"], r["mode"], col(ec, "graphs"), col(ec, "breaks"), col(ec, "ops"), (ec or {}).get("dead", "-"),
                    col(tc, "graphs"), col(tc, "breaks"), col(tc, "ops"), ratio_cell(ec), equal[:60], brk])
    lines.append(table(["model", "mode", "ember graphs", "breaks", "ops", "dead", "torch.compile graphs", "breaks", "ops",
                        "f64 ratio", "equal", "ember's first break"], out))
    lines.append("")
    lines += summary(rows)
    return "\n".join(lines)


def ratio_cell(ec: dict | None) -> str:
    r = (ec or {}).get("f64_ratio")
    return "-" if r is None else f"{r:.2f}" + ("" if r <= F64_RATIO else " !")


def ratio_summary(rs: list[dict]) -> str:
    """The f64 ratios' distribution over rows: quantiles, how many within F64_RATIO, the rows over it."""
    ratios = sorted(((r["ember"]["counts"]["f64_ratio"], r["name"]) for r in rs
                     if r.get("ember", {}).get("counts", {}).get("f64_ratio") is not None),
                    key=lambda x: (x[0] != x[0], x[0]))
    if not ratios:
        return "  f64 ratio: none measured"
    vals = [v for v, _ in ratios]
    q = lambda f: vals[min(int(f * len(vals)), len(vals) - 1)]  # noqa: E731
    over = [f"{name} {v:.2f}" for v, name in ratios if not v <= F64_RATIO]
    return (f"  f64 ratio (ember's error / eager float32's, vs float64) over {len(vals)} rows: min {vals[0]:.2f}, "
            f"median {q(0.5):.2f}, p90 {q(0.9):.2f}, max {vals[-1]:.2f}; within {F64_RATIO:g}: "
            f"{sum(v <= F64_RATIO for v in vals)}/{len(vals)}" + (f"; over: {', '.join(over)}" if over else ""))


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for mode in ("eval", "train"):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        skipped = [r for r in rs if "skipped" in r.get("ember", {}) or "skipped" in r.get("torch", {})]
        rs = [r for r in rs if r not in skipped]
        ran = [r for r in rs if "counts" in r.get("ember", {})]
        equal = [r for r in ran if r["ember"]["counts"].get("equal", "").startswith("yes")]
        by_f64 = [r for r in equal if r["ember"]["counts"].get("vs_f64")]
        unchecked = [r for r in ran if r["ember"]["counts"].get("equal") == "not checked"]
        both = [r for r in ran if "counts" in r.get("torch", {})]
        goal = [r for r in both if meets_goal(r["ember"]["counts"], r["torch"]["counts"])]
        e_ops = sum(r["ember"]["counts"]["ops"] for r in both)
        t_ops = sum(r["torch"]["counts"]["ops"] for r in both)
        backends = sorted({r.get("backend", "?") for r in rs})
        lines.append(
            f"{mode} ({'/'.join(backends)} backend): {len(rs)} models (+{len(skipped)} skipped); "
            f"equal to eager {len(equal)}/{len(rs) - len(unchecked)} checked "
            f"({len(by_f64)} of them against float64; {len(rs) - len(ran)} errors or timeouts; "
            f"{sum(bool(r['ember'].get('fallbacks')) for r in rs)} with a graph run eagerly); "
            f"graphs <= torch.compile's and ops >= 98% of its: {len(goal)}/{len(both)}; "
            f"captured ops ember {e_ops} vs torch.compile {t_ops} ({100 * e_ops / max(t_ops, 1):.1f}%)")
        lines.append(ratio_summary(ran))
    return lines


def misses(rows: list[dict]) -> list[str]:
    """Each row below a goal: not equal, an error, or fewer ops / more graphs than torch.compile."""
    out = []
    for r in rows:
        e, t = r.get("ember", {}), r.get("torch", {})
        if "skipped" in e or "skipped" in t:
            continue
        ec, tc = e.get("counts"), t.get("counts")
        why = []
        if not ec:
            why.append(f"error: {e.get('error')}")
        else:
            if not ec.get("equal", "").startswith(("yes", "not checked")):
                why.append(f"equal: {ec.get('equal')}")
            if tc and not meets_goal(ec, tc):
                why.append(f"graphs {ec['graphs']} vs {tc['graphs']}, ops {ec['ops']} vs {tc['ops']}")
            if ec.get("f64_ratio") is not None and not ec["f64_ratio"] <= F64_RATIO:
                why.append(f"f64 ratio {ec['f64_ratio']:.2f} > {F64_RATIO:g}")
        if e.get("fallbacks"):
            why.append(f"{len(e['fallbacks'])} graphs ran eagerly, the first: {e['fallbacks'][0]}")
        if why:
            brk = ec.get("first_break") if ec else ""
            out.append(f"{r['name']} ({r['mode']}): {'; '.join(why)}" + (f"; first break: {brk}" if brk else ""))
    return out


def break_groups(rows: list[dict]) -> list[str]:
    """ember's first break in each row below the ops/graphs goal, grouped by reason (places listed), most common
    first; a row with no torch.compile counts is listed when ember broke at all."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for r in rows:
        ec, tc = r.get("ember", {}).get("counts"), r.get("torch", {}).get("counts")
        if not ec or not ec.get("first_break") or (tc and meets_goal(ec, tc)):
            continue
        reason, _, where = ec["first_break"].rpartition(" at ")
        groups.setdefault(reason or where, []).append((f"{r['name']}/{r['mode']}", where))
    out = []
    for reason, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        places: dict[str, int] = {}
        for _, where in items:
            places[where] = places.get(where, 0) + 1
        out.append(f"{len(items):3d}  {reason}\n       at {', '.join(f'{w} ({n})' for w, n in places.items())}"
                   f"\n       rows: {', '.join(m for m, _ in items)}")
    return out


def machine() -> str:
    cpu = platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    v = versions()
    return (f"{cpu}, {os.cpu_count()} CPUs; Python {platform.python_version()}, torch {v['torch']}, "
            f"torchvision {v['torchvision']}, transformers {v['transformers']}; commit {commit}; "
            f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-params", type=float, default=0, help="skip models over this many parameters (default: "
                   "300M on the CPU, 2B on a GPU; e.g. 3e8 on a GPU to run the largest models alone elsewhere)")
    p.add_argument("--models", default="", help="comma-separated substrings of model names (hf_ = transformers)")
    p.add_argument("--mode", default="both", choices=["eval", "train", "both"])
    p.add_argument("--backend", default="ember", help="ember's backend: ember (the whole pipeline) or eager "
                   "(its frontend's graphs run as captured: capture-only counts)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: where models, inputs and the float64 run live")
    p.add_argument("--shard", default="1/1", help="i/n: the i-th of n interleaved slices of the models (1-based)")
    p.add_argument("--jobs", type=int, default=1, help="rows run at once, each in its own worker process")
    p.add_argument("--budget", type=float, default=0, help="seconds after which no new row starts (0: none); the "
                   "rows not run are listed")
    p.add_argument("--timeout", type=float, default=300, help="seconds per row and compiler")
    p.add_argument("--recount-torch", action="store_true", help="measure torch.compile's counts again")
    p.add_argument("--no-torch", action="store_true", help="leave torch.compile's counts out where not cached")
    p.add_argument("--no-train-check", action="store_true", help="train mode: counts only, results unchecked "
                   "(the float64 gradient check of big models takes minutes)")
    p.add_argument("--json", help="write the rows to this file (for --merge)")
    p.add_argument("--log", default=os.devnull, help="the workers' stderr (warnings, model prints)")
    p.add_argument("--merge", nargs="+", help="print one table and summary from these --json files (a later "
                   "file's row replaces an earlier one's)")
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    global DEVICE
    DEVICE = a.device
    if a.max_params:
        os.environ["ZOO_MAX_PARAMS"] = str(int(a.max_params))   # read by the workers' _skip_reason
    if a.worker:
        return worker()
    if a.merge:
        by_key = {}  # a later file's row replaces an earlier one's (a rerun)
        for f in a.merge:
            for r in json.loads(pathlib.Path(f).read_text())["rows"]:
                by_key[r["name"], r["mode"]] = r
        rows = list(by_key.values())
        DEVICE = rows[0].get("device", "cpu") if rows else "cpu"   # (torch.compile's counts of that device)
        cached = load_counts()
        for r in rows:  # rows run with --no-torch take torch.compile's counts from the cache
            if not r.get("torch") and f"{r['name']}/{r['mode']}" in cached:
                r["torch"] = cached[f"{r['name']}/{r['mode']}"]
        rows.sort(key=lambda r: (r["name"], r["mode"]))
        print(report(rows))
        print("\nmisses:\n" + "\n".join(misses(rows)))
        print("\nfirst breaks of the rows below the goal, grouped:\n" + "\n".join(break_groups(rows)))
        return 0

    sys.path[:0] = [str(ROOT / "bench")]
    import zoo_models
    names = list(zoo_models.all_models())
    wanted = [w for w in a.models.split(",") if w]
    names = [n for n in names if not wanted or any(w in n for w in wanted)]
    i, n = (int(x) for x in a.shard.split("/"))
    names = names[i - 1::n]
    if a.list:
        print("\n".join(names))
        return 0
    modes = ["eval", "train"] if a.mode == "both" else [a.mode]
    cached = {} if a.recount_torch else load_counts()
    print(f"ember zoo: {len(names)} models x {modes}, backend {a.backend}, device {a.device}, shard {a.shard}\n"
          f"{machine()}", flush=True)

    header = machine()
    log = open(a.log, "a")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that `finally` ends the worker too
    workers: list[Worker] = []
    rows: list[dict] = []
    try:
        run_rows(a, names, modes, cached, workers, log, header, rows)
    finally:
        for w in workers:
            w.kill()
    rows.sort(key=lambda r: (names.index(r["name"]), modes.index(r["mode"])))
    print(report(rows))
    ms = misses(rows)
    if ms:
        print("\nmisses:\n" + "\n".join(ms))
    not_run = [f"{n}/{m}" for n in names for m in modes if not any(r["name"] == n and r["mode"] == m for r in rows)]
    if not_run:
        print(f"\nnot run (--budget {a.budget:g} s spent): {len(not_run)} rows: {', '.join(not_run)}")
    return 0


def run_rows(a, names, modes, cached, workers: list, log, header: str, rows: list) -> None:
    """Each (model, mode) row into `rows`: ember's task, then torch.compile's where not cached; --jobs rows at
    once, each thread with its own worker process; no row starts once --budget seconds have passed."""
    import queue
    import threading
    todo: queue.Queue = queue.Queue()
    for name in names:
        for mode in modes:
            todo.put((name, mode))
    t0, lock = time.monotonic(), threading.Lock()

    def one_row(name: str, mode: str, mine: list) -> None:
        row = {"name": name, "mode": mode, "backend": a.backend, "device": a.device}
        key = f"{name}/{mode}"
        jobs = [("ember", dict(kind="ember", name=name, mode=mode, backend=a.backend, device=a.device,
                               check_train=not a.no_train_check))]
        if key in cached:
            row["torch"] = cached[key]
        elif not a.no_torch:
            jobs.append(("torch", dict(kind="torch", name=name, mode=mode, device=a.device)))
        for who, task in jobs:
            if not mine or not mine[-1].alive():
                mine.append(Worker(log))
                with lock:
                    workers.append(mine[-1])
            res = mine[-1].run(task, a.timeout)
            row[who] = {k: res[k] for k in ("counts", "error", "skipped", "seconds", "fallbacks") if k in res}
            if who == "torch" and "timeout" not in res.get("error", ""):  # a timeout may pass on a freer machine
                save_count(key, row["torch"])
            if "skipped" in res:
                row["torch"] = row.get("torch") or {"skipped": res["skipped"]}
                break
        e = row["ember"]
        with lock:
            rows.append(row)
            print(f"  {name} {mode}: {e.get('seconds', '?')} s, "
                  f"{e.get('skipped') or e.get('error') or e['counts'].get('equal')}"
                  f"{'' if 'counts' not in e else ', f64 ratio ' + ratio_cell(e['counts'])}", file=sys.stderr,
                  flush=True)
            if a.json:
                pathlib.Path(a.json).write_text(json.dumps({"machine": header, "rows": rows}, indent=1))

    def loop() -> None:
        mine: list = []
        while not (a.budget and time.monotonic() - t0 > a.budget):
            try:
                name, mode = todo.get_nowait()
            except queue.Empty:
                return
            one_row(name, mode, mine)
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(max(a.jobs, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
