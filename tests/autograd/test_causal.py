"""Attention masks computed from constants that are the causal mask run as is_causal=True (ember.autograd.causal):
compiled results against eager (forward and gradients), the rewrite seen in the autograd log, and masks that are
not causal (a window, an input, a different diagonal) left as they are."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.autograd.causal import is_causal_mask


def _bool_mask(L: int, S: int, device, window: int | None = None, diagonal: int = 0):
    """A mask as libraries build it when traced: aranges compared, broadcast over batch and heads."""
    q = torch.arange(L, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    m = k <= q + diagonal
    if window is not None:
        m = m & (q - k < window)
    return m[None, None].expand(2, 1, L, S)


def _float_mask(L: int, S: int, device, dtype):
    keep = _bool_mask(L, S, device)
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


def attention(q, k, v, kind: str):
    L, S = q.shape[-2], k.shape[-2]
    mask = {"bool": lambda: _bool_mask(L, S, q.device),
            "float": lambda: _float_mask(L, S, q.device, q.dtype),
            "window": lambda: _bool_mask(L, S, q.device, window=3),
            "diagonal": lambda: _bool_mask(L, S, q.device, diagonal=1)}[kind]()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin()


@pytest.fixture
def autograd_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="ember.autograd"):
        yield caplog


def _rewritten(caplog) -> bool:
    return any("is the causal mask" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind,causal", [("bool", True), ("float", True), ("window", False), ("diagonal", False)])
@pytest.mark.parametrize("L,S", [(16, 16), (8, 12)])
def test_constant_causal_masks_compile_to_is_causal(autograd_log, kind, causal, L, S):
    q = torch.randn(2, 4, L, 16, requires_grad=True)
    k = torch.randn(2, 4, S, 16, requires_grad=True)
    v = torch.randn(2, 4, S, 16, requires_grad=True)
    expected = attention(q, k, v, kind)
    grads = torch.autograd.grad(expected.sum(), (q, k, v))
    got = ember.compile(attention)(q, k, v, kind)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), (q, k, v)), grads, rtol=1e-4, atol=1e-5)
    assert _rewritten(autograd_log) == causal


def test_a_mask_read_from_an_input_is_kept(autograd_log):
    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril()   # causal in value, but an input: another call may differ
    torch.testing.assert_close(ember.compile(f)(q, k, v, mask), f(q, k, v, mask))
    other = torch.rand(16, 16) > 0.3
    other[:, 0] = True
    torch.testing.assert_close(ember.compile(f)(q, k, v, other), f(q, k, v, other))
    assert not _rewritten(autograd_log)


def test_is_causal_mask_rule():
    tril = torch.ones(5, 7, dtype=torch.bool).tril()
    assert is_causal_mask(tril, 5, 7) and is_causal_mask(tril[None, None].expand(3, 2, 5, 7), 5, 7)
    assert not is_causal_mask(tril.triu(), 5, 7) and not is_causal_mask(tril, 7, 5)
    bias = torch.zeros(5, 7).masked_fill(~tril, float("-inf"))
    assert is_causal_mask(bias, 5, 7)
    assert not is_causal_mask(bias.masked_fill(~tril, -1e4), 5, 7)   # a finite penalty: other weights than 0
    assert not is_causal_mask(torch.ones(5, 7, dtype=torch.int64).tril(), 5, 7)
