"""Block-causal attention and per-document positions: the batch fields, the kernels and the model."""

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_model import _tiny
from torchtitan.data import document_positions
from torchtitan.distributed.context_parallel import METHODS, context_parallel_attention
from torchtitan.models.shared.attention import DocumentMask, attend, document_spans


def random_document_ids(generator, batch, seq, max_documents):
    """Non-decreasing ids per row, with documents of random lengths (some rows hold a single document)."""
    rows = []
    for _ in range(batch):
        count = torch.randint(0, max_documents, (1,), generator=generator)
        cuts = torch.randperm(seq - 1, generator=generator)[:count]
        starts = torch.zeros(seq, dtype=torch.long)
        starts[cuts + 1] = 1
        rows.append(starts.cumsum(0) + torch.randint(0, 3, (1,), generator=generator))
    return torch.stack(rows)


def masked_reference(q, k, v, ids):
    """Attention with the explicit (batch, seq, seq) same-document-and-causal mask, in float64."""
    seq = q.size(2)
    mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.size(1) != k.size(1))


def outputs_and_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return [t.double() for t in (out, q.grad, k.grad, v.grad)]


def test_positions_restart_at_each_document_and_a_cut_document_counts_from_zero():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [3, 3, 3, 3, 3, 3], [0, 1, 2, 3, 3, 3]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 2]]
    assert document_spans(ids) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)], [(0, 1), (1, 2), (2, 3), (3, 6)]]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_per_document_kernel_matches_the_masked_reference(kv_heads):
    g = torch.Generator().manual_seed(kv_heads)
    ids = random_document_ids(g, 3, 40, 6)
    q, dout = torch.randn(3, 4, 40, 8, generator=g).double(), torch.randn(3, 4, 40, 8, generator=g).double()
    k, v = (torch.randn(3, kv_heads, 40, 8, generator=g).double() for _ in range(2))
    want = outputs_and_grads(lambda *a: masked_reference(*a, ids), q, k, v, dout)
    got = outputs_and_grads(lambda *a: attend(*a, DocumentMask(ids)), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max() < 1e-12, name


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_single_rank_context_parallel_attention_honours_documents(method, use_kernel):
    g = torch.Generator().manual_seed(7)
    ids = random_document_ids(g, 2, 24, 5)
    q, dout = torch.randn(2, 4, 24, 8, generator=g), torch.randn(2, 4, 24, 8, generator=g)
    k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(2))
    want = outputs_and_grads(lambda *a: masked_reference(*a, ids), *(t.double() for t in (q, k, v)), dout.double())
    got = outputs_and_grads(
        lambda *a: context_parallel_attention(*a, None, method, use_kernel=use_kernel, documents=DocumentMask(ids)),
        q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max() < 1e-5, name


@pytest.mark.slow
def test_flex_block_mask_used_on_cuda_masks_like_the_reference():
    # flex attention has no CPU backward, so CPU runs the per-document kernel; the block mask CUDA uses is
    # checked here through flex attention's (compiled) CPU forward.
    from torchtitan.models.shared.attention import _flex_attention, _flex_block_mask

    g = torch.Generator().manual_seed(3)
    ids = random_document_ids(g, 2, 256, 8)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(2))
    with torch.no_grad():
        got = _flex_attention(q, k, v, _flex_block_mask(ids))
    assert (got.double() - masked_reference(q.double(), k.double(), v.double(), ids)).abs().max() < 1e-5


def test_a_packed_document_is_independent_of_the_one_before_it():
    """Logits of document B do not change when every token of document A does, equal B's logits run alone,
    and a loss on B's tokens gives A's input embeddings no gradient."""
    model = _tiny(max_seq_len=64)
    g = torch.Generator().manual_seed(11)
    a_len, b_len = 23, 17
    a, b = torch.randint(1, 257, (a_len,), generator=g), torch.randint(1, 257, (b_len,), generator=g)
    a_changed = (a + 1 + torch.randint(0, 255, (a_len,), generator=g)) % 256 + 1
    assert (a_changed != a).all()
    ids = torch.tensor([0] * a_len + [1] * b_len)[None]
    positions = document_positions(ids)

    def run(tokens, ids, positions):
        embeddings = []
        handle = model.tok_embeddings.register_forward_hook(
            lambda module, args, out: embeddings.append(out.retain_grad() or out))
        logits = model(tokens[None], document_ids=ids, positions=positions)
        handle.remove()
        return logits, embeddings[0]

    logits, embeddings = run(torch.cat([a, b]), ids, positions)
    changed, _ = run(torch.cat([a_changed, b]), ids, positions)
    alone, _ = run(b, torch.zeros(1, b_len, dtype=torch.long), torch.arange(b_len)[None])
    assert (logits[0, a_len:] - changed[0, a_len:]).abs().max() <= 1e-6
    assert (logits[0, a_len:] - alone[0]).abs().max() <= 1e-6
    assert (logits[0, :a_len] - changed[0, :a_len]).abs().max() > 1e-3  # A's own logits did change
    F.cross_entropy(logits[0, a_len:-1], b[1:]).backward()
    assert embeddings.grad[0, :a_len].abs().max() == 0
    assert embeddings.grad[0, a_len:].abs().max() > 0
    # Without the document mask B does see A: the test can tell the difference.
    plain = model(torch.cat([a_changed, b])[None]).detach()
    assert (plain[0, a_len:] - model(torch.cat([a, b])[None]).detach()[0, a_len:]).abs().max() > 1e-3
