"""Chunked linear cross-entropy equals the plain projection + cross-entropy, in loss and gradients (fp32)."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.objectives.loss import cross_entropy_sum
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.models.shared.chunked_cross_entropy import ChunkedLinearCrossEntropy


def close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Within 1e-5 relative, entries that cancel to near zero measured against the tensor's largest entry."""
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def plain_and_chunked(tokens: int, dim: int, vocab: int, chunk: int, ignored: float = 0.2, compiled: bool = False,
                      device: str = "cpu"):
    """(loss, input gradient, weight gradient) of the plain head + cross-entropy, then of the chunked head."""
    h = torch.randn(2, tokens // 2, dim, dtype=torch.float64).float().to(device)
    labels = torch.randint(0, vocab, (2, tokens // 2))
    labels[torch.rand(labels.shape) < ignored] = IGNORE_INDEX
    labels = labels.to(device)
    weight = torch.randn(vocab, dim) / dim**0.5
    head = ChunkedLinearCrossEntropy(dim, vocab, chunk, device=device)
    with torch.no_grad():
        head.weight.copy_(weight)
    if compiled:
        head.compile_loss("inductor")
    results = []
    for chunked in (False, True):
        head.zero_grad()
        x = h.clone().requires_grad_()
        loss = head(x, labels=labels) if chunked else cross_entropy_sum(head(x), labels)
        (loss * 0.37).backward()  # a non-unit upstream gradient
        results.append((loss.detach(), x.grad, head.weight.grad.clone()))
    return results


@pytest.mark.parametrize("tokens,vocab,chunk", [(256, 2048, 64), (250, 2003, 64), (96, 517, 1000)],
                         ids=["even", "ragged", "one-chunk"])
def test_loss_and_gradients_equal_the_plain_path(tokens, vocab, chunk):
    (loss, grad_h, grad_w), (chunked_loss, chunked_h, chunked_w) = plain_and_chunked(tokens, 64, vocab, chunk)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5, atol=0)
    close(chunked_h, grad_h)
    close(chunked_w, grad_w)


def test_ignored_tokens_contribute_nothing():
    (loss, grad_h, _), (chunked_loss, chunked_h, _) = plain_and_chunked(64, 32, 300, 16, ignored=0.5)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5, atol=0)
    assert chunked_loss > 0
    head_rows = chunked_h.flatten(0, 1)
    assert (head_rows.abs().sum(dim=1) == 0).sum() == (grad_h.flatten(0, 1).abs().sum(dim=1) == 0).sum() > 0


def test_without_labels_the_head_is_the_plain_projection():
    head = ChunkedLinearCrossEntropy(16, 50, 8)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(head(x), F.linear(x, head.weight))


def test_a_model_with_the_chunked_head_trains_like_the_plain_one():
    """Through the decoder: same summed loss and parameter gradients as logits + cross-entropy."""
    from torchtitan.models.shared.chunked_cross_entropy import use_chunked_loss
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    args = spec.flavors["debugmodel"].finalize(2048, 64)
    plain = spec.model_cls(args)
    plain.init_weights(seed=3)
    chunked = spec.model_cls(args)
    chunked.load_state_dict(plain.state_dict())
    use_chunked_loss(chunked, 48)
    tokens = torch.randint(0, 2048, (2, 64))
    labels = torch.randint(0, 2048, (2, 64))
    cross_entropy_sum(plain(tokens), labels).backward()
    chunked(tokens, labels=labels).backward()
    grads = dict(chunked.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
