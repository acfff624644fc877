"""SIGUSR1/SIGTERM through run_train.sh and torchrun: checkpoint, clean exit, resume."""

import json
import signal
import time

import pytest

from tests.integration.test_checkpoint import launch, run_to_end
from torchtitan.components.checkpointing.checkpoint import complete_steps


@pytest.mark.slow
# The resume does not depend on which signal stopped the run: one of them checks it.
@pytest.mark.parametrize("sig,resume", [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"])
def test_signal_makes_every_rank_checkpoint_and_exit_then_resume(tmp_path, sig, resume):
    extra = ["--training.local_batch_size", "4", "--training.steps", "400", "--checkpoint.interval", "1000",
             "--training.dataloader.num_workers", "2"]
    proc = launch(tmp_path, 2, extra, launcher=["./run_train.sh"])
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, "the run did not start training"
        time.sleep(0.1)
    proc.send_signal(sig)  # run_train.sh execs torchrun, so this is torchrun's pid
    out, _ = proc.communicate(timeout=60)  # the job ends within a minute
    steps = complete_steps(tmp_path / "checkpoint")
    assert len(steps) == 1 and 3 <= steps[0] < 400, (steps, out[-3000:])
    assert f"stopping after step {steps[0]} on {sig.name}" in out
    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert last_logged == steps[0]  # it finished the step it was in, then stopped
    if not resume:
        return
    resumed = run_to_end(tmp_path, 2, [*extra[:2], "--training.steps", str(steps[0] + 2), *extra[4:]])
    assert f"resumed from step {steps[0]}" in resumed
