"""Per-device memory of a training step, term by term (docs/planning.md lists the saved tensors op by op): parameters,
gradients, optimizer state, the activations each block saves for backward and the transient buffers at the peak,
per pipeline rank from the trainer's own stage split; and the generation engine's caches."""

import math
from dataclasses import dataclass

import torch

from torchtitan.components.optimizers.optimizer import state_bytes
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.precision import uses_autocast
from torchtitan.generation.caches import mixers_bytes_per_row
from torchtitan.hardware import DTYPES
from torchtitan.models.shared import amx_attention
from torchtitan.models.shared.gated_delta_rule import CHUNK
from torchtitan.planner.layout import PlanError
from torchtitan.planner.model_shape import ModelShape

GIB = 2**30


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
    from torchtitan.distributed import (
        pipeline_parallel as pipe,  # imports torch.distributed.pipelining
    )

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


def generation_cache_bytes(m: ModelShape, rows: int, length: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes the generation engine's caches hold on one device for ``rows`` rows of ``length`` slots each (a batch's
    longest prompt plus its most new tokens): each layer's cache's own bytes_per_row (generation/caches.py), on one
    of ``tp`` tensor-parallel ranks."""
    return rows * mixers_bytes_per_row(m.mixers, length, dtype, tp)
