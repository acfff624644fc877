"""Peak FLOP/s of one device, for MFU: a table for known GPUs, a measured calibration on CPU.

A device we know nothing about gets no peak (MFU is not reported) rather than another device's.

MFU is never above 100%, by construction (``Peak.mfu``): the peak is at least every rate achieved, so when a
logged window computes faster than the peak, the peak is raised to that rate first (logged once), for this run:
the cache keeps only measured matmul rates, since a rate above the peak can as well mean a FLOP count that
overstates the work (the causal half of attention) as a calibration made while neighbours loaded the machine.
The thread count is part of the key, not a share of an all-core peak: a process computing on 1 of 2 cores runs
faster than half the machine (a single core clocks higher and has the caches and memory to itself), which the
share scaling took for more than 100% of its peak.
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
CALIBRATION_VERSION = 4  # 4: measured per thread count (3 scaled an all-core peak by the share of cores)
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


def cpu_threads() -> int:
    """The threads this process computes with (at most the cores it may run on)."""
    return min(torch.get_num_threads(), usable_cores())


def cpu_peak_key(dtype: torch.dtype, threads: int) -> str:
    machine = f"{cpu_model()}|{usable_cores()} cores"
    return f"v{CALIBRATION_VERSION}|{machine}|{threads} threads|torch {torch.__version__}|{dtype}"


def cpu_peak_tflops(dtype: torch.dtype, threads: int) -> float:
    """Matmul peak in ``dtype`` with ``threads`` threads on this machine: measured once and cached (concurrent
    ranks wait for one measurement), or the higher rate a training run achieved since (``Peak.mfu``)."""

    def measure() -> float:
        logger.info(f"measuring this CPU's {str(dtype).removeprefix('torch.')} matmul peak on {threads} thread(s) "
                    f"for MFU (at most {CALIBRATION_BUDGET_SECONDS:.0f} s, once per machine and thread count)")
        return measure_matmul_tflops(dtype, threads)

    peak, measured = measured_once(CACHE_FILE, cpu_peak_key(dtype, threads), measure)
    if measured:
        logger.info(f"measured CPU {dtype} matmul peak: {peak:.3f} TFLOP/s on {threads} thread(s) "
                    f"(cached in {cache_dir() / CACHE_FILE})")
    return peak


def cpu_machine_peak_tflops(dtype: torch.dtype) -> float:
    """Matmul peak of the whole machine (all cores) in ``dtype`` (the planner's)."""
    return cpu_peak_tflops(dtype, usable_cores())


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
        return cpu_peak_tflops(dtype, cpu_threads())
    logger.warning(f"no peak FLOP/s known for device '{device.type}': MFU is not reported; "
                   f"set metrics.peak_tflops to enable it")
    return None


class Peak:
    """The peak TFLOP/s this process's MFU divides by (``device_peak_tflops``; None: MFU is not reported), never
    below a rate the process achieved, so MFU <= 100%."""

    def __init__(self, device: torch.device, dtype: torch.dtype, override: float | None):
        self.tflops = device_peak_tflops(device, dtype, override)
        self.source = ("metrics.peak_tflops" if override is not None else
                       "this CPU's measured peak" if device.type == "cpu" else "the data sheet's peak")
        self.raised = False

    def mfu(self, achieved_tflops: float) -> float | None:
        """``achieved_tflops`` as a percentage of the peak, after raising the peak to it if it is higher."""
        if self.tflops is None:
            return None
        if achieved_tflops > self.tflops:
            before, self.tflops = self.tflops, achieved_tflops
            if not self.raised:
                self.raised = True
                logger.info(f"MFU: {achieved_tflops:.4g} TFLOP/s achieved is above {self.source} of {before:.4g}; "
                            "the peak is raised to it for this run (MFU is never above 100%; a CPU peak measured "
                            "under load is measured again once its cache file is deleted)")
        return 100.0 * achieved_tflops / self.tflops
