"""gpt-oss weights to and from Hugging Face transformers' GptOssForCausalLM naming (the bf16 layout).

Attention maps by name (biases and sinks too); the router is ``mlp.router`` (with its bias). The experts are
stacked in both: transformers' gate_up_proj (E, dim, 2 * hidden) interleaves gate and linear columns (gate at even
columns), its bias likewise; down_proj (E, hidden, dim) is ours as it is. The released checkpoints store the
experts in MXFP4 (``*_blocks``, ``*_scales``): those are refused, naming the bf16 copies to use instead.

From a config.json (models/shared/hf_config.py): any widths, expert counts, window, clamp, rope theta and YaRN;
refused: layer_types other than sliding and full alternating (sliding first), YaRN with truncate, another RoPE
scaling type.
"""

import dataclasses
import re
from collections.abc import Iterable
from typing import ClassVar

import torch

from torchtitan.models.gpt_oss.args import GptOssModelArgs
from torchtitan.models.shared.decoder_state_dict_adapter import DecoderStateDictAdapter, RefusedWeightError
from torchtitan.models.shared.hf_config import Default, derived, head_dim, heads

_OURS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w1|w2|w3|b1|b2|b3)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


class GptOssStateDictAdapter(DecoderStateDictAdapter):
    family = "gpt-oss"
    hf_architecture = "GptOssForCausalLM"
    hf_model_type = "gpt_oss"
    extra_layer_names: ClassVar[dict[str, str]] = {
        **{f"attention.{ours}.bias": f"self_attn.{hf}.bias"
           for ours, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))},
        "attention.sinks.weight": "self_attn.sinks",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
    }
    # transformers' GptOssConfig: YaRN by default, and sliding and full layers alternating.
    hf_defaults: ClassVar[dict[str, Default]] = {
        "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_attention_heads": 64, "sliding_window": 128, "tie_word_embeddings": False,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
        "num_key_value_heads": derived("num_key_value_heads", heads, absent=8),
        "head_dim": derived("head_dim", head_dim, absent=64),
        "layer_types": lambda c: ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(c["num_hidden_layers"])],
    }
    hf_aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}
    hf_default_theta: ClassVar[float] = 150_000.0
    hf_default_rope: ClassVar[dict | None] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "truncate": False,
                                              "original_max_position_embeddings": 4096}
    args: GptOssModelArgs

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> GptOssModelArgs:
        rope = {"rope_factor": 1.0}
        if view["rope_type"] == "yarn":
            rope = {"rope_factor": float(view["rope_parameters.factor"]),
                    "original_seq_len": view["rope_parameters.original_max_position_embeddings"],
                    "beta_fast": float(view["rope_parameters.beta_fast"]),
                    "beta_slow": float(view["rope_parameters.beta_slow"])}
        # The published MoE (biases, clamped SwiGLU, renormalised softmax top-k) at config.json's sizes.
        moe = dataclasses.replace(GptOssModelArgs().moe, num_experts=view["num_local_experts"],
                                  top_k=view["num_experts_per_tok"], hidden_dim=view["intermediate_size"],
                                  swiglu_limit=float(view["swiglu_limit"]), swiglu_alpha=float(view["swiglu_alpha"]))
        return GptOssModelArgs(**cls._decoder_fields(view), head_dim=view["head_dim"],
                               sliding_window=view["sliding_window"] or 0, moe=moe, **rope)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state, experts = dict(state), {}
        for name in [n for n in state if _OURS.match(n)]:
            match = _OURS.match(name)
            experts.setdefault(match.group(1), {})[match.group(2)] = state.pop(name)
        out = super().to_hf(state)
        for layer, t in experts.items():
            prefix = f"model.layers.{layer}.mlp.experts."
            # Interleave: column 2j is gate j, column 2j + 1 linear j.
            out[prefix + "gate_up_proj"] = torch.stack([t["w1"], t["w3"]], dim=-1).flatten(-2)
            out[prefix + "gate_up_proj_bias"] = torch.stack([t["b1"], t["b3"]], dim=-1).flatten(-2)
            out[prefix + "down_proj"] = t["w2"]
            out[prefix + "down_proj_bias"] = t["b2"]
        return out

    def check_hf_names(self, names: Iterable[str]) -> None:
        names = list(names)
        super().check_hf_names(names)
        quantized = sorted(n for n in names if n.endswith(("_blocks", "_scales")))
        if quantized:
            raise RefusedWeightError(quantized[0], "is an MXFP4-quantised expert weight, which this trainer does not "
                                     "read; use a bf16 copy of the model (e.g. unsloth/gpt-oss-20b-BF16), or "
                                     "dequantise with transformers (Mxfp4Config(dequantize=True)) and save_pretrained")

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.check_hf_names(state)  # before the experts are taken out of it (the base class checks what is left)
        state, ours = dict(state), {}
        for name in [n for n in state if _HF.match(n)]:
            layer, kind = _HF.match(name).groups()
            tensor, prefix = state.pop(name), f"layers.{layer}.moe.experts."
            if kind == "gate_up_proj":
                ours[prefix + "w1"], ours[prefix + "w3"] = tensor[..., 0::2], tensor[..., 1::2]
            elif kind == "gate_up_proj_bias":
                ours[prefix + "b1"], ours[prefix + "b3"] = tensor[..., 0::2], tensor[..., 1::2]
            else:
                ours[prefix + ("w2" if kind == "down_proj" else "b2")] = tensor
        return {**super().from_hf(state), **{k: v.contiguous() for k, v in ours.items()}}

    def extra_hf_config(self) -> dict:
        a, moe = self.args, self.args.moe
        needed = {"score_func": (moe.score_func, "softmax"), "route_norm": (moe.route_norm, True),
                  "route_scale": (moe.route_scale, 1.0), "n_groups": (moe.n_groups, 1),
                  "shared_hidden_dim": (moe.shared_hidden_dim, 0), "router_bias": (moe.router_bias, True),
                  "expert_biases": (moe.expert_biases, True), "activation": (moe.activation, "clamped_swiglu")}
        for name, (value, want) in needed.items():
            if value != want:
                raise ValueError(f"{self.hf_architecture} cannot express moe.{name} = {value!r} (it needs {want!r})")
        rope = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.rope_factor > 1:
            rope = {"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": a.rope_factor,
                    "beta_fast": a.beta_fast, "beta_slow": a.beta_slow, "truncate": False,
                    "original_max_position_embeddings": a.original_seq_len}
        return {
            "rope_parameters": rope,
            "rope_scaling": rope if a.rope_factor > 1 else None,
            "attention_bias": True,
            "sliding_window": a.sliding_window,
            "layer_types": ["sliding_attention" if a.window(i) else "full_attention" for i in range(a.n_layers)],
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "swiglu_limit": moe.swiglu_limit,
            "swiglu_alpha": moe.swiglu_alpha,
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
        }
