"""Fixtures shared by the integration tests."""

import pytest

from tests.conftest import run_module
from tests.integration.parity import COMMON, CONFIG, read_rows


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Single process, local batch 8: what every layout of the debug model must reproduce."""
    out = tmp_path_factory.mktemp("single")
    result = run_module("torchtitan.train", "--job.config_file", CONFIG, *COMMON, "--training.local_batch_size", "8",
                        f"--job.dump_folder={out}")
    assert result.returncode == 0, result.stderr
    return read_rows(out)
