"""What the benchmark scripts print: the environment line, and a markdown table shown row by row as it is
measured and optionally written to a file."""

from __future__ import annotations

import json
import pathlib
import platform
import statistics

import torch

from torchtitan.hardware import cpu_model


def environment() -> str:
    """torch, the GPU (or the CPU when there is none) and Python, in one line."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        device = f"no GPU: CPU {cpu_model()}, {torch.get_num_threads()} threads"
    return f"torch {torch.__version__}, {device}, Python {platform.python_version()}"


def median_of(rows: list[dict], key: str) -> float | None:
    """The median of ``key`` over the metrics rows that have it; None where none has (the trainer logs mfu as null
    on a GPU whose peak it does not know)."""
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.median(values) if values else None


def figure(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or n/a."""
    return "n/a" if value is None else format(value, spec)


def append_json(path: pathlib.Path | None, record: dict) -> None:
    """One measured row as one JSON line appended to ``path`` (nothing when None), written as it is measured so
    that a caller that stops the run early (scripts/gpu_check.py) keeps the rows done."""
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


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
