"""Pipeline parallelism on CPU/gloo trains the same numbers as a single process (fp32, 4 steps, global batch 8)."""

from pathlib import Path

import pytest

from tests.integration.parity import (
    CONFIG,
    assert_matches,
    assert_resumes_under_another_layout,
    assert_tiny_matches_single_process,
    rows_of,
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


LAYOUTS = {
    **{schedule: (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_schedule", schedule])
       for schedule in SCHEDULES},
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
COMPOSITIONS = [name for name in LAYOUTS if name not in SCHEDULES]


def debug_layouts(folder: Path) -> dict[str, tuple[int, list[str]]]:
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture): every schedule and
    composition above, the uneven cut by module names and a CSV schedule equal to 1F1B, all with PP2."""
    uneven = folder / "uneven.toml"
    uneven.write_text(f'extends = "{Path(CONFIG).resolve()}"\n[parallelism]\nmodule_fqns_per_model_part = '
                      '[["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4"], '
                      '["layers.5", "norm", "output"]]\n')
    csv = one_f_one_b_csv(folder / "1f1b.csv", pp=2, microbatches=8)
    layouts = {
        **LAYOUTS,
        # An uneven cut given by name: 5 blocks on the first stage, 1 with the output on the second.
        "explicit_module_names": (2, ["--training.local_batch_size", "8", "--job.config_file", str(uneven)]),
        "csv_1f1b": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_schedule_csv",
                         str(csv)]),
    }
    return {name: (nproc, [*flags, *PP2]) for name, (nproc, flags) in layouts.items()}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_single_process(debug_runs, reference, schedule):
    assert_matches(rows_of(debug_runs, schedule), reference)


@pytest.mark.slow
def test_explicit_module_names_per_stage(debug_runs, reference):
    assert_matches(rows_of(debug_runs, "explicit_module_names"), reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", COMPOSITIONS)
def test_pipeline_compositions_match_single_process(debug_runs, reference, layout):
    assert_matches(rows_of(debug_runs, layout), reference)


@pytest.mark.slow
def test_csv_schedule_equal_to_1f1b_gives_the_1f1b_losses(debug_runs):
    builtin, custom = rows_of(debug_runs, "1F1B"), rows_of(debug_runs, "csv_1f1b")
    assert [r["loss"] for r in custom] == pytest.approx([r["loss"] for r in builtin], rel=1e-6)
    assert [r["grad_norm"] for r in custom] == pytest.approx([r["grad_norm"] for r in builtin], rel=1e-6)


@pytest.mark.slow
def test_dp2_tp2_pp2_on_eight_processes_matches_single_process(many_process_runs):
    assert_tiny_matches_single_process(many_process_runs, "dp2_tp2_pp2")


@pytest.mark.slow
@pytest.mark.parametrize("source, target", [((2, PP2), (1, [])),
                                            ((1, []), (2, [*PP2, "--parallelism.pipeline_parallel_schedule",
                                                           "Interleaved1F1B"]))], ids=["pp2_to_pp1", "pp1_to_pp2"])
def test_checkpoint_moves_between_pipeline_layouts(tmp_path, source, target):
    assert_resumes_under_another_layout(tmp_path, source, target)
