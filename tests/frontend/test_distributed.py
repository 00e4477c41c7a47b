"""Training through torch.distributed's wrappers: DDP and FSDP2 around ember-compiled models, on 2 CPU processes
(gloo), against eager DDP/FSDP2 from the same start; and module hooks with kwargs, which FSDP2 registers.

The processes are spawned once (module fixture) and run every scenario; each test reads its scenario's result.
Each scenario trains a small transformer 3 AdamW steps per rank on rank-specific data and compares the losses
and the final parameters with eager DDP/FSDP2, and checks through a counting backend that ember compiled the
model's compute (not only ran it)."""
from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ember
from ember.backends import lookup_backend

WORLD = 2
VOCAB, WIDTH = 64, 32


class Block(nn.Module):
    def __init__(self, d: int, with_break: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)   # (a k bias gets zero gradients: AdamW would amplify noise)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.with_break = with_break

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        if self.with_break:
            print(end="")   # a graph break inside the block
        return x + self.mlp(self.ln2(x))


class CallingBlock(Block):
    """A block whose class has its own __call__ around nn.Module's (as transformers' GradientCheckpointingLayer)."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


class Net(nn.Module):
    def __init__(self, with_break: bool = False, n: int = 2, block=Block):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([block(WIDTH, with_break and i == 0) for i in range(n)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class Counting:
    """A backend (aot_eager: ember's autograd, ATen graphs run as they are) that counts the ops it was given."""

    def __init__(self):
        self.ops: list[int] = []

    def __call__(self, gm, example_inputs):
        self.ops.append(sum(n.op in ("call_function", "call_method") for n in gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)


def train(model: nn.Module, wrap, rank: int, steps: int = 3, on_step=None):
    """Losses and final parameters (full tensors) of `steps` AdamW steps on rank-specific tokens."""
    run = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 16), generator=gen)
        loss = nn.functional.cross_entropy(run(tokens).flatten(0, 1), tokens.flatten())
        if on_step is not None:
            on_step(step, loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                                 for p in model.parameters()]


def fsdp(model: Net, compile_blocks: bool = False, compile_model: bool = False, backend=None):
    """FSDP2 as its recipes apply it: fully_shard on each block and on the root; then ember.compile of each block
    and/or of the whole model."""
    from torch.distributed.fsdp import fully_shard
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    if compile_blocks:
        for i, b in enumerate(model.blocks):
            model.blocks[i] = ember.compile(b, backend=backend)
    return ember.compile(model, backend=backend) if compile_model else model


def check_equal(got, expected):
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])


_expected: dict = {}


def expected(kind: str, with_break: bool, rank: int):
    """Eager DDP's or FSDP2's losses and parameters, once per process and model."""
    if (kind, with_break) not in _expected:
        torch.manual_seed(0)
        wrap = (lambda m: DDP(m, bucket_cap_mb=BUCKET_MB)) if kind == "ddp" else fsdp
        _expected[kind, with_break] = train(Net(with_break), wrap, rank)
    return _expected[kind, with_break]


BUCKET_MB = 0.02   # ~20 kB buckets: the model's ~100 kB of parameters in several


def scenario_ddp(rank: int, with_break: bool, outer: bool):
    """ember.compile(DDP(model)) or DDP(ember.compile(model)). With the outer one, also: a bucket's all-reduce
    starts while the compiled backward still has pieces to run (DDP's comm hook fires before the backward of the
    graph's first piece begins): without the split at DDP's buckets, every all-reduce would follow it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    backend, events = Counting(), []

    def comm_hook(state, bucket):
        events.append("allreduce")
        return allreduce_hook(None, bucket)

    def wrap(m):
        if not outer:
            return DDP(ember.compile(m, backend=backend), bucket_cap_mb=BUCKET_MB)
        ddp = DDP(m, bucket_cap_mb=BUCKET_MB)
        ddp.register_comm_hook(None, comm_hook)
        return ember.compile(ddp, backend=backend)

    def on_step(step, loss):   # each compiled piece's backward, as it starts
        events.clear()
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is not None and node not in seen:
                seen.add(node)
                if type(node).__name__ == "CompiledGraphFunctionBackward":
                    node.register_prehook(lambda grads: events.append("piece"))
                todo += [n for n, _ in node.next_functions]

    torch.manual_seed(0)
    check_equal(train(Net(with_break), wrap, rank, on_step=on_step), expected("ddp", with_break, rank))
    # compiled, and each graph split at DDP's buckets: the model's 47 ops arrive in pieces
    assert sum(backend.ops) >= 40 and len(backend.ops) > (5 if with_break else 3), backend.ops
    if outer:   # (the last step's events: DDP rebuilds its buckets after the first)
        assert events.count("piece") > 2, events
        assert events.index("allreduce") < len(events) - 1 - events[::-1].index("piece"), events


def scenario_fsdp(rank: int, with_break: bool, compile_blocks: bool, compile_model: bool = True, block=Block):
    """fully_shard on each block and the root, then ember.compile of the whole model and/or of each block."""
    backend = Counting()
    torch.manual_seed(0)
    check_equal(train(Net(with_break, block=block), lambda m: fsdp(m, compile_blocks, compile_model, backend), rank),
                expected("fsdp", with_break, rank))
    # each block's compute is compiled between FSDP's hooks (all-gather before, reshard after, run as Python)
    assert max(backend.ops) >= (10 if with_break else 20), backend.ops


SCENARIOS = {
    "ddp_outer": lambda r: scenario_ddp(r, False, True),
    "ddp_inner_break": lambda r: scenario_ddp(r, True, False),
    "fsdp_model": lambda r: scenario_fsdp(r, False, False),
    "fsdp_blocks_break": lambda r: scenario_fsdp(r, True, True),
    # only the blocks compiled, each block's class with its own __call__
    "fsdp_blocks_own_call": lambda r: scenario_fsdp(r, False, True, compile_model=False, block=CallingBlock),
}


def _worker(rank: int, init_file: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {}
    for name, run in SCENARIOS.items():
        ember.reset()
        try:
            run(rank)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(str(out / "init"), str(out)), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_distributed_training(results, name):
    for rank, res in enumerate(results):
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


# ------------------------------------------------------------------------------- module hooks (FSDP2's kind)
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return self.lin(x).relu() * scale


def _hooked(printing: bool):
    m = Scaled()

    def pre(mod, args, kwargs):
        if printing:
            print(end="")
        kwargs["scale"] = 3.0     # the kwargs dict is the one forward then receives
        return (args[0] * 2,), kwargs

    def post(mod, args, kwargs, out):
        return out + kwargs["scale"]

    m.register_forward_pre_hook(pre, with_kwargs=True)
    m.register_forward_hook(post, with_kwargs=True)
    return m


@pytest.mark.parametrize("printing", [False, True])
def test_hooks_with_kwargs(printing):
    """Hooks with kwargs are inlined; one that breaks runs as Python at the break and the module's forward still
    compiles."""
    m = _hooked(printing)
    x = torch.randn(2, 4, requires_grad=True)
    expected = m(x, scale=0.5)
    e = ember.explain(m)(x, scale=0.5)
    torch.testing.assert_close(e.result, expected)
    assert e.graph_count >= 1 and max(len(ops) for ops in e.ops_per_graph) >= 2, e   # linear, relu, (mul, add)
    assert e.graph_break_count == (1 if printing else 0), e
    compiled = ember.compile(m)
    for _ in range(2):
        x = torch.randn(2, 4, requires_grad=True)
        got, expected = compiled(x, scale=0.5), m(x, scale=0.5)
        torch.testing.assert_close(got, expected)
        (g1,) = torch.autograd.grad(got.sum(), x)
        (g2,) = torch.autograd.grad(expected.sum(), x)
        torch.testing.assert_close(g1, g2)


def test_pre_hook_returning_bad_value_raises_as_eager():
    m = Scaled()
    m.register_forward_pre_hook(lambda mod, args, kwargs: args, with_kwargs=True)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="forward pre-hook must return None or a tuple"):
        m(x)
    with pytest.raises(RuntimeError, match="forward pre-hook must return None or a tuple"):
        ember.compile(m)(x)
