"""experimental.custom_import is read by every entry point that builds a model from a config, not only the trainer:
torchtitan.load_model, scripts/convert_to_hf.py, scripts/convert_from_hf.py (and generate/evaluate through
load_model). A flavor or a family registered from outside the package converts and loads as a built-in one; a name
nobody registered is a one-line error naming model.flavor or model.name and what is registered."""

import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scripts import convert_from_hf, convert_to_hf
from tests.bad_input import assert_one_line_error, run_entry_point, snapshot
from torchtitan.components.checkpointing.states import ModelState
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.inference import build_model, load_model
from torchtitan.models.llama3.args import llama3_flavors

FLAVOR_MODULE = '''from torchtitan.models.llama3.args import Llama3ModelArgs, llama3_flavors

llama3_flavors["outside"] = Llama3ModelArgs(dim=48, n_layers=2, n_heads=6, n_kv_heads=3, multiple_of=16)
'''


def config_text(custom_import: str = "outside_flavor", name: str = "llama3", flavor: str = "outside") -> str:
    return (f'[experimental]\ncustom_import = "{custom_import}"\n\n[model]\nname = "{name}"\nflavor = "{flavor}"\n'
            'hf_assets_path = "assets/tokenizer"\n\n[training]\nseq_len = 32\n')


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """A config whose flavor a module outside the package registers (as scripts/generate_config.py writes one)."""
    (tmp_path / "outside_flavor.py").write_text(FLAVOR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "outside.toml"
    config.write_text(config_text())
    yield config
    llama3_flavors.pop("outside", None)
    sys.modules.pop("outside_flavor", None)


def test_a_flavor_registered_outside_converts_both_ways_and_loads(tmp_path, outside):
    cfg = load_model_config(outside)
    model, _ = build_model(cfg)
    assert model.args.dim == 48 and len(model.layers) == 2
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    code, text = run_entry_point(convert_to_hf.main, [str(tmp_path / "step-1"), str(tmp_path / "hf"),
                                                      "--config", str(outside)])
    assert code == 0, text
    code, text = run_entry_point(convert_from_hf.main, [str(tmp_path / "hf"), str(tmp_path / "back"),
                                                        "--config", str(outside)])
    assert code == 0, text
    tokens = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        expected = model.eval()(tokens)
        for checkpoint in ("hf", "back", "step-1"):
            assert torch.equal(load_model(str(outside), str(tmp_path / checkpoint))(tokens), expected), checkpoint


def test_a_family_registered_outside_loads_and_is_refused_by_the_converters_for_having_no_hf_names(tmp_path):
    config = tmp_path / "toy.toml"
    config.write_text('[experimental]\ncustom_import = "tests.unit.third_family"\n\n[model]\nname = "toy_decoder"\n'
                      'flavor = "small"\nhf_assets_path = "assets/tokenizer"\n\n[training]\nseq_len = 32\n')
    model = load_model(str(config))
    assert model.args.dim == 96
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    before = snapshot(tmp_path)
    assert_one_line_error(convert_to_hf.main, [str(tmp_path / "step-1"), str(tmp_path / "hf"), "--config",
                                               str(config)],
                          "model 'toy_decoder' has no Hugging Face state-dict adapter", unchanged=before)


@pytest.mark.parametrize(("bad", "needle"), [
    ({"flavor": "nope"}, "model.flavor = 'nope' is not a flavor of 'llama3'; valid: "),
    ({"name": "nope"}, "model.name = 'nope' is unknown: "),
    ({"custom_import": "no_such_module"}, "experimental.custom_import = 'no_such_module' failed to import: "
                                          "ModuleNotFoundError"),
])
def test_names_nobody_registered_are_one_line_errors_in_every_entry_point(tmp_path, outside, bad, needle):
    model, _ = build_model(load_model_config(outside))
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    hf = tmp_path / "hf"
    assert run_entry_point(convert_to_hf.main, [str(tmp_path / "step-1"), str(hf), "--config", str(outside)])[0] == 0
    config = tmp_path / "bad.toml"
    config.write_text(config_text(**bad))
    before = snapshot(tmp_path)
    assert_one_line_error(convert_to_hf.main, [str(tmp_path / "step-1"), str(tmp_path / "out1"), "--config",
                                               str(config)], needle, unchanged=before)
    assert_one_line_error(convert_from_hf.main, [str(hf), str(tmp_path / "out2"), "--config", str(config)], needle,
                          unchanged=before)
    with pytest.raises(ConfigError) as error:
        load_model(str(config), str(hf))
    assert needle in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
