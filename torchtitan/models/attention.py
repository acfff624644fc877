"""Attention kernels shared by the model families."""

import torch
import torch.nn.functional as F

from torchtitan.models import amx_attention

_aten = torch.ops.aten


class _CpuBf16FlashAttention(torch.autograd.Function):
    """Causal attention on CPU: PyTorch's flash kernel forward in bfloat16, its backward in float32.

    Measured with torch 2.13 on Sapphire Rapids (AMX), batch 8 x 2048, head_dim 16: the kernel's
    bfloat16 forward is about 1.3x faster than its float32 one, but its bfloat16 backward is about
    1.5x slower than the float32 one; pairing the two fast halves made the debug model's whole
    training step 1.15x (compiled) to 1.2x (eager) faster than computing both in float32. The
    backward gets the forward's float32 log-sum-exp and the bfloat16 output upcast, so it
    differentiates the forward that ran.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, True
            )
        return tuple(g.to(torch.bfloat16) for g in grads)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled-dot-product attention of (batch, heads, seq, head_dim) tensors; k/v may have fewer heads.

    On CPU, bfloat16 inputs with head_dim 16 take the AMX kernel where the machine has one
    (models/amx_attention.py), other bfloat16 inputs the mixed-precision flash kernel above, and float16
    ones are computed in float32 (the CPU float16 kernel is slower still); elsewhere the inputs' dtype is used.
    """
    gqa = q.shape[1] != k.shape[1]
    if amx_attention.supports(q, k, v):
        return amx_attention.causal_attention(q, k, v)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and k.dtype == v.dtype == torch.bfloat16:
        return _CpuBf16FlashAttention.apply(q, k, v)  # the kernel maps kv heads to query-head groups itself
    if q.device.type == "cpu" and q.dtype == torch.float16:
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
