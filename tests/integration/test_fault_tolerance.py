"""Replica groups under torchft on CPU/gloo: two groups of FSDP 2 (4 processes) and a lighthouse.

A group killed mid-run is relaunched and recovers from the survivor, which never stops; without failures the
groups train what HSDP 2 x 2 trains (QK-clip included); DiLoCo with one inner step is plain data parallelism; checkpoints resume.
"""

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tests.conftest import REPO, run_module, torchrun_command
from tests.integration.parity import COMMON, CONFIG, rows_of
from tests.integration.test_checkpoint import kill_tree

pytestmark = pytest.mark.slow

GROUPS = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.timeout_seconds", "30"]
HSDP = ["--training.local_batch_size", "2", "--training.steps", "6"]  # global batch 8, as in parity.COMMON's runs
# QK-clip below the debug model's first logits (about 0.7), so every step clips: the groups must clip on the
# maximum over both groups' batches, as HSDP does over its ranks, or their weights part.
QK_CLIP = ["--optimizer.qk_clip_threshold", "0.5"]
SGD = ["--optimizer.name", "SGD", "--training.max_norm", "0"]


def debug_layouts(folder):
    """The ordinary HSDP 2 x 2 runs the replica groups must reproduce (the suite's debug-model matrix)."""
    replicate = ["--parallelism.data_parallel_replicate_degree", "2"]
    return {"ft_hsdp2x2": (4, [*HSDP, *replicate, *QK_CLIP]), "ft_hsdp2x2_sgd": (4, [*HSDP, *replicate, *SGD])}


@pytest.fixture(autouse=True)
def kill_leftover_groups():
    yield
    while Group.launched:
        group = Group.launched.pop()
        if group.proc.poll() is None:
            group.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextmanager
def lighthouse(min_replicas: int):
    """torchft's lighthouse on a free port; yields the environment a group needs to find it."""
    port = free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    proc = subprocess.Popen([str(binary), "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                             "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    finally:
        proc.kill()
        proc.wait()


class Group:
    """One replica group: torchrun of 2 processes, output to a file; every one launched is killed at the end of
    its test (the launched fixture), finished or not."""

    launched: ClassVar[list["Group"]] = []

    def __init__(self, replica: int, folder: Path, flags: list[str], env: dict, log: Path,
                 module: str = "tests.integration.fault_tolerance_worker"):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [*torchrun_command(2, module, ranks="0,1"), "--job.config_file", CONFIG, *COMMON, *flags,
                 *GROUPS, "--fault_tolerance.replica_id", str(replica), f"--job.dump_folder={folder}"],
                cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        Group.launched.append(self)

    def wait(self, timeout: float = 300) -> str:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = "timeout"
        output = self.log.read_text()
        assert code == 0, f"{self.log.name} exited {code}:\n{output[-4000:]}"
        return output

    def kill(self) -> None:
        """SIGKILL torchrun and its workers (each of which torchrun starts in a session of its own)."""
        kill_tree(self.proc)


def weights(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"weights-rank{rank}.jsonl").read_text().splitlines()]


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_group_rejoins_from_the_survivor_and_both_hold_the_same_weights(tmp_path):
    """Must-show 1: group 1 is SIGKILLed (every process) after step 5; group 0 trains on alone, never restarting
    and reading no checkpoint; group 1 relaunched resumes its own step-4 checkpoint, then takes group 0's live state,
    and from then on both groups' weight shards hash the same at every step, and they read on from the same data
    position. Then both resume from their own checkpoints on disk."""
    steps = 24
    flags = ["--training.steps", str(steps), "--training.local_batch_size", "2", "--checkpoint.enable",
             "--checkpoint.interval", "4", "--comm.train_timeout_seconds", "60"]
    g0, g1 = tmp_path / "replica_0", tmp_path / "replica_1"
    with lighthouse(min_replicas=1) as env:
        env["FT_START_TOGETHER"] = str(tmp_path)
        survivor = Group(0, tmp_path, flags, {**env, "FT_SLOW_WHEN_ALONE": "1"}, tmp_path / "g0.log")
        victim = Group(1, tmp_path, flags, {**env, "FT_PAUSE_AFTER_STEP": "5"}, tmp_path / "g1.log")
        del env["FT_START_TOGETHER"]
        deadline = time.monotonic() + 600
        # Every rank of the group has written its row for the step and paused (one rank alone may be a row ahead).
        while not all((g1 / f"paused-rank{rank}").exists() for rank in (0, 1)):
            assert victim.proc.poll() is None and time.monotonic() < deadline, (tmp_path / "g1.log").read_text()[-4000:]
            time.sleep(0.1)
        killed_at = weights(g1, 0)[-1]["step"]
        victim.kill()
        relaunched = Group(1, tmp_path, flags, {**env, "FT_SLOW_WHEN_ALONE": "1"}, tmp_path / "g1-relaunch.log")
        survivor_log, relaunch_log = survivor.wait(), relaunched.wait()

    assert killed_at == 5
    # The survivor ran every step once, in one process tree: no restart, no checkpoint read.
    for rank in (0, 1):
        assert [w["step"] for w in weights(g0, rank)] == list(range(1, steps + 1))
    assert "resumed from" not in survivor_log and "took the live state" not in survivor_log
    alone = [w["step"] for w in weights(g0, 0) if w["groups"] == 1]
    assert alone and alone[0] == killed_at + 1, alone  # it went on alone right after the kill
    # The relaunched group read its own older checkpoint, then took the live state and rejoined before the end.
    assert "resumed from step 4" in relaunch_log
    healed = [line for line in relaunch_log.splitlines() if "took the live state of a peer group: step" in line]
    assert healed, relaunch_log[-4000:]
    rejoined = int(healed[0].rsplit("step ", 1)[1])
    assert killed_at < rejoined <= steps - 3
    for rank in (0, 1):
        survivor_sha = {w["step"]: w["sha"] for w in weights(g0, rank)}
        victim_rows = weights(g1, rank)
        assert [w["step"] for w in victim_rows] == [*range(1, killed_at + 1), *range(rejoined + 1, steps + 1)]
        for row in victim_rows:
            assert row["sha"] == survivor_sha[row["step"]], (rank, row["step"])
    assert all(w["groups"] == 2 for w in weights(g0, 0) if w["step"] > rejoined)
    # The same data position (and everything else a checkpoint holds but the weights) at the end.
    final = [checkpoint(folder, steps) for folder in (g0, g1)]
    for key in ("dataloader", "lr_scheduler", "train_state", "optimizer"):
        assert final[0][key].keys() == final[1][key].keys()
        for name, value in final[0][key].items():
            if name != "rng_cpu":
                assert torch.equal(value, final[1][key][name]) if torch.is_tensor(value) else value == \
                    final[1][key][name], (key, name)

    # A total failure: both groups relaunched resume from their own checkpoints and go on in lock-step.
    more = [*flags[:1], str(steps + 2), *flags[2:]]
    with lighthouse(min_replicas=2) as env:
        both = [Group(r, tmp_path, more, env, tmp_path / f"g{r}-resume.log") for r in (0, 1)]
        outputs = [group.wait() for group in both]
    for output in outputs:
        assert f"resumed from step {steps}" in output and "took the live state" not in output
    for rank in (0, 1):
        tails = [weights(folder, rank)[-2:] for folder in (g0, g1)]
        assert [w["step"] for w in tails[0]] == [steps + 1, steps + 2]
        assert tails[0] == tails[1]


def checkpoint(folder: Path, step: int) -> dict:
    """A group's DCP checkpoint at ``step`` as one dict (rank 0's view of every entry)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder / f"step-{step}.pt"
    dcp_to_torch_save(folder / "checkpoint" / f"step-{step}", out)
    return torch.load(out, weights_only=False)


def run_groups(tmp_path: Path, flags: list[str]) -> list[Path]:
    with lighthouse(min_replicas=2) as env:
        groups = [Group(r, tmp_path, flags, env, tmp_path / f"g{r}.log", module="torchtitan.train") for r in (0, 1)]
        for group in groups:
            group.wait()
    return [tmp_path / f"replica_{r}" for r in (0, 1)]


def test_two_replica_groups_train_what_hsdp_2x2_trains(tmp_path, debug_runs):
    """Must-show 2: with no failure, the groups' loss (over both groups' tokens) is HSDP 2 x 2's, fp32, 6 steps; with
    QK-clip on, the same heads are clipped by the same largest logits."""
    reference = rows_of(debug_runs, "ft_hsdp2x2")
    assert len(reference) == 6 and reference[-1]["loss"] < reference[0]["loss"]
    assert all(row["qk_clip/heads_clipped"] > 0 for row in reference)
    for folder in run_groups(tmp_path, [*HSDP, *QK_CLIP]):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
        assert [r["qk_clip/heads_clipped"] for r in rows] == [r["qk_clip/heads_clipped"] for r in reference]
        assert [r["qk_clip/max_logit"] for r in rows] == pytest.approx([r["qk_clip/max_logit"] for r in reference],
                                                                        rel=1e-5)


def test_diloco_with_one_inner_step_is_data_parallel_sgd(tmp_path, debug_runs):
    """Must-show 3: DiLoCo with H = 1, outer lr 1 and no momentum, around SGD without clipping, is HSDP 2 x 2 with
    that SGD: the mean of the groups' own losses (equal token counts) is the HSDP loss at every step."""
    reference = [row["loss"] for row in rows_of(debug_runs, "ft_hsdp2x2_sgd")]
    diloco = ["--fault_tolerance.semi_sync.method", "diloco", "--fault_tolerance.semi_sync.sync_every", "1",
              "--fault_tolerance.semi_sync.outer_lr", "1", "--fault_tolerance.semi_sync.outer_momentum", "0"]
    g0, g1 = run_groups(tmp_path, [*HSDP, *SGD, *diloco])
    mean = [(a + b) / 2 for a, b in zip(losses(g0), losses(g1))]
    assert len(mean) == 6 and mean == pytest.approx(reference, abs=1e-5)
    assert losses(g0) != pytest.approx(losses(g1), abs=1e-4)  # each group scores its own batch


def test_diloco_resumes_bitwise_after_every_group_is_killed(tmp_path):
    """Must-show 2: 2 groups of FSDP 2, DiLoCo with H = 4 and outer momentum 0.9, checkpoints every 2 steps (at and
    between synchronisations). Every process of both groups is killed right after the step-4 synchronisation (before
    step 5: the relaunch resumes from step 4), then, relaunched, between two synchronisations (after step 7: the next
    relaunch resumes from step 6, whose checkpoint holds the agreed weights and the inner step count). Each group's
    weight shards are bitwise the uninterrupted run's at every step after each resume, through the step-8
    synchronisation, which applies the momentum the checkpoints carried."""
    diloco = ["--fault_tolerance.semi_sync.method", "diloco", "--fault_tolerance.semi_sync.sync_every", "4",
              "--fault_tolerance.semi_sync.outer_momentum", "0.9", "--fault_tolerance.semi_sync.outer_lr", "0.7"]
    flags = ["--training.steps", "8", "--training.local_batch_size", "2", "--checkpoint.enable",
             "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only", *diloco]
    straight, killed = tmp_path / "straight", tmp_path / "killed"

    def launch(folder: Path, env: dict, tag: str) -> list[Group]:
        return [Group(r, folder, flags, env, tmp_path / f"{tag}-g{r}.log") for r in (0, 1)]

    def rows(folder: Path, replica: int, rank: int) -> dict[int, str]:
        return {w["step"]: w["sha"] for w in weights(folder / f"replica_{replica}", rank)}  # the last row of a step

    with lighthouse(min_replicas=2) as env:
        for group in launch(straight, env, "straight"):
            group.wait()
        outputs = []
        for pause, tag in ((("FT_PAUSE_BEFORE_STEP", "5"), "first"), (("FT_PAUSE_AFTER_STEP", "7"), "second")):
            victims = launch(killed, {**env, pause[0]: pause[1]}, tag)
            deadline = time.monotonic() + 600
            while not all((killed / f"replica_{r}" / f"paused-rank{rank}").exists() for r in (0, 1) for rank in (0, 1)):
                assert all(v.proc.poll() is None for v in victims) and time.monotonic() < deadline, tag
                time.sleep(0.1)
            for victim in victims:
                victim.kill()
            outputs.append([v.log.read_text() for v in victims])
            for r in (0, 1):
                for rank in (0, 1):
                    (killed / f"replica_{r}" / f"paused-rank{rank}").unlink()
        outputs.append([group.wait() for group in launch(killed, env, "third")])
    assert all("resumed from step 4" in log for log in outputs[1])
    assert all("resumed from step 6" in log and "took the live state" not in log for log in outputs[2])
    for replica in (0, 1):
        for rank in (0, 1):
            reference = rows(straight, replica, rank)
            resumed = [(w["step"], w["sha"]) for w in weights(killed / f"replica_{replica}", rank)]
            assert sorted(reference) == list(range(1, 9))
            # Steps 1-4, then 5-7 from the first relaunch, then 7-8 from the second.
            assert [step for step, _ in resumed] == [1, 2, 3, 4, 5, 6, 7, 7, 8]
            assert all(sha == reference[step] for step, sha in resumed), (replica, rank)
    # At a synchronisation the groups hold the same weights.
    assert rows(straight, 0, 0)[8] == rows(straight, 1, 0)[8] and rows(straight, 0, 0)[7] != rows(straight, 1, 0)[7]


def test_an_unreachable_lighthouse_is_one_line_naming_it(tmp_path):
    result = run_module("torchtitan.train", "--job.config_file", "train_configs/tiny.toml", "--training.steps", "2",
                        *GROUPS[:3], "--fault_tolerance.timeout_seconds", "2", f"--job.dump_folder={tmp_path}",
                        env={"TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}"})
    assert result.returncode == 1
    assert "error: fault_tolerance: cannot reach the lighthouse at $TORCHFT_LIGHTHOUSE = http://localhost:" in \
        result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
