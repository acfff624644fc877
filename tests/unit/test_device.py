"""Device choice: one GPU per local rank, and a clear refusal where a host has fewer GPUs than processes."""

import pytest
import torch

from torchtitan.distributed import device as device_lib


def test_more_local_processes_than_gpus_is_refused_before_nccl_starts(monkeypatch, tmp_path):
    """Through the trainer's entry point: exit 2 with one line naming both numbers and the ways out."""
    from tests.bad_input import assert_one_line_error
    from torchtitan.train import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("no device may be chosen"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "1", f"--job.dump_folder={tmp_path}"]
    assert_one_line_error(main, argv, "2 processes on this host (LOCAL_WORLD_SIZE)", "only 1 visible GPU",
                          "--nproc_per_node", "CUDA_VISIBLE_DEVICES")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_each_local_rank_takes_its_own_gpu(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # no rendezvous: only the device choice runs
    assert device_lib.init_distributed(60) == torch.device("cuda", 3) == chosen[0]
