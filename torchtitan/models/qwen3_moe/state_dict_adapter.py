"""Qwen3-MoE weights to and from Hugging Face transformers' Qwen3MoeForCausalLM naming.

Attention maps as Qwen3's; the router is ``mlp.gate``; the stacked experts split into per-expert projections
(the shared adapter does that). The format has no routing bias and no shared experts.

From a config.json (models/shared/hf_config.py): any widths and expert counts, dense blocks first (mlp_only_layers
0..k-1); refused: dense blocks elsewhere or every few blocks (decoder_sparse_step), a sliding window, attention
biases, another activation, RoPE scaling.
"""

from typing import ClassVar

from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs
from torchtitan.models.shared.hf_config import Default, derived, head_dim
from torchtitan.models.shared.moe import MoEArgs


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    family = "Qwen3-MoE"
    hf_architecture = "Qwen3MoeForCausalLM"
    hf_model_type = "qwen3_moe"
    extra_layer_names: ClassVar[dict[str, str]] = {
        **Qwen3StateDictAdapter.extra_layer_names,
        "moe.router.gate.weight": "mlp.gate.weight",
    }
    # transformers' Qwen3MoeConfig (it has no head_dim of its own: the attention takes hidden_size / heads).
    hf_defaults: ClassVar[dict[str, Default]] = {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": [], "head_dim": derived("head_dim", head_dim),
    }
    hf_aliases: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}  # transformers 5 writes that name
    args: Qwen3MoeModelArgs

    def extra_hf_config(self) -> dict:
        a, moe = self.args, self.args.moe
        # Qwen3MoeForCausalLM routes by renormalisable softmax top-k only; refuse what it would compute otherwise.
        unsupported = {"score_func": (moe.score_func, "softmax"), "route_scale": (moe.route_scale, 1.0),
                       "n_groups": (moe.n_groups, 1), "shared_hidden_dim": (moe.shared_hidden_dim, 0)}
        for name, (value, needed) in unsupported.items():
            if value != needed:
                raise ValueError(f"{self.hf_architecture} cannot express moe.{name} = {value!r} (it needs {needed!r})")
        return {
            **super().extra_hf_config(),
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.hidden_dim,
            "norm_topk_prob": moe.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(a.n_dense_layers)),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
        }

    @classmethod
    def _hf_view_of_family(cls, view: dict) -> dict:
        # One window for every layer, with use_sliding_window (transformers' Qwen3-MoE has no layer types).
        window = view.pop("sliding_window", None) if view.pop("use_sliding_window", False) else None
        view.pop("max_window_layers", None)
        view.pop("layer_types", None)
        return {**view, "sliding_window": window}

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> Qwen3MoeModelArgs:
        moe = MoEArgs(num_experts=view["num_experts"], top_k=view["num_experts_per_tok"],
                      hidden_dim=view["moe_intermediate_size"], score_func="softmax",
                      route_norm=bool(view["norm_topk_prob"]))
        return Qwen3MoeModelArgs(**cls._decoder_fields(view), head_dim=view["head_dim"],
                                 hidden_dim=view["intermediate_size"], moe=moe,
                                 n_dense_layers=len(view["mlp_only_layers"]))
