"""Real models with random weights (no downloads), their inputs, and ways to count what a compiler captured.

Shared by tests/models (small configs) and bench/frontend.py (default configs). Every builder returns
(model, args): a fresh nn.Module in eval mode and a tuple of example inputs for `model(*args)`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init only: never reach the network

import torch
from torch.testing import assert_close


# ---------------------------------------------------------------- counting what a compiler captured

@dataclasses.dataclass
class Recorder:
    """A backend wrapper that records every graph it is given, then hands it to the real backend.

    Works for ember.compile and torch.compile alike: both call backend(gm, example_inputs) -> callable.
    """
    inner: Callable = None  # None: run the graph as captured (the "eager" backend)
    graphs: list = dataclasses.field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs.append(gm)
        return gm.forward if self.inner is None else self.inner(gm, example_inputs)

    @property
    def ops(self) -> int:
        return sum(op_count(g) for g in self.graphs)

    def ops_per_graph(self) -> list[int]:
        return [op_count(g) for g in self.graphs]


def op_count(gm: torch.fx.GraphModule) -> int:
    return sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)


def torch_break_count(fn: Callable, *args) -> int:
    """Graph breaks torch.compile takes on fn(*args), as torch._dynamo.explain reports them."""
    import torch._dynamo
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def ember_break_count(fn: Callable, *args) -> int:
    """Graph breaks ember takes on fn(*args), as ember.explain reports them."""
    import ember
    ember.reset()
    return ember.explain(fn)(*args).graph_break_count


# ---------------------------------------------------------------- comparing outputs

def assert_same(expected: Any, actual: Any, path: str = "out") -> None:
    """assert_close on every tensor of two nested outputs (tuples, lists, dicts, HF ModelOutputs, caches)."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert_close(actual, expected, msg=lambda m: f"{path}: {m}")
    elif isinstance(expected, dict):  # includes transformers' ModelOutput (an OrderedDict)
        assert list(actual.keys()) == list(expected.keys()), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    elif hasattr(expected, "__dict__") and not callable(expected):  # objects built in forward: HF caches
        assert_same(vars(expected), vars(actual), f"{path}.__dict__")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------- the models

def resnet18(batch: int = 2, size: int = 32):
    import torchvision
    return torchvision.models.resnet18(), (torch.randn(batch, 3, size, size),)


def densenet121(batch: int = 2, size: int = 64):
    import torchvision
    return torchvision.models.densenet121(), (torch.randn(batch, 3, size, size),)


def mobilenet_v3_small(batch: int = 2, size: int = 32):
    import torchvision
    return torchvision.models.mobilenet_v3_small(), (torch.randn(batch, 3, size, size),)


# Small transformer configs: same code paths as the default configs, a fraction of the size.
SMALL = dict(vocab=99, hidden=32, layers=2, heads=4, ffn=37, seq=8)


def _ids(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def bert(small: bool = True, batch: int = 2, seq: int | None = None):
    from transformers import BertConfig, BertModel
    s = SMALL
    cfg = BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                     num_attention_heads=s["heads"], intermediate_size=s["ffn"]) if small else BertConfig()
    seq = seq or (s["seq"] if small else 128)
    ids = _ids(cfg.vocab_size, batch, seq)
    return BertModel(cfg), (ids, torch.ones_like(ids))  # (input_ids, attention_mask)


def gpt2(small: bool = True, batch: int = 2, seq: int | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel
    s = SMALL
    cfg = GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                     n_positions=64, bos_token_id=s["vocab"] - 1, eos_token_id=s["vocab"] - 1) if small else GPT2Config()
    seq = seq or (s["seq"] if small else 128)
    return GPT2LMHeadModel(cfg), (_ids(cfg.vocab_size, batch, seq),)


def t5(small: bool = True, batch: int = 2, seq: int | None = None):
    from transformers import T5Config, T5ForConditionalGeneration
    s = SMALL
    cfg = T5Config(vocab_size=s["vocab"], d_model=s["hidden"], d_kv=8, d_ff=s["ffn"], num_layers=s["layers"],
                   num_decoder_layers=s["layers"], num_heads=s["heads"]) if small else T5Config()
    seq = seq or (s["seq"] if small else 128)
    # (input_ids, attention_mask, decoder_input_ids)
    ids = _ids(cfg.vocab_size, batch, seq)
    return T5ForConditionalGeneration(cfg), (ids, torch.ones_like(ids), _ids(cfg.vocab_size, batch, seq))


MODELS: dict[str, Callable] = {
    "resnet18": resnet18, "densenet121": densenet121, "mobilenet_v3_small": mobilenet_v3_small,
    "bert": bert, "gpt2": gpt2, "t5": t5,
}


def build(name: str, train: bool = False, seed: int = 0):
    """A fresh model (same weights for the same seed) in train or eval mode, and its inputs."""
    torch.manual_seed(seed)
    model, args = MODELS[name]()
    return model.train(train), args
