"""Which size guards attention adds on CUDA under symbolic sizes (a diagnostic for issue 27: a loop of sequence
lengths that compiles a graph per length on the GPU, not on the CPU).

    PYTHONPATH=. python bench/tools/gpu_sdpa_guards.py

For attention shapes of BERT (no mask, a float mask), GPT-2 decoding (one query, a growing key length) and
prefill (causal), in float32 and float16: fake CUDA tensors whose sequence lengths are symbols of one ShapeEnv go
through F.scaled_dot_product_attention (what ember's frontend runs), ember's recorder choice
(autograd.recorder.cuda_attention: the fused kernel, else the math path over SymInts), torch.backends.cuda's can_use_* checks one by one, and a batched matmul;
each prints the guards it added (a guard `Eq(s0, 28)` pins the length to its value: a graph per length).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode

from ember.frontend.symbolic import SizeSource   # (a size's source, as ember's capture names them)


class _OpsThatGuard(TorchDispatchMode):
    def __init__(self, env, out):
        super().__init__()
        self.env, self.out = env, out

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        n = len(self.env.guards)
        r = func(*args, **(kwargs or {}))
        if len(self.env.guards) > n:
            self.out.append(f"{func}: {[str(g.expr) for g in self.env.guards[n:]]}")
        return r


def fakes(shapes: dict, dtype, dynamic_dims: dict):
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    out = {}
    for name, shape in shapes.items():
        dims = dynamic_dims.get(name, ())
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK if d in dims else DimDynamic.STATIC
                                                      for d in range(len(shape))])
        f = mode.from_tensor(torch.randn(shape, dtype=dtype), source=SizeSource(name), symbolic_context=ctx)
        with mode:   # (a CUDA fake of the same symbolic sizes; also where no GPU is, for a dry run)
            out[name] = torch.empty_strided(f.shape, f.stride(), dtype=dtype, device="cuda")
    return env, mode, out


def heads_view(t, heads: int):
    """[B, S, H*D] -> [B, H, S, D] as transformers' attention makes q, k, v (a view: strides S*H*D, D, H*D, 1)."""
    b, s, hd = t.shape
    return t.view(b, s, heads, hd // heads).transpose(1, 2)


def probe(label, shapes, dynamic_dims, dtype, mask=False, causal=False, heads=None):
    print(f"\n== {label} {dtype} mask={mask} causal={causal}")
    for what in ("F.sdpa", "recorder", "checks", "matmul"):
        env, mode, t = fakes(shapes, dtype, dynamic_dims)
        q, k, v, m = t["q"], t["k"], t["v"], t.get("mask")
        if heads:   # (inside the fake mode: views of the projections' outputs)
            with mode:
                q, k, v = (heads_view(x, heads) for x in (q, k, v))
        log: list = []
        try:
            with mode, _OpsThatGuard(env, log):
                if what == "F.sdpa":
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
                    log.append(f"out {tuple(o.shape)} stride {o.stride()}")
                elif what == "recorder":
                    from ember.autograd.recorder import _cuda_fused_sdpa, cuda_attention
                    fused = _cuda_fused_sdpa(q, k, v, attn_mask=m, is_causal=causal) is not None
                    o = cuda_attention(q, k, v, attn_mask=m, is_causal=causal)
                    log.append(f"fused kernel: {fused}")
                    log.append("declined (None)" if o is None else f"out {tuple(o.shape)} stride {o.stride()}")
                elif what == "checks":
                    p = torch.backends.cuda.SDPAParams(q, k, v, m, 0.0, causal, False)
                    log.append(f"SDPAParams guards {[str(g.expr) for g in env.guards]}")
                    for check in ("can_use_efficient_attention", "can_use_flash_attention", "can_use_cudnn_attention"):
                        fn = getattr(torch.backends.cuda, check, None)
                        if fn is None:
                            continue
                        n = len(env.guards)
                        try:
                            ok = fn(p)
                        except Exception as e:
                            ok = f"raised {type(e).__name__}"
                        log.append(f"{check} -> {ok}, guards {[str(g.expr) for g in env.guards[n:]]}")
                else:
                    o = q @ k.transpose(-2, -1)
                    log.append(f"q @ k^T {tuple(o.shape)}")
        except Exception as e:
            log.append(f"raised {type(e).__name__}: {str(e)[:200]}")
        print(f"  {what}: all guards {[str(g.expr) for g in env.guards]}")
        for line in log:
            print(f"    {line}")


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    for dtype in (torch.float32, torch.float16):
        bert = {"q": (8, 12, 28, 64), "k": (8, 12, 28, 64), "v": (8, 12, 28, 64)}
        probe("bert", bert, {"q": (2,), "k": (2,), "v": (2,)}, dtype)
        proj = {"q": (8, 28, 768), "k": (8, 28, 768), "v": (8, 28, 768)}
        probe("bert as transformers lays it out (head views)", proj, {"q": (1,), "k": (1,), "v": (1,)}, dtype,
              heads=12)
        probe("bert", {**bert, "mask": (8, 1, 28, 28)}, {"q": (2,), "k": (2,), "v": (2,), "mask": (2, 3)}, dtype,
              mask=True)
        dec = {"q": (1, 12, 1, 64), "k": (1, 12, 37, 64), "v": (1, 12, 37, 64)}
        probe("gpt2 decode", dec, {"k": (2,), "v": (2,)}, dtype)
        probe("gpt2 prefill", {"q": (1, 12, 16, 64), "k": (1, 12, 16, 64), "v": (1, 12, 16, 64)},
              {"q": (2,), "k": (2,), "v": (2,)}, dtype, causal=True)


if __name__ == "__main__":
    main()
