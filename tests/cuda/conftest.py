"""The CUDA tier (``pytest -m cuda``): tests marked ``cuda`` run only where a CUDA GPU is present."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the CUDA tier); this machine has none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
