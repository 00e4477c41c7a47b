"""The slowest of ember's Triton kernels in one model step, with their source (device run): GPU time per kernel
from torch.profiler, each matched to the printed kernel of the compiled programs.

    python bench/tools/gpu_top_kernels.py [gpt2|resnet50|bert|densenet_train] [TOP] [--bn-aten]

--bn-aten: train-mode batch norm as ATen's (cuDNN's) kernels on CUDA, not decomposed (decomp/norms.py).
"""
import datetime
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench import gpu  # noqa: E402

from ember.backends import triton_backend  # noqa: E402


# the rows this script and gpu_kernel_configs.py take: (compiler, mode) -> one step
STEPS = {"gpt2": gpu.gpt2_train, "resnet50": gpu.resnet50, "bert": gpu.bert,
         "densenet_train": lambda c, m: gpu.densenet_train(c, "reduce-overhead")}


def main() -> None:
    if "--bn-aten" in sys.argv:
        from ember.decomp import norms
        sys.argv.remove("--bn-aten")
        norms.TRAIN_BATCH_NORM_DECOMPOSED.discard("cuda")
    row = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    build = STEPS[row]
    sources = {}
    orig = triton_backend.compile_aten

    def keep(gm, ex, options=None):
        run = orig(gm, ex, options)
        call = getattr(run, "compiled", None)
        if call is not None:
            for part in call.kernel_source.split("\n\n\n"):
                m = re.search(r"^def (k_\w+)\(", part, re.M)
                if m:
                    sources[m[1]] = part
        return run
    triton_backend.compile_aten = keep
    step = build(gpu.ember_compile, None)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print("step wall times (ms, synchronized):", " ".join(f"{w:.2f}" for w in gpu.synced_walls(step, 12)))
    steps = 5
    evs, total = gpu.cuda_kernels(step, steps)
    triton = [e for e in evs if e.key in sources]
    print(f"# bench/tools/gpu_top_kernels.py {row}, {torch.cuda.get_device_name()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: {total:.3f} ms GPU time a step, "
          f"ember's Triton kernels {sum(e.self_device_time_total for e in triton) / steps / 1e3:.3f} ms "
          f"({len(triton)} kernels)")
    for e in sorted(triton, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"\n## {e.self_device_time_total / steps / 1e3:.3f} ms {e.count // steps}x {e.key}")
        print(sources[e.key][:3000])


if __name__ == "__main__":
    main()
