"""DDP, HSDP and PP x DDP with gradient accumulation train the single process's numbers, and the
all-reduce across replicas runs once per optimizer step, not once per micro-batch.

Tiny flavor, fp32, global batch 8, 4 steps; the layouts differ in how the 8 sequences are split.
"""

import json
import sys

import pytest

from tests.conftest import run_command, run_module
from tests.integration.parity import assert_same_steps, read_rows

CONFIG = "train_configs/tiny.toml"
COMMON = ["--job.config_file", CONFIG, "--training.mixed_precision_param", "float32", "--training.steps", "4",
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


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = run_module("torchtitan.train", *COMMON, "--training.local_batch_size", "8", f"--job.dump_folder={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] != rows[0]["loss"]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulation_matches_single_process_with_one_sync_per_step(tmp_path, tiny_reference, layout):
    nproc, flags, microbatches, once_per_step = LAYOUTS[layout]
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          "tests/integration/gradient_sync_worker.py", *COMMON, *flags, f"--job.dump_folder={tmp_path}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"accumulation {microbatches}" in result.stdout + result.stderr
    assert_same_steps(read_rows(tmp_path), tiny_reference)
    for rank in range(nproc):
        counts = json.loads((tmp_path / f"all_reduces-rank{rank}.json").read_text())
        assert counts["units"] > 0 and counts["steps"] == 4
        per_unit_and_step = counts["all_reduces"] / (counts["units"] * counts["steps"])
        assert per_unit_and_step == (1 if once_per_step else microbatches), (rank, counts)
