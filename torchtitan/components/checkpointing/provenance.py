"""What produced a run: code version, packages, layout and hardware, saved beside its metrics."""

import datetime
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from torchtitan.hardware import cpu_model

PACKAGES = ("torch", "torchdata", "tokenizers", "tiktoken", "numpy", "datasets", "tensorboard", "wandb",
            "torchao", "torchtitan")


def _git(*args: str) -> str | None:
    repo = Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(package: str) -> str | None:
    if package == "torch":
        return torch.__version__  # with the build's local tag (2.11.0+cu130), which the metadata drops
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_provenance(layout: dict, device: torch.device, compute_dtype: dict | None = None) -> dict:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    device_info = {"type": device.type, "threads_per_process": torch.get_num_threads()}
    if device.type == "cuda":
        device_info.update(name=torch.cuda.get_device_name(device), count=torch.cuda.device_count(),
                           cuda=torch.version.cuda)
    else:
        device_info.update(name=cpu_model(), cores=os.cpu_count())
    return {
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "hostname": socket.gethostname(),
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "python": sys.version.split()[0],
        "packages": {p: v for p in PACKAGES if (v := _version(p)) is not None},
        "layout": layout,
        "device": device_info,
        "compute_dtype": compute_dtype,
    }


def save_provenance(dump_folder: str, layout: dict, device: torch.device, compute_dtype: dict | None = None) -> Path:
    path = Path(dump_folder) / "provenance.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(collect_provenance(layout, device, compute_dtype), indent=2) + "\n")
    return path
