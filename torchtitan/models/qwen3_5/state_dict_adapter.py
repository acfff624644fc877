"""Qwen3.5 weights to and from transformers' Qwen3_5ForConditionalGeneration (dense flavors) and
Qwen3_5MoeForConditionalGeneration (MoE flavors) naming: the family's adapter is the one matching the flavor.

The text model is Qwen3-Next's (models/qwen3_next/state_dict_adapter.py) under ``model.language_model.``, with one
difference: a Gated DeltaNet layer's four input projections are stored apart (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a), not fused per key head; in_proj_qkv's rows, like the conv's channels, are ordered [all q | all k |
all values] where ours are grouped per key head, and are regrouped exactly both ways. The tower and the nested
config.json are Qwen3-VL's (VisionLanguageAdapter), without DeepStack; the M-RoPE sections sit in the text config's
rope_parameters beside the rotary share.

From a config.json: any widths, rotary share, linear-attention sizes, tower sizes and expert counts; refused, by
key, what the family cannot compute (another activation, irregular layer types, a tower whose output is not the
decoder's width, DeepStack on export).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from torchtitan.models.qwen3_5.args import (
    QWEN3_5_IMAGE_PAD,
    QWEN3_5_VIDEO_PAD,
    QWEN3_5_VISION_END,
    QWEN3_5_VISION_START,
    QWEN3_5_VOCAB,
    Qwen3_5ModelArgs,
)
from torchtitan.models.qwen3_next.state_dict_adapter import Qwen3NextStateDictAdapter, _layer_types
from torchtitan.models.qwen3_vl.state_dict_adapter import DEEPSTACK, VISION_DEFAULTS, VisionLanguageAdapter
from torchtitan.models.shared.hf_config import Default
from torchtitan.models.shared.moe import MoEArgs

QKV = "attention.in_proj_qkv.weight"
# transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults on the keys both have (Qwen3NextConfig's, but the
# vocabulary); layer_types, when not given, from full_attention_interval (default 4).
_TEXT_DEFAULTS: dict[str, Default] = {
    "vocab_size": QWEN3_5_VOCAB, "num_attention_heads": 16, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "partial_rotary_factor": 0.25,
    "layer_types": lambda c: _layer_types(c.get("full_attention_interval", 4), c["num_hidden_layers"]),
}


class Qwen3_5StateDictAdapter(VisionLanguageAdapter, Qwen3NextStateDictAdapter):
    family = "Qwen3.5"
    hf_architecture = "Qwen3_5ForConditionalGeneration"
    hf_model_type = "qwen3_5"
    text_model_type = "qwen3_5_text"
    vision_model_type = "qwen3_5_vision"
    vision_defaults: ClassVar[dict] = {key: value for key, value in VISION_DEFAULTS.items() if key != DEEPSTACK}
    default_mrope_section: ClassVar[list[int]] = [11, 11, 10]
    default_token_ids: ClassVar[dict[str, int]] = {
        "image_token_id": QWEN3_5_IMAGE_PAD, "video_token_id": QWEN3_5_VIDEO_PAD,
        "vision_start_token_id": QWEN3_5_VISION_START, "vision_end_token_id": QWEN3_5_VISION_END}
    args_class = Qwen3_5ModelArgs
    extra_layer_names: ClassVar[dict[str, str]] = {
        **Qwen3NextStateDictAdapter.extra_layer_names,
        **{f"attention.{name}.weight": f"linear_attn.{name}.weight"
           for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
    }
    fused_ours = ()
    hf_defaults: ClassVar[dict[str, Default]] = {**_TEXT_DEFAULTS, "hidden_size": 4096, "intermediate_size": 12288,
                                                 "num_hidden_layers": 32, "num_key_value_heads": 4}
    args: Qwen3_5ModelArgs

    def __new__(cls, args: Qwen3_5ModelArgs):
        # One family, two transformers architectures: the flavor's feed-forward picks the format.
        chosen = cls
        if cls in (Qwen3_5StateDictAdapter, Qwen3_5MoeStateDictAdapter):
            chosen = Qwen3_5StateDictAdapter if args.moe is None else Qwen3_5MoeStateDictAdapter
        return super().__new__(chosen)

    @classmethod
    def args_from_hf_config(cls, config: dict) -> Qwen3_5ModelArgs:
        if cls is Qwen3_5StateDictAdapter and config.get("model_type") == Qwen3_5MoeStateDictAdapter.hf_model_type:
            return Qwen3_5MoeStateDictAdapter.args_from_hf_config(config)
        return super().args_from_hf_config(config)

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(QKV):
            return self.to_streams(tensor)
        return super().tensor_to_hf(name, tensor)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(QKV):
            return self.from_streams(tensor)
        return super().tensor_from_hf(name, tensor)

    @classmethod
    def _moe_from_hf_view(cls, view: dict) -> tuple[MoEArgs | None, int]:
        return None, 0  # transformers' dense Qwen3.5 has no MoE keys (it ignores any a file holds)

    def _moe_hf_config(self) -> dict:
        moe = self.args.moe
        if moe is None:
            return {}
        # Qwen3-Next's MoE (its checks included), except that every block is MoE and the router always renormalises
        # the top k: Qwen3_5MoeTextConfig has no decoder_sparse_step, mlp_only_layers or norm_topk_prob.
        for name, value, want in (("moe.route_norm", moe.route_norm, True),
                                  ("n_dense_layers", self.args.n_dense_layers, 0)):
            if value != want:
                raise ValueError(f"{self.hf_architecture} cannot express {name} = {value!r} (it needs {want!r})")
        keys = super()._moe_hf_config()
        for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            keys.pop(key)
        return keys


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter):
    family = "Qwen3.5-MoE"
    hf_architecture = "Qwen3_5MoeForConditionalGeneration"
    hf_model_type = "qwen3_5_moe"
    text_model_type = "qwen3_5_moe_text"
    vision_model_type = "qwen3_5_moe_vision"
    hf_defaults: ClassVar[dict[str, Default]] = {
        **_TEXT_DEFAULTS, "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
        "num_experts": 256}

    @classmethod
    def _moe_from_hf_view(cls, view: dict) -> tuple[MoEArgs | None, int]:
        return MoEArgs(num_experts=view["num_experts"], top_k=view["num_experts_per_tok"],
                       hidden_dim=view["moe_intermediate_size"], score_func="softmax", route_norm=True,
                       shared_hidden_dim=view["shared_expert_intermediate_size"], shared_gate=True), 0

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        config = super().hf_config(tokenizer_bos, tokenizer_eos, dtype)
        config["text_config"].pop("intermediate_size")  # no dense feed-forward: transformers has no such key
        return config
