"""Bytes of activations saved for backward: eager autograd vs torch.compile (Inductor's partitioner) vs ember.

Counted with torch.autograd.graph.saved_tensors_hooks around one forward: every tensor packed for backward,
deduplicated by storage (a tensor saved by two ops is held once), split into parameters/buffers and activations
(everything else: what a partitioner can choose to save or recompute). On CUDA also the peak memory of one
training step above the memory held before it (torch.cuda.max_memory_allocated), gradients set to None first.

    PYTHONPATH=. .venv/bin/python bench/autograd.py [--device cuda] [--no-inductor]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import platform
import warnings

import torch

from ember.autograd import aot_eager


def _storage_key(t: torch.Tensor):
    try:
        return (t.device, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    except Exception:      # tensors without storage (subclasses): count each save
        return id(t)


def saved_bytes(call, params: list[torch.Tensor]) -> tuple[int, int, int]:
    """(activation bytes, parameter bytes, number of saves) packed for backward by one call."""
    seen: dict = {}
    count = [0]
    param_keys = {_storage_key(p) for p in params}

    def pack(t):
        count[0] += 1
        k = _storage_key(t)
        seen.setdefault(k, t.untyped_storage().nbytes() if not isinstance(k, int) else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    acts = sum(v for k, v in seen.items() if k not in param_keys)
    prms = sum(v for k, v in seen.items() if k in param_keys)
    del out
    return acts, prms, count[0]


def peak_step_bytes(call, params: list[torch.Tensor], device) -> int | None:
    """Peak memory of one step above what was held before it, the step starting as the tutorial's does:
    after opt.zero_grad(set_to_none=True) (zero_grad's default), so each system allocates its gradients."""
    if device.type != "cuda":
        return None
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = call()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def resnet18(device):
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train().to(device)
    x = torch.randn(8, 3, 64, 64, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    loss = torch.nn.CrossEntropyLoss()
    return "resnet18 train, batch 8, 64x64", model, (x,), lambda out: loss(out, y)


class LMLoss(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


def gpt2(device):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=1000, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    lm = transformers.GPT2LMHeadModel(cfg).train().to(device)
    ids = torch.randint(0, 1000, (4, 128), device=device)
    return "GPT-2 (4 layers, 256 wide) train, batch 4x128", LMLoss(lm), (ids, ids), lambda out: out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (slow to compile on 2 cores)")
    args = ap.parse_args()
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    rows = []
    for make in (resnet18, gpt2):
        name, model, inputs, to_loss = make(device)
        params = list(model.parameters()) + list(model.buffers())
        systems = {"eager": copy.deepcopy(model)}
        if not args.no_inductor:
            systems["torch.compile"] = torch.compile(copy.deepcopy(model))
        ember_model = copy.deepcopy(model)
        ember_fn = aot_eager(ember_model, list(inputs))
        systems["ember"] = (ember_model, ember_fn)
        results = {}
        for sys_name, m in systems.items():
            mod, fn = m if isinstance(m, tuple) else (m, m)
            plist = list(mod.parameters()) + list(mod.buffers())
            for _ in range(2):                      # warm up (compile) outside the measurement
                to_loss(fn(*inputs)).backward()
            acts, prms, n = saved_bytes(lambda: to_loss(fn(*inputs)), plist)
            peak = peak_step_bytes(lambda: to_loss(fn(*inputs)), plist, device)
            results[sys_name] = (acts, prms, n, peak)
        rows.append((name, results))
        del params

    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"# saved-for-backward bytes, {dev} ({device.type}), torch {torch.__version__}, "
          f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")
    print(f"{'workload':48} {'system':14} {'activations MB':>15} {'params MB':>10} {'total MB':>9} {'saves':>6} "
          f"{'acts/eager':>11} {'total/eager':>12} {'peak step MB':>13}")
    for name, results in rows:
        eager_acts, eager_prms = results["eager"][:2]
        for sys_name, (acts, prms, n, peak) in results.items():
            peak_s = f"{peak / 2**20:13.1f}" if peak is not None else f"{'n/a':>13}"
            print(f"{name:48} {sys_name:14} {acts / 2**20:15.2f} {prms / 2**20:10.2f} {(acts + prms) / 2**20:9.2f} "
                  f"{n:6d} {acts / eager_acts:10.2f}x {(acts + prms) / (eager_acts + eager_prms):11.2f}x {peak_s}")
    print("activations = saved tensors not sharing storage with a parameter/buffer (torch.compile saves copies of\n"
          "some weights, e.g. in another layout, which land there); total = all saved bytes, each storage once.")


if __name__ == "__main__":
    main()
