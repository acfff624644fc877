"""What the planner knows of a model: its exact parameter counts (built on the meta device) and the widths its
activations scale with."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.components.lora.converter import LoRAConverter
from torchtitan.components.optimizers.muon import split_parameters
from torchtitan.config.job_config import JobConfig
from torchtitan.generation.caches import mixers
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet
from torchtitan.models.shared.nf4 import nf4_shardable, nf4_weights
from torchtitan.planner.layout import PlanError
from torchtitan.protocols.model import token_flop_params
from torchtitan.protocols.train_spec import (
    build_model_args,
    flavor_args,
    get_train_spec,
)

# Bytes per weight of torchao's NF4Tensor (QLoRA): 4-bit codes, an int8 scale per 64 values, a float32 factor per
# 256 of those (and 68 bytes per tensor, left out).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass
class ModelShape:
    """Exact parameter counts and the dimensions activations scale with."""

    dim: int
    n_layers: int  # blocks, multi-token prediction blocks included
    n_heads: int
    q_dim: int  # n_heads x head_dim
    kv_dim: int  # kv_heads x head_dim
    ffn_dim: int
    qk_norm: bool  # q and k are RMS-normalised per head before RoPE (Qwen3)
    vocab: int
    params: int
    block_params: int  # one transformer block
    block_linear_params: int  # its Linear weights (the ones autocast copies to the compute dtype)
    embedding_params: int
    output_params: int
    flops_per_token: float  # training FLOPs per token as the trainer reports it (MFU)
    attention_flops_per_token: float = 0.0  # of which softmax attention's (causal mask not discounted)
    mixer_flops_per_token: float = 0.0  # of which other token mixing's (a linear attention's recurrence)
    linear_layers: tuple = ()  # per Gated DeltaNet block: (value heads, key head size, value head size, conv width)
    # Mixture-of-Experts (zero for dense models): blocks with a MoE, experts per block, experts per token,
    # an expert's and the shared experts' SwiGLU widths, and one block's routed-expert parameters.
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    expert_dim: int = 0
    shared_dim: int = 0
    routed_params: int = 0
    mtp_blocks: int = 0  # of n_layers, the multi-token prediction blocks (on the last pipeline stage)
    tied: bool = False  # the output head is the embedding table
    # Every parameter tensor as (elements, where, muon, trainable): where is "block", "embedding", "vision" or
    # "head" (the final norm and output); muon says whether optimizer.name = "Muon" gives it to Muon
    # (components/optimizers/muon.split_parameters); trainable is False for a frozen (LoRA base) weight.
    tensors: tuple[tuple[int, str, bool, bool], ...] = ()
    # The shapes of the block weights a QLoRA base stores in NF4 (lora.base_dtype): FSDP shards those whose rows
    # split into whole scale groups (models/shared/nf4.nf4_shardable), the others stay whole on every rank.
    nf4_shapes: tuple[tuple[int, ...], ...] = ()
    # The token mixer of each block a forward runs, on the meta device: the generation engine's caches are sized
    # from them (generation/caches.py); empty, with the reason in no_generation_cache, for a mixer without a cache.
    mixers: tuple[nn.Module, ...] = ()
    no_generation_cache: str | None = None
    # A vision tower (models/shared/vision.py), on the first pipeline stage, replicated under TP: its parameters,
    # and per patch and block the bytes per element size it saves for backward; patches per image token.
    vision_params: int = 0
    vision_saved_per_patch: int = 0
    vision_dim: int = 0
    vision_depth: int = 0
    vision_merge_unit: int = 1

    @property
    def nf4_params(self) -> int:
        return sum(math.prod(shape) for shape in self.nf4_shapes)

    def nf4_bytes(self, fsdp_degree: int) -> float:
        """Bytes of the NF4 base on one rank holding every block, FSDP sharding over ``fsdp_degree`` ranks."""
        return NF4_BYTES * sum(math.prod(shape) / (fsdp_degree if nf4_shardable(shape, fsdp_degree) else 1)
                               for shape in self.nf4_shapes)

    @property
    def routed_params_per_block(self) -> float:
        """Routed-expert parameters of a block, averaged over the blocks (like block_params)."""
        return self.routed_params * self.moe_layers / self.n_layers


def model_shape(cfg: JobConfig, vocab_size: int | None = None) -> ModelShape:
    """Widths from the flavor's DecoderArgs (the interface every decoder family implements), parameter
    counts from the model built on the meta device (free even for 405B)."""
    spec = get_train_spec(cfg.model.name)
    flavor = flavor_args(spec, cfg.model)
    if not isinstance(flavor, DecoderArgs):
        raise PlanError(f"model.name = {cfg.model.name!r}: the planner needs its flavors to be DecoderArgs "
                        f"(torchtitan/models/shared/decoder_args.py), not {type(flavor).__name__}")
    if vocab_size is None and flavor.vocab_size is None:
        vocab_size = spec.build_tokenizer_fn(cfg.model.hf_assets_path).vocab_size
    args = build_model_args(spec, cfg.model, vocab_size or flavor.vocab_size, cfg.training.seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if "lora" in cfg.model.converters:  # adapters added, the base frozen (components/lora/converter.py)
        LoRAConverter(cfg, None).convert(model)
    # Multi-token prediction blocks are planned as blocks, plus an output-head pass each (memory and FLOPs).
    blocks = list(model.layers.values())
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    embedding = sum(embeddings.values())
    params = sum(p.numel() for p in model.parameters())
    moe = args.moe
    # Per-block counts are averaged over the blocks: a MoE family may keep its first blocks dense.
    per_block = sum(p.numel() for b in blocks for p in b.parameters()) // len(blocks)
    linear = sum(m.weight.numel() for b in blocks for m in b.modules() if isinstance(m, nn.Linear)) // len(blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    tower = getattr(model, "visual", None)
    in_tower = {id(p) for p in tower.parameters()} if tower is not None else set()
    embedding -= sum(n for i, n in embeddings.items() if i in in_tower)  # the tower's position table
    vision_params = sum(p.numel() for p in tower.parameters()) if tower is not None else 0
    muon = {id(p) for _, p in split_parameters([model])[0]}
    tensors = tuple((p.numel(), "block" if id(p) in in_blocks else "vision" if id(p) in in_tower
                     else "embedding" if id(p) in embeddings else "head", id(p) in muon, p.requires_grad)
                    for p in model.parameters())
    vision = args.vision if tower is not None else None
    nf4_shapes = tuple(tuple(p.shape) for p in nf4_weights(model))
    try:
        token_mixers, no_cache = tuple(mixer for _, mixer in mixers(model)), None
    except ValueError as e:
        token_mixers, no_cache = (), str(e)
    return ModelShape(
        dim=args.dim, n_layers=len(blocks), n_heads=args.n_heads, q_dim=args.n_heads * args.head_dim,
        kv_dim=args.kv_heads * args.head_dim, ffn_dim=args.ffn_hidden_dim, qk_norm=args.qk_norm,
        vocab=args.vocab_size, params=params, block_params=per_block, block_linear_params=linear,
        embedding_params=embedding,
        output_params=0 if args.tie_embeddings else args.vocab_size * args.dim,
        flops_per_token=args.flops_per_token(token_flop_params(model), cfg.training.seq_len),
        attention_flops_per_token=args.attention_flops_per_token(cfg.training.seq_len),
        mixer_flops_per_token=args.mixer_flops_per_token(),
        linear_layers=tuple((m.in_proj_b.out_features, m.key_head_dim, m.value_head_dim, m.conv.weight.shape[0])
                            for b in blocks for m in b.modules() if isinstance(m, GatedDeltaNet)),
        moe_layers=args.n_moe_layers, experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
        expert_dim=moe.hidden_dim if moe else 0, shared_dim=moe.shared_hidden_dim if moe else 0,
        routed_params=moe.routed_params(args.dim) if moe else 0,
        mtp_blocks=len(blocks) - args.n_layers, tied=args.tie_embeddings, tensors=tensors, nf4_shapes=nf4_shapes,
        mixers=token_mixers, no_generation_cache=no_cache,
        vision_params=vision_params,
        # Per patch a vision block keeps its two norms' inputs, q, k, v, the attention output, and the MLP's
        # hidden activations before and after the GELU; a checkpointed one its input only.
        vision_saved_per_patch=6 * vision.dim + 2 * vision.ffn_dim if vision else 0,
        vision_dim=vision.dim if vision else 0,
        vision_depth=vision.depth if vision else 0, vision_merge_unit=vision.merge_unit if vision else 1,
    )
