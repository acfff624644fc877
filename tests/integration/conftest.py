"""Fixtures shared by the integration tests: the suite-wide matrix of training runs."""

import importlib

import pytest

from tests.generation_checks import SAVE_LAST_STEP
from tests.integration.parity import (
    DEBUG_LAYOUT_MODULES,
    MANY_PROCESS_LAYOUTS,
    OTHER_MATRIX_MODULES,
    TINY_COMMON,
    TINY_CONFIG,
    Matrix,
    rows_of,
    train_matrices,
    train_matrix,
)


@pytest.fixture(scope="session")
def debug_folder(tmp_path_factory):
    """Where the suite's matrix writes: {debug_folder}/{layout}/ is each layout's job.dump_folder."""
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="session")
def suite_runs(request, debug_folder):
    """Every matrix layout of the modules this session collected, with one launch per process count for the
    whole suite (the launches' start-up is the cost of a short run): the debug-model layouts and their
    single-process reference (parity.COMMON flags), and the other modules' matrices."""
    collected = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items if item.module}
    folder = debug_folder
    # The reference saves its last step, which the generation engine is checked on (test_distributed.py).
    debug = {"reference": (1, ["--training.local_batch_size", "8", *SAVE_LAST_STEP])}
    for name in DEBUG_LAYOUT_MODULES:
        if name in collected:
            module = importlib.import_module(f"tests.integration.{name}")
            for layout, spec in module.debug_layouts(folder).items():
                assert layout not in debug, f"{name} repeats the layout name {layout!r}"
                debug[layout] = spec
    matrices = {"": Matrix(debug)} if len(debug) > 1 else {}
    for name in OTHER_MATRIX_MODULES:
        if name in collected:
            for prefix, matrix in importlib.import_module(f"tests.integration.{name}").suite_matrices(folder).items():
                assert prefix and prefix not in matrices, f"{name}: matrix prefix {prefix!r} is empty or taken"
                matrices[prefix] = matrix
    return folder, train_matrices(folder, matrices)


@pytest.fixture(scope="session")
def debug_runs(suite_runs):
    return suite_runs[1]


@pytest.fixture(scope="session")
def reference(debug_runs):
    """Single process, local batch 8: what every layout of the debug model must reproduce."""
    return rows_of(debug_runs, "reference")


@pytest.fixture(scope="session")
def many_process_runs(tmp_path_factory):
    """The 8- and 16-process layouts and their single-process reference (parity.MANY_PROCESS_LAYOUTS)."""
    return train_matrix(tmp_path_factory.mktemp("many"), MANY_PROCESS_LAYOUTS, config=TINY_CONFIG,
                        common=TINY_COMMON)
