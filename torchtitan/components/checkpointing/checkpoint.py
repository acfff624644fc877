"""Distributed checkpoints: save, auto-resume, async writes, atomic completion, model-only exports.

Layout under ``{job.dump_folder}/{checkpoint.folder}`` (or checkpoint.folder alone when it is an absolute path
or a URL such as ``s3://bucket/run``; see checkpoint_storage.py for how completion is marked there):

    step-20/            a complete checkpoint (DCP: one .metadata file plus shard files)
    step-0/             a seed checkpoint (checkpoint.create_seed_checkpoint): the initial weights only
    step-30.partial/    a checkpoint being written; renamed to step-30/ only once every rank is done
                        (under a URL: written as step-30/, complete once step-30/.complete exists)
    export-step-40/     model weights only, in checkpoint.export_dtype (beside step-40/, not instead of it):
                        DCP, or with checkpoint.last_save_in_hf a Hugging Face folder (config.json,
                        model.safetensors, tokenizer files) that transformers loads

What we store ourselves is a tensor (steps, token counts, RNG states, the dataloader's stream position).
Two things in a checkpoint are pickles, and neither is unpickled freely (checkpoint_storage.py): DCP's .metadata
file, read with an unpickler that admits only the classes DCP metadata is made of, and the optimizer's param
groups (learning rates, betas, flags), which DCP stores as pickled bytes, read with torch.load's weights-only
unpickler. Weights from elsewhere should come in as Hugging Face safetensors.
"""

import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpointing.frozen_base import BaseFingerprint, frozen_names
from torchtitan.components.checkpointing.hf_folder import read_hf_model_state, write_hf_folder
from torchtitan.components.checkpointing.states import (
    DataLoaderState,
    LRSchedulerState,
    ModelState,
    OptimizerState,
    TrainState,
    load_model_state,
)
from torchtitan.components.checkpointing.storage import (
    CheckpointError,
    SafeLoadPlanner,
    checkpoint_location,
    complete_steps,
    open_storage,
    reader_for,
    verify_checkpoint,
    writer_for,
)
from torchtitan.components.lora.peft_adapter import write_lora_export
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.hardware import DTYPES
from torchtitan.log import logger, one_line
from torchtitan.models.shared.lora import adapter_settings, is_adapter_param
from torchtitan.remote import RemoteError, fetched_folder, is_url, url_problem

__all__ = ["CheckpointError", "CheckpointManager", "TrainState", "complete_steps", "config_problems"]

STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "guard", "base", "fault_tolerance",
              "reference")
# Added after the first checkpoints were written, or kept by some runs only (the frozen base's fingerprint):
# loaded when the checkpoint has them, else left fresh.
OPTIONAL_KEYS = ("guard", "base", "fault_tolerance", "reference")  # reference: GRPO's frozen model (rl/reference.py)
SEED_STEP = 0  # step-0 is a seed checkpoint: the initial model weights, nothing else
# A single process needs no process group to save or load; DCP warns about that every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def config_problems(cfg: CheckpointConfig, world_size: int, model_name: str,
                    has_hf_adapter: bool) -> list[tuple[str, str]]:
    """Problems with the [checkpoint] section as (field, reason) pairs, in the order they are checked."""
    problems = []

    def require(field: str, ok: bool, reason: str) -> None:
        if not ok:
            problems.append((field, reason))

    require("interval", cfg.interval > 0, "is invalid; it must be > 0")
    require("keep_latest_k", cfg.keep_latest_k >= 0, "is invalid; it must be >= 0 (0 keeps all)")
    unknown = [k for k in cfg.exclude_from_loading if k not in STATE_KEYS]
    require("exclude_from_loading", not unknown, f"names unknown state {unknown}; valid: {', '.join(STATE_KEYS)}")
    for name, location in (("folder", cfg.folder), ("initial_load_path", cfg.initial_load_path)):
        problem = url_problem(location) if is_url(location) else None
        require(name, problem is None, str(problem))
    if cfg.discard_newer_steps:
        require("discard_newer_steps", cfg.load_step != -1, "does nothing without checkpoint.load_step (the run "
                "resumes from the newest checkpoint); set load_step, or leave discard_newer_steps out")
        require("discard_newer_steps", not cfg.load_only, "deletes checkpoints, but checkpoint.load_only = true "
                "never writes any; leave one of them out")
    if cfg.initial_load_path is not None:
        # Read by the checkpoint manager only (where a run without checkpoints of its own starts from).
        require("initial_load_path", cfg.enable, "is read only with checkpoint.enable = true; set it")
    if cfg.initial_load_path is not None and not is_url(cfg.initial_load_path):
        require("initial_load_path", Path(cfg.initial_load_path).is_dir(), "is not a folder")
        if cfg.initial_load_in_hf:
            require("initial_load_path", any(Path(cfg.initial_load_path).glob("*.safetensors")),
                    "holds no *.safetensors files (checkpoint.initial_load_in_hf is set)")
    if cfg.create_seed_checkpoint:
        require("create_seed_checkpoint", cfg.enable,
                "needs checkpoint.enable = true (the seed is written as checkpoint step-0)")
        require("create_seed_checkpoint", world_size == 1, f"must run as a single process (the world size is "
                f"{world_size}); later runs load the seed under any layout")
        require("create_seed_checkpoint", not cfg.load_only,
                "writes a checkpoint, but checkpoint.load_only = true forbids saving")
    if cfg.last_save_in_hf:
        require("last_save_in_hf", cfg.enable, "needs checkpoint.enable = true")
        require("last_save_in_hf", cfg.last_save_model_only, "needs checkpoint.last_save_model_only = true (the "
                "Hugging Face folder is the last step's model-only export)")
        require("last_save_in_hf", has_hf_adapter, f"is not supported by model.name = {model_name!r}: its "
                "TrainSpec has no state_dict_adapter (no Hugging Face names)")
    return problems


def _first_failure(error: BaseException) -> str:
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error
    return str(error) if isinstance(error, CheckpointError) else one_line(error)


def load_state(state: dict, where: str, no_dist: bool) -> None:
    """``dcp.load`` from a checkpoint folder or URL (its metadata and its non-tensor entries unpickled
    restrictedly); failures as one line."""
    try:
        dcp.load(state, storage_reader=reader_for(where), planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        raise CheckpointError(f"cannot load checkpoint {where}: {_first_failure(e)}") from None


class CheckpointManager:
    """Saves and loads the training state under the [checkpoint] section's rules."""

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, model_parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, lr_scheduler, dataloader, train_state: TrainState,
                 device: torch.device, guard: Stateful, state_dict_adapter=None, tokenizer=None,
                 hf_assets_path: str | None = None, pp_mesh=None):
        """``state_dict_adapter``, ``tokenizer`` and ``hf_assets_path`` serve Hugging Face loads and exports;
        ``pp_mesh`` (None without pipeline parallelism) tells the ranks holding the other stages."""
        self.cfg = cfg
        self.state_dict_adapter = state_dict_adapter
        self.tokenizer, self.hf_assets_path, self.pp_mesh = tokenizer, hf_assets_path, pp_mesh
        self.storage = open_storage(checkpoint_location(dump_folder, cfg.folder))
        if cfg.enable:
            self.storage.check_reachable()  # a wrong URL or missing credentials fail before training
        self.model_parts = model_parts
        self.adapted = any(is_adapter_param(name) for part in model_parts for name, _ in part.named_parameters())
        frozen = frozen_names(model_parts)
        # The model as a base checkpoint holds it (initial_load_path): every weight but the adapters.
        self.base_state = ModelState(model_parts, include=lambda name: not is_adapter_param(name), loading_only=True)
        self.states = {
            "model": ModelState(model_parts, include=lambda name: name not in frozen),
            "optimizer": OptimizerState(model_parts, optimizer),
            "lr_scheduler": LRSchedulerState(lr_scheduler),
            "dataloader": DataLoaderState(dataloader),
            "train_state": train_state,
            "guard": guard,
        }
        if frozen:
            self.states["base"] = BaseFingerprint(model_parts, cfg.initial_load_path or "the seeded initialisation")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.no_dist = not dist.is_initialized()
        self.async_mode = cfg.async_mode
        if self.async_mode == "async_with_pinned_mem" and device.type != "cuda":
            logger.warning("checkpoint.async_mode = 'async_with_pinned_mem' needs an accelerator; "
                           "using 'async' on this CPU-only machine")
            self.async_mode = "async"
        # Background saves talk over their own gloo group so they never race the training collectives.
        self.save_group = dist.new_group(backend="gloo") if dist.is_initialized() and cfg.enable else None
        self.stager = None
        if cfg.enable and self.async_mode != "disabled":
            self.stager = _ReusedBufferStager(pin_memory=self.async_mode == "async_with_pinned_mem")
        self.in_flight: tuple[int, Future] | None = None

    # ----- loading -----

    def load(self) -> int | None:
        """Resume from the latest (or checkpoint.load_step) checkpoint, else from initial_load_path.

        Returns the step resumed from, or None when training starts from scratch.
        """
        if not self.cfg.enable:
            return None
        self._check_folder()
        steps = self.storage.steps()
        if self.cfg.load_step != -1:
            if self.cfg.load_step not in steps:
                raise CheckpointError(f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                                      f"{self.storage.where(f'step-{self.cfg.load_step}')}; available steps: "
                                      f"{steps or 'none'}")
            step = self.cfg.load_step
            newer = [] if self.cfg.load_only else self.storage.saved_after(step)
            if newer and not self.cfg.discard_newer_steps:
                raise CheckpointError(
                    f"checkpoint.load_step = {step} is below the newest checkpoints in {self.storage.location}: "
                    f"{', '.join(newer)}; this run's saves would overwrite or prune them, so it does not start. To "
                    f"branch off step {step}, copy {self.storage.where(f'step-{step}')} into a new folder and give "
                    "that as checkpoint.folder (the run resumes from it); to discard the newer ones, set "
                    "checkpoint.discard_newer_steps = true")
        elif steps:
            step = steps[-1]
        elif self.cfg.initial_load_path:
            self._load_initial(self.cfg.initial_load_path)
            return None
        else:
            return None
        if "base" in self.states and self.cfg.initial_load_path:
            self._load_initial(self.cfg.initial_load_path)  # the frozen base, under the trained weights
        # A seed checkpoint holds the model only: the optimizer, schedule and data start fresh.
        seed = step == SEED_STEP
        keys = [k for k in (["model"] if seed else STATE_KEYS)
                if k in self.states and k not in self.cfg.exclude_from_loading]
        self._load(self.storage.where(f"step-{step}"), keys)
        logger.info(f"resumed from step {step}: {self.storage.where(f'step-{step}')}"
                    + (" (a seed checkpoint: the model only)" if seed else ""))
        if self.cfg.load_step != -1 and self.cfg.discard_newer_steps and not self.cfg.load_only:
            self._discard_after(step)  # only once the step to resume from has loaded
        return step

    def _discard_after(self, step: int) -> None:
        """checkpoint.discard_newer_steps: rank 0 deletes the checkpoints and exports after ``step``; every rank
        waits for it, so none saves into the folder meanwhile."""
        if self.rank == 0:
            for name in self.storage.saved_after(step):
                logger.warning(f"checkpoint.discard_newer_steps: deleting {self.storage.where(name)}")
                self.storage.delete(name)
        if dist.is_initialized():
            dist.barrier(group=self.save_group)

    def _load_initial(self, location: str) -> None:
        if self.cfg.initial_load_in_hf:
            self._load_hf(location)
            return
        if "base" in self.states:  # a fine-tuning run's base: the weights only, whatever else the folder holds
            for group in self.base_state.in_groups():  # a QLoRA base: a block of NF4 weights at a time
                self._load(location, ["model"], {"model": group})
            logger.info(f"loaded the base model from {location}")
            return
        keys = ["model"] if self.cfg.initial_load_model_only else [k for k in STATE_KEYS if k in self.states]
        self._load(location, keys)
        logger.info(f"initialised {'the model' if keys == ['model'] else 'the run'} from {location}")

    def _load_hf(self, location: str) -> None:
        """Model weights from a Hugging Face folder (local, or a URL copied once per machine into the cache); every
        rank reads the files and keeps its shards."""
        if self.state_dict_adapter is None:
            raise CheckpointError(f"checkpoint.initial_load_in_hf: this model has no Hugging Face adapter ({location})")
        # Names and shapes are checked against the model's (global shapes, this rank's stages) before any tensor
        # is read.
        expected = self.base_state.shapes()
        try:
            with fetched_folder(location, "config.json", "*.safetensors") as path:
                state = read_hf_model_state(path, self.state_dict_adapter, expected)
        except RemoteError as e:
            raise CheckpointError(f"checkpoint.initial_load_path: {e}") from None
        if reason := self.base_state.missing_from(state):
            raise CheckpointError(f"checkpoint.initial_load_path {location}: {reason}")
        load_model_state(self.model_parts, state, StateDictOptions(full_state_dict=True, strict=False))
        logger.info(f"initialised the model from Hugging Face weights in {location}")

    def _load(self, where: str, keys: list[str], states: dict[str, Stateful] | None = None) -> None:
        states = {**self.states, **(states or {})}
        metadata = verify_checkpoint(where)
        stored = {name.split(".", 1)[0] for name in metadata.state_dict_metadata}
        keys = [k for k in keys if k not in OPTIONAL_KEYS or k in stored]
        for key in ("model", "optimizer", "base"):
            if key in keys and (reason := states[key].refusal(metadata)):
                raise CheckpointError(f"cannot load checkpoint {where}: {reason}")
        for key in keys:
            if hasattr(states[key], "prepare_load"):  # state whose tensors' sizes vary: sized from the file
                states[key].prepare_load(metadata)
        load_state({k: states[k] for k in keys}, where, self.no_dist)

    def _check_folder(self) -> None:
        """Refuse a folder holding steps that are not ours, then drop what a run killed mid-save left behind;
        complete checkpoints are untouched. Not with load_only: such a job may read a folder another run is
        writing to. Rank 0 alone looks and sends every rank its verdict: ranks listing while rank 0 deletes
        could see a step half removed and disagree, one raising alone while the others wait for it."""
        problem = None
        if self.rank == 0 and not self.cfg.load_only:
            try:
                self.storage.refuse_unowned()
                self.storage.remove_incomplete()
            except CheckpointError as e:
                problem = str(e)
            except Exception as e:  # e.g. a URL failing mid-listing: still a verdict every rank must hear
                problem = f"checkpoint folder {self.storage.location}: {one_line(e)}"
        if dist.is_initialized():
            verdict = [problem]
            dist.broadcast_object_list(verdict, src=0, group=self.save_group)
            problem = verdict[0]
        if problem is not None:
            raise CheckpointError(problem)

    # ----- saving -----

    def create_seed_checkpoint(self) -> str:
        """Write the model's current (initial) weights as step-0, model only, for later runs to start from.

        A single process writes it (validation makes sure), so every later layout starts from the same
        weights. Refuses a folder that already holds checkpoints: a seed starts a new run.
        """
        self.storage.refuse_unowned()
        existing = self.storage.steps()
        if existing:
            raise CheckpointError(f"checkpoint.create_seed_checkpoint: {self.storage.location} already holds "
                                  f"checkpoints (steps {existing}); a seed starts a new run, use an empty "
                                  "job.dump_folder")
        name = f"step-{SEED_STEP}"
        self.storage.begin(name)
        dcp.save({"model": self.states["model"]}, storage_writer=writer_for(self.storage.target(name)),
                 no_dist=self.no_dist)
        self._finish(SEED_STEP)
        logger.info(f"seed checkpoint written to {self.storage.where(name)}: the initial model weights, model only")
        return self.storage.where(name)

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.cfg.enable or self.cfg.load_only:
            return False
        if step == last_step or step % self.cfg.interval == 0:
            return True
        return step == 1 and self.cfg.enable_first_step_checkpoint

    def save(self, step: int, last_step: int) -> None:
        """Write step-N (in the background with async_mode), then an export at the last step."""
        self.poll()
        self.wait()  # at most one save in flight
        name = f"step-{step}"
        if self.rank == 0:
            self.storage.begin(name)
        if dist.is_initialized():
            dist.barrier()
        state = dict(self.states)
        start = time.perf_counter()
        writer = writer_for(self.storage.target(name))
        if self.async_mode == "disabled":
            dcp.save(state, storage_writer=writer, process_group=self.save_group, no_dist=self.no_dist)
            self._finish(step)
            logger.info(f"saved checkpoint {self.storage.where(name)} in {time.perf_counter() - start:.2f}s")
        else:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.save_group,
                                    async_stager=self.stager, no_dist=self.no_dist)
            self.in_flight = (step, future)
            logger.info(f"checkpoint step-{step} staged in {time.perf_counter() - start:.2f}s; "
                        "writing in the background")
        if step == last_step and self.cfg.last_save_model_only:
            self.wait()
            self.export_model(step)

    def poll(self) -> None:
        """Finish a background save that has completed; re-raise its failure, loudly."""
        if self.in_flight is not None and self.in_flight[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written and made the latest checkpoint."""
        if self.in_flight is None:
            return
        step, future = self.in_flight
        self.in_flight = None
        try:
            future.result()
        except Exception as e:
            raise CheckpointError(f"background save of {self.storage.where(f'step-{step}')} failed: "
                                  f"{type(e).__name__}: {e}") from e
        self._finish(step)

    def _finish(self, step: int) -> None:
        # DCP's save ends with a collective finish in which rank 0 gathers every rank's write results
        # and then writes the metadata; once rank 0's save has returned, every shard is written. Only
        # then is the checkpoint made complete (renamed, or marked), and may older ones go.
        if self.rank == 0:
            self.storage.commit(f"step-{step}")
            self._prune()
        logger.info(f"checkpoint step-{step} complete: {self.storage.where(f'step-{step}')}")

    def _prune(self) -> None:
        """Keep the newest keep_latest_k complete checkpoints; older ones go only after a newer one is complete."""
        if self.cfg.keep_latest_k <= 0:
            return
        for step in self.storage.steps()[: -self.cfg.keep_latest_k]:
            self.storage.delete(f"step-{step}")

    def export_model(self, step: int) -> str:
        """Model weights only, in export_dtype, beside the full checkpoint of the same step (DCP, or a
        Hugging Face folder with last_save_in_hf)."""
        if self.cfg.last_save_in_hf:
            return self.export_hf(step)
        dtype = DTYPES[self.cfg.export_dtype]
        # Every weight, a frozen base's too: an export stands alone.
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ModelState(self.model_parts).state_dict().items()}
        name = f"export-step-{step}"
        if self.rank == 0:
            self.storage.begin(name)
        if dist.is_initialized():
            dist.barrier(group=self.save_group)
        writer = writer_for(self.storage.target(name))
        dcp.save({"model": state}, storage_writer=writer, process_group=self.save_group, no_dist=self.no_dist)
        if self.rank == 0:
            self.storage.commit(name)
        logger.info(f"exported model weights ({self.cfg.export_dtype}) to {self.storage.where(name)}")
        return self.storage.where(name)

    def export_hf(self, step: int) -> str:
        """The model as a Hugging Face folder ``export-step-N/``, written by rank 0 from the gathered weights."""
        if self.state_dict_adapter is None or self.tokenizer is None or self.hf_assets_path is None:
            raise CheckpointError("checkpoint.last_save_in_hf: this model has no Hugging Face adapter or tokenizer")
        # A LoRA run on a frozen base exports its adapters (a PEFT folder): only they are gathered.
        state = self.full_model_state(is_adapter_param if "base" in self.states else lambda name: True)
        # Each adapter's rank and alpha, from every pipeline stage (they may differ per module).
        settings = self._on_rank0({k: v for part in self.model_parts for k, v in adapter_settings(part).items()}) \
            if self.adapted else {}
        name = f"export-step-{step}"
        if self.rank == 0:
            def write_model(folder: Path, state: dict) -> int:
                return write_hf_folder(folder, state, self.state_dict_adapter, self.tokenizer, self.hf_assets_path,
                                       self.cfg.export_dtype)

            def write(folder: Path) -> int:
                if not self.adapted:
                    return write_model(folder, state)
                return write_lora_export(folder, state, self.state_dict_adapter, settings, "base" in self.states,
                                         self.cfg.export_dtype, self.cfg.initial_load_path or "", write_model)

            try:
                count = self.storage.write_folder(name, write)
            except ValueError as e:  # a model the format cannot express (e.g. a trained routing bias)
                raise CheckpointError(f"cannot export {self.storage.where(name)} as a Hugging Face folder: {e}") \
                    from None
            logger.info(f"exported the model as a Hugging Face folder ({count} tensors, {self.cfg.export_dtype}) "
                        f"to {self.storage.where(name)}")
        if dist.is_initialized():
            dist.barrier(group=self.save_group)  # the folder is complete once any rank returns
        return self.storage.where(name)

    def full_model_state(self, include=lambda name: True) -> dict[str, torch.Tensor]:
        """Every weight of the model, unsharded, on rank 0's CPU; an empty dict on the other ranks.

        Each DTensor (FSDP, TP) is gathered by its own mesh, one tensor at a time, and kept only by the
        first rank of its pipeline stage (the ranks of rank 0's pp group). (get_model_state_dict's
        full_state_dict + cpu_offload keeps the values on global rank 0 only, which drops every stage but
        rank 0's.) Those ranks then send their stages to rank 0, one after another.
        """
        keep = self.rank in self._stage_leaders()
        state = {}
        for part in self.model_parts:
            for name, tensor in get_model_state_dict(part).items():
                if not include(name):
                    continue
                if isinstance(tensor, DTensor):
                    tensor = tensor.full_tensor()  # a collective: every rank of the mesh takes part
                if keep:
                    state[name] = tensor.detach().cpu()
        return self._on_rank0(state)

    def _stage_leaders(self) -> list[int]:
        """The first rank of each pipeline stage (rank 0's pp group); [0] without pipelining."""
        if self.pp_mesh is None:
            return [0]
        pp_ranks = dist.get_process_group_ranks(self.pp_mesh.get_group())
        return pp_ranks if 0 in pp_ranks else []

    def _on_rank0(self, local: dict) -> dict:
        """The stage leaders' ``local`` dicts (of their own stages) merged on rank 0; an empty dict elsewhere."""
        leaders = self._stage_leaders()
        if self.pp_mesh is not None and self.rank in leaders:
            if self.rank == 0:
                local = dict(local)
                for src in (r for r in leaders if r != 0):
                    received = [None]
                    dist.recv_object_list(received, src=src, group=self.save_group)
                    local.update(received[0])
            else:
                dist.send_object_list([local], dst=0, group=self.save_group)
        return local if self.rank == 0 else {}

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class _ReusedBufferStager(BlockingAsyncStager):
    """Stages into host buffers allocated once per run, so staging a checkpoint is a copy, not an allocation.

    Safe because at most one save is in flight: the buffers are not refilled while being written.
    """

    def __init__(self, pin_memory: bool):
        super().__init__(cache_staged_state_dict=True)
        self.pin_memory = pin_memory

    def stage(self, state_dict: dict) -> dict:
        if self.state_dict_cache is not None:
            try:
                return _copy_state_dict(state_dict, self.state_dict_cache)
            except RuntimeError:  # a tensor changed size (e.g. the dataloader state's blocks): buffers anew
                self.state_dict_cache = None
        self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self.pin_memory)
        return _copy_state_dict(state_dict, self.state_dict_cache)
