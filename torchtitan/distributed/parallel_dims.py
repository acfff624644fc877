"""ParallelDims: the parallel degrees of a run and the device meshes built from them.

Expert parallelism (EP) adds no ranks of its own: its group is the innermost ``ep`` ranks of the
data-parallel-shard x context-parallel ranks, so turning it on changes no other degree. The experts are
sharded over those ``ep`` ranks and FSDP-sharded over the rest of dp_shard x cp ("efsdp"). To carve EP out of
dp_shard x cp, the mesh is built from finer dimensions (dp_shard = dp_shard_out x dp_shard_in, cp = cp_out x
cp_in, EP = dp_shard_in x cp_in), and every name below is a view over them.
"""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost to innermost: pipeline stages span the slowest links, tensor parallel the fastest.
MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Views made of several dimensions: data loading, FSDP, and the loss; expert parallel and the experts' FSDP.
FLAT_MESHES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
               "dp_cp": ("dp_replicate", "dp_shard", "cp")}
MESH_NAMES = (*MESH_DIM_ORDER, *FLAT_MESHES, "ep", "efsdp")


@dataclass
class ParallelDims:
    """Degrees already checked by config validation; dp_shard is resolved (never -1)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    data_parallel: bool = True
    """False where every rank runs the same batch (generation): no FSDP wraps the model, and the dp_shard ranks
    only carry expert parallelism."""
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
                   tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, world_size=world_size,
                   ep=p.expert_parallel_degree)

    def expert_parallel_problem(self) -> str | None:
        """Why parallelism.expert_parallel_degree cannot be carved out of dp_shard x cp, or None."""
        ep, ranks = self.ep, self.dp_shard * self.cp
        if ep == 1:
            return None
        if ranks % ep:
            return (f"does not divide data_parallel_shard_degree x context_parallel_degree = {self.dp_shard} x "
                    f"{self.cp} = {ranks}, the ranks expert parallelism is carved from")
        if self.cp % ep and ep % self.cp:
            return (f"must divide context_parallel_degree = {self.cp} or be a multiple of it (its group is the "
                    "innermost ranks of dp_shard x cp)")
        return None

    @property
    def efsdp(self) -> int:
        """Ranks the experts are FSDP-sharded over (dp_shard x cp / ep; the rest of dp_shard x cp)."""
        return self.dp_shard * self.cp // self.ep

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
                "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp, "ep": self.ep}

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
        return self.data_parallel and self.fsdp_degree > 1

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

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def _dimensions(self) -> tuple[list[tuple[str, int]], dict[str, list[str]]]:
        """The mesh's dimensions (name, size), outermost first, and the dimensions each name is made of."""
        if not self.ep_enabled:
            dims = list(zip(MESH_DIM_ORDER, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
            parts = {name: [name] for name in MESH_DIM_ORDER}
        else:
            # EP takes the innermost ranks: all of cp_in = min(ep, cp) and then dp_shard_in = ep / cp_in.
            cp_in = min(self.ep, self.cp)
            dp_in = self.ep // cp_in
            dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard_out", self.dp_shard // dp_in),
                    ("dp_shard_in", dp_in), ("cp_out", self.cp // cp_in), ("cp_in", cp_in), ("tp", self.tp)]
            parts = {"pp": ["pp"], "dp_replicate": ["dp_replicate"], "dp_shard": ["dp_shard_out", "dp_shard_in"],
                     "cp": ["cp_out", "cp_in"], "tp": ["tp"], "ep": ["dp_shard_in", "cp_in"],
                     "efsdp": ["dp_shard_out", "cp_out"]}
        for flat, names in FLAT_MESHES.items():
            parts[flat] = [dim for name in names for dim in parts[name]]
        sizes = dict(dims)
        parts = {name: [d for d in dims_of if sizes[d] > 1] for name, dims_of in parts.items()}
        if self.ep_enabled and not parts["efsdp"]:
            # The experts' FSDP needs its mesh even when it spans one rank (then it only casts and reduces dtypes).
            dims.insert(2, ("efsdp", 1))
            parts["efsdp"] = ["efsdp"]
        return [(d, n) for d, n in dims if n > 1 or d == "efsdp"], parts

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh, with the views 'dp' (data loading), 'dp_shard_cp' (FSDP), 'dp_cp' (loss), and with
        expert parallelism 'ep' and 'efsdp' (the experts' FSDP)."""
        if self.world_size == 1:
            return None
        dims, parts = self._dimensions()
        mesh = init_device_mesh(device_type, [n for _, n in dims], mesh_dim_names=tuple(d for d, _ in dims))
        self._mesh = mesh
        # Views are kept here: torch wants flattened meshes bookkept, not sliced again from the root.
        self._flat = {}
        for name, dims_of in parts.items():
            if not dims_of:
                continue
            if dims_of == [name]:
                self._flat[name] = mesh[name]
            else:
                self._flat[name] = mesh[tuple(dims_of)]._flatten(name)
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
        return self._flat.get(name)

    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: dp_shard x cp, with dp_replicate as an outer dimension for HSDP."""
        return self._with_replicas(self.submesh("dp_shard_cp"))

    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """What the experts' FSDP shards over under expert parallelism (efsdp, HSDP with dp_replicate); else None."""
        return self._with_replicas(self.submesh("efsdp")) if self.ep_enabled else None

    def _with_replicas(self, shard_mesh: DeviceMesh) -> DeviceMesh:
        if not self.dp_replicate_enabled:
            return shard_mesh
        return DeviceMesh._concatenate([self.submesh("dp_replicate"), shard_mesh])

    def dp_coordinates(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, data-parallel degree) for sharding the data."""
        mesh = self.submesh("dp")
        return (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
