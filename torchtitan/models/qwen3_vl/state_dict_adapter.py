"""Qwen3-VL weights to and from transformers' Qwen3VLForConditionalGeneration naming, through the mixin that
Qwen3.5 shares (VisionLanguageAdapter).

The language model is Qwen3's under ``model.language_model.`` (the output stays ``lm_head``); the vision tower's
names are transformers' under ``model.visual.``, except the patch embedding: a Conv3d there, whose kernel equals
its stride and covers the whole patch, so its (dim, channels, time, rows, columns) weight is our Linear's
(dim, patch_dim) reshaped.

config.json nests a ``text_config`` (Qwen3's keys; the three position streams in ``rope_parameters.mrope_section``)
and a ``vision_config``; the view that compares two of them (models/shared/hf_config.py) reads the text keys as
Qwen3's and each vision key as ``vision_config.<key>``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3_vl.args import (
    QWEN_IMAGE_PAD,
    QWEN_VISION_END,
    QWEN_VISION_START,
    Qwen3VLModelArgs,
)
from torchtitan.models.shared.decoder_state_dict_adapter import UnexpectedWeightError
from torchtitan.models.shared.vision import VisionArgs

TEXT, VISUAL = "model.language_model.", "model.visual."
# transformers' Qwen3VLVisionConfig defaults, and the keys that change the computation.
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
                   "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
                   "deepstack_visual_indexes": [8, 16, 24]}
DEEPSTACK = "deepstack_visual_indexes"
QWEN_VIDEO_PAD = 151656


class VisionLanguageAdapter:
    """Mix in before a text family's adapter (``class Qwen3VLStateDictAdapter(VisionLanguageAdapter,
    Qwen3StateDictAdapter)``): the text family's names under ``model.language_model.``, the tower's under
    ``model.visual.``, and config.json nested (``text_config``, ``vision_config``, the vision token ids at the top).
    The family sets the class variables below."""

    text_model_type: ClassVar[str]
    vision_model_type: ClassVar[str]
    vision_defaults: ClassVar[dict]
    """transformers' defaults of the vision config's keys that change the computation (DeepStack only where the
    format has it)."""
    default_mrope_section: ClassVar[list[int]]
    default_token_ids: ClassVar[dict[str, int]]
    """transformers' image_token_id, vision_start_token_id, vision_end_token_id and video_token_id."""
    args_class: ClassVar[type]

    def hf_name(self, name: str) -> str:
        if name.startswith("visual."):
            return "model." + name.replace("visual.patch_embed.", "visual.patch_embed.proj.")
        hf = super().hf_name(name)
        return hf if hf == "lm_head.weight" else TEXT + hf.removeprefix("model.")

    def our_name(self, name: str) -> str:
        if name.startswith(VISUAL):
            return name.removeprefix("model.").replace("patch_embed.proj.", "patch_embed.")
        if name.startswith(TEXT):
            try:
                return super().our_name("model." + name.removeprefix(TEXT))
            except UnexpectedWeightError:
                raise UnexpectedWeightError(name, self.family) from None  # the name as the file has it
        if name == "lm_head.weight":
            return super().our_name(name)
        raise UnexpectedWeightError(name, self.family)

    # The shared adapter names the experts of a MoE block itself (not through hf_name), under model.layers.: they
    # move under the language model on the way out and back on the way in.
    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {TEXT + name.removeprefix("model.") if name.startswith("model.layers.") else name: tensor
                for name, tensor in super().to_hf(state).items()}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().from_hf({"model." + name.removeprefix(TEXT) if _is_expert(name) else name: tensor
                                for name, tensor in state.items()})

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "visual.patch_embed.weight":
            v = self.args.vision
            return tensor.reshape(v.dim, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        return super().tensor_to_hf(name, tensor)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "visual.patch_embed.weight":
            return tensor.reshape(tensor.shape[0], -1)
        return super().tensor_from_hf(name, tensor)

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        a, v = self.args, self.args.vision
        text = super().hf_config(tokenizer_bos, tokenizer_eos, dtype)
        rope = {"rope_type": "default", "rope_theta": a.rope_theta, **(text.pop("rope_parameters", None) or {}),
                "mrope_section": list(a.mrope_section), "mrope_interleaved": True}
        for key in ("architectures", "rope_theta", "rope_scaling"):
            text.pop(key, None)
        text.update(model_type=self.text_model_type, rope_parameters=rope)
        vision = {"model_type": self.vision_model_type, "depth": v.depth, "hidden_size": v.dim,
                  "hidden_act": "gelu_pytorch_tanh", "intermediate_size": v.ffn_dim, "num_heads": v.n_heads,
                  "in_channels": v.in_channels, "patch_size": v.patch_size, "spatial_merge_size": v.spatial_merge_size,
                  "temporal_patch_size": v.temporal_patch_size, "out_hidden_size": v.out_dim,
                  "num_position_embeddings": v.num_position_embeddings}
        if DEEPSTACK in self.vision_defaults:
            vision[DEEPSTACK] = list(v.deepstack_indexes)
        elif v.deepstack_indexes:
            raise ValueError(f"{self.hf_architecture} has no DeepStack; vision.deepstack_indexes = "
                             f"{v.deepstack_indexes} cannot be exported (it needs ())")
        return {"architectures": [self.hf_architecture], "model_type": self.hf_model_type, "text_config": text,
                "vision_config": vision, **self.default_token_ids, "image_token_id": a.image_token_id,
                "vision_start_token_id": a.vision_start_token_id, "vision_end_token_id": a.vision_end_token_id,
                "tie_word_embeddings": a.tie_embeddings, "torch_dtype": dtype}

    @classmethod
    def hf_view(cls, config: dict) -> dict:
        text = {k: v for k, v in (config.get("text_config") or {}).items() if k != "model_type"}
        text["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        view = super().hf_view(text)
        view["mrope_section"] = list(rope.get("mrope_section", cls.default_mrope_section))
        vision = {**cls.vision_defaults, **(config.get("vision_config") or {})}
        view.update({f"vision_config.{key}": vision[key] for key in cls.vision_defaults})
        view.update({key: config.get(key, default) for key, default in cls.default_token_ids.items()
                     if key != "video_token_id"})
        return view

    @classmethod
    def _args_from_hf_view(cls, view: dict):
        """The text family's args (its own _args_from_hf_view) with the tower, the M-RoPE sections and the vision
        token ids."""
        text = super()._args_from_hf_view(view)
        vision = VisionArgs(
            depth=view["vision_config.depth"], dim=view["vision_config.hidden_size"],
            ffn_dim=view["vision_config.intermediate_size"], n_heads=view["vision_config.num_heads"],
            patch_size=view["vision_config.patch_size"], temporal_patch_size=view["vision_config.temporal_patch_size"],
            spatial_merge_size=view["vision_config.spatial_merge_size"], in_channels=view["vision_config.in_channels"],
            out_dim=view["vision_config.out_hidden_size"],
            num_position_embeddings=view["vision_config.num_position_embeddings"],
            deepstack_indexes=tuple(view.get(f"vision_config.{DEEPSTACK}", ())))
        return cls.args_class(**{f.name: getattr(text, f.name) for f in dataclasses.fields(text)}, vision=vision,
                              mrope_section=tuple(view["mrope_section"]), image_token_id=view["image_token_id"],
                              vision_start_token_id=view["vision_start_token_id"],
                              vision_end_token_id=view["vision_end_token_id"])


def _is_expert(name: str) -> bool:
    return name.startswith(TEXT + "layers.") and ".mlp.experts." in name


class Qwen3VLStateDictAdapter(VisionLanguageAdapter, Qwen3StateDictAdapter):
    family = "Qwen3-VL"
    hf_architecture = "Qwen3VLForConditionalGeneration"
    hf_model_type = "qwen3_vl"
    hf_default_theta: ClassVar[float] = 500_000.0  # Qwen3VLTextConfig's
    text_model_type = "qwen3_vl_text"
    vision_model_type = "qwen3_vl_vision"
    vision_defaults: ClassVar[dict] = VISION_DEFAULTS
    default_mrope_section: ClassVar[list[int]] = [24, 20, 20]
    default_token_ids: ClassVar[dict[str, int]] = {
        "image_token_id": QWEN_IMAGE_PAD, "video_token_id": QWEN_VIDEO_PAD, "vision_start_token_id": QWEN_VISION_START,
        "vision_end_token_id": QWEN_VISION_END}
    args_class = Qwen3VLModelArgs
    args: Qwen3VLModelArgs
