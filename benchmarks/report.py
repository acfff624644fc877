"""What the benchmark scripts print: the environment line, and a markdown table shown row by row as it is
measured and optionally written to a file."""

from __future__ import annotations

import pathlib
import platform

import torch

from torchtitan.hardware import cpu_model


def environment() -> str:
    """torch, the GPU (or the CPU when there is none) and Python, in one line."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        device = f"no GPU: CPU {cpu_model()}, {torch.get_num_threads()} threads"
    return f"torch {torch.__version__}, {device}, Python {platform.python_version()}"


class Table:
    """Heading lines printed at once; rows printed and written to ``output`` as they come, so a run cut short
    keeps what it measured."""

    def __init__(self, heading: list[str], output: pathlib.Path | None):
        self.lines = list(heading)
        self.output = output
        print("\n".join(self.lines), flush=True)

    def add(self, row: str) -> None:
        self.lines.append(row)
        print(row, flush=True)
        self.close()

    def close(self) -> None:
        if self.output:
            self.output.write_text("\n".join(self.lines) + "\n")
