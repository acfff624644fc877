"""ParallelDims: the parallel degrees of a run and the device meshes built from them."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost to innermost: pipeline stages span the slowest links, tensor parallel the fastest.
MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Views made of several dimensions: data loading, FSDP, and the loss.
FLAT_MESHES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
               "dp_cp": ("dp_replicate", "dp_shard", "cp")}
MESH_NAMES = (*MESH_DIM_ORDER, *FLAT_MESHES)


@dataclass
class ParallelDims:
    """Degrees already checked by config validation; dp_shard is resolved (never -1)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        """The degrees of ``parallelism`` on ``world_size`` ranks, data_parallel_shard_degree = -1 resolved to
        the ranks the other degrees leave over. When they do not fit, raises ValueError with the reason, to
        be put after "parallelism.data_parallel_shard_degree = <value>".

        Needs no process group: config validation and the planner use it too.
        """
        p = parallelism
        others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
        others *= p.pipeline_parallel_degree
        dp_shard = p.data_parallel_shard_degree
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(f"cannot fill the world size {world_size}: the other degrees multiply to "
                                 f"{others}, which does not divide it")
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ValueError(f"is invalid: replicate x shard x tp x pp x cp = {others * dp_shard}, but the world "
                             f"size is {world_size}; the degrees must multiply to the world size")
        return cls(dp_replicate=p.data_parallel_replicate_degree, dp_shard=dp_shard, cp=p.context_parallel_degree,
                   tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, world_size=world_size)

    def global_batch_size(self, training) -> int:
        """Sequences per optimizer step: training.global_batch_size, or -1 = one micro-batch per dp rank."""
        if training.global_batch_size == -1:
            return training.local_batch_size * self.dp
        return training.global_batch_size

    def grad_accum_steps(self, training) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step (validation checks it divides)."""
        return self.global_batch_size(training) // (training.local_batch_size * self.dp)

    def layout(self) -> dict:
        """The degrees as a plain dict (for logs and provenance)."""
        return {"world_size": self.world_size, "pp": self.pp, "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_degree(self) -> int:
        """What FSDP shards parameters, gradients and optimizer state over (context-parallel ranks too)."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp_degree > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh, with flattened views 'dp' (data loading), 'dp_shard_cp' (FSDP), 'dp_cp' (loss)."""
        if self.world_size == 1:
            return None
        sizes = dict(zip(MESH_DIM_ORDER, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        names = [n for n in MESH_DIM_ORDER if sizes[n] > 1]
        mesh = init_device_mesh(device_type, [sizes[n] for n in names], mesh_dim_names=tuple(names))
        self._mesh = mesh
        # Flattened views are kept here: torch wants them bookkept, not sliced again from the root.
        self._flat = {}
        for flat, parts in FLAT_MESHES.items():
            present = tuple(p for p in parts if p in names)
            if present:
                self._flat[flat] = mesh[present]._flatten(flat) if len(present) > 1 else mesh[present[0]]
        return mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """A named (possibly flattened) sub-mesh, or None when that dimension has size 1.

        Raises ValueError for a name that is no dimension at all, so a misspelt name cannot pass for
        "size 1" and silently skip, say, the loss all-reduce.
        """
        if name not in MESH_NAMES:
            raise ValueError(f"no mesh dimension named {name!r}; valid: {', '.join(MESH_NAMES)}")
        if self._mesh is None:
            return None
        if name in self._flat:
            return self._flat[name]
        if name in self._mesh.mesh_dim_names:
            return self._mesh[name]
        return None

    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: dp_shard x cp, with dp_replicate as an outer dimension for HSDP."""
        if not self.dp_replicate_enabled:
            return self.submesh("dp_shard_cp")
        return self._mesh[("dp_replicate", "dp_shard_cp" if self.cp_enabled else "dp_shard")]

    def dp_coordinates(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, data-parallel degree) for sharding the data."""
        mesh = self.submesh("dp")
        return (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
