"""Qwen3-MoE weights to and from Hugging Face transformers' Qwen3MoeForCausalLM naming.

Attention maps as Qwen3's; the router is ``mlp.gate``; the stacked experts split into per-expert projections
(the shared adapter does that). The format has no routing bias and no shared experts.
"""

from typing import ClassVar

from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    family = "Qwen3-MoE"
    hf_architecture = "Qwen3MoeForCausalLM"
    hf_model_type = "qwen3_moe"
    extra_layer_names: ClassVar[dict[str, str]] = {
        **Qwen3StateDictAdapter.extra_layer_names,
        "moe.router.gate.weight": "mlp.gate.weight",
    }
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
