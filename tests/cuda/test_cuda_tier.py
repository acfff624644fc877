"""The CUDA tier: training, float8, checkpoints, exports and the NCCL code path on a GPU (``pytest -m cuda``).

Skipped where no CUDA GPU is present (tests/cuda/conftest.py). Each test runs the trainer as users do, in its
own process, with bf16 compute (the GPU default) unless it compares numbers, where it asks for float32.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import run_command, torchrun_command

pytestmark = pytest.mark.cuda

DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--metrics.log_freq", "1",
         "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
# A mid-size Llama 3: the 1.1B research flavor (1536 wide, 32 layers) at seq 2048.
MID = [*DEBUG, "--model.flavor", "1.1B", "--training.seq_len", "2048", "--training.local_batch_size", "2"]
FLOAT8 = ["--model.converters", "float8", "--compile.enable"]
MODES = {
    "eager": [],
    "compile": ["--compile.enable"],
    "selective_op_ac": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                        "op", "--compile.enable"],
    "full_ac": ["--activation_checkpoint.mode", "full"],
    "float8_tensorwise": [*FLOAT8, "--quantize.linear.float8.recipe_name", "tensorwise"],
    "float8_rowwise": [*FLOAT8, "--quantize.linear.float8.recipe_name", "rowwise"],
    "chunked_loss": ["--training.loss_chunk_size", "1024", "--compile.enable"],
}


def train(dump: Path, *flags: str, torchrun: bool = False) -> list[dict]:
    command = torchrun_command(1, "torchtitan.train") if torchrun else [sys.executable, "-m", "torchtitan.train"]
    result = run_command([*command, *flags, f"--job.dump_folder={dump}"], timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def learns(rows: list[dict]) -> None:
    losses = [r["loss"] for r in rows]
    assert all(loss == loss and loss < 20 for loss in losses), losses  # finite
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


@pytest.mark.parametrize("mode", MODES)
def test_the_debug_model_learns_on_the_gpu(tmp_path, mode):
    rows = train(tmp_path, *DEBUG, "--training.steps", "30", "--lr_scheduler.warmup_steps", "3", *MODES[mode])
    learns(rows)
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    assert provenance["device"]["type"] == "cuda"


@pytest.mark.parametrize("mode", ["eager", "compile", "float8_rowwise"])
def test_a_mid_size_model_trains_on_the_gpu(tmp_path, mode):
    rows = train(tmp_path, *MID, "--training.steps", "12", "--lr_scheduler.warmup_steps", "2", *MODES[mode])
    assert len(rows) == 12 and all(r["loss"] == r["loss"] for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["memory_gib"] > 1 and rows[-1]["mfu"] > 0


def test_float8_follows_the_bf16_losses(tmp_path):
    bf16 = train(tmp_path / "bf16", *DEBUG, "--training.steps", "20", "--compile.enable")
    fp8 = train(tmp_path / "fp8", *DEBUG, "--training.steps", "20", *MODES["float8_rowwise"])
    for ours, ref in zip(fp8, bf16):
        assert abs(ours["loss"] - ref["loss"]) < 0.1 * ref["loss"], (ours["step"], ours["loss"], ref["loss"])


def test_async_checkpoint_resume_repeats_the_straight_run(tmp_path):
    flags = [*DEBUG, "--training.steps", "8", "--training.mixed_precision_param", "float32", "--debug.deterministic",
             "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.async_mode",
             "async_with_pinned_mem", "--checkpoint.last_save_model_only=false"]
    straight = train(tmp_path / "straight", *flags)
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-4", ignore_errors=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-4", tmp_path / "resumed" / "checkpoint" / "step-4")
    resumed = train(tmp_path / "resumed", *flags)
    by_step = {r["step"]: r["loss"] for r in resumed}
    assert [by_step[s] for s in range(5, 9)] == pytest.approx([r["loss"] for r in straight[4:]], rel=1e-5)


def test_hf_export_from_the_gpu_loads_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan.inference import load_model

    train(tmp_path, *DEBUG, "--training.steps", "4", "--training.mixed_precision_param", "float32",
          "--checkpoint.enable", "--checkpoint.last_save_in_hf")
    folder = tmp_path / "checkpoint" / "export-step-4"
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).cuda().eval()
    ours = load_model("train_configs/debug_model.toml", str(folder), device="cuda")
    tokens = torch.randint(0, 2048, (2, 64), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon", "AdamW8bit"])
def test_one_process_nccl_run_takes_the_distributed_code_paths(tmp_path, optimizer):
    """torchrun with one process: the NCCL process group, the device mesh and collective-backed checkpoints, with
    each optimizer (Muon's owner exchange and torchao's 8-bit step on the GPU)."""
    rows = train(tmp_path, *DEBUG, "--training.steps", "30", "--lr_scheduler.warmup_steps", "3",
                 "--checkpoint.enable", "--checkpoint.interval", "10", "--optimizer.name", optimizer, torchrun=True)
    learns(rows)
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    assert provenance["layout"]["world_size"] == 1 and provenance["device"]["type"] == "cuda"
