"""What bounds the pointwise chain (bench/gpu.py's first row): its memory side, its arithmetic, or their overlap.
Triton kernels over the same 64M float32 elements, written on ember's prelude (its _sincos), timed in turns
(medians of 5 rounds):
  copy            x*1.5+0.5: the loads and stores alone (the memory floor)
  chain           the chain with sin and cos from libdevice (tl.sin, tl.cos) or from ember's _sincos (one range
                  reduction and a block test for arguments past its fast path), _sincos_fast ("no check"),
                  _sincos_nan_slow (the block test, a NaN for its slow path), _sincos_flagged with a fixup
                  kernel that only reads the flag ("flag+fixup": what a flagged pair costs when not needed)
  math-only       the chain's arithmetic on values made from the index, no load; the store is predicated on a
                  result tanh never gives, so nothing is stored but nothing can be left out
  <op> x4         one op on four such values an element (empty, index x4: the launch floor under them)
  ember ...       ember's own kernels for the chain (bench/gpu.py's step), OWN_SINCOS on (a flagged pair) and off
and for each hand-written kernel its registers, spills and the instruction mix of its SASS (cuobjdump; the
SASS and PTX are written to $OUT), to set the instructions an element against the GPU's issue rate.
Grid-stride loops (one program a block is faster) are in docs/evidence.md.

    python bench/tools/gpu_pointwise_bound.py     # on the GPU machine
"""
import collections
import datetime
import os
import re
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench import gpu  # noqa: E402

from ember import config  # noqa: E402
from ember.codegen.triton.printer import PRELUDE  # noqa: E402
from ember.runtime.triton_launch import load_module  # noqa: E402

N = gpu.N_POINTWISE
CONFIGS = [(512, 4), (1024, 4), (1024, 8)]   # (BLOCK, num_warps) the chains are timed at; the rest at the first

SOURCE = '''

@triton.jit
def _made(i):   # values like randn's (|x| < 4) from the index, so no load is needed
    return (i & 65535).to(tl.float32) * (8.0 / 65536.0) - 4.0


@triton.jit
def _rest(x, s, c):   # the chain after its sin and cos
    y = s * c
    y = tl.where(y < 0, 0, y) + tl.sigmoid(x)
    return libdevice.tanh(y * y - x)


@triton.jit
def k_copy(p0, p1, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(p1 + i, tl.load(p0 + i) * 1.5 + 0.5)


@triton.jit
def k_fixup(flag):   # what follows a flagged kernel: nothing, unless an argument was past the fast path
    if tl.load(flag) != 0:
        tl.store(flag, 0)


@triton.jit
def k_math_only_libdevice(p0, p1, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = _made(i)
    y = x * 1.5 + 0.5
    r = _rest(x, tl.sin(y), tl.cos(y))
    tl.store(p1 + i, r, mask=r == 7.0)


@triton.jit
def k_math_only_sincos(p0, p1, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = _made(i)
    s, c = _sincos(x * 1.5 + 0.5)
    r = _rest(x, s, c)
    tl.store(p1 + i, r, mask=r == 7.0)


@triton.jit
def k_empty(p0, p1, BLOCK: tl.constexpr):
    pass

'''
# the chain's kernels: name -> (extra parameters, how its sin and cos of y are computed)
CHAINS = {"libdevice": ("", "tl.sin(y), tl.cos(y)"), "sincos": ("", "_sincos(y)"),
          "sincos_no_check": ("", "_sincos_fast(y)"), "sincos_nan_slow": ("", "_sincos_nan_slow(y)"),
          "sincos_flag": ("flag, ", "_sincos_flagged(y, flag)")}
for name, (params, call) in CHAINS.items():
    SOURCE += f'''

@triton.jit
def k_chain_{name}(p0, p1, {params}BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(p0 + i)
    y = x * 1.5 + 0.5
    s, c = {call}
    tl.store(p1 + i, _rest(x, s, c))
'''
# one op on four made values an element: name -> the expression of `v`
X4 = {"index": "{v}", "sin*cos libdevice": "tl.sin({v}) * tl.cos({v})", "sin*cos _sincos": "_mul(_sincos({v}))",
      "sin*cos no check": "_mul(_sincos_fast({v}))", "sigmoid": "tl.sigmoid({v})",
      "tanh": "libdevice.tanh({v})"}
SOURCE += '''
@triton.jit
def _mul(sc):
    return sc[0] * sc[1]
'''
for j, (name, expr) in enumerate(X4.items()):
    terms = " + ".join(expr.format(v=f"_made(i + {k})") for k in range(4))
    SOURCE += f'''

@triton.jit
def k_x4_{j}(p0, p1, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = {terms}
    tl.store(p1 + i, r, mask=r == 7.0)
'''


def _variants(prelude: str) -> str:
    """_sincos_nan_slow: _sincos whose slow path is a NaN, to time its block test alone (wrong past the fast
    path: a measurement only)."""
    src = prelude[prelude.index("@triton.jit\ndef _sincos("):]
    src = src[:src.index("return s, c")] + "return s, c\n"
    src = src.replace("tl.sin(x)", "float('nan')").replace("tl.cos(x)", "float('nan')")
    return "\n\n" + src.replace("def _sincos(", "def _sincos_nan_slow(")


def sass_mix(name: str, compiled) -> str:
    """The SASS's instruction count and commonest opcodes; the chains' SASS and PTX are written to $OUT (if set)."""
    out, fname = os.environ.get("OUT") if name.endswith(("sincos 512/4", "check 512/4")) else None, re.sub(r"[^a-z0-9]+", "_", name)
    if out:
        with open(os.path.join(out, f"{fname}.ptx"), "w") as f:
            f.write(compiled.asm.get("ptx", ""))
    try:
        from triton.tools.disasm import get_sass
        sass = get_sass(compiled.asm["cubin"])
    except Exception as e:   # no cuobjdump: the PTX's instruction count instead
        ptx = compiled.asm.get("ptx", "")
        lines = [ln.strip() for ln in ptx.splitlines() if re.match(r"\s+[a-z]", ln)]
        return f"(no SASS: {type(e).__name__}) {len(lines)} PTX instructions"
    if out:
        with open(os.path.join(out, f"{fname}.sass"), "w") as f:
            f.write(sass)
    ops = collections.Counter()
    for ln in sass.splitlines():
        m = re.match(r"(?:\S+\t)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops[m.group(1)] += 1
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
    return f"{sum(ops.values())} SASS instructions ({top})"


def main() -> None:
    print(f"# bench/tools/gpu_pointwise_bound.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"Triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"{N} float32")
    mod = load_module(PRELUDE + _variants(PRELUDE) + SOURCE)
    x = torch.randn(N, device="cuda")
    out = torch.empty_like(x)
    kernels = {"copy": (mod.k_copy, CONFIGS[:1]), "empty": (mod.k_empty, CONFIGS[:1])}
    steps = {}
    for v in ("libdevice", "sincos", "sincos_no_check", "sincos_nan_slow"):
        kernels[f"chain {v}"] = (getattr(mod, f"k_chain_{v}"), CONFIGS)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for block, warps in CONFIGS[:2]:
        mod.k_chain_sincos_flag[(N // block,)](x, out, flag, BLOCK=block, num_warps=warps)
        mod.k_fixup[(4 * sms,)](flag)
        assert flag.item() == 0

        def step(b=block, w=warps):
            mod.k_chain_sincos_flag[(N // b,)](x, out, flag, BLOCK=b, num_warps=w)
            mod.k_fixup[(4 * sms,)](flag)
        steps[f"chain sincos_flag+fixup {block}/{warps}"] = step
    for v in ("libdevice", "sincos"):
        kernels[f"math-only {v}"] = (getattr(mod, f"k_math_only_{v}"), CONFIGS[:1])
    for j, name in enumerate(X4):
        kernels[f"{name} x4"] = (getattr(mod, f"k_x4_{j}"), CONFIGS[:1])
    for name, (k, configs) in kernels.items():
        for block, warps in configs:
            label = f"{name} {block}/{warps}"
            compiled = k[(N // block,)](x, out, BLOCK=block, num_warps=warps)
            torch.cuda.synchronize()
            print(f"{label:32s} regs {compiled.n_regs:3d} spills {compiled.n_spills}  {sass_mix(label, compiled)}",
                  flush=True)
            steps[label] = (lambda k=k, b=block, w=warps: k[(N // b,)](x, out, BLOCK=b, num_warps=w))
            if name.startswith("chain"):
                ref = torch.tanh((torch.relu(torch.sin(x * 1.5 + 0.5) * torch.cos(x * 1.5 + 0.5)) +
                                  torch.sigmoid(x)) ** 2 - x)
                print(f"    against eager: max abs diff {(out - ref).abs().max().item():.3g}")
    for own in (True, False):   # ember's printed chain, with and without _sincos (OWN_SINCOS)
        config.OWN_SINCOS = own
        try:
            step = gpu.pointwise(gpu.ember_compile, None)
            step()
            torch.cuda.synchronize()
        finally:
            config.OWN_SINCOS = True
        steps[f"ember {'_sincos' if own else 'libdevice'}"] = step
    times = gpu.in_turns(steps, 200, 5)
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"{name:32s} {ms:.4f} ms  {2 * 4 * N / ms / 1e6:5.0f} GB/s-equivalent  "
              f"rounds {' '.join(f'{t:.4f}' for t in ts)}", flush=True)


if __name__ == "__main__":
    main()
