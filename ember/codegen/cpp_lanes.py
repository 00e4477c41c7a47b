"""Reductions' innermost loops with their accumulators in lanes (cpp._member, cpp._sums): independent chains.

g++ vectorizes an `omp simd reduction` loop with one vector accumulator, so each step waits for the one before:
a chain of vmaxps (4 cycles on Intel cores) over 8 AVX2 lanes reads less than memory delivers (amax of 4M floats,
one thread: 0.73 ms against eager's 0.62), and a layer norm's row sums wait on vaddps the same way (0.73x eager on
AVX2). `split` rewrites such a loop into blocks of LANE_BYTES: an `omp simd` loop over the block's elements, each
adding into its own element of a local array (g++ keeps the array in several vector registers, one chain each),
then the elements past the last whole block into the scalar accumulator as before, then the array folded into
it. Eager's reductions keep several vector accumulators for the same reason (at::vec's reduce_all, cascade sums).
"""
from __future__ import annotations

import re

LANE_BYTES = 256   # of all a loop's accumulators together per block: 8 AVX2 or 4 AVX-512 registers of chains
SIZES = {"float": 4, "double": 8, "int32_t": 4, "int64_t": 8}
IDENTITY = {"+": "0", "|": "0", "*": "1"}   # max and min start from the accumulator's own value (idempotent)
FOLD = {"+": "{a} += {b};", "*": "{a} *= {b};", "|": "{a} |= {b};",
        "max": "{a} = ({b} > {a}) ? {b} : {a};", "min": "{a} = ({b} < {a}) ? {b} : {a};"}
_CLAUSE = re.compile(r" reduction\(([^:()]+):(\w+)\)")
_FOR = re.compile(r"^(\s*)for \(int64_t (\w+) = (.+?); \2 < (.+?); \2\+\+\) \{$")


def lanes(types: dict) -> int:
    """Elements per block for accumulators of these C types (a power of two, at least 8)."""
    k = LANE_BYTES // sum(SIZES[t] for t in types.values())
    return max(8, 1 << (k.bit_length() - 1))


def worth(types: dict, n: int | None) -> bool:
    """Whether a loop of n elements (None: unknown) with these accumulators gains from lanes: a floating-point
    one among them (an integer add's chain takes one cycle) and at least two blocks."""
    return any(t in ("float", "double") for t in types.values()) and all(t in SIZES for t in types.values()) \
        and (n is None or n >= 2 * lanes(types))


def split(lines: list[str], types: dict) -> list[str]:
    """`lines` with each innermost reduction loop whose clauses name only accumulators in `types` (name -> C
    type) and operators of FOLD split into lanes (module doc); other lines as they are."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        clauses = _CLAUSE.findall(line)
        m = _FOR.match(lines[i + 1]) if i + 1 < len(lines) and line.lstrip().startswith("#pragma omp") else None
        if not (clauses and m and " simd" in line and all(op in FOLD and v in types for op, v in clauses)
                and worth({v: types[v] for _, v in clauses}, None)):
            out.append(line)
            i += 1
            continue
        ind, var, lo, hi = m.groups()
        end = next(j for j in range(i + 2, len(lines)) if lines[j] == ind + "}")
        if any(x.lstrip().startswith(("for (", "#pragma")) for x in lines[i + 2:end]):   # not the innermost loop
            out.append(line)
            i += 1
            continue
        out += _blocks(line, ind, var, lo, hi, lines[i + 2:end], clauses, types)
        i = end + 1
    return out


def _blocks(pragma: str, ind: str, v: str, lo: str, hi: str, body: list[str], clauses: list, types: dict) -> list[str]:
    k = lanes({name: types[name] for _, name in clauses})
    arr = {name: f"{name}_l" for _, name in clauses}
    lane = f"{v}l"

    def in_lanes(s: str) -> str:
        for name, a in arr.items():
            s = re.sub(rf"\b{name}\b", f"{a}[{lane}]", s)
        return s
    parallel = " parallel for" in pragma
    cond = pragma[pragma.index(" if("):] if " if(" in pragma else ""
    serial = pragma[:len(pragma) - len(cond)].replace(" parallel for", "")
    out = [f"{ind}{{", f"{ind}const int64_t {v}e = ({lo}) + (({hi}) - ({lo})) / {k} * {k};"]
    for op, name in clauses:
        init = IDENTITY.get(op, name)
        out.append(f"{ind}{types[name]} {arr[name]}[{k}]; for (int {lane} = 0; {lane} < {k}; {lane}++) "
                   f"{arr[name]}[{lane}] = {init};")
    if parallel:   # threads share the blocks, each with its own lanes
        sections = "".join(f" reduction({op}:{arr[name]}[:{k}])" for op, name in clauses)
        out.append(f"{ind}#pragma omp parallel for{sections}{cond}")
    out += [f"{ind}for (int64_t {v}b = {lo}; {v}b < {v}e; {v}b += {k}) {{",
            f"{ind}  #pragma omp simd",
            f"{ind}  for (int64_t {lane} = 0; {lane} < {k}; {lane}++) {{",
            f"{ind}    const int64_t {v} = {v}b + {lane};",
            *("    " + in_lanes(x) for x in body), f"{ind}  }}", f"{ind}}}"]
    out += [serial, f"{ind}for (int64_t {v} = {v}e; {v} < {hi}; {v}++) {{", *body, f"{ind}}}"]
    for op, name in clauses:   # (a vector fold: one add after another is the chain again, 64 long)
        out += [f"{ind}#pragma omp simd reduction({op}:{name})",
                f"{ind}for (int {lane} = 0; {lane} < {k}; {lane}++) {{ "
                + FOLD[op].format(a=name, b=f"{arr[name]}[{lane}]") + " }"]
    return out + [f"{ind}}}"]
