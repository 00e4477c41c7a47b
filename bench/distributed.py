"""Data-parallel training through torch.distributed: eager, torch.compile and ember under DDP and FSDP2.

    python bench/distributed.py                         # every GPU of the machine, NCCL, GPT-2 small
    python bench/distributed.py --wrappers ddp --batch 8 --seq 512
    python bench/distributed.py --device cpu --tiny     # 2 CPU processes (gloo), a small GPT-2: checks the script

One process per GPU (torch.multiprocessing), each training GPT2LMHeadModel (transformers; dropout off, so every
column computes the same function) on its own random tokens with AdamW (the optimizer runs eagerly in every
column). Per column, on a model built afresh from the same seed:
  - the first 3 steps (compile included: "first 3 steps"), then every parameter compared with eager's after the
    same 3 steps (max |difference|; DDP's replicas, FSDP2's full tensors);
  - step time: the median of --steps steps timed with CUDA events after 2 more, and tokens/s over all ranks;
  - a profile of 3 steps on rank 0 (torch.profiler, CUDA kernels): the GPU time spent computing, communicating
    (NCCL kernels), and only communicating (NCCL kernels running while no other kernel runs): the communication
    the compiled backward did not hide;
  - peak memory allocated.
DDP: `compiler(DDP(model))`. FSDP2: fully_shard on each block and the root, then each block compiled (the recipe
of torch's FSDP2 examples); --fsdp-root also compiles the whole model.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

# NVLink multicast stays off on the shared machines (its use can take the host's GPUs out of service)
for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _value

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

COLUMNS = ("eager", "torch.compile", "ember")


def build_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel
    # training builds no KV cache (transformers' default use_cache=True makes one per step, as no trainer does)
    kw = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if args.tiny:
        kw.update(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128)
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**kw)).to(device).train()


def compiler_of(column: str):
    if column == "eager":
        return None
    if column == "torch.compile":
        return torch.compile
    import ember
    return ember.compile


def wrap(model, wrapper: str, column: str, args):
    """What a step calls: DDP or FSDP2 around the model, compiled as the column says."""
    compile_ = compiler_of(column)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[model.device.index] if model.device.type == "cuda" else None)
        return ddp if compile_ is None else compile_(ddp)
    from torch.distributed.fsdp import fully_shard
    blocks = model.transformer.h
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    if compile_ is None:
        return model
    for i, block in enumerate(blocks):
        blocks[i] = compile_(block)
    return compile_(model) if args.fsdp_root else model


def full_params(model) -> dict[str, torch.Tensor]:
    # torch.compile registers a compiled block as `<name>._orig_mod`: compare under the module's own names
    return {name.replace("._orig_mod", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for name, p in model.named_parameters()}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_of(a: list, b: list) -> float:
    """Total length of the intersection of two sorted unions of intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_times(trace_path: str, steps: int, top: int = 0) -> dict:
    """Per step, in ms: GPU time computing, communicating (NCCL kernels) and only communicating; with `top`, the
    kernels taking the most GPU time (name, ms per step, launches per step)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    comm, compute = [], []
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        (comm if "nccl" in e.get("name", "").lower() else compute).append((e["ts"], e["ts"] + e["dur"]))
        by_name.setdefault(e.get("name", "?")[:90], []).append(e["dur"])
    comm, compute = union(comm), union(compute)
    comm_us = sum(e - s for s, e in comm)
    exposed = comm_us - overlap_of(comm, compute)
    out = {"compute_ms": sum(e - s for s, e in compute) / 1e3 / steps, "comm_ms": comm_us / 1e3 / steps,
           "comm_only_ms": exposed / 1e3 / steps, "kernels_per_step": sum(map(len, by_name.values())) / steps}
    if top:
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        out["top_kernels"] = [(name, round(sum(d) / 1e3 / steps, 3), len(d) / steps) for name, d in ranked]
    return out


def run_column(rank: int, world: int, wrapper: str, column: str, args, device, reference: dict) -> dict:
    model = build_model(args, device)
    run = wrap(model, wrapper, column, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    cuda = device.type == "cuda"

    def step():
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    losses = [step() for _ in range(3)]
    sync()
    first3 = time.perf_counter() - t0
    params = full_params(model)
    out = {"first3_s": first3, "losses": [float(x) for x in losses]}
    if column == "eager":
        reference[wrapper] = params
    elif wrapper in reference:
        diffs = {name: float((p - reference[wrapper][name]).abs().max()) for name, p in params.items()}
        out["max_param_diff"] = max(diffs.values())
        out["max_param_diff_at"] = max(diffs, key=diffs.get)
    del params
    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    step_ms = statistics.median(times)
    step_t = torch.tensor([step_ms], device=device)
    dist.all_reduce(step_t, op=dist.ReduceOp.MAX)   # the slowest rank sets the pace
    out["step_ms"] = float(step_t)
    out["tokens_per_s"] = world * args.batch * args.seq / (out["step_ms"] / 1e3)
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            sync()
        if rank == 0:
            path = os.path.join(tempfile.mkdtemp(), "trace.json")
            prof.export_chrome_trace(path)
            out.update(kernel_times(path, 3, args.top))
    dist.barrier()
    return out


def worker(rank: int, world: int, args, port: int, results_path: str):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        torch.set_float32_matmul_precision("high")   # TF32 matmuls in every column
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    reference: dict = {}
    results = {}
    pairs = [p.split(":") for p in args.pairs.split(",")] if args.pairs else \
        [(w, c) for w in args.wrappers.split(",") for c in args.columns.split(",")]
    for wrapper, column in pairs:
        key = f"{wrapper} {column}"
        try:
            results[key] = run_column(rank, world, wrapper, column, args, device, reference)
        except Exception as e:
            results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if rank == 0:   # (written after each column: a run stopped by its time limit keeps what it measured)
            print(f"{key}: {json.dumps(results[key])}", flush=True)
            with open(results_path, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


def table(results: dict, args, world: int) -> str:
    lines = [f"| {world} x {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'}, GPT-2"
             f"{' (tiny)' if args.tiny else ' small'}, batch {args.batch} x {args.seq} per rank | step | tokens/s | "
             f"first 3 steps | GPU computing | communicating | only communicating | peak | max param diff vs eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        if "error" in r:
            lines.append(f"| {key} | {r['error']} |")
            continue

        def f(name, fmt):
            return format(r[name], fmt) if name in r else "-"
        lines.append(f"| {key} | {f('step_ms', '.1f')} ms | {f('tokens_per_s', ',.0f')} | {f('first3_s', '.1f')} s | "
                     f"{f('compute_ms', '.1f')} ms | {f('comm_ms', '.1f')} ms | {f('comm_only_ms', '.1f')} ms | "
                     f"{f('peak_gib', '.1f')} GiB | {f('max_param_diff', '.2e')} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--wrappers", default="ddp,fsdp")
    p.add_argument("--columns", default=",".join(COLUMNS))
    p.add_argument("--pairs", default="", help="wrapper:column pairs in this order (ddp:eager,fsdp:ember,...)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 (checks the script)")
    p.add_argument("--fsdp-root", action="store_true", help="FSDP2: also compile the whole model")
    p.add_argument("--top", type=int, default=0, help="list the N kernels taking the most GPU time per column")
    p.add_argument("--world", type=int, default=0, help="processes (default: the GPUs, or 2 on the CPU)")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "distributed.json"))
    args = p.parse_args()
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2:
        print(f"bench/distributed.py: {world} GPU(s) here; data parallelism needs 2", file=sys.stderr)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch {torch.__version__}, {world} processes, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
          flush=True)
    mp.spawn(worker, args=(world, args, port, args.json), nprocs=world)
    with open(args.json) as f:
        print(table(json.load(f), args, world))


if __name__ == "__main__":
    main()
