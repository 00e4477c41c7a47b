"""Diagnostic (device run): the width of the column strip a Triton program takes in a column reduction
(lower.GPU_COLUMN_STRIP: bias and layer-norm weight gradients, sums down the rows of a row-major matrix),
on whole rows of bench/gpu.py, ember's column only: each width compiled once, then timed in turns (medians).

    python bench/gpu_column_strips.py [gpt2|densenet_train] [widths...]      # on the GPU machine
"""
import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402

from ember.codegen import lower  # noqa: E402

ROUNDS = 5


def main() -> None:
    row = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    widths = [int(a) for a in sys.argv[2:]] or [8, 16, 32]
    build, iters = {"gpt2": (gpu.gpt2_train, 20), "bert": (gpu.bert, 30)}[row]
    print(f"# bench/gpu_column_strips.py {row}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, ember, medians of {ROUNDS} rounds")
    default, steps = lower.GPU_COLUMN_STRIP, {}
    for w in widths:
        lower.GPU_COLUMN_STRIP = w
        try:
            torch.manual_seed(0)
            step = build(gpu.ember_compile, None)
            for _ in range(3):   # compiled under this width
                step()
            torch.cuda.synchronize()
            steps[w] = step
        finally:
            lower.GPU_COLUMN_STRIP = default
    times = gpu.in_turns(steps, iters, ROUNDS)
    print("  ".join(f"strip {w}: {statistics.median(ts):.3f} ms" for w, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
