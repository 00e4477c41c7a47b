"""Where the GPU zoo's misses come from (issue 32), one diagnosis per model, printed.

    EMBER_LOGS=graph_breaks PYTHONPATH=. python bench/tools/gpu_zoo_diag.py [--only resnet,mamba,funnel]

- resnet (hf_resnet eval): each run's largest error against float64, for eager (contiguous, and model and input
  channels-last) and ember, with cuDNN's TF32 on (torch's default) and off: a layout that lets cuDNN take a TF32
  algorithm shows as an error only with TF32 on.
- mamba (hf_mamba train): each parameter's gradient error against float64 (2-norm, relative), eager float32's and
  ember's, the worst ratios first.
- funnel (hf_funnel eval and train): every fallback log line in full (set EMBER_REPRO_DIR to keep repros).
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests", "models"), ROOT]
import zoo  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def max_err(out, ref) -> float:
    return max((a.detach().double() - r.detach()).abs().max().item()
               for a, r in zip(zoo.tensors(out), zoo.tensors(ref)) if a.is_floating_point())


def resnet() -> None:
    import ember
    model, kw = zoo._build("hf_resnet", False, DEVICE)
    cl_kw = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v for k, v in kw.items()}
    with torch.no_grad():
        ref = zoo.run_f64(model, kw)
        scale = max(t.abs().max().item() for t in zoo.tensors(ref))
        for tf32 in (True, False):
            torch.backends.cudnn.allow_tf32 = tf32
            eager = model(**kw)
            eager_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)(**cl_kw)
            ember.reset()
            compiled = ember.compile(copy.deepcopy(model))(**kw)
            print(f"resnet eval, cudnn.allow_tf32={tf32}: max|f64| {scale:.3g}; error vs float64: eager "
                  f"{max_err(eager, ref):.3e}, eager channels-last {max_err(eager_cl, ref):.3e}, "
                  f"ember {max_err(compiled, ref):.3e}", flush=True)
    torch.backends.cudnn.allow_tf32 = True


def mamba() -> None:
    import ember
    model, kw = zoo._build("hf_mamba", True, DEVICE)
    m32, m64 = copy.deepcopy(model), copy.deepcopy(model).double()
    torch.manual_seed(100)
    zoo.scalar_loss(m32(**kw)).backward()
    ember.reset()
    torch.manual_seed(100)
    zoo.scalar_loss(ember.compile(model)(**kw)).backward()

    def forward_backward(m, k):
        out = m(**k)
        zoo.scalar_loss(out).backward()
        return out
    zoo.run_f64(m64, kw, forward_backward)
    p32, p64 = dict(m32.named_parameters()), dict(m64.named_parameters())
    rows = []
    for name, p in model.named_parameters():
        g64 = p64[name].grad
        if p.grad is None or g64 is None or p32[name].grad is None:
            print(f"mamba {name}: grad None (ember {p.grad is None}, eager {p32[name].grad is None})")
            continue
        n = g64.norm().item() or 1e-30
        e_em = (p.grad.double() - g64).norm().item() / n
        e_32 = (p32[name].grad.double() - g64).norm().item() / n
        rows.append((e_em / max(e_32, 1e-12), name, e_em, e_32, n))
    for ratio, name, e_em, e_32, n in sorted(rows, reverse=True)[:12]:
        print(f"mamba grad {name}: ember {e_em:.2e} eager32 {e_32:.2e} (ratio {ratio:.1f}, |g64| {n:.2e})",
              flush=True)


class _Full(logging.Handler):
    def emit(self, record):
        print(f"[{record.name}] {record.getMessage()}", flush=True)


def funnel() -> None:
    import ember
    logging.getLogger("ember.fallbacks").addHandler(_Full(logging.WARNING))
    for mode in ("eval", "train"):
        model, kw = zoo._build("hf_funnel", mode == "train", DEVICE)
        ember.reset()
        print(f"funnel {mode}:", flush=True)
        with torch.set_grad_enabled(mode == "train"):
            ex = ember.explain(model)(**kw)
        print(f"funnel {mode}: {ex.graph_count} graphs, breaks: "
              f"{[str(b)[:300] for b in getattr(ex, 'break_reasons', [])][:4]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="resnet,mamba,funnel")
    for name in ap.parse_args().only.split(","):
        try:
            globals()[name]()
        except Exception as e:  # noqa: BLE001 - one diagnosis failing leaves the others
            print(f"{name}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
