"""One densenet121 dense block's training step with Adam (reduce-overhead), Inductor against ember, kernel by
kernel (device run): the training row's Triton time in a graph small enough to read, compiled in seconds.

    python bench/gpu_dense_block.py [--layers 24 --features 256 --size 8] [--out DIR] [--columns inductor,ember]

Prints each column's step time (in turns), its Triton kernels' GPU time by kind (batch-norm forward, backward,
optimizer, other) and its heaviest kernels; with --out, writes Inductor's generated code (output_code log) and
ember's kernel source there.
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402  (sets the cold cache directories before torch is imported)
import torch  # noqa: E402

from ember.codegen import triton as tr  # noqa: E402


def block_step(compiler, layers: int, features: int, size: int):
    from torchvision.models.densenet import _DenseBlock
    torch.manual_seed(0)
    block = _DenseBlock(layers, features, bn_size=4, growth_rate=32, drop_rate=0).to("cuda")
    opt = torch.optim.Adam(block.parameters())
    x = torch.randn(16, features, size, size, device="cuda")

    def train(mod, x):
        opt.zero_grad(True)
        loss = mod(x).square().mean()
        loss.backward()
        opt.step()

    fn = compiler(train, mode="reduce-overhead")
    return lambda: fn(block, x)


def kind(fx_nodes: str) -> str:
    if "backward" in fx_nodes:
        return "backward"
    if any(k in fx_nodes for k in ("addcmul", "lerp", "_foreach", "for_fused")):
        return "optimizer"
    if "batch_norm" in fx_nodes:
        return "bn forward"
    if "cat" in fx_nodes:
        return "cat"
    return "other"


def kernel_table(step, names: dict, label: str, top: int) -> None:
    """names: kernel name -> its fused ops (ember's fx nodes; Inductor's names say them)."""
    steps = 5
    step()
    torch.cuda.synchronize()
    evs, total = gpu.cuda_kernels(step, steps)
    ours = [e for e in evs if e.key in names or e.key.startswith("triton_")]
    by_kind, count = collections.Counter(), collections.Counter()
    for e in ours:
        k = kind(names.get(e.key, e.key))
        by_kind[k] += e.self_device_time_total / steps / 1e3
        count[k] += e.count // steps
    triton = sum(by_kind.values())
    print(f"  {label}: {total:.3f} ms GPU time a step, Triton {triton:.3f} ms in {sum(count.values())} launches: "
          + ", ".join(f"{k} {v:.3f} ({count[k]}x)" for k, v in sorted(by_kind.items())), flush=True)
    for e in sorted(ours, key=lambda e: -e.self_device_time_total)[:top]:
        us = e.self_device_time_total / e.count
        print(f"    {e.self_device_time_total / steps / 1e3:7.3f} ms {e.count // steps:4d}x {us:6.2f} us  "
              f"{e.key[:60]}  {names.get(e.key, '')[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--columns", default="inductor,ember")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sources: dict = {}
    orig = tr.compile_aten

    def keep(gm, ex, options=None):
        run = orig(gm, ex, options)
        call = getattr(run, "compiled", None)
        if call is not None:
            for m in re.finditer(r"# fused fx nodes: (.*)\n@triton.jit\ndef (k_\w+)\(", call.kernel_source):
                sources[m[2]] = m[1]
            if a.out:
                with open(os.path.join(a.out, "ember_kernels.py"), "a") as f:
                    f.write(call.kernel_source)
        return run
    tr.compile_aten = keep
    if a.out and "inductor" in a.columns:
        import logging
        torch._logging.set_logs(output_code=True)
        handler = logging.FileHandler(os.path.join(a.out, "inductor_code.log"))
        logging.getLogger("torch._inductor").addHandler(handler)
    print(f"# dense block of {a.layers} layers, {a.features} input features, 16x{a.size}x{a.size}: train step + "
          f"Adam, reduce-overhead; {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    steps = {}
    for col in a.columns.split(","):
        compiler = torch.compile if col == "inductor" else gpu.ember_compile
        steps[col] = block_step(compiler, a.layers, a.features, a.size)
        for _ in range(3):
            steps[col]()
        torch.cuda.synchronize()
    times = gpu.in_turns(steps, 50, 3)
    print("  step ms (3 rounds in turns): " + "; ".join(f"{k} " + " ".join(f"{t:.3f}" for t in v)
                                                       for k, v in times.items()), flush=True)
    for col, step in steps.items():
        kernel_table(step, sources if col == "ember" else {}, col, a.top)


if __name__ == "__main__":
    main()
