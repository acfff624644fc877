"""DDP, HSDP and PP x DDP with gradient accumulation train the single process's numbers, and the
all-reduce across replicas runs once per optimizer step, not once per micro-batch.

Tiny flavor, fp32, global batch 8, 4 steps; the layouts differ in how the 8 sequences are split.
"""

import json

import pytest

from tests.integration.parity import Matrix, assert_same_steps, rows_of

CONFIG = "train_configs/tiny.toml"
COMMON = ["--training.mixed_precision_param", "float32", "--training.steps", "4",
          "--training.global_batch_size", "8", "--metrics.log_freq", "1",
          "--comm.init_timeout_seconds", "900", "--comm.train_timeout_seconds", "900"]
DDP2 = ["--parallelism.data_parallel_replicate_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
# name: (processes, flags, micro-batches per rank per step, whether all-reduces must be one per step)
LAYOUTS = {
    "ddp2_accum2": (2, ["--training.local_batch_size", "2", *DDP2], 2, True),
    "hsdp2x2_accum2": (4, ["--training.local_batch_size", "1", *DDP2], 2, True),
    "pp2_ddp2": (4, ["--training.local_batch_size", "4", *DDP2, *PP2], 1, True),
    # The pipeline stage syncs at the end of each schedule step, so here once per micro-batch.
    "pp2_ddp2_accum2": (4, ["--training.local_batch_size", "2", *DDP2, *PP2], 2, False),
}


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py), names prefixed "sync_"."""
    layouts = {"single": (1, ["--training.local_batch_size", "8"]),
               **{name: (nproc, flags) for name, (nproc, flags, _, _) in LAYOUTS.items()}}
    return {"sync_": Matrix(layouts, CONFIG, COMMON, entry="tests.integration.gradient_sync_worker:main")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulation_matches_single_process_with_one_sync_per_step(suite_runs, layout):
    folder, runs = suite_runs
    nproc, _, microbatches, once_per_step = LAYOUTS[layout]
    reference = rows_of(runs, "sync_single")
    assert [r["step"] for r in reference] == [1, 2, 3, 4] and reference[-1]["loss"] != reference[0]["loss"]
    assert_same_steps(rows_of(runs, "sync_" + layout), reference)
    for rank in range(nproc):
        counts = json.loads((folder / f"sync_{layout}" / f"all_reduces-rank{rank}.json").read_text())
        assert counts["units"] > 0 and counts["steps"] == 4 and counts["accumulation"] == microbatches
        per_unit_and_step = counts["all_reduces"] / (counts["units"] * counts["steps"])
        assert per_unit_and_step == (1 if once_per_step else microbatches), (rank, counts)
