"""Many tensors copied into one flat allocation in one kernel launch (CUDA, Triton).

A replay's outputs that the caller keeps are cloned on each replay (cudagraphs.FreshLike). A CNN's training step
clones hundreds of gradients, many of them small: torch.cat into one allocation takes several launches and several
times the GPU time their traffic needs. Here every program copies one block of one source: the block table (which
source, where in it) is built once, since the sources (graph memory) stay at their addresses; only the destination
changes per call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)


@triton.jit
def _copy_blocks(dst, src_addresses, dst_offsets, sizes, block_source, block_start, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_source + pid)
    start = tl.load(block_start + pid)
    src = tl.load(src_addresses + t).to(dst.dtype, bitcast=True)   # an address -> a pointer of dst's type
    i = start + tl.arange(0, BLOCK)
    mask = i < tl.load(sizes + t)
    tl.store(dst + tl.load(dst_offsets + t) + i, tl.load(src + i, mask=mask), mask=mask)


class GatherCopy:
    """`copy(dst)`: sources[k] into dst[offsets[k]:offsets[k] + numel] for every k, in one launch."""

    def __init__(self, sources: list[torch.Tensor], offsets: list[int]):
        device = sources[0].device
        block_source, block_start = [], []
        for k, s in enumerate(sources):
            for start in range(0, s.numel(), BLOCK):
                block_source.append(k)
                block_start.append(start)

        def table(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)
        self.sources = sources   # (kept alive: the table holds their addresses)
        self.tables = (table([s.data_ptr() for s in sources]), table(offsets), table([s.numel() for s in sources]),
                       table(block_source, torch.int32), table(block_start))
        self.grid = (len(block_source),)

    def copy(self, dst: torch.Tensor) -> None:
        _copy_blocks[self.grid](dst, *self.tables, BLOCK=BLOCK)
