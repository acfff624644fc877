"""Rotary position embeddings for every decoder family: one cos/sin table, two channel conventions.

- ``"pairs"``: adjacent channels (2i, 2i+1) rotate together (Llama's original layout; DeepSeek's
  interleaved form).
- ``"halves"``: channel i rotates with channel i + head_dim/2 (Hugging Face's rotate_half; the layout
  of Qwen3's released checkpoints, so their projections load unpermuted).

A family changes the frequencies (Llama 3.1 scaling, YaRN) by handing ``rope_table`` other ones;
positions that restart per document go through ``apply_rope``'s ``positions``.

Multimodal RoPE (M-RoPE: Qwen3-VL, Qwen3.5) gives each token three positions, temporal, height and width, and
each frequency reads one of them. ``mrope_streams`` says which ("interleaved": frequency i takes stream i mod 3
while i < 3 x that stream's section, the temporal stream otherwise), and ``apply_rope`` takes positions per
frequency, (batch, seq, head_dim/2), as ``positions[..., streams]``. Looked up in the same table, a token whose
three positions are equal rotates exactly as under one position, so a text-only batch is bitwise the text model's.
"""

import math
from typing import Literal

import torch

RopeConvention = Literal["pairs", "halves"]


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """The head_dim/2 rotation frequencies theta^(-2i/head_dim), in float64."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, theta: float, factor: float, original_seq_len: int, beta_fast: float,
                     beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): the dim/2 frequencies, those that turn fewer than ``beta_slow`` times over the
    original length divided by ``factor`` (interpolated), those that turn more than ``beta_fast`` times kept, a
    linear ramp between (its ends rounded outwards with ``truncate``, as DeepSeek-V3; not for gpt-oss)."""
    freqs = rope_frequencies(dim, theta)
    if factor <= 1:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)
    extrapolate = 1 - ramp.clamp(0, 1)  # 1: keep the original frequency (high-frequency channels)
    return freqs / factor * (1 - extrapolate) + freqs * extrapolate


def rope_table(freqs: torch.Tensor, max_seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every (position, frequency): shape (max_seq_len, len(freqs), 2), float32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs.double())
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, convention: RopeConvention) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if convention == "pairs":
        pairs = xf.unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)
    first, second = xf.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)


class _Rotate(torch.autograd.Function):
    """The gradient of a rotation is the inverse rotation. Stating that directly lets inductor fuse the
    backward like the forward; differentiating the stack instead costs twice the time (compiled on CPU,
    bf16 8x2048x16x16: 4.4 vs 10 ms per call)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, convention: RopeConvention):
        ctx.save_for_backward(cos, sin)
        ctx.convention = convention
        return _rotate(x, cos, sin, convention)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, ctx.convention), None, None, None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, convention: RopeConvention) -> torch.Tensor:
    """Rotate x (..., head_dim) by angles given as their cos and sin (..., head_dim/2), broadcast against x."""
    return _Rotate.apply(x, cos, sin, convention)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, convention: RopeConvention = "pairs",
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (batch, seq, heads, head_dim) by the table ``rope`` at positions 0..seq-1, or at
    ``positions`` (batch, seq) when given (e.g. restarting at each packed document), or at a position per
    frequency, (batch, seq, head_dim/2) (M-RoPE, see the module doc)."""
    if positions is None:
        angles = rope[: x.shape[1], None]  # (seq, 1, head_dim/2, 2), broadcast over batch and heads
    elif positions.dim() == 3:
        frequency = torch.arange(positions.shape[-1], device=positions.device)
        angles = rope[positions, frequency][:, :, None]  # (batch, seq, 1, head_dim/2, 2)
    else:
        angles = rope[positions][:, :, None]  # (batch, seq, 1, head_dim/2, 2)
    return _Rotate.apply(x, angles[..., 0], angles[..., 1], convention)


def mrope_streams(section: tuple[int, ...], n_frequencies: int) -> torch.Tensor:
    """Which position stream (0 temporal, 1 height, 2 width) each of ``n_frequencies`` frequencies reads under
    interleaved M-RoPE with ``section`` (frequencies per stream, e.g. Qwen3-VL's (24, 20, 20))."""
    if len(section) != 3 or sum(section) != n_frequencies:
        raise ValueError(f"mrope_section {tuple(section)} must be three counts summing to the {n_frequencies} "
                         "rotary frequencies")
    streams = torch.zeros(n_frequencies, dtype=torch.long)
    for stream in (1, 2):
        streams[stream:3 * section[stream]:3] = stream
    return streams
