"""Qwen3-Next weights to and from Hugging Face transformers' Qwen3NextForCausalLM naming.

Gated attention and the MoE map by name. A Gated DeltaNet layer's projections are fused differently: the format
keeps per key head [q, k, values, z] in one in_proj_qkvz and [beta, decay] rows in in_proj_ba, and orders the
conv's channels [all q | all k | all v] ("streams"), where ours are grouped per key head (so that tensor parallelism
cuts whole heads); these tensors are regrouped, exactly, both ways. (Qwen3.5's format keeps the four projections
apart, in_proj_qkv in streams order like the conv: models/qwen3_5/state_dict_adapter.py.)

From a config.json (models/shared/hf_config.py): any widths, rotary share, linear-attention sizes and expert counts,
dense blocks first (mlp_only_layers 0..k-1); layer_types must be linear blocks with every k-th full; refused: other
layer patterns, dense blocks elsewhere, no shared expert, attention biases, another activation, RoPE scaling.
"""

import re
from typing import ClassVar

import torch

from torchtitan.log import logger
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3_next.args import FULL, LINEAR, Qwen3NextModelArgs
from torchtitan.models.shared.decoder_state_dict_adapter import UnexpectedWeightError
from torchtitan.models.shared.hf_config import Default
from torchtitan.models.shared.moe import MoEArgs

_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED_OURS = ("attention.in_proj_qkv.weight", "attention.in_proj_z.weight", "attention.in_proj_b.weight",
               "attention.in_proj_a.weight")
_FUSED_HF = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")
CONV = "attention.conv.weight"


class Qwen3NextStateDictAdapter(Qwen3StateDictAdapter):
    family = "Qwen3-Next"
    hf_architecture = "Qwen3NextForCausalLM"
    hf_model_type = "qwen3_next"
    extra_layer_names: ClassVar[dict[str, str]] = {
        **Qwen3StateDictAdapter.extra_layer_names,
        "attention.decay.A_log": "linear_attn.A_log",
        "attention.decay.dt_bias": "linear_attn.dt_bias",
        "attention.norm.weight": "linear_attn.norm.weight",
        CONV: "linear_attn.conv1d.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
        "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
    }
    # transformers' Qwen3NextConfig: layer_types, when not given, from full_attention_interval (default 4).
    hf_defaults: ClassVar[dict[str, Default]] = {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
        "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": [], "partial_rotary_factor": 0.25,
        "layer_types": lambda c: _layer_types(c.get("full_attention_interval", 4), c["num_hidden_layers"]),
    }
    # Qwen3's sliding-window keys (which hf_config writes, inherited) mean nothing to Qwen3-Next; the interval is
    # read through layer_types.
    hf_ignored: ClassVar[frozenset[str]] = frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                                                      "full_attention_interval"})
    # Our linear blocks' tensors that the format stores fused with others (to_hf and from_hf convert them); none
    # where the format keeps them apart and they map by name (Qwen3.5).
    fused_ours: ClassVar[tuple[str, ...]] = _FUSED_OURS
    args: Qwen3NextModelArgs

    @classmethod
    def _hf_view_of_family(cls, view: dict) -> dict:
        return view

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> Qwen3NextModelArgs:
        moe, n_dense = cls._moe_from_hf_view(view)
        return Qwen3NextModelArgs(**cls._hybrid_fields(view), moe=moe, n_dense_layers=n_dense)

    @classmethod
    def _hybrid_fields(cls, view: dict) -> dict:
        """The args fields of the decoder, its attention and its linear blocks."""
        types, n = view["layer_types"], view["num_hidden_layers"]
        # The interval whose pattern layer_types is (n + 1: all linear); none such is refused when compared.
        interval = next((k for k in range(1, n + 2) if _layer_types(k, n) == types), 4)
        # A format whose blocks are all MoE may have no dense width (Qwen3.5-MoE): the args' default stands.
        dense = {"hidden_dim": view["intermediate_size"]} if "intermediate_size" in view else {}
        return {**cls._decoder_fields(view), **dense, "head_dim": view["head_dim"],
                "partial_rotary_factor": float(view["partial_rotary_factor"]), "full_attention_interval": interval,
                "linear_n_key_heads": view["linear_num_key_heads"], "linear_n_value_heads": view["linear_num_value_heads"],
                "linear_key_head_dim": view["linear_key_head_dim"],
                "linear_value_head_dim": view["linear_value_head_dim"],
                "linear_conv_kernel": view["linear_conv_kernel_dim"]}

    @classmethod
    def _moe_from_hf_view(cls, view: dict) -> tuple[MoEArgs | None, int]:
        """The MoE args and the number of dense blocks first."""
        moe = MoEArgs(num_experts=view["num_experts"], top_k=view["num_experts_per_tok"],
                      hidden_dim=view["moe_intermediate_size"], score_func="softmax",
                      route_norm=bool(view["norm_topk_prob"]),
                      shared_hidden_dim=view["shared_expert_intermediate_size"], shared_gate=True)
        return moe, len(view["mlp_only_layers"])

    def _is_linear(self, layer: str) -> bool:
        return self.args.layer_type(int(layer)) == LINEAR

    def hf_name(self, name: str) -> str:
        match = _OURS_LAYER.match(name)
        if match and self._is_linear(match.group(1)):
            if match.group(2) == "attention.wo.weight":
                return f"model.layers.{match.group(1)}.linear_attn.out_proj.weight"
            if match.group(2) in self.fused_ours:
                raise KeyError(f"weight '{name}' is part of a fused {self.hf_architecture} tensor, not one of its own")
        return super().hf_name(name)

    def our_name(self, name: str) -> str:
        match = _HF_LAYER.match(name)
        if match and match.group(2) == "linear_attn.out_proj.weight":
            return f"layers.{match.group(1)}.attention.wo.weight"
        return super().our_name(name)

    def _sizes(self) -> tuple[int, int, int, int]:
        a = self.args
        return (a.linear_n_key_heads, a.linear_key_head_dim, a.linear_n_value_heads // a.linear_n_key_heads,
                a.linear_value_head_dim)

    def to_streams(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows (q, k and values channels) grouped per key head -> [all q | all k | all values]."""
        nk, dk, r, dv = self._sizes()
        q, k, v = tensor.reshape(nk, -1, *tensor.shape[1:]).split([dk, dk, r * dv], dim=1)
        return torch.cat([t.flatten(0, 1) for t in (q, k, v)])

    def from_streams(self, tensor: torch.Tensor) -> torch.Tensor:
        """to_streams undone."""
        nk, dk, r, dv = self._sizes()
        q, k, v = tensor.split([nk * dk, nk * dk, nk * r * dv])
        rest = tensor.shape[1:]
        return torch.cat([q.reshape(nk, dk, *rest), k.reshape(nk, dk, *rest), v.reshape(nk, r * dv, *rest)],
                         dim=1).flatten(0, 1)

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(CONV):
            return self.to_streams(tensor).unsqueeze(1)  # the format's depthwise Conv1d: (channels, 1, kernel)
        return super().tensor_to_hf(name, tensor)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(CONV):
            return self.from_streams(tensor.squeeze(1))
        return super().tensor_from_hf(name, tensor)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state, fused = dict(state), {}
        nk, _, r, dv = self._sizes()
        for layer in {m.group(1) for name in state if (m := _OURS_LAYER.match(name))} if self.fused_ours else ():
            ours, hf = f"layers.{layer}.attention.", f"model.layers.{layer}.linear_attn."
            if ours + "in_proj_qkv.weight" not in state:
                continue
            qkv, z, b, a = (state.pop(f"layers.{layer}.{name}") for name in _FUSED_OURS)
            dim = qkv.shape[-1]
            fused[hf + "in_proj_qkvz.weight"] = torch.cat(
                [qkv.view(nk, -1, dim), z.view(nk, r * dv, dim)], dim=1).reshape(-1, dim)
            fused[hf + "in_proj_ba.weight"] = torch.cat([b.view(nk, r, dim), a.view(nk, r, dim)], dim=1).reshape(-1, dim)
        return {**super().to_hf(state), **fused}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The released checkpoints carry a multi-token prediction module (mtp.*) that the model does not have;
        # transformers skips it on load too.
        mtp = [name for name in state if name.startswith("mtp.")]
        if mtp:
            logger.info(f"{self.family}: skipped the checkpoint's {len(mtp)} multi-token prediction tensors (mtp.*)")
        state, split = {k: v for k, v in state.items() if not k.startswith("mtp.")}, {}
        nk, dk, r, dv = self._sizes()
        for name in [n for n in state if n.endswith(_FUSED_HF)] if self.fused_ours else ():
            match = _HF_LAYER.match(name)
            if match is None:
                raise UnexpectedWeightError(name, self.family)
            ours, tensor = f"layers.{match.group(1)}.attention.", state.pop(name)
            if name.endswith("in_proj_qkvz.weight"):
                qkv, z = tensor.view(nk, -1, tensor.shape[-1]).split([2 * dk + r * dv, r * dv], dim=1)
                split[ours + "in_proj_qkv.weight"] = qkv.reshape(-1, tensor.shape[-1])
                split[ours + "in_proj_z.weight"] = z.reshape(-1, tensor.shape[-1])
            else:
                b, a = tensor.view(nk, 2 * r, tensor.shape[-1]).split([r, r], dim=1)
                split[ours + "in_proj_b.weight"] = b.reshape(-1, tensor.shape[-1])
                split[ours + "in_proj_a.weight"] = a.reshape(-1, tensor.shape[-1])
        return {**super().from_hf(state), **split}

    def extra_hf_config(self) -> dict:
        return {**super().extra_hf_config(), **self._hybrid_hf_config(), **self._moe_hf_config()}

    def _hybrid_hf_config(self) -> dict:
        a = self.args
        return {
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                                "partial_rotary_factor": a.partial_rotary_factor},
            "partial_rotary_factor": a.partial_rotary_factor,
            "layer_types": a.layer_types,
            "full_attention_interval": a.full_attention_interval,
            "linear_conv_kernel_dim": a.linear_conv_kernel,
            "linear_key_head_dim": a.linear_key_head_dim,
            "linear_value_head_dim": a.linear_value_head_dim,
            "linear_num_key_heads": a.linear_n_key_heads,
            "linear_num_value_heads": a.linear_n_value_heads,
        }

    def _moe_hf_config(self) -> dict:
        a, moe = self.args, self.args.moe
        if moe is None:
            raise ValueError(f"{self.hf_architecture} has MoE blocks; this flavor has none (moe = None)")
        needed = {"score_func": (moe.score_func, "softmax"), "route_scale": (moe.route_scale, 1.0),
                  "n_groups": (moe.n_groups, 1), "shared_gate": (moe.shared_gate, True)}
        for name, (value, want) in needed.items():
            if value != want:
                raise ValueError(f"{self.hf_architecture} cannot express moe.{name} = {value!r} (it needs {want!r})")
        if moe.shared_hidden_dim <= 0:
            raise ValueError(f"{self.hf_architecture} needs a shared expert (moe.shared_hidden_dim > 0)")
        return {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.hidden_dim,
            "shared_expert_intermediate_size": moe.shared_hidden_dim,
            "norm_topk_prob": moe.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(a.n_dense_layers)),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
        }


def _layer_types(interval: int, n_layers: int) -> list[str]:
    """Linear blocks with every ``interval``-th full attention (transformers' and our default layout)."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
