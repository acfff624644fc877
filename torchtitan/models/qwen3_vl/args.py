"""Qwen3-VL hyper-parameters and the named flavors: Qwen3's decoder, a vision tower (models/shared/vision.py)
and multimodal RoPE.

What is Qwen3-VL's own: image tokens (``<|image_pad|>``, one per merged patch, between ``<|vision_start|>`` and
``<|vision_end|>``) whose embeddings are replaced by the tower's output; three RoPE position streams, interleaved by
``mrope_section``; DeepStack (the tower's intermediate features added after the first decoder blocks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.models.qwen3.args import QWEN3_VOCAB, Qwen3ModelArgs
from torchtitan.models.shared.vision import VisionArgs

# Qwen's vocabulary ids of the vision tokens.
QWEN_VISION_START, QWEN_VISION_END, QWEN_IMAGE_PAD = 151652, 151653, 151655
# Their ids in the debug tokenizer with vision tokens (assets/tokenizer_vision: the 2048 text ids of assets/tokenizer
# followed by <|vision_start|>, <|vision_end|>, <|vision_pad|> and <|image_pad|>), which the debug flavors use.
DEBUG_VISION_START, DEBUG_VISION_END, DEBUG_IMAGE_PAD = 2048, 2049, 2051
DEBUG_VISION_TOKENS = {"image_token_id": DEBUG_IMAGE_PAD, "vision_start_token_id": DEBUG_VISION_START,
                       "vision_end_token_id": DEBUG_VISION_END}


@dataclass
class VisionLanguageArgs:
    """The fields that make a decoder's args read images (models/shared/vision_language.py), mixed in before the
    text family's args (``class Qwen3VLModelArgs(VisionLanguageArgs, Qwen3ModelArgs)``)."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    """RoPE frequencies read from the temporal, height and width positions (interleaved; sums to the rotary
    frequencies: head_dim/2, or rotary_dim/2 where only part of each head rotates)."""
    image_token_id: int = QWEN_IMAGE_PAD
    vision_start_token_id: int = QWEN_VISION_START
    vision_end_token_id: int = QWEN_VISION_END

    def __post_init__(self):
        # The tower writes into the decoder's embeddings: its output width is the model's.
        if self.vision.out_dim != self.dim:
            self.vision = dataclasses.replace(self.vision, out_dim=self.dim)

    def check(self) -> list[tuple[str, str]]:
        problems = super().check() + self.vision.check()
        rotary = "rotary_dim" if hasattr(self, "rotary_dim") else "head_dim"
        frequencies = getattr(self, rotary) // 2
        if sum(self.mrope_section) != frequencies or len(self.mrope_section) != 3:
            problems.append(("mrope_section", f"{tuple(self.mrope_section)} must be three counts summing to "
                                              f"{rotary}/2 = {frequencies}"))
        if len(self.vision.deepstack_indexes) > self.n_layers:
            problems.append(("vision.deepstack_indexes", f"{len(self.vision.deepstack_indexes)} features need as "
                                                         f"many decoder blocks; the model has {self.n_layers}"))
        return problems


@dataclass
class Qwen3VLModelArgs(VisionLanguageArgs, Qwen3ModelArgs):
    rope_theta: float = 5_000_000.0


def _published(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool, vision: VisionArgs
               ) -> Qwen3VLModelArgs:
    return Qwen3VLModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                            hidden_dim=hidden_dim, vocab_size=QWEN3_VOCAB, tie_embeddings=tie, vision=vision)


# The two towers of the published sizes (patch 16, merge 2, a 48 x 48 position table).
_SMALL_TOWER = VisionArgs(depth=24, dim=1024, ffn_dim=4096, n_heads=16, deepstack_indexes=(5, 11, 17))
_LARGE_TOWER = VisionArgs(depth=27, dim=1152, ffn_dim=4304, n_heads=16, deepstack_indexes=(8, 16, 24))

qwen3_vl_flavors: dict[str, Qwen3VLModelArgs] = {
    # The debug tower: 2 blocks, 32 x 32 pixel merge blocks (patch 16), DeepStack from both blocks.
    "debugmodel": Qwen3VLModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, mrope_section=(12, 10, 10),
        # The vision tokens of assets/tokenizer_vision: the debug tokenizer's, appended after its 2048 ids.
        vision_start_token_id=2048, vision_end_token_id=2049, image_token_id=2051,
        vision=VisionArgs(depth=2, dim=128, ffn_dim=384, n_heads=4, num_position_embeddings=256,
                          deepstack_indexes=(0, 1))),
    "2B": _published(2048, 28, 16, 6144, tie=True, vision=_SMALL_TOWER),
    "4B": _published(2560, 36, 32, 9728, tie=True, vision=_SMALL_TOWER),
    "8B": _published(4096, 36, 32, 12288, tie=False, vision=_LARGE_TOWER),
    "32B": _published(5120, 64, 64, 25600, tie=False, vision=_LARGE_TOWER),
}
