"""Where metric rows go besides the console: metrics.jsonl, TensorBoard and Weights & Biases."""

import importlib
import json
import os
from pathlib import Path

from torchtitan.log import one_line


class MetricsBackendError(Exception):
    """An optional metrics backend cannot start (e.g. its package or one of its dependencies is missing)."""


# flag -> (module to import, package to install)
BACKENDS = {"metrics.enable_tensorboard": ("torch.utils.tensorboard", "tensorboard"),
            "metrics.enable_wandb": ("wandb", "wandb")}


def import_backend(flag: str):
    """Import the module an optional backend flag needs, or say in one line what is missing."""
    module, package = BACKENDS[flag]
    try:
        return importlib.import_module(module)
    except Exception as e:  # a missing package, or one whose own dependencies are missing or broken
        raise MetricsBackendError(f"{flag} needs {package}, which cannot be imported here ({one_line(e)}); "
                                  f"install it with its dependencies or turn {flag} off") from None


def config_problems(metrics) -> list[tuple[str, str]]:
    """The [metrics] backends that are on but cannot be imported, checked on every rank before training (only
    rank 0 writes them, so finding out there would leave the other ranks waiting in a collective)."""
    problems = []
    for flag in BACKENDS:
        if getattr(metrics, flag.split(".")[1]):
            try:
                import_backend(flag)
            except MetricsBackendError as e:
                problems.append((flag, str(e).removeprefix(f"{flag} ")))
    return problems


class JsonlBackend:
    """Appends one flushed JSON object per row, so a crash loses nothing already logged."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardBackend:
    """One scalar series per metric, e.g. loss/train, written as event files."""

    def __init__(self, folder: Path):
        tensorboard = import_backend("metrics.enable_tensorboard")
        self.writer = tensorboard.SummaryWriter(log_dir=str(folder), max_queue=100)

    def log(self, row: dict) -> None:
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run; WANDB_MODE=offline writes it to disk for a later ``wandb sync``."""

    def __init__(self, dump_folder: Path, project: str | None, run_name: str | None, config: dict,
                 group: str | None):
        wandb = import_backend("metrics.enable_wandb")
        dump_folder.mkdir(parents=True, exist_ok=True)
        # W&B writes its runs into {dir}/wandb/.
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "torchtitan",
            name=run_name or os.environ.get("WANDB_NAME") or dump_folder.resolve().name,
            dir=str(dump_folder),
            config=config,
            group=group,
            reinit="create_new",
        )

    def log(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def close(self) -> None:
        self.run.finish()
