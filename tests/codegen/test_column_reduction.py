"""Reductions over outer dims (x.sum(0) of a contiguous matrix) in the C++ backend: generated column-wise (the
reduced dims outside, adjacent kept elements inside in blocks of accumulators); compiled vs eager on fresh
random inputs, NaN/inf for max/min, keepdim, non-contiguous inputs, and the cases that keep the row form."""
import pytest
import torch

from ember.backends.cpp_backend import compile_aten
from tests.codegen.aten_trace import trace_aten
from tests.numerics import assert_as_close_as_eager


def compiled(fn, inputs):
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    out = c(*inputs)
    got = out[0] if len(out) == 1 else out
    exact = fn(*[t.double() for t in inputs])
    if isinstance(ref, torch.Tensor) and ref.dtype == torch.float32 and ref.isfinite().all():
        # a float32 sum's rounding depends on its order, which differs between instruction sets: the error
        # allowed is eager's own against float64
        assert_as_close_as_eager(got, ref, exact)
    else:
        torch.testing.assert_close(got, ref, equal_nan=True)  # NaN where eager has NaN
    return c.compiled.source


def _with_specials(x):
    """x with NaN in some columns, +inf/-inf in others (column 0 untouched)."""
    x = x.clone()
    x[torch.randint(0, x.shape[0], (5,)), torch.randint(1, x.shape[-1], (5,))] = float("nan")
    x[torch.randint(0, x.shape[0], (5,)), torch.randint(1, x.shape[-1], (5,))] = float("inf")
    x[torch.randint(0, x.shape[0], (5,)), torch.randint(1, x.shape[-1], (5,))] = -float("inf")
    return x


# (name, fn, inputs): every case reduces over dims outer to the kept contiguous ones
COLUMN_CASES = [
    ("tanh_mean0", lambda x: x.tanh().mean(0), lambda: [torch.randn(300, 700)]),  # 700: a partial last block
    ("sum0_small", lambda x: x.sum(0), lambda: [torch.randn(37, 100)]),  # one block, below the threading size
    ("mul_sum0", lambda x, y: (x * y).sum(0), lambda: [torch.randn(512, 768), torch.randn(512, 768)]),
    ("sum01_3d", lambda x: x.sum((0, 1)), lambda: [torch.randn(8, 64, 96)]),
    ("sum0_keepdim", lambda x: x.sum(0, keepdim=True) * 2, lambda: [torch.randn(200, 300)]),
    ("sum0_float64", lambda x: x.sum(0), lambda: [torch.randn(200, 300, dtype=torch.float64)]),
    ("var0", lambda x: x.var(0), lambda: [torch.randn(300, 260) * 3 + 1]),  # a reduction reading another's value
    ("amax0_nan_inf", lambda x: x.amax(0), lambda: [_with_specials(torch.randn(300, 500))]),
    ("amin0_nan_inf", lambda x: x.amin(0), lambda: [_with_specials(torch.randn(300, 500))]),
    ("amax0_float64_nan", lambda x: x.amax(0), lambda: [_with_specials(torch.randn(100, 300, dtype=torch.float64))]),
    ("int_sum0", lambda x: x.sum(0), lambda: [torch.randint(-1000, 1000, (300, 400), dtype=torch.int32)]),
    ("int64_amax0", lambda x: x.amax(0), lambda: [torch.randint(-10**12, 10**12, (300, 400))]),
    ("int_prod0", lambda x: x.prod(0), lambda: [torch.randint(-2, 3, (20, 400))]),
    ("bool_any0", lambda x: (x > 2.5).any(0), lambda: [torch.randn(300, 400)]),
    ("bool_all0", lambda x: (x > -2.5).all(0), lambda: [torch.randn(300, 400)]),
    ("bool_sum0", lambda x: (x > 0).sum(0), lambda: [torch.randn(300, 400)]),
    ("transposed_sum1", lambda x: x.t().sum(1), lambda: [torch.randn(400, 300)]),  # non-contiguous input
    # a constant trip count (`xn = 3`); positive values, as sum_all's below: a sum of 3,000 randn cancels to a
    # few units, where summation-order rounding (2e-5) exceeded the default tolerance in 1 of ~10 runs
    ("few_columns", lambda x: x.sum(0), lambda: [torch.rand(3000, 3) + 0.5]),
    ("no_rows", lambda x: x.sum(0) + 1, lambda: [torch.randn(0, 40)]),  # an empty reduction: the initial value
    ("amax0_3d_rows", lambda x: x.amax((0, 1)), lambda: [_with_specials(torch.randn(6, 50, 40))]),
    ("sum0_then_pointwise", lambda x, b: (x.sum(0) + b).relu(), lambda: [torch.randn(300, 400), torch.randn(400)]),
    # a global average pool of a channels-last input: rows n*C + c, each load (x0 // C)*HWC + r*C + x0 % C
    ("channels_last_mean_hw", lambda x: x.mean((2, 3)),
     lambda: [torch.randn(4, 96, 7, 7).to(memory_format=torch.channels_last)]),
]


@pytest.mark.parametrize("name,fn,make", COLUMN_CASES, ids=[c[0] for c in COLUMN_CASES])
def test_outer_dim_reduction_is_columnwise_and_matches_eager(name, fn, make):
    src = compiled(fn, make())
    assert "column-wise" in src
    if name == "few_columns":
        assert "const int64_t xn = 3;" in src, src


# (name, fn, inputs): the row form stays (a contiguous reduction loop, argmax, a strided kept dim)
ROW_CASES = [
    ("mean1", lambda x: x.tanh().mean(1), lambda: [torch.randn(300, 700)]),
    ("argmax0_nan", lambda x: x.argmax(0), lambda: [_with_specials(torch.randn(300, 500))]),
    ("max0_values_indices", lambda x: x.max(0), lambda: [_with_specials(torch.randn(300, 500))]),
    ("strided_kept_dim", lambda x: x[:, ::2].sum(0), lambda: [torch.randn(300, 800)]),
    # positive values: a sum of randn cancels to near zero, where float32's summation-order rounding (~1e-5 in
    # absolute terms for 2,100 terms) exceeded the default relative tolerance in 1 of ~10 runs
    ("sum_all", lambda x: x.sum(), lambda: [torch.rand(30, 70) + 0.5]),
]


@pytest.mark.parametrize("name,fn,make", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_other_reductions_keep_the_row_form_and_match_eager(name, fn, make):
    src = compiled(fn, make())
    assert "column-wise" not in src


# ----------------------------------------------------------------------------------------- split reductions
def test_split_factors_from_sizes():
    """reductions.reduction_parts: deterministic, a divisor of the reduced size, only where results are too few."""
    from ember.codegen import reductions
    gpu = lambda out, r, col: reductions.reduction_parts(out, r, col, "gpu")  # noqa: E731
    assert gpu(768, 2048, True) == 8          # GPT-2's layer-norm weight/bias gradients: 8 x 256 rows
    assert gpu(1, 64 * 2 ** 20, False) == 1024  # a full sum of 64M elements: 1024 parts (512 programs of 2)
    assert gpu(4, 65536, False) == 64         # few long rows: parts of 1024
    assert gpu(3072, 2048, True) == 1         # 384 strips of 8 columns already fill 132 SMs
    assert gpu(2048, 768, False) == 1         # a layer norm's row sums
    assert gpu(1, 4096, False) == 1           # too short to be worth a second kernel
    assert gpu(100, 3000, True) == 50         # 3000 rows: a divisor (no ragged part), parts of >= 32 rows
    assert gpu(256, 16384, False) == 4        # 256 long rows (densenet's first block, 1.6 TB/s unsplit): 1024 parts
    assert gpu(256, 8192, False) == 1         # shorter ones: one program a row
    assert gpu(300, 16384, False) == 1        # >= 2x the SMs' rows (LONG_ROWS_SPLIT_BELOW)
    cpu = lambda out, r, col, threads: reductions.reduction_parts(out, r, col, "cpu") if not setattr(  # noqa: E731
        reductions, "cpu_threads", lambda: threads) else None
    try:
        assert cpu(3, 2_000_000, True, 2) == 25   # 3 columns: one block of the column loop on 1 of 2 threads
        assert cpu(768, 2048, True, 2) == 1       # 48 blocks of 16 columns for 2 threads
        assert cpu(768, 2048, True, 64) == 4
        assert cpu(4, 1_000_000, False, 16) == 8  # 4 rows for 16 threads
        assert cpu(1, 1_000_000, False, 16) == 1  # one row: its loop is parallel already
        assert cpu(3, 3000, True, 16) == 1        # too little work to split
    finally:
        import os
        reductions.cpu_threads = lambda: os.cpu_count() or 1


SPLIT_CASES = [
    ("sum0_narrow", lambda x: x.sum(0), lambda: [torch.rand(200_000, 3) + 0.5]),
    ("mean0_float64", lambda x: x.mean(0), lambda: [torch.rand(100_000, 8, dtype=torch.float64)]),
    ("tanh_mean0", lambda x: x.tanh().mean(0), lambda: [torch.rand(50_000, 16) + 0.5]),
    ("var0", lambda x: x.var(0), lambda: [torch.randn(100_000, 4) * 3 + 1]),
    ("amax0_nan_inf", lambda x: x.amax(0), lambda: [_with_specials(torch.randn(100_000, 5))]),
    ("amin0_nan_inf", lambda x: x.amin(0), lambda: [_with_specials(torch.randn(100_000, 5))]),
    ("int_sum0", lambda x: x.sum(0), lambda: [torch.randint(-2 ** 30, 2 ** 30, (100_000, 6), dtype=torch.int32)]),
    ("bool_any_all", lambda x: ((x > 4.2).any(0), (x > -4.2).all(0)), lambda: [torch.randn(100_000, 6)]),
    # 4 x 50000 rows in 16 parts: the part's rows are a flat range over both reduced dims (div/mod indices)
    ("sum01_flat_parts", lambda x: x.sum((0, 1)), lambda: [torch.rand(4, 50_000, 3) + 0.5]),
    ("rows_few_long", lambda x: x.sum(1), lambda: [torch.rand(3, 400_000) + 0.5]),
]


@pytest.mark.parametrize("name,fn,make", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_few_results_are_split_and_match_eager(name, fn, make, monkeypatch):
    """With 16 threads to fill (monkeypatched: the split depends on the machine's CPU count), reductions with
    few results become a partial reduction over parts of the rows, then one over the parts (two kernels; the
    partials of a column reduction run column-wise too); NaN/inf, integer and boolean results as eager's."""
    from ember.codegen import reductions
    monkeypatch.setattr(reductions, "cpu_threads", lambda: 16)
    src = compiled(fn, make())
    assert src.count("reduction over") >= 2 * (1 + (name == "var0")) + (name == "bool_any_all") * 2, src
    if name not in ("rows_few_long",):
        assert "column-wise" in src
        # the partials' rows x0 = s*C + c walked in blocks of C (or a divisor): per-block xq, contiguous xi
        assert "const int64_t xq = xb /" in src and "xq / " not in src.split("kernel_buf", 2)[1], src
