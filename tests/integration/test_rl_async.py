"""Asynchronous GRPO (rl.max_staleness = 1, torchtitan/rl/async_generation.py): the generator process's weights after
every transfer are bitwise the trainer's of that version, no batch is older than allowed whether the generator or the
trainer is the slow one, the importance ratio is against the sampler's stale log-probabilities, a resume restarts
the generator from the loaded weights, and the generator neither hangs the trainer nor outlives it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_module
from tests.rl_doubles import state_digest

# The debug model on 2 prompts x 4 completions of 4 tokens per step, the generator process 1 version ahead.
ASYNC = ["--job.config_file", "train_configs/grpo_debug.toml", "--rl.prompts_per_step", "2", "--rl.group_size", "4",
         "--rl.max_new_tokens", "4", "--training.seq_len", "72", "--training.local_batch_size", "4",
         "--rl.reward_weights", "1.0", "--rl.reward_workers", "0", "--experimental.custom_import", "tests.rl_doubles",
         "--rl.sampler", "digesting", "--rl.max_staleness", "1", "--optimizer.lr", "1e-3",
         "--lr_scheduler.warmup_steps", "0"]


def train(folder: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # One thread per process: the trainer and its generator then take a core each; on a machine whose cores are
    # busy, threads that wait on each other's share of one op cost the suite many times their work.
    return run_module("torchtitan.train", *ASYNC, "--job.dump_folder", str(folder), *args,
                      env={"TORCHTITAN_TEST_DIGESTS": str(folder / "digests.jsonl"), "OMP_NUM_THREADS": "1",
                           **(env or {})})


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_generators_ended(digests: list[dict]) -> None:
    """The generator processes that wrote ``digests`` have exited and their trainers removed the weight files."""
    pids = {r["pid"] for r in digests}
    assert pids and not [pid for pid in pids if alive(pid)]
    import tempfile

    for trainer in {r["trainer"] for r in digests}:
        for parent in ("/dev/shm", tempfile.gettempdir()):
            assert not list(Path(parent).glob(f"torchtitan-rl-weights-{trainer}-*"))


def trainer_digests(checkpoints: Path, versions: list[int]) -> dict[int, str]:
    """The digest of the trainer's model at each version: the seeded initialisation for 0, else its checkpoint."""
    from torchtitan.config_check import load_model_config
    from torchtitan.inference import build_model, load_dcp_model

    model, _ = build_model(load_model_config("train_configs/grpo_debug.toml"))
    digests = {}
    for version in sorted(versions):
        if version:
            load_dcp_model(model, checkpoints / f"step-{version}")
        digests[version] = state_digest(model.state_dict())
    return digests


@pytest.fixture(scope="module")
def slow_generator(tmp_path_factory):
    """4 steps, a checkpoint after each, the generator sleeping 1 s per batch; then resumed to 6 steps."""
    folder = tmp_path_factory.mktemp("slow_generator")
    env = {"TORCHTITAN_TEST_GENERATE_SLEEP": "1"}
    first = train(folder, "--training.steps", "4", "--checkpoint.interval", "1", "--rl.rewards", "text_shape", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    digests = rows(folder / "digests.jsonl")
    metrics = rows(folder / "metrics.jsonl")
    os.rename(folder / "digests.jsonl", folder / "digests_first.jsonl")
    resumed = train(folder, "--training.steps", "6", "--checkpoint.interval", "1", "--rl.rewards", "text_shape",
                    env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return folder, digests, metrics, rows(folder / "digests.jsonl"), rows(folder / "metrics.jsonl")


@pytest.mark.slow
def test_the_generators_weights_after_each_transfer_are_the_trainers_of_that_version(slow_generator):
    folder, digests, _, resumed_digests, _ = slow_generator
    assert [r["version"] for r in digests] == [0, 1, 2, 3]  # version 4 is never needed: the run ends
    expected = trainer_digests(folder / "checkpoint", [r["version"] for r in digests + resumed_digests])
    for r in digests + resumed_digests:
        assert r["digest"] == expected[r["version"]], r["version"]
    assert len({r["digest"] for r in digests}) == 4  # the weights did change: the check can fail
    # The resumed run starts a new generator whose first weights are the loaded ones.
    assert [r["version"] for r in resumed_digests] == [4, 5]
    assert {r["pid"] for r in resumed_digests}.isdisjoint({r["pid"] for r in digests})
    assert_generators_ended(digests + resumed_digests)


@pytest.mark.slow
def test_with_a_slow_generator_no_batch_is_older_than_allowed_and_the_ratio_is_against_the_sampler(slow_generator):
    _, _, metrics, _, resumed_metrics = slow_generator
    steps = {r["step"]: r for r in metrics + resumed_metrics}  # a resumed run appends its steps
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for step, r in steps.items():
        assert r["rl/policy_version"] == step - 1
        assert r["rl/staleness"] == r["rl/policy_version"] - r["rl/sampler_version"]
        assert 0 <= r["rl/staleness"] <= 1, r
    # The first batch of a run, and of a resumed one, comes from the weights it starts with.
    assert steps[1]["rl/staleness"] == steps[5]["rl/staleness"] == 0
    # The off-policy correction: GRPO's ratio divides by the sampler's log-probabilities, so at a step's start it
    # is 1 (up to numerics) on fresh rollouts and trainer / sampler on stale ones; mismatch_abs is the mean of
    # |log ratio| over the completion tokens.
    for step, r in steps.items():
        if r["rl/staleness"] == 0:
            assert r["rl/mismatch_abs"] < 1e-5, r
        else:
            assert r["rl/mismatch_abs"] > 1e-3, r


@pytest.mark.slow
def test_with_a_slow_trainer_the_generator_works_ahead_but_no_further_than_allowed(tmp_path):
    # Scoring sleeps 0.1 s per completion in the trainer (8 a step); generating a batch takes well under that.
    result = train(tmp_path, "--training.steps", "4", "--checkpoint.no_enable", "--rl.rewards", "slow_text_shape",
                   env={"TORCHTITAN_TEST_REWARD_SLEEP": "0.1"})
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = rows(tmp_path / "metrics.jsonl")
    assert [r["rl/staleness"] for r in metrics] == [0, 1, 1, 1]
    assert [r["rl/sampler_version"] for r in metrics] == [0, 0, 1, 2]
    digests = rows(tmp_path / "digests.jsonl")
    assert [r["version"] for r in digests] == [0, 1, 2, 3]
    assert_generators_ended(digests)


@pytest.mark.slow
def test_a_failure_in_the_generator_ends_the_run_with_one_line(tmp_path):
    # (A sampler that fails to build: test_a_silent_or_dead_generator_is_one_line_not_a_hang.)
    result = train(tmp_path, "--training.steps", "2", "--checkpoint.no_enable", "--rl.rewards", "text_shape",
                   env={"TORCHTITAN_TEST_GENERATE_FAIL": "this prompt breaks it"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("error: rl: the generator process failed: generating a batch "
                                                      "from policy version 0: ValueError: this prompt breaks it")
    assert_generators_ended(rows(tmp_path / "digests.jsonl"))


# A process holding generator processes of the "echo" sampler (no model), as a trainer holds its generator.
GENERATORS = """
import sys, time
from multiprocessing.connection import wait
from torchtitan.config_check import load_model_config
from torchtitan.generation.sampling import SamplingConfig
from torchtitan.rl.async_generation import GeneratorProcess
cfg = load_model_config("train_configs/grpo_debug.toml", ["--experimental.custom_import", "tests.rl_doubles",
                        "--rl.sampler", "echo"])
"""


def run_generators(code: str, env: dict | None = None, **kwargs):
    return subprocess.Popen([sys.executable, "-c", GENERATORS + code], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **kwargs)


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


@pytest.mark.slow
def test_generators_exit_with_their_trainer_idle_or_busy(tmp_path):
    # The trainer is killed outright: an idle generator sees its end close, a busy one (asleep in a generation)
    # notices within a second that its trainer is gone; both exit and remove the weight files.
    loaded = tmp_path / "loaded.jsonl"
    trainer = run_generators("""
import os
idle = GeneratorProcess(cfg, "cpu")
os.environ["TORCHTITAN_TEST_GENERATE_SLEEP"] = "600"  # the next generator's generations sleep
busy = GeneratorProcess(cfg, "cpu")
for g in (idle, busy):
    g.send_weights({}, 0)
    g.request([[1, 2]], SamplingConfig(), [0], min_version=0)
idle.receive()  # answered: it waits for the next message now
print(idle.process.pid, idle.folder, busy.process.pid, busy.folder, flush=True)
time.sleep(600)
""", env={"TORCHTITAN_TEST_DIGESTS": str(loaded)})
    idle_pid, idle_folder, busy_pid, busy_folder = trainer.stdout.readline().split()
    # The busy one loaded its weights: it generates now.
    assert wait_until(lambda: loaded.exists() and len(loaded.read_text().splitlines()) == 2, 60)
    trainer.kill()
    trainer.wait()
    for pid, folder in ((idle_pid, idle_folder), (busy_pid, busy_folder)):
        assert wait_until(lambda pid=pid, folder=folder: not alive(int(pid)) and not Path(folder).exists(), 10), \
            (pid, folder)


@pytest.mark.slow
def test_a_silent_or_dead_generator_is_one_line_not_a_hang():
    trainer = run_generators("""
cfg.comm.init_timeout_seconds = 1
g = GeneratorProcess(cfg, "cpu")
print(g.process.pid, g.folder, flush=True)
for _ in range(2):  # asked for nothing, it answers nothing: the wait ends at comm.init_timeout_seconds
    try:
        g.receive()
    except Exception as e:
        print(type(e).__name__, e, flush=True)
    g.process.kill()
g.close()
# One whose sampler failed to build and that exited before the trainer's next send: the send reports its reason.
import os
os.environ["TORCHTITAN_TEST_SAMPLER_FAIL"] = "no engine here"
cfg.rl.sampler = "digesting"
g = GeneratorProcess(cfg, "cpu")
g.process.wait()
try:
    g.send_weights({}, 0)
except Exception as e:
    print(type(e).__name__, e, flush=True)
g.close()
""")
    out, _ = trainer.communicate(timeout=120)
    first, timed_out, died, failed = out.splitlines()
    pid, folder = first.split()
    assert timed_out == (f"DataError rl: the generator process (pid {pid}) answered no batch within "
                         "comm.init_timeout_seconds = 1 s; raise it if generating a batch takes that long")
    assert died == f"DataError rl: the generator process (pid {pid}) exited (code -9) with batches outstanding"
    assert failed == ("DataError rl: the generator process failed: building rl.sampler = 'digesting': RuntimeError: "
                      "no engine here")
    assert not alive(int(pid)) and not Path(folder).exists()


@pytest.mark.slow
def test_large_requests_and_answers_cross_without_blocking_each_other():
    # Each request and answer is larger than a socket's buffer: the trainer sends the next request while the
    # generator sends its answer to the last, and neither may wait on the other.
    trainer = run_generators("""
g = GeneratorProcess(cfg, "cpu")
g.send_weights({}, 0)
prompts = [[1000 + i] * 300_000 for i in range(3)]
g.request([prompts[0]], SamplingConfig(), [0], min_version=0)
wait([g.conn])  # the generator is sending its answer, larger than the socket's buffer: it waits on this process
for prompt in prompts[1:]:
    g.request([prompt], SamplingConfig(), [0], min_version=0)  # larger than the buffer too
answers = [g.receive() for _ in prompts]
g.close()
print([(c[0].tokens == p, version) for (c, version), p in zip(answers, prompts)])
""")
    try:
        out, _ = trainer.communicate(timeout=120)  # a deadlock hangs for ever; a busy machine can take tens of seconds
    finally:
        trainer.kill()
    assert out.strip() == str([(True, 0)] * 3)
