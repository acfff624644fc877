"""The global gradient norm and the clipped optimizer step.

The norm is the float64 norm to float32 precision on every device. The step clips as PyTorch's
``clip_grad_norm_`` does, whichever optimizer implementation runs it; a fused optimizer, which divides by the
clip scale inside its own kernel, gives the same bits as clipping float32 gradients first (and FSDP-sharded
DTensors on two gloo ranks match the foreach optimizer clipping first), and the norm of DTensor gradients is that
of their whole tensors.
"""

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan.components.optimizers.optimizer import build_optimizer, clipped_step
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.device import device_type
from torchtitan.distributed.grad_norm import clip_grads_, clip_scale, global_grad_norm

SHAPES = [(300, 200), (50,), (7, 13)]


def _params_with_grads(shapes, device, dtype=torch.float32):
    params = [torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)) for shape in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device) * 1e-3).to(dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_large_gradients_equals_the_float64_norm(dtype):
    # An output-layer-sized gradient: PyTorch's float32 CPU norm was 1e-4 off on this size.
    params = _params_with_grads([(2048, 256), (256,), (768, 256)], device_type(), dtype)
    expected = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    norm = global_grad_norm(params)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(expected, rel=1e-6)


def test_norm_leaves_out_copies_counted_elsewhere():
    params = _params_with_grads(SHAPES, device_type())
    expected = torch.cat([p.grad.double().flatten() for p in params[:2]]).norm().item()
    assert global_grad_norm(params, counted_elsewhere=[params[2]]).item() == pytest.approx(expected, rel=1e-6)


def test_clipping_scales_every_gradient_to_max_norm():
    params = _params_with_grads(SHAPES, device_type())
    before = [p.grad.clone() for p in params]
    norm = global_grad_norm(params)
    assert norm.item() > 1e-3
    clip_grads_(params, clip_scale(norm, 1e-3))
    after = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    assert after == pytest.approx(1e-3, rel=1e-5)
    for old, p in zip(before, params):
        torch.testing.assert_close(p.grad, old * (1e-3 / norm), rtol=1e-5, atol=0)
    # Under the limit, gradients are left exactly as they were.
    kept = [p.grad.clone() for p in params]
    clip_grads_(params, clip_scale(global_grad_norm(params), 1.0))
    assert all(torch.equal(p.grad, k) for p, k in zip(params, kept))


def _train(implementation: str, max_norm: float, clip: str, seed: int):
    """Parameters and optimizer state after five steps on fresh random gradients whose norms straddle max_norm
    (so some steps clip and some do not). ``clip``: "clipped_step" (the trainer's), "pytorch" (PyTorch's
    clip_grad_norm_, then the step) or "first" (our clipping of the gradients, then an unscaled step)."""
    device = device_type()
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in SHAPES]
    cfg = OptimizerConfig(implementation=implementation, lr=1e-2, weight_decay=0.1)
    optimizer = build_optimizer([torch.nn.ParameterList(params)], cfg)
    generator = torch.Generator(device).manual_seed(seed + 1)
    for step in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=generator) * (0.002 if step % 2 else 0.05)
        if clip == "clipped_step":
            clipped_step(optimizer, params, global_grad_norm(params), max_norm)
            continue
        if clip == "pytorch":
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            clip_grads_(params, clip_scale(global_grad_norm(params), max_norm))
        optimizer.step()
    state = [optimizer.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]
    return [p.detach() for p in params] + state


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_clipped_step_equals_pytorch_clipping_then_the_step(implementation):
    seed = int(torch.randint(0, 2**31, ()))
    got = _train(implementation, 1.0, "clipped_step", seed)
    want = _train("for-loop", 1.0, "pytorch", seed)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"seed {seed}: {m}")


def test_no_clipping_when_max_norm_is_zero():
    seed = int(torch.randint(0, 2**31, ()))
    got = _train("fused", 0.0, "clipped_step", seed)
    want = _train("fused", 1e30, "first", seed)  # a limit never reached: the gradients as they are
    assert all(torch.equal(g, w) for g, w in zip(got, want)), seed
    assert not all(torch.equal(g, w) for g, w in zip(got, _train("fused", 1.0, "first", seed))), seed


def test_fused_step_divides_in_its_kernel_exactly_as_clipping_first():
    seed = int(torch.randint(0, 2**31, ()))
    fused = _train("fused", 1.0, "clipped_step", seed)
    explicit = _train("fused", 1.0, "first", seed)
    for f, e in zip(fused, explicit):
        assert torch.equal(f, e), seed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, seed: int, result_file: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    results = {}
    for implementation in ("fused", "foreach"):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 9))
        fully_shard(model, mesh=mesh)
        optimizer = build_optimizer([model], OptimizerConfig(implementation=implementation, lr=1e-2))
        inputs = torch.Generator().manual_seed(seed + 1)
        norms = []
        for step in range(4):
            optimizer.zero_grad()
            x = torch.randn(8, 32, generator=inputs)
            (model(x).pow(2).sum() * (3.0 if step % 2 else 0.01)).backward()
            params = list(model.parameters())
            norm = global_grad_norm(params)
            clipped_step(optimizer, params, norm, max_norm=1.0)
            norms.append(norm.item())
        results[implementation] = {"norms": norms,
                                   "params": [p.full_tensor().flatten().tolist() for p in model.parameters()]}
    results["placements"] = _norms_of_placed_gradients(world, seed)
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _norms_of_placed_gradients(world: int, seed: int) -> tuple[float, float]:
    """(global_grad_norm, the float64 norm of the whole tensors) for DTensor gradients placed every way FSDP, TP
    and EP leave them, on a 1D and a 2D mesh, unevenly sharded, plus one partial sum."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    flat = dist.device_mesh.init_device_mesh("cpu", (world,))
    square = dist.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    layouts = [(flat, [Shard(0)], 7), (flat, [Replicate()], 10), (square, [Shard(0), Shard(1)], 13),
               (square, [Replicate(), Shard(0)], 16), (square, [Shard(0), Replicate()], 19), (flat, [Shard(0)], 22),
               (flat, [_StridedShard(0, split_factor=2)], 8)]  # FSDP's sharding of TP's shards (even rows)
    generator = torch.Generator().manual_seed(seed + 2)
    wholes, grads = [], []
    for i, (mesh, placements, rows) in enumerate(layouts):
        whole = torch.randn(rows, 5 + i, generator=generator)  # every rank draws the same tensor
        wholes.append(whole)
        grads.append(SimpleNamespace(grad=distribute_tensor(whole, mesh, placements)))
    whole = torch.randn(6, generator=generator)
    wholes.append(whole)  # the full tensor is the sum of the ranks' parts
    grads.append(SimpleNamespace(grad=torch.distributed.tensor.DTensor.from_local(whole / world, flat, [Partial()])))
    expected = torch.cat([w.double().flatten() for w in wholes]).norm().item()
    return global_grad_norm(grads).item(), expected


@pytest.mark.slow
def test_fsdp_sharded_fused_step_matches_foreach_with_clipping_first(tmp_path):
    world, seed = 2, int(torch.randint(0, 2**31, ()))
    mp.spawn(_fsdp_worker, args=(world, _free_port(), seed, str(tmp_path / "out")), nprocs=world)
    for rank in range(world):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        got, expected = result["placements"]
        assert got == pytest.approx(expected, rel=1e-6), seed
        fused, foreach = result["fused"], result["foreach"]
        assert fused["norms"] == pytest.approx(foreach["norms"], rel=1e-6), seed
        assert min(fused["norms"]) < 1.0 < max(fused["norms"])  # both clipped and unclipped steps
        for f, e in zip(fused["params"], foreach["params"]):
            assert f == pytest.approx(e, rel=1e-5, abs=1e-7), seed
