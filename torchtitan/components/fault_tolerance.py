"""Replica groups that fail and rejoin mid-run ([fault_tolerance]), through PyTorch's torchft.

A run is ``group_size`` replica groups, each an ordinary job of the config's layout (FSDP, TP, PP, CP inside
it), launched and relaunched on its own. Before every step torchft's lighthouse ($TORCHFT_LIGHTHOUSE) settles
which groups take part (the quorum), and torchft rebuilds the process group that joins the same rank of every
group in it. A group that dies makes the others' step fail to commit; they drop that step's batch and go on
without it, while nobody reads a checkpoint.

What a step counts (semi_sync.method = "none"): the groups in the quorum sum their gradients, their target
counts and their losses, so the loss is the mean over the tokens of the groups that took part and the update is
its gradient: with every group present exactly the job of group_size x the layout (HSDP across groups); with
one missing, a smaller global batch (``ft/groups`` in the metrics says how many took part). Throughput, MFU and
tokens_seen stay this group's own.

Live recovery: a group that joins behind the others (relaunched, or started late) receives, each of its ranks
from the same rank of a group in the quorum, what a checkpoint holds (weights, optimizer state, schedule, data
position, progress, the guard) over the groups' process group (torchft's PGTransport) before its first step, then trains in lock-step.
The data position is a count of rounds the same on every rank, and each group reads its own rows of every
round (data rank = replica_id x the group's data-parallel degree + its own), so the groups' data stays disjoint.

DiLoCo (semi_sync.method = "diloco", torchft.local_sgd.DiLoCo): each group takes ``sync_every`` steps of the
trainer's optimizer alone, then the groups average their weight change since the last synchronisation and an
outer SGD with Nesterov momentum applies it; with ``fragments`` > 1, runs of consecutive blocks take turns
(Streaming DiLoCo). The loss logged is this group's. A group that rejoins heals at the next synchronisation.
What a resume needs of DiLoCo is in this group's DCP checkpoint (under ``fault_tolerance.``): the outer SGD's
momentum per weight (``outer_momentum.<weight>``), the inner steps since the last synchronisation (``diloco_step``)
and, for a checkpoint between two synchronisations (the last step's, a preemption's), the weights the groups last
agreed on (``outer_weights.<weight>``; at a synchronisation they are the model's own). So killing every group and
resuming reproduces the uninterrupted run, bit for bit.

Everything sent to other groups goes through the manager's allreduce, which counts it (``ft/sent_bytes_per_step``:
the tensors this group contributes per step, summed over its ranks).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import FaultTolerance as FaultToleranceConfig
from torchtitan.config_fields import changed_fields
from torchtitan.log import logger
from torchtitan.models.shared.seeded_init import canonical_name

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class ReplicaGroupError(Exception):
    """The groups cannot agree (the lighthouse unreachable, no quorum in time); the message says which."""


def config_problems(cfg: FaultToleranceConfig, optimizer_name: str, guard_enabled: bool,
                    checkpoint_enabled: bool) -> list[tuple[str, str]]:
    """Problems with the [fault_tolerance] section as (field, reason) pairs."""
    sync = cfg.semi_sync
    changed = [f"fault_tolerance.{name}" for name in changed_fields(cfg, skip=("enable", "semi_sync"))]
    changed_sync = [f"fault_tolerance.semi_sync.{name}" for name in changed_fields(sync)]
    if not cfg.enable:
        if changed or changed_sync:
            return [("enable", f"but {(changed + changed_sync)[0]} is set; enable fault tolerance or leave the "
                               "[fault_tolerance] settings out")]
        return []
    if importlib.util.find_spec("torchft") is None:
        return [("enable", "needs torchft (pip install torchft, or this package's [ft] extra)")]
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address.startswith(("http://", "https://")):
        return [("enable", f"needs the lighthouse's address in ${LIGHTHOUSE_ENV} (e.g. http://localhost:29510 "
                           "after `torchft_lighthouse --min_replicas 1`; docs/fault_tolerance.md)"
                           + (f", not {address!r}" if address else ""))]
    problems = []
    if cfg.group_size < 1:
        problems.append(("group_size", "is invalid; it must be >= 1"))
    if not 0 <= cfg.replica_id < max(cfg.group_size, 1):
        problems.append(("replica_id", f"is invalid; it must be in [0, group_size = {cfg.group_size})"))
    if not 1 <= cfg.min_replica_size <= max(cfg.group_size, 1):
        problems.append(("min_replica_size", f"is invalid; it must be in [1, group_size = {cfg.group_size}]"))
    for name in ("timeout_seconds", "quorum_timeout_seconds"):
        if not getattr(cfg, name) > 0:
            problems.append((name, "is invalid; it must be > 0"))
    if optimizer_name == "AdamW8bit":
        problems.append(("enable", "cannot send AdamW8bit's 8-bit optimizer state to a recovering group; use "
                                   "optimizer.name = 'AdamW' or 'Muon'"))
    if sync.method == "none":
        if changed_sync and changed_sync[0] != "fault_tolerance.semi_sync.method":
            problems.append(("semi_sync.method", f"synchronises every step and ignores {changed_sync[0]}; set "
                                                 "method = 'diloco' or leave it out"))
        return problems
    if sync.sync_every < 1:
        problems.append(("semi_sync.sync_every", "is invalid; it must be >= 1"))
    if not sync.outer_lr > 0:
        problems.append(("semi_sync.outer_lr", "is invalid; it must be > 0"))
    if not 0 <= sync.outer_momentum < 1:
        problems.append(("semi_sync.outer_momentum", "is invalid; it must be in [0, 1)"))
    if sync.fragments < 1 or sync.sync_every % max(sync.fragments, 1):
        problems.append(("semi_sync.fragments", f"is invalid; it must be >= 1 and divide semi_sync.sync_every = "
                                                f"{sync.sync_every}"))
    if guard_enabled:
        problems.append(("semi_sync.method", "counts each group's optimizer steps to know when to synchronise, "
                                             "and the bad-step guard skips them per group; turn "
                                             "training.guard.enable off"))
    if checkpoint_enabled and sync.fragments > 1:
        problems.append(("semi_sync.fragments", "> 1 synchronises the fragments at different steps, so no step's "
                                                "checkpoint holds weights the groups agree on; use 1 fragment with "
                                                "checkpoint.enable"))
    return problems


def replica_folder(folder: str, cfg: FaultToleranceConfig) -> str:
    """This group's own folder under a shared one (job.dump_folder, or a checkpoint.folder given as an absolute path
    or URL): the groups never write, or clean up, each other's files."""
    return f"{folder.rstrip('/')}/replica_{cfg.replica_id}" if cfg.enable else folder


def data_coordinates(cfg: FaultToleranceConfig, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(data rank, data-parallel degree) over all groups: each group reads its own rows of every round."""
    if not cfg.enable:
        return dp_rank, dp_degree
    return cfg.replica_id * dp_degree + dp_rank, cfg.group_size * dp_degree


class ReplicaGroups(Stateful):
    """This group's place among the replica groups; with fault tolerance off, the only group (every method is
    then the identity or a constant). Checkpoints itself (key ``fault_tolerance``): torchft's step count."""

    def __init__(self, cfg: FaultToleranceConfig, device: torch.device, live_state: dict[str, Stateful],
                 model_parts: list[nn.Module], optimizer: torch.optim.Optimizer):
        self.cfg, self.enabled, self.device = cfg, cfg.enable, device
        self.every_step = cfg.enable and cfg.semi_sync.method == "none"
        self.diloco = None
        # DiLoCo keeps the weights the groups last agreed on: built at the first step, after any checkpoint load.
        self._diloco_parts = (model_parts, optimizer) if cfg.enable and not self.every_step else None
        self._outer: list[torch.optim.Optimizer] = []  # DiLoCo's outer SGD, one per fragment
        # DiLoCo's state a resume needs, by weight name (see the module doc); what a checkpoint gave is kept until
        # DiLoCo is built, and the keys a checkpoint holds decide what its load asks for (``prepare_load``).
        self._weights = _trainable_by_name(model_parts) if self._diloco_parts else {}
        self._momentum = bool(self._weights) and cfg.semi_sync.outer_momentum > 0
        self._loaded: dict[str, torch.Tensor] = {}
        self._loading: set[str] | None = None  # the DiLoCo kinds the checkpoint being loaded holds
        self._groups = None  # groups in the last quorum
        self.committed = True  # whether the last step's update was applied
        self._received = False  # a peer's live state was loaded since begin_step last looked
        self._sent, self._sent_logged, self._step_logged = 0, 0, 0
        if not self.enabled:
            return
        # torchft's Rust side logs every quorum at INFO: one line per step beside ours. RUST_LOG=info shows them.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        logging.getLogger("torchft.manager").addFilter(
            lambda record: "flight recorder" not in record.getMessage())  # NCCL's, warned at every new quorum

        self.live_state = live_state
        # The DTensor layout of every parameter by name: received shards become DTensors like this group's.
        self._layouts = {name: p for part in model_parts for name, p in _named_tensors(part)}
        timeout = timedelta(seconds=cfg.timeout_seconds)
        group_rank, group_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self._store = None
        store = {}
        if "MASTER_ADDR" not in os.environ:  # one process without torchrun: the manager needs a store to meet at
            self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": "localhost", "store_port": self._store.port}
        groups = self

        class CountingManager(Manager):
            def allreduce(self, tensor, *args, **kwargs):
                groups._sent += tensor.numel() * tensor.element_size()
                return super().allreduce(tensor, *args, **kwargs)

        from torchft.checkpointing.pg_transport import PGTransport

        pg = ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)
        try:
            self.manager = CountingManager(
                pg=pg, checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
                load_state_dict=self._receive, state_dict=self._send, min_replica_size=cfg.min_replica_size,
                # Synchronous: a group that heals loads the live state before its forward, so it takes part at once.
                use_async_quorum=False, timeout=timeout, connect_timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds), rank=group_rank, world_size=group_size,
                replica_id=f"torchtitan_replica_{cfg.replica_id}",
                init_sync=False,  # every group initialises the same weights from debug.seed
                **store,
            )
        except RuntimeError as e:  # torchft's connection error
            raise ReplicaGroupError(f"fault_tolerance: cannot reach the lighthouse at ${LIGHTHOUSE_ENV} = "
                                    f"{os.environ[LIGHTHOUSE_ENV]} within fault_tolerance.timeout_seconds = "
                                    f"{cfg.timeout_seconds:g}: {str(e).splitlines()[0][:200]}") from None
        logger.info(f"fault tolerance: replica group {cfg.replica_id} of {cfg.group_size}, lighthouse "
                    f"{os.environ[LIGHTHOUSE_ENV]}, synchronising "
                    + ("every step" if self.every_step else
                       f"by DiLoCo every {cfg.semi_sync.sync_every} steps in {cfg.semi_sync.fragments} fragment(s)"))

    def begin_step(self) -> bool:
        """Agree on this step's groups (every-step mode); True when this group has just taken a peer's live state
        (here, or at the previous step's DiLoCo synchronisation): the data iterator must then be made anew."""
        if self._diloco_parts is not None:
            self.diloco, self._outer = _build_diloco(self.manager, self.cfg.semi_sync, *self._diloco_parts,
                                                     self.device)
            self._diloco_parts = None
            self._restore_diloco()
        if self.every_step:
            self.manager.start_quorum()
            if self.manager.num_participants() != self._groups:
                self._groups = self.manager.num_participants()
                logger.info(f"replica groups taking part: {self._groups} of {self.cfg.group_size} (the loss and "
                            "the update are over their tokens)")
        received, self._received = self._received, False
        return received

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the groups of this step (every-step mode)."""
        return self._reduce(tensor, dist.ReduceOp.SUM)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s elementwise maximum over the groups of this step (every-step mode). A group that only
        watches this step (recovering) sends zeros."""
        return self._reduce(tensor, dist.ReduceOp.MAX)

    def _reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if not self.every_step:
            return tensor
        tensor = tensor.detach().clone()  # also waits for a functional collective's result
        self.manager.allreduce(tensor, reduce_op=op).wait()
        return tensor

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum this rank's gradient shards with the same rank's of the other groups, one flat buffer per dtype."""
        if not self.every_step:
            return
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def should_commit(self) -> bool:
        """Whether every group of the quorum finished this step's exchanges; if not, nothing may change."""
        self.committed = self.manager.should_commit() if self.every_step else True
        return self.committed

    def metrics(self, step: int) -> dict[str, float]:
        """Groups in the last quorum and this group's bytes sent to other groups per step since the last call (a
        sum over the group's ranks: every rank must call it)."""
        if not self.enabled:
            return {}
        sent = torch.tensor([float(self._sent - self._sent_logged)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(sent)
        steps = max(step - self._step_logged, 1)
        self._sent_logged, self._step_logged = self._sent, step
        return {"ft/groups": self.manager.num_participants(), "ft/sent_bytes_per_step": sent.item() / steps}

    def close(self) -> None:
        if self.enabled:
            self.manager.shutdown(wait=False)

    # ----- live recovery: this rank's part of every live state, DTensors as their local shards -----

    def _send(self) -> dict:
        return {name: _to_local(state.state_dict()) for name, state in self.live_state.items()}

    def _receive(self, received: dict) -> None:
        for name, state in self.live_state.items():
            local, dtensors = received[name]
            state.load_state_dict({key: self._as_dtensor(key, value) if key in dtensors else value
                                   for key, value in local.items()})
        self._received = True
        logger.info(f"took the live state of a peer group: step {self.live_state['train_state'].step}")

    def _as_dtensor(self, key: str, local: torch.Tensor) -> DTensor:
        # A weight's own name, or an optimizer entry "state.<weight>.<kind>", which is laid out like its weight.
        like = self._layouts[key if key in self._layouts else key.split(".", 1)[1].rsplit(".", 1)[0]]
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())

    # ----- its own checkpoint entry: torchft's count of committed steps, DiLoCo's outer momentum -----

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        state = {"manager": torch.tensor([self.manager.current_step(), self.manager.batches_committed()])}
        if self._weights:
            state.update(self._diloco_state())
        return state

    def prepare_load(self, metadata) -> None:
        """Ask a checkpoint for the DiLoCo state it holds: the agreed weights only if it was taken between two
        synchronisations; none at all if an earlier version wrote it (the momentum then restarts, with a warning)."""
        held = {name.split(".")[1] for name in metadata.state_dict_metadata if name.startswith("fault_tolerance.")}
        self._loading = held & {_MOMENTUM, _STEP, _AGREED}
        if self._weights and _STEP not in self._loading:
            logger.warning("the checkpoint holds no DiLoCo state (written by an earlier version): the outer SGD's "
                           "momentum restarts from zero, so the run departs from an uninterrupted one")

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and "manager" in state:
            step, batches = (int(x) for x in state["manager"].tolist())
            self.manager.load_state_dict({"step": step, "batches_committed": batches})
        self._loaded = {key: value for key, value in state.items() if key != "manager"}
        self._loading = None
        if self.diloco is not None:
            self._restore_diloco()

    def _diloco_state(self) -> dict[str, torch.Tensor]:
        """DiLoCo's checkpoint entries (module doc), or, while a checkpoint is being loaded, the ones it holds.

        Before the first synchronisation the outer SGD has no momentum yet: zeros are saved, which it then takes
        exactly as if fresh (with no dampening a fresh buffer is the gradient itself, and 0.9 x 0 + g = g)."""
        kinds = self._loading if self._loading is not None else {_STEP, *([_MOMENTUM] if self._momentum else [])}
        step = self.diloco._local_step if self.diloco is not None else 0  # torchft's count since the last sync
        if self._loading is None and step:
            kinds.add(_AGREED)
        momentum = {id(p): s["momentum_buffer"] for outer in self._outer for p, s in outer.state.items()
                    if s.get("momentum_buffer") is not None}
        agreed = self._agreed_weights() if _AGREED in kinds and self._loading is None else {}
        state = {}
        if _STEP in kinds:
            state[_STEP] = self._loaded.get(_STEP, torch.tensor([step]))
        for name, p in self._weights.items():
            for kind, value in ((_MOMENTUM, momentum.get(id(p))), (_AGREED, agreed.get(name))):
                if kind in kinds:
                    key = f"{kind}.{name}"
                    state[key] = value if value is not None else self._loaded.get(key, torch.zeros_like(p.detach()))
        return state

    def _agreed_weights(self) -> dict[str, torch.Tensor]:
        """The weights the groups last agreed on, which DiLoCo keeps as local shards on the host, laid out as the
        model's (DTensors where the weights are), so a checkpoint of them reshards like the weights."""
        names = {id(p): name for name, p in self._weights.items()}
        agreed = {}
        for fragment in self.diloco._fragments:
            for local_name, p in fragment._model_fragment.named_parameters():
                if id(p) in names:
                    # A DTensor's shard lives on its mesh's device: a GPU run copies the host copy back for the save
                    # (a checkpoint between synchronisations only; at one the agreed weights are the model's).
                    kept = fragment.original_parameters[local_name].to(p.device)
                    agreed[names[id(p)]] = DTensor.from_local(kept, p.device_mesh, p.placements, shape=p.shape,
                                                              stride=p.stride()) if isinstance(p, DTensor) else kept
        return agreed

    def _restore_diloco(self) -> None:
        """Hand what a checkpoint gave to DiLoCo, once it exists: the momentum, the inner step count, and the
        agreed weights of a checkpoint taken between two synchronisations."""
        outer_of = {id(p): outer for outer in self._outer for group in outer.param_groups for p in group["params"]}
        names = {id(p): name for name, p in self._weights.items()}
        for name, p in self._weights.items():
            if (buffer := self._loaded.get(f"{_MOMENTUM}.{name}")) is not None and id(p) in outer_of:
                outer_of[id(p)].state[p]["momentum_buffer"] = buffer
        for fragment in self.diloco._fragments:
            for local_name, p in fragment._model_fragment.named_parameters():
                if (agreed := self._loaded.get(f"{_AGREED}.{names.get(id(p))}")) is not None:
                    local = agreed.to_local() if isinstance(agreed, DTensor) else agreed
                    fragment.original_parameters[local_name].copy_(local)
        if _STEP in self._loaded:
            step, every = int(self._loaded[_STEP].item()), self.cfg.semi_sync.sync_every
            if step >= every:
                raise ReplicaGroupError(f"fault_tolerance.semi_sync.sync_every = {every}: the checkpoint was taken "
                                        f"{step} inner steps after the groups' last synchronisation; resume with "
                                        f"sync_every > {step} (the one it was trained with)")
            self.diloco._local_step = step
        self._loaded = {}


# DiLoCo's checkpoint entries under fault_tolerance.: the outer momentum and the agreed weights per weight name, the
# inner step count.
_MOMENTUM, _AGREED, _STEP = "outer_momentum", "outer_weights", "diloco_step"


def _trainable_by_name(model_parts: list[nn.Module]) -> dict[str, nn.Parameter]:
    return {canonical_name(name): p for part in model_parts for name, p in part.named_parameters() if p.requires_grad}


def _named_tensors(part: nn.Module):
    for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
        if isinstance(tensor, DTensor):
            yield canonical_name(name), tensor


def _to_local(state: dict) -> tuple[dict, list[str]]:
    local = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}
    return local, [key for key, value in state.items() if isinstance(value, DTensor)]


def _build_diloco(manager, cfg, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                  device: torch.device) -> tuple[object, list[torch.optim.Optimizer]]:
    """torchft's DiLoCo around the inner optimizer, and its outer SGDs (one per fragment)."""
    from torchft.local_sgd import DiLoCo

    fragments = model_fragments(model_parts, cfg.fragments)
    outer = [torch.optim.SGD([p for p in fragment.parameters() if p.requires_grad], lr=cfg.outer_lr,
                             momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0) for fragment in fragments]
    diloco = DiLoCo(manager, fragments, optimizer, outer, sync_every=cfg.sync_every,
                    pin_memory=device.type == "cuda")
    diloco.__enter__()  # hooks the inner optimizer's step; they live as long as the run
    # What checkpoints save and restore of it (ReplicaGroups._diloco_state) is torchft's own state, not its API.
    fragment = diloco._fragments[0] if hasattr(diloco, "_fragments") else None
    if not (hasattr(diloco, "_local_step") and hasattr(fragment, "original_parameters")
            and hasattr(fragment, "_model_fragment")):
        import torchft

        raise ReplicaGroupError(f"this torchft ({getattr(torchft, '__version__', 'unknown version')}) keeps "
                                "DiLoCo's state under other names than the checkpoints read (_local_step, "
                                "_fragments[i].original_parameters); install the torchft 0.2 this was built on")
    return diloco, outer


def model_fragments(model_parts: list[nn.Module], n: int) -> list[nn.Module]:
    """``n`` runs of consecutive top-level modules (each block one module) of about equal parameter counts."""
    units = []
    for part in model_parts:
        for child in part.children():
            units += list(child.values() if isinstance(child, nn.ModuleDict) else child) \
                if isinstance(child, (nn.ModuleDict, nn.ModuleList)) else [child]
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    total, fragments, current, filled = sum(sizes), [], [], 0
    for unit, size in zip(units, sizes):
        current.append(unit)
        filled += size
        if filled >= total * (len(fragments) + 1) / n and len(fragments) < n - 1:
            fragments.append(nn.ModuleList(current))
            current = []
    fragments.append(nn.ModuleList(current))
    if len(fragments) != n or not all(len(f) for f in fragments):
        raise ValueError(f"fault_tolerance.semi_sync.fragments = {n}: the model has {len(units)} top-level modules "
                         "to split, too few for that many fragments")
    seen = set()
    for fragment in fragments:
        ids = {id(p) for p in fragment.parameters()}
        if ids & seen:
            raise ValueError(f"fault_tolerance.semi_sync.fragments = {n}: a weight is shared between fragments "
                             "(tied embeddings); use 1 fragment")
        seen |= ids
    return fragments
