"""generate.py and evaluate.py on a checkpoint of a short real training run."""

import json
import math

import pytest

from scripts import generate as generate_script
from tests.conftest import REPO, run_command, run_module, torchrun_command

CONFIG = "train_configs/tiny.toml"  # compute dtype "auto", like the debug preset
STEPS, VAL_FREQ = 20, 10


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("run")
    result = run_module(
        "torchtitan.train", "--job.config_file", CONFIG, "--training.steps", str(STEPS),
        "--checkpoint.enable", "--checkpoint.interval", str(VAL_FREQ), "--validation.enable",
        "--validation.freq", str(VAL_FREQ), "--validation.steps", "16", f"--job.dump_folder={dump}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dump


def generate(dump, *flags):
    return generate_from(dump / "config.toml", dump / "checkpoint" / f"step-{STEPS}", *flags)


def generate_from(config, checkpoint, *flags):
    # One BLAS thread: with several, the BLAS may pick its thread count by machine load, which changes
    # the summation order, and a weakly trained model has near-ties that a last-bit change can flip.
    return run_module("scripts.generate", "--config", str(config), "--checkpoint", str(checkpoint), *flags,
                      env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})


@pytest.mark.slow
def test_generate_prints_new_text_and_greedy_is_deterministic(run):
    prompt = "def main():"
    first = generate(run, "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "12", "--no_stop_at_eos")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(prompt) and len(first.stdout.rstrip("\n")) > len(prompt), repr(first.stdout)
    assert "[12 new tokens]" in first.stderr
    again = generate(run, "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "12", "--no_stop_at_eos")
    assert again.stdout == first.stdout, (first.stdout, again.stdout)
    # In a batch with a longer prompt (left-padded beside it), the same text, printed in the prompts' order.
    batch = generate(run, "--prompt", "import os\nimport sys\n", "--prompt", prompt, "--temperature", "0",
                     "--max_new_tokens", "12", "--no_stop_at_eos")
    assert batch.returncode == 0, batch.stderr
    assert batch.stdout.split("=== prompt 2 of 2 ===\n")[1] == first.stdout
    sampled = generate(run, "--prompt", prompt, "--top_k", "20", "--top_p", "0.9", "--seed", "1",
                       "--max_new_tokens", "12", "--no_stop_at_eos")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith(prompt) and len(sampled.stdout.rstrip("\n")) > len(prompt), repr(sampled.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [(["--top_p", "0"], "--top_p 0 is invalid"),
                                            (["--temperature", "-1"], "--temperature -1 is invalid"),
                                            (["--max_new_tokens", "0"], "--max_new_tokens 0 is invalid"),
                                            (["--system", "Be brief."], "--system is a chat message; add --chat")])
def test_generate_rejects_bad_arguments(run, flags, message):
    result = generate(run, *flags)
    assert result.returncode == 2 and message in result.stderr


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """qwen3_moe_debug's config and its checkpoint after one step (trained experts and routing bias)."""
    dump = tmp_path_factory.mktemp("moe")
    result = run_module(
        "torchtitan.train", "--job.config_file", "train_configs/qwen3_moe_debug.toml", "--training.steps", "1",
        "--training.local_batch_size", "2", "--training.seq_len", "64", "--checkpoint.enable",
        "--checkpoint.interval", "1", f"--job.dump_folder={dump}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dump / "config.toml", dump / "checkpoint" / "step-1"


@pytest.fixture(scope="module")
def tiny_run(run):
    return run / "config.toml", run / "checkpoint" / f"step-{STEPS}"


def json_lines(stderr: str) -> list[dict]:
    """The --logprobs lines of a run's stderr."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def largest_logprob_gap(a: list[dict], b: list[dict]) -> float:
    return max(abs(x - y) for one, other in zip(a, b) for x, y in zip(one["logprobs"], other["logprobs"]))


@pytest.mark.slow
@pytest.mark.parametrize("layout, trained", [(["--tp", "2"], "tiny_run"), (["--ep", "2"], "moe_run")])
def test_generate_under_torchrun_prints_the_single_process_text(layout, trained, request, capsys):
    config, checkpoint = request.getfixturevalue(trained)
    flags = ["--prompt", "def main():", "--prompt", "import os\nimport sys\n", "--temperature", "0",
             "--max_new_tokens", "12", "--no_stop_at_eos", "--logprobs"]
    one = generate_from(config, checkpoint, *flags)
    assert one.returncode == 0, one.stderr
    # As users run it (torchrun scripts/generate.py); PYTHONPATH: a script imports from its own folder first, so
    # torchtitan would otherwise be whichever one is installed, not this repository's.
    sharded = run_command([*torchrun_command(2, "scripts/generate.py", ranks=None), "--config", str(config),
                           "--checkpoint", str(checkpoint), *flags, *layout], env={"PYTHONPATH": str(REPO)},
                          timeout=300)
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-3000:]
    assert sharded.stdout == one.stdout and one.stdout.count("=== prompt") == 2
    for i in (1, 2):  # rank 0 alone reports
        assert sharded.stderr.count(f"[prompt {i} of 2: 12 new tokens]") == 1, sharded.stderr[-3000:]
    ones, shardeds = json_lines(one.stderr), json_lines(sharded.stderr)
    assert len(shardeds) == 2 and [r["tokens"] for r in shardeds] == [r["tokens"] for r in ones]
    assert largest_logprob_gap(shardeds, ones) < 1e-4
    # The checkpoint's weights made those numbers: the seeded initialisation's are further off.
    assert generate_script.main(["--config", str(config), "--device", "cpu", *flags]) == 0
    assert largest_logprob_gap(json_lines(capsys.readouterr().err), ones) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("step", [VAL_FREQ, STEPS])
def test_evaluation_perplexity_matches_the_logged_validation(run, step):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r["val_loss"] for r in rows if r["step"] == step and "val_loss" in r)
    result = run_module("scripts.evaluate", "--config", str(run / "config.toml"),
                        "--checkpoint", str(run / "checkpoint" / f"step-{step}"), "--json")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(result.stdout)
    assert evaluated["val_perplexity"] == pytest.approx(math.exp(logged), rel=0.01)
    assert evaluated["val_tokens"] == 16 * 4 * 64


@pytest.mark.slow
def test_evaluate_takes_validation_overrides(run):
    result = run_module("scripts.evaluate", "--config", str(run / "config.toml"), "--checkpoint",
                        str(run / "checkpoint" / f"step-{STEPS}"), "--validation.steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["val_tokens"] == 2 * 4 * 64
    missing = run_module("scripts.evaluate", "--config", str(run / "config.toml"), "--checkpoint", "/nonexistent")
    assert missing.returncode == 2 and "is not a folder" in missing.stderr


SFT_STEPS = 30


@pytest.fixture(scope="module")
def sft(run, tmp_path_factory):
    """sft_debug.toml at the tiny flavor, fine-tuning the pretraining run's last checkpoint."""
    dump = tmp_path_factory.mktemp("sft")
    result = run_module(
        "torchtitan.train", "--job.config_file", "train_configs/sft_debug.toml", "--model.flavor", "tiny",
        "--checkpoint.initial_load_path", str(run / "checkpoint" / f"step-{STEPS}"), "--training.seq_len", "128",
        "--validation.seq_len", "128", "--training.steps", str(SFT_STEPS), "--validation.freq", str(SFT_STEPS),
        "--validation.steps", "4", "--checkpoint.interval", str(SFT_STEPS), "--metrics.log_freq", "1",
        "--optimizer.lr", "1e-3", f"--job.dump_folder={dump}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert f"initialised the model from {run}" in log and "from freshly" not in log
    assert "attention block-causal (within documents), RoPE positions per document" in log
    return dump


@pytest.mark.slow
def test_fine_tuning_from_a_checkpoint_lowers_the_assistant_loss(sft):
    rows = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == SFT_STEPS
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.25, losses  # a tiny model, 30 steps: about -0.35
    assert all(r["data/conversations_truncated"] >= 0 for r in rows if "loss" in r)
    assert any("val_loss" in r for r in rows)


@pytest.mark.slow
def test_generate_chat_answers_through_the_template(sft):
    result = run_module("scripts.generate", "--config", str(sft / "config.toml"), "--checkpoint",
                        str(sft / "checkpoint" / f"step-{SFT_STEPS}"), "--chat", "--prompt",
                        "What does `json.dumps(obj)` do?", "--temperature", "0", "--max_new_tokens", "24")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "<|user|>" not in result.stdout and "json.dumps" not in result.stdout[:5]
