"""The reported gradient norm (and so clipping) is the float64 norm to float32 precision on every device."""

import pytest
import torch

from torchtitan.distributed.device import device_type
from torchtitan.distributed.grad_norm import clip_grad_norm_


def _params_with_grads(shapes, device):
    params = [torch.nn.Parameter(torch.empty(shape, device=device)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device) * 1e-3
    return params


def test_norm_of_large_gradients_equals_the_float64_norm():
    # An output-layer-sized gradient: PyTorch's float32 CPU norm was 1e-4 off on this size.
    params = _params_with_grads([(2048, 256), (256,), (768, 256)], device_type())
    expected = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    assert clip_grad_norm_(params, max_norm=0.0).item() == pytest.approx(expected, rel=1e-6)


def test_clipping_scales_every_gradient_to_max_norm():
    params = _params_with_grads([(300, 200), (50,)], device_type())
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=1e-3).item()
    assert norm > 1e-3
    after = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    assert after == pytest.approx(1e-3, rel=1e-5)
    for old, new in zip(before, params):
        torch.testing.assert_close(new.grad, old * (1e-3 / norm), rtol=1e-5, atol=0)
