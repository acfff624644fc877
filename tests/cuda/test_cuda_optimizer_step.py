"""The clipped optimizer step where the parameters live in host memory and the gradient norm on the GPU, as
with FSDP CPU offload: the scale the fused CPU kernel reads must be there before it runs (``pytest -m cuda``)."""

import pytest
import torch

from torchtitan.components.optimizers.optimizer import build_optimizer, clipped_step
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.grad_norm import clip_grads_, clip_scale

pytestmark = pytest.mark.cuda


def test_host_parameters_with_a_gpu_norm_are_clipped_as_clipping_first():
    seed = int(torch.randint(0, 2**31, ()))
    results = []
    for in_kernel in (True, False):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(4096, 1024)) for _ in range(3)]
        optimizer = build_optimizer([torch.nn.ParameterList(params)], OptimizerConfig(implementation="fused"))
        generator = torch.Generator().manual_seed(seed + 1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            # Computed on the GPU, as the norm of offloaded FSDP gradients is (DTensor.from_local moves it there),
            # then a long GPU queue so that an unawaited copy to the host would still be in flight.
            norm = torch.cat([p.grad.flatten() for p in params]).cuda().norm()
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                busy = busy @ busy / 64
            if in_kernel:
                clipped_step(optimizer, params, norm, max_norm=1.0)
            else:
                clip_grads_(params, clip_scale(norm, 1.0))
                optimizer.step()
        results.append([p.detach().clone() for p in params])
    for got, want in zip(*results):
        assert torch.equal(got, want), seed
