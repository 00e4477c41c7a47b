"""mode="max-autotune": a Triton matmul template with the pointwise epilogue that follows the matmul fused in,
chosen over the library call only where it measures faster on the GPU it compiles for.

A schedule has `mm`/`addmm` as extern calls (cuBLAS) followed by a flat pointwise group reading the product
(bias, activation, residual...). `fuse_mm_epilogues` replaces such a pair by one `TemplateGroup`: a tiled
GEMM (tl.dot over K, fp32 accumulator) whose [BM, BN] tile is then fed to the epilogue's own printed code,
the product's loads replaced by the accumulator (rounded to the product's dtype first, as eager stores it).
For each pair, a few tile configurations are compiled and timed on random inputs of the right layouts
against the library call plus the separate epilogue kernel; the fastest wins. The choice is cached on disk
(`EMBER_CACHE_DIR/triton/autotune.json`) by the kernel's source and the GPU's name, so a warm compile does not
time again.

Precision follows eager's settings: fp32 matmuls use IEEE products unless
torch.backends.cuda.matmul.allow_tf32 is set (then TF32, as cuBLAS would).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import statistics

import torch

from ember.ir import ExternBuffer, TensorArg
from ember.codegen.printer import kernel_args
from ember.codegen.schedule import FusedGroup, Schedule
from ember.codegen.triton.heuristics import FLAT, group_shape, inner_size
from ember.codegen.triton.kernels import canonical, flat_range, in_registers, kernel_source, storage_extent
from ember.codegen.triton.printer import PRELUDE
from ember.runtime.triton_launch import cache_dir, load_module
from ember.tools.logs import get_logger

log = get_logger("autotune")
aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BM, BN, BK, num_warps, num_stages)
CONFIGS = {
    torch.float32: [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3)],
    "16bit": [(64, 64, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)],
}


@dataclasses.dataclass(eq=False)
class TemplateGroup(FusedGroup):
    """A matmul and its epilogue group as one kernel. `members` are the epilogue's (what gets stored)."""
    mm: ExternBuffer = None
    extra_reads: set = dataclasses.field(default_factory=set)
    config: tuple = None

    @property
    def name(self):
        return "template_" + "_".join(m.buf.name for m in self.members[:4])


def _mm_operands(ext: ExternBuffer):
    """(bias TensorArg | None, A, B, beta, alpha) of an mm/addmm extern, or None."""
    if ext.target is aten.mm.default and len(ext.args) == 2:
        a, b = ext.args
        bias, beta, alpha = None, 1, 1
    elif ext.target is aten.addmm.default and len(ext.args) == 3:
        bias, a, b = ext.args
        beta, alpha = ext.kwargs.get("beta", 1), ext.kwargs.get("alpha", 1)
        if not isinstance(bias, TensorArg) or len(bias.size) not in (1, 2):
            return None
    else:
        return None
    if not (isinstance(a, TensorArg) and isinstance(b, TensorArg) and len(a.size) == 2 and len(b.size) == 2):
        return None
    if set(ext.kwargs) - {"beta", "alpha"} or not all(isinstance(v, (int, float)) for v in (beta, alpha)):
        return None
    return bias, a, b, beta, alpha


def _candidate(sched: Schedule, i: int, readers: dict, outputs: set):
    """The (extern, epilogue group) pair at items i, i+1 when the template can take it, else None."""
    ext = sched.items[i]
    if not isinstance(ext, ExternBuffer) or ext.fallback or i + 1 >= len(sched.items):
        return None
    group = sched.items[i + 1]
    if not isinstance(group, FusedGroup) or isinstance(group, TemplateGroup) or group_shape(group) != FLAT:
        return None
    ops = _mm_operands(ext)
    outs = [o for o in ext.outputs if o is not None]
    if ops is None or len(outs) != 1:
        return None
    o = outs[0]
    m_, n_ = (int(s) for s in o.size)
    if o.dtype not in DTYPES or tuple(int(s) for s in o.stride) != (n_, 1) or int(o.offset or 0) != 0:
        return None
    if any(sched.buffers[t.buffer].dtype != o.dtype for t in ops[:3] if t is not None):
        return None
    if readers.get(o.name, set()) != {i + 1} or o.name in outputs:
        return None
    if max(int(group.numel), 1) * max(inner_size(m) for m in group.members) != m_ * n_ or m_ * n_ == 0:
        return None
    return ext, group, o, ops


def _operand_ptr(t: TensorArg, rows: str, cols: str) -> str:
    """Pointer expression of a 2-D (or 1-D, broadcast over rows) operand at tile indices rows x cols."""
    if len(t.size) == 1:
        return f"{t.buffer} + {t.offset} + {cols} * {t.stride[0] if t.size[0] != 1 else 0}"
    s0 = t.stride[0] if t.size[0] != 1 else 0
    s1 = t.stride[1] if t.size[1] != 1 else 0
    return f"{t.buffer} + {t.offset} + {rows} * {s0} + {cols} * {s1}"


def template_source(group: FusedGroup, o, ops, sched: Schedule):
    """(source lines of KERNEL, pointer args, (M, N)) or None when the epilogue cannot take the tile."""
    bias, a, b, beta, alpha = ops
    m_, k_ = (int(s) for s in a.size)
    n_ = int(b.size[1])
    ep_args, _ = kernel_args(group, in_registers)
    args = list(dict.fromkeys([a.buffer, b.buffer] + ([bias.buffer] if bias is not None else [])
                              + [x for x in ep_args if x != o.name]))
    extents = {x: storage_extent(sched.buffers[x]) for x in ep_args}
    # the epilogue as the flat kernel prints it, minus its 1-D xindex/xmask (the tile defines 2-D ones)
    rows = max(int(group.numel), 1)
    body = flat_range(group.members, "0", rows, max(inner_size(m) for m in group.members), extents, "    ")[2:]
    body = [line.replace("tl.full([BLOCK],", "tl.full([BM, BN],") for line in body]
    # the product's loads become the accumulator; any other use of it (another index) cannot take the tile
    load = re.escape(f"tl.load({o.name} + xindex, xmask, other=0)") + r"(\.to\(tl\.float32\))?"
    body = [re.sub(load, "acc", line) for line in body]
    if any(re.search(rf"\b{o.name}\b", line) for line in body):
        return None
    tl_o = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}[o.dtype]
    # fp32: IEEE products as cuBLAS computes them unless TF32 is allowed (16-bit inputs ignore the setting)
    prec = "ieee" if o.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    L = [f"# matmul template {m_}x{k_}x{n_} + fused fx nodes: {', '.join(group.origins())[:160]}",
         "@triton.jit",
         f"def KERNEL({', '.join(args)}, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):",
         "    pid = tl.program_id(0)",
         f"    grid_n = tl.cdiv({n_}, BN)",
         "    pid_m = pid // grid_n",
         "    pid_n = pid % grid_n",
         "    rm = pid_m * BM + tl.arange(0, BM)",
         "    rn = pid_n * BN + tl.arange(0, BN)",
         "    rk = tl.arange(0, BK)",
         "    acc = tl.zeros((BM, BN), dtype=tl.float32)",
         f"    for k in range(0, {k_}, BK):",
         f"        av = tl.load({_operand_ptr(a, 'rm[:, None]', '(k + rk)[None, :]')}, "
         f"mask=(rm[:, None] < {m_}) & ((k + rk)[None, :] < {k_}), other=0.0)",
         f"        bv = tl.load({_operand_ptr(b, '(k + rk)[:, None]', 'rn[None, :]')}, "
         f"mask=((k + rk)[:, None] < {k_}) & (rn[None, :] < {n_}), other=0.0)",
         f"        acc += tl.dot(av, bv, input_precision=\"{prec}\", out_dtype=tl.float32)"]
    if alpha != 1:
        L.append(f"    acc = acc * {float(alpha)}")
    if bias is not None:
        L.append(f"    bv = tl.load({_operand_ptr(bias, 'rm[:, None]', 'rn[None, :]')}, "
                 f"mask=(rm[:, None] < {m_}) & (rn[None, :] < {n_}), other=0.0).to(tl.float32)")
        L.append(f"    acc = acc + bv * {float(beta)}" if beta != 1 else "    acc = acc + bv")
    if o.dtype != torch.float32:   # the product as eager stores it
        L.append(f"    acc = acc.to({tl_o}).to(tl.float32)")
    L.append(f"    xindex = rm[:, None] * {n_} + rn[None, :]")
    L.append(f"    xmask = (rm[:, None] < {m_}) & (rn[None, :] < {n_})")
    return L + body, args, (m_, n_)


# ---------------------------------------------------------------------------------------------- the choice
def _choices_path() -> str:
    return os.path.join(cache_dir(), "autotune.json")


def _load_choices() -> dict:
    try:
        with open(_choices_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save_choice(key: str, value) -> None:
    choices = _load_choices()
    choices[key] = value
    tmp = f"{_choices_path()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(choices, f)
    os.replace(tmp, _choices_path())


def _random_buffer(buf, device) -> torch.Tensor:
    size = tuple(int(s) for s in buf.size)
    t = torch.empty_strided(size, tuple(int(s) for s in buf.stride), dtype=buf.dtype, device=device)
    if buf.dtype.is_floating_point:
        t.normal_()
    else:
        t.zero_()           # index-like inputs stay in range
    return t


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _choose(sched: Schedule, ext, group, o, src: list, args: list, mn: tuple, device) -> tuple | None:
    """The fastest config of the template, or None when the library call plus the epilogue kernel wins."""
    configs = CONFIGS[torch.float32] if o.dtype == torch.float32 else CONFIGS["16bit"]
    name, text = canonical(src, args + [m.buf.name for m in group.members])
    key = hashlib.sha256((text + torch.cuda.get_device_name(device)).encode()).hexdigest()[:24]
    choices = _load_choices()
    if key in choices:
        return tuple(choices[key]) if choices[key] else None
    bufs = {}
    for n in set(args) | {m.buf.name for m in group.members} | set(ext.inputs) | {o.name}:
        bufs[n] = _random_buffer(sched.buffers[n], device)

    def view(x):
        return bufs[x.buffer].as_strided(x.size, x.stride, bufs[x.buffer].storage_offset() + x.offset) \
            if isinstance(x, TensorArg) else x
    ep_src, ep_args, ep_cfg, ep_grid = kernel_source(group, sched, "KERNEL")
    ep_name, ep_text = canonical(ep_src, ep_args + [m.buf.name for m in group.members])
    mod = load_module(PRELUDE + "\n\n" + ep_text + "\n\n\n" + text + "\n")
    ep_meta = {k: v for k, v in ep_cfg.items() if k != "persistent"}
    ep_kernel, tpl = getattr(mod, ep_name), getattr(mod, name)
    ext_args = [view(x) for x in ext.args]
    ext_kwargs = {k: view(v) for k, v in ext.kwargs.items()}

    def library():   # as the host program runs the pair: the library call, then the epilogue on its result
        out = ext.target(*ext_args, **ext_kwargs)
        ep_kernel[(ep_grid,)](*[out if x == o.name else bufs[x] for x in ep_args], **ep_meta)
    best, best_ms = None, _time_ms(library)
    base_ms = best_ms
    ptrs = [bufs[x] for x in args]
    m_, n_ = mn
    for bm, bn, bk, warps, stages in configs:
        grid = (math.ceil(m_ / bm) * math.ceil(n_ / bn),)
        try:
            ms = _time_ms(lambda: tpl[grid](*ptrs, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages))
        except Exception as e:  # a config that does not compile (registers, shared memory) is not a choice
            log.debug("template config %s failed: %s", (bm, bn, bk, warps, stages), e)
            continue
        if ms < best_ms:
            best, best_ms = (bm, bn, bk, warps, stages), ms
    log.info("mm %s: library+epilogue %.4f ms, template best %s %.4f ms", mn, base_ms, best, best_ms)
    _save_choice(key, list(best) if best else None)
    return best


def fuse_mm_epilogues(sched: Schedule, device, force: tuple | None = None) -> Schedule:
    """Replace each (mm/addmm, epilogue) pair the template can take by a TemplateGroup where it wins.
    force: use this config without timing (the tests, under TRITON_INTERPRET)."""
    readers: dict[str, set] = {}
    for j, it in enumerate(sched.items):
        names = it.inputs if isinstance(it, ExternBuffer) else set().union(*(m.reads for m in it.members))
        for n in names:
            readers.setdefault(n, set()).add(j)
    outputs = {x.buffer for x in sched.lowered.outputs if isinstance(x, TensorArg)}
    items, i = [], 0
    while i < len(sched.items):
        cand = _candidate(sched, i, readers, outputs)
        made = None
        if cand is not None:
            ext, group, o, ops = cand
            printed = template_source(group, o, ops, sched)
            if printed is not None:
                src, args, mn = printed
                try:
                    config = force or _choose(sched, ext, group, o, src, args, mn, device)
                except Exception as e:  # timing failed: the library call stays
                    log.debug("autotuning %s failed: %s: %s", ext.name, type(e).__name__, e)
                    config = None
                if config is not None:
                    made = TemplateGroup(group.numel, group.members, mm=ext, extra_reads=set(ext.inputs),
                                         config=tuple(config))
                    made.template = (src, args, mn)
        if made is not None:
            items.append(made)
            i += 2
        else:
            items.append(sched.items[i])
            i += 1
    return dataclasses.replace(sched, items=items)
