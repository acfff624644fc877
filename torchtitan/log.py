"""The project's logger: one line per message, rank 0 only unless asked otherwise."""

import logging
import sys

logger = logging.getLogger("torchtitan")


def init_logger(rank: int = 0, all_ranks: bool = False) -> None:
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank{rank}] " if all_ranks else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False


def one_line(error: BaseException) -> str:
    """An exception as one line for an error message: its type and the first line of its text."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def quiet_torchao_import() -> None:
    """Before importing torchao: on CPU-only machines it reports its optional CUDA kernels failing to load, and torch
    warns about an enum torchao registers with pytree; both are expected and not the user's to act on."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
