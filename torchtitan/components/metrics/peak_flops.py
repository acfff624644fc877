"""Peak FLOP/s of one device, for MFU: a table for known GPUs, a measured calibration on CPU.

A device we know nothing about gets no peak (MFU is not reported) rather than another device's.
"""

import time
from collections.abc import Callable

import torch

from torchtitan.cache import cache_dir, measured_once
from torchtitan.hardware import cpu_model, usable_cores
from torchtitan.log import logger

# Dense (no sparsity) peak TFLOP/s from vendors' data sheets, by compute dtype.
# Longest names first: "H100 PCIe" must match before "H100".
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0},
    "H100 NVL": {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H800": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "GH200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "B200": {"bfloat16": 2250.0, "float16": 2250.0, "float32": 80.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "A800": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6},
    "A10G": {"bfloat16": 70.0, "float16": 70.0, "float32": 31.2},
    "MI300X": {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4},
    "MI325X": {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4},
    "MI250X": {"bfloat16": 383.0, "float16": 383.0, "float32": 95.7},
}

# Square matmul sizes, smallest first: each size's throughput predicts how long the next one takes.
CALIBRATION_SIZES = (256, 1024, 2048, 4096)
# Rounds over all sizes: on a shared VM a neighbour can halve the matmul throughput for seconds at a
# time (seen on a 2-core AMX VM: ~1.0 vs ~2.1 TFLOP/s bf16), and the best round is the device's peak.
CALIBRATION_ROUNDS = 3
# The whole measurement stays within this many seconds: where a dtype is slow (bf16 without native
# support: ~0.7 GFLOP/s, one 4096^2 matmul ~3 minutes) the large sizes are skipped, not waited for.
CALIBRATION_BUDGET_SECONDS = 3.0
CALIBRATION_VERSION = 3
CACHE_FILE = "cpu_peak_tflops.json"


def gpu_peak_tflops(device_name: str, dtype: str) -> float | None:
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return GPU_PEAK_TFLOPS[key].get(dtype)
    return None


def measure_matmul_tflops(dtype: torch.dtype, threads: int, budget_seconds: float = CALIBRATION_BUDGET_SECONDS,
                          rounds: int = CALIBRATION_ROUNDS, clock: Callable[[], float] = time.perf_counter,
                          matmul: Callable = torch.matmul) -> float:
    """Best square-matmul throughput (TFLOP/s) over sizes and rounds, with ``threads`` intra-op threads.

    Never starts a matmul that the throughput measured so far says would end past ``budget_seconds``;
    the smallest size always runs, so there is a number even on the slowest machine.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    deadline = clock() + budget_seconds
    slice_seconds = budget_seconds / (rounds * len(CALIBRATION_SIZES))
    operands: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    best = rate = 0.0  # FLOP/s: the best so far, and the last size's

    def fits(flops: float) -> bool:
        # Predicted at half the last size's rate: a slow kernel path can lose speed as sizes grow (bf16
        # on an AVX2-only CPU: ~3 GFLOP/s at 256^2, ~0.7 at 1024^2).
        return rate > 0 and clock() + 2 * flops / rate <= deadline

    try:
        for _ in range(rounds):
            for n in CALIBRATION_SIZES:
                flops = 2 * n**3
                if rate > 0 and not fits(flops * (1 if n in operands else 2)):  # a new size runs a warm-up too
                    break  # larger sizes take longer still
                if n not in operands:
                    operands[n] = (torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype))
                    matmul(*operands[n])  # warm-up: kernel selection and page faults
                start, count = clock(), 0
                while True:
                    matmul(*operands[n])
                    count += 1
                    elapsed = clock() - start
                    rate = flops * count / elapsed if elapsed > 0 else float("inf")
                    if elapsed >= slice_seconds or not fits(flops):
                        break
                best = max(best, rate)
        return best / 1e12
    finally:
        torch.set_num_threads(previous)


def cpu_machine_peak_tflops(dtype: torch.dtype) -> float:
    """Matmul peak of the whole machine (all cores) in ``dtype``, measured once and cached (concurrent ranks
    wait for one measurement)."""
    cores = usable_cores()
    key = f"v{CALIBRATION_VERSION}|{cpu_model()}|{cores} cores|torch {torch.__version__}|{dtype}"

    def measure() -> float:
        logger.info(f"measuring this CPU's {str(dtype).removeprefix('torch.')} matmul peak for MFU "
                    f"(at most {CALIBRATION_BUDGET_SECONDS:.0f} s, once per machine)")
        return measure_matmul_tflops(dtype, cores)

    peak, measured = measured_once(CACHE_FILE, key, measure)
    if measured:
        logger.info(f"measured CPU {dtype} matmul peak: {peak:.3f} TFLOP/s on {cores} cores "
                    f"(cached in {cache_dir() / CACHE_FILE})")
    return peak


def device_peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    """Peak TFLOP/s available to this process in ``dtype``; None when it cannot be known."""
    if override is not None:
        return override
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, dtype_name)
        if peak is None:
            logger.warning(f"no peak FLOP/s known for '{name}' in {dtype_name}: MFU is not reported; "
                           f"set metrics.peak_tflops to enable it")
        return peak
    if device.type == "cpu":
        # The machine's peak scaled to the share of cores this process computes with.
        cores = usable_cores()
        return cpu_machine_peak_tflops(dtype) * min(torch.get_num_threads(), cores) / cores
    logger.warning(f"no peak FLOP/s known for device '{device.type}': MFU is not reported; "
                   f"set metrics.peak_tflops to enable it")
    return None
