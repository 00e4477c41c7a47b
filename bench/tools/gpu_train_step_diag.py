"""A whole training step (zero_grad, forward, loss, backward, AdamW(foreach) step) compiled on the GPU, as
bench/suite.py's train rows run it: ember's fallback log (EMBER_LOGS=fallbacks: every graph it runs eagerly, and
why), the graphs run eagerly, and the losses of 3 steps against eager's.

    PYTHONPATH=. EMBER_LOGS=fallbacks python bench/tools/gpu_train_step_diag.py [--models resnet18,gpt2] [--bf16]
        [--backend ember|aot_eager|eager] [--profile]   (a model of bench/suite.py by its name there: its GPU size,
        batch --batch; --profile: each column's top kernels)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_and_inputs(name: str, device: str, batch: int):
    import suite
    if name in suite.MODELS:
        model, kwargs, labels = suite.build(name, device, True, batch)
        return model, kwargs, labels, suite.MODELS[name].family == "tv"
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        return model.to(device), {"input": torch.randn(32, 64, device=device)}, torch.randint(0, 10, (32,),
                                                                                           device=device), True
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4000, attn_pdrop=0, resid_pdrop=0,
                         embd_pdrop=0)
        ids = torch.randint(0, 4000, (4, 128), device=device)
        return GPT2LMHeadModel(cfg).to(device), {"input_ids": ids}, ids, False
    import torchvision
    model = getattr(torchvision.models, name)(num_classes=100)
    return model.to(device), {"x": torch.randn(8, 3, 64, 64, device=device)}, torch.randint(0, 100, (8,),
                                                                                          device=device), True


def print_profile(who: str, fn, device: str, steps: int = 3, top: int = 15) -> None:
    """The kernels (or, on the CPU, the ops) with the most time over `steps` more steps, and the step's wall."""
    import time
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    torch.cuda.synchronize() if device == "cuda" else None
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize() if device == "cuda" else None
    wall = 1e3 * (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA] or events
    key = (lambda e: e.self_device_time_total) if device == "cuda" else (lambda e: e.self_cpu_time_total)
    print(f"  {who}: {wall:.2f} ms a step under the profiler; kernels {sum(key(e) for e in kernels) / steps / 1e3:.2f}"
          f" ms a step; the top {top} (ms a step, calls a step):")
    for e in sorted(kernels, key=key, reverse=True)[:top]:
        print(f"    {key(e) / steps / 1e3:8.3f} {e.count / steps:6.1f}  {e.key[:120]}")


def run(name: str, bf16: bool, device: str, backend: str, batch: int, profile: bool = False) -> None:
    import ember
    from ember.backends import triton_backend
    base, kwargs, labels, plain = model_and_inputs(name, device, batch)
    losses = {}
    for who in ("eager", "ember"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                out = model(*kwargs.values()) if plain else None
                loss = F.cross_entropy(out, labels) if plain else model(**kwargs, labels=labels).loss
            loss.backward()
            opt.step()
            return loss.detach()
        fn = ember.compile(step, backend=backend) if who == "ember" else step
        before = triton_backend.STATS["eager_graphs"]
        losses[who] = [float(fn()) for _ in range(3)]
        if profile:
            print_profile(who, fn, device)
        if who == "ember":
            print(f"{name}{' bf16' if bf16 else ''}: graphs run eagerly {triton_backend.STATS['eager_graphs'] - before}")
    print(f"  losses eager {losses['eager']}\n  losses ember {losses['ember']}")
    torch.testing.assert_close(losses["ember"], losses["eager"], rtol=4e-2 if bf16 else 1e-3, atol=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,resnet18,gpt2")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="ember")
    ap.add_argument("--batch", type=int, default=0, help="a suite model's batch (default: the suite's)")
    ap.add_argument("--profile", action="store_true", help="each column's top kernels over 3 more steps")
    a = ap.parse_args()
    for name in a.models.split(","):
        try:
            run(name, a.bf16, a.device, a.backend, a.batch or None, a.profile)
        except Exception:   # the next model still runs
            traceback.print_exc()


if __name__ == "__main__":
    main()
