"""The Triton printer: a Schedule (ember.codegen.schedule) -> one Python module of @triton.jit kernels, one per
FusedGroup, launched from the backend-neutral host program of ember.codegen.wrapper (ember.backends.triton_backend
compiles the module and launches its kernels).

The second printer beside cpp.py, over the same loop IR. A group is printed in one of three shapes:
  flat   every member is pointwise over the same rows x inner range and none reads another member:
         one 1-D range over all numel*R elements, `BLOCK` per program. The row/inner indices are
         substituted as div/mod of the flat index and simplified back (sympy), so contiguous buffers
         get plainly contiguous offsets and Triton emits 16-byte vector loads. Where a load runs across the
         stores (a transposed copy), [YBLOCK, XBLOCK] tiles instead, each access contiguous along its own dim.
  foreach  pointwise members over ranges of different sizes, or of several blocks of an `elementwise` group
         (horizontal fusion, e.g. an optimizer step): one flat range per (size, block), laid end to end
         over the program ids (`if pid < end0: ...`, `if (pid >= end0) & (pid < end1): ...`), so N
         parameters are one launch.
  rows   anything with a reduction (or members reading each other): a [XBLOCK, RBLOCK] tile, each
         program owning whole rows. Persistent when the longest inner range fits one RBLOCK (the row lives
         in registers, all members share it); looped otherwise (each member loops over its row with an
         [XBLOCK, RBLOCK] accumulator, reduced at the end). Members run in order; a reduction member's
         result is a [XBLOCK, 1] value later members read; a stored member read later in the same program
         is separated by a barrier.

Arithmetic on float16/bfloat16 values runs in float32 (loads upcast, stores round), like Inductor; casts to a
16-bit type round-trip so explicit casts keep their rounding. Sizes are specialized to the example's.

  printer.py      the prelude of helpers, op tables, literals; Body prints an Expr DAG as straight-line Triton
  heuristics.py   a group's kernel shape and launch configuration (block sizes, warps)
  passes.py       schedule passes for the GPU (splits, chunks, values kept in registers, results over dying inputs)
  kernels.py      kernel_source (flat and foreach kernels, the flagged sin/cos pair) and generate (the module)
  row_kernels.py  row kernels: persistent and looped, reductions, online softmax
"""
