from pathlib import Path

import pytest

from tests.conftest import REPO, TOKENIZER
from tests.unit.test_plan_presets import intended_run
from torchtitan.config import load_config
from torchtitan.config_check import import_custom_modules, validate_config

PRESETS = sorted((REPO / "train_configs").glob("*.toml"))


def test_presets_exist():
    assert {"debug_model.toml", "tiny.toml", "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"} <= {
        p.name for p in PRESETS
    }


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_parses_and_validates(preset):
    cfg, sources = load_config(["--job.config_file", str(preset.relative_to(REPO))])
    import_custom_modules(cfg, sources)
    if not Path(cfg.model.hf_assets_path).exists():
        # Large presets point at a tokenizer the user downloads; check the rest with the shipped one.
        assert preset.name.startswith(("llama3_", "qwen3_moe_30b", "deepseek_v3_671b", "deepseek_v3_16b",
                                       "qwen3_next_80b", "gpt_oss_20b")), preset
        cfg.model.hf_assets_path = str(TOKENIZER)
    # At the world size it is written for (its degrees, expert parallelism among them, must fit it).
    validate_config(cfg, sources, world_size=intended_run(preset)[1])
