"""A/B of the flat kernels' block size (ember.codegen.triton.heuristics.launch_config) on whole rows of
bench/gpu.py, ember's column only: each row is built and compiled once per configuration, then the
configurations are timed in turns, ROUNDS times (medians). The pointwise chain alone is what
`bench/gpu.py --sweep-blocks` measures; this asks whether a choice made there holds for the memory-bound flat
kernels of other rows (batch norm + relu in resnet50).

    python bench/tools/gpu_flat_blocks.py [rows...]     # on the GPU machine; rows: pointwise affine resnet50 densenet
"""
import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench import gpu  # noqa: E402

from ember.codegen.triton import heuristics, kernels  # noqa: E402

CONFIGS = [(1024, 4), (512, 4)]
ROUNDS = 5
ROWS = {"pointwise": (gpu.pointwise, 100), "affine": (gpu.affine, 100), "resnet50": (gpu.resnet50, 30),
        "densenet": (gpu.densenet_inference, 30)}


def main() -> None:
    print(f"# bench/tools/gpu_flat_blocks.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, ember column, medians of {ROUNDS} "
          f"rounds taken in turns")
    default = kernels.launch_config   # (kernel_source looks it up in kernels)
    for row in sys.argv[1:] or list(ROWS):
        build, iters = ROWS[row]
        steps = {}
        for block, warps in CONFIGS:
            kernels.launch_config = lambda shape, rows, rmax, b=block, w=warps: (
                {"BLOCK": b, "num_warps": w} if shape == heuristics.FLAT and rows * rmax >= (1 << 20)
                else default(shape, rows, rmax))
            try:
                torch.manual_seed(0)
                step = build(gpu.ember_compile, None)
                for _ in range(3):   # compiled while this configuration is the launch_config
                    step()
                torch.cuda.synchronize()
                steps[(block, warps)] = step
            finally:
                kernels.launch_config = default
        times = gpu.in_turns(steps, iters, ROUNDS)
        print(f"{row:10s} " + "  ".join(f"BLOCK={b} warps={w}: {statistics.median(ts):.4f} ms" for (b, w), ts in
                                        times.items()), flush=True)
        del steps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
