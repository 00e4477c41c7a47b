"""Prefix sums on the GPU as ember's own library call: `cumsum(x, dim)` for a floating-point CUDA tensor along
its last, contiguous dim, one Triton kernel (Triton's tl.cumsum over a tile of rows, looping down long rows with
the running sum carried), in place of ATen's cumsum (codegen.lower picks it: `GPU_CUMSUM`). Other cases call
ATen's op. Accumulates in float32 (16-bit inputs too, as eager's CUDA kernel does) and rounds each result once."""
from __future__ import annotations

import functools
import os

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
TILE = 4096   # elements of a program's tile: rows of up to this length in one step, longer ones in steps of 1024


def supported(x_dtype: torch.dtype, ndim: int, dim: int, dtype: torch.dtype | None) -> bool:
    """Whether `cumsum` runs its own kernel for these arguments (else it calls ATen's)."""
    return x_dtype in FLOATS and dtype in (None, x_dtype) and ndim >= 1 and dim % ndim == ndim - 1


def cumsum(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.cumsum(x, dim) (contiguous result); the Triton kernel for a float tensor on the GPU (or on the CPU
    under Triton's interpreter) along its last dim."""
    on_device = x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if not on_device or not supported(x.dtype, x.ndim, dim, dtype) or x.numel() == 0:
        return torch.ops.aten.cumsum.default(x, dim, dtype=dtype)
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    rblock = min(1 << max(0, (n - 1).bit_length()), TILE)
    step = rblock if n <= TILE else 1024
    xblock = max(1, min(TILE // step, 1 << max(0, (rows - 1).bit_length())))
    warps = 8 if xblock * step >= 2048 else 4
    grid = ((rows + xblock - 1) // xblock,)
    _kernel()[grid](x, y, rows, n, XBLOCK=xblock, RBLOCK=step, WIDE=x.numel() >= 2 ** 31, ONE_STEP=n <= step,
                     num_warps=warps)
    return y


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cumsum_rows(x_ptr, y_ptr, rows, n, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, WIDE: tl.constexpr,
                    ONE_STEP: tl.constexpr):
        row = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
        if WIDE:
            row = row.to(tl.int64)
        xmask = row < rows
        if ONE_STEP:   # the whole row in one tile: no running sum to carry
            col = tl.arange(0, RBLOCK)[None, :]
            mask = xmask & (col < n)
            v = tl.load(x_ptr + row * n + col, mask, other=0).to(tl.float32)
            tl.store(y_ptr + row * n + col, tl.cumsum(v, 1).to(y_ptr.dtype.element_ty), mask)
        else:
            carry = tl.zeros([XBLOCK, 1], tl.float32)
            for start in range(0, n, RBLOCK):
                col = start + tl.arange(0, RBLOCK)[None, :]
                mask = xmask & (col < n)
                v = tl.load(x_ptr + row * n + col, mask, other=0).to(tl.float32)
                s = tl.cumsum(v, 1) + carry
                tl.store(y_ptr + row * n + col, s.to(y_ptr.dtype.element_ty), mask)
                # the running sum: the step's last column (masked lanes past n hold no element)
                carry = tl.max(tl.where(col == tl.minimum(start + RBLOCK, n) - 1, s, float("-inf")), 1)[:, None]
    return cumsum_rows
