"""Host memory reuse for CPU training: keep freed pages in the process instead of returning them to the OS."""

import ctypes
import platform

from torchtitan.log import logger

# mallopt(3) parameters of glibc.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_KEEP = 2**31 - 1  # the largest value mallopt takes: "never" for trimming, "no mmap" for allocations


def keep_freed_host_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse; returns whether it applied (glibc only).

    By default glibc serves each allocation over 32 MiB with its own mmap, unmaps it on free and trims the
    heap's top, so every CPU training step page-faults its large activations and gradients in again. Measured
    on the debug model at 8 x 2048 (compiled, in-process A/B): 91k page faults per step and 1.96 s steps by
    default, none and 1.76 s with the heap kept. The cost: the heap holds on to the step's peak, and grows
    a few rounds before same-sized blocks reuse freed ones (peak RSS 3.42 instead of 3.23 GB, eager).
    """
    if platform.system() != "Linux":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    ok = all(mallopt(param, value) == 1 for param, value in
             ((_M_MMAP_THRESHOLD, _KEEP), (_M_TRIM_THRESHOLD, _KEEP), (_M_TOP_PAD, 1 << 30)))
    if not ok:
        logger.warning("glibc refused the malloc settings that keep freed memory; CPU steps may page-fault more")
    return ok
