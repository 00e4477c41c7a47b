"""Sibling matmuls on one input (BERT's query, key and value projections) as three library calls against one
call on the concatenated weights (device run): whether merging them is worth a graph rewrite.

    python bench/tools/gpu_sibling_mm.py
"""
import torch


def timed(fn, iters=200):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters // 10):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters * 1e3   # us per fn


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, float32 (no TF32)")
    for m, k, n, parts in [(1024, 768, 768, 3), (2048, 768, 768, 3), (1024, 1024, 1024, 3), (512, 768, 768, 3)]:
        x = torch.randn(m, k, device="cuda")
        ws = [torch.randn(n, k, device="cuda") for _ in range(parts)]
        bs = [torch.randn(n, device="cuda") for _ in range(parts)]
        w_cat, b_cat = torch.cat(ws), torch.cat(bs)
        sep = timed(lambda: [torch.addmm(b, x, w.t()) for w, b in zip(ws, bs)])
        one = timed(lambda: torch.addmm(b_cat, x, w_cat.t()))
        with_cat = timed(lambda: torch.addmm(torch.cat(bs), x, torch.cat(ws).t()))
        print(f"  x {m}x{k} @ {parts} weights {k}x{n}: separate {sep:7.1f} us, one call {one:7.1f} us, "
              f"one call with the weights concatenated each time {with_cat:7.1f} us")


if __name__ == "__main__":
    main()
