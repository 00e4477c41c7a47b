"""float32 rsqrt in ember's Triton kernels: libdevice.rsqrt against the inline PTX of ember's prelude (`_rsqrt`).

Prints each one's PTX instructions for rsqrt and its cold compile time (a fresh Triton cache: linking libdevice
costs LLVM time in every kernel that calls it) and, on a GPU, whether both give bit-identical results over
float32 inputs of every exponent (denormals, zeros, infinities, NaN and negatives included).

    python bench/tools/gpu_rsqrt.py        # on the GPU machine (bench/device.sh run); without a GPU: PTX and timings only
"""
import datetime
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_rsqrt_")
import torch  # noqa: E402
import triton  # noqa: E402

from ember.codegen.triton.printer import PRELUDE  # noqa: E402
from ember.runtime.triton_launch import load_module  # noqa: E402

SOURCE = PRELUDE + '''

@triton.jit
def with_libdevice_{i}(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, libdevice.rsqrt(tl.load(x + o, mask=o < n)) * {i}.0, mask=o < n)


@triton.jit
def with_inline_{i}(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, _rsqrt(tl.load(x + o, mask=o < n)) * {i}.0, mask=o < n)
'''


def main() -> None:
    cuda = torch.cuda.is_available()
    print(f"# bench/tools/gpu_rsqrt.py, {torch.cuda.get_device_name() if cuda else 'no GPU (compile only)'}, "
          f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    mod = load_module("\n".join(SOURCE.format(i=i) for i in range(1, 5)))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32) if not cuda else None
    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    times = {"with_libdevice": [], "with_inline": []}
    for i in range(1, 5):
        for kind in times:
            src = ASTSource(getattr(mod, f"{kind}_{i}"), signature=sig, constexprs={"BLOCK": 1024})
            t0 = time.perf_counter()
            k = triton.compile(src, target=target) if target else triton.compile(src)
            times[kind].append(time.perf_counter() - t0)
            if i == 1:
                lines = [ln.strip() for ln in k.asm["ptx"].splitlines() if "rsqrt" in ln and not ln.strip().startswith("//")]
                print(f"  {kind}: {len(lines)} PTX lines with rsqrt, e.g. {lines[:1]}")
    for kind, ts in times.items():   # the first compile of a process also loads Triton's passes: drop it
        print(f"  {kind}: cold compile {' '.join(f'{t * 1e3:.0f}' for t in ts)} ms")
    if not cuda:
        return
    bits = torch.arange(0, 2 ** 32, 97, dtype=torch.int64, device="cuda")   # every exponent, sign and class
    x = (bits - 2 ** 31).to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, 1e-38],
                                   device="cuda")])
    outs = {}
    for kind in times:
        y = torch.empty_like(x)
        getattr(mod, f"{kind}_1")[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        outs[kind] = y
    a, b = outs["with_libdevice"].view(torch.int32), outs["with_inline"].view(torch.int32)
    same = (a == b) | (outs["with_libdevice"].isnan() & outs["with_inline"].isnan())
    print(f"  bit-identical on {int(same.sum())} of {x.numel()} float32 inputs")
    eager = torch.rsqrt(x)
    finite = eager.isfinite() & (eager != 0)
    rel = ((outs["with_inline"] - eager).abs() / eager.abs())[finite]
    print(f"  against torch.rsqrt (eager): max relative difference {rel.max().item():.2e} on finite results")
    sys.exit(0 if bool(same.all()) else 1)


if __name__ == "__main__":
    main()
