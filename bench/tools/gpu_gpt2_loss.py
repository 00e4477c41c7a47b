"""GPU timing of GPT-2's two loss kernels (issue #6, b8 s256: 2048 rows of 50,257 logits, float32): eager,
torch.compile (Inductor), ember, and ember as before the online softmax and the one-hot sum
(config.ONLINE_SOFTMAX = config.ONE_HOT_SUMS = False), A/B in one process on one GPU.

    python bench/tools/gpu_gpt2_loss.py
    python bench/tools/gpu_gpt2_loss.py --device cpu --check-only --rows 64 --cols 5000   # no GPU: Triton's interpreter

  stats  the forward's statistics of the partitioner's split log_softmax (autograd.partition): the row max, the
         sum of exp(x - max), its log (ember before: a loop for the max, a second loop for the sum; now one
         online loop).
  grad   the backward's gradient of the mean cross-entropy w.r.t. the logits from the saved statistics:
         nll_loss_backward's one-hot row and log_softmax's backward (ember before: a loop over each row summing
         the one-hot gradient, then the gradient's loop; now one flat pass).
Columns as bench/tools/gpu_reductions.py (its timers): GPU time per call under torch.profiler / wall time per call
(CUDA events around back-to-back calls); k = kernels. Every result is checked against eager.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench.tools import gpu_reductions as timers  # noqa: E402  (sets TRITON_INTERPRET for --device cpu before triton loads)

import torch  # noqa: E402

from ember import config  # noqa: E402
from ember.codegen.triton.printer import PRELUDE  # noqa: E402


def loss_stats(x):
    m = x.amax(1, keepdim=True)
    s = torch.exp(x - m).sum(1, keepdim=True)
    return m, s, torch.log(s)


def loss_grad(x, labels, m, logs, g, total):
    y = x - m - logs
    gy = torch.ops.aten.nll_loss_backward(g, y, labels, None, 1, -100, total)
    return torch.ops.aten._log_softmax_backward_data(gy, y, 1, torch.float32)


def cases(rows: int, cols: int, dev: str):
    x = torch.randn(rows, cols, device=dev)
    labels = torch.randint(0, cols, (rows,), device=dev)
    labels[::50] = -100   # GPT-2's shifted labels: the ignored last token of each sequence
    m, s, logs = loss_stats(x)
    total = (labels != -100).sum().float()
    g = torch.ones((), device=dev)
    return [("stats", loss_stats, [x]), ("grad", loss_grad, [x, labels, m, logs, g, total])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rows", type=int, default=8 * 256)
    ap.add_argument("--cols", type=int, default=50257)
    ap.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (correctness of the plumbing)")
    ap.add_argument("--check-only", action="store_true", help="compile and compare with eager, no timing")
    ap.add_argument("--source", action="store_true", help="print ember's kernels")
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter)"
    print(f"# {name}, torch {torch.__version__}, logits {args.rows} x {args.cols}; GPU us / wall us per call; "
          f"k = kernels, loops = looped passes over the rows")
    print(f"{'case':8s} {'eager':>15s} {'inductor':>15s} {'ember':>26s} {'ember before':>26s}")
    for case, fn, xs in cases(args.rows, args.cols, args.device):
        ref = fn(*xs)
        cells = []
        for column in ("eager", "inductor", "ember", "ember before"):
            if args.check_only and column in ("eager", "inductor"):
                cells.append("-")
                continue
            try:
                info = ""
                call = timers.baseline_call(column, fn, xs)
                if call is None:
                    new = column == "ember"
                    c, prog = timers.ember_compiled(fn, xs, {(config, "ONLINE_SOFTMAX"): new,
                                                              (config, "ONE_HOT_SUMS"): new})
                    call = lambda: c(*xs)  # noqa: E731
                    info = f" k={len(prog.kernels)} loops={prog.kernel_source.count('for roff in range(')}"
                    if args.source:
                        print(f"## {case} / {column}\n{prog.kernel_source[len(PRELUDE):]}")
                timers.check(call(), ref)
                if args.check_only:
                    cells.append(f"ok{info}")
                    continue
                cells.append(f"{timers.gpu_us(call, args.iters):6.1f}/{timers.wall_us(call, args.iters):6.1f}{info}")
            except Exception as e:  # one failing column does not stop the table
                cells.append(type(e).__name__)
                print(f"  {case} / {column}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        print(f"{case:8s} {cells[0]:>15s} {cells[1]:>15s} {cells[2]:>26s} {cells[3]:>26s}", flush=True)


if __name__ == "__main__":
    main()
