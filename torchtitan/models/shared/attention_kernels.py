"""One block of attention as (output, log-sum-exp), and its backward given a merged (output, log-sum-exp).

The shared pieces of every attention that combines partial results by their log-sum-exp: context parallelism
(distributed/context_parallel.py) and attention with sinks or sliding windows (models/shared/attention.py). A block's
backward recomputes its probabilities from the merged log-sum-exp, so each block's gradient is exact whatever
else was merged (the flash-attention backward).

``causal`` is False (no mask), True (a square block on the diagonal) or a bool tensor (Lq, Lk), True where a query
may see a key (a sliding window); the CPU flash kernel and the math block take such masks, the CUDA wrappers do
not (masked blocks run the math block there).
"""

import warnings

import torch

aten = torch.ops.aten


# ----------------------------------------------------------------------------------------------------------
# One block of attention: (out, lse) forward and a backward against the merged (out, lse)
# ----------------------------------------------------------------------------------------------------------
# q is (B, H, Lq, D), k/v (B, H, Lk, D) already expanded to H heads and in the compute dtype. Forward returns
# out in the compute dtype and lse (B, H, Lq) in float32 (float64 for float64 inputs); a query row that sees no
# key of the block gets out 0 and lse -inf. The CPU kernel and math blocks are tested against each other; the
# CUDA wrappers are only checked on meta tensors here, so a CUDA kernel that rejects its inputs at run time falls
# back to the math block (exact, slower) with a warning rather than failing.


def _masked_scores(q, k, causal, scale):
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    if isinstance(causal, torch.Tensor):
        return scores.masked_fill(~causal, float("-inf"))
    if causal:
        return scores.masked_fill(_upper_mask(scores), float("-inf"))
    return scores


def _math_forward(q, k, v, causal, scale):
    scores = _masked_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, 0.0)  # a row without keys: exp(-inf) = 0, not nan
    out = torch.matmul(torch.exp(scores - finite.unsqueeze(-1)), v.to(scores.dtype))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    scores = _masked_scores(q, k, causal, scale)
    work = scores.dtype
    qf, kf, vf, doutf = q.to(work), k.to(work), v.to(work), dout.to(work)
    probs = torch.exp(scores - lse.to(work).unsqueeze(-1))
    delta = (doutf * out.to(work)).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(doutf, vf.transpose(-1, -2)) - delta)
    dq = torch.matmul(dscores, kf) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), qf) * scale
    dv = torch.matmul(probs.transpose(-1, -2), doutf)
    return dq, dk, dv


def _upper_mask(scores):
    n = scores.size(-1)
    return torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _cpu_flash_forward(q, k, v, causal, scale):
    if isinstance(causal, torch.Tensor):
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, False, attn_mask=_additive(causal, q.dtype), scale=scale)
    return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    if isinstance(causal, torch.Tensor):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            dout, q, k, v, out, lse.contiguous(), 0.0, False, attn_mask=_additive(causal, q.dtype), scale=scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)


def _cuda_flash_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    # No dropout, so the RNG state is never read; the cumulative lengths are unset as for dense inputs.
    rng = torch.empty(0, dtype=torch.long, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward.default(
        dout, q, k, v, out, lse.contiguous(), None, None, q.size(2), k.size(2), 0.0, causal, rng, rng, scale=scale)


def _efficient_lse_len(lq: int) -> int:
    # The memory-efficient kernel pads its LSE rows to a multiple of 32 (not on ROCm).
    return lq if torch.version.hip else -(-lq // 32) * 32


def _cuda_efficient_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.size(2)]


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    padded = lse.new_zeros(*lse.shape[:-1], _efficient_lse_len(q.size(2)))
    padded[..., : q.size(2)] = lse
    seed = torch.zeros((), dtype=torch.long, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
        dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


KERNELS = {
    "math": (_math_forward, _math_backward),
    "cpu_flash": (_cpu_flash_forward, _cpu_flash_backward),
    "cuda_flash": (_cuda_flash_forward, _cuda_flash_backward),
    "cuda_efficient": (_cuda_efficient_forward, _cuda_efficient_backward),
}
_failed_kernels: set[tuple[str, torch.dtype]] = set()


def _pick_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, use_kernel: bool) -> str:
    if not use_kernel:
        return "math"
    if device.type == "cpu":
        name = "cpu_flash"
    elif device.type == "cuda":
        flash_ok = dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and head_dim % 8 == 0
        name = "cuda_flash" if flash_ok else "cuda_efficient"
    else:
        name = "math"
    return "math" if (name, dtype) in _failed_kernels else name


def _run_block(kernel: str, backward: bool, *args):
    """Run a block with ``kernel``; if the kernel rejects these inputs, fall back to the (exact) math path."""
    if kernel.startswith("cuda") and isinstance(args[-2], torch.Tensor):
        kernel = "math"  # the CUDA wrappers take no mask (see the module docstring)
    if kernel != "math":
        try:
            return list(KERNELS[kernel][backward](*args))
        except (RuntimeError, NotImplementedError) as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise
            dtype = args[0].dtype
            _failed_kernels.add((kernel, dtype))
            warnings.warn(f"attention block: kernel {kernel} failed for {dtype} ({err}); using the math path",
                          stacklevel=2)
    return list(KERNELS["math"][backward](*args))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # On CPU the flash kernel's backward is faster in float32 than in bfloat16 (see models/shared/attention.py).
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return t.dtype


# ----------------------------------------------------------------------------------------------------------
# Attention sinks and windows on merged results
# ----------------------------------------------------------------------------------------------------------


def check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be >= 1 (tokens each query sees, itself included)")


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sink s per head (H,) joins each query's softmax as one more logit with no value: given the output and
    log-sum-exp over the real keys, (out * sigmoid(lse - s), logaddexp(lse, s)). Folded once, after every block is
    merged; the blocks' backward, given these, is exact for the softmax with the sink."""
    with_sink = torch.logaddexp(lse, sinks.detach().to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - with_sink).unsqueeze(-1), with_sink


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, -sum over queries of P(sink) * (dO . O), from the folded output and log-sum-exp."""
    weight = torch.exp(sinks.detach().to(lse.dtype).view(1, -1, 1) - lse)
    return -(weight * (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)).sum((0, 2)).to(sinks.dtype)

