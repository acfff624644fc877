"""scripts/generate_config.py: step arithmetic, token budget, and TOMLs that pass config validation."""

import math
import sys

import pytest

from scripts import generate_config as gc
from torchtitan.config import load_config
from torchtitan.config_check import import_custom_modules, validate_config
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.planner import model_shape


def generate(tmp_path, *flags):
    out = tmp_path / "gen.toml"
    assert gc.main([*flags, "--output", str(out)]) == 0
    return out


def validated(path, world_size):
    cfg, sources = load_config(["--job.config_file", str(path)])
    import_custom_modules(cfg, sources)
    validate_config(cfg, sources, world_size)
    return cfg


def test_steps_warmup_and_local_batch_rules():
    assert gc.steps_for(1_000_000, 8, 128) == math.ceil(1_000_000 / 1024)
    assert gc.steps_for(1024, 8, 128) == 1
    assert gc.warmup_for(10) == 1 and gc.warmup_for(1000) == 20
    assert gc.local_batch_for(32) == 8 and gc.local_batch_for(6) == 6 and gc.local_batch_for(12) == 6


def test_default_token_budget_is_22x_non_embedding_params(tmp_path):
    out = generate(tmp_path, "--flavor", "debugmodel", "--nodes", "2", "--gpus_per_node", "4",
                   "--global_batch_size", "64", "--seq_len", "256", "--device", "CPU")
    cfg = validated(out, world_size=8)
    shape = model_shape(cfg)
    tokens = 22 * (shape.params - shape.embedding_params)
    assert cfg.training.steps == math.ceil(tokens / (64 * 256))
    assert cfg.lr_scheduler.warmup_steps == max(1, round(0.02 * cfg.training.steps))
    assert cfg.parallelism.data_parallel_shard_degree == 8 and cfg.parallelism.tensor_parallel_degree == 1
    # local x dp x accumulation = global batch
    assert cfg.training.global_batch_size == 64 and 64 % (cfg.training.local_batch_size * 8) == 0


def test_explicit_tokens_tp_and_accumulation(tmp_path):
    out = generate(tmp_path, "--flavor", "debugmodel", "--gpus_per_node", "4", "--global_batch_size", "32",
                   "--seq_len", "128", "--tokens", "1e6", "--tp", "2", "--local_batch_size", "4", "--device", "CPU")
    cfg = validated(out, world_size=4)
    assert cfg.training.steps == math.ceil(1e6 / (32 * 128))
    assert cfg.parallelism.tensor_parallel_degree == 2 and cfg.parallelism.data_parallel_shard_degree == 2
    assert cfg.training.local_batch_size == 4  # 32 = 4 local x 2 dp x 4 accumulation steps


def test_tensor_parallel_is_added_when_the_model_does_not_fit(tmp_path, capsys):
    assert gc.main(["--flavor", "70B", "--gpus_per_node", "8", "--global_batch_size", "8", "--seq_len", "4096",
                    "--output", str(tmp_path / "x.toml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tp 1," not in out and "would run: CONFIG_FILE=" in out and "sbatch --nodes 1" in out
    assert not (tmp_path / "x.toml").exists()


@pytest.fixture
def forget_mini_flavor():
    """Remove what the custom-dimensions test registers, even when it fails: other tests expect the built-ins."""
    yield
    llama3_flavors.pop("mini", None)
    sys.modules.pop("gen_flavor", None)


def test_custom_dimensions_register_a_flavor_the_trainer_can_build(tmp_path, monkeypatch, forget_mini_flavor):
    from tests.conftest import REPO

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m torchtitan.train` puts the working folder first

    out = generate(tmp_path, "--dim", "64", "--n_layers", "2", "--n_heads", "4", "--n_kv_heads", "2",
                   "--name", "mini", "--gpus_per_node", "2", "--global_batch_size", "8", "--seq_len", "64",
                   "--hf_assets_path", str(REPO / "assets/tokenizer"),
                   "--base", str(REPO / "train_configs/debug_model.toml"), "--device", "CPU")
    assert (tmp_path / "gen_flavor.py").is_file()
    cfg = validated(out, world_size=2)
    assert cfg.model.flavor == "mini" and cfg.experimental.custom_import == "gen_flavor"


def test_pipeline_gets_a_micro_batch_per_stage_or_a_clear_error(tmp_path, capsys):
    flags = ["--flavor", "debugmodel", "--pp", "4", "--device", "CPU", "--seq_len", "256"]
    assert gc.main([*flags, "--global_batch_size", "2", "--output", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --global_batch_size 2 gives 1 sequence(s) per data-parallel rank")
    assert "fewer than the 4 that --pp 4 needs" in err and err.count("\n") == 1
    assert not (tmp_path / "x.toml").exists()
    # 8 ranks = pp 4 x dp 2: 4 sequences per rank, one micro-batch for each of the 4 stages.
    cfg = validated(generate(tmp_path, *flags, "--global_batch_size", "8"), world_size=8)
    assert cfg.parallelism.pipeline_parallel_degree == 4 and cfg.training.local_batch_size == 4


def test_a_tensor_parallel_degree_the_validation_rejects_is_reported(tmp_path, capsys):
    # debugmodel has 16 heads: tp 3 cannot split them (seq_len 3072 passes the sequence check first).
    assert gc.main(["--flavor", "debugmodel", "--tp", "3", "--gpus_per_node", "3", "--global_batch_size", "3",
                    "--seq_len", "3072", "--device", "CPU", "--output", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no valid layout for 3 ranks: tp 3:") and "n_heads 16 is not divisible" in err


@pytest.mark.parametrize("flags, message", [
    (["--global_batch_size", "8"], "either --flavor or custom dimensions"),
    (["--flavor", "nope", "--global_batch_size", "8"], "--flavor nope is not registered"),
    (["--flavor", "tiny", "--global_batch_size", "6", "--gpus_per_node", "4"], "not divisible by the data-parallel"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, flags, message):
    assert gc.main([*flags, "--output", str(tmp_path / "x.toml"), "--device", "CPU"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--flavor", "tiny", "--nodes", "0"], "--nodes 0 is invalid; it must be an integer >= 1"),
    (["--dim", "0", "--n_layers", "2", "--n_heads", "2"], "--dim 0 is invalid; it must be an integer >= 1"),
    (["--flavor", "tiny", "--tokens", "0"], "--tokens 0 is invalid; it must be a finite number > 0"),
])
def test_a_number_out_of_range_is_refused_while_parsing(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        gc.main([*flags, "--global_batch_size", "8", "--output", str(tmp_path / "x.toml"), "--device", "CPU"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
