"""DeepSeek-V3 weights to and from Hugging Face transformers' DeepseekV3ForCausalLM naming.

MLA's projections keep their layout: the released checkpoints store the rotary channels interleaved in pairs,
as our "pairs" RoPE rotates them (config rope_interleave = true), so nothing is permuted. The router is
``mlp.gate`` with its routing bias ``mlp.gate.e_score_correction_bias``; shared experts are
``mlp.shared_experts``; the stacked experts split into per-expert projections (the shared adapter does that).

Multi-token prediction blocks are model.layers.{n_layers + k}.* as DeepSeek-V3 releases them: a decoder layer's
tensors plus enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding (embed_tokens) and output head
(shared_head.head), which our blocks share with the main model. transformers does not run them. Exports leave them
out unless ``include_mtp`` (checkpoint.hf_include_mtp); imports read those the model has and skip the others.

From a config.json (models/shared/hf_config.py): any widths, MLA ranks, expert counts and groups, dense blocks first,
YaRN; built without multi-token prediction blocks (model.mtp_depth adds them: transformers' own saves write
num_nextn_predict_layers without the weights, so it is not read); refused: rotary channels in halves
(rope_interleave false), no shared experts, another RoPE scaling type.
"""

import math
import re
from typing import ClassVar

import torch

from torchtitan.models.deepseek_v3.args import DeepseekV3ModelArgs
from torchtitan.models.shared.decoder_state_dict_adapter import DecoderStateDictAdapter
from torchtitan.models.shared.hf_config import Default, derived, heads
from torchtitan.models.shared.moe import MoEArgs

_OUR_LAYER = re.compile(r"^layers\.(\d+)\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# An MTP layer's copies of the shared embedding and output head.
_MTP_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")


def _layer_of(name: str, pattern: re.Pattern) -> int | None:
    match = pattern.match(name)
    return int(match.group(1)) if match else None


class DeepseekV3StateDictAdapter(DecoderStateDictAdapter):
    family = "DeepSeek-V3"
    hf_architecture = "DeepseekV3ForCausalLM"
    hf_model_type = "deepseek_v3"
    hf_has_expert_bias = True
    extra_layer_names: ClassVar[dict[str, str]] = {
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight",
    }
    # transformers' DeepseekV3Config.
    hf_defaults: ClassVar[dict[str, Default]] = {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
        "num_key_value_heads": derived("num_key_value_heads", heads, absent=128),
    }
    hf_aliases: ClassVar[dict[str, str]] = {"num_local_experts": "n_routed_experts"}
    hf_ignored: ClassVar[frozenset[str]] = frozenset({"head_dim"})  # transformers sets it to qk_rope_head_dim
    args: DeepseekV3ModelArgs

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> DeepseekV3ModelArgs:
        rope = {"rope_factor": 1.0}
        if view["rope_type"] == "yarn":
            factor, scale = float(view["rope_parameters.factor"]), float(view["rope_parameters.attention_factor"])
            all_dim = float(view["rope_parameters.mscale_all_dim"])
            # The mscale that gives config.json's cos/sin factor with its mscale_all_dim (released: 1 and 1).
            mscale = (scale * (0.1 * all_dim * math.log(factor) + 1) - 1) / (0.1 * math.log(factor)) \
                if all_dim and factor > 1 else 1.0
            mscale = 1.0 if math.isclose(mscale, 1.0) else mscale
            rope = {"rope_factor": factor, "mscale": mscale, "mscale_all_dim": all_dim,
                    "original_seq_len": view["rope_parameters.original_max_position_embeddings"],
                    "beta_fast": float(view["rope_parameters.beta_fast"]),
                    "beta_slow": float(view["rope_parameters.beta_slow"])}
        return DeepseekV3ModelArgs(**{**cls._decoder_fields(view), **cls._latent_attention_and_moe(view)},
                                   mtp_depth=0, **rope)

    @staticmethod
    def _latent_attention_and_moe(view: dict) -> dict:
        """The MLA sizes, the dense width and DeepSeek-V3's MoE from config.json (shared with Kimi Linear)."""
        experts = view["moe_intermediate_size"]
        moe = MoEArgs(num_experts=view["n_routed_experts"], top_k=view["num_experts_per_tok"], hidden_dim=experts,
                      score_func="sigmoid", route_norm=bool(view["norm_topk_prob"]),
                      route_scale=float(view["routed_scaling_factor"]), n_groups=view["n_group"] or 1,
                      topk_group=view["topk_group"] or 1, shared_hidden_dim=view["n_shared_experts"] * experts)
        # MLA: as many key/value heads as query heads.
        return dict(n_kv_heads=None, inter_dim=view["intermediate_size"], q_lora_rank=view["q_lora_rank"] or 0,
                    kv_lora_rank=view["kv_lora_rank"], qk_nope_head_dim=view["qk_nope_head_dim"],
                    qk_rope_head_dim=view["qk_rope_head_dim"], v_head_dim=view["v_head_dim"],
                    n_dense_layers=view["first_k_dense_replace"], moe=moe)

    def __init__(self, args: DeepseekV3ModelArgs):
        super().__init__(args)
        self.include_mtp = False  # set by the exporter from checkpoint.hf_include_mtp

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = self.args.n_layers
        mtp_layers = sorted({layer for name in state if (layer := _layer_of(name, _OUR_LAYER)) is not None
                             and layer >= n})
        if not self.include_mtp:
            state = {name: t for name, t in state.items() if (_layer_of(name, _OUR_LAYER) or 0) < n}
        out = super().to_hf(state)
        if self.include_mtp:
            for layer in mtp_layers:
                # Copies: the released files store them per MTP layer (and safetensors refuses shared storage).
                out[f"model.layers.{layer}.embed_tokens.weight"] = state["tok_embeddings.weight"].clone()
                out[f"model.layers.{layer}.shared_head.head.weight"] = state["output.weight"].clone()
        return out

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        wanted = self.args.n_layers + self.args.mtp_depth
        skipped = {name for name in state if (layer := _layer_of(name, _HF_LAYER)) is not None and
                   (layer >= wanted or name.endswith(_MTP_COPIES) and layer >= self.args.n_layers)}
        return super().from_hf({name: t for name, t in state.items() if name not in skipped})

    def _rope_heads(self, name: str) -> int | None:
        return None  # interleaved on both sides

    def extra_hf_config(self) -> dict:
        a, moe = self.args, self.args.moe
        if moe is None or moe.score_func != "sigmoid" or not moe.shared_hidden_dim:
            raise ValueError(f"{self.hf_architecture} routes with sigmoid scores and has shared experts; this "
                             "flavor's MoE differs")
        if moe.shared_hidden_dim % moe.hidden_dim:
            raise ValueError(f"{self.hf_architecture} sizes shared experts in whole experts: moe.shared_hidden_dim "
                             f"{moe.shared_hidden_dim} is not a multiple of moe.hidden_dim {moe.hidden_dim}")
        config = {
            "head_dim": a.qk_rope_head_dim,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "rope_interleave": True,
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": moe.shared_hidden_dim // moe.hidden_dim,
            "moe_intermediate_size": moe.hidden_dim,
            "num_experts_per_tok": moe.top_k,
            "n_group": moe.n_groups,
            "topk_group": moe.topk_group,
            "routed_scaling_factor": moe.route_scale,
            "norm_topk_prob": moe.route_norm,
            "first_k_dense_replace": a.n_dense_layers,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "num_nextn_predict_layers": a.mtp_depth if self.include_mtp else 0,
        }
        if a.rope_factor > 1:
            config["rope_scaling"] = {
                "type": "yarn", "rope_type": "yarn", "factor": a.rope_factor,
                "original_max_position_embeddings": a.original_seq_len, "beta_fast": a.beta_fast,
                "beta_slow": a.beta_slow, "mscale": a.mscale, "mscale_all_dim": a.mscale_all_dim,
            }
        return config
