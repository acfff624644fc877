"""Pipeline parallelism: cut a decoder into stages, place them on the pp ranks, run a torch schedule.

The model is cut by module names ("tok_embeddings", "layers.3", "norm", "output"), so each stage is
the same model class with the other modules removed: parameter names stay the names of the whole
model, and checkpoints, initialisation and the HF adapters do not know about stages. The embedding
and the output projection count as weight-bearing layers in the even split (see
``pipeline_parallel_first_stage_less_layers``), so the first and last stages get fewer blocks.
Multi-token prediction blocks (after the main ones) go to the last stage, which then also holds a copy of the
embedding kept equal to the first stage's (SharedEmbedding), as it does for an output head tied to the embedding.

Placement: single-stage schedules put stage r on rank r; looped schedules put stage s on rank
s % pp (round-robin); V schedules (ZBVZeroBubble, DualPipeV) pair stage r with stage 2*pp-1-r so
the first and last stages share rank 0. A CSV schedule says itself which stages each rank runs.
"""

from __future__ import annotations

import copy
import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Model, Parallelism, Training, Validation
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.moe import MoE

# The schedules users pick by name (all in torch 2.13), and which of them run several stages per rank.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def is_single_stage(schedule: str) -> bool:
    return issubclass(get_schedule_class(schedule), PipelineScheduleSingle)


def read_schedule_csv(path: str | Path) -> list[list[_Action]]:
    """The compute actions of each rank (one CSV row per pp rank, cells like 0F3, 1B2, 0I1, 0W1)."""
    with open(path, newline="") as f:
        return [[a for a in map(_Action.from_str, row) if a is not None] for row in csv.reader(f)]


def csv_stage_ranks(path: str | Path) -> dict[int, list[int]]:
    """{rank: stage indices it computes} in a schedule CSV."""
    return {rank: sorted({a.stage_index for a in row}) for rank, row in enumerate(read_schedule_csv(path))}


def csv_microbatches(path: str | Path) -> int:
    """How many micro-batches a schedule CSV runs per step."""
    return 1 + max((a.microbatch_index for row in read_schedule_csv(path) for a in row
                    if a.microbatch_index is not None), default=-1)


def count_stages(p: Parallelism, n_layers: int) -> int:
    """How many stages the model is cut into, from the CSV, the explicit parts, the layer count per stage,
    or else the schedule (one stage per rank for single-stage schedules, two for the others)."""
    if p.pipeline_parallel_schedule_csv:
        return sum(len(stages) for stages in csv_stage_ranks(p.pipeline_parallel_schedule_csv).values())
    if p.module_fqns_per_model_part:
        return len(p.module_fqns_per_model_part)
    if p.pipeline_parallel_layers_per_stage:
        total = n_layers + p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
        return math.ceil(total / p.pipeline_parallel_layers_per_stage)
    pp = p.pipeline_parallel_degree
    return pp if is_single_stage(p.pipeline_parallel_schedule) else 2 * pp


def stage_placement(p: Parallelism, n_layers: int) -> dict[int, list[int]]:
    """{pp rank: the stage indices it holds}, for a stage count config validation accepted."""
    pp = p.pipeline_parallel_degree
    if p.pipeline_parallel_schedule_csv:
        return csv_stage_ranks(p.pipeline_parallel_schedule_csv)
    num_stages = count_stages(p, n_layers)
    if p.pipeline_parallel_schedule in V_SCHEDULES:
        return {r: [r, num_stages - 1 - r] for r in range(pp)}
    return {r: list(range(r, num_stages, pp)) for r in range(pp)}


def split_layers(n_layers: int, num_stages: int, first_less: int, last_less: int) -> list[list[str]]:
    """Module names of each stage: an even split of the blocks plus the embedding and output "layers".

    Raises ValueError when some stage would hold no transformer block.
    """
    total = n_layers + first_less + last_less
    base, extra = divmod(total, num_stages)
    # Stage sizes in "layers"; the remainder adds one layer to each of the first `extra` middle stages
    # (which hold neither the embedding nor the output), then to the end stages.
    sizes = [base] * num_stages
    for index in ([*range(1, num_stages - 1), 0, num_stages - 1][:extra] if num_stages > 1 else []):
        sizes[index] += 1
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if num_stages == 1:
        sizes[0] = n_layers
    if min(sizes) < 1:
        raise ValueError(f"{num_stages} pipeline stages need more than the model's {n_layers} transformer blocks "
                         f"(stage block counts would be {sizes}); use fewer stages or a smaller "
                         f"pipeline_parallel_first/last_stage_less_layers")
    stages, next_layer = [], 0
    for index, size in enumerate(sizes):
        names = [f"layers.{i}" for i in range(next_layer, next_layer + size)]
        next_layer += size
        if index == 0:
            names.insert(0, "tok_embeddings")
        if index == num_stages - 1:
            names += ["norm", "output"]
        stages.append(names)
    return stages


def check_module_names(parts: list[list[str]], n_layers: int) -> None:
    """Raise ValueError unless ``parts`` cut the model in order: every module exactly once, the embedding
    on the first stage, norm and output on the last, and blocks in increasing order across stages."""
    key = "parallelism.module_fqns_per_model_part"
    valid = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    named = [name for part in parts for name in part]
    unknown = sorted(set(named) - set(valid))
    if unknown:
        raise ValueError(f"{key} names {unknown}, which are not modules of the model; valid: tok_embeddings, "
                         f"layers.0 .. layers.{n_layers - 1}, norm, output")
    missing = [name for name in valid if name not in named]
    repeated = sorted({name for name in named if named.count(name) > 1})
    if missing or repeated:
        raise ValueError(f"{key} must name every module exactly once; missing {missing}, repeated {repeated}")
    if "tok_embeddings" not in parts[0] or not {"norm", "output"} <= set(parts[-1]):
        raise ValueError(f"{key} must put tok_embeddings on the first stage and norm, output on the last")
    if named != valid:
        raise ValueError(f"{key} must list the blocks in order across the stages (layers.0 first), "
                         f"as the model runs them")


def stage_module_names(p: Parallelism, n_layers: int, num_stages: int) -> list[list[str]]:
    if p.module_fqns_per_model_part:
        if len(p.module_fqns_per_model_part) != num_stages:
            raise ValueError(f"parallelism.module_fqns_per_model_part has {len(p.module_fqns_per_model_part)} "
                             f"parts but the schedule runs {num_stages} stages; give one list per stage")
        check_module_names(p.module_fqns_per_model_part, n_layers)
        return p.module_fqns_per_model_part
    return split_layers(n_layers, num_stages, p.pipeline_parallel_first_stage_less_layers,
                        p.pipeline_parallel_last_stage_less_layers)


def model_stage_names(model: nn.Module, p: Parallelism, num_stages: int) -> tuple[list[list[str]], bool]:
    """The module names of each stage of ``model`` — its main blocks split by stage_module_names, then any
    multi-token prediction blocks (layers.{n_layers}, ...) on the last stage — and whether the last stage also
    holds a copy of the embedding (for those blocks, or for an output head tied to it)."""
    n_layers = model.args.n_layers
    names = [list(stage) for stage in stage_module_names(p, n_layers, num_stages)]
    if getattr(model, "visual", None) is not None:
        # The vision tower feeds the embeddings, and its DeepStack features the first blocks: all on stage 0.
        needed = [f"layers.{i}" for i in range(model.image_layers)]
        if not set(needed) <= set(names[0]):
            raise ValueError(f"the first pipeline stage holds {names[0]} but the vision tower's DeepStack features "
                             f"go into {needed}: give the first stage at least {model.image_layers} blocks "
                             "(parallelism.pipeline_parallel_first_stage_less_layers or _layers_per_stage)")
        names[0].append("visual")
    names[-1] += [f"layers.{key}" for key in model.layers if int(key) >= n_layers]
    shares = num_stages > 1 and (len(model.layers) > n_layers or model.args.tie_embeddings)
    if shares:
        names[-1].append("tok_embeddings")
    return names, shares


def keep_only(model: nn.Module, names: list[str], first: bool) -> nn.Module:
    """A copy of ``model`` (on the meta device) holding only the named top-level modules and blocks; only the
    ``first`` stage embeds its input (a later one holding tok_embeddings keeps it as a copy, SharedEmbedding)."""
    part = copy.deepcopy(model)
    keep = set(names)
    for key in list(part.layers):
        if f"layers.{key}" not in keep:
            del part.layers[key]
    for name in ("tok_embeddings", "norm", "output", *(("visual",) if hasattr(part, "visual") else ())):
        if name not in keep:
            setattr(part, name, None)
    part.embeds_input = first
    return part


class SharedEmbedding:
    """The token embedding held twice: by the first stage, for its input, and by the last, for multi-token
    prediction blocks or an output head tied to it.

    Both copies start equal (initialised from the parameter's name) and stay equal: after every backward their
    gradients are summed (on the rank, when it holds both stages, else between the first- and last-stage ranks of
    each pipeline) and both take that sum, so the optimizer moves them alike. Gradient-norm clipping counts the
    last stage's copy once (``counted_elsewhere``). Every rank must build it (it creates process groups).
    """

    def __init__(self, model_parts: list[nn.Module], pp_mesh, first_stage_rank: int, last_stage_rank: int):
        self.weights = [part.tok_embeddings.weight for part in model_parts if part.tok_embeddings is not None]
        self.counted_elsewhere = [part.tok_embeddings.weight for part in model_parts
                                  if part.tok_embeddings is not None and not part.embeds_input]
        self.group = None
        if first_stage_rank == last_stage_rank:
            return  # one rank holds both stages (V schedules): the sum is local
        if pp_mesh.size() == 2:
            self.group = pp_mesh.get_group()
            return
        # Every pipeline's (first, last) pair: each rank tells the others its pipeline's ranks.
        pipelines = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, pp_mesh.mesh.tolist())
        pairs = sorted({(ranks[first_stage_rank], ranks[last_stage_rank]) for ranks in pipelines})
        self.group, _ = dist.new_subgroups_by_enumeration([list(pair) for pair in pairs])

    @torch.no_grad()
    def sum_gradients(self) -> None:
        if not self.weights:
            return  # a middle stage
        # Every copy has a gradient after a backward: the first stage's from its input, the last's from the
        # blocks or the head that use it.
        total = torch.stack([_local(w.grad) for w in self.weights]).sum(0)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for w in self.weights:
            _local(w.grad).copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Stage(PipelineStage):
    """A PipelineStage whose shape inference leaves the step's records alone: the MoE loads and QK-clip's
    per-head largest logits.

    Before the first step (and after a switch between evaluation and training) torch runs each stage once on
    placeholder inputs to learn the shapes it sends, with gradients on when a backward follows; those inputs are
    not training data (a later stage's are uninitialised memory, whose logits can be anything, NaN included), so
    whatever the stage's MoE layers counted and its attention layers noted then is forgotten.
    """

    def _prepare_forward_infra(self, *args, **kwargs):
        moes = [m for m in self.submod.modules() if isinstance(m, MoE)]
        stats = [m.pending_stats() for m in moes]
        # The attention modules' logit_max (a tensor while QK-clip measures, else None).
        noted = [(m.logit_max, m.logit_max.clone()) for m in self.submod.modules()
                 if isinstance(getattr(m, "logit_max", None), torch.Tensor)]
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            for moe, kept in zip(moes, stats):
                moe.restore_stats(kept)
            for maxima, kept in noted:
                maxima.copy_(kept)


@dataclass
class Pipeline:
    """The schedule and this rank's model parts (one per local stage, in stage order)."""

    schedule: _PipelineSchedule
    model_parts: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool
    shared_embedding: SharedEmbedding | None = None


def build_pipeline(
    model: nn.Module,
    p: Parallelism,
    pp_mesh,
    device: torch.device,
    n_microbatches: int,
    prepare_part: Callable[[nn.Module], nn.Module],
    loss_fn: Callable,
) -> Pipeline:
    """Cut the meta-device ``model`` into this rank's stages, prepare each (parallelize + materialise) and
    wrap them in the configured schedule. The loss is computed on the last stage as ``loss_fn(logits,
    labels, **loss_kwargs)`` without the schedule's own scaling: our loss is already divided by the
    global token count."""
    pp_rank = pp_mesh.get_local_rank()
    placement = stage_placement(p, model.args.n_layers)
    num_stages = sum(len(stages) for stages in placement.values())
    names, shares_embedding = model_stage_names(model, p, num_stages)
    stages, parts = [], []
    for stage_index in placement[pp_rank]:
        part = prepare_part(keep_only(model, names[stage_index], first=stage_index == 0))
        parts.append(part)
        stages.append(_Stage(part, stage_index, num_stages, device, group=pp_mesh.get_group()))

    if p.pipeline_parallel_schedule_csv:
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                            scale_grads=False)
        schedule._load_csv(p.pipeline_parallel_schedule_csv, format="compute_only")
    else:
        cls = get_schedule_class(p.pipeline_parallel_schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        schedule = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                       scale_grads=False)
    local = placement[pp_rank]
    shared = None
    if shares_embedding:
        rank_of = {stage: rank for rank, held in placement.items() for stage in held}
        shared = SharedEmbedding(parts, pp_mesh, rank_of[0], rank_of[num_stages - 1])
    return Pipeline(schedule, parts, has_first_stage=0 in local, has_last_stage=num_stages - 1 in local,
                    shared_embedding=shared)


def merged_view(model_parts: list[nn.Module]) -> nn.Module:
    """One module whose named parameters are those of all parts, under the whole model's names.

    The parts' modules are shared, not copied: state-dict helpers that need a single module (the
    optimizer state dict, for one) see the same names with or without pipeline parallelism.
    """
    if len(model_parts) == 1:
        return model_parts[0]
    view = nn.Module()
    for part in model_parts:
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict):
                if not hasattr(view, name):
                    view.add_module(name, nn.ModuleDict())
                getattr(view, name).update(child)
            else:
                view.add_module(name, child)
    return view


def config_problems(p: Parallelism, t: Training, v: Validation, model: Model, can_pipeline: bool,
                    args: DecoderArgs) -> list[tuple[str, str]]:
    """The first problem (full config key, reason) with pipelining ``args`` (the model's DecoderArgs) as
    configured, or []; ``can_pipeline``: the model family has a pipelining_fn."""
    pp, key = p.pipeline_parallel_degree, "parallelism.pipeline_parallel_degree"
    if not can_pipeline:
        return [(key, f"is not supported by model.name = {model.name!r} (its TrainSpec has no pipelining_fn)")]
    if v.enable:
        # The stages exchange activations of the shape the training step set up.
        for field in ("local_batch_size", "seq_len"):
            if getattr(v, field) != getattr(t, field):
                return [(f"validation.{field}",
                         f"must equal training.{field} = {getattr(t, field)} with pipeline parallelism")]
    csv_key, csv_path = "parallelism.pipeline_parallel_schedule_csv", p.pipeline_parallel_schedule_csv
    if csv_path is None:
        if p.pipeline_parallel_schedule not in SCHEDULES:
            return [("parallelism.pipeline_parallel_schedule", f"is unknown; valid: {', '.join(SCHEDULES)}")]
    else:
        if not Path(csv_path).is_file():
            return [(csv_key, "does not exist")]
        try:
            placement = csv_stage_ranks(csv_path)
        except Exception as e:  # a malformed action must still give the one-line error
            return [(csv_key, f"cannot be read: {type(e).__name__}: {e}")]
        if len(placement) != pp:
            return [(csv_key, f"has {len(placement)} rows but there are {pp} pipeline ranks; write one row of "
                              "actions per rank")]
        stages = sorted(s for ranks in placement.values() for s in ranks)
        if stages != list(range(len(stages))) or not all(placement.values()):
            return [(csv_key, "must give every rank at least one stage and each of the stages 0..N-1 to exactly "
                              f"one rank; its rows hold stages {[placement[r] for r in sorted(placement)]}")]
    mbs, mbs_key = p.pipeline_parallel_microbatch_size, "parallelism.pipeline_parallel_microbatch_size"
    if mbs < 1 or t.local_batch_size % mbs != 0:
        return [(mbs_key, f"must be >= 1 and divide training.local_batch_size = {t.local_batch_size}")]
    if p.pipeline_parallel_layers_per_stage is not None and p.pipeline_parallel_layers_per_stage < 1:
        return [("parallelism.pipeline_parallel_layers_per_stage", "is invalid; it must be >= 1 or unset")]
    num_stages = count_stages(p, args.n_layers)
    schedule = "the CSV schedule" if csv_path else f"schedule {p.pipeline_parallel_schedule}"
    if csv_path is None:
        if is_single_stage(p.pipeline_parallel_schedule):
            ok, need = num_stages == pp, f"exactly {pp} stages (one per rank)"
        elif p.pipeline_parallel_schedule in V_SCHEDULES:
            ok, need = num_stages == 2 * pp, f"exactly {2 * pp} stages (two per rank)"
        else:
            ok, need = num_stages % pp == 0, f"a multiple of {pp} stages"
        if not ok:
            return [("parallelism.pipeline_parallel_schedule",
                     f"needs {need}, but the layer settings give {num_stages}; change "
                     "pipeline_parallel_layers_per_stage or module_fqns_per_model_part")]
    microbatches = t.local_batch_size // mbs
    if csv_path is not None and (in_csv := csv_microbatches(csv_path)) != microbatches:
        return [(csv_key, f"schedules {in_csv} micro-batches per step, but training.local_batch_size "
                          f"{t.local_batch_size} / pipeline_parallel_microbatch_size {mbs} gives {microbatches}; "
                          "make them agree")]
    if microbatches < num_stages:
        return [(mbs_key, f"gives {microbatches} micro-batches (training.local_batch_size {t.local_batch_size} / "
                          f"{mbs}), fewer than the {num_stages} stages of {schedule}; raise local_batch_size or "
                          "lower the micro-batch size")]
    if csv_path is None and p.pipeline_parallel_schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        # These run the micro-batches in rounds of (about) pp each; the rounds must all be the same size.
        rounds = max(1, microbatches // pp)
        if microbatches % rounds != 0:
            return [(mbs_key, f"gives {microbatches} micro-batches, which {schedule} cannot split into {rounds} "
                              f"equal rounds (of about pp = {pp}); use a multiple of {pp} micro-batches")]
    try:
        stage_module_names(p, args.n_layers, num_stages)
    except ValueError as e:
        return [(key, f"cannot be laid out: {e}")]
    if args.tie_embeddings or args.mtp_depth:
        # The last stage keeps a copy of the embedding (SharedEmbedding), summed with the first stage's over ranks.
        why, off = (("multi-token prediction blocks", "model.mtp_depth = 0") if args.mtp_depth else
                    ("an output head tied to it", "an untied flavor"))
        placement = stage_placement(p, args.n_layers)
        if any(0 in held and num_stages - 1 in held for held in placement.values()):
            return [(csv_key if csv_path else "parallelism.pipeline_parallel_schedule",
                     f"puts the first and last stages on one rank, where the last stage's copy of the embedding (for "
                     f"{why}) cannot be checkpointed beside the first's yet; use a schedule that does not (1F1B, "
                     f"Interleaved1F1B, ...) or {off}")]
        if t.enable_cpu_offload:
            return [("training.enable_cpu_offload", f"is not supported with pipeline parallelism and {why} (the "
                     "embedding copies' gradients are summed between ranks on the device)")]
    return []
