"""Whole matrices, each on one owner rank: gather the shards of DTensor matrices to their owners, and send every
rank its shard of each owner's result. For an optimizer step that needs a whole matrix (Muon's
orthogonalisation) and should compute it once per step, not on every rank that holds a shard.

A matrix is a 2-D parameter or one expert of a stacked ``[experts, in, out]`` parameter. Its holders are the
ranks of its DTensor's mesh that hold a non-empty piece of it; ranks whose pieces are the same (replicas, e.g.
HSDP's replicate dimension) hold one distinct piece. Owners are assigned once, greedily, largest matrix first,
to the holder with the least load among the matrices of the same holders (load: rows * cols * min(rows, cols),
Newton-Schulz's cost); a holder with the whole matrix (an expert under expert parallelism) is preferred, since it
needs no traffic at all.

Per step, one all-to-all over the world gathers (each distinct piece travels once, from the replica in the
owner's replica position, to the owner), and one sends back (the owner's result, to every holder its piece).
All matrices of all meshes travel in those two collectives, so every rank calls exactly two per step whatever
its pipeline stage holds. Pieces are placed by index: each rank's piece is computed from the DTensor's
placements (Shard, FSDP2's _StridedShard, Replicate) the way distribute_tensor splits a tensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchtitan.distributed.device import device_type

Index = slice | torch.Tensor


def piece_indices(shape: torch.Size, mesh_shape: tuple[int, ...], placements, coordinate) -> list[torch.Tensor]:
    """The global indices, per tensor dimension, of the piece that the rank at ``coordinate`` holds: the splits
    distribute_tensor makes, mesh dimension by mesh dimension, applied to an arange of each tensor dimension."""
    index = [torch.arange(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if isinstance(placement, _StridedShard):
            along = _StridedShard(0, split_factor=placement.split_factor)
        elif isinstance(placement, Shard):
            along = Shard(0)
        else:
            raise TypeError(f"a matrix placed as {placement} on mesh dimension {mesh_dim} cannot be gathered: "
                             "only Shard, _StridedShard and Replicate placements can")
        dim = placement.dim % len(shape)
        chunks, _ = along._split_tensor(index[dim], mesh_shape[mesh_dim], with_padding=False)
        index[dim] = chunks[coordinate[mesh_dim]]
    return index


def _as_index(indices: torch.Tensor, device: torch.device) -> Index:
    """A slice for a contiguous run of indices (cheap views), else the index tensor on the device."""
    if len(indices) and indices[-1] - indices[0] + 1 == len(indices) and bool((indices.diff() == 1).all()):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return indices.to(device)


def _length(index: Index) -> int:
    return index.stop - index.start if isinstance(index, slice) else len(index)


def _cross(rows: Index, cols: Index, device: torch.device) -> tuple:
    """Index a 2-D tensor with the rows x cols block (a view when both are slices)."""
    if isinstance(rows, slice) and isinstance(cols, slice):
        return rows, cols
    rows = torch.arange(rows.start, rows.stop, device=device) if isinstance(rows, slice) else rows
    cols = torch.arange(cols.start, cols.stop, device=device) if isinstance(cols, slice) else cols
    return rows[:, None], cols


@dataclass
class Matrix:
    name: str  # the parameter's name, with "[e]" for expert e of a stack
    param: int  # position in the parameter list
    expert: int | None  # the expert of a stacked parameter; None for a 2-D parameter
    shape: tuple[int, int]
    owner: int = -1
    # rank -> (rows, cols) of its piece, for every holder (replicas included)
    pieces: dict[int, tuple[Index, Index]] = field(default_factory=dict)
    # rank -> the rank that sends it its distinct piece, for the pieces the owner receives
    senders: list[int] = field(default_factory=list)
    local_position: int | None = None  # the expert's position in this rank's local stack


class WholeMatrices:
    """The owner plan for a list of parameters (those that are not DTensors are left out); ``gather`` and
    ``scatter`` move one step's tensors along it. Every rank of the world must build it and call both methods,
    in the same order, even one that holds no DTensor matrix."""

    def __init__(self, params: list[torch.Tensor], names: list[str]):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = params
        self.matrices: list[Matrix] = []
        for position, (param, name) in enumerate(zip(params, names)):
            if isinstance(param, DTensor):
                self.matrices.extend(self._matrices_of(position, param, name))
        self._assign_owners()
        self.owned = [m for m in self.matrices if m.owner == self.rank]
        # The routes of both collectives, as (other rank, matrix index), in the order both ends use.
        me, matrices = self.rank, list(enumerate(self.matrices))
        self._gather_out = sorted((m.owner, i) for i, m in matrices if me in m.senders)
        self._gather_in = sorted((sender, i) for i, m in matrices if m.owner == me for sender in m.senders)
        self._scatter_out = sorted((holder, i) for i, m in matrices if m.owner == me for holder in m.pieces)
        self._scatter_in = sorted((m.owner, i) for i, m in matrices if me in m.pieces)

    def _matrices_of(self, position: int, param: DTensor, name: str) -> list[Matrix]:
        mesh = param.device_mesh.mesh
        device = param.to_local().device
        coordinates = itertools.product(*(range(n) for n in mesh.shape))
        holdings = {rank: piece_indices(param.shape, tuple(mesh.shape), param.placements, coordinate)
                    for rank, coordinate in zip(mesh.flatten().tolist(), coordinates)}
        if self.rank in holdings:  # the split must be DTensor's: this rank's piece has its local shape
            mine = tuple(len(index) for index in holdings[self.rank])
            if mine != tuple(param.to_local().shape):
                raise AssertionError(f"{name}: computed local shape {mine} != {tuple(param.to_local().shape)}")
        if param.ndim == 2:
            matrix = Matrix(name, position, None, tuple(param.shape))
            for rank, (rows, cols) in holdings.items():
                if len(rows) and len(cols):
                    matrix.pieces[rank] = (_as_index(rows, device), _as_index(cols, device))
            return [matrix]
        matrices = [Matrix(f"{name}[{expert}]", position, expert, tuple(param.shape[1:]))
                    for expert in range(param.shape[0])]
        for rank, (experts, rows, cols) in holdings.items():
            if not (len(rows) and len(cols)):
                continue
            piece = (_as_index(rows, device), _as_index(cols, device))
            for local_position, expert in enumerate(experts.tolist()):
                matrices[expert].pieces[rank] = piece
                if rank == self.rank:
                    matrices[expert].local_position = local_position
        return matrices

    def _assign_owners(self) -> None:
        # Loads are kept per set of holders: every rank that holds a matrix sees the same matrices with that set
        # (its peers hold the same parameters), so all of them make the same choices, while a rank outside the set
        # (another pipeline stage, the other copy of a sub-mesh's tensor) may see other matrices altogether.
        loads: dict[frozenset, dict[int, int]] = {}
        order = sorted(range(len(self.matrices)),
                       key=lambda i: (-self._cost(self.matrices[i]), i))
        for i in order:
            matrix = self.matrices[i]
            rows, cols = matrix.shape
            whole = [rank for rank, (r, c) in matrix.pieces.items() if _length(r) * _length(c) == rows * cols]
            candidates = whole or sorted(matrix.pieces)
            load = loads.setdefault(frozenset(matrix.pieces), dict.fromkeys(matrix.pieces, 0))
            matrix.owner = min(candidates, key=lambda rank: (load[rank], rank))
            load[matrix.owner] += self._cost(matrix)
            # One sender per distinct piece: the owner for its own, else the replica in the owner's position
            # among the holders of its piece.
            replicas: dict[tuple, list[int]] = {}
            for rank in sorted(matrix.pieces):
                replicas.setdefault(self._key(matrix.pieces[rank]), []).append(rank)
            own = replicas[self._key(matrix.pieces[matrix.owner])]
            position = own.index(matrix.owner)
            matrix.senders = [holders[position % len(holders)] for holders in replicas.values()]
            covered = sum(_length(matrix.pieces[s][0]) * _length(matrix.pieces[s][1]) for s in matrix.senders)
            if covered != rows * cols:
                raise AssertionError(f"{matrix.name}: its distinct pieces cover {covered} of {rows * cols} elements")

    @staticmethod
    def _cost(matrix: Matrix) -> int:
        rows, cols = matrix.shape
        return rows * cols * min(rows, cols)

    @staticmethod
    def _key(piece: tuple[Index, Index]) -> tuple:
        return tuple((i.start, i.stop) if isinstance(i, slice) else tuple(i.tolist()) for i in piece)

    def _my_piece(self, matrix: Matrix, local: torch.Tensor) -> torch.Tensor:
        return local if matrix.expert is None else local[matrix.local_position]

    def _piece_numel(self, i: int, rank: int) -> int:
        rows, cols = self.matrices[i].pieces[rank]
        return _length(rows) * _length(cols)

    def gather(self, locals_: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """The whole matrices this rank owns, by name, from every rank's local tensors (one per parameter, in
        the plan's order; None for those that are not DTensors). All local tensors share one dtype."""
        dtype, device = self._dtype_device(locals_)
        send = [self._my_piece(self.matrices[i], locals_[self.matrices[i].param]).reshape(-1)
                for _, i in self._gather_out]
        sizes = [self._piece_numel(i, sender) for sender, i in self._gather_in]
        received = self._all_to_all(send, self._gather_out, sizes, self._gather_in, dtype, device)
        whole = {m.name: torch.empty(m.shape, dtype=dtype, device=device) for m in self.owned}
        for (sender, i), flat in zip(self._gather_in, received.split(sizes)):
            rows, cols = self.matrices[i].pieces[sender]
            whole[self.matrices[i].name][_cross(rows, cols, device)] = flat.view(_length(rows), _length(cols))
        return whole

    def scatter(self, results: dict[str, torch.Tensor], locals_: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Every rank's local pieces of the owners' ``results`` (by name, as gather returned them): new tensors
        shaped like ``locals_`` (None where that is None)."""
        dtype, device = self._dtype_device(locals_)
        send = [results[self.matrices[i].name][_cross(*self.matrices[i].pieces[holder], device)].reshape(-1).to(dtype)
                for holder, i in self._scatter_out]
        sizes = [self._piece_numel(i, self.rank) for _, i in self._scatter_in]
        received = self._all_to_all(send, self._scatter_out, sizes, self._scatter_in, dtype, device)
        out = [None if t is None else torch.empty_like(t, dtype=dtype) for t in locals_]
        for (_, i), flat in zip(self._scatter_in, received.split(sizes)):
            target = self._my_piece(self.matrices[i], out[self.matrices[i].param])
            target.copy_(flat.view(target.shape))
        return out

    def _dtype_device(self, locals_: list[torch.Tensor | None]) -> tuple[torch.dtype, torch.device]:
        present = [t for t in locals_ if t is not None]
        if not present:  # a rank without DTensor matrices still takes part in both collectives
            return torch.float32, torch.device(device_type())
        return present[0].dtype, present[0].device

    def _all_to_all(self, send: list[torch.Tensor], send_route: list[tuple[int, int]], receive: list[int],
                    receive_route: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One all-to-all over the world: ``send`` (pieces, to the ranks of ``send_route``) out, and the pieces
        of ``receive`` sizes (from the ranks of ``receive_route``) in, as one flat tensor in route order."""
        send_sizes, receive_sizes = [0] * self.world, [0] * self.world
        for (rank, _), piece in zip(send_route, send):
            send_sizes[rank] += piece.numel()
        for (rank, _), n in zip(receive_route, receive):
            receive_sizes[rank] += n
        buffer = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
        received = torch.empty(sum(receive_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(received, buffer, receive_sizes, send_sizes)
        return received
