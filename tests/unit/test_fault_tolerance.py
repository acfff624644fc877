"""[fault_tolerance] alone: its validation, the groups' data coordinates and folders, and DiLoCo's fragments."""

import pytest
import torch
from torch import nn

from torchtitan.components.fault_tolerance import data_coordinates, model_fragments, replica_folder
from torchtitan.config import ConfigError
from torchtitan.config.job_config import FaultTolerance
from torchtitan.config.loading import load_config
from torchtitan.config_check import validate_config

LIGHTHOUSE = {"TORCHFT_LIGHTHOUSE": "http://localhost:29510"}
ON = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
DILOCO = ["--fault_tolerance.semi_sync.method", "diloco"]


def check(flags: list[str], world_size: int = 1) -> None:
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", *flags])
    validate_config(cfg, sources, world_size=world_size)


@pytest.mark.parametrize(("flags", "message"), [
    (["--fault_tolerance.group_size", "2"], "fault_tolerance.enable = False but fault_tolerance.group_size is set"),
    ([*DILOCO], "but fault_tolerance.semi_sync.method is set"),
    ([*ON, "--fault_tolerance.replica_id", "2"], r"replica_id = 2 is invalid; it must be in \[0, group_size = 2\)"),
    ([*ON, "--fault_tolerance.min_replica_size", "3"], r"min_replica_size = 3 is invalid; it must be in \[1, "),
    ([*ON, "--fault_tolerance.timeout_seconds", "0"], "timeout_seconds = 0.0 is invalid; it must be > 0"),
    ([*ON, "--optimizer.name", "AdamW8bit"], "cannot send AdamW8bit's 8-bit optimizer state"),
    ([*ON, "--fault_tolerance.semi_sync.sync_every", "5"], "semi_sync.method = 'none' synchronises every step and "
                                                           "ignores fault_tolerance.semi_sync.sync_every"),
    ([*ON, *DILOCO, "--fault_tolerance.semi_sync.sync_every", "0"], "sync_every = 0 is invalid"),
    ([*ON, *DILOCO, "--fault_tolerance.semi_sync.outer_momentum", "1"], r"outer_momentum = 1.0 is invalid"),
    ([*ON, *DILOCO, "--fault_tolerance.semi_sync.fragments", "3"], "fragments = 3 is invalid; it must be >= 1 and "
                                                                   "divide semi_sync.sync_every = 20"),
    ([*ON, *DILOCO, "--training.guard.enable"], "the bad-step guard skips them per group"),
    ([*ON, *DILOCO, "--fault_tolerance.semi_sync.fragments", "2", "--checkpoint.enable"],
     "fragments = 2 > 1 synchronises the fragments at different steps"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(monkeypatch, flags, message):
    for name, value in LIGHTHOUSE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message) as error:
        check(flags)
    assert "\n" not in str(error.value)


def test_the_lighthouse_address_is_required_and_good_settings_pass(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=r"needs the lighthouse's address in \$TORCHFT_LIGHTHOUSE"):
        check(ON)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "localhost:29510")
    with pytest.raises(ConfigError, match=r"\(e.g. http://localhost:29510 .*, not 'localhost:29510'"):
        check(ON)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    check(ON)
    check([*ON, "--fault_tolerance.replica_id", "1", *DILOCO, "--fault_tolerance.semi_sync.fragments", "2"])
    check([*ON, *DILOCO, "--checkpoint.enable", "--checkpoint.interval", "40"])
    check([*ON, *DILOCO, "--checkpoint.enable", "--checkpoint.interval", "30"])  # between syncs: DiLoCo's state saved
    check(["--optimizer.name", "SGD"])
    with pytest.raises(ConfigError, match="optimizer.beta1 = 0.8 is read by the Adam family"):
        check(["--optimizer.name", "SGD", "--optimizer.beta1", "0.8"])


def test_each_group_reads_its_own_rows_and_writes_its_own_folder():
    on = FaultTolerance(enable=True, replica_id=1, group_size=3)
    # Group 1 of 3, data-parallel rank 1 of 2 within it: rank 3 of 6 over the whole stream.
    assert data_coordinates(on, 1, 2) == (3, 6)
    seen = sorted(data_coordinates(FaultTolerance(enable=True, replica_id=r, group_size=3), d, 2)[0]
                  for r in range(3) for d in range(2))
    assert seen == list(range(6))  # disjoint and complete
    assert data_coordinates(FaultTolerance(), 1, 2) == (1, 2)
    assert replica_folder("out", on) == "out/replica_1"
    assert replica_folder("s3://bucket/ckpt/", on) == "s3://bucket/ckpt/replica_1"
    assert replica_folder("out", FaultTolerance()) == "out"


class Blocks(nn.Module):
    def __init__(self, sizes: list[int], tie: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 4)
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, size, bias=False) for i, size in enumerate(sizes)})
        self.output = nn.Linear(4, 10, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


def test_fragments_are_runs_of_blocks_that_cover_every_weight_once():
    model = Blocks([4, 4, 4, 4, 4, 4])
    fragments = model_fragments([model], 3)
    owned = [{id(p) for p in fragment.parameters()} for fragment in fragments]
    assert sum(map(len, owned)) == len(list(model.parameters()))
    assert set().union(*owned) == {id(p) for p in model.parameters()}
    order = [id(p) for p in model.parameters()]
    flat = [id(p) for fragment in fragments for p in fragment.parameters()]
    assert flat == order  # consecutive runs, in the model's order
    sizes = [sum(p.numel() for p in fragment.parameters()) for fragment in fragments]
    assert max(sizes) - min(sizes) <= 40  # about equal: 40 + 6 x 16 + 40 parameters in three parts
    assert len(model_fragments([model], 1)) == 1
    with pytest.raises(ValueError, match="too few for that many fragments"):
        model_fragments([Blocks([4])], 4)
    with pytest.raises(ValueError, match="shared between fragments"):
        model_fragments([Blocks([4, 4], tie=True)], 2)


def test_sgd_is_plain_gradient_descent():
    from torchtitan.components.optimizers.optimizer import build_optimizer
    from torchtitan.config.job_config import Optimizer

    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer([model], Optimizer(name="SGD", lr=0.5, weight_decay=0.0))
    model(torch.randn(4, 3)).square().sum().backward()
    optimizer.step()
    for old, p in zip(before, model.parameters()):
        torch.testing.assert_close(p.detach(), old - 0.5 * p.grad, rtol=0, atol=0)
