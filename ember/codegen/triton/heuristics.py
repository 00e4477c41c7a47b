"""Which shape a fused group's Triton kernel takes (flat, foreach or rows: see ember/codegen/triton/__init__.py)
and its launch configuration (block sizes, warps), from the sizes."""
from __future__ import annotations

import functools
import math

import sympy
import torch

from ember import ir
from ember.ir import FloorDiv, ModIndex
from ember.codegen.schedule import X0, FusedGroup, Member, rvars

PERSISTENT_MAX_R = 4096     # longest row kept whole in registers
FLAT = "flat"
FOREACH = "foreach"
ROWS = "rows"


def inner_size(m: Member) -> int:
    """Elements of a member's inner (row) range: 1 where it has none."""
    return ir.prod(m.inner) if m.inner else 1


def inner_index(m: Member, rflat: sympy.Expr) -> dict:
    """r0, r1, ... of member m as div/mod of its flat inner index."""
    r = rvars(len(m.inner))
    strides = ir.contiguous_strides(m.inner)
    return {v: (ModIndex(FloorDiv(rflat, st), s) if len(m.inner) > 1 else rflat)
            for v, s, st in zip(r, m.inner, strides)}


def group_shape(group: FusedGroup) -> str:
    """FLAT, FOREACH or ROWS (ember/codegen/triton/__init__.py): pointwise members that do not read each other
    (or an elementwise group's, which forward their values in registers) are flat, or foreach when their ranges
    differ; anything else runs in row kernels."""
    pointwise = all(not m.is_reduction for m in group.members)
    same_r = len({(inner_size(m), m.block) for m in group.members}) == 1
    names = {m.buf.name for m in group.members}
    internal = any(m.reads & names for m in group.members)
    if pointwise and (not internal or group.elementwise):  # reads of each other: values forwarded in registers
        return FLAT if same_r else FOREACH
    return ROWS


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """The GPU's multiprocessors; without a visible GPU (the interpreter, the compile profile) a fixed count, so
    the printed code does not depend on the machine."""
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


FLAT_FULL_BLOCKS_FROM = 1 << 20   # elements from which a flat kernel takes full blocks (launch_config)
ARITHMETIC_BOUND = 3   # transcendental ops an element of a flat kernel (ir.EXPENSIVE) from which it gets smaller blocks


def launch_config(shape: str, rows: int, rmax: int, expensive: int = 0, reductions: str = "all") -> dict:
    """Block sizes and warps from the sizes; each rule was timed (docs/evidence.md).
    - A flat kernel takes 1024-element blocks; 512 (one 16-byte vector a thread) where it does at least
      ARITHMETIC_BOUND transcendental ops an element, being bound by its arithmetic, not memory. Under 1M
      elements, blocks shrink (down to 128) until there are 2 programs an SM: few programs stream slowly.
    - A row padded to its power of two (768 in 1024) runs one row a program on 8 warps.
    - Rows of 2048 to 4096 elements, at least 3 SMs' worth of them, loop instead of holding the row in
      registers: reductions alone (`reductions` "all") in 256-element steps on 8 warps, with an epilogue
      ("some") in 512-element steps on 16 warps. Fewer rows, or no reduction ("none": members reading each
      other's rows), keep the persistent kernel.
    - Longer rows loop one row a program in 2048-element steps on 16 warps."""
    if shape in (FLAT, FOREACH):
        total = rows * rmax
        big = 512 if shape == FLAT and expensive >= ARITHMETIC_BOUND else 1024
        block = big if total >= FLAT_FULL_BLOCKS_FROM else max(128, min(1024, triton_next_pow2(total)))
        while shape == FLAT and block > 128 and math.ceil(total / block) < 2 * sm_count():
            block //= 2   # few programs stream at a fraction of the bandwidth
        warps = 4 if block >= 512 else (2 if block >= 256 else 1)
        return {"BLOCK": block, "num_warps": warps}
    if rmax <= 1:
        xblock = max(1, min(1024, triton_next_pow2(rows)))
        return {"XBLOCK": xblock, "RBLOCK": 1, "num_warps": 4 if xblock >= 512 else 2, "persistent": True}
    if rmax > PERSISTENT_MAX_R:
        return {"XBLOCK": 1, "RBLOCK": 2048, "num_warps": 16, "persistent": False}
    if reductions != "none" and rmax >= 2048 and rows >= 3 * sm_count():
        return {"XBLOCK": 1, "RBLOCK": 256, "num_warps": 8, "persistent": False} if reductions == "all" else \
            {"XBLOCK": 1, "RBLOCK": 512, "num_warps": 16, "persistent": False}
    rblock = triton_next_pow2(rmax)
    if rmax < rblock and rblock >= 1024:
        return {"XBLOCK": 1, "RBLOCK": rblock, "num_warps": 8, "persistent": True}
    # enough programs to fill the GPU before making tiles taller
    xblock = 1
    while xblock * rblock < 2048 and xblock * 2 <= triton_next_pow2(rows) and \
            math.ceil(rows / (xblock * 2)) >= 2 * sm_count():
        xblock *= 2
    tile = xblock * rblock
    warps = 16 if tile >= 8192 else 8 if tile >= 2048 else 4 if tile >= 512 else 2 if tile >= 128 else 1
    return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": warps, "persistent": True}


def reduction_share(group: FusedGroup) -> str:
    """Whether "all", "some" or "none" of a group's members are reductions (launch_config's rows)."""
    n = sum(m.is_reduction for m in group.members)
    return "all" if n == len(group.members) else "some" if n else "none"


COLUMN_TILE = 8192   # elements of a persistent column tile whose group also stores rows (column_config)


def column_config(rows: int, rmax: int, reductions: str = "all") -> dict:
    """Reductions down columns (a bias or layer-norm weight gradient: a sum over the rows of a row-major
    matrix). A program takes a strip of at least 8 columns, so each row's piece is whole 32-byte sectors (one
    column a program reads a sector for 4 bytes), as many strips as fill the GPU, and loops down the rows; a
    strip that loops takes 16 columns or more in tiles of 1024 on 8 warps (timed: docs/evidence).
    A group that also stores down its columns (`reductions` "some": a log_softmax over dim 0) keeps the strip
    whole in registers while COLUMN_TILE holds 8 columns of it (read once, not once for its statistics and
    again for its output), as wide as that size allows and the GPU is filled."""
    from ember.codegen.reductions import GPU_COLUMN_STRIP
    xblock = GPU_COLUMN_STRIP
    if reductions == "some" and triton_next_pow2(rmax) * xblock <= COLUMN_TILE:
        rblock = triton_next_pow2(rmax)
        while xblock < 64 and xblock * 2 * rblock <= COLUMN_TILE and math.ceil(rows / (xblock * 2)) >= 2 * sm_count():
            xblock *= 2
        tile = xblock * rblock
        return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": 8 if tile >= 2048 else 4, "persistent": True}
    while xblock < 64 and math.ceil(rows / (xblock * 2)) >= 2 * sm_count():
        xblock *= 2
    rblock = max(1, min(triton_next_pow2(rmax), 4096 // xblock))
    if rmax <= rblock:
        return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": 4, "persistent": True}
    xblock = max(xblock, 16)
    return {"XBLOCK": xblock, "RBLOCK": 1024 // xblock, "num_warps": 8, "persistent": False}


def is_columnwise(group: FusedGroup) -> bool:
    """Whether the group reduces and every access runs down columns: consecutive kept indices (x0) are
    neighbours in memory while the reduced index strides over rows, and no load or store runs along the
    reduction (pointwise members too: a log_softmax over dim 0 stores its rows down the same columns)."""
    rflat = sympy.Symbol("rflat", integer=True, nonnegative=True)
    column = False
    if not any(m.is_reduction for m in group.members):
        return False
    for m in group.members:
        if (m.is_reduction and m.buf.kind.startswith("arg")) or m.body is None:
            return False
        subst = inner_index(m, rflat) if m.inner else {}
        offsets = [x.args[1] for x in m.body.walk() if x.op == "load"]
        if not m.is_reduction:
            offsets.append(m.store)
        for off in offsets:
            off = sympy.sympify(off).xreplace(subst)
            try:
                base = int(off.subs({X0: 0, rflat: 0}))
                along_x, along_r = int(off.subs({X0: 1, rflat: 0})) - base, int(off.subs({X0: 0, rflat: 1})) - base
            except (TypeError, ValueError):
                return False
            if along_x != 0 and abs(along_r) == 1:
                return False
            column |= along_x == 1 and abs(along_r) >= 8
    return column


def triton_next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_meta(cfg: dict) -> dict:
    """A launch config's Triton meta-parameters (BLOCK..., num_warps), without ember's own keys."""
    return {k: v for k, v in cfg.items() if k not in ("persistent", "fixup")}
