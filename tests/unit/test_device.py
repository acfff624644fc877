"""Device choice: one GPU per local rank, and a clear refusal where a host has fewer GPUs than processes."""

import pytest
import torch

from torchtitan.distributed import device as device_lib


def test_more_local_processes_than_gpus_is_refused_before_nccl_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("no device may be chosen"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError) as error:
        device_lib.init_distributed(60)
    message = str(error.value)
    assert "2 processes on this host (LOCAL_WORLD_SIZE)" in message and "only 1 visible GPU" in message
    assert "--nproc_per_node" in message and "CUDA_VISIBLE_DEVICES" in message


def test_each_local_rank_takes_its_own_gpu(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # no rendezvous: only the device choice runs
    assert device_lib.init_distributed(60) == torch.device("cuda", 3) == chosen[0]
