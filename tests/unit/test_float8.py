"""The float8 converter's settings that depend on the rest of the config."""

import logging
import re
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


def converter_with(monkeypatch, device: str = "cpu", **fields) -> tuple[Float8Converter, list[str]]:
    """A float8 converter built for ``device`` with the given quantize.linear.float8 fields, and its emulate line(s)."""
    import torchtitan.components.float8 as float8_module
    from torchtitan.log import logger

    monkeypatch.setattr(float8_module, "device_type", lambda: device)
    cfg = JobConfig()
    for name, value in fields.items():
        setattr(cfg.quantize.linear.float8, name, value)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        converter = Float8Converter(cfg, SimpleNamespace(fsdp_enabled=False))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return converter, [r.getMessage() for r in records if r.getMessage().startswith("float8: emulate")]


def test_on_a_cpu_float8_emulates_by_default_and_says_so_in_one_line(monkeypatch):
    """torch._scaled_mm has no fast CPU kernel (a debug step took 164-177 s instead of 0.10 s): auto emulates."""
    converter, lines = converter_with(monkeypatch)
    assert converter.cfg.emulate == "auto" and converter.config.emulate is True
    assert len(lines) == 1 and lines[0].startswith("float8: emulate = true (auto: this CPU (") and \
        "has no fast float8 matmul" in lines[0]


@pytest.mark.parametrize("emulate, recipe", [(False, None), (False, "rowwise"), (True, None), (True, "tensorwise")])
def test_an_explicit_emulate_is_kept_on_a_cpu(emulate, recipe, monkeypatch):
    converter, lines = converter_with(monkeypatch, emulate=emulate, recipe_name=recipe)
    assert converter.config.emulate is emulate
    assert len(lines) == 1
    # Real float8 matmuls on a CPU are asked for, but the log says what they cost.
    assert ("thousands of times slower" in lines[0]) is (not emulate)


@pytest.mark.parametrize("props, hip, fast", [
    (SimpleNamespace(name="NVIDIA H100", major=9, minor=0), None, True),
    (SimpleNamespace(name="NVIDIA L4", major=8, minor=9), None, True),
    (SimpleNamespace(name="NVIDIA A100", major=8, minor=0), None, False),
    (SimpleNamespace(name="AMD Instinct MI300X", major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-"), "6.2", True),
    (SimpleNamespace(name="AMD Instinct MI250X", major=9, minor=0, gcnArchName="gfx90a:sramecc+:xnack-"), "6.2", False),
])
def test_auto_emulates_on_gpus_without_float8_matmuls(props, hip, fast, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", hip)
    converter, lines = converter_with(monkeypatch, device="cuda")
    assert converter.config.emulate is not fast
    assert len(lines) == 1 and props.name in lines[0]


@pytest.mark.parametrize("value, error", [
    ("maybe", "quantize.linear.float8.emulate = 'maybe' is invalid; expected one of auto|true|false"),
    ("2", "quantize.linear.float8.emulate = '2' is invalid; expected one of auto|true|false"),
])
def test_a_bad_emulate_is_one_line(value, error):
    from torchtitan.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(error)):
        load_config(["--quantize.linear.float8.emulate", value])


@pytest.mark.parametrize("argv, toml, expected", [
    (["--quantize.linear.float8.emulate"], "", True),  # the bare flag of the boolean it was
    (["--quantize.linear.float8.no_emulate"], "", False),
    (["--quantize.linear.float8.emulate", "false"], "", False),
    (["--quantize.linear.float8.emulate", "auto"], "", "auto"),
    ([], "emulate = true", True),
    ([], 'emulate = "auto"', "auto"),
    ([], "emulate = false", False),
])
def test_emulate_reads_auto_true_and_false(argv, toml, expected, tmp_path):
    from torchtitan.config import load_config

    config = tmp_path / "c.toml"
    config.write_text(f"[quantize.linear.float8]\n{toml}\n")
    cfg, _ = load_config(["--job.config_file", str(config), *argv])
    assert cfg.quantize.linear.float8.emulate == expected and type(cfg.quantize.linear.float8.emulate) is type(expected)


def test_a_toml_number_is_not_true(tmp_path):
    from torchtitan.config import ConfigError, load_config

    config = tmp_path / "c.toml"
    config.write_text("[quantize.linear.float8]\nemulate = 1\n")
    with pytest.raises(ConfigError, match="emulate = 1 is invalid; expected one of auto|true|false"):
        load_config(["--job.config_file", str(config)])
    with pytest.raises(ValueError, match="quantize.linear.float8.emulate = 'yes' is invalid; valid: auto, true, false"):
        from torchtitan.components.float8 import resolve_emulate

        resolve_emulate("yes", False, "this CPU")
