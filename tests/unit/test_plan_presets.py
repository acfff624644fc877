"""scripts/plan.py on every shipped preset at the world size it is written for, and its exit codes."""

import re
import subprocess
import sys

import pytest

from scripts import plan as plan_script
from tests.conftest import REPO
from torchtitan import planner

PRESETS = sorted((REPO / "train_configs").glob("*.toml"))


def intended_run(preset) -> tuple[str, int]:
    """(device, world size) a preset is written for: a cluster preset's opening comment says "on N GPUs";
    the others (debug, tiny, Qwen3 debug) are for one process on a CPU."""
    cluster = re.search(r"\bon (\d+) GPUs\b", preset.read_text())
    return ("H100", int(cluster.group(1))) if cluster else ("CPU", 1)


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_script.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cluster_presets_are_planned_on_their_clusters():
    runs = {p.name: intended_run(p) for p in PRESETS}
    assert runs["llama3_8b.toml"] == ("H100", 8)
    assert runs["llama3_70b.toml"] == ("H100", 64)
    assert runs["llama3_405b.toml"] == ("H100", 512)
    assert runs["qwen3_moe_30b_a3b.toml"] == ("H100", 32)
    assert runs["qwen3_debug.toml"] == runs["debug_model.toml"] == runs["qwen3_moe_debug.toml"] == ("CPU", 1)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_gets_a_plan(preset, capsys, monkeypatch):
    # The CPU measurements (matmul peak, the model's blocks timed) take minutes on a fresh machine; the
    # plan around them is what is checked here (test_planner.py checks the calibration itself).
    monkeypatch.setattr(planner.speed, "cpu_machine_peak_tflops", lambda dtype: 1.0)
    monkeypatch.setattr(planner, "measure_cpu_timing", lambda cfg, vocab_size: planner.CpuTiming(0.1, 0.1, 0.01, 0.01))
    device, world_size = intended_run(preset)
    code, out, err = run_plan(capsys, "--config", str(preset.relative_to(REPO)), "--device", device,
                              "--world_size", str(world_size))
    # Not fitting is a verdict, not a failure to plan.
    assert code in (plan_script.FITS, plan_script.DOES_NOT_FIT), err
    assert f"device: {device}" in out and f"layout: world {world_size} =" in out
    assert out.rstrip().splitlines()[-1].startswith("fits: " if code == plan_script.FITS else "DOES NOT FIT")


def test_a_config_that_cannot_be_planned_exits_2_with_one_line(tmp_path):
    config = tmp_path / "bad.toml"
    # A Llama flavor under the Qwen3 model: the kind of config that used to reach the planner's internals.
    config.write_text(f'extends = "{REPO / "train_configs" / "qwen3_debug.toml"}"\n\n[model]\nflavor = "70B"\n')
    result = subprocess.run([sys.executable, "scripts/plan.py", "--config", str(config), "--device", "H100"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == plan_script.CANNOT_PLAN == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and "model.flavor = '70B' is not a flavor" in result.stderr


def test_a_planner_failure_is_one_line_with_its_own_exit_code(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'SomeModelArgs' object has no attribute 'kv_heads'\n(second line)")

    monkeypatch.setattr(plan_script, "plan", broken)
    code, out, err = run_plan(capsys, "--config", "train_configs/tiny.toml", "--device", "H100")
    assert code == plan_script.PLANNER_BUG == 1 and out == ""
    assert err == ("error: the planner failed on this config (a bug; please report it with the command line): "
                   "AttributeError: 'SomeModelArgs' object has no attribute 'kv_heads' (second line)\n")


@pytest.mark.parametrize("flag", ["--world_size", "--vocab_size"])
def test_non_positive_sizes_are_refused_in_one_line(capsys, flag):
    with pytest.raises(SystemExit) as exit_info:  # while parsing, before the config is read
        run_plan(capsys, "--config", "train_configs/debug_model.toml", "--device", "H100", flag, "-5")
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and err == f"error: {flag} -5 is invalid; it must be an integer >= 1\n"


def test_a_family_registered_from_outside_is_planned_through_the_decoder_interface(capsys):
    import torch

    from torchtitan.config import load_config
    from torchtitan.protocols.train_spec import get_train_spec

    flags = ["--experimental.custom_import", "tests.unit.third_family", "--model.name", "toy_decoder",
             "--model.flavor", "wide", "--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    code, out, err = run_plan(capsys, "--config", "train_configs/debug_model.toml", "--device", "H100", *flags)
    assert code == 0, err
    assert "toy_decoder/wide" in out
    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml", *flags])
    shape = planner.model_shape(cfg)
    args = get_train_spec("toy_decoder").flavors["wide"].finalize(2048, 64)
    with torch.device("meta"):
        model = get_train_spec("toy_decoder").model_cls(args)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.ffn_dim, shape.kv_dim, shape.qk_norm, shape.output_params) == (8 * 96, 2 * 16, True, 0)


@pytest.mark.parametrize("preset, smallest, written_for, reason", [
    ("qwen3_moe_30b_a3b", 8, 32, "parallelism.expert_parallel_degree = 8 does not divide"),
    ("deepseek_v3_16b", 8, 16, "parallelism.expert_parallel_degree = 8 does not divide"),
    ("deepseek_v3_671b", 512, 512, "parallelism.data_parallel_shard_degree = -1 cannot fill the world size 1"),
])
def test_a_preset_planned_without_its_world_size_says_the_world_size_to_give(capsys, preset, smallest, written_for,
                                                                             reason):
    code, out, err = run_plan(capsys, "--config", f"train_configs/{preset}.toml", "--device", "H100")
    assert code == plan_script.CANNOT_PLAN and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: train_configs/{preset}.toml: {reason}")
    assert err.endswith(f". This plan assumed a world size of 1 (the default; --world_size sets it); the smallest "
                        f"these parallel degrees allow is {smallest} (--world_size {smallest}); the config's header "
                        f"says it is written for {written_for} GPUs\n")


def test_a_world_size_the_degrees_do_not_fit_is_named_as_given(capsys):
    code, _, err = run_plan(capsys, "--config", "train_configs/deepseek_v3_16b.toml", "--device", "H100",
                            "--world_size", "12")
    assert code == plan_script.CANNOT_PLAN
    assert "= 12 x 1 = 12" in err and err.endswith(
        ". This plan assumed --world_size 12; the smallest these parallel degrees allow is 8 (--world_size 8); "
        "the config's header says it is written for 16 GPUs\n")


def test_smallest_world_size_follows_the_degrees():
    from torchtitan.config.job_config import Parallelism

    def smallest(**degrees):
        return planner.smallest_world_size(Parallelism(**degrees))

    assert smallest() == 1
    assert smallest(tensor_parallel_degree=2, pipeline_parallel_degree=4) == 8
    # EP 4 carved from dp_shard x cp with cp 2: dp_shard 2 suffices.
    assert smallest(context_parallel_degree=2, expert_parallel_degree=4) == 4
    assert smallest(data_parallel_shard_degree=3, expert_parallel_degree=2) is None
    assert smallest(context_parallel_degree=4, expert_parallel_degree=6) is None  # neither divides the other
