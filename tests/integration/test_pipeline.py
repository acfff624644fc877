"""Pipeline parallelism on CPU/gloo trains the same numbers as a single process (fp32, 6 steps, global batch 8)."""

import shutil
from pathlib import Path

import pytest

from tests.conftest import run_command, run_module
from tests.integration.test_distributed import COMMON, CONFIG, assert_matches, read_rows, reference  # noqa: F401
from torchtitan.distributed.pipeline_parallel import SCHEDULES

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def train(dump: Path, nproc: int, flags: list[str], config: str = CONFIG, common=COMMON) -> list[dict]:
    result = run_command(["./run_train.sh", *common, *flags, f"--job.dump_folder={dump}"],
                         env={"NGPU": str(nproc), "CONFIG_FILE": config})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_rows(dump)


def one_f_one_b_csv(path: Path, pp: int, microbatches: int) -> Path:
    """1F1B written out by hand: rank r warms up with pp-1-r forwards, then alternates, then drains."""
    rows = []
    for r in range(pp):
        warmup = min(pp - 1 - r, microbatches)
        actions = [f"{r}F{i}" for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [f"{r}F{warmup + i}", f"{r}B{i}"]
        actions += [f"{r}B{i}" for i in range(microbatches - warmup, microbatches)]
        rows.append(",".join(actions))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_single_process(tmp_path, reference, schedule):  # noqa: F811
    rows = train(tmp_path, 2, ["--training.local_batch_size", "8", *PP2,
                               "--parallelism.pipeline_parallel_schedule", schedule])
    assert_matches(rows, reference)


LAYOUTS = {
    "pp2_accum2": (2, ["--training.local_batch_size", "4", "--training.global_batch_size", "8",
                       "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "pp2_microbatch2": (2, ["--training.local_batch_size", "8",
                            "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    "pp2_fsdp2": (4, ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"]),
    "pp2_tp2": (4, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2_looped_2_layers_per_stage": (2, ["--training.local_batch_size", "8",
                                          "--parallelism.pipeline_parallel_schedule", "LoopedBFS",
                                          "--parallelism.pipeline_parallel_layers_per_stage", "2"]),
}


@pytest.mark.slow
def test_explicit_module_names_per_stage(tmp_path, reference):  # noqa: F811
    """An uneven cut given by name: 5 blocks on the first stage, 1 with the output on the second."""
    toml = tmp_path / "uneven.toml"
    toml.write_text(f'extends = "{Path(CONFIG).resolve()}"\n[parallelism]\nmodule_fqns_per_model_part = '
                    '[["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4"], '
                    '["layers.5", "norm", "output"]]\n')
    rows = train(tmp_path / "run", 2, ["--training.local_batch_size", "8", *PP2], config=str(toml))
    assert_matches(rows, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_compositions_match_single_process(tmp_path, reference, layout):  # noqa: F811
    nproc, flags = LAYOUTS[layout]
    assert_matches(train(tmp_path, nproc, [*flags, *PP2]), reference)


@pytest.mark.slow
def test_csv_schedule_equal_to_1f1b_gives_the_1f1b_losses(tmp_path):
    flags = ["--training.local_batch_size", "8", *PP2]
    builtin = train(tmp_path / "1f1b", 2, flags)
    csv = one_f_one_b_csv(tmp_path / "1f1b.csv", pp=2, microbatches=8)
    custom = train(tmp_path / "csv", 2, [*flags, "--parallelism.pipeline_parallel_schedule_csv", str(csv)])
    assert [r["loss"] for r in custom] == pytest.approx([r["loss"] for r in builtin], rel=1e-6)
    assert [r["grad_norm"] for r in custom] == pytest.approx([r["grad_norm"] for r in builtin], rel=1e-6)


def assert_same_steps(rows: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    for ours, ref in zip(rows, expected):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ours["step"]


def assert_tiny_matches_single_process(tmp_path: Path, nproc: int, flags: list[str]) -> None:
    """4 steps of the tiny flavor (fp32, global batch 8) on ``nproc`` processes against one process."""
    common = ["--training.mixed_precision_param", "float32", "--training.steps", "4", "--metrics.log_freq", "1",
              "--comm.init_timeout_seconds", "900", "--comm.train_timeout_seconds", "900"]
    config = "train_configs/tiny.toml"
    single = tmp_path / "single"
    result = run_module("torchtitan.train", "--job.config_file", config, *common, "--training.local_batch_size", "8",
                        f"--job.dump_folder={single}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train(tmp_path / "parallel", nproc, flags, config=config, common=common)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_same_steps(rows, read_rows(single))


def assert_resumes_under_another_layout(tmp_path: Path, source: tuple[int, list[str]],
                                        target: tuple[int, list[str]]) -> None:
    """Saved at step 3 under ``source`` (nproc, flags), resumed under ``target``: steps 4-6 match the
    uninterrupted source run."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--training.local_batch_size", "8"]
    straight = train(tmp_path / "straight", source[0], [*ckpt, *source[1]])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    result = run_command(["./run_train.sh", *COMMON, *ckpt, *target[1], f"--job.dump_folder={resumed}"],
                         env={"NGPU": str(target[0]), "CONFIG_FILE": CONFIG})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from step 3" in result.stdout + result.stderr
    assert_same_steps(read_rows(resumed), straight[3:])


@pytest.mark.slow
def test_dp2_tp2_pp2_on_eight_processes_matches_single_process(tmp_path):
    assert_tiny_matches_single_process(
        tmp_path, 8, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2", *PP2])


@pytest.mark.slow
@pytest.mark.parametrize("source, target", [((2, PP2), (1, [])),
                                            ((1, []), (2, [*PP2, "--parallelism.pipeline_parallel_schedule",
                                                           "Interleaved1F1B"]))], ids=["pp2_to_pp1", "pp1_to_pp2"])
def test_checkpoint_moves_between_pipeline_layouts(tmp_path, source, target):
    assert_resumes_under_another_layout(tmp_path, source, target)
