"""Tolerances from error analysis: a compiled float32 result is right when it is as close to the float64 result
as eager's own float32 result is. A fixed tolerance against eager encodes one CPU's rounding: eager's kernels
differ by instruction set (ATen and oneDNN pick theirs at run time), so the same program is off float64 by 1e-7 on
one machine and 1e-3 on another."""
import torch


def assert_as_close_as_eager(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, factor: float = 2.0,
                             ulps: float = 8.0, msg: str = "") -> None:
    """max |got - exact| <= factor * max |eager - exact| + ulps float32 roundings of max |exact|, with got's
    dtype and shape those of eager."""
    assert got.dtype == eager.dtype and got.shape == eager.shape, (got.dtype, eager.dtype, got.shape, eager.shape)
    exact = exact.double()
    err_got = (got.double() - exact).abs().max().item()
    err_eager = (eager.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    allowed = factor * err_eager + ulps * torch.finfo(got.dtype).eps * scale
    assert err_got <= allowed, (f"{msg} compiled is off the float64 result by {err_got:.3g}, more than "
                                f"{factor} x eager's {err_eager:.3g} + {ulps} ulps of {scale:.3g}")
