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

The parts: layout.py (the parallel degrees), model_shape.py (what the model is), memory.py, speed.py; here they
are put together into a Plan and its printed table.
"""

import dataclasses
from dataclasses import dataclass

from torchtitan.components.optimizers.optimizer import state_bytes
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.precision import resolve_compute_dtype
from torchtitan.hardware import DTYPES
from torchtitan.planner.layout import PlanError, layout_problem, resolve_layout, smallest_world_size
from torchtitan.planner.memory import (
    GIB,
    Memory,
    gathered_block_params,
    generation_cache_bytes,
    layer_activation_bytes,
    pipeline_ranks,
    predict_memory,
)
from torchtitan.planner.model_shape import NF4_BYTES, ModelShape, model_shape
from torchtitan.planner.speed import (
    DEVICE_MEMORY_GIB,
    GPU_EFFICIENCY,
    CpuTiming,
    all_to_all_bytes,
    cpu_step_seconds,
    cpu_timing_risk,
    device_capacity_and_peak,
    measure_cpu_timing,
    step_flops_per_device,
)

# What callers use: the plan and its parts (layout, shape, memory, speed).
__all__ = [
    "DEVICE_MEMORY_GIB", "GIB", "GPU_EFFICIENCY", "NF4_BYTES", "CpuTiming", "Memory", "ModelShape", "Plan", "PlanError",
    "all_to_all_bytes", "cpu_step_seconds", "format_plan", "gathered_block_params", "generation_cache_bytes",
    "layer_activation_bytes", "layout_problem", "measure_cpu_timing", "model_shape", "pipeline_ranks", "plan",
    "predict_memory", "predicted_memory", "resolve_layout", "smallest_world_size",
]


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
        (f"step time: {'-' if p.step_time_s is None else f'{p.step_time_s:.3f} s'}  "
         f"({p.tokens_per_device:,.0f} tokens/device, {p.flops_per_device / 1e12:.3f} TFLOP/device, {p.speed})"),
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
