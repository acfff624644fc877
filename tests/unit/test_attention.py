import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.attention import causal_attention


@pytest.mark.parametrize("batch,heads,kv_heads,seq,head_dim", [(2, 4, 4, 300, 16), (2, 8, 2, 257, 64)])
def test_cpu_bfloat16_attention_and_its_gradients_match_float64(batch, heads, kv_heads, seq, head_dim):
    # bfloat16 inputs take the mixed kernel (bf16 forward, fp32 backward); compare with float64 SDPA
    # on the same rounded inputs, GQA included.
    gen = torch.Generator().manual_seed(torch.seed())
    q = (2 * torch.randn(batch, seq, heads, head_dim, generator=gen)).bfloat16().transpose(1, 2)
    k = (2 * torch.randn(batch, seq, kv_heads, head_dim, generator=gen)).bfloat16().transpose(1, 2)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).bfloat16().transpose(1, 2)
    grad = torch.randn(batch, heads, seq, head_dim, generator=gen).bfloat16()
    ours = [t.detach().requires_grad_() for t in (q, k, v)]
    out = causal_attention(*ours)
    out.backward(grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    group = heads // kv_heads
    expected = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(group, 1),
                                              ref[2].repeat_interleave(group, 1), is_causal=True)
    expected.backward(grad.double())
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in ours)
    # Errors relative to the largest magnitude: bfloat16 rounding is 2**-8 = 3.9e-3.
    for name, got, want in [("out", out, expected)] + [(f"d{n}", a.grad, b.grad) for n, a, b in zip("qkv", ours, ref)]:
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 1.5e-2, f"{name}: relative error {err:.2e}"
