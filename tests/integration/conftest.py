"""Fixtures shared by the integration tests."""

import pytest

from tests.conftest import run_module
from tests.integration.parity import (
    COMMON,
    CONFIG,
    MANY_PROCESS_LAYOUTS,
    TINY_COMMON,
    TINY_CONFIG,
    read_rows,
    train_matrix,
)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Single process, local batch 8: what every layout of the debug model must reproduce."""
    out = tmp_path_factory.mktemp("single")
    result = run_module("torchtitan.train", "--job.config_file", CONFIG, *COMMON, "--training.local_batch_size", "8",
                        f"--job.dump_folder={out}")
    assert result.returncode == 0, result.stderr
    return read_rows(out)


@pytest.fixture(scope="session")
def many_process_runs(tmp_path_factory):
    """The 8- and 16-process layouts and their single-process reference (parity.MANY_PROCESS_LAYOUTS)."""
    return train_matrix(tmp_path_factory.mktemp("many"), MANY_PROCESS_LAYOUTS, config=TINY_CONFIG,
                        common=TINY_COMMON)
