"""Qwen3-VL: Qwen3's decoder reading images through the shared vision tower, with DeepStack
(models/shared/vision_language.py has the seam and the batch format)."""

from __future__ import annotations

from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.vision_language import VisionLanguageDecoder


class Qwen3VL(VisionLanguageDecoder, Decoder):
    pass
