"""Extension points: an outside model via experimental.custom_import, and the float8 model converter."""

import json

import pytest
import torch

from tests.conftest import run_command, run_module, torchrun_command
from tests.integration.parity import Matrix, rows_of, runs_under
from tests.integration.test_training import make_trainer
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.protocols import TrainSpec, register_train_spec
from torchtitan.protocols.model_converter import register_model_converter

NANOGPT = "examples/nanogpt/nanogpt.toml"


def losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_outside_package_model_trains_through_custom_import(tmp_path):
    result = run_module("torchtitan.train", "--job.config_file", NANOGPT, "--training.steps", "5",
                        "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
                        f"--job.dump_folder={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "model nanogpt/tiny" in result.stdout
    values = losses(tmp_path)
    assert len(values) == 5 and values[-1] < values[0]


@pytest.mark.slow
def test_outside_package_model_under_fsdp2_matches_single_process(tmp_path):
    flags = ["--training.steps", "5", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
             "--comm.init_timeout_seconds", "600"]
    single = tmp_path / "single"
    assert run_module("torchtitan.train", "--job.config_file", NANOGPT, *flags, "--training.local_batch_size", "4",
                      f"--job.dump_folder={single}").returncode == 0
    fsdp = tmp_path / "fsdp"
    # Both ranks' output: rank 1 once aborted at teardown (SIGABRT after "training finished") with nothing shown.
    result = run_command([*torchrun_command(2, "torchtitan.train", ranks="0,1"), "--job.config_file", NANOGPT, *flags,
                          "--training.local_batch_size", "2", f"--job.dump_folder={fsdp}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert losses(fsdp) == pytest.approx(losses(single), rel=1e-4)


def test_registries_refuse_duplicates_and_unknown_names():
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.models.shared.decoder import Decoder

    with pytest.raises(ValueError, match="'llama3' is already registered"):
        register_train_spec("llama3", TrainSpec(model_cls=Decoder, flavors=llama3_flavors))
    with pytest.raises(ValueError, match="'float8' is already registered"):
        from torchtitan.components.float8 import Float8Converter  # noqa: F401  (registers float8)

        register_model_converter("float8", object)
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", "--model.converters", "fp8"])
    with pytest.raises(ConfigError, match=r"model.converters = \['fp8'\] names unknown converters \['fp8'\]; "
                                          r"registered: .*float8"):
        validate_config(cfg, sources, world_size=1)


def test_float8_converts_every_linear_except_filtered(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    trainer = make_trainer(tmp_path, "--model.converters", "float8", "--training.steps", "1",
                           "--model.flavor", "debugmodel")
    model = trainer.model_parts[0]
    linears = {name: type(m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears.pop("output") is torch.nn.Linear  # filter_fqns = ["output"] by default
    assert len(linears) == 6 * 7 and all(t is Float8Linear for t in linears.values())


STEPS = 15
FLOAT8_FLAGS = ["--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.steps", str(STEPS),
                "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600"]
# torch._scaled_mm has no fast CPU kernel; emulation keeps float8 rounding with fast matmuls.
EMULATE = ["--quantize.linear.float8.emulate"]


FLOAT8 = ["--model.converters", "float8", *EMULATE]
FLOAT8_RUNS = {
    "bf16": (1, ["--training.local_batch_size", "8"]),
    "single": (1, [*FLOAT8, "--training.local_batch_size", "8"]),
    "compile": (1, [*FLOAT8, "--training.local_batch_size", "8", "--compile.enable"]),
    "fsdp2": (2, [*FLOAT8, "--training.local_batch_size", "4"]),
}


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's float8 runs in the suite-wide matrix (integration/conftest.py), names prefixed "float8_"."""
    return {"float8_": Matrix(FLOAT8_RUNS, "train_configs/tiny.toml", FLOAT8_FLAGS)}


@pytest.fixture(scope="module")
def float8_runs(suite_runs):
    return runs_under(suite_runs[1], "float8_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "fsdp2", "compile"])
def test_float8_training_stays_within_5_percent_of_bf16(float8_runs, layout):
    ours, bf16 = [[r["loss"] for r in rows_of(float8_runs, name)] for name in (layout, "bf16")]
    assert len(ours) == len(bf16) == STEPS
    assert ours[-1] == pytest.approx(bf16[-1], rel=0.05)
    assert ours[-1] < ours[0] - 1.0  # it learned, so the comparison is between trained models


@pytest.mark.slow
def test_float8_with_real_scaled_mm_kernels_trains_the_tiny_model(tmp_path):
    """Without emulation (asked for: on a CPU the default emulates) every float8 matmul goes through
    torch._scaled_mm (slow on CPU: 3 tiny steps), with a warning."""
    flags = ["--training.steps", "3", "--metrics.log_freq", "1", f"--job.dump_folder={tmp_path}"]
    ref = tmp_path / "ref"
    assert run_module("torchtitan.train", "--job.config_file", "train_configs/tiny.toml", *flags[:-1],
                      f"--job.dump_folder={ref}").returncode == 0
    result = run_module("torchtitan.train", "--job.config_file", "train_configs/tiny.toml", *flags,
                        "--model.converters", "float8", "--quantize.linear.float8.no_emulate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converted" in result.stdout and "float8: emulate = false on this CPU" in result.stdout
    assert losses(tmp_path) == pytest.approx(losses(ref), rel=0.05)
