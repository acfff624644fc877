"""The data sections of the job config ([training.dataloader], [training.chat], [data]), beside the data
pipeline that reads them; config/job_config.py composes them into the schema."""

from dataclasses import dataclass
from typing import Literal

from torchtitan.config_fields import option


@dataclass
class DataLoader:
    num_workers: int = option(0, "Dataloader worker processes (0 = load in the training process)")
    persistent_workers: bool = option(False, "Keep workers alive between epochs")
    pin_memory: bool = option(False, "Pin host memory for faster host-to-device copies")
    prefetch_factor: int | None = option(None, "Batches each worker loads ahead")


@dataclass
class Chat:
    messages_column: str = option("messages", "Column holding each conversation: a list of {role, content}")
    train_on: Literal["assistant", "all"] = option(
        "assistant", "Tokens that carry loss: the assistant turns only, or every token of the conversation"
    )
    overlong: Literal["truncate", "drop"] = option(
        "truncate", "A conversation longer than seq_len is cut to seq_len tokens or left out (both counted)"
    )
    images_column: str = option("images", "Column holding each conversation's images (vision-language models): "
                                          "paths relative to the file, bytes or images, in the order shown")
    image_min_pixels: int = option(65536, "Images smaller than this many pixels are enlarged to it (aspect kept)")
    image_max_pixels: int = option(16777216, "Images larger than this many pixels are shrunk to it (aspect kept)")
    max_image_tokens: int = option(0, "Image tokens one conversation may hold; one with more is left out and "
                                      "counted (0: up to seq_len)")


@dataclass
class DataSource:
    name: str = option("", "Name of the source in metrics (data/tokens/NAME)")
    kind: Literal["text", "tokens"] = option("text", "text: documents tokenized on the fly; tokens: a shard folder")
    path: str | None = option(None, "File/folder (text) or shard folder (tokens), local or a URL; text without it: "
                                    "dataset")
    dataset: str = option("pydocs", "Registered text dataset, read when path is unset")
    weight: float = option(1.0, "Share of the sequences (weights are normalised over the sources)")


@dataclass
class DataStage:
    start_step: int = option(1, "First training step with these weights")
    weights: list[float] = option([], "One weight per [[data.sources]] entry, in order (0 leaves a source out)")


@dataclass
class Data:
    sources: list[DataSource] = option([], "A mixture of sources ([[data.sources]]); replaces training.dataset")
    stages: list[DataStage] = option([], "Weight changes at given steps ([[data.stages]]), e.g. for annealing")
    on_exhausted: Literal["repeat", "stop"] = option(
        "repeat", "A source that runs out starts over (its pass counter is logged) or ends the run"
    )
