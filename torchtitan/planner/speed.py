"""Step time: the FLOPs a device executes per step (recomputation included), the devices' capacity and peak, and on CPU a
short calibration that times the model itself cut to one and to two blocks (attention kernels and element-wise work
run far below the matmul peak there, so no single efficiency fits)."""

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from torchtitan.components.metrics.peak_flops import (
    cpu_machine_peak_tflops,
    gpu_peak_tflops,
)
from torchtitan.components.objectives.loss import build_cross_entropy_loss
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.hardware import DTYPES
from torchtitan.planner.layout import PlanError
from torchtitan.planner.memory import GIB, Memory
from torchtitan.planner.model_shape import ModelShape
from torchtitan.protocols.train_spec import (
    flavor_args,
    get_train_spec,
)

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
