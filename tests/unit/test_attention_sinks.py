"""Attention sinks and sliding windows against a plain softmax with an explicit sink column and window mask: the
one-process paths (whole rows and per document, CPU flash kernel and the math block), forward and every gradient,
the sinks' included. The context-parallel paths are in test_context_parallel.py."""

import pytest
import torch

from tests.unit.test_document_masking import random_document_ids
from torchtitan.models import attention_kernels
from torchtitan.models.attention import DocumentMask, attend


def reference(q, k, v, sinks, window, ids=None):
    """Softmax over [the keys a query may see | its head's sink], the sink's column dropped afterwards."""
    bsz, heads, length, dim = q.shape
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * dim**-0.5
    back = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    visible = back >= 0
    if window is not None:
        visible = visible & (back < window)
    visible = visible.expand(bsz, 1, length, length)
    if ids is not None:
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(bsz, heads, length, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :length]
    return probs @ v


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _case(dtype, gen, length=150, kv_heads=2, documents=False):
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, generator=gen)

    q, k, v = randn(2, 4, length, 16), randn(2, kv_heads, length, 16), randn(2, kv_heads, length, 16)
    sinks = randn(4) * 2
    ids = random_document_ids(gen, 2, length, 6) if documents else None
    return [t.requires_grad_() for t in (q, k, v, sinks)], ids


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("window, with_sinks", [(None, True), (1, True), (7, True), (70, True), (7, False),
                                               (70, False)])
@pytest.mark.parametrize("documents", [False, True])
def test_sinks_and_windows_equal_the_explicit_softmax(dtype, tol, kernel, window, documents, with_sinks, monkeypatch):
    monkeypatch.setattr(attention_kernels, "_pick_kernel", lambda *args: kernel)
    calls = []
    run_block = attention_kernels._run_block
    monkeypatch.setattr(attention_kernels, "_run_block", lambda name, *args: calls.append(name) or run_block(name,
                                                                                                           *args))
    gen = fresh_generator()
    (q, k, v, sinks), ids = _case(dtype, gen, documents=documents)
    sinks_or_none = sinks if with_sinks else None
    cotangent = torch.randn(q.shape, dtype=dtype, generator=gen)
    inputs = [q, k, v, sinks] if with_sinks else [q, k, v]
    documents_mask = None if ids is None else DocumentMask(ids, flex=False)
    ours = attend(q, k, v, documents_mask, window=window, sinks=sinks_or_none)
    expected = reference(q, k, v, sinks_or_none, window, ids)
    assert (ours - expected).abs().max() <= tol
    got = torch.autograd.grad((ours * cotangent).sum(), inputs)
    want = torch.autograd.grad((expected * cotangent).sum(), inputs)
    for name, a, b in zip("q k v sinks".split(), got, want):
        assert (a - b).abs().max() <= tol * max(1.0, b.abs().max().item()), name
    assert set(calls) == {kernel} and not attention_kernels._failed_kernels  # the kernel asked for ran


def test_a_sink_takes_attention_mass():
    gen = fresh_generator()
    (q, k, v, _), _ = _case(torch.float64, gen, length=20)
    plain = attend(q, k, v, window=5)
    heavy = attend(q, k, v, window=5, sinks=torch.full((4,), 30.0, dtype=torch.float64))
    assert heavy.abs().max() < 1e-6 * plain.abs().max()  # a huge sink logit leaves almost nothing for the keys


def test_a_bad_window_is_refused():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="window 0 must be >= 1"):
        attend(q, q, q, window=0)
