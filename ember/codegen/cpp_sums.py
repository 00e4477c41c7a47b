"""Sums' loops in the C++ backend (cpp._sums, cpp._member): which sums share one loop nest (`siblings`), and
float64 sums of float32 values that may take float partials.

A sum in float64 of float32 values that may take float partials (ir.Reduction.partial_dtype: a train-mode batch
norm's backward sums on the CPU, decomp.norms, rounded to float32 afterwards) adds the float values in the innermost
loop to a float partial per at most PARTIAL_CHUNK elements, added to the float64 accumulator after it. A float64
accumulator in the vector loop takes half the lanes, and where a select feeds the cast (a ReLU's mask in a batch
norm's backward) g++ does not vectorize the loop at all: scalar code, ~10x slower. Each vector lane's partial sums
at most PARTIAL_CHUNK / 16 values, as eager's per-plane vector sums do, and the float64 sum over the partials keeps
the rest of the float64 accumulation's accuracy.
"""
from __future__ import annotations

import torch

from ember.codegen import cpp_lowp
from ember.codegen.schedule import Member, rvars
from ember.ir import symbols

PARTIAL_CHUNK = 1024   # float32 elements summed into a float partial before it joins a float64 sum


def siblings(prev: list, m: Member) -> bool:
    """Whether sum m joins the sums of `prev` in one loop nest (cpp._sums): the same inner loops, none reading
    another's result. A batch norm's backward takes two sums of one recomputed value per element; one loop
    computes it once."""
    def plain_sum(x: Member) -> bool:
        return x.is_reduction and x.buf.kind == "sum" and bool(x.inner) and x.body.dtype != torch.bool \
            and x.body.dtype not in cpp_lowp.LOW_PRECISION
    if not (plain_sum(m) and all(plain_sum(p) for p in prev) and tuple(prev[0].inner) == tuple(m.inner)
            and prev[0].block == m.block):
        return False
    names = {p.buf.name for p in prev}
    return not any(x.op == "load" and x.args[0] in names for x in m.body.walk())


def widened_sum(m: Member, loop: tuple = ()) -> bool:
    """Whether m sums float32 values in float64 and may take float partials (ir.Reduction.partial_dtype: a
    statistic rounded to float32 afterwards; a user's `x.double().sum()` sums every value in float64), in a loop
    (m and the members in `loop`) reading no 16-bit floats (those loops convert in chunks, cpp_lowp.Chunks)."""
    x = m.body
    return m.buf.kind == "sum" and getattr(m.buf, "partial_dtype", None) == torch.float32 and x is not None \
        and x.op == "cast" and x.dtype == torch.float64 and x.args[0].dtype == torch.float32 \
        and not any(y.op == "load" and y.dtype in cpp_lowp.LOW_PRECISION
                    for k in (m, *loop) if k.body is not None for y in k.body.walk())


def partial_loops(head: list, close: list, inner, parts: dict, size: str) -> tuple[list, list]:
    """The opening and closing lines of a reduction's loop nest (cpp._loops: its innermost loop `omp simd`, with
    the accumulators' reduction clauses) with a float partial per accumulator in `parts` (accumulator -> the
    partial's name) in the innermost loop; `size` is the innermost loop's bound as C. The loop body adds the
    float value to the partial."""
    if not parts:
        return head, close
    v, n = rvars(len(inner))[-1], inner[-1]
    pragma, loop = head[-2], head[-1]
    ind = pragma[:len(pragma) - len(pragma.lstrip())]
    simd = pragma.split(" if(")[0].replace(" parallel for", "")
    for acc, part in parts.items():
        simd = simd.replace(f" reduction(+:{acc})", f" reduction(+:{part})")
    decls = [f"{ind}float {part} = 0;" for part in parts.values()]
    adds = [f"{ind}{acc} += {part};" for acc, part in parts.items()]
    if symbols.is_static(n) and int(n) <= PARTIAL_CHUNK and " parallel for" not in pragma:
        return head[:-2] + decls + [simd, loop], close[:1] + adds + close[1:]
    # chunks of the innermost loop (shared among threads where the loop was)
    shared = [pragma.replace(" simd", "", 1)] if " parallel for" in pragma else []
    chunks = [f"{ind}for (int64_t {v}c = 0; {v}c < {size}; {v}c += {PARTIAL_CHUNK}) {{"]
    inner_loop = f"{ind}  for (int64_t {v} = {v}c; {v} < ember_imin({v}c + {PARTIAL_CHUNK}, {size}); {v}++) {{"
    return (head[:-2] + shared + chunks + ["  " + x for x in decls] + ["  " + simd, inner_loop],
            ["  " + close[0]] + ["  " + x for x in adds] + [f"{ind}}}"] + close[1:])
