"""Predict per-device memory and step time of a training config before running it.

Memory is the sum of what a training step keeps alive, each term derived from the model's exact
parameter counts (the model is built on the meta device) and from the tensors the forward saves
for backward (docs/planning.md lists them op by op). Step time is the training FLOPs a device
executes, split into matmul and attention FLOPs: on GPUs divided by the peak FLOP/s times an
efficiency. On CPU a short calibration times the model itself cut to one and to two blocks at the
config's batch and length (attention kernels and element-wise work run far below the matmul peak
there, so no single efficiency fits) and scales by the layers, recomputation and layout (skipped,
and the step time reported as not measured, when the run would not fit the machine or its blocks
are large). Pipeline ranks are predicted one by one from the trainer's own stage split; their
activations in flight and selective per-op checkpointing are coarser than the rest; the docs say how.
"""

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.components.lora.converter import LoRAConverter
from torchtitan.components.metrics.peak_flops import cpu_machine_peak_tflops, gpu_peak_tflops
from torchtitan.components.objectives.loss import build_cross_entropy_loss
from torchtitan.components.optimizers.muon import split_parameters
from torchtitan.components.optimizers.optimizer import state_bytes
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.precision import resolve_compute_dtype, uses_autocast
from torchtitan.generation.caches import mixers, mixers_bytes_per_row
from torchtitan.hardware import DTYPES
from torchtitan.models.shared import amx_attention
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.gated_delta_rule import CHUNK
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet
from torchtitan.models.shared.nf4 import nf4_shardable, nf4_weights
from torchtitan.protocols.model import token_flop_params
from torchtitan.protocols.train_spec import build_model_args, flavor_args, get_train_spec

GIB = 2**30

# Usable memory per device in GiB, from the vendors' data sheets (80 GB parts report ~79.1 GiB to
# CUDA; we use the nominal size and leave the margin to the user's judgement).
DEVICE_MEMORY_GIB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "B200": 192.0, "MI300X": 192.0}
# Names the peak-FLOPs table knows the devices by.
DEVICE_PEAK_NAMES = {"H100": "H100", "H200": "H200", "A100": "A100", "B200": "B200", "MI300X": "MI300X"}
# Fraction of the dense peak a tuned bf16 training run reaches on GPUs (MFU reported for Llama-style
# dense models is typically 35-45%).
GPU_EFFICIENCY = 0.40
# The CPU calibration trains the real-width model cut to two blocks; above this many parameters per
# block (a 2-block model with AdamW state then needs several GiB and minutes) it is not attempted.
CPU_TIMING_MAX_BLOCK_PARAMS = 200_000_000


class PlanError(ValueError):
    """The plan cannot be made; the message names the input and what is valid."""

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


@dataclass
class Memory:
    """Predicted peak bytes per device, by component."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward at the peak (incl. autocast weight copies)
    transient: float  # short-lived buffers at the peak: logits in the loss, FSDP all-gathers, recompute
    peak_phase: str
    rl: float = 0.0  # GRPO: the frozen reference (sharded like the policy) and the sampler's whole copy

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.rl


@dataclass
class Plan:
    device: str
    capacity_gib: float
    layout: ParallelDims
    memory: Memory
    tokens_per_device: float  # per optimizer step
    flops_per_device: float  # per optimizer step, recomputation included
    peak_tflops: float
    speed: str  # how the step time was derived (or why it was not)
    step_time_s: float | None  # None when it was not measured
    compute_dtype: str  # training.mixed_precision_param, "auto" resolved for the device
    moe: str | None = None  # the MoE lines of the plan (experts per device, all-to-all volume), None when dense
    generation: str = ""  # the generation cache line: its bytes per device for a batch and length

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_gib * GIB


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


def resolve_layout(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The trainer's layout arithmetic (no process group needed), with its errors as PlanError."""
    try:
        return ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as e:
        raise PlanError(f"parallelism.data_parallel_shard_degree = {cfg.parallelism.data_parallel_shard_degree} "
                        f"{e}") from None


def layout_problem(parallelism, world_size: int) -> str | None:
    """Why the degrees of ``parallelism`` cannot lay out on ``world_size`` ranks (the checks config validation
    makes: they multiply to it, expert parallelism is carved from dp_shard x cp), or None."""
    try:
        dims = ParallelDims.from_config(parallelism, world_size)
    except ValueError as e:
        return str(e)
    return dims.expert_parallel_problem()


def smallest_world_size(parallelism) -> int | None:
    """The fewest ranks the degrees of ``parallelism`` lay out on, or None if no world size fits them."""
    p = parallelism
    degrees = (p.data_parallel_replicate_degree, p.context_parallel_degree, p.tensor_parallel_degree,
               p.pipeline_parallel_degree, p.expert_parallel_degree)
    if min(degrees) < 1 or p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        return None
    others = math.prod(degrees[:4])
    if p.data_parallel_shard_degree != -1:
        candidates = [others * p.data_parallel_shard_degree]
    else:
        # dp_shard = ep ranks always carves expert parallelism out of dp_shard x cp if anything does.
        candidates = [others * k for k in range(1, p.expert_parallel_degree + 1)]
    return next((w for w in candidates if layout_problem(p, w) is None), None)


def layer_activation_bytes(m: ModelShape, cfg: JobConfig, on_cpu: bool, tp: int) -> float:
    """Bytes one transformer block saves for backward, per token (see docs/planning.md)."""
    c = DTYPES[cfg.training.mixed_precision_param].itemsize
    autocast = uses_autocast(cfg.training)
    d, q, kv, f, h = m.dim, m.q_dim / tp, m.kv_dim / tp, m.ffn_dim / tp, m.n_heads / tp
    # q, k, v, output, and the fp32 log-sum-exp per head, as torchtitan.models.shared.attention computes them:
    # on CPU float16 is upcast to fp32 (a = 4), and in low precision the (batch, heads, seq, head_dim)
    # output reaches wo as a separate copy (a cast back, or a copy into wo's layout), except from the AMX
    # kernel, which writes it in wo's layout.
    a = 4 if on_cpu and cfg.training.mixed_precision_param == "float16" else c
    attention = a * (2 * q + 2 * kv) + 4 * h
    amx = on_cpu and amx_attention.takes(int(m.q_dim // m.n_heads), cfg.training.seq_len,
                                         DTYPES[cfg.training.mixed_precision_param])
    wo_input = c * q if on_cpu and c != 4 and not amx else 0
    ffn = 4 * c * f  # w1 out, silu out, w3 out, w2 input
    if m.moe_layers:
        # A MoE block, per token: each of its k copies (the sorted input, the experts' four hidden tensors,
        # their output), the router's float32 logits and scores over all experts, the shared experts' SwiGLU.
        routed = m.top_k * (2 * c * d + 4 * c * m.expert_dim / tp)
        moe_ffn = routed + 2 * 4 * m.experts + 4 * c * m.shared_dim / tp
        ffn = (m.moe_layers * moe_ffn + (m.n_layers - m.moe_layers) * ffn) / m.n_layers
    if autocast:
        # fp32 residual: each RMSNorm saves its input, 1/rms, the normalised x (fp32), and every
        # Linear saves its own compute-dtype cast of its input (q, k, v and w1, w3: 5 casts).
        norms = 2 * (4 * d + 4 + 4 * d)
        linear_inputs = 5 * c * d
    else:
        norms = 2 * (c * d + 4 + c * d)
        linear_inputs = 2 * c * d  # q/k/v share one input, w1/w3 another
    if m.qk_norm:
        # The per-head RMSNorms of q and k save, like the block's norms, their input and normalised
        # output (fp32 under autocast) and one 1/rms per head.
        kv_h = h * m.kv_dim / m.q_dim
        attention += (4 if autocast else c) * 2 * (q + kv) + 4 * (h + kv_h)
    mixer = attention + wo_input
    if m.linear_layers:
        linear = sum(linear_mixer_bytes(*shape, c, on_cpu, tp) for shape in m.linear_layers)
        mixer = (linear + (m.n_layers - len(m.linear_layers)) * mixer) / m.n_layers
    return norms + linear_inputs + mixer + ffn


def linear_mixer_bytes(value_heads: int, dk: int, dv: int, channels: int, c: int, on_cpu: bool, tp: int) -> float:
    """Bytes a Gated DeltaNet layer saves for backward per token (models/shared/gated_deltanet.py): the conv's input and
    output, q and k normalised in float32 (repeated to the value heads), v, the gates, the recurrence's own, and
    the gated norm's input, gate and output. The chunked PyTorch form (CPU) keeps per head and token about six
    chunk-wide rows (its decays, scores and triangular solve) and three (K + V) rows; fla's kernel (CUDA) keeps its
    output and a state per chunk."""
    h, channels = value_heads / tp, channels / tp
    recurrence = 4 * h * (6 * CHUNK + 3 * (dk + dv)) if on_cpu else 4 * h * (dv + dk * dv / CHUNK)
    return 2 * c * channels + 4 * h * (2 * dk + 2) + c * h * dv + recurrence + 4 * c * h * dv


@dataclass
class PipelineRank:
    """What one pipeline rank holds: its blocks, whether it has the embedding / the head, and how many
    blocks' activations it keeps alive at once, counted in micro-batch x block units."""

    blocks: int
    first: bool
    last: bool
    saved_blocks: int  # micro-batch x block activation sets alive at the peak
    head_in_flight: int  # micro-batches whose loss tensors the last stage keeps until their backward


# Schedules that run every micro-batch's forward through a rank's stages before any backward.
ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


def pipeline_ranks(m: ModelShape, cfg: JobConfig, layout: ParallelDims) -> list[PipelineRank]:
    """Per pipeline rank: the blocks it holds (the trainer's own stage split) and its activations in flight.

    Rule, with n_mb = local_batch_size / pipeline_parallel_microbatch_size micro-batches per step and
    S stages in all:
      - GPipe and LoopedBFS run every forward before the first backward: all n_mb micro-batches of
        every local stage are alive, n_mb x (blocks on the rank).
      - The 1F1B family (1F1B, Interleaved1F1B, the zero-bubble and V schedules) starts backwards as
        soon as the pipeline is full: at most min(n_mb x local stages, S) stage forwards are alive on
        the first rank, each of one stage's blocks. With one stage per rank that is min(n_mb, pp)
        micro-batches, the warm-up of plain 1F1B's first stage.
      - A CSV schedule may order its actions any way: counted as every forward first (an upper bound).
    Gradient accumulation runs whole pipeline steps one after another, so it does not raise the peak.
    """
    p = cfg.parallelism
    if layout.pp == 1:
        return [PipelineRank(m.n_layers, first=True, last=True, saved_blocks=m.n_layers, head_in_flight=1)]
    from torchtitan.distributed import pipeline_parallel as pipe  # imports torch.distributed.pipelining

    main = m.n_layers - m.mtp_blocks  # the blocks the stages split; MTP blocks join the last stage
    try:
        placement = pipe.stage_placement(p, main)
        num_stages = sum(len(stages) for stages in placement.values())
        names = pipe.stage_module_names(p, main, num_stages)
    except ValueError as e:
        raise PlanError(f"parallelism.pipeline_parallel_degree = {layout.pp} cannot be laid out: {e}") from None
    stage_blocks = [sum(name.startswith("layers.") for name in stage) for stage in names]
    stage_blocks[-1] += m.mtp_blocks
    n_mb = max(1, cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size)
    all_forwards_first = bool(p.pipeline_parallel_schedule_csv) or p.pipeline_parallel_schedule in ALL_FORWARDS_FIRST
    ranks = []
    for stages in placement.values():
        blocks = sum(stage_blocks[s] for s in stages)
        if all_forwards_first:
            saved = n_mb * blocks
        else:
            saved = min(n_mb * len(stages), num_stages) * max(stage_blocks[s] for s in stages)
        ranks.append(PipelineRank(blocks=blocks, first=0 in stages, last=num_stages - 1 in stages,
                                  saved_blocks=saved, head_in_flight=n_mb if all_forwards_first else 1))
    return ranks


def _rank_tensor_bytes(m: ModelShape, rank: PipelineRank, shards: int, embedding_copies: int, bytes_of,
                       tp: int = 1) -> float:
    """Summed over the trainable tensors on a pipeline rank, split ``shards`` ways (TP x FSDP) like its parameters,
    with ``embedding_copies`` of the embedding: ``bytes_of(local elements, muon)``. Frozen tensors (a LoRA
    base) have no gradient and no optimizer state."""
    total = 0.0
    for elements, where, muon, trainable in m.tensors:
        copies = (rank.blocks / m.n_layers if where == "block" else embedding_copies if where == "embedding"
                  else int(rank.first) if where == "vision" else int(rank.last))
        if copies and trainable:
            # The tower is replicated under TP: only FSDP splits it.
            total += copies * bytes_of(elements / shards * (tp if where == "vision" else 1), muon)
    return total


def optimizer_state_bytes(m: ModelShape, cfg: JobConfig, rank: PipelineRank, shards: int,
                          embedding_copies: int, tp: int = 1) -> float:
    """The optimizer state on a pipeline rank (see _rank_tensor_bytes)."""
    return _rank_tensor_bytes(m, rank, shards, embedding_copies,
                              lambda elements, muon: state_bytes(cfg.optimizer, cfg.training.dtype, elements, muon),
                              tp)


def predict_memory(m: ModelShape, cfg: JobConfig, layout: ParallelDims, on_cpu: bool) -> Memory:
    """The busiest device's peak: each pipeline rank is predicted and the largest total kept."""
    return max((rank_memory(m, cfg, layout, on_cpu, rank) for rank in pipeline_ranks(m, cfg, layout)),
               key=lambda memory: memory.total)


def rank_memory(m: ModelShape, cfg: JobConfig, layout: ParallelDims, on_cpu: bool, rank: PipelineRank) -> Memory:
    t = cfg.training
    s, c = DTYPES[t.dtype].itemsize, DTYPES[t.mixed_precision_param].itemsize
    fsdp = layout.fsdp_enabled
    tp = layout.tp
    autocast = uses_autocast(cfg.training, fsdp)
    # Parameters on this device: blocks split by TP (norm weights are small and counted as split
    # too); the first stage holds the embedding, the last the final norm and output. FSDP shards all.
    outside_blocks = m.params - m.n_layers * m.block_params - m.vision_params  # embedding, final norm, output
    head_params = (m.embedding_params if rank.first else 0) + (outside_blocks - m.embedding_params if rank.last else 0)
    shared_embedding = rank.last and layout.pp > 1 and (m.mtp_blocks or m.tied)
    if shared_embedding:
        head_params += m.embedding_params  # the last stage's copy of the embedding (SharedEmbedding)
    params_local = ((rank.blocks * m.block_params + head_params) / tp
                    + (m.vision_params if rank.first else 0)) / layout.fsdp_degree
    # An NF4 base takes NF4_BYTES per weight instead of s, FSDP sharding only the weights that split into whole
    # scale groups (the others stay whole on every rank).
    nf4_local = rank.blocks / m.n_layers * m.nf4_params
    nf4_bytes = rank.blocks / m.n_layers * m.nf4_bytes(layout.fsdp_degree if fsdp else 1)
    params = params_local * s - nf4_local / tp / layout.fsdp_degree * s + nf4_bytes
    embedding_copies = int(rank.first) + int(shared_embedding)
    grads = _rank_tensor_bytes(m, rank, tp * layout.fsdp_degree, embedding_copies, lambda elements, _: s * elements,
                               tp)
    optimizer = optimizer_state_bytes(m, cfg, rank, tp * layout.fsdp_degree, embedding_copies, tp)

    # One micro-batch: the whole local batch, or under PP one pipeline micro-batch.
    sequences = t.local_batch_size if layout.pp == 1 else cfg.parallelism.pipeline_parallel_microbatch_size
    tokens = sequences * t.seq_len / layout.cp
    full_layer = layer_activation_bytes(m, cfg, on_cpu, tp) * tokens
    residual = (4 if autocast else c) * m.dim * tokens  # a checkpointed block saves only its input
    # Autocast's casts of the weights, saved by the matmuls (the experts cast their stacked weights themselves).
    weight_copies = c * (m.block_linear_params + m.routed_params_per_block / layout.ep) / tp if autocast else 0
    ac = cfg.activation_checkpoint
    # Of the rank.saved_blocks block activations alive, how many are checkpointed.
    if ac.mode == "none":
        checkpointed = 0
    elif ac.mode == "full" or ac.selective_ac_option == "op":
        checkpointed = rank.saved_blocks
    else:
        # Every N-th block; a pipeline rank's share is counted in proportion to its blocks.
        checkpointed = math.ceil(rank.saved_blocks / int(ac.selective_ac_option))
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        # Attention outputs and about half of the matmul outputs are kept (the every-other-matmul
        # rule alternates between blocks); the rest is recomputed.
        matmul_outputs = c * (m.q_dim + 2 * m.kv_dim + m.dim + 2 * m.ffn_dim + m.dim) / tp / 2
        kept = residual + (4 if on_cpu else c) * m.q_dim / tp * tokens + matmul_outputs * tokens
    else:
        kept = residual
    stored = checkpointed * kept + (rank.saved_blocks - checkpointed) * (full_layer + weight_copies)
    if rank.first and m.vision_depth and t.dataset_format == "chat":
        # The tower's blocks on the micro-batch's images, whole on every TP and CP rank: at most every token an
        # image token (or training.chat.max_image_tokens a sequence), merge_unit patches each.
        patches = sequences * (t.chat.max_image_tokens or t.seq_len) * m.vision_merge_unit
        every = 0 if ac.mode == "none" else 1 if ac.mode == "full" or ac.selective_ac_option == "op" else int(
            ac.selective_ac_option)
        kept = math.ceil(m.vision_depth / every) if every else 0  # the tower's blocks checkpoint like the decoder's
        stored += c * patches * (kept * m.vision_dim + (m.vision_depth - kept) * m.vision_saved_per_patch)

    # The model's head (last stage only): the final norm and the output layer's input, then the
    # loss's fp32 log-probabilities (kept for backward); while the loss runs forward and its backward
    # starts, two more fp32 logit-sized buffers are alive. Under TP with loss parallel the vocab is split.
    vocab = m.vocab / tp
    norm = (2 * 4 * m.dim + 4) if autocast else (2 * c * m.dim + 4)
    head_saved = head_transient = output_grad = 0.0
    if rank.last:
        # Each multi-token prediction depth has its own pass through the norm, output layer and loss.
        head_saved = (norm + c * m.dim + 4 * vocab) * tokens * rank.head_in_flight * (1 + m.mtp_blocks)
        head_saved += c * m.output_params / tp if autocast else 0
        head_transient = 2 * 4 * vocab * tokens
        output_grad = m.output_params * s / tp / layout.fsdp_degree
    # FSDP all-gathers a block's parameters in the compute dtype and prefetches the next one; under expert
    # parallelism a block gathers only its own experts.
    gathered = 2 * c * gathered_block_params(m, layout) / tp if fsdp else 0

    phases = {
        "loss (end of forward)": (0, stored + head_saved, head_transient + gathered),
        # Backward of the last block recomputes its full activations, with the output layer's
        # gradient already allocated and the head's saved tensors already freed.
        "recompute in backward": (output_grad, stored, (full_layer + weight_copies + gathered) if checkpointed else 0),
        "optimizer step": (grads, 0, gathered / 2),
    }
    phase, (grad_bytes, act_bytes, transient_bytes) = max(phases.items(), key=lambda kv: sum(kv[1]))
    return Memory(params=params, grads=grad_bytes, optimizer=optimizer, activations=act_bytes,
                  transient=transient_bytes, peak_phase=phase, rl=rl_model_bytes(m, cfg, params))


def rl_model_bytes(m: ModelShape, cfg: JobConfig, policy_bytes: float) -> float:
    """GRPO's models beside the policy on a device: the reference (rl.kl_coeff > 0 without LoRA, whose reference is
    the base itself) holds what the policy's parameters hold; the engine sampler a whole copy in the stored dtype."""
    if cfg.training.objective != "grpo":
        return 0.0
    reference = policy_bytes if cfg.rl.kl_coeff > 0 and "lora" not in cfg.model.converters else 0.0
    sampler = m.params * DTYPES[cfg.training.dtype].itemsize if cfg.rl.sampler == "engine" else 0.0
    return reference + sampler


def gathered_block_params(m: ModelShape, layout: ParallelDims) -> float:
    """Parameters of one block as FSDP gathers it on a device (before TP): under expert parallelism only the
    block's local experts (num_experts / ep)."""
    return m.block_params - m.routed_params_per_block + m.routed_params_per_block / layout.ep


def all_to_all_bytes(m: ModelShape, cfg: JobConfig, layout: ParallelDims) -> float:
    """Bytes one device sends in expert-parallel all-to-alls per optimizer step: every MoE layer sends each
    routed token copy (k per token) whose expert lives on another of the ep ranks out and back, in forward
    and again in backward, and once more where activation checkpointing recomputes the layer."""
    if layout.ep == 1 or not m.moe_layers:
        return 0.0
    t = cfg.training
    c = DTYPES[t.mixed_precision_param].itemsize
    tokens = t.local_batch_size * t.seq_len / layout.cp * layout.grad_accum_steps(t)
    per_layer = tokens * m.top_k * m.dim * c * (layout.ep - 1) / layout.ep * 2  # dispatch and combine
    passes = 2 + recomputed_fraction(cfg, m.n_layers)
    layers = m.moe_layers / layout.pp
    return per_layer * passes * layers


def step_flops_per_device(m: ModelShape, cfg: JobConfig, layout: ParallelDims) -> tuple[float, float, float]:
    """(tokens, matmul FLOPs, attention FLOPs) one device executes per step, recomputation included.

    Unlike the MFU convention (flops_per_token), the causal mask is discounted: attention kernels
    skip the masked half of the score matrix, so they execute half the attention FLOPs.
    """
    t = cfg.training
    tokens = layout.global_batch_size(t) * t.seq_len / layout.world_size
    # A linear attention's recurrence counts with the attention: kernels, not the weights' matmuls.
    attention = m.attention_flops_per_token / 2 + m.mixer_flops_per_token
    weights = m.flops_per_token - m.attention_flops_per_token - m.mixer_flops_per_token  # 6 x non-embedding params
    block_weights = weights - 6 * m.output_params
    weights += 6 * m.vocab * m.dim * m.mtp_blocks  # each multi-token prediction depth's output-head pass
    # A recomputed block repeats its forward: a third of its forward + backward FLOPs.
    recomputed = recomputed_fraction(cfg, m.n_layers)
    matmul = (weights + block_weights * recomputed / 3) * tokens
    attention *= (1 + recomputed / 3) * tokens
    return tokens, matmul, attention


@dataclass
class CpuTiming:
    """Seconds measured on this CPU for one micro-batch (local_batch_size x seq_len tokens)."""

    block: float  # forward + backward of one transformer block
    rest: float  # embedding, output projection and loss, forward + backward
    optimizer_per_layer: float  # optimizer step, per block
    optimizer_rest: float  # optimizer step of the other parameters


def _time_model(cfg: JobConfig, n_layers: int, vocab_size: int, repeats: int) -> tuple[float, float]:
    """Best (forward + backward, optimizer step) seconds of the config's model cut to n_layers blocks."""
    from torchtitan.components.optimizers.optimizer import build_optimizer

    spec = get_train_spec(cfg.model.name)
    t = cfg.training
    args = dataclasses.replace(flavor_args(spec, cfg.model), n_layers=n_layers).finalize(vocab_size, t.seq_len)
    model = spec.model_cls(args)
    model.init_weights(cfg.debug.seed)
    optimizer = build_optimizer([model], cfg.optimizer)
    loss_fn = (spec.build_loss_fn or build_cross_entropy_loss)()
    tokens = torch.randint(0, vocab_size, (t.local_batch_size, t.seq_len))
    compute = DTYPES[t.mixed_precision_param]
    autocast = torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32)
    best_step, best_optimizer = math.inf, math.inf
    for i in range(repeats + 1):
        start = time.perf_counter()
        with autocast:
            logits = model(tokens)
        loss_fn(logits, tokens, tokens.numel()).backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        if i:  # the first round warms up kernels and creates the optimizer state
            best_step = min(best_step, middle - start)
            best_optimizer = min(best_optimizer, time.perf_counter() - middle)
    return best_step, best_optimizer


def measure_cpu_timing(cfg: JobConfig, vocab_size: int, repeats: int = 2) -> CpuTiming:
    """Time the model cut to one and to two blocks; their difference is one block.

    Timing the real modules (not just their matmuls) counts the element-wise work too: norms, RoPE,
    activations, casts and the loss, which on CPU take a large share of a small model's step.
    """
    one, one_opt = _time_model(cfg, 1, vocab_size, repeats)
    two, two_opt = _time_model(cfg, 2, vocab_size, repeats)
    block, block_opt = max(two - one, 0.0), max(two_opt - one_opt, 0.0)
    return CpuTiming(block=block, rest=max(one - block, 0.0), optimizer_per_layer=block_opt,
                     optimizer_rest=max(one_opt - block_opt, 0.0))


def recomputed_fraction(cfg: JobConfig, n_layers: int) -> float:
    """Share of the blocks' forward that activation checkpointing runs a second time."""
    ac = cfg.activation_checkpoint
    if ac.mode == "none":
        return 0.0
    if ac.mode == "full":
        return 1.0
    if ac.selective_ac_option == "op":
        return 0.5  # about half the matmuls are recomputed
    return math.ceil(n_layers / int(ac.selective_ac_option)) / n_layers


def cpu_step_seconds(m: ModelShape, cfg: JobConfig, layout: ParallelDims, timing: CpuTiming) -> float:
    """Step time on CPU from the measured parts: blocks (with recomputation, a third of their
    forward + backward), the rest, and the optimizer, for this device's share of layers and tokens.
    Communication between CPU processes is not modelled."""
    layers = m.n_layers / layout.pp
    per_micro = layers * timing.block * (1 + recomputed_fraction(cfg, m.n_layers) / 3) + timing.rest
    per_micro /= layout.tp * layout.cp
    shard = layout.dp_shard * layout.cp * layout.tp
    optimizer = (layers * timing.optimizer_per_layer + timing.optimizer_rest) / shard
    return layout.grad_accum_steps(cfg.training) * per_micro + optimizer


def cpu_memory_gib() -> float:
    """The machine's RAM, the capacity on CPU."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    raise PlanError("cannot read MemTotal from /proc/meminfo")


def device_capacity_and_peak(device: str, compute_dtype: str) -> tuple[float, float]:
    """(memory GiB, peak TFLOP/s in compute_dtype) of one device."""
    if device == "CPU":
        return cpu_memory_gib(), cpu_machine_peak_tflops(DTYPES[compute_dtype])
    if device not in DEVICE_MEMORY_GIB:
        raise PlanError(f"device {device!r} is unknown; valid: {', '.join([*DEVICE_MEMORY_GIB, 'CPU'])}")
    peak = gpu_peak_tflops(DEVICE_PEAK_NAMES[device], compute_dtype)
    if peak is None:
        raise PlanError(f"no peak FLOP/s known for {device} in {compute_dtype}")
    return DEVICE_MEMORY_GIB[device], peak


def cpu_timing_risk(m: ModelShape, memory: Memory, capacity_gib: float) -> str | None:
    """Why timing the model on this CPU could exhaust the machine, or None when it is safe.

    The calibration builds the real-width model with one and two blocks and trains it for a few steps,
    so it needs about what the prediction says for two blocks plus the embedding and output.
    """
    if memory.total > capacity_gib * GIB:
        return "the run does not fit this machine's memory, so timing it could exhaust it"
    if m.block_params > CPU_TIMING_MAX_BLOCK_PARAMS:
        return (f"one block has {m.block_params / 1e6:,.0f}M parameters "
                f"(over {CPU_TIMING_MAX_BLOCK_PARAMS / 1e6:.0f}M), too large to time safely on a CPU")
    return None


def plan(cfg: JobConfig, device: str, world_size: int = 1, efficiency: float | None = None,
         vocab_size: int | None = None, cpu_timing: CpuTiming | None = None, generate_batch: int | None = None,
         generate_length: int | None = None) -> Plan:
    """The prediction for ``cfg`` on ``world_size`` devices of kind ``device``.

    On CPU the step time comes from the model's parts timed now (``cpu_timing`` passes them in
    instead), unless ``efficiency`` is given, which applies to the matmul peak. The generation cache is sized for
    ``generate_batch`` rows (default training.local_batch_size) of ``generate_length`` slots: the batch's longest
    prompt plus its most new tokens (default training.seq_len, where the engine stops a row of equal prompts).
    """
    t = cfg.training
    # A GRPO run's sampler generates each data-parallel rank's prompts x group_size rows (resolve_layout gives dp).
    rollout_rows = (cfg.rl.prompts_per_step // resolve_layout(cfg, world_size).dp * cfg.rl.group_size
                    if t.objective == "grpo" else t.local_batch_size)
    generate_batch = rollout_rows if generate_batch is None else generate_batch
    generate_length = t.seq_len if generate_length is None else generate_length
    if generate_batch < 1:
        raise PlanError(f"generate_batch = {generate_batch} is invalid; it must be >= 1")
    # A prompt has at most seq_len - 1 tokens, and a row at most seq_len - 1 new ones (the model's max_seq_len).
    if not 1 <= generate_length <= 2 * t.seq_len - 2:
        raise PlanError(f"generate_length = {generate_length} is invalid; it must be in [1, {2 * t.seq_len - 2}]: "
                        f"the longest prompt plus the most new tokens, each at most training.seq_len - 1 = "
                        f"{t.seq_len - 1}")
    device = device.upper() if device.upper() in (*DEVICE_MEMORY_GIB, "CPU") else device
    cfg = _with_compute_dtype(cfg, "cpu" if device == "CPU" else "cuda")
    dtype = cfg.training.mixed_precision_param
    capacity, peak = device_capacity_and_peak(device, cfg.training.mixed_precision_param)
    layout = resolve_layout(cfg, world_size)
    m = model_shape(cfg, vocab_size)
    memory = predict_memory(m, cfg, layout, on_cpu=device == "CPU")
    tokens, matmul, attention = step_flops_per_device(m, cfg, layout)
    if efficiency is not None and not 0 < efficiency <= 1:
        raise PlanError(f"efficiency = {efficiency} is invalid; it must be in (0, 1]")
    if device == "CPU" and efficiency is None:
        unsafe = cpu_timing_risk(m, memory, capacity) if cpu_timing is None else None
        if unsafe:
            step_time = None
            speed = f"not measured: {unsafe}; pass --efficiency to estimate it from the peak instead"
        else:
            timing = cpu_timing or measure_cpu_timing(cfg, m.vocab)
            step_time = cpu_step_seconds(m, cfg, layout, timing)
            speed = (f"from a block timed at {timing.block * 1e3:.1f} ms, the rest at {timing.rest * 1e3:.1f} ms "
                     f"per micro-batch on this CPU")
    else:
        efficiency = efficiency or GPU_EFFICIENCY
        step_time = (matmul + attention) / (peak * 1e12 * efficiency)
        speed = f"at {efficiency:.0%} of peak"
    return Plan(device=device, capacity_gib=capacity, layout=layout, memory=memory, tokens_per_device=tokens,
                flops_per_device=matmul + attention, peak_tflops=peak, speed=speed, step_time_s=step_time,
                compute_dtype=dtype, moe=moe_summary(m, cfg, layout),
                generation=generation_summary(m, generate_batch, generate_length, dtype, layout.tp))


def _with_compute_dtype(cfg: JobConfig, device_type: str) -> JobConfig:
    """``cfg`` with training.mixed_precision_param = "auto" resolved as the trainer resolves it on that device."""
    dtype, _ = resolve_compute_dtype(cfg.training.mixed_precision_param, device_type)
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, mixed_precision_param=dtype))


def predicted_memory(cfg: JobConfig, device_type: str, world_size: int, vocab_size: int) -> Memory:
    """The plan's memory for the busiest device alone (no step timing), for a run to log beside what it measures."""
    cfg = _with_compute_dtype(cfg, device_type)
    return predict_memory(model_shape(cfg, vocab_size), cfg, resolve_layout(cfg, world_size),
                          on_cpu=device_type == "cpu")


def generation_cache_bytes(m: ModelShape, rows: int, length: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes the generation engine's caches hold on one device for ``rows`` rows of ``length`` slots each (a batch's
    longest prompt plus its most new tokens): each layer's cache's own bytes_per_row (generation/caches.py), on one
    of ``tp`` tensor-parallel ranks."""
    return rows * mixers_bytes_per_row(m.mixers, length, dtype, tp)


def generation_summary(m: ModelShape, rows: int, length: int, dtype: str, tp: int) -> str:
    """The plan's generation cache line."""
    if m.no_generation_cache:
        return f"generation cache: - ({m.no_generation_cache})"
    total = generation_cache_bytes(m, rows, length, DTYPES[dtype], tp)
    return (f"generation cache: {_size(total)} per device for {rows} row{'s' if rows != 1 else ''} x {length:,} tokens "
            f"(prompt + new) in {dtype}, {_size(total / rows)} per row (--generate_batch, --generate_length)")


def _size(n: float) -> str:
    """Bytes in the largest of GiB, MiB, KiB that keeps the number >= 1 (the debug models' caches are KiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{n:,.0f} bytes"


def moe_summary(m: ModelShape, cfg: JobConfig, layout: ParallelDims) -> str | None:
    """Experts per EP rank, their memory per device, and the all-to-all volume per step."""
    if not m.moe_layers:
        return None
    s = DTYPES[cfg.training.dtype].itemsize
    local = m.experts // layout.ep
    # Stored sharded like everything else (over ep x the experts' FSDP = dp_shard x cp, and tp); the gradient
    # and the optimizer's states add to the parameters' bytes (states in the parameters' bytes: a bfloat16
    # moment of a float32 weight counts half).
    stored = m.routed_params * m.moe_layers / layout.pp / (layout.dp_shard * layout.cp * layout.tp) * s
    stack = stored / s / max(1, 3 * m.moe_layers / layout.pp)  # elements of one of a block's three expert stacks
    states = state_bytes(cfg.optimizer, cfg.training.dtype, stack, muon=True) / (stack * s) if stack else 0.0
    volume = all_to_all_bytes(m, cfg, layout)
    split = (f"{local} per EP rank (ep {layout.ep}, FSDP-sharded {layout.efsdp} ways more)" if layout.ep > 1 else
             f"no expert parallelism (FSDP-sharded {layout.fsdp_degree} ways)")
    return (f"experts: {m.experts} per MoE block, {split}; expert weights {stored / GIB:.3f} GiB per device "
            f"({stored * (2 + states) / GIB:.3f} GiB with gradients and optimizer state); "
            f"all-to-all {volume / GIB:.3f} GiB sent per device per step")


def format_plan(p: Plan) -> str:
    mem = p.memory
    rows = [
        ("parameters", mem.params), ("gradients", mem.grads), ("optimizer state", mem.optimizer),
        ("activations", mem.activations), ("transient buffers", mem.transient),
        *([("rl ref. + sampler", mem.rl)] if mem.rl else []), ("total", mem.total),
    ]
    lay = p.layout
    lines = [
        f"device: {p.device} ({p.capacity_gib:.1f} GiB, {p.peak_tflops:.3g} TFLOP/s {p.compute_dtype} peak)   "
        f"layout: world {lay.world_size} = dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x "
        f"cp {lay.cp} x tp {lay.tp} x pp {lay.pp}" + (f" (ep {lay.ep} within dp_shard x cp)" if lay.ep > 1 else ""),
        "",
        f"| {'memory per device':<20} | {'GiB':>10} |",
        f"|{'-' * 22}|{'-' * 12}|",
        *(f"| {name:<20} | {value / GIB:>10.3f} |" for name, value in rows),
        "",
        f"peak phase: {mem.peak_phase}",
        f"step time: {'-' if p.step_time_s is None else f'{p.step_time_s:.3f} s'}  "
        f"({p.tokens_per_device:,.0f} tokens/device, {p.flops_per_device / 1e12:.3f} TFLOP/device, {p.speed})",
        *([p.moe] if p.moe else []),
        *([p.generation] if p.generation else []),
    ]
    if p.fits:
        share = mem.total / GIB / p.capacity_gib
        lines.append(f"fits: {mem.total / GIB:.2f} of {p.capacity_gib:.1f} GiB ({share:.0%})")
    else:
        lines.append(f"DOES NOT FIT: needs {mem.total / GIB:.2f} GiB per device, the {p.device} has "
                     f"{p.capacity_gib:.1f} GiB")
    return "\n".join(lines)
