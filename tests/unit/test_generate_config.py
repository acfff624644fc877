"""scripts/generate_config.py: step arithmetic, token budget, and TOMLs that pass config validation."""

import math

import pytest

from scripts import generate_config as gc
from torchtitan.config import load_config
from torchtitan.config.validation import import_custom_modules, validate_config
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


def test_custom_dimensions_register_a_flavor_the_trainer_can_build(tmp_path, monkeypatch):
    from tests.conftest import REPO
    from torchtitan.models.llama3.args import llama3_flavors

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m torchtitan.train` puts the working folder first

    out = generate(tmp_path, "--dim", "64", "--n_layers", "2", "--n_heads", "4", "--n_kv_heads", "2",
                   "--name", "mini", "--gpus_per_node", "2", "--global_batch_size", "8", "--seq_len", "64",
                   "--hf_assets_path", str(REPO / "assets/tokenizer"), "--base", str(REPO / "train_configs/debug_model.toml"),
                   "--device", "CPU")
    assert (tmp_path / "gen_flavor.py").is_file()
    cfg = validated(out, world_size=2)
    assert cfg.model.flavor == "mini" and cfg.experimental.custom_import == "gen_flavor"
    llama3_flavors.pop("mini")  # registered by the generator and the import; other tests expect the built-ins


@pytest.mark.parametrize("flags, message", [
    (["--global_batch_size", "8"], "either --flavor or custom dimensions"),
    (["--flavor", "nope", "--global_batch_size", "8"], "--flavor nope is not registered"),
    (["--flavor", "tiny", "--global_batch_size", "6", "--gpus_per_node", "4"], "not divisible by the data-parallel"),
    (["--flavor", "tiny", "--global_batch_size", "8", "--nodes", "0"], "--nodes 0 is invalid"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, flags, message):
    assert gc.main([*flags, "--output", str(tmp_path / "x.toml"), "--device", "CPU"]) == 2
    assert message in capsys.readouterr().err
