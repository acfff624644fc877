import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.shared import amx_attention
from torchtitan.models.shared.attention import causal_attention


@pytest.mark.parametrize("batch,heads,kv_heads,seq,head_dim", [(2, 4, 4, 300, 16), (2, 8, 2, 257, 64)])
def test_cpu_bfloat16_attention_and_its_gradients_match_float64(batch, heads, kv_heads, seq, head_dim):
    # Shapes the AMX kernel declines (seq % 16, head_dim 64) take PyTorch's flash kernel, bf16 forward and
    # fp32 backward; compare with float64 SDPA on the same rounded inputs, GQA included.
    gen = torch.Generator().manual_seed(torch.seed())
    q = (2 * torch.randn(batch, seq, heads, head_dim, generator=gen)).bfloat16().transpose(1, 2)
    k = (2 * torch.randn(batch, seq, kv_heads, head_dim, generator=gen)).bfloat16().transpose(1, 2)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).bfloat16().transpose(1, 2)
    grad = torch.randn(batch, heads, seq, head_dim, generator=gen).bfloat16()
    assert not amx_attention.supports(q, k, v)
    _assert_matches_float64(q, k, v, grad)


def _assert_matches_float64(q, k, v, grad):
    """causal_attention's output and q/k/v gradients against float64 SDPA on the same rounded inputs."""
    ours = [t.detach().requires_grad_() for t in (q, k, v)]
    out = causal_attention(*ours)
    out.backward(grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    expected = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(group, 1),
                                              ref[2].repeat_interleave(group, 1), is_causal=True)
    expected.backward(grad.double())
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in ours)
    # Errors relative to the largest magnitude: bfloat16 rounding is 2**-8 = 3.9e-3.
    for name, got, want in [("out", out, expected)] + [(f"d{n}", a.grad, b.grad) for n, a, b in zip("qkv", ours, ref)]:
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 1.5e-2, f"{name}: relative error {err:.2e}"
        assert got.stride(-1) == 1


needs_amx = pytest.mark.skipif(not amx_attention.available(), reason="this CPU has no AMX (or no C++ compiler)")


def _random_qkv(batch, heads, kv_heads, seq, layout, gen):
    def make(h, scale=1.0):
        if layout == "bthd":  # the model's layout: a transposed view of (batch, seq, heads, head_dim)
            return (scale * torch.randn(batch, seq, h, 16, generator=gen)).bfloat16().transpose(1, 2)
        return (scale * torch.randn(batch, h, seq, 16, generator=gen)).bfloat16()
    return make(heads, 2), make(kv_heads, 2), make(kv_heads)


@needs_amx
@pytest.mark.parametrize("batch,heads,kv_heads,seq,layout", [(2, 4, 4, 256, "bthd"), (3, 8, 2, 336, "bhtd"),
                                                              (1, 2, 1, 16, "bthd")])
def test_amx_attention_and_its_gradients_match_float64(batch, heads, kv_heads, seq, layout):
    gen = torch.Generator().manual_seed(torch.seed())
    q, k, v = _random_qkv(batch, heads, kv_heads, seq, layout, gen)
    assert amx_attention.supports(q, k, v)
    grad = torch.randn(batch, heads, seq, 16, generator=gen).bfloat16()
    _assert_matches_float64(q, k, v, grad)  # the kernel rounds P and dS to bfloat16, as flash kernels do


def test_amx_attention_declines_what_it_does_not_compute():
    q = torch.randn(1, 2, 32, 16).bfloat16()
    assert not amx_attention.supports(q.float(), q.float(), q.float())  # float32
    assert not amx_attention.supports(q[:, :, :30], q[:, :, :30], q[:, :, :30])  # seq not a multiple of 16
    wide = torch.randn(1, 2, 32, 32).bfloat16()
    assert not amx_attention.supports(wide, wide, wide)  # head_dim 32


def test_amx_attention_is_off_without_a_working_compiler_or_when_disabled(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    amx_attention._loaded.clear()
    try:
        monkeypatch.setenv("TORCHTITAN_AMX_ATTENTION", "0")
        assert amx_attention._library() is None
        amx_attention._loaded.clear()
        monkeypatch.delenv("TORCHTITAN_AMX_ATTENTION")
        monkeypatch.setenv("CXX", "false")  # a compiler that always fails
        assert amx_attention._library() is None
        if amx_attention._CPU_FLAGS <= amx_attention._cpu_flags():
            assert "failed to build" in caplog.text
    finally:
        amx_attention._loaded.clear()


@needs_amx
@pytest.mark.slow
def test_compiled_amx_attention_matches_eager():
    gen = torch.Generator().manual_seed(torch.seed())
    q, k, v = _random_qkv(2, 4, 2, 64, "bthd", gen)

    def loss(q, k, v):
        return (causal_attention(q, k, v).float() ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True)  # fullgraph: the kernel must not break the graph
    grads = []
    for fn in (loss, compiled):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        value = fn(*inputs)
        value.backward()
        grads.append([value.detach()] + [t.grad for t in inputs])
    for eager, comp in zip(*grads):
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)


@needs_amx
def test_amx_attention_reads_odd_strides_and_declines_mismatched_shapes():
    gen = torch.Generator().manual_seed(torch.seed())
    # head_dim 16 sliced out of 17: token strides are odd, which the kernel's pair loads cannot read in place.
    q, k, v = (torch.randn(2, 32, 3, 17, generator=gen).bfloat16()[..., :16].transpose(1, 2) for _ in range(3))
    assert q.stride(2) % 2 == 1 and amx_attention.supports(q, k, v)
    torch.testing.assert_close(causal_attention(q, k, v), causal_attention(*(t.contiguous() for t in (q, k, v))),
                               rtol=0, atol=0)
    assert not amx_attention.supports(q, k[:1], v[:1])  # a broadcast batch
    assert not amx_attention.supports(q, k, v[..., :8])  # a narrower v
