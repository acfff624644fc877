"""Decoder weights to and from Hugging Face transformers' *ForCausalLM naming, shared by the families.

A family adds its own per-layer names, its config.json identity and extra keys. Hugging Face's Llama
and Qwen3 rotate the two halves of each head in RoPE; for a family whose RoPE rotates adjacent pairs
(args.rope_convention = "pairs") the q and k projection rows are permuted between the two layouts.

Mixture-of-Experts blocks store their experts stacked (``moe.experts.w1`` of shape (E, dim, hidden)); Hugging
Face checkpoints name each expert's matrices (``mlp.experts.{j}.gate_proj.weight``, (hidden, dim)), which
transformers 5 still writes although it fuses them in memory. Both directions convert, and the fused form
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) is read too.
"""

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from torchtitan.log import logger
from torchtitan.models.shared.hf_config import Default, describe, differences, hf_view, read_config_json

# Our name within layers.N -> the Hugging Face name within model.layers.N.
DECODER_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DECODER_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Our stacked expert matrices -> the per-expert Hugging Face projection (ours are transposed: x @ w).
EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OUR_EXPERTS = re.compile(r"^moe\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_HF_FUSED_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")


class UnexpectedWeightError(KeyError):
    """A Hugging Face tensor name the family does not know (weights of another family, most likely)."""

    def __init__(self, name: str, family: str):
        super().__init__(f"unexpected Hugging Face weight '{name}' for a {family} model")
        self.name = name


class RefusedWeightError(ValueError):
    """A Hugging Face tensor the family recognises but cannot read (a quantised format): the reason and what to use
    instead, judged from the names alone (``check_hf_names``)."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name} {reason}")
        self.name = name


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, dim = w.shape
    return w.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


class DecoderStateDictAdapter:
    """Renames every tensor; subclasses set ``family``, ``hf_architecture``, ``hf_model_type`` and
    ``extra_layer_names`` and may add config keys (``extra_hf_config``) or convert tensors.

    A MoE family maps its router (and shared experts, routing bias) in ``extra_layer_names``; the stacked
    experts map here. Where its format has no routing bias (``hf_has_expert_bias`` False) a trained, non-zero
    bias is refused on export, or dropped with ``drop_expert_bias``."""

    family: ClassVar[str] = "decoder"
    hf_architecture: ClassVar[str] = ""
    hf_model_type: ClassVar[str] = ""
    extra_layer_names: ClassVar[dict[str, str]] = {}
    hf_has_expert_bias: ClassVar[bool] = False
    # How transformers reads the family's config.json (models/shared/hf_config.py): its default for each key a
    # file may leave out, other names it accepts for a key (-> the name hf_config writes), the rope theta and
    # parameters it assumes when none are given, and keys of ours it does not compute with.
    hf_defaults: ClassVar[dict[str, Default]] = {}
    hf_aliases: ClassVar[dict[str, str]] = {}
    hf_default_theta: ClassVar[float] = 10000.0
    hf_default_rope: ClassVar[dict | None] = None
    hf_ignored: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, args):
        self.args = args
        self.drop_expert_bias = False  # set by the exporter from checkpoint.hf_drop_expert_bias
        self._layer_to_hf = {**DECODER_LAYER_NAMES, **self.extra_layer_names}
        self._layer_from_hf = {hf: ours for ours, hf in self._layer_to_hf.items()}
        self._top_from_hf = {hf: ours for ours, hf in DECODER_TOP_NAMES.items()}

    def _rope_heads(self, name: str) -> int | None:
        """Heads of a q or k projection whose rows need permuting between RoPE layouts, else None."""
        if self.args.rope_convention != "pairs":
            return None
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``name`` in the Hugging Face layout."""
        heads = self._rope_heads(name)
        return tensor if heads is None else _pairs_to_halves(tensor, heads)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The Hugging Face tensor for our ``name`` in our layout."""
        heads = self._rope_heads(name)
        return tensor if heads is None else _halves_to_pairs(tensor, heads)

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        """config.json for transformers' AutoConfig."""
        a = self.args
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.hf_model_type,
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": a.tie_embeddings,
            "bos_token_id": tokenizer_bos,
            "eos_token_id": tokenizer_eos,
            "torch_dtype": dtype,
            **self.extra_hf_config(),
        }

    def extra_hf_config(self) -> dict:
        """The family's own config.json keys."""
        return {}

    @classmethod
    def hf_view(cls, config: dict) -> dict:
        """A config.json (as a dict) on the keys that change the computation, read as transformers reads it."""
        view = hf_view(config, cls.hf_defaults, cls.hf_aliases, cls.hf_default_theta, cls.hf_default_rope)
        return cls._hf_view_of_family({k: v for k, v in view.items() if k not in cls.hf_ignored})

    @classmethod
    def _hf_view_of_family(cls, view: dict) -> dict:
        """The family's own reading of keys that act together (sliding windows, layer types)."""
        return view

    def hf_config_differences(self, config: dict) -> list[tuple[str, Any, Any]]:
        """(key, config.json's value, this model's) for each key where ``config`` computes otherwise than the
        config.json this model writes (hf_config); ValueError where the model has no config.json form at all."""
        return differences(self.hf_view(config), self.hf_view(self.hf_config(0, 0, "float32")))

    @classmethod
    def args_from_hf_file(cls, file) -> Any:
        """``args_from_hf_config`` of the config.json at ``file``; ValueError naming the file."""
        try:
            return cls.args_from_hf_config(read_config_json(file))
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    @classmethod
    def args_from_hf_config(cls, config: dict):
        """The family's args for a model of config.json's dimensions, or ValueError (one line) naming each key the
        family cannot express (the args are checked by writing their config.json back and comparing)."""
        theirs = config.get("model_type")
        if theirs is not None and theirs != cls.hf_model_type:
            raise ValueError(f"config.json has model_type {theirs!r}, not {cls.hf_model_type!r} ({cls.family}): it "
                             "describes a model of another family (check model.name)")
        try:
            args = cls._args_from_hf_view(cls.hf_view(config))
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]}, which a {cls.family} model needs") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json cannot be read as a {cls.family} model ({type(e).__name__}: {e})") from None
        if bad := args.check():
            raise ValueError(f"config.json gives a {cls.family} model with an invalid {bad[0][0]}: {bad[0][1]}")
        if found := cls(args).hf_config_differences(config):
            raise ValueError(f"config.json describes what a {cls.family} model cannot compute: "
                             f"{describe(found, 'the nearest model has')}")
        return args

    @classmethod
    def _args_from_hf_view(cls, view: dict):
        """The family's args from ``hf_view(config)``; the family's adapter defines it."""
        raise ValueError(f"the {cls.family} adapter cannot build a model from config.json")

    @staticmethod
    def _decoder_fields(view: dict) -> dict:
        """The DecoderArgs fields every family reads the same way."""
        return {"dim": view["hidden_size"], "n_layers": view["num_hidden_layers"],
                "n_heads": view["num_attention_heads"], "n_kv_heads": view["num_key_value_heads"],
                "norm_eps": float(view["rms_norm_eps"]), "rope_theta": float(view["rope_theta"]),
                "vocab_size": view["vocab_size"], "tie_embeddings": bool(view["tie_word_embeddings"])}

    @staticmethod
    def _from_fused_experts(layer: str, hf: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        # transformers' in-memory layout: gate_up_proj (E, 2 * hidden, dim) with the gate first, down_proj
        # (E, dim, hidden).
        prefix = f"layers.{layer}.moe.experts"
        if hf == "down_proj":
            return {f"{prefix}.w2": tensor.transpose(1, 2).contiguous()}
        gate, up = tensor.chunk(2, dim=1)
        return {f"{prefix}.w1": gate.transpose(1, 2).contiguous(), f"{prefix}.w3": up.transpose(1, 2).contiguous()}

    def hf_name(self, name: str) -> str:
        """Our weight name's Hugging Face name (a stacked expert tensor has several: to_hf names them)."""
        if (match := _OURS.match(name)) and match.group(2) in self._layer_to_hf:
            return f"model.layers.{match.group(1)}.{self._layer_to_hf[match.group(2)]}"
        if name in DECODER_TOP_NAMES:
            return DECODER_TOP_NAMES[name]
        raise KeyError(f"weight '{name}' has no Hugging Face name for a {self.family} model")

    def our_name(self, name: str) -> str:
        """A Hugging Face weight name's name in our model; UnexpectedWeightError for a name the family lacks."""
        if (match := _HF.match(name)) and match.group(2) in self._layer_from_hf:
            return f"layers.{match.group(1)}.{self._layer_from_hf[match.group(2)]}"
        if name in self._top_from_hf:
            return self._top_from_hf[name]
        raise UnexpectedWeightError(name, self.family)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._refuse_mup()
        out, dropped = {}, {}
        for name, tensor in state.items():
            match = _OURS.match(name)
            layer, local = (match.group(1), match.group(2)) if match else (None, name)
            if layer is not None and (experts := _OUR_EXPERTS.match(local)):
                hf = EXPERT_NAMES[experts.group(1)]
                for j, matrix in enumerate(tensor.unbind(0)):
                    out[f"model.layers.{layer}.mlp.experts.{j}.{hf}.weight"] = matrix.T.contiguous()
            elif layer is not None and local == "moe.expert_bias" and not self.hf_has_expert_bias:
                dropped[name] = tensor
            else:
                out[self.hf_name(name)] = self.tensor_to_hf(name, tensor)
        self._check_dropped_bias(dropped)
        if self.args.tie_embeddings:
            # Released tied checkpoints store only the embedding; safetensors also refuses shared storage.
            out.pop("lm_head.weight", None)
        return out

    def _refuse_mup(self) -> None:
        if self.args.mup_changes_outputs:
            raise ValueError(f"the model is parametrized by µP away from its base width ({self.args.mup}): the "
                             "Hugging Face model has no µP multipliers, so the same weights would give other outputs")

    def _check_dropped_bias(self, biases: dict[str, torch.Tensor]) -> None:
        """The format has no routing bias: exporting a trained (non-zero) one would change which experts
        the exported model picks, so it is refused unless the user asked to drop it."""
        # Meta tensors (a check of names and shapes only) hold no values to judge.
        largest = max(((t.abs().max().item(), name) for name, t in biases.items() if not t.is_meta),
                      default=(0.0, ""))
        if largest[0] == 0.0:
            return
        if not self.drop_expert_bias:
            raise ValueError(f"{largest[1]} is non-zero (largest |bias| {largest[0]:.4g}) but {self.hf_architecture} "
                             "has no routing bias, so the export would route tokens differently; set "
                             "checkpoint.hf_drop_expert_bias (scripts/convert_to_hf.py --drop_expert_bias) to drop it")
        logger.warning(f"dropped the experts' routing bias from the {self.hf_architecture} export; the largest "
                       f"was {largest[0]:.4g} in {largest[1]}")

    def check_hf_names(self, names: Iterable[str]) -> None:
        """Refuse, from the tensor names alone, weights this adapter cannot read however the model is sized
        (RefusedWeightError naming the first such tensor and what to use instead). Loading calls it on the
        safetensors headers before anything else (hf_folder.check_hf_folder): such a checkpoint lacks the
        unquantised tensors too, and "missing tensor ... check model.flavor" would send the user the wrong way.
        A family adds its own formats by extending it."""
        # Block-quantised FP8 (DeepSeek-V3 and -R1 as released, the *-FP8 Qwen3 models): each float8 weight has a
        # float32 scale per 128 x 128 block beside it.
        scales = sorted(name for name in names if name.endswith(".weight_scale_inv"))
        if scales:
            raise RefusedWeightError(scales[0], "is the block scale of an FP8-quantised weight, which this trainer "
                                     "does not read; dequantise the model to bf16 first (transformers: "
                                     "FineGrainedFP8Config(dequantize=True), then save_pretrained), or use a bf16 "
                                     "copy of it")

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.check_hf_names(state)
        self._refuse_mup()
        out = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for name, tensor in state.items():
            match = _HF.match(name)
            if match and (expert := _HF_EXPERT.match(match.group(2))):
                experts.setdefault((match.group(1), expert.group(2)), {})[int(expert.group(1))] = tensor
                continue
            if match and (fused := _HF_FUSED_EXPERTS.match(match.group(2))):
                out.update(self._from_fused_experts(match.group(1), fused.group(1), tensor))
                continue
            ours = self.our_name(name)
            out[ours] = self.tensor_from_hf(ours, tensor)
        hf_to_ours = {hf: ours for ours, hf in EXPERT_NAMES.items()}
        for (layer, hf), by_index in experts.items():
            if sorted(by_index) != list(range(len(by_index))):
                raise KeyError(f"model.layers.{layer}.mlp.experts: expert indices {sorted(by_index)} are not 0..N-1")
            out[f"layers.{layer}.moe.experts.{hf_to_ours[hf]}"] = torch.stack(
                [by_index[j].T for j in range(len(by_index))])
        if self.args.moe is not None and not self.hf_has_expert_bias:
            # The format routes without a bias: ours starts at zero, which routes the same way.
            for layer in range(self.args.n_layers):
                if self.args.is_moe_layer(layer):
                    out[f"layers.{layer}.moe.expert_bias"] = torch.zeros(self.args.moe.num_experts)
        if "tok_embeddings.weight" in out:
            if "output.weight" not in out:
                out["output.weight"] = out["tok_embeddings.weight"]  # a tied file stores the table once
            elif self.args.tie_embeddings and not out["output.weight"].is_meta and \
                    not torch.equal(out["output.weight"], out["tok_embeddings.weight"]):
                # One table serves both ends; an lm_head stored anyway (some exports do) must agree with it.
                raise ValueError("the flavor ties embeddings but the file's lm_head.weight differs from "
                                 "model.embed_tokens.weight")
        return out
