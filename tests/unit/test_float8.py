"""The float8 converter's settings that depend on the rest of the config."""

from types import SimpleNamespace

import pytest
import torch._inductor.config as inductor_config

from torchtitan.components.float8 import Float8Converter
from torchtitan.config.job_config import JobConfig


@pytest.mark.parametrize("recipe, compile_enabled, expected", [
    ("rowwise", True, True),
    ("rowwise", False, False),
    ("tensorwise", True, False),
    (None, True, False),
])
def test_rowwise_under_compile_emulates_precision_casts(recipe, compile_enabled, expected):
    cfg = JobConfig()
    cfg.quantize.linear.float8.recipe_name = recipe
    cfg.quantize.linear.float8.emulate = True
    cfg.compile.enable = compile_enabled
    with inductor_config.patch(emulate_precision_casts=False):  # restored after the test
        Float8Converter(cfg, SimpleNamespace(fsdp_enabled=False))
        assert inductor_config.emulate_precision_casts is expected
