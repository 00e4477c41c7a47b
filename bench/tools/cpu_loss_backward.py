"""CPU A/B of the one-hot sum (config.ONE_HOT_SUMS) in one process: the backward of a mean cross-entropy over
[512, 50257] float32 logits (GPT-2's vocabulary; every 17th label -100) through ember.compile (the C++ backend),
with the rule and without, and eager; each round times one backward of each, interleaved; medians over rounds
and the median of the per-round ratio without / with (ms).

    PYTHONPATH=. python bench/tools/cpu_loss_backward.py [--rounds 21]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

import torch  # noqa: E402

import ember  # noqa: E402
from ember import config  # noqa: E402


def loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.rows, 50257)
    labels = torch.randint(0, 50257, (args.rows,))
    labels[::17] = -100

    def backward_s(fn) -> float:
        xg = x.clone().requires_grad_()
        out = fn(xg, labels)
        t = time.perf_counter()
        out.backward()
        return time.perf_counter() - t, out, xg.grad

    fns = {}
    for name, rule in (("without", False), ("with", True)):
        config.ONE_HOT_SUMS = rule   # the backward graph compiles at the first backward
        fns[name] = ember.compile(lambda a, b: loss(a, b))
        _, out, grad = backward_s(fns[name])
        _, want, want_grad = backward_s(loss)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grad, want_grad)
    config.ONE_HOT_SUMS = True
    fns["eager"] = loss
    ts = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            ts[k].append(backward_s(fn)[0] * 1e3)
    print(f"# {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; cross-entropy backward over "
          f"{args.rows} x 50257, ms; {args.rounds} rounds")
    for k, v in ts.items():
        print(f"{k:8s} median {statistics.median(v):7.1f}  min {min(v):7.1f}")
    ratio = [a / b for a, b in zip(ts["without"], ts["with"])]
    print(f"without / with per round: median {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})")


if __name__ == "__main__":
    main()
