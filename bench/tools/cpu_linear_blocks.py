"""Blocks of CPU float32 linear layers (eval, no_grad) compiled by ember twice, its products through oneDNN's inner
product (bias and activation inside: EMBER_ONEDNN_MATMULS=1) and through ATen's mm (MKL sgemm; the bias and
activation in the reader's kernel: =0), against eager, one call per column per round, median ms of the process's
CPU time (one thread).

    .venv/bin/python bench/tools/cpu_linear_blocks.py [--isa native|avx2|avx512] [--rounds R] [--blocks a,b]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ISA_ENV = {"avx2": {"EMBER_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"EMBER_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
           "native": {}}


def blocks():
    import torch
    from torch import nn
    import torch.nn.functional as F

    class FFN(nn.Module):      # bert / hf_vit: linear -> gelu -> linear -> + x -> layer_norm
        def __init__(s, d, h):
            super().__init__()
            s.a, s.b, s.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

        def forward(s, x):
            return s.ln(x + s.b(F.gelu(s.a(x))))

    class GLU(nn.Module):      # llama: down(silu(gate(x)) * up(x)) + x
        def __init__(s, d, h):
            super().__init__()
            s.g, s.u, s.d = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

        def forward(s, x):
            return x + s.d(F.silu(s.g(x)) * s.u(x))

    class Attn(nn.Module):     # q, k, v projections -> sdpa -> out projection -> + x
        def __init__(s, d, heads, kv=None):
            super().__init__()
            s.h, s.dh = heads, d // heads
            kv = kv or d
            s.q, s.k, s.v, s.o = nn.Linear(d, d), nn.Linear(d, kv), nn.Linear(d, kv), nn.Linear(d, d)

        def forward(s, x):
            b, t, d = x.shape
            q = s.q(x).view(b, t, s.h, s.dh).transpose(1, 2)
            k = s.k(x).view(b, t, -1, s.dh).transpose(1, 2)
            v = s.v(x).view(b, t, -1, s.dh).transpose(1, 2)
            if k.shape[1] != s.h:
                k, v = (z.repeat_interleave(s.h // z.shape[1], 1) for z in (k, v))
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
            return x + s.o(y)

    class Head(nn.Module):     # a CNN's classifier: linear -> hardswish -> linear (mobilenet_v3), 8 rows
        def __init__(s, d, h, n):
            super().__init__()
            s.a, s.b = nn.Linear(d, h), nn.Linear(h, n)

        def forward(s, x):
            return s.b(F.hardswish(s.a(x)))

    class LMHead(nn.Module):   # llama / gpt2: rms-ish norm -> vocab product
        def __init__(s, d, n):
            super().__init__()
            s.w = nn.Linear(d, n, bias=False)

        def forward(s, x):
            return s.w(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    return {"bert_ffn": (lambda: FFN(256, 1024), (4, 128, 256)), "vit_ffn": (lambda: FFN(384, 1536), (4, 197, 384)),
            "vitb_ffn": (lambda: FFN(768, 3072), (2, 197, 768)), "llama_glu": (lambda: GLU(256, 688), (4, 128, 256)),
            "bert_attn": (lambda: Attn(256, 4), (4, 128, 256)), "llama_attn": (lambda: Attn(256, 8, 128), (4, 128, 256)),
            "mnv3_head": (lambda: Head(960, 1280, 1000), (8, 960)), "lm_head": (lambda: LMHead(256, 8000), (4, 128, 256))}


def run(names, rounds: int) -> None:
    import torch
    import ember
    from ember import config
    torch.set_num_threads(1)
    print(f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()} "
          f"EMBER_CPU_ISA={os.environ.get('EMBER_CPU_ISA', '-')}", flush=True)
    print(f"{'block':>11} | {'eager':>8} {'onednn':>8} {'mm':>8} | onednn/mm (above 1: mm faster)")
    table = blocks()
    for name in names:
        make, shape = table[name]
        torch.manual_seed(0)
        model = make().eval()
        x = torch.randn(*shape)
        cols = {"eager": model}
        for col, on in (("onednn", True), ("mm", False)):
            config.ONEDNN_MATMULS = on
            ember.reset()
            f = ember.compile(model)
            with torch.no_grad():
                y = f(x)   # compiled now, under this setting
                torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
            cols[col] = f
        times = {c: [] for c in cols}
        names_c = list(cols)
        with torch.no_grad():
            for r in range(rounds):
                for i in range(len(names_c)):
                    c = names_c[(r + i) % len(names_c)]
                    t0 = time.process_time()
                    cols[c](x)
                    times[c].append(time.process_time() - t0)
        med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
        print(f"{name:>11} | {med['eager']:8.3f} {med['onednn']:8.3f} {med['mm']:8.3f} | {med['onednn'] / med['mm']:6.3f}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--isa", default="native", choices=list(ISA_ENV))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--blocks", default="")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    names = [b for b in a.blocks.split(",") if b] or ["bert_ffn", "vit_ffn", "vitb_ffn", "llama_glu", "bert_attn",
                                                       "llama_attn", "mnv3_head", "lm_head"]
    if a.child:
        return run(names, a.rounds)
    env = {**os.environ, **ISA_ENV[a.isa], "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, __file__, "--child", "--rounds", str(a.rounds), "--blocks", ",".join(names)],
                   env=env, check=True)


if __name__ == "__main__":
    main()
