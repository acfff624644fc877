"""Whole matrices on owner ranks (distributed/whole_matrices.py), on 4 gloo ranks: for every placement our layouts
make (FSDP's Shard(0), TP's Shard(0)/Shard(1), FSDP2 + TP's _StridedShard, HSDP's Replicate, EP's expert shards,
uneven sizes), the owner receives exactly the global matrix, each matrix has exactly one owner, and every rank
gets back exactly its piece of the owner's result; Muon's step on DTensors equals the step on whole tensors.
"""

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

WORLD = 4
# (name, global shape, placements on the ("dp", "tp") mesh); a 1-D mesh entry says which dimension
CASES = [
    ("fsdp_rows", (12, 8), (Shard(0), Shard(0))),
    ("tp_cols", (8, 12), (Shard(0), Shard(1))),
    ("strided", (16, 6), (_StridedShard(0, split_factor=2), Shard(0))),
    ("hsdp", (10, 6), (Replicate(), Shard(0))),
    ("replicated", (5, 7), (Replicate(), Replicate())),
    ("uneven", (5, 3), (Shard(0), Shard(1))),
    ("experts_ep", (4, 6, 10), (Shard(0), Replicate())),
    ("experts_ep_fsdp", (4, 6, 10), (Shard(0), Shard(1))),
    ("experts_uneven", (3, 5, 4), (Shard(0), Shard(2))),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    from torchtitan.components.optimizers import muon
    from torchtitan.components.optimizers.muon import MuonWithAdamW
    from torchtitan.config.job_config import Optimizer as OptimizerConfig
    from torchtitan.distributed.whole_matrices import WholeMatrices

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same global tensors on every rank
    globals_ = [torch.randn(shape) for _, shape, _ in CASES]
    params = [distribute_tensor(g, mesh, placements) for g, (_, _, placements) in zip(globals_, CASES)]
    # A tensor on the 1-D "tp" sub-mesh (ranks that are not on a mesh take part but hold nothing of it) and a
    # plain tensor, which the plan leaves out.
    globals_.append(torch.randn(6, 4))
    params.append(distribute_tensor(globals_[-1], mesh["tp"], [Shard(1)]))
    globals_.append(torch.randn(3, 3))
    params.append(globals_[-1].clone())
    names = [name for name, _, _ in CASES] + ["tp_submesh", "plain"]

    plan = WholeMatrices(params, names)
    locals_ = [p.to_local() if p is not params[-1] else None for p in params]
    whole = plan.gather(locals_)
    expected = {}
    for name, g in zip(names, globals_):
        if g.ndim == 3:
            expected.update({f"{name}[{e}]": g[e] for e in range(g.shape[0])})
        elif name != "plain":
            expected[name] = g
    for name, tensor in whole.items():
        assert torch.equal(tensor, expected[name]), name
    results = {name: tensor * 3 + 1 for name, tensor in whole.items()}
    back = plan.scatter(results, locals_)
    for name, param, g, local in zip(names, params, globals_, back):
        if name == "plain":
            assert local is None
            continue
        want = distribute_tensor(g * 3 + 1, param.device_mesh, param.placements).to_local()
        assert torch.equal(local, want), name

    # Muon on these DTensors equals Muon on the whole tensors (5 steps, fresh gradients each step).
    cfg = OptimizerConfig(name="Muon", lr=0.02, weight_decay=0.1)
    sharded = [torch.nn.Parameter(p.clone()) for p in params]
    plain = [torch.nn.Parameter(g.clone()) for g in globals_]
    optimizers = [MuonWithAdamW(ps, [], cfg, {"fused": False, "foreach": False}, torch.float32, muon_names=names)
                  for ps in (sharded, plain)]
    calls = []
    counted = muon.newton_schulz

    def counting(x, *args):
        calls.append(x.shape[0] if x.ndim == 3 else 1)
        return counted(x, *args)

    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        for s, p in zip(sharded, plain):
            p.grad = torch.randn(p.shape, generator=generator)
            s.grad = distribute_tensor(p.grad, s.device_mesh, s.placements) if hasattr(s, "device_mesh") \
                else p.grad.clone()
        muon.newton_schulz = counting
        optimizers[0].step()
        muon.newton_schulz = counted
        optimizers[1].step()
    worst = max((s.full_tensor() if hasattr(s, "full_tensor") else s).sub(p).abs().max().item()
                for s, p in zip(sharded, plain))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"owned": [m.name for m in plan.owned], "calls": sum(calls), "worst": worst}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_owners_get_whole_matrices_and_every_rank_its_piece_back(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path / "out")), nprocs=WORLD)
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(WORLD)]
    owned = sorted(name for rank in ranks for name in rank["owned"])
    experts = [f"{name}[{e}]" for name, shape, _ in CASES if len(shape) == 3 for e in range(shape[0])]
    # Each matrix has exactly one owner; the tensor on the "tp" sub-mesh is two tensors, one per sub-mesh.
    expected = sorted([name for name, shape, _ in CASES if len(shape) == 2] + experts + ["tp_submesh"] * 2)
    assert owned == expected
    assert all(rank["owned"] for rank in ranks)  # and the work is spread over every rank
    # Each step orthogonalises each sharded matrix once over all ranks, plus the plain tensor on every rank.
    assert sum(rank["calls"] for rank in ranks) == 5 * (len(expected) + WORLD)
    assert max(rank["worst"] for rank in ranks) < 1e-6
