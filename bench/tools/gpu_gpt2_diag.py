"""Diagnostic (device run): GPT-2's compiled training step under CUDA_LAUNCH_BLOCKING=1; on a CUDA error, the
host-program line and kernel that failed, and the graphs' CPU/meta-device values with their users."""
import os
import sys
import traceback

os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
import torch  # noqa: E402

import ember  # noqa: E402
from ember.backends import triton_backend  # noqa: E402

graphs = []
orig = triton_backend.compile_aten


def keep(gm, ex, options=None):
    r = orig(gm, ex, options)
    graphs.append((gm, r))
    return r


def main() -> None:
    triton_backend.compile_aten = keep
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).cuda().train()
    ids = torch.randint(0, 50257, (8, 256), device="cuda")
    fn = ember.compile(model)
    try:
        for _ in range(2):
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
        torch.cuda.synchronize()
        print("no error")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.key_averages() if e.key.startswith("k_")), key=lambda e: -e.self_device_time_total)
        for e in evs[:int(os.environ.get("TOP", "2"))]:
            print(f"{e.key}: {e.self_device_time_total / 1e3:.3f} ms, {e.count} launches")
            for gm, r in graphs:
                call = getattr(r, "compiled", None)
                if call is None or f"def {e.key}(" not in call.kernel_source:
                    continue
                src = call.kernel_source
                start = src.rfind("@triton.jit", 0, src.find(f"def {e.key}("))
                end = src.find("@triton.jit", start + 12)
                print(src[start:end if end > 0 else None][:3000])
                print([ln for ln in call.source.splitlines() if e.key in ln][:2])
    except Exception as e:
        print("ERROR", type(e).__name__, str(e)[:200])
        tb = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename == "<ember wrapper>":
                for gm, r in graphs:
                    call = getattr(r, "compiled", None)
                    if call is not None and call.__code__ is code:
                        lines = call.source.splitlines()
                        print("graph", type(gm).__name__, "line", tb.tb_lineno, ":", lines[tb.tb_lineno - 1][:300])
                        names = [n for n in lines[tb.tb_lineno - 1].split("(")[1].split(")")[0].split(", ")]
                        kname = lines[tb.tb_lineno - 1].split("# ")[-1].split("[")[0].strip()
                        src = call.kernel_source
                        start = src.find(f"def {kname}(")
                        if start >= 0:
                            start = src.rfind("@triton.jit", 0, start)
                            end = src.find("@triton.jit", start + 12)
                            print(src[start:end if end > 0 else None])
                        loc = tb.tb_frame.f_locals
                        for a in names[:24]:
                            t = loc.get(a.strip())
                            if isinstance(t, torch.Tensor):
                                print("   ", a, t.device, tuple(t.shape), t.stride(), t.dtype, t.storage_offset(),
                                      t.untyped_storage().nbytes())
            tb = tb.tb_next
    for i, (gm, r) in enumerate(graphs):
        odd = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].device.type != "cuda"]
        print(f"graph {i}: {len(gm.graph.nodes)} nodes, compiled={hasattr(r, 'compiled')}, non-CUDA values:")
        for n in odd[:8]:
            print("   ", n.op, n.name, n.target, n.meta["val"].device, tuple(n.meta["val"].shape),
                  "users:", [(u.op, str(u.target)) for u in n.users][:4])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
