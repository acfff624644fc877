"""The --device option of the single-process scripts (generate.py, evaluate.py): one parser, one set of errors."""

import torch

from torchtitan.distributed.device import device_type

# The trainer runs on CUDA GPUs or the CPU (torchtitan.distributed.device), so these are the devices
# a checkpoint can be loaded on with the same kernels and precision.
VALID = "cpu, cuda or cuda:N"


def default_device() -> str:
    """'cuda' where a GPU is usable, else 'cpu' (the trainer's choice)."""
    return device_type()


def parse_device(value: str, flag: str = "--device") -> torch.device:
    """``value`` as a torch.device this machine has; ValueError naming ``flag`` otherwise."""
    try:
        device = torch.device(value)
    except RuntimeError:  # torch lists every device type it knows; name the ones that make sense here
        raise ValueError(f"{flag} {value} is invalid; valid: {VALID}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {value} is not supported; valid: {VALID}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {value} asks for CUDA, which this machine does not have; use cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{flag} {value} is invalid; this machine has {count} CUDA device(s): "
                             f"cuda:0..cuda:{count - 1}")
    return device
