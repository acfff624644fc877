"""Where metric rows go besides the console: metrics.jsonl, TensorBoard and Weights & Biases."""

import json
import os
from pathlib import Path


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
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder), max_queue=100)

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
        import wandb

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
