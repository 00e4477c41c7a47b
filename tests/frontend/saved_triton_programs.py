"""Programs compiled by the Triton backend that one process saves (ember.save_cache) and another loads
(ember.load_cache): `python -m tests.frontend.saved_triton_programs save|load FILE SEED` runs them all, asserts
each equal to eager, and prints what the process captured, generated and had Triton compile
(tests/frontend/test_saved.py reads it). On a GPU they run there (and under mode="reduce-overhead" too); without
one, on the CPU under Triton's interpreter, through the Triton backend (the sources and host programs)."""
import json
import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # (before triton is imported: it reads it then)

import ember  # noqa: E402
from ember.backends import ember_backend  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
if not CUDA:   # CPU tensors through the Triton backend
    ember_backend.DEVICE_BACKENDS["cpu"] = "ember.backends.triton_backend"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.l1(x)))
        return self.l2(h).softmax(-1) * x[:, :8].sigmoid()


def row_stats(x):
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-3) + x.amax(0)


def programs(seed: int) -> dict:
    """name -> (compiled result, eager result), on inputs and weights drawn from `seed`."""
    torch.manual_seed(seed)
    net = Block().to(DEV)
    cnet = ember.compile(net)
    out = {}
    x = torch.randn(4, 16, device=DEV)
    with torch.no_grad():
        out["inference"] = (cnet(x), net(x))
    cnet(x).square().sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).square().sum().backward()
    out["training"] = (grads, [p.grad.clone() for p in net.parameters()])
    g = ember.compile(row_stats, dynamic=True)
    for n in (3, 7):   # one symbolic program serves both sizes
        t = torch.randn(n, 6, device=DEV)
        out[f"dynamic size {n}"] = (g(t), row_stats(t))
    if CUDA:   # CUDA graphs: recorded again at the loaded program's first calls (eager, record, replay)
        graphed = ember.compile(net, mode="reduce-overhead")
        with torch.no_grad():
            for i in range(3):
                t = torch.randn(4, 16, device=DEV)
                out[f"reduce-overhead inference {i}"] = (graphed(t), net(t))
        for i in range(3):
            t = torch.randn(4, 16, device=DEV)
            net.zero_grad()
            graphed(t).square().sum().backward()
            grads = [p.grad.clone() for p in net.parameters()]
            net.zero_grad()
            net(t).square().sum().backward()
            out[f"reduce-overhead training {i}"] = (grads, [p.grad.clone() for p in net.parameters()])
    return out


def main(mode: str, path: str, seed: int) -> dict:
    from ember.backends import triton_program
    from ember.frontend import convert, saved
    compiles = []   # Triton compiles (cache misses) of ember's generated kernels
    cache_hits = []
    try:
        from triton import knobs

        def listener(src=None, cache_hit=False, **_):
            fn = getattr(src, "fn", None)
            name = f"{getattr(fn, '__module__', '?')}.{getattr(src, 'name', '?')}"
            (cache_hits if cache_hit else compiles).append(name)
        knobs.compilation.listener = listener
    except ImportError:   # (an older Triton: none counted)
        pass
    loaded = ember.load_cache(path) if mode == "load" else None
    for name, (got, want) in programs(seed).items():
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")
    triton_backend = sys.modules.get("ember.backends.triton_backend")
    report = {"captures": convert.STATS["captures"], "graphs": triton_backend.STATS["graphs"] if triton_backend else 0,
              "codegen_imported": "ember.codegen.lower" in sys.modules, "restored": saved.STATS["restored_entries"],
              "restored_kernels": triton_program.STATS["restored_kernels"], "loaded": loaded, "cuda": CUDA,
              "ember_kernel_compiles": [c for c in compiles if c.startswith("ember_triton_")],
              "other_compiles": [c for c in compiles if not c.startswith("ember_triton_")], "cache_hits": cache_hits}
    if mode == "save":
        report.update(ember.save_cache(path))
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
