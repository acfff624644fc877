"""Qwen3.5: Qwen3-Next's hybrid decoder reading images through the shared vision tower, with M-RoPE over the
attention's rotary part and no DeepStack (models/shared/vision_language.py has the seam and the batch format)."""

from __future__ import annotations

from torchtitan.models.qwen3_next.model import Qwen3NextModel
from torchtitan.models.shared.vision_language import VisionLanguageDecoder


class Qwen3_5(VisionLanguageDecoder, Qwen3NextModel):
    pass
