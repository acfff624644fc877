"""flash-linear-attention's kernels (the ``fla`` extra: chunk_gated_delta_rule, and chunk_kda for a decay per key
channel) against the chunked PyTorch form on the GPU: packed documents, an incoming state, the affine probe context
parallelism uses, and the gradients."""

import pytest
import torch

from tests.unit.test_gated_deltanet import fresh_generator, random_inputs
from torchtitan.models.shared import gated_deltanet
from torchtitan.models.shared.gated_delta_rule import chunk_transition, gated_delta_rule

pytestmark = pytest.mark.cuda


@pytest.fixture
def fla_kernel():
    if gated_deltanet._fla_kernel() is None:
        pytest.skip("flash-linear-attention (the fla extra) is not installed")
    kernel = gated_deltanet.recurrence_kernel(torch.device("cuda"))
    assert kernel is not gated_delta_rule
    return kernel


def test_fla_equals_the_chunked_form_with_documents_state_and_gradients(fla_kernel):
    gen = fresh_generator()
    q, k, v, g, beta = (t.cuda() for t in random_inputs(2, 300, 4, 64, 64, torch.float32, gen))
    q = q * 64**-0.5
    resets = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    resets[0, [50, 128, 129]] = True
    resets[1, 0] = True
    state = torch.randn(2, 4, 64, 64, device="cuda", generator=None) * 0.1
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    ours = fla_kernel(*inputs, resets, state)
    reference = gated_delta_rule(*inputs, resets, state)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)
    cotangent = torch.randn_like(reference[0])
    grads = torch.autograd.grad((ours[0] * cotangent).sum(), inputs)
    expected = torch.autograd.grad((reference[0] * cotangent).sum(), inputs)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    # The probe of context parallelism (K extra value channels starting as the identity) through fla.
    for a, b in zip(chunk_transition(q, k, v, g, beta, resets, kernel=fla_kernel),
                    chunk_transition(q, k, v, g, beta, resets)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)


def test_fla_chunk_kda_equals_the_chunked_form_with_channel_decays():
    """Kimi Delta Attention (a decay per key channel) through fla's chunk_kda against the chunked PyTorch form:
    documents, an incoming state, the gradients and the probe of context parallelism."""
    from tests.unit.test_kimi_delta_attention import channel_inputs

    if gated_deltanet._fla_kernel(per_channel=True) is None:
        pytest.skip("flash-linear-attention with chunk_kda (the fla extra) is not installed")
    kernel = gated_deltanet.recurrence_kernel(torch.device("cuda"))
    assert kernel is not gated_delta_rule
    gen = fresh_generator()
    q, k, v, g, beta = (t.cuda() for t in channel_inputs(2, 300, 4, 64, 64, torch.float32, gen))
    q = q * 64**-0.5
    resets = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    resets[0, [50, 128, 129]] = True
    resets[1, 0] = True
    state = torch.randn(2, 4, 64, 64, device="cuda") * 0.1
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    ours = kernel(*inputs, resets, state)
    reference = gated_delta_rule(*inputs, resets, state)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)
    cotangent = torch.randn_like(reference[0])
    grads = torch.autograd.grad((ours[0] * cotangent).sum(), inputs)
    expected = torch.autograd.grad((reference[0] * cotangent).sum(), inputs)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    for a, b in zip(chunk_transition(q, k, v, g, beta, resets, kernel=kernel),
                    chunk_transition(q, k, v, g, beta, resets)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)
