"""Model suite: eager vs torch.compile (Inductor) vs ember on named models of bench/zoo.py's families, for speed.

    .venv/bin/python bench/suite.py [--device cpu|cuda] [--rows a,b] [--shard i/n] [--cpu-target native|avx2|avx512]
                                    [--threads N] [--clock wall|process] [--batch B] [--timeout S] [--budget S]
                                    [--json FILE] [--list]
    .venv/bin/python bench/suite.py --merge a.json b.json ...     # one table and summary from shards' JSON

Rows: a model (torchvision, or transformers built from a config: random weights, no downloads), a mode and a dtype:
- eval: forward under torch.no_grad;
- train: one training step, the torch.compile tutorial's: zero_grad, forward, loss, backward, AdamW(foreach) step;
- f32: float32; bf16: eval casts weights and inputs to bfloat16, train runs forward and loss under
  torch.autocast(bfloat16) with float32 weights (mixed precision, as training is run).
Dropout is off in every model (p = 0), so that the three columns compute the same step and can be checked.
Sizes: realistic, but CPU-affordable on the CPU; larger batches and models on the GPU. --batch B sets every row's
batch (host-time rows: B = 1 or 2; on CUDA the table then also gives each column's host time per call, the calls
queued without a wait).

Each row runs in its own process (a crash or a timeout is a row), with fresh, empty on-disk caches for both
compilers (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, EMBER_CACHE_DIR: new temporary directories; ember's
once-per-machine C++ guard checker and CUDA launcher are built first in a cache shared by the run, as an installed
ember has them). In the row's process: each column is built from the same seeded weights (train: its own copy,
and its own optimizer), then
- cold compile: the wall time of the first 3 calls (compile, recompiles, the optimizer's state creation) minus 3
  steady calls; the compilers go in the order ember, Inductor (torch._dynamo and torch._inductor are imported
  before, so neither is charged for the other's imports);
- check: eval compares every floating output with eager's (assert_close, rtol 1e-3 and atol 1e-3 of the largest
  eager value in float32; 4e-2 in bfloat16); train compares the losses of the first 3 steps (the 2nd and 3rd
  follow the optimizer's updates) at the same tolerances, and how far each fell from the first (within the
  tolerance of eager's drop, plus a tenth of it of the first loss). A failed check is printed in the row (MISMATCH), and
  the row is still timed;
- timing: rounds in turns, each round starting at the next column, one call per column and round on the CPU, a
  block of calls of at least 5 ms on the GPU (synchronized after it); median ms per call over the rounds. --clock
  process (CPU) times the calls in this process's CPU time: on a machine shared with other work, with
  --threads 1, what the calls cost without the waits for a core that others' work adds (cold compiles stay wall
  time: both compilers build in other processes).
--cpu-target (CPU only) sets the instruction set of the whole row's process, as on a machine that has only it:
EMBER_CPU_ISA for ember's C++, ATEN_CPU_CAPABILITY for ATen's kernels and Inductor's C++ (Inductor picks its vector
ISA from it), ONEDNN_MAX_CPU_ISA for oneDNN (as `python -m tests.other_targets` does), MKL_ENABLE_INSTRUCTIONS for
MKL (eager's and Inductor's matrix products and 1x1 convolutions: left at AVX-512, they ran ~2x faster than an AVX2
machine's, where ember's oneDNN products were capped).
The summary gives the geomean of ember against Inductor (Inductor ms / ember ms), the rows below 0.95x, against
eager, and the largest ratio of ember's cold compile to Inductor's (the goal: at most 1/5 on every row).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
TAG = "@@SUITE "
ISA_ENV = {"avx2": {"EMBER_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"EMBER_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
           "native": {}}


# ---------------------------------------------------------------- models

@dataclasses.dataclass
class Size:
    batch: int
    seq: int = 128      # tokens (text), or the image side (vision)


@dataclasses.dataclass
class Model:
    family: str                   # "tv" (torchvision) or "hf" (transformers)
    cls: str                      # torchvision name, or the transformers model class
    cpu: Size
    gpu: Size
    config: str = ""              # transformers config class
    cfg: dict = dataclasses.field(default_factory=dict)      # config kwargs on the CPU
    gpu_cfg: dict = dataclasses.field(default_factory=dict)  # config kwargs on the GPU (over cfg)
    inputs: str = "text"          # text | ids | seq2seq | image (transformers)


BERT_CPU = dict(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                max_position_embeddings=512)
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
DEC_CPU = dict(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
               intermediate_size=688, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DEC_GPU = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=2816)
T5_CPU = dict(vocab_size=8000, d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=8,
              decoder_start_token_id=0, pad_token_id=0)   # (the labels shifted into decoder inputs need both)
T5_GPU = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8)
VIT_CPU = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536, image_size=224,
               patch_size=16, num_labels=1000)

MODELS: dict[str, Model] = {
    # torchvision (cpu.seq / gpu.seq: the image side)
    "resnet18": Model("tv", "resnet18", Size(8, 224), Size(128, 224)),
    "resnet50": Model("tv", "resnet50", Size(4, 224), Size(64, 224)),
    "mobilenet_v3_large": Model("tv", "mobilenet_v3_large", Size(8, 224), Size(128, 224)),
    "efficientnet_b0": Model("tv", "efficientnet_b0", Size(8, 224), Size(64, 224)),
    "densenet121": Model("tv", "densenet121", Size(8, 128), Size(32, 224)),
    "convnext_tiny": Model("tv", "convnext_tiny", Size(4, 224), Size(64, 224)),
    "vit_b_16": Model("tv", "vit_b_16", Size(2, 224), Size(64, 224)),
    "swin_t": Model("tv", "swin_t", Size(2, 224), Size(64, 224)),
    "regnet_y_800mf": Model("tv", "regnet_y_800mf", Size(8, 224), Size(128, 224)),
    "shufflenet_v2_x1_0": Model("tv", "shufflenet_v2_x1_0", Size(8, 224), Size(128, 224)),
    # transformers (seq: tokens)
    "bert": Model("hf", "BertModel", Size(4, 128), Size(32, 256), "BertConfig", BERT_CPU, BERT_BASE),
    "distilbert": Model("hf", "DistilBertModel", Size(4, 128), Size(32, 256), "DistilBertConfig",
                        dict(vocab_size=30522, dim=256, n_layers=4, n_heads=4, hidden_dim=1024),
                        dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072)),
    "roberta": Model("hf", "RobertaModel", Size(4, 128), Size(32, 256), "RobertaConfig",
                     dict(BERT_CPU, vocab_size=50265, max_position_embeddings=514), BERT_BASE),
    "gpt2": Model("hf", "GPT2LMHeadModel", Size(4, 128), Size(16, 512), "GPT2Config",
                  dict(vocab_size=8000, n_embd=256, n_layer=4, n_head=4, n_positions=1024),
                  dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12), "ids"),
    "llama": Model("hf", "LlamaForCausalLM", Size(4, 128), Size(16, 512), "LlamaConfig", DEC_CPU, DEC_GPU),
    "qwen2": Model("hf", "Qwen2ForCausalLM", Size(4, 128), Size(16, 512), "Qwen2Config", DEC_CPU, DEC_GPU),
    "t5": Model("hf", "T5ForConditionalGeneration", Size(4, 128), Size(16, 256), "T5Config", T5_CPU, T5_GPU,
                "seq2seq"),
    "mistral": Model("hf", "MistralForCausalLM", Size(4, 128), Size(16, 512), "MistralConfig",
                     dict(DEC_CPU, sliding_window=None), DEC_GPU),
    "bart": Model("hf", "BartForConditionalGeneration", Size(4, 128), Size(16, 256), "BartConfig",
                  dict(vocab_size=8000, d_model=256, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                       max_position_embeddings=1024),
                  dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                       decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072), "seq2seq"),
    "hf_vit": Model("hf", "ViTForImageClassification", Size(4, 224), Size(64, 224), "ViTConfig", VIT_CPU,
                    dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
                    "image"),
}


def _no_dropout(config) -> None:
    for k, v in config.to_dict().items():
        if ("dropout" in k or "pdrop" in k or k == "drop_path_rate") and isinstance(v, float):
            setattr(config, k, 0.0)


def build(name: str, device: str, train: bool, batch: int | None) -> tuple:
    """(model, kwargs, labels or None) for the row's model on the device, float32, seeded weights."""
    import torch
    m = MODELS[name]
    size = m.gpu if device == "cuda" else m.cpu
    b = batch or size.batch
    torch.manual_seed(0)
    if m.family == "tv":
        import torchvision
        with torch.device(device):
            model = torchvision.models.get_model(m.cls, weights=None)
        for mod in model.modules():   # Dropout, torchvision's StochasticDepth: off (module doc)
            if isinstance(getattr(mod, "p", None), float) and ("Dropout" in type(mod).__name__ or
                                                               "StochasticDepth" in type(mod).__name__):
                mod.p = 0.0
        kwargs = {"x": torch.randn(b, 3, size.seq, size.seq, device=device)}
        labels = torch.randint(0, 1000, (b,), device=device)
        return model, kwargs, labels
    import transformers
    cfg = dict(m.cfg, **(m.gpu_cfg if device == "cuda" else {}))
    config = getattr(transformers, m.config)(**cfg)
    config.use_cache = False
    _no_dropout(config)
    cls = m.cls
    if train and cls in ("BertModel", "RobertaModel", "DistilBertModel"):   # pretraining: the masked-LM head's loss
        cls = cls.replace("Model", "ForMaskedLM")
    with torch.device(device):
        model = getattr(transformers, cls)(config)
    vocab = getattr(config, "vocab_size", 1000)
    ids = torch.randint(3, vocab, (b, size.seq), device=device)
    if m.inputs == "image":
        kwargs = {"pixel_values": torch.randn(b, 3, size.seq, size.seq, device=device)}
        labels = torch.randint(0, config.num_labels, (b,), device=device)
    elif m.inputs == "seq2seq":
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = torch.randint(3, vocab, (b, size.seq), device=device)
        if not train:
            kwargs["decoder_input_ids"] = labels
    else:
        kwargs = {"input_ids": ids} if m.inputs == "ids" else {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = ids.clone()
    return model, kwargs, labels


@dataclasses.dataclass
class Row:
    name: str
    model: str
    mode: str      # eval | train
    dtype: str     # f32 | bf16


def rows_for(device: str) -> list[Row]:
    if device == "cuda":
        spec = [(m, "eval", "f32") for m in ("resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0",
                                            "convnext_tiny", "regnet_y_800mf", "shufflenet_v2_x1_0", "vit_b_16",
                                            "swin_t", "densenet121",
                                            "bert", "distilbert", "roberta", "gpt2", "llama", "qwen2", "mistral",
                                            "t5", "bart", "hf_vit")]
        spec += [(m, "eval", "bf16") for m in ("resnet50", "vit_b_16", "bert", "llama")]
        spec += [(m, "train", "f32") for m in ("resnet18", "bert", "gpt2")]
        spec += [(m, "train", "bf16") for m in ("resnet50", "vit_b_16", "bert", "gpt2", "llama", "t5")]
    else:
        spec = [(m, "eval", "f32") for m in ("resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0",
                                            "densenet121", "convnext_tiny", "vit_b_16", "regnet_y_800mf", "bert",
                                            "distilbert", "gpt2", "llama", "t5", "hf_vit")]
        spec += [(m, "train", "f32") for m in ("resnet18", "bert", "gpt2")]
    return [Row(f"{m} {mode} {dt}", m, mode, dt) for m, mode, dt in spec]


# ---------------------------------------------------------------- one row, in its own process

def make_step(row: Row, device: str, base, kwargs, labels, compiler):
    """A no-argument step for one column: eval returns the model's output, train the loss (detached)."""
    import torch
    import torch.nn.functional as F
    if row.mode == "eval":
        model = base
        fn = model if compiler is None else compiler(model)

        def step():
            with torch.no_grad():
                return fn(**kwargs)
        return step
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tv = MODELS[row.model].family == "tv"
    autocast = row.dtype == "bf16"

    def train_step(kwargs, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            if tv:
                loss = F.cross_entropy(model(**kwargs), labels)
            else:
                loss = model(**kwargs, labels=labels).loss
        loss.backward()
        opt.step()
        return loss.detach()
    fn = train_step if compiler is None else compiler(train_step)
    return lambda: fn(kwargs, labels)


def check(row: Row, outs: list, refs: list) -> str:
    """"ok", or "MISMATCH: ..." with the worst error (module doc: the tolerances)."""
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    from zoo import tensors
    tol = 1e-3 if row.dtype == "f32" else 4e-2
    got = [t for o in outs for t in tensors(o) if t.is_floating_point()]
    want = [t for o in refs for t in tensors(o) if t.is_floating_point()]
    if len(got) != len(want):
        return f"MISMATCH: {len(got)} floating outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        scale = max(w.detach().float().abs().max().item() if w.numel() else 0.0, 1e-6)
        try:
            torch.testing.assert_close(g.detach().float(), w.detach().float(), rtol=tol, atol=tol * scale)
        except AssertionError:
            err = (g.detach().float() - w.detach().float()).abs().max().item()
            return f"MISMATCH: output {i} max error {err:.3g} (largest eager value {scale:.3g})"
    if row.mode == "train" and len(want) > 1:
        # the losses' drops from the first step: an update that is wrong (a gradient lost) moves the loss by much
        # less than the loss itself, which the comparison above is scaled by
        first, first_ref = float(got[0]), float(want[0])
        for k in range(1, len(want)):
            drop, drop_ref = first - float(got[k]), first_ref - float(want[k])
            if abs(drop - drop_ref) > tol * abs(drop_ref) + 0.1 * tol * abs(first_ref):
                return f"MISMATCH: the loss fell by {drop:.4g} by step {k + 1}, eager's by {drop_ref:.4g}"
    return "ok"


def child(a) -> dict:
    import torch
    row = next(r for r in rows_for(a.device) if r.name == a.child)
    res = {"row": row.name, "device": a.device}
    if a.threads:
        torch.set_num_threads(a.threads)
    res["threads"] = torch.get_num_threads()
    # ember's once-per-machine extensions in the run's shared cache, then a fresh cache for the row's kernels
    import ember
    from ember.runtime import native_guards
    native_guards.checker(wait=True)
    if a.device == "cuda":
        from ember.runtime import cuda_launch
        cuda_launch.EXTENSION.get(wait=True)
    fresh = tempfile.mkdtemp(prefix="suite_row_")
    for var, sub in [("EMBER_CACHE_DIR", "ember"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("TRITON_CACHE_DIR", "triton")]:
        os.environ[var] = os.path.join(fresh, sub)
    import torch._dynamo  # noqa: F401  (imported before the timed compiles: module doc)
    import torch._inductor.compile_fx  # noqa: F401
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    base, kwargs, labels = build(row.model, a.device, row.mode == "train", a.batch)
    base.train(row.mode == "train")
    if row.dtype == "bf16" and row.mode == "eval":
        base = base.to(torch.bfloat16)
        kwargs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kwargs.items()}
    res["batch"] = next(iter(kwargs.values())).shape[0]
    compilers = {"eager": None, "ember": ember.compile, "inductor": torch.compile}
    eagerly = ran_eagerly()
    steps, outs, first = {}, {}, 3
    for col, comp in compilers.items():
        try:
            torch.manual_seed(1)
            step = make_step(row, a.device, base, kwargs, labels, comp)
            sync()
            t0 = time.perf_counter()
            outs[col] = [step() for _ in range(first)]
            sync()
            first_s = time.perf_counter() - t0
            runs = []
            for _ in range(3):
                t1 = time.perf_counter()
                step()
                sync()
                runs.append(time.perf_counter() - t1)
            if comp is not None:
                res[f"{col} cold s"] = max(0.0, first_s - first * statistics.median(runs))
                res[f"{col} check"] = check(row, outs[col], outs["eager"])
            steps[col] = (step, statistics.median(runs))
        except Exception as e:   # a failing column is reported; the others are timed
            res[f"{col} error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"
        print(f"  {row.name} [{col}] " + ", ".join(f"{k.split(' ', 1)[1]} {v if isinstance(v, str) else round(v, 3)}"
                                                   for k, v in res.items() if k.startswith(col + " ")), flush=True)
    outs.clear()
    if eagerly:   # a graph ember ran eagerly (a miss): the row's ember column is partly eager's
        res["ember eager graphs"] = len(eagerly)
        res["ember eager first"] = eagerly[0]
    res.update(time_in_turns(steps, a.device, a.budget, time.process_time if a.clock == "process" else time.perf_counter))
    if a.device == "cuda" and a.batch:
        for col, (step, _) in steps.items():
            res[f"{col} host ms"] = host_ms(step)
    res["load"] = os.getloadavg()[0]
    shutil.rmtree(fresh, ignore_errors=True)
    return res


def ran_eagerly() -> list:
    """The messages of ember's `fallbacks` log that say a graph ran eagerly (as bench/zoo.py counts misses), from
    now on."""
    import logging
    lines: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "eagerly" in msg or "ATen graph" in msg:
                lines.append(msg.strip().splitlines()[0][:300])
    logging.getLogger("ember.fallbacks").addHandler(Keep(logging.WARNING))
    return lines


def time_in_turns(steps: dict, device: str, budget: float, clock=time.perf_counter) -> dict:
    """{"<col> ms": median ms per call}: rounds in turns, each starting at the next column (module doc)."""
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    keys = list(steps)
    if not keys:
        return {}
    inner = {k: 1 if device != "cuda" else max(1, math.ceil(5e-3 / max(steps[k][1], 1e-6))) for k in keys}
    per_round = sum(inner[k] * steps[k][1] for k in keys)
    rounds = max(5, min(40, int(budget / max(per_round, 1e-6))))
    times: dict = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            step = steps[k][0]
            sync()
            t0 = clock()
            for _ in range(inner[k]):
                step()
            sync()
            times[k].append((clock() - t0) / inner[k])
    return {f"{k} ms": statistics.median(v) * 1e3 for k, v in times.items()} | {"rounds": rounds}


def host_ms(step, calls: int = 20) -> float:
    """Host time per call (ms): calls queued without a wait in between (the GPU's queue absorbs their kernels)."""
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e3


# ---------------------------------------------------------------- the parent

def run_row(row: Row, a, machine_cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               EMBER_CACHE_DIR=machine_cache, **ISA_ENV[a.cpu_target if a.device == "cpu" else "native"])
    cmd = [sys.executable, __file__, "--child", row.name, "--device", a.device, "--budget", str(a.budget),
           "--clock", a.clock]
    if a.batch:
        cmd += ["--batch", str(a.batch)]
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
        cmd += ["--threads", str(a.threads)]
    t0 = time.perf_counter()
    # its own session: a timeout ends the row's process and every process it started (compile workers, g++)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        print("".join(l + "\n" for l in stdout.splitlines() if not l.startswith(TAG)), end="")
        return {"row": row.name, "error": f"timeout after {a.timeout:.0f} s", "seconds": a.timeout}
    print("".join(l + "\n" for l in stdout.splitlines() if not l.startswith(TAG)), end="", flush=True)
    lines = [l for l in stdout.splitlines() if l.startswith(TAG)]
    if not lines:
        tail = stderr.strip().splitlines()[-3:]
        return {"row": row.name, "error": f"exit {p.returncode}: {' | '.join(tail)[-300:]}",
                "seconds": round(time.perf_counter() - t0, 1)}
    res = json.loads(lines[-1][len(TAG):])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and x == x else "-"


def geomean(xs: list) -> float:
    xs = [x for x in xs if isinstance(x, float) and x == x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def ratios(r: dict) -> tuple:
    e, i, m = (r.get(f"{k} ms", float("nan")) for k in ("eager", "inductor", "ember"))
    ic, mc = r.get("inductor cold s", float("nan")), r.get("ember cold s", float("nan"))
    return i / m, e / m, (mc / ic if ic == ic and ic > 0 else float("nan"))


def table(results: list[dict], host: bool = False) -> str:
    head = ["row", "batch", "eager ms", "inductor ms", "ember ms", "ember/inductor", "ember/eager",
            "inductor cold s", "ember cold s", "cold ember/ind", "check"]
    if host:
        head += ["eager host ms", "inductor host ms", "ember host ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        vs_ind, vs_eager, cold = ratios(r)
        errs = "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("error"))
        checks = ", ".join(f"{c} {r[c + ' check']}" for c in ("inductor", "ember")
                           if r.get(f"{c} check", "ok") != "ok")
        cells = [r["row"], str(r.get("batch", "-")), fmt(r.get("eager ms"), ".3f"), fmt(r.get("inductor ms"), ".3f"),
                 fmt(r.get("ember ms"), ".3f"), fmt(vs_ind, ".2f") + "x", fmt(vs_eager, ".2f") + "x",
                 fmt(r.get("inductor cold s"), ".1f"), fmt(r.get("ember cold s"), ".1f"), fmt(cold, ".2f"),
                 " ".join(x for x in (checks or ("ok" if "ember check" in r else ""), errs) if x)
                 + (f" ({r['ember eager graphs']} ember graphs eager)" if r.get("ember eager graphs") else "")]
        if host:
            cells += [fmt(r.get(f"{c} host ms"), ".3f") for c in ("eager", "inductor", "ember")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    rs = [(r["row"], *ratios(r)) for r in results]
    ok = [x for x in rs if x[1] == x[1]]
    low = [f"{n} {v:.2f}x" for n, v, _, _ in ok if v < 0.95]
    slow = [f"{n} {v:.2f}x" for n, _, v, _ in ok if v < 1.0]
    colds = [(c, n) for n, _, _, c in rs if c == c]
    worst = max(colds) if colds else (float("nan"), "-")
    over = [f"{n} {c:.2f}" for c, n in colds if c > 0.2]
    eager = [f"{r['row']} ({r['ember eager first'][:120]})" for r in results if r.get("ember eager graphs")]
    failed = [r["row"] for r in results if any(k.endswith("error") for k in r)
              or any(str(r.get(f"{c} check", "ok")) != "ok" for c in ("inductor", "ember"))]
    return (f"ember vs Inductor geomean {geomean([x[1] for x in ok]):.2f}x over {len(ok)} rows (lowest "
            f"{min((x[1] for x in ok), default=float('nan')):.2f}x); ember vs eager geomean "
            f"{geomean([x[2] for x in ok]):.2f}x\n"
            f"rows below 0.95x Inductor: {', '.join(low) or 'none'}\n"
            f"rows slower than eager: {', '.join(slow) or 'none'}\n"
            f"cold compile ember/Inductor: largest {worst[0]:.2f} ({worst[1]}), rows over 0.2: {', '.join(over) or 'none'}\n"
            f"rows with an error or a failed check: {', '.join(failed) or 'none'}\n"
            f"rows where ember ran a graph eagerly: {', '.join(eager) or 'none'}")


def machine(device: str, cpu_target: str) -> str:
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if device == "cuda":
        dev = torch.cuda.get_device_name()
    else:
        dev = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                   platform.processor() or platform.machine()) + f", {os.cpu_count()} cores, target {cpu_target}"
    return (f"{dev}; torch {torch.__version__}, Python {platform.python_version()}; {when}; commit {commit}; "
            f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--rows", default="", help="comma-separated parts of row names (e.g. resnet,bert train)")
    p.add_argument("--shard", default="1/1", help="i/n: the i-th of n interleaved slices of the rows (1-based)")
    p.add_argument("--cpu-target", default="native", choices=sorted(ISA_ENV), help="CPU instruction set (module doc)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of every column (OMP_NUM_THREADS and "
                   "torch.set_num_threads; default: torch's)")
    p.add_argument("--clock", default="wall", choices=["wall", "process"],
                   help="the timed calls' clock: wall, or (CPU) this process's CPU time, which a shared machine's "
                   "other work does not add to (with --threads 1 the same as the wall time of an idle machine)")
    p.add_argument("--batch", type=int, default=0, help="every row's batch (host-time rows: 1 or 2)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per row (its process is killed after)")
    p.add_argument("--budget", type=float, default=0, help="seconds of timing per row (default 6 CPU, 3 GPU)")
    p.add_argument("--json", default="")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    p.add_argument("--merge", nargs="+", help="JSON files of shards: print their rows as one table")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.merge:
        docs = [json.load(open(f)) for f in a.merge]
        results = [r for d in docs for r in d["rows"]]
        order = {r.name: i for i, r in enumerate(rows_for(docs[0]["device"]))}
        results.sort(key=lambda r: order.get(r["row"], 1e9))
        print("\n".join(f"# {d['machine']}" for d in docs))
        print(table(results, host=any(d.get("batch") for d in docs) and docs[0]["device"] == "cuda"))
        print(summary(results))
        return 0
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.budget = a.budget or (6.0 if a.device == "cpu" else 3.0)
    if a.clock == "process" and a.device != "cpu":
        p.error("--clock process times CPU work: --device cpu only")
    if a.child:
        res = child(a)
        print(TAG + json.dumps(res), flush=True)
        return 0
    rows = rows_for(a.device)
    if a.rows:
        parts = [s.strip() for s in a.rows.split(",") if s.strip()]
        rows = [r for r in rows if any(s in r.name for s in parts)]
    i, n = map(int, a.shard.split("/"))
    rows = rows[i - 1::n]
    if a.list:
        print("\n".join(r.name for r in rows))
        return 0
    head = machine(a.device, a.cpu_target)
    print(f"# bench/suite.py --device {a.device} --shard {a.shard}" + (f" --batch {a.batch}" if a.batch else "")
          + (f" --threads {a.threads}" if a.threads else "") + (f" --clock {a.clock}" if a.clock != "wall" else "")
          + f": {len(rows)} rows\n# {head}", flush=True)
    machine_cache = tempfile.mkdtemp(prefix="suite_machine_")
    results = []
    for row in rows:
        results.append(run_row(row, a, machine_cache))
        r = results[-1]
        vs_ind, vs_eager, cold = ratios(r)
        print(f"{row.name}: ember/inductor {vs_ind:.2f}x, ember/eager {vs_eager:.2f}x, cold ember/ind {cold:.2f}, "
              f"{r['seconds']} s, load {os.getloadavg()[0]:.2f}"
              + "".join(f"; {k}: {v}" for k, v in r.items() if k.endswith("error")), flush=True)
        if a.json:   # after every row, so a run cut short keeps its rows
            with open(a.json, "w") as f:
                json.dump({"machine": head, "device": a.device, "cpu_target": a.cpu_target, "batch": a.batch,
                           "threads": a.threads, "clock": a.clock,
                           "rows": results}, f, indent=1)
    shutil.rmtree(machine_cache, ignore_errors=True)
    print()
    print(table(results, host=bool(a.batch and a.device == "cuda")))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
