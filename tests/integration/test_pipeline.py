"""Pipeline parallelism on CPU/gloo trains the same numbers as a single process (fp32, 6 steps, global batch 8)."""

from pathlib import Path

import pytest

from tests.integration.parity import (
    CONFIG,
    assert_matches,
    assert_resumes_under_another_layout,
    assert_tiny_matches_single_process,
    train,
)
from torchtitan.distributed.pipeline_parallel import SCHEDULES

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


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
def test_every_schedule_matches_single_process(tmp_path, reference, schedule):
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
def test_explicit_module_names_per_stage(tmp_path, reference):
    """An uneven cut given by name: 5 blocks on the first stage, 1 with the output on the second."""
    toml = tmp_path / "uneven.toml"
    toml.write_text(f'extends = "{Path(CONFIG).resolve()}"\n[parallelism]\nmodule_fqns_per_model_part = '
                    '[["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4"], '
                    '["layers.5", "norm", "output"]]\n')
    rows = train(tmp_path / "run", 2, ["--training.local_batch_size", "8", *PP2], config=str(toml))
    assert_matches(rows, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_compositions_match_single_process(tmp_path, reference, layout):
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
