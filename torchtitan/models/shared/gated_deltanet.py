"""Gated DeltaNet, the linear-attention layer of hybrid models (Qwen3-Next): a token mixer with a fixed-size state.

Per token x (Yang et al., arXiv 2412.06464; Qwen3-Next's arrangement):

    q, k, v  = SiLU(causal depthwise conv, kernel 4, over in_proj_qkv(x))     (per key head: q, k, then its values)
    q, k     = L2-normalised per head; q scaled by 1/sqrt(key head size)
    beta     = sigmoid(in_proj_b(x));   g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)     (per value head)
    o        = the gated delta rule over q, k, v, g, beta (models/shared/gated_delta_rule.py)
    out      = wo(RMSNorm(o) * SiLU(in_proj_z(x)))                              (the norm's weight shared by heads)

There are fewer key heads than value heads (16 and 32 released): each key head serves n_value / n_key consecutive
value heads. in_proj_qkv's output channels, and the conv's, are grouped by key head, so that a slice of whole key
heads (tensor parallelism) is a contiguous slice of both.

A packed row's documents stay apart: a document's first token starts from a zero state and its conv window does
not reach into the previous document. The conv and the recurrence are attributes (``conv_fn``, ``recurrence_fn``)
that context parallelism replaces with versions that take the history from the other ranks.
"""

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.log import logger
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.gated_delta_rule import gated_delta_rule
from torchtitan.models.shared.seeded_init import FillFn


def _local(t: torch.Tensor) -> torch.Tensor:
    # Tensor parallelism shards the per-head parameters; each rank computes with its own heads.
    return t.to_local() if isinstance(t, DTensor) else t


def document_resets(ids: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: True where a token's document differs from the previous token's (never at position 0)."""
    return F.pad(ids[:, 1:] != ids[:, :-1], (1, 0))


def causal_short_conv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor | None = None,
                      history: torch.Tensor | None = None, history_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution of x (B, L, C) with weight (C, K): out_t = sum_i weight[:, K-1-i] x_{t-i}, the
    taps reaching before the row reading ``history`` (B, K-1, C; None: zeros). With document ``ids`` (B, L; and
    ``history_ids``, B, K-1) a tap reads only tokens of the same document."""
    kernel = weight.shape[-1]
    if history is None:
        history = x.new_zeros(x.shape[0], kernel - 1, x.shape[-1])
        history_ids = None if ids is None else ids.new_full((ids.shape[0], kernel - 1), -1)
    padded = torch.cat([history.to(x.dtype), x], dim=1)
    padded_ids = None if ids is None else torch.cat([history_ids, ids], dim=1)
    length = x.shape[1]
    out = x * weight[:, -1]
    for back in range(1, kernel):
        tap = padded[:, kernel - 1 - back: kernel - 1 - back + length]
        if ids is not None:
            tap = tap * (padded_ids[:, kernel - 1 - back: kernel - 1 - back + length] == ids).unsqueeze(-1)
        out = out + tap * weight[:, kernel - 1 - back]
    return out


def local_conv(x: torch.Tensor, weight: torch.Tensor, documents: DocumentMask | None) -> torch.Tensor:
    """The conv of a whole (unsharded) sequence."""
    return causal_short_conv(x, weight, None if documents is None else documents.ids)


_fla_kernels: dict[str, object] = {}
_logged_kernel: set[str] = set()


def _fla_kernel(per_channel: bool = False):
    """flash-linear-attention's chunked Triton kernel, if installed (the ``fla`` extra), else None:
    chunk_gated_delta_rule for one decay per head, chunk_kda (Kimi Delta Attention) for one per key channel. Both
    take the same call (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)."""
    module, name = ("fla.ops.kda", "chunk_kda") if per_channel else ("fla.ops.gated_delta_rule",
                                                                     "chunk_gated_delta_rule")
    if name not in _fla_kernels:
        try:
            _fla_kernels[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # not installed, or a release without KDA
            _fla_kernels[name] = None
    return _fla_kernels[name]


@torch.compiler.disable
def _log_kernel_once(name: str) -> None:
    _logged_kernel.add(name)
    kernel = {"fla": "flash-linear-attention's Triton kernel (fla-core)",
              "fla_kda": "flash-linear-attention's Triton kernel chunk_kda (fla-core), a decay per key channel",
              "torch": "the chunked PyTorch form (models/shared/gated_delta_rule.py)"}[name]
    logger.info(f"gated delta rule: {kernel}")


@torch.compiler.disable
def _fla_gated_delta_rule(fla, q, k, v, g, beta, resets, initial_state=None):
    """The same contract as gated_delta_rule through fla's varlen mode: every document of every row is one
    sequence of a single packed row (cu_seqlens); the incoming state feeds each row's first document unless that
    document starts at the row's first token."""
    bsz, length = q.shape[:2]
    starts = torch.zeros(bsz, length, dtype=torch.bool, device=q.device) if resets is None else resets.clone()
    starts[:, 0] = True
    flat = starts.flatten().nonzero().flatten()
    rows, first_of_row = flat // length, flat % length == 0
    cu_seqlens = torch.cat([flat, flat.new_tensor([bsz * length])])
    state0 = None
    if initial_state is not None:
        carried = first_of_row if resets is None else first_of_row & ~resets[rows, 0]
        state0 = initial_state.new_zeros(len(flat), *initial_state.shape[1:]).float()
        state0[carried] = initial_state[rows[carried]].float()
    packed = [t.flatten(0, 1).unsqueeze(0) for t in (q.to(v.dtype), k.to(v.dtype), v, g, beta)]
    out, final = fla(*packed, scale=1.0, initial_state=state0, output_final_state=True, cu_seqlens=cu_seqlens)
    last_of_row = torch.cat([first_of_row[1:], first_of_row.new_ones(1)])
    return out.view(bsz, length, *out.shape[2:]), final[last_of_row]


def recurrence_kernel(device: torch.device):
    """The gated delta rule's kernel for ``device`` (gated_delta_rule's signature, resets included, g per head or
    per key channel): on CUDA where flash-linear-attention is installed, its Triton kernels, picked per call by g's
    shape; else the chunked PyTorch form. Logs each choice once."""
    if device.type == "cuda" and (_fla_kernel() or _fla_kernel(per_channel=True)):
        return _fla_by_decay
    if "torch" not in _logged_kernel:
        _log_kernel_once("torch")
    return gated_delta_rule


@torch.compiler.disable
def _fla_by_decay(q, k, v, g, beta, resets, initial_state=None):
    """fla's chunk_gated_delta_rule for g (B, L, H), its chunk_kda for g (B, L, H, K); the chunked PyTorch form
    where the installed release lacks the one needed."""
    per_channel = g.dim() == 4
    fla = _fla_kernel(per_channel)
    name = "torch" if fla is None else "fla_kda" if per_channel else "fla"
    if name not in _logged_kernel:
        _log_kernel_once(name)
    if fla is None:
        return gated_delta_rule(q, k, v, g, beta, resets, initial_state)
    return _fla_gated_delta_rule(fla, q, k, v, g, beta, resets, initial_state)


def local_recurrence(q, k, v, g, beta, documents: DocumentMask | None):
    """The gated delta rule over a whole (unsharded) sequence, from a zero state; g per head (B, L, H) or per key
    channel (B, L, H, K)."""
    resets = None if documents is None else document_resets(documents.ids)
    return recurrence_kernel(q.device)(q, k, v, g, beta, resets)


class ShortConv(nn.Module):
    """The depthwise causal conv's weights, (channels, kernel); the layer's conv_fn applies them."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))


class DecayGate(nn.Module):
    """g = -exp(A_log) * softplus(a + dt_bias) per value head: the log of the state's decay per token (<= 0)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        # At least float32: in bfloat16 exp(A_log) * softplus(.) loses the small decays that keep long memory.
        work = torch.promote_types(a.dtype, torch.float32)
        return -_local(self.A_log).to(work).exp() * F.softplus(a.to(work) + _local(self.dt_bias).to(work))


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, n_key_heads: int, n_value_heads: int, key_head_dim: int, value_head_dim: int,
                 conv_kernel: int, norm_eps: float):
        super().__init__()
        if n_value_heads % n_key_heads:
            raise ValueError(f"n_value_heads {n_value_heads} must be a multiple of n_key_heads {n_key_heads}")
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.values_per_key = n_value_heads // n_key_heads
        group = 2 * key_head_dim + self.values_per_key * value_head_dim  # one key head's q, k and values
        self.in_proj_qkv = nn.Linear(dim, n_key_heads * group, bias=False)
        self.in_proj_b = nn.Linear(dim, n_value_heads, bias=False)
        self.conv = ShortConv(n_key_heads * group, conv_kernel)
        self._build_gates(dim, n_value_heads, value_head_dim)
        self.norm = nn.RMSNorm(value_head_dim, eps=norm_eps)
        self.wo = nn.Linear(n_value_heads * value_head_dim, dim, bias=False)
        self.conv_fn = local_conv
        self.recurrence_fn = local_recurrence

    def _build_gates(self, dim: int, n_value_heads: int, value_head_dim: int) -> None:
        """The decay's and the output gate's projections (a variant, e.g. Kimi Delta Attention, has its own)."""
        self.in_proj_z = nn.Linear(dim, n_value_heads * value_head_dim, bias=False)
        self.in_proj_a = nn.Linear(dim, n_value_heads, bias=False)
        self.decay = DecayGate(n_value_heads)

    def decay_of(self, x: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """g, the log of the state's decay per token: (B, L, value heads)."""
        return self.decay(self.in_proj_a(x).to(work))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """What the normed output is multiplied by: (B, L, value heads, value head size)."""
        return F.silu(self.in_proj_z(x).view(*x.shape[:2], -1, self.value_head_dim))

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Same call as the attention layers; ``rope`` and ``positions`` are unused (the conv and the recurrence
        carry order)."""
        bsz, seqlen, _ = x.shape
        dk, dv = self.key_head_dim, self.value_head_dim
        mixed = F.silu(self.conv_fn(self.in_proj_qkv(x), _local(self.conv.weight), documents))
        # -1 rather than the head counts: under tensor parallelism each rank holds a subset of the heads.
        mixed = mixed.view(bsz, seqlen, -1, 2 * dk + self.values_per_key * dv)
        q, k, v = mixed.split([dk, dk, self.values_per_key * dv], dim=-1)
        v = v.reshape(bsz, seqlen, -1, dv)
        work = torch.promote_types(x.dtype, torch.float32)  # the normalisation and the gates in float32 at least
        q, k = (t.to(work) * torch.rsqrt(t.to(work).pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        q = q * dk**-0.5
        q, k = (t.repeat_interleave(self.values_per_key, dim=2) for t in (q, k))
        beta = torch.sigmoid(self.in_proj_b(x).to(work))
        o, _ = self.recurrence_fn(q, k, v, self.decay_of(x, work), beta, documents)
        o = self.norm(o.to(x.dtype)) * self.output_gate(x)
        return self.wo(o.reshape(bsz, seqlen, -1))


def gated_deltanet_fill(name: str) -> FillFn | None:
    """The init of a GatedDeltaNet parameter that differs from a Linear's (None: not one of them).

    Decay rates and step sizes spread over orders of magnitude, as in Mamba-2 and Gated DeltaNet: A uniform in
    [1, 16], dt log-uniform in [0.001, 0.1] through softplus (dt_bias = softplus^-1(dt)); the conv as PyTorch
    initialises a depthwise conv (uniform within 1/sqrt(kernel))."""
    if name.endswith("decay.A_log"):
        return lambda t, gen: t.copy_(torch.empty_like(t).uniform_(1.0, 16.0, generator=gen).log())
    if name.endswith("decay.dt_bias"):
        def fill_dt(t: torch.Tensor, gen: torch.Generator) -> None:
            dt = torch.exp(torch.empty_like(t).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
            t.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        return fill_dt
    if name.endswith("conv.weight"):
        return lambda t, gen: t.uniform_(-t.shape[-1] ** -0.5, t.shape[-1] ** -0.5, generator=gen)
    return None
