"""Kimi Linear weights to and from the released checkpoints' format, which transformers' KimiLinearForCausalLM reads
and writes (it renames them in memory on load and back on save).

DeepSeek-V3's adapter with the released format's names: the feed-forward is ``block_sparse_moe`` (the dense blocks'
SwiGLU too), each expert's matrices ``experts.{j}.w1/w2/w3``; a Kimi Delta Attention block's projections are
``self_attn.{q,k,v}_proj`` and its conv ``self_attn.{q,k,v}_conv1d`` (one each, [all heads] rows), which ours fuse
with each head's q, k and v together (so that tensor parallelism cuts whole heads): regrouped exactly, both ways.
``A_log`` is stored (1, 1, heads, 1). config.json names the KDA blocks in ``linear_attn_config`` (1-indexed
``kda_layers`` and ``full_attn_layers``).
"""

import re
from typing import ClassVar

import torch

from torchtitan.models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter
from torchtitan.models.kimi_linear.args import FULL, KimiLinearModelArgs
from torchtitan.models.shared.hf_config import Default, derived, heads

_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_STREAMS = ("q", "k", "v")
# The released format's expert and feed-forward names <-> the DeepSeek-V3 (transformers) names our base writes.
_EXPERT_RENAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_KDA_FUSED = ("attention.in_proj_qkv.weight", "attention.conv.weight")


class KimiLinearStateDictAdapter(DeepseekV3StateDictAdapter):
    family = "Kimi Linear"
    hf_architecture = "KimiLinearForCausalLM"
    hf_model_type = "kimi_linear"
    extra_layer_names: ClassVar[dict[str, str]] = {
        **DeepseekV3StateDictAdapter.extra_layer_names,
        "attention.in_proj_b.weight": "self_attn.b_proj.weight",
        "attention.f_a_proj.weight": "self_attn.f_a_proj.weight",
        "attention.f_b_proj.weight": "self_attn.f_b_proj.weight",
        "attention.decay.A_log": "self_attn.A_log",
        "attention.decay.dt_bias": "self_attn.dt_bias",
        "attention.g_a_proj.weight": "self_attn.g_a_proj.weight",
        "attention.g_b_proj.weight": "self_attn.g_b_proj.weight",
        "attention.norm.weight": "self_attn.o_norm.weight",
    }
    # transformers' KimiLinearConfig (its attribute names; config.json may use either, hf_aliases maps them).
    hf_defaults: ClassVar[dict[str, Default]] = {
        "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
        "num_hidden_layers": 27, "num_attention_heads": 32, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "attention_bias": False, "linear_head_dim": 128, "linear_num_heads": 32,
        "linear_conv_kernel_dim": 4,
        "num_key_value_heads": derived("num_key_value_heads", heads, absent=32),
    }
    hf_aliases: ClassVar[dict[str, str]] = {
        "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
        "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
        "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
    }
    hf_ignored: ClassVar[frozenset[str]] = frozenset({
        "head_dim", "qk_head_dim", "model_max_length", "mlp_layer_types", "rope_theta", "rope_interleave",
        "topk_method", "scoring_func", "linear_attn_config", "rope_type"})
    args: KimiLinearModelArgs

    @classmethod
    def _hf_view_of_family(cls, view: dict) -> dict:
        """The KDA settings and which blocks use MLA, however config.json gives them (linear_attn_config, as the
        released files do, or transformers' layer_types)."""
        linear = view.pop("linear_attn_config", None) or {}
        for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                          ("short_conv_kernel_size", "linear_conv_kernel_dim")):
            if key in linear:
                view[name] = linear[key]
        layers = view.get("num_hidden_layers")
        if "full_attn_layers" in linear:
            view["full_attention_layers"] = sorted(i - 1 for i in linear["full_attn_layers"])
        elif isinstance(view.get("layer_types"), list):
            view["full_attention_layers"] = [i for i, t in enumerate(view["layer_types"]) if t == FULL]
        elif layers is not None:  # transformers' default: every fourth block from the fifth
            view["full_attention_layers"] = [i for i in range(layers) if i and i % 4 == 0]
        view.pop("layer_types", None)
        return view

    @classmethod
    def hf_view(cls, config: dict) -> dict:
        # linear_attn_config is read before the generic rules leave unknown keys out.
        view = super().hf_view({k: v for k, v in config.items() if k != "linear_attn_config"})
        if "linear_attn_config" in config:
            view = cls._hf_view_of_family({**view, "linear_attn_config": config["linear_attn_config"]})
        return view

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> KimiLinearModelArgs:
        fields = {**cls._decoder_fields({**view, "rope_theta": 10000.0}), **cls._latent_attention_and_moe(view)}
        return KimiLinearModelArgs(
            **fields, kda_n_heads=view["linear_num_heads"], kda_head_dim=view["linear_head_dim"],
            kda_conv_kernel=view["linear_conv_kernel_dim"], full_attention_layers=tuple(view["full_attention_layers"]))

    def extra_hf_config(self) -> dict:
        a = self.args
        config = super().extra_hf_config()
        for key in ("rope_interleave", "topk_method", "scoring_func", "num_nextn_predict_layers"):
            config.pop(key, None)
        # KimiLinearConfig's own names for DeepSeek-V3's MoE keys (what transformers writes and reads).
        for theirs, ours in self.hf_aliases.items():
            if ours in config and theirs != "num_local_experts":
                config[theirs] = config.pop(ours)
        full = [i + 1 for i in range(a.n_layers) if a.layer_type(i) == FULL]
        config.update({
            "linear_attn_config": {"head_dim": a.kda_head_dim, "num_heads": a.kda_n_heads,
                                   "short_conv_kernel_size": a.kda_conv_kernel, "full_attn_layers": full,
                                   "kda_layers": [i for i in range(1, a.n_layers + 1) if i not in full]},
            "linear_head_dim": a.kda_head_dim, "linear_num_heads": a.kda_n_heads,
            "linear_conv_kernel_dim": a.kda_conv_kernel,
        })
        return config

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        config = super().hf_config(tokenizer_bos, tokenizer_eos, dtype)
        config.pop("rope_theta", None)  # no positional encoding anywhere
        return config

    # Weights.

    def _regroup(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Our rows grouped per head ([q_h | k_h | v_h] for each head) -> the q, k and v streams' rows."""
        h, d = self.args.kda_n_heads, self.args.kda_head_dim
        grouped = tensor.reshape(h, 3, d, *tensor.shape[1:])
        return [grouped[:, i].reshape(h * d, *tensor.shape[1:]) for i in range(3)]

    def _group(self, streams: list[torch.Tensor]) -> torch.Tensor:
        """_regroup undone."""
        h, d = self.args.kda_n_heads, self.args.kda_head_dim
        rest = streams[0].shape[1:]
        return torch.stack([t.reshape(h, d, *rest) for t in streams], dim=1).reshape(3 * h * d, *rest)

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("attention.decay.A_log"):
            return tensor.reshape(1, 1, -1, 1)
        return super().tensor_to_hf(name, tensor)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("attention.decay.A_log"):
            return tensor.reshape(-1)
        return super().tensor_from_hf(name, tensor)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fused = {}
        for name in [n for n in state if (m := _OURS.match(n)) and m.group(2) in _KDA_FUSED]:
            layer, local = _OURS.match(name).groups()
            tensor = state[name]
            for stream, part in zip(_STREAMS, self._regroup(tensor)):
                if local == "attention.conv.weight":  # the format's depthwise Conv1d: (channels, 1, kernel)
                    fused[f"model.layers.{layer}.self_attn.{stream}_conv1d.weight"] = part.unsqueeze(1).contiguous()
                else:
                    fused[f"model.layers.{layer}.self_attn.{stream}_proj.weight"] = part.contiguous()
        out = super().to_hf({n: t for n, t in state.items() if not _is_fused(n)})
        return {**{_released_name(name): t for name, t in out.items()}, **fused}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = {_transformers_name(name): t for name, t in state.items()}
        kda = {layer for layer in range(self.args.n_layers) if self.args.layer_type(layer) != FULL}
        fused, rest = {}, {}
        for name, tensor in state.items():
            match = _HF.match(name)
            stream = _kda_stream(match.group(2)) if match and int(match.group(1)) in kda else None
            if stream is None:
                rest[name] = tensor
            else:
                fused.setdefault((match.group(1), stream[0]), {})[stream[1]] = tensor
        out = super().from_hf(rest)
        for (layer, kind), streams in fused.items():
            if sorted(streams) != sorted(_STREAMS):
                raise KeyError(f"model.layers.{layer}.self_attn: has {sorted(streams)} of the q, k, v "
                               f"{'conv1d' if kind == 'conv' else 'proj'} tensors; a KDA block needs all three")
            parts = [streams[s].squeeze(1) if kind == "conv" else streams[s] for s in _STREAMS]
            ours = "attention.conv.weight" if kind == "conv" else "attention.in_proj_qkv.weight"
            out[f"layers.{layer}.{ours}"] = self._group(parts)
        return out


def _is_fused(name: str) -> bool:
    match = _OURS.match(name)
    return bool(match) and match.group(2) in _KDA_FUSED


def _kda_stream(local: str) -> tuple[str, str] | None:
    """("proj" or "conv", "q"/"k"/"v") for a KDA block's q/k/v projection or conv, else None."""
    match = re.fullmatch(r"self_attn\.([qkv])_(proj|conv1d)\.weight", local)
    return None if match is None else ("conv" if match.group(2) == "conv1d" else "proj", match.group(1))


def _released_name(name: str) -> str:
    """A DeepSeek-V3 (transformers) layer name in the released Kimi Linear format."""
    name = name.replace(".mlp.", ".block_sparse_moe.")
    match = re.match(r"^(.*\.experts\.\d+\.)(gate_proj|down_proj|up_proj)(\.weight)$", name)
    return f"{match.group(1)}{_EXPERT_RENAMES[match.group(2)]}{match.group(3)}" if match else name


def _transformers_name(name: str) -> str:
    """_released_name undone."""
    match = re.match(r"^(.*\.experts\.\d+\.)(w[123])(\.weight)$", name)
    if match:
        name = f"{match.group(1)}{ {v: k for k, v in _EXPERT_RENAMES.items()}[match.group(2)] }{match.group(3)}"
    return name.replace(".block_sparse_moe.", ".mlp.")
