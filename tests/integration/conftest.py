"""Fixtures shared by the integration tests."""

import importlib

import pytest

from tests.integration.parity import MANY_PROCESS_LAYOUTS, TINY_COMMON, TINY_CONFIG, rows_of, train_matrix

# The modules whose debug-model layouts run together; each has debug_layouts(folder) -> {name: (nproc, flags)}.
DEBUG_LAYOUT_MODULES = ("test_distributed", "test_pipeline", "test_context_parallel_training",
                        "test_document_masking_training", "test_chunked_loss_training", "test_objective_training")


@pytest.fixture(scope="session")
def debug_folder(tmp_path_factory):
    """Where the debug_runs layouts write: {debug_folder}/{layout}/ is each layout's job.dump_folder."""
    return tmp_path_factory.mktemp("debug_layouts")


@pytest.fixture(scope="session")
def debug_runs(debug_folder):
    """Every debug-model layout of the parity modules and the single-process reference, run with one launch
    per process count for the whole suite (parity.COMMON flags)."""
    folder = debug_folder
    layouts = {"reference": (1, ["--training.local_batch_size", "8"])}
    for name in DEBUG_LAYOUT_MODULES:
        module = importlib.import_module(f"tests.integration.{name}")
        for layout, spec in module.debug_layouts(folder).items():
            assert layout not in layouts, f"{name} repeats the layout name {layout!r}"
            layouts[layout] = spec
    return train_matrix(folder, layouts)


@pytest.fixture(scope="session")
def reference(debug_runs):
    """Single process, local batch 8: what every layout of the debug model must reproduce."""
    return rows_of(debug_runs, "reference")


@pytest.fixture(scope="session")
def many_process_runs(tmp_path_factory):
    """The 8- and 16-process layouts and their single-process reference (parity.MANY_PROCESS_LAYOUTS)."""
    return train_matrix(tmp_path_factory.mktemp("many"), MANY_PROCESS_LAYOUTS, config=TINY_CONFIG,
                        common=TINY_COMMON)
