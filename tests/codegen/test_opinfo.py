"""Differential sweep over PyTorch's OpInfo database on the CPU: for each op, dtype and sample, ember's compiled
ATen graph gives eager's result (assert_close, dtypes included) or the op is a logged ATen fallback.

Statuses: pass (all compiled), pass+fallback (some nodes stayed ATen calls: logged), eager-graph (the whole graph
was not compilable: logged), skip (reason given: the tracer cannot capture it, or eager itself is
nondeterministic or raises), FAIL (a wrong result or a crash: never allowed).
CI runs a fixed subset (SUBSET, first samples); `make test-full` runs every op and sample (marked slow).
"""
import collections
import logging
import os

import pytest
import torch
import torch.utils._pytree as pytree

from ember.backends.cpp_backend import compile_aten
from ember.codegen import lower
from tests.codegen.aten_trace import trace_aten

DTYPES = (torch.float32, torch.float64, torch.int64)
SUBSET = ["add", "sub", "mul", "div", "true_divide", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh",
          "sigmoid", "erf", "pow", "clamp", "where", "maximum", "minimum", "eq", "lt", "ge", "sum", "mean", "amax",
          "amin", "argmax", "var", "std", "prod", "softmax", "log_softmax", "logsumexp", "nn.functional.layer_norm",
          "nn.functional.gelu", "nn.functional.silu", "nn.functional.relu", "nn.functional.embedding",
          "nn.functional.group_norm", "nn.functional.batch_norm", "nn.functional.nll_loss",
          "nn.functional.cross_entropy", "cat", "stack", "split", "chunk", "permute", "transpose", "expand",
          "reshape", "flip", "gather", "index_select", "masked_fill", "tril", "nn.functional.pad",
          "mm", "addmm", "bmm", "square", "lerp", "addcmul", "max", "min", "any", "all", "sign", "floor", "round"]
# float16/bfloat16 (ember/codegen/cpp_lowp.py) over a smaller subset: pointwise, reductions, norms, softmax, indexing
LOWP_DTYPES = (torch.float16, torch.bfloat16)
LOWP_SUBSET = ["add", "mul", "div", "exp", "tanh", "sigmoid", "pow", "where", "clamp", "sum", "mean", "amax", "argmax",
               "var", "prod", "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.group_norm",
               "nn.functional.gelu", "nn.functional.silu", "cat", "index_select", "masked_fill", "lerp"]
# Uninitialized outputs cannot be compared. Random ops can: eager and compiled runs start from the same seed, and
# ember keeps RNG ops as ATen calls in graph order, so they draw the same numbers.
NONDETERMINISTIC = ("empty", "new_empty", "empty_like", "empty_strided")


def _ops(names=None):
    try:
        import expecttest  # noqa: F401
    except ImportError:  # op_db's module imports it only for its TestCase base class; the sweep never uses it
        import sys
        import types
        import unittest
        sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)
    from torch.testing._internal.common_methods_invocations import op_db
    if names is None:
        return list(op_db)
    by = collections.defaultdict(list)
    for op in op_db:
        by[op.name].append(op)
    return [op for n in names for op in by.get(n, [])[:1]]


def _draws_random(n) -> bool:
    """A node of a random op (attention ops are tagged random for their dropout: only with dropout_p > 0)."""
    if not (isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags):
        return False
    if "scaled_dot_product" in str(n.target):
        p = n.kwargs.get("dropout_p", n.args[3] if len(n.args) > 3 else 0.0)
        return bool(p)
    return True


def sample_function(op, sample):
    """(fn, tensors): the op on an OpInfo sample as a function of the sample's tensors (its other arguments fixed)."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def fn(*ts):
        ls = list(leaves)
        for i, t in zip(pos, ts):
            ls[i] = t
        inp, args, kwargs = pytree.tree_unflatten(ls, spec)
        return op.op(inp, *args, **kwargs)
    fn.structure = (spec, tuple(repr(x) for i, x in enumerate(leaves) if i not in pos))
    return fn, [leaves[i] for i in pos]


def run_sample(op, dtype, sample) -> tuple[str, str]:
    """(status, detail) for one OpInfo sample."""
    if any(w in op.name for w in NONDETERMINISTIC):
        return "skip", "nondeterministic or uninitialized output"
    fn, tensors = sample_function(op, sample)
    try:
        torch.manual_seed(1234)
        gm, ref = trace_aten(fn, tensors)
    except Exception as e:
        return "skip", f"tracer/eager: {type(e).__name__}"
    if any(_draws_random(n) for n in gm.graph.nodes):
        # OpInfo wraps random ops in wrapper_set_seed: a manual_seed inside the op, which no ATen trace sees
        return "skip", "random op (OpInfo seeds inside its wrapper, outside the ATen graph)"
    ref_leaves = [r for r in pytree.tree_leaves(ref) if isinstance(r, torch.Tensor)]
    if not ref_leaves:
        return "skip", "no tensor output"
    before = sum(lower.FALLBACK_COUNTS.values())
    try:
        with torch.no_grad():
            compiled = compile_aten(gm, tensors)
            torch.manual_seed(1234)
            out = compiled(*tensors)
    except Exception as e:  # eager raised nothing here (it ran in the tracer): a compiled-only error is a failure
        return "FAIL", f"{type(e).__name__}: {str(e)[:300]}"
    got = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    try:
        assert len(got) == len(ref_leaves)
        for g, r in zip(got, ref_leaves):
            torch.testing.assert_close(g, r, equal_nan=True, atol=1e-5 if dtype == torch.float32 else None,
                                       rtol=1.3e-5 if dtype == torch.float32 else None)
    except AssertionError as e:
        return "FAIL", str(e).split("\n")[0][:300] + f" graph: {[str(n.target) for n in gm.graph.nodes][:12]}"
    if not hasattr(compiled, "compiled"):
        return "eager-graph", ""
    n_fb = sum(lower.FALLBACK_COUNTS.values()) - before
    return ("pass+fallback" if n_fb else "pass"), ""


def sweep(ops, max_samples=None, out=print, progress=None, dtypes=DTYPES):
    table = collections.defaultdict(collections.Counter)
    failures = []
    reasons = collections.Counter()

    class Collect(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            reasons[msg.split(" at node ")[0] + " (" + msg.rsplit(" (", 1)[-1][:100]] += 1
    log = logging.getLogger("ember.fallbacks")
    log.setLevel(logging.DEBUG)
    log.addHandler(Collect())
    log.propagate = False
    torch.manual_seed(0)
    for op in ops:
        for dtype in dtypes:
            if not op.supports_dtype(dtype, "cpu"):
                continue
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))
            except Exception as e:
                table[op.name]["skip"] += 1
                continue
            for s in samples[:max_samples]:
                status, detail = run_sample(op, dtype, s)
                table[op.name][status] += 1
                if status == "FAIL":
                    failures.append(f"{op.name} {dtype}: {detail}")
        if progress:
            progress(f"{op.name:40s} {dict(table[op.name])} {[f for f in failures if f.startswith(op.name + ' ')]}")
    cols = ["pass", "pass+fallback", "eager-graph", "skip", "FAIL"]
    out(f"{'op':40s}" + "".join(f"{c:>15s}" for c in cols))
    tot = collections.Counter()
    for name, c in sorted(table.items()):
        out(f"{name:40s}" + "".join(f"{c[k]:15d}" for k in cols))
        tot.update(c)
    out(f"{'TOTAL (' + str(len(table)) + ' ops)':40s}" + "".join(f"{tot[k]:15d}" for k in cols))
    out(f"fallback ATen ops: {dict(lower.FALLBACK_COUNTS.most_common(40))}")
    for r, n in reasons.most_common(60):
        out(f"  {n:5d}  {r}")
    for f in failures:
        out("FAIL " + f)
    return table, failures


def test_opinfo_subset(capsys):
    _, failures = sweep(_ops(SUBSET), max_samples=2)
    assert not failures, "\n".join(failures)


def test_opinfo_lowp_subset(capsys):
    _, failures = sweep(_ops(LOWP_SUBSET), max_samples=2, dtypes=LOWP_DTYPES)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_opinfo_full():
    _, failures = sweep(_ops(), max_samples=int(os.environ.get("EMBER_SWEEP_SAMPLES", "0")) or None)
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    import sys
    names = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "all" else None
    sweep(_ops(names), max_samples=int(sys.argv[2]) if len(sys.argv) > 2 else None,
          progress=lambda line: print(line, file=sys.stderr, flush=True),
          dtypes=tuple(getattr(torch, d) for d in sys.argv[3].split(",")) if len(sys.argv) > 3 else DTYPES)
