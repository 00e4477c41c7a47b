"""Diagnostic (device run): column sums (a bias gradient: x.sum(0) of a row-major matrix) as ember's Triton
backend compiles them, under other tilings: (columns a program takes, rows an iteration, warps, parts the rows
are split into; None: lower.reduction_parts' choice). GPT-2's shapes (2048 rows; 768, 2304 and 3072 columns).
Each is captured 20 times into one CUDA graph, so the time is the GPU's, not the host's launches; medians of 5
rounds in turns; GB/s from the matrix's bytes.

    python bench/gpu_column_sums.py      # on the GPU machine
"""
import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import gpu  # noqa: E402

from ember.codegen import lower  # noqa: E402
from ember.codegen import triton as tr  # noqa: E402
from tests.codegen.aten_trace import trace_aten  # noqa: E402

SHAPES = [(2048, 768), (2048, 2304), (2048, 3072)]
CONFIGS = [None, (8, 512, 8, None), (8, 512, 4, 2), (8, 512, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4),
           (32, 128, 4, 8), (64, 64, 4, 8), (64, 64, 4, 16), (32, 64, 2, 8)]
CALLS = 20


def compiled_sum(x, config):
    gm, _ = trace_aten(lambda x: (x.sum(0),), [x])
    parts, col_cfg = lower.reduction_parts, tr.column_config
    if config is not None:
        xblock, rblock, warps, n = config
        if n is not None:
            lower.reduction_parts = lambda out, rnumel, column, target: n if column and target == "gpu" and \
                rnumel % n == 0 and rnumel >= 256 else parts(out, rnumel, column, target)
        tr.column_config = lambda rows, rmax: {"XBLOCK": xblock, "RBLOCK": min(rblock, tr.triton_next_pow2(rmax)),
                                               "num_warps": warps, "persistent": rmax <= rblock}
    try:
        f = tr.compile_aten(gm, [x])
        f(x)
        torch.cuda.synchronize()
    finally:
        lower.reduction_parts, tr.column_config = parts, col_cfg
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            out = f(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[0], x.sum(0), rtol=1e-4, atol=1e-3)
    return graph


def main() -> None:
    print(f"# bench/gpu_column_sums.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; us a sum (GPU time), medians of 5 "
          f"rounds; config (columns a program, rows an iteration, warps, row parts)")
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda")
        steps = {str(c): (lambda g=compiled_sum(x, c): g.replay()) for c in CONFIGS}
        times = gpu.in_turns(steps, 20, 5)
        print(f"{rows}x{cols}: " + "  ".join(
            f"{k}: {statistics.median(ts) * 1000 / CALLS:.1f} us ({rows * cols * 4 / (statistics.median(ts) / CALLS) / 1e6:.0f} GB/s)"
            for k, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
