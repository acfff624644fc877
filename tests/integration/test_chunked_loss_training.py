"""training.loss_chunk_size in the trainer: under TP 2 (the vocab-sharded head reduces over the TP group), PP 2
(the last stage gets the labels), FSDP 2 and compile, training and validation losses are the plain path's."""

import pytest

from tests.integration.parity import assert_same_steps, rows_of
from tests.integration.test_distributed import VALIDATION

CHUNKED = [*VALIDATION, "--training.loss_chunk_size", "40"]  # 256 tokens per micro-batch: 7 chunks, the last short
LAYOUTS = {
    "chunked_single": (1, CHUNKED),
    "chunked_tp2": (2, [*CHUNKED, "--parallelism.tensor_parallel_degree", "2"]),
    "chunked_pp2": (2, [*CHUNKED, "--parallelism.pipeline_parallel_degree", "2"]),
    "chunked_fsdp2": (2, [*CHUNKED, "--training.local_batch_size", "4", "--validation.local_batch_size", "4"]),
    "chunked_compile": (1, [*CHUNKED, "--compile.enable"]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture); compared with
    test_distributed's val_single, the same run with the plain loss."""
    return LAYOUTS


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_loss_matches_the_plain_loss(debug_runs, layout):
    expected = rows_of(debug_runs, "val_single")
    rows = rows_of(debug_runs, layout)
    train = [r for r in rows if "loss" in r]
    assert_same_steps(train, [r for r in expected if "loss" in r])
    validation = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in validation] == [3, 6]
    for ours, ref in zip(validation, (r for r in expected if "val_loss" in r)):
        assert ours["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4)
