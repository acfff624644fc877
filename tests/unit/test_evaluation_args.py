"""Argument checks of scripts/evaluate.py and scripts/generate.py: one-line errors, no model is trained."""

import pytest
import torch

from scripts import evaluate as evaluate_script
from scripts import generate as generate_script
from torchtitan.device_arg import parse_device

CONFIG = "train_configs/debug_model.toml"


def test_parse_device_accepts_cpu_and_names_the_flag_otherwise(monkeypatch):
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--device gpu is invalid; valid: cpu, cuda or cuda:N$"):
        parse_device("gpu")
    with pytest.raises(ValueError, match="--device meta is not supported"):
        parse_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda asks for CUDA, which this machine does not have"):
        parse_device("cuda")


@pytest.mark.parametrize("script", [evaluate_script, generate_script])
@pytest.mark.parametrize("device, message", [("gpu", "--device gpu is invalid"), ("cuda", "asks for CUDA")])
def test_scripts_reject_a_bad_device_in_one_line(script, device, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main(["--config", CONFIG, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("seq_len", ["4096", "0"])
def test_evaluate_rejects_a_validation_seq_len_the_model_cannot_take(seq_len, capsys):
    code = evaluate_script.main(["--config", CONFIG, "--device", "cpu", "--training.seq_len", "256",
                                 "--validation.seq_len", seq_len])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"validation.seq_len = {seq_len} is invalid; it must be in 1..256 (training.seq_len" in err
