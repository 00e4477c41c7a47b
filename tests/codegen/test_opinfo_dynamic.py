"""The CPU OpInfo subset (test_opinfo.SUBSET) through the whole pipeline with dynamic=True: each sample's op is
captured with symbolic sizes, traced symbolically and compiled by the C++ backend (or run as its ATen graph where
the code generator cannot lower it symbolically, logged), and must give eager's result; then a second sample of a
different size, where the op has one of the same structure, reuses the compiled program."""
import pytest
import torch
import torch.utils._pytree as pytree

import ember
from ember.tools.failsafe import STATS
from tests.codegen.test_opinfo import NONDETERMINISTIC, SUBSET, _ops, sample_function


def _as_function(op, sample):
    """(fn of the sample's tensors, the tensors, the sample's structure: its non-tensor leaves and tensor ranks)."""
    fn, tensors = sample_function(op, sample)
    return fn, tensors, (*fn.structure, tuple(t.dim() for t in tensors))


def _compare(out, ref):
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, equal_nan=True, atol=1e-5, rtol=1.3e-5)
        else:
            assert g == w


@pytest.mark.parametrize("name", SUBSET)
def test_opinfo_subset_dynamic_equals_eager(name):
    ops = _ops([name])
    if not ops or any(w in name for w in NONDETERMINISTIC):
        pytest.skip(f"{name}: no such OpInfo in this torch, or an uninitialized output")
    op = ops[0]
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    first, *rest = [_as_function(op, s) for s in samples]
    fn, tensors, structure = first
    try:
        ref = fn(*tensors)
    except Exception as e:
        pytest.skip(f"{name}: eager raises on its first sample ({type(e).__name__})")
    cfn = ember.compile(fn, dynamic=True)
    bugs = STATS["compile_fallbacks"] + STATS["launch_fallbacks"]
    with torch.no_grad():
        _compare(cfn(*tensors), ref)
        # the same op on other sizes: the first later sample of the same structure, through the same compiled fn
        for _, other, s in rest:
            if s == structure and [t.shape for t in other] != [t.shape for t in tensors]:
                _compare(cfn(*other), fn(*other))
                break
    assert STATS["compile_fallbacks"] + STATS["launch_fallbacks"] == bugs, \
        "ember crashed (the fail-safe ran the graph eagerly): see the ember.fallbacks log"
