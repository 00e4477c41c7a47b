"""Dynamic shapes: loops whose input sizes change, eager vs torch.compile vs ember, side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/dynamic.py [--device cpu|cuda] [--loops bert,gpt2,train] [--compilers ...]
        [--logs DIR]   (each child's stderr to DIR/<loop>-<compiler>.log: with EMBER_LOGS=recompiles,dynamic, why
                        each graph was compiled)

Each (loop, compiler) runs in a fresh process, so each total includes every compile the loop triggers, as a user
sees it. Both compilers run with their defaults (dynamic=None: static first, then symbolic for the sizes that
changed), each wrapped in the same counting backend, so "graphs" is the number of graphs handed to the backend.
  bert   BertModel (4 layers) inference over 10 sequence lengths, each 3 times: total seconds; then the mean
         time of one more call per length after the loop (steady state).
  gpt2   GPT-2 greedy generation of 128 tokens with its KV cache (the cache grows by one token per step): total
         seconds of the first generation (compiles included), then tokens per second of a second generation.
  train  a training loop (conv net, SGD) of 30 steps whose batch size changes on a few steps (the last batch of
         an epoch): total seconds, then the mean step time over a second pass.
Goals (issue 27): at most 2 compiles per loop; total at most 1/4 of torch.compile's; after the compiles each
call at least as fast as eager's, and on the GPU at least as fast as torch.compile's dynamic code.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = ("bert", "gpt2", "train")
COMPILERS = ("eager", "torch.compile", "ember")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _counting(backend, counter: list):
    def count(gm, example_inputs):
        counter[0] += 1
        return backend(gm, example_inputs)
    return count


def _compiler(name: str, counter: list):
    """fn -> compiled fn for one compiler name, counting the graphs its backend receives."""
    if name == "eager":
        return lambda f: f
    if name == "torch.compile":
        import torch._dynamo
        return lambda f: torch.compile(f, backend=_counting(torch._dynamo.lookup_backend("inductor"), counter))
    import ember
    from ember.backends import lookup_backend
    return lambda f: ember.compile(f, backend=_counting(lookup_backend("ember"), counter))


# ---------------------------------------------------------------- loops: each returns (total s, steady metric)

def bert_loop(device: str, compile_fn) -> dict:
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=4, hidden_size=256 if device == "cpu" else 768,
                     num_attention_heads=4 if device == "cpu" else 12,
                     intermediate_size=1024 if device == "cpu" else 3072)
    model = BertModel(cfg).eval().to(device)
    fn = compile_fn(model)
    lengths = [16 + 12 * k for k in range(10)]
    batch = 2 if device == "cpu" else 8
    inputs = {n: torch.randint(0, cfg.vocab_size, (batch, n), device=device) for n in lengths}
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            for n in lengths:
                fn(input_ids=inputs[n]).last_hidden_state
        _sync(device)
        total = time.perf_counter() - t0
        steady = []
        for n in lengths:
            t1 = time.perf_counter()
            for _ in range(5):
                fn(input_ids=inputs[n])
            _sync(device)
            steady.append((time.perf_counter() - t1) / 5)
    return {"total_s": total, "steady_ms": 1e3 * sum(steady) / len(steady)}


def gpt2_generator(device: str, compile_fn):
    """generate(tokens) -> ids: greedy decoding with GPT-2's KV cache through the compiled model (the loop below;
    bench/tools/gpu_decode_profile.py profiles its steps)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4 if device == "cpu" else 12, n_embd=256 if device == "cpu" else 768,
                     n_head=4 if device == "cpu" else 12, n_positions=512)
    model = GPT2LMHeadModel(cfg).eval().to(device)
    step = compile_fn(model)
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), device=device)

    def generate(tokens: int) -> torch.Tensor:
        out = step(input_ids=prompt, use_cache=True)
        past, ids = out.past_key_values, [out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(tokens - 1):
            out = step(input_ids=ids[-1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids.append(out.logits[:, -1].argmax(-1, keepdim=True))
        return torch.cat(ids, 1)
    return generate


def gpt2_loop(device: str, compile_fn) -> dict:
    generate = gpt2_generator(device, compile_fn)

    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        first = generate(128)
        _sync(device)
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        second = generate(128)
        _sync(device)
        rate = 128 / (time.perf_counter() - t1)
    return {"total_s": total, "tokens_per_s": rate, "ids": first.tolist(), "same_twice": bool((first == second).all())}


def train_loop(device: str, compile_fn) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step = compile_fn(train_step)
    # batch 32, the last batch of each 10-step epoch smaller (an epoch of 297 samples), twice as many on the GPU
    sizes = [(32 if k % 10 != 9 else 9) * (1 if device == "cpu" else 4) for k in range(30)]
    data = [(torch.randn(b, 3, 32, 32, device=device), torch.randint(0, 10, (b,), device=device)) for b in sizes]
    _sync(device)
    t0 = time.perf_counter()
    losses = [float(step(x, y)) for x, y in data]
    _sync(device)
    total = time.perf_counter() - t0
    t1 = time.perf_counter()
    for x, y in data:
        step(x, y)
    _sync(device)
    return {"total_s": total, "steady_ms": 1e3 * (time.perf_counter() - t1) / len(data), "losses": losses}


def child(loop: str, compiler: str, device: str) -> dict:
    counter = [0]
    compile_fn = _compiler(compiler, counter)
    out = {"bert": bert_loop, "gpt2": gpt2_loop, "train": train_loop}[loop](device, compile_fn)
    out["graphs"] = counter[0]
    return out


def run_child(loop: str, compiler: str, device: str, timeout: float, logs: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{loop}:{compiler}", "--device", device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        p = types.SimpleNamespace(stdout="", stderr=e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or "")
        _save_log(logs, loop, compiler, p.stderr)
        return {"error": f"timeout after {timeout:.0f} s"}
    _save_log(logs, loop, compiler, p.stderr)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:160]}


def _save_log(logs: str | None, loop: str, compiler: str, text: str) -> None:
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"{loop}-{compiler.replace('.', '_')}.log"), "w") as f:
            f.write(text)


def _fmt(r: dict, key: str, spec: str) -> str:
    return "error" if "error" in r else format(r[key], spec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--compilers", default=",".join(COMPILERS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--logs", help="a folder for each child's stderr (EMBER_LOGS=recompiles,dynamic: why it compiled)")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        loop, compiler = a.child.split(":", 1)
        print("RESULT " + json.dumps(child(loop, compiler, a.device)), flush=True)
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    name = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine()
    print(f"bench/dynamic.py  {a.device} ({name})  torch {torch.__version__}  {datetime.date.today()}  "
          f"commit {commit.strip()}")
    for loop in a.loops.split(","):
        rows = {c: run_child(loop, c, a.device, a.timeout, a.logs) for c in a.compilers.split(",")}
        metric = {"bert": ("steady_ms", "ms/call after"), "gpt2": ("tokens_per_s", "tokens/s after"),
                  "train": ("steady_ms", "ms/step after")}[loop]
        print(f"\n{loop}: | compiler | total s (compiles included) | graphs | {metric[1]} | same as eager |")
        print("|---|---|---|---|---|")
        ref = rows.get("eager", {})
        for c, r in rows.items():
            same = "—"
            if ref and "error" not in r and "error" not in ref and c != "eager":
                key = {"gpt2": "ids", "train": "losses"}.get(loop)
                if key == "ids":
                    same = "yes" if r[key] == ref[key] else "no"
                elif key == "losses":
                    same = "yes" if torch.allclose(torch.tensor(r[key]), torch.tensor(ref[key]), rtol=1e-3, atol=1e-4) \
                        else "no"
            err = f" ({r['error']})" if "error" in r else ""
            print(f"| {c} | {_fmt(r, 'total_s', '.2f')}{err} | {r.get('graphs', '—')} | "
                  f"{_fmt(r, metric[0], '.2f')} | {same} |")


if __name__ == "__main__":
    main()
