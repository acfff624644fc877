"""Context parallelism of the Gated DeltaNet layer: every rank's outputs and all gradients (input and parameters)
equal the single process's on the whole sequence, with random documents crossing the cuts (fp64, gloo ranks)."""

import copy
import json
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.test_context_parallel import _free_port
from tests.unit.test_document_masking import random_document_ids
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.distributed.context_parallel_linear import cp_conv, cp_recurrence
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet

TOL = 1e-10


def _layer(generator: torch.Generator) -> GatedDeltaNet:
    layer = GatedDeltaNet(dim=16, n_key_heads=2, n_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4,
                          norm_eps=1e-6).double()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64, generator=generator) * (0.5 if "A_log" in name
                                                                                             else 0.3))
    return layer


def _worker(rank, world, port, result_file, seed):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    worst, cases = {}, 0
    # Chunks of 3 tokens (exactly the conv's history), 5, and 70 (more than one 64-token kernel chunk).
    for chunk in (3, 5, 70):
        for with_documents in (True, False):
            cases += 1
            gen = torch.Generator().manual_seed(seed + cases)  # every rank draws the same full tensors
            seq = 2 * world * chunk
            layer = _layer(gen)
            x = torch.randn(2, seq, 16, dtype=torch.float64, generator=gen)
            dout = torch.randn(2, seq, 16, dtype=torch.float64, generator=gen)
            ids = random_document_ids(gen, 2, seq, seq // 4) if with_documents else None
            full_x = x.clone().requires_grad_()
            reference = layer(full_x, documents=None if ids is None else DocumentMask(ids, flex=False))
            reference.backward(dout)
            sharded = copy.deepcopy(layer)
            sharded.zero_grad()
            sharded.conv_fn = partial(cp_conv, group=group)
            sharded.recurrence_fn = partial(cp_recurrence, group=group)
            local_x = shard_sequence(x, 1, rank, world).requires_grad_()
            documents = None if ids is None else DocumentMask(shard_sequence(ids, 1, rank, world), flex=False)
            out = sharded(local_x, documents=documents)
            out.backward(shard_sequence(dout, 1, rank, world))
            errors = {"out": (out - shard_sequence(reference, 1, rank, world)).abs().max().item(),
                      "dx": (local_x.grad - shard_sequence(full_x.grad, 1, rank, world)).abs().max().item()}
            for (name, param), (_, expected) in zip(sharded.named_parameters(), layer.named_parameters()):
                grad = param.grad.clone()
                dist.all_reduce(grad)  # each rank holds its tokens' share of the parameter gradients
                errors[f"d{name}"] = (grad - expected.grad).abs().max().item()
            for key, err in errors.items():
                worst[key] = max(worst.get(key, 0.0), err)
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump({"worst": worst, "cases": cases}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_matches_the_whole_sequence(tmp_path, world):
    seed = torch.seed() % 2**31
    result_file = tmp_path / "worst"
    mp.start_processes(_worker, args=(world, _free_port(), str(result_file), seed), nprocs=world,
                       start_method="spawn")
    for rank in range(world):
        report = json.loads((tmp_path / f"worst.{rank}").read_text())
        assert report["cases"] == 6
        assert len(report["worst"]) == 2 + len(list(_layer(torch.Generator()).parameters()))
        for key, err in report["worst"].items():
            assert err < TOL, (rank, key, err, seed)
