"""What a checkpoint holds of each part of a run, as torch Stateful objects: the run's progress, the model's
weights, the optimizer state, the schedule's position and the dataloader's. The checkpoint manager
(checkpoint.py) saves and loads them together."""

import json
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.models.shared.nf4 import is_nf4
from torchtitan.models.shared.seeded_init import assign_whole_, canonical_name


@dataclass
class TrainState(Stateful):
    """Progress of the run, kept as tensors so that restoring it needs no unpickling."""

    step: int = 0
    tokens_seen: int = 0
    rng: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        state = {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen),
                 "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])


class ModelState(Stateful):
    """The parameters (and buffers) of every model part, under the names of the unwrapped model; only those
    ``include(name)`` accepts (a fine-tuning run's checkpoints leave the frozen base out, components/checkpointing/frozen_base.py,
    and its base loads leave the adapters out)."""

    def __init__(self, model_parts: list[nn.Module], include=lambda name: True, loading_only: bool = False):
        self.model_parts = model_parts
        self.include = include
        self.loading_only = loading_only  # see state_dict

    def _tensors(self) -> dict[str, torch.Tensor]:
        state = {}
        for part in self.model_parts:
            state.update({name: t for name, t in get_model_state_dict(part).items() if self.include(name)})
        return state

    def state_dict(self) -> dict:
        state = self._tensors()
        if not self.loading_only:
            return state
        # An NF4 weight (a QLoRA base) is loaded whole, as a plain tensor of its shape on the host, even where FSDP
        # shards it: load_state_dict then quantises the whole weight and keeps this rank's slice (in_groups bounds
        # how many are whole at once).
        return {name: torch.empty(t.shape, dtype=t.dtype, device="cpu") if is_nf4(_local(t)) else t
                for name, t in state.items()}

    def shapes(self) -> dict[str, torch.Size]:
        """The shape of every weight and buffer, nothing allocated."""
        return {name: t.shape for name, t in self._tensors().items()}

    def in_groups(self) -> list["ModelState"]:
        """These weights as states loaded one after another: a QLoRA base's NF4 weights a block at a time (each is
        read whole, in training.dtype, before it is quantised: the whole base at once would need the unquantised
        model on every rank), everything else in one."""
        nf4 = {name for name, t in self._tensors().items() if is_nf4(_local(t))}
        if not nf4:
            return [self]
        blocks: dict[str, set[str]] = {}  # "layers.N" -> its NF4 weights
        for name in nf4:
            blocks.setdefault(".".join(name.split(".")[:2]), set()).add(name)
        groups = [lambda name: self.include(name) and name not in nf4]
        groups += [lambda name, names=names: name in names for names in blocks.values()]
        return [ModelState(self.model_parts, include, self.loading_only) for include in groups]

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model_parts, state, StateDictOptions(strict=False))

    def refusal(self, metadata) -> str | None:
        """A one-line reason why a DCP checkpoint (its ``metadata``) cannot fill these model parts, else None:
        weights it lacks, or holds in another shape."""
        saved = {name.split(".", 1)[1]: entry for name, entry in metadata.state_dict_metadata.items()
                 if name.startswith("model.")}
        if reason := self.missing_from(saved):
            return reason
        for name, shape in self.shapes().items():
            size = getattr(saved.get(name), "size", None)
            if size is not None and tuple(size) != tuple(shape):
                return (f"it holds {name} with shape {list(size)}, but the model needs {list(shape)}: it was "
                        "saved from a model of another size (check model.flavor)")
        return None

    def missing_from(self, available) -> str | None:
        """A one-line reason when weights of these model parts are not among ``available`` names, else None."""
        missing = sorted({canonical_name(name) for part in self.model_parts for name, _ in part.named_parameters()
                          if self.include(canonical_name(name))} - set(available))
        if not missing:
            return None
        return (f"it holds no {missing[0]}" + (f" (nor {len(missing) - 1} more weights)" if len(missing) > 1 else "")
                + ": it was saved from a model built differently (model.flavor, or model.mtp_depth: multi-token "
                "prediction blocks are layers.{n_layers}...; set model.mtp_depth = 0 to go on without them)")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def load_model_state(model_parts: list[nn.Module], state: dict[str, torch.Tensor], options: StateDictOptions) -> None:
    """``state`` (names of the unwrapped model) into the model parts, as set_model_state_dict loads it; an NF4 weight
    (a QLoRA base) takes its whole value, quantised once and sliced (seeded_init.assign_whole_), never a slice
    quantised on its own."""
    state = dict(state)
    for part in model_parts:
        for name, param in part.named_parameters():
            if is_nf4(_local(param)) and (value := state.pop(canonical_name(name), None)) is not None:
                assign_whole_(param, value)
    for part in model_parts:
        set_model_state_dict(part, state, options=options)


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter name ("state.layers.0.….exp_avg"), one entry per parameter.

    Flattened so that every rank contributes only its own parameters' entries: with pipeline
    parallelism the ranks hold different parameters, and the checkpoint loads under any layout.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer):
        from torchtitan.distributed.pipeline_parallel import merged_view

        self.model, self.optimizer = merged_view(model_parts), optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.OPTIONS)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self.OPTIONS)

    def refusal(self, metadata) -> str | None:
        """A one-line reason when the checkpoint's optimizer state is another optimizer's (other state names,
        e.g. AdamW's exp_avg where Muon keeps momentum_buffer), else None."""
        def kinds(names) -> set[str]:
            return {name.rsplit(".", 1)[1] for name in names if name.startswith("state.")}

        saved = kinds(name.split(".", 1)[1] for name in metadata.state_dict_metadata if name.startswith("optimizer."))
        ours = kinds(self.state_dict())
        if not saved or saved == ours:
            return None
        return (f"its optimizer state holds {', '.join(sorted(saved))} but this run's optimizer keeps "
                f"{', '.join(sorted(ours))}: it was saved with another optimizer.name; load the model alone "
                "(checkpoint.exclude_from_loading = ['optimizer'])")


class LRSchedulerState(Stateful):
    """Only the count of completed steps: the schedule (a LambdaLR) is rebuilt from the config."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return {"last_epoch": torch.tensor(self.scheduler.last_epoch)}

    def load_state_dict(self, state: dict) -> None:
        completed = int(state["last_epoch"])
        scheduler = self.scheduler
        scheduler.last_epoch = completed
        scheduler._step_count = completed + 1
        # Recompute the next step's lr from the schedule rather than trusting load order against the optimizer.
        lrs = [base * fn(completed) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs


class DataLoaderState(Stateful):
    """The dataloader's state (stream position, counts), the same on every rank, as UTF-8 JSON in a uint8 tensor.

    JSON because a mixture's position has an entry per source; ints and strings only, so nothing is pickled.
    DCP loads into tensors of the stored size, so a load first sizes the destination from the metadata
    (``prepare_load``). Checkpoints written before this format hold three ints under ``stream_position``.
    """

    KEY, BLOCK = "state_json", 1024
    LEGACY_KEY, LEGACY_FIELDS = "stream_position", ("epoch", "document", "offset")

    def __init__(self, dataloader):
        self.dataloader = dataloader
        self._stored: tuple[str, int] | None = None  # (key, length) of what the checkpoint being loaded holds

    def prepare_load(self, metadata) -> None:
        entries = metadata.state_dict_metadata
        for key in (self.KEY, self.LEGACY_KEY):
            if f"dataloader.{key}" in entries:
                self._stored = key, int(entries[f"dataloader.{key}"].size[0])
                return
        raise CheckpointError(f"the checkpoint holds no dataloader state (expected dataloader.{self.KEY})")

    def state_dict(self) -> dict:
        if self._stored is not None:  # a destination for loading
            key, length = self._stored
            return {key: torch.zeros(length, dtype=torch.uint8 if key == self.KEY else torch.int64)}
        text = json.dumps(self.dataloader.state_dict(), sort_keys=True).encode()
        # Padded (JSON allows trailing spaces) to whole blocks, so the size, and the async stager's buffer for
        # it, rarely changes from one save to the next.
        text = text.ljust(-(-len(text) // self.BLOCK) * self.BLOCK)
        return {self.KEY: torch.frombuffer(bytearray(text), dtype=torch.uint8)}

    def load_state_dict(self, state: dict) -> None:
        self._stored = None
        if self.LEGACY_KEY in state:
            values = state[self.LEGACY_KEY].tolist()
            self.dataloader.load_state_dict({"stream_position": dict(zip(self.LEGACY_FIELDS, values))})
        else:
            self.dataloader.load_state_dict(json.loads(bytes(state[self.KEY].tolist()).decode()))
