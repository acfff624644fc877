"""The vision tower of Qwen3-VL and Qwen3.5: images in, embeddings of the language model's width out.

An image arrives as patches (data/images.py): resized so that each side is a multiple of patch_size x
spatial_merge_size, cut into patch_size x patch_size squares, each square repeated temporal_patch_size times (the
tower is shared with video, whose patches span that many frames) and flattened in (channel, time, row, column)
order. The patches of an image come in *merge-block order*: the spatial_merge_size x spatial_merge_size squares
that will be merged into one token are consecutive. ``grid_thw`` (images, 3) gives each image's grid in patches
(time, height, width); an image is 1 x h x w.

The tower, per image (the images of a batch are concatenated and never see each other):

    x = patch_embed(patches) + P                P: the learned (side x side) position table, resampled
                                                   bilinearly (corners aligned) to the image's h x w grid
    x = x + attn(norm1(x)); x = x + mlp(norm2(x))    pre-norm blocks, LayerNorm, full (non-causal) attention
                                                     within the image, 2-D RoPE on q and k
    tokens = merger(x)                          LayerNorm, then each merge block's spatial_merge_size^2 vectors
                                                   concatenated and mapped by a 2-layer GELU MLP to out_dim

2-D RoPE: of each head's head_dim/2 rotation angles, the first half turn with the patch's row and the second with
its column, at frequencies theta^(-4i/head_dim) for i < head_dim/4; the two halves of the head rotate together
("halves" convention).

DeepStack (Qwen3-VL): the outputs of the blocks listed in ``deepstack_indexes`` are merged too, each by its own
merger whose LayerNorm comes after the concatenation, and the language model adds the k-th of them to its hidden
states at the image positions after its k-th block (models/qwen3_vl/model.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.shared.rope import rope_frequencies, rotate


@dataclass
class VisionArgs:
    depth: int = 27
    dim: int = 1152
    ffn_dim: int = 4304
    n_heads: int = 16
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    out_dim: int = 2048
    """The language model's width (set by the family to its dim)."""
    num_position_embeddings: int = 2304
    """Entries of the learned position table, a square grid (48 x 48)."""
    deepstack_indexes: tuple[int, ...] = ()
    """Blocks whose merged outputs are added to the first decoder blocks' outputs (Qwen3-VL: 8, 16, 24)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x time x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        return round(self.num_position_embeddings ** 0.5)

    def check(self) -> list[tuple[str, str]]:
        problems = []
        sizes = {"depth": self.depth, "dim": self.dim, "ffn_dim": self.ffn_dim, "n_heads": self.n_heads,
                 "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                 "spatial_merge_size": self.spatial_merge_size, "out_dim": self.out_dim}
        problems += [(f"vision.{name}", f"{value} must be positive") for name, value in sizes.items() if value <= 0]
        if problems:
            return problems
        if self.dim % self.n_heads or self.head_dim % 4:
            problems.append(("vision.n_heads", f"{self.n_heads} must divide dim={self.dim} into heads whose size is "
                                               "a multiple of 4 (2-D RoPE splits each head's angles in two)"))
        if self.grid_side ** 2 != self.num_position_embeddings:
            problems.append(("vision.num_position_embeddings", f"{self.num_position_embeddings} is not a square"))
        if bad := [i for i in self.deepstack_indexes if not 0 <= i < self.depth]:
            problems.append(("vision.deepstack_indexes", f"{bad} are not blocks (0..{self.depth - 1})"))
        return problems


def merge_block_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """A (h, w, ...) grid's cells in merge-block order: (h * w, ...)."""
    h, w = grid.shape[:2]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:]).transpose(1, 2)
    return blocks.reshape(h * w, *grid.shape[2:])


def image_spans(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each image's patches in the concatenated patch sequence."""
    starts = [0, *itertools.accumulate(grid_thw.prod(-1).tolist())]
    return list(itertools.pairwise(starts))


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.head_dim, self.n_heads = args.head_dim, args.n_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: list[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)  # (patches, heads, head_dim) each
        q, k = rotate(q, cos, sin, "halves"), rotate(k, cos, sin, "halves")
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, patches, head_dim)
        # Each image attends within itself: one kernel call per image, no patches x patches mask.
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])
                         for s, e in spans] or [v], dim=2)  # no image: v is empty, and keeps qkv in the graph
        return self.proj(out[0].transpose(0, 1).reshape(n, self.n_heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.dim, args.ffn_dim)
        self.linear_fc2 = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = VisionAttention(args)
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge_unit consecutive patch vectors -> one out_dim token; ``norm_after_concat``: the LayerNorm sees the
    concatenation (DeepStack's mergers) rather than each patch vector (the main merger)."""

    def __init__(self, args: VisionArgs, norm_after_concat: bool = False):
        super().__init__()
        self.width = args.dim * args.merge_unit
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.width if norm_after_concat else args.dim, eps=args.norm_eps)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.norm_after_concat else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """Patches (N, patch_dim) of the images in ``grid_thw`` -> their tokens (N / merge_unit, out_dim) and the
    DeepStack features (one such tensor per deepstack index)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = nn.Linear(args.patch_dim, args.dim)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.dim)
        self.blocks = nn.ModuleDict({str(i): VisionBlock(args) for i in range(args.depth)})
        self.merger = PatchMerger(args)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(args, norm_after_concat=True)
                                                   for _ in args.deepstack_indexes)
        self.register_buffer("rope_freqs", self._rope_freqs(), persistent=False)

    def _rope_freqs(self, device: torch.device | None = None) -> torch.Tensor:
        # head_dim/4 frequencies shared by rows and columns: theta^(-2i / (head_dim/2)).
        return rope_frequencies(self.args.head_dim // 2, self.args.rope_theta).float().to(device)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grid_thw = grid_thw.cpu()
        expected = int(grid_thw.prod(-1).sum())
        if tuple(patches.shape) != (expected, self.args.patch_dim):
            raise ValueError(f"pixel_values has shape {tuple(patches.shape)}, but the {len(grid_thw)} image grids "
                             f"make ({expected}, {self.args.patch_dim}): patches x channels x time x rows x columns")
        positions, (cos, sin) = self.position_embeddings(grid_thw, patches.device)
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype)) + positions.to(self.patch_embed.weight.dtype)
        spans = image_spans(grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks.values()):
            x = block(x, cos, sin, spans)
            if i in self.args.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.args.deepstack_indexes.index(i)](x))
        return self.merger(x), deepstack

    def position_embeddings(self, grid_thw: torch.Tensor, device: torch.device
                            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The learned positions resampled to each image's grid (patches, dim), and the 2-D RoPE angles' cos and
        sin (patches, 1, head_dim/2), in the patches' merge-block order."""
        merge, side = self.args.spatial_merge_size, self.args.grid_side
        table = self.pos_embed.weight
        # A rank without images still runs the tower on nothing, so that every parameter gets a (zero) gradient
        # and sharded data parallelism reduces the same tensors on every rank.
        learned, angles = [table[:0]], [torch.zeros(0, 2, dtype=torch.long, device=device)]
        for t, h, w in grid_thw.tolist():
            rows, cols = torch.arange(h, device=device), torch.arange(w, device=device)
            # Bilinear resampling with corners aligned: cell r of h sits at r * (side - 1) / (h - 1) of the table.
            (r0, r1, wr), (c0, c1, wc) = (_bilinear_taps(idx, n, side) for idx, n in ((rows, h), (cols, w)))
            grid = (table[r0[:, None] * side + c0] * ((1 - wr)[:, None] * (1 - wc))[..., None]
                    + table[r0[:, None] * side + c1] * ((1 - wr)[:, None] * wc)[..., None]
                    + table[r1[:, None] * side + c0] * (wr[:, None] * (1 - wc))[..., None]
                    + table[r1[:, None] * side + c1] * (wr[:, None] * wc)[..., None])
            learned.append(merge_block_order(grid, merge).repeat(t, 1))
            hw = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1)  # (h, w, 2)
            angles.append(merge_block_order(hw, merge).repeat(t, 1))
        positions = torch.cat(learned)
        hw = torch.cat(angles).float()  # (patches, 2): row, column
        freqs = self.rope_freqs.to(device)
        theta = torch.cat([hw[:, :1] * freqs, hw[:, 1:] * freqs], dim=-1)  # (patches, head_dim/2)
        return positions, (theta.cos()[:, None], theta.sin()[:, None])

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.rope_freqs = self._rope_freqs(buffer_device or self.rope_freqs.device)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For cells 0..size-1 of an axis resampled from ``side`` table cells (corners aligned): the lower and upper
    table cell and the upper one's weight."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    low = src.floor()
    return low.long().clamp(0, side - 1), (low.long() + 1).clamp(0, side - 1), src - low
