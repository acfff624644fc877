"""Train a model from one TOML file: build everything from the JobConfig, then run the loop.

    python -m torchtitan.train --job.config_file train_configs/debug_model.toml [--section.field value ...]
    torchrun --nproc_per_node=N -m torchtitan.train --job.config_file ...
"""

import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from torchtitan.components.checkpointing.checkpoint import CheckpointError, CheckpointManager, TrainState
from torchtitan.components.checkpointing.provenance import save_provenance
from torchtitan.components.evaluation.validate import Validator
from torchtitan.components.expert_load import ExpertLoadBalancer
from torchtitan.components.fault_tolerance import ReplicaGroupError, ReplicaGroups, data_coordinates, replica_folder
from torchtitan.components.metrics.backends import MetricsBackendError
from torchtitan.components.metrics.host_memory import keep_freed_host_memory
from torchtitan.components.metrics.logger import MetricsLogger
from torchtitan.components.metrics.profiling import Profiler
from torchtitan.components.observability.observer import RunObserver
from torchtitan.components.objectives.forward_backward import LocalForwardBackward, PipelineForwardBackward
from torchtitan.components.objectives.loss import build_cross_entropy_loss, count_valid_tokens, summed_loss_share
from torchtitan.components.objectives.objective import DataSourceContext, build_objective
from torchtitan.components.optimizers.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizers.mup import apply_lr_multipliers, base_lr, lr_multipliers
from torchtitan.components.optimizers.optimizer import build_optimizer, clipped_step
from torchtitan.components.optimizers.qk_clip import QKClip
from torchtitan.components.preemption import PreemptionWatcher
from torchtitan.components.step_guard import StepGuard
from torchtitan.config import ConfigError, JobConfig
from torchtitan.config.loading import config_to_dict, format_help, save_resolved_config
from torchtitan.config_check import load_and_validate
from torchtitan.data import Batch, DataError
from torchtitan.distributed import device as device_lib
from torchtitan.distributed.apply_common import parallelize_fn_of, pipelining_fn_of
from torchtitan.distributed.collectives import sum_over
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.distributed.grad_norm import global_grad_norm
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.precision import compute_autocast, compute_dtype, set_compute_dtype
from torchtitan.distributed.tensor_parallel import loss_parallel_context, to_local_scalar
from torchtitan.hardware import DTYPES
from torchtitan.log import init_logger, logger
from torchtitan.models.shared.chunked_cross_entropy import use_chunked_loss
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.document_masking import DocumentMasking
from torchtitan.models.shared.vision_language import image_chat
from torchtitan.protocols.model import count_params, token_flop_params
from torchtitan.protocols.model_converter import ModelConverters
from torchtitan.protocols.train_spec import build_model_args, get_train_spec
from torchtitan.remote import is_url


class TrainingError(Exception):
    """The run cannot continue (e.g. a non-finite loss); the message says why and at which step."""


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        training = cfg.training

        # Where we run, and how the ranks are laid out.
        self.device = device_lib.init_distributed(cfg.comm.init_timeout_seconds)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.rank = device_lib.rank()
        self.compute_dtype_reason = set_compute_dtype(training, self.device.type)
        self.parallel_dims = ParallelDims.from_config(cfg.parallelism, device_lib.world_size())
        self.parallel_dims.build_mesh(self.device.type)
        self._seed(cfg.debug.seed, cfg.debug.deterministic)

        # The model: built on the meta device, parallelized, then materialised and initialised.
        spec = get_train_spec(cfg.model.name)
        self.tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
        self.model_args = build_model_args(spec, cfg.model, self.tokenizer.vocab_size, training.seq_len)
        self.converters = ModelConverters(cfg.model.converters, cfg, self.parallel_dims)

        def build_converted() -> torch.nn.Module:
            """The model on the meta device, converted; in the stored dtype from the start (free there): what
            converters add and what parallelism wraps (a QLoRA base's NF4 weights, which a later cast would
            dequantize) is built in it."""
            with torch.device("meta"):
                built = spec.model_cls(self.model_args)
            built.to(DTYPES[training.dtype])
            self.converters.convert(built)
            return built

        model = build_converted()
        if cfg.model.print_after_conversion:
            logger.info(f"model after conversion:\n{model}")
        num_params = count_params(model)
        self.flops_per_token = self.model_args.flops_per_token(token_flop_params(model),
                                                               training.seq_len)
        logger.info(f"model {cfg.model.name}/{cfg.model.flavor}: {num_params:,} parameters, "
                    f"{self.flops_per_token / 1e9:.3f} GFLOPs per token; {self.parallel_dims}")
        self.masking = DocumentMasking.from_config(cfg.model, training)
        logger.info(self.masking.describe())
        compile_loss = cfg.compile.enable and "loss" in cfg.compile.components
        if training.loss_chunk_size > 0:
            # The output head computes the summed loss chunk by chunk; what is left is dividing it.
            use_chunked_loss(model, training.loss_chunk_size)
            if compile_loss and not self.parallel_dims.tp_enabled:
                model.output.compile_loss(cfg.compile.backend)
            self.loss_fn = summed_loss_share
        else:
            build_loss = spec.build_loss_fn or build_cross_entropy_loss
            self.loss_fn = build_loss(compile_loss=compile_loss, backend=cfg.compile.backend)
        # What a step trains: derives targets from each batch and scores the output (training.objective).
        self.objective = build_objective(training, self.loss_fn, self.model_args, self.masking.block_causal, cfg.rl)
        # Tensor-parallel logits stay sharded over the vocabulary into the loss (the chunked loss shards it itself).
        self.loss_parallel = (self.parallel_dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
                              and training.loss_chunk_size == 0)
        # Without FSDP (whose mixed-precision policy casts the parameters) compute in the
        # requested precision through autocast.
        self.autocast = compute_autocast(training, self.device, fsdp_enabled=self.parallel_dims.fsdp_enabled)

        def materialise(part: torch.nn.Module) -> torch.nn.Module:
            part.to_empty(device=self.device)
            part.init_weights(cfg.debug.seed, buffer_device=self.device)
            self.converters.init_weights(part, cfg.debug.seed)
            return part.train()

        def prepare(part: torch.nn.Module) -> torch.nn.Module:
            return materialise(parallelize_fn_of(spec)(part, self.parallel_dims, cfg))

        self.pipeline = None
        if self.parallel_dims.pp_enabled:
            # Each rank keeps only its stages; the schedule computes the loss on the last one.
            self.runner = PipelineForwardBackward(self.objective, self.loss_fn, self.autocast, self.loss_parallel,
                                                  self.device)
            self.pipeline = self.runner.pipeline = pipelining_fn_of(spec)(
                model, cfg.parallelism, self.parallel_dims.submesh("pp"), self.device,
                n_microbatches=training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size,
                prepare_part=prepare, loss_fn=self.runner.stage_loss,
            )
            self.model_parts = self.pipeline.model_parts
        else:
            self.model_parts = [prepare(model)]
            self.runner = LocalForwardBackward(self.model_parts[0], self.objective, self.autocast, self.loss_parallel)

        # Optimisation.
        self.optimizer = (spec.build_optimizer_fn or build_optimizer)(self.model_parts, cfg.optimizer)
        if cfg.model.mup.base_width:  # µP: each parameter group's lr times its width multiplier
            apply_lr_multipliers(self.optimizer, lr_multipliers(self.model_parts, self.model_args.mup,
                                                                self.model_args.dim, cfg.optimizer))
        self.lr_scheduler = (spec.build_lr_scheduler_fn or build_lr_scheduler)(self.optimizer, cfg.lr_scheduler,
                                                                              training.steps)

        # Data: each data-parallel rank reads its share of one global stream (with fault tolerance, a stream over
        # all replica groups, each reading its own rows).
        ft = cfg.fault_tolerance
        group_dp_rank, group_dp_degree = self.parallel_dims.dp_coordinates()
        dp_rank, dp_degree = data_coordinates(ft, group_dp_rank, group_dp_degree)
        global_batch = self.parallel_dims.global_batch_size(training)  # this replica group's
        groups = ft.group_size if ft.enable else 1
        self.grad_accum_steps = self.parallel_dims.grad_accum_steps(training)
        build_own_data = getattr(self.objective, "build_data_source", None)  # e.g. GRPO's rollouts
        if build_own_data is not None:
            self.dataloader = build_own_data(DataSourceContext(
                cfg=cfg, tokenizer=self.tokenizer, model_parts=self.model_parts,
                build_model_part=lambda: prepare(build_converted()),
                build_local_model=lambda: materialise(build_converted()), parallel_dims=self.parallel_dims,
                device=self.device, autocast=self.autocast, loss_parallel=self.loss_parallel, masking=self.masking,
                dp_rank=dp_rank,
                dp_degree=dp_degree, grad_accum_steps=self.grad_accum_steps, seed=cfg.debug.seed))
        else:
            self.dataloader = spec.build_dataloader_fn(
                self.tokenizer,
                dataset=training.dataset,
                dataset_path=training.dataset_path,
                seq_len=training.seq_len,
                local_batch_size=training.local_batch_size,
                dp_rank=dp_rank,
                dp_world_size=dp_degree,
                num_workers=training.dataloader.num_workers,
                pin_memory=training.dataloader.pin_memory,
                prefetch_factor=training.dataloader.prefetch_factor,
                persistent_workers=training.dataloader.persistent_workers,
                text_column=training.dataset_text_column,
                dataset_format=training.dataset_format,
                chat=training.chat,
                shuffle_seed=cfg.debug.seed if training.shuffle_documents else None,
                mixture=cfg.data,
                global_batch_size=global_batch * groups,
                image_chat=image_chat(self.model_args, training.chat),
            )
        self.expert_loads = None
        if isinstance(self.model_args, DecoderArgs) and self.model_args.moe is not None:
            # Tokens one forward routes on this rank: a pipeline micro-batch under PP, else the local batch.
            sequences = (cfg.parallelism.pipeline_parallel_microbatch_size if self.pipeline
                         else training.local_batch_size)
            self.expert_loads = ExpertLoadBalancer(
                cfg.moe, self.model_parts, self.model_args, self.parallel_dims, global_sequences=global_batch,
                local_tokens=sequences * training.seq_len // self.parallel_dims.cp,
                compute_dtype=compute_dtype(training), device=self.device,
                across_groups=lambda counts: self.replicas.sum(counts),
            )
        self.loss_mesh = self.parallel_dims.submesh("dp_cp")
        # Tokens one device accounts for per step: TP and CP ranks share their replica's tokens.
        self.tokens_per_device = global_batch * training.seq_len / self.parallel_dims.world_size
        self.validator = None
        if cfg.validation.enable:
            self.validator = Validator(
                # Every replica group validates on the whole split.
                cfg.validation, self.tokenizer, dp_rank=group_dp_rank, dp_world_size=group_dp_degree,
                loss_fn=self.loss_fn, device=self.device, dp_mesh=self.loss_mesh, autocast=self.autocast,
                batch_loss=self._validation_batch_loss, chat=training.chat,
                image_chat=image_chat(self.model_args, training.chat),
            )

        self.task_eval = None
        if cfg.eval.enable:
            from torchtitan.components.evaluation.task_eval import TaskEvaluator

            self.task_eval = TaskEvaluator(cfg.eval, self.tokenizer, training.seq_len, self.device, self.autocast)

        self.metrics = MetricsLogger(
            cfg.metrics, cfg.job.dump_folder, self.rank, self.device, compute_dtype(training), self.flops_per_token,
            training.steps, run_config=config_to_dict(cfg), console_extras=self.objective.metric_names,
        )
        # Every rank's step phases and memory, summarised each log step beside the planner's memory prediction.
        self.observer = RunObserver(cfg.observability, cfg.job.dump_folder, self.rank, self.device,
                                    cfg.metrics.log_freq, self._planned_memory(), cfg.comm)
        if self.rank == 0:
            save_provenance(cfg.job.dump_folder, self.parallel_dims.layout(), self.device,
                            compute_dtype={"dtype": training.mixed_precision_param, "why": self.compute_dtype_reason})
        self.step_metrics: dict[str, torch.Tensor] = {}  # the last step's objective metrics beyond the loss
        self.data_iterator = None  # created on first use, after any dataloader state is restored

        # Checkpoints: resume from the latest one of this run, if any.
        self.train_state = TrainState()
        self.guard = StepGuard(training.guard)
        tp_mesh = self.parallel_dims.submesh("tp")
        self.qk_clip = QKClip(cfg.optimizer.qk_clip_threshold, self.model_parts, self.device,
                              tp_mesh.get_local_rank() if tp_mesh is not None else 0, self.parallel_dims.tp)
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, cfg.job.dump_folder, self.model_parts, self.optimizer, self.lr_scheduler,
            self.dataloader, self.train_state, self.device, self.guard,
            state_dict_adapter=self._hf_adapter(spec),
            tokenizer=self.tokenizer, hf_assets_path=cfg.model.hf_assets_path,
            pp_mesh=self.parallel_dims.submesh("pp"),
        )
        # The other replica groups (fault_tolerance): live state for a group that rejoins, sums across groups.
        self.replicas = ReplicaGroups(ft, self.device, {k: v for k, v in self.checkpointer.states.items()
                                                        if k != "base"}, self.model_parts, self.optimizer)
        if ft.enable:
            self.checkpointer.states["fault_tolerance"] = self.replicas
        # What a data source of the objective's own keeps besides its position (GRPO: the reference model).
        self.checkpointer.states.update(getattr(self.dataloader, "checkpoint_states", dict)())
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.create_seed_checkpoint()  # step-0 from the initial weights; main() then exits
        else:
            self.checkpointer.load()
        if training.dataset_format == "chat" and self.step == 0 and not cfg.checkpoint.initial_load_path:
            logger.warning("fine-tuning on chat data from freshly initialised weights: no checkpoint was resumed and "
                           "checkpoint.initial_load_path is unset (give the pretrained checkpoint to start from)")
        self.preemption = PreemptionWatcher(self.device)
        logger.info(f"global batch {global_batch * groups} sequences = local {training.local_batch_size} x dp "
                    f"{self.parallel_dims.dp}{f' x {groups} replica groups' if ft.enable else ''} x accumulation "
                    f"{self.grad_accum_steps}; {training.steps} steps")

    def _planned_memory(self) -> dict[str, float] | None:
        """The planner's GiB per device for this config (scripts/plan.py's memory table), logged once; None when it
        cannot plan it (e.g. a model outside the decoder contract)."""
        from torchtitan.planner import GIB, predicted_memory

        if not self.cfg.observability.record_phases or self.rank != 0:  # rank 0 alone logs and writes it
            return None
        try:
            memory = predicted_memory(self.cfg, self.device.type, self.parallel_dims.world_size,
                                      self.tokenizer.vocab_size)
        except Exception as e:  # the prediction is a by-product: a config it cannot plan still trains
            logger.warning(f"no memory plan for this run (the planner: {e})")
            return None
        parts = {name: getattr(memory, name) / GIB for name in ("params", "grads", "optimizer", "activations",
                                                               "transient", "rl")}
        logger.info(f"memory plan (the planner, busiest device): {memory.total / GIB:.2f} GiB = "
                    + ", ".join(f"{name} {gib:.2f}" for name, gib in parts.items() if gib))
        return {"total": memory.total / GIB, **parts}

    def _hf_adapter(self, spec):
        """The family's Hugging Face adapter for exports, told whether to drop a MoE routing bias; None if none."""
        if spec.state_dict_adapter is None:
            return None
        adapter = spec.state_dict_adapter(self.model_args)
        adapter.drop_expert_bias = self.cfg.checkpoint.hf_drop_expert_bias
        if self.cfg.checkpoint.hf_include_mtp:
            adapter.include_mtp = True
        return adapter

    @staticmethod
    def _seed(seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def train_step(self, microbatches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (global loss, global grad norm)."""
        self.optimizer.zero_grad()
        prepared = [self._prepare(batch) for batch in microbatches]
        # Each loss term is normalised by its valid targets in the whole step on all ranks, known up front;
        # at least 1, so a step whose targets are all ignored contributes zero, not NaN.
        local_counts = sum(self.objective.count(targets) for _, _, targets in prepared)
        global_counts = self.replicas.sum(sum_over(local_counts, self.loss_mesh)).clamp(min=1)
        parts = sum(self.runner.forward_backward(tokens, inputs, targets, global_counts,
                                                 last_microbatch=index == len(prepared) - 1)
                    for index, (tokens, inputs, targets) in enumerate(prepared))
        self.observer.mark("forward_backward")
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_mesh = self.parallel_dims.submesh("pp")
        counted_elsewhere = self.runner.finish_gradients()
        self.replicas.sum_gradients(params)
        grad_norm = global_grad_norm(params, pp_mesh, counted_elsewhere=counted_elsewhere)
        # Only the ranks holding the last stage have a loss; the others add zero.
        loss, *extra = self.replicas.sum(sum_over(sum_over(parts, pp_mesh), self.loss_mesh))
        self.step_metrics = dict(zip(self.objective.metric_names, extra))
        self.observer.mark("grad_comm")  # what of the gradient and loss reductions was left exposed
        if self.expert_loads is not None:
            self.expert_loads.collect()
        self.qk_clip.reduce(self.replicas.max)
        committed = self.replicas.should_commit()  # False: a replica group failed mid-step, which is redone
        if not committed or (self.guard.cfg.enable and self._guard_skips(loss, grad_norm)):
            if self.expert_loads is not None:
                self.expert_loads.discard_step()
            self.qk_clip.discard_step()
        else:
            clipped_step(self.optimizer, params, grad_norm, self.cfg.training.max_norm)
            self.qk_clip.after_step()  # before the converters' hook, which may derive state from the weights
            self.converters.post_optimizer_hook(self.model_parts)
            if self.expert_loads is not None:
                self.expert_loads.after_step()
        if committed:
            self.lr_scheduler.step()  # a step the guard skipped still counts for the schedule
        self.observer.mark("optimizer")
        return loss, grad_norm

    def _guard_skips(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether the bad-step guard skips this step's update (the same decision on every rank)."""
        reason = self.guard.check(*torch.stack([loss.float(), grad_norm.float()]).tolist())
        if reason is None:
            return False
        step = self.train_state.step + 1
        logger.warning(f"step {step} skipped by the bad-step guard: {reason} (skipped so far: {self.guard.skipped})")
        if stop := self.guard.stop_reason():
            raise TrainingError(f"step {step}: {stop}")
        return True

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """(tokens, the forward's keyword inputs, the objective's targets) of one micro-batch, on the device and
        sharded for context parallelism; the objective derives its inputs and targets from the whole rows."""
        batch = self._on_device(batch)
        extra, targets = self.objective.prepare(batch)
        return self._sharded_inputs(batch, targets, extra)

    def _sharded_inputs(self, batch: Batch, targets: torch.Tensor, extra: dict | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """(tokens, the forward's keyword inputs, targets), the per-token ones split for context parallelism."""
        inputs = {**self.masking.model_inputs(batch), **(extra or {})}
        # The sequence is the last dimension of every per-token input (multi-token prediction's (batch, depth, seq)
        # too), except M-RoPE's positions, (batch, seq, 3).
        dims = [1 if name == "positions" and t.dim() == 3 else t.dim() - 1 for name, t in inputs.items()]
        tokens, targets, *values = self._cp_shard([batch.input_ids, targets, *inputs.values()],
                                                  [1, targets.dim() - 1, *dims])
        return tokens, {**dict(zip(inputs, values)), **self.masking.image_inputs(batch)}, targets

    def _on_device(self, batch: Batch) -> Batch:
        return type(batch)(*(t.to(self.device, non_blocking=True) for t in batch))  # a Batch, or an objective's own

    def _cp_shard(self, tensors: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
        """Under context parallelism, this rank's head and tail chunks of every sequence (each tensor's ``dims``)."""
        if not self.parallel_dims.cp_enabled:
            return tensors
        cp_mesh = self.parallel_dims.submesh("cp")
        return [shard_sequence(t, dim, cp_mesh.get_local_rank(), cp_mesh.size()) for t, dim in zip(tensors, dims)]

    def _validation_batch_loss(self, model_parts: list[torch.nn.Module],
                               batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy and valid tokens of one validation batch on this rank (all stages summed)."""
        tokens, inputs, labels = self._sharded_inputs(self._on_device(batch), batch.labels.to(self.device))
        with self.autocast(), loss_parallel_context(self.loss_parallel):
            if self.pipeline is None:
                loss = to_local_scalar(self.loss_fn(model_parts[0](tokens, **inputs), labels, 1.0))
            else:
                pipe, losses = self.pipeline, []
                pipe.schedule.eval(*((tokens,) if pipe.has_first_stage else ()),
                                   target=labels if pipe.has_last_stage else None, losses=losses,
                                   return_outputs=False, **inputs)
                loss = sum((to_local_scalar(x) for x in losses), torch.zeros((), device=self.device))
                loss = sum_over(loss, self.parallel_dims.submesh("pp"))
        return loss, count_valid_tokens(labels)

    @property
    def step(self) -> int:
        return self.train_state.step

    def train(self) -> None:
        cfg = self.cfg.training
        if self.step >= cfg.steps:
            logger.info(f"the run already reached step {self.step} of {cfg.steps}; nothing to train")
            return
        if self.data_iterator is None:
            self.data_iterator = iter(self.dataloader)
        profiler = Profiler(self.cfg.profiling, self.cfg.job.dump_folder, self.rank, self.device)
        gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
        try:
            while self.step < cfg.steps:
                if self.replicas.begin_step():  # took a peer group's live state: read on from its data position
                    self.data_iterator = iter(self.dataloader)
                if (self.step + 1) % cfg.gc_freq == 0:
                    gc.collect(1)
                # A tensor for torchao's optimizers; under µP, optimizer.lr's share of the first group's.
                lr = base_lr(self.optimizer, float(self.lr_scheduler.get_last_lr()[0]))
                self.observer.begin_step(self.step + 1)
                data_start = time.perf_counter()
                microbatches = [next(self.data_iterator) for _ in range(self.grad_accum_steps)]
                data_seconds = time.perf_counter() - data_start
                self.observer.mark("data")
                loss, grad_norm = self.train_step(microbatches)
                if not self.replicas.committed:
                    self.observer.abandon_step()
                    logger.warning(f"step {self.step + 1} not committed (a replica group failed during it): its "
                                   "batch is dropped and the step redone by the groups still training")
                    if self.preemption.should_stop():
                        self._stop_for_preemption(self.step, saved=self.step == 0)  # step-0 is a seed's name
                        return
                    continue
                # After the step: a DiLoCo synchronisation inside it may have brought a peer's progress.
                step = self.train_state.step = self.step + 1
                self.train_state.tokens_seen += round(self.tokens_per_device * self.parallel_dims.world_size)
                profiler.step(step)
                self.metrics.record_step(step, self.tokens_per_device, data_seconds)
                self._check_and_log(step, loss, grad_norm, lr)
                self.checkpointer.poll()
                saved = self.checkpointer.should_save(step, cfg.steps)
                if saved:
                    with self.observer.paused("a checkpoint save"):
                        self.checkpointer.save(step, cfg.steps)
                self.observer.mark("checkpoint")
                self.observer.end_step(step)
                if self.preemption.should_stop():
                    self._stop_for_preemption(step, saved)
                    return
                if step == 1:
                    device_lib.set_collective_timeout(self.cfg.comm.train_timeout_seconds)
        finally:
            self.observer.training_ended()
            gc.enable()
            profiler.close()
        logger.info(f"training finished after {cfg.steps} steps")

    def _stop_for_preemption(self, step: int, saved: bool) -> None:
        with self.observer.paused("the checkpoint save before stopping"):
            if self.cfg.checkpoint.enable and not saved:
                self.checkpointer.save(step, self.cfg.training.steps)
            self.checkpointer.wait()
        where = "a checkpoint is saved" if self.cfg.checkpoint.enable else "checkpointing is off, nothing saved"
        logger.warning(f"stopping after step {step} on {self.preemption.received or 'a peer rank signal'}: "
                       f"{where}; relaunch the same command to resume")

    def _check_and_log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        loss_value, norm_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
        if not (self.guard.cfg.enable and self.guard.last_reason):  # a skipped step may be non-finite
            check_finite(step, loss_value, norm_value)
        if self.metrics.should_log(step, self.cfg.training.steps):
            extra = self.expert_loads.metrics() if self.expert_loads is not None else {}
            extra.update(self.guard.metrics())
            extra.update(self.qk_clip.metrics())
            extra.update(self.observer.summarise())  # every rank's phases and memory (a collective)
            extra.update(self.replicas.metrics(step))
            extra.update({name: value.item() for name, value in self.step_metrics.items()})
            # What the data source reports, e.g. chat conversations cut or left out (totals since the start).
            data_metrics = getattr(self.dataloader, "metrics", dict)()
            namespace = getattr(self.dataloader, "metrics_namespace", "data")  # e.g. "rl" for rollouts
            extra.update({f"{namespace}/{name}": n for name, n in data_metrics.items()})
            self.metrics.log(step, loss_value, norm_value, lr, extra)
        self.observer.mark("logging")
        if self.validator is not None and self.validator.should_validate(step):
            with self.observer.paused("validation"):
                self.metrics.log_validation(step, self.validator.validate(self.model_parts, step))
        if self.task_eval is not None and self.task_eval.should_run(step):
            with self.observer.paused("task evaluation"):
                self.metrics.log_eval(step, self.task_eval.run(self.model_parts))
        self.observer.mark("evaluation")

    def close(self) -> None:
        if hasattr(self.dataloader, "close"):  # e.g. GRPO's reward workers
            self.dataloader.close()
        self.replicas.close()
        self.preemption.close()
        self.checkpointer.close()
        self.observer.close()
        self.metrics.close()


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raise TrainingError naming which of the loss and the gradient norm is not finite."""
    bad = [name for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)]
    if bad:
        raise TrainingError(
            f"non-finite {' and '.join(bad)} at step {step} (loss {loss}, grad_norm {grad_norm}); "
            f"try a lower optimizer.lr, a longer lr_scheduler.warmup_steps or training.max_norm, or skip such steps "
            "with training.guard.enable"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(format_help())
        return 0
    try:
        cfg = load_and_validate(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Each replica group of a fault-tolerant run writes its own metrics, config copy and checkpoints.
    cfg.job.dump_folder = replica_folder(cfg.job.dump_folder, cfg.fault_tolerance)
    if is_url(cfg.checkpoint.folder) or os.path.isabs(cfg.checkpoint.folder):  # else under the dump folder
        cfg.checkpoint.folder = replica_folder(cfg.checkpoint.folder, cfg.fault_tolerance)
    rank = int(os.environ.get("RANK", "0")) if device_lib.launched_distributed() else 0
    init_logger(rank, all_ranks=cfg.metrics.save_for_all_ranks)
    if rank == 0:
        save_resolved_config(cfg)
    trainer = None
    try:
        trainer = Trainer(cfg)
        if cfg.checkpoint.create_seed_checkpoint:
            logger.info("checkpoint.create_seed_checkpoint: exiting without training; runs with this job.dump_folder "
                        "and checkpoint.enable start from step-0 under any layout")
        else:
            trainer.train()
    except (DataError, ConfigError) as e:  # ConfigError here: what only the launch shows (e.g. too few GPUs)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, CheckpointError, MetricsBackendError, ReplicaGroupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            # Tear down together: a rank that leaves while another still talks to it aborts that one.
            dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
