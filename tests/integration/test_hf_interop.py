"""Hugging Face round trip: our checkpoint -> HF folder -> transformers gives our logits, and back."""

import json

import pytest
import torch
import transformers

from tests.conftest import run_module
from torchtitan.inference import load_model, read_safetensors

CONFIG = "train_configs/tiny.toml"  # grouped-query attention: exercises the k-projection permutation too


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dump = tmp_path_factory.mktemp("run")
    result = run_module("torchtitan.train", "--job.config_file", CONFIG, "--training.steps", "3", "--checkpoint.enable",
                        "--training.mixed_precision_param", "float32", f"--job.dump_folder={dump}")
    assert result.returncode == 0, result.stderr
    step = dump / "checkpoint" / "step-3"
    hf = dump / "hf"
    converted = run_module("scripts.convert_to_hf", str(step), str(hf), "--config", CONFIG)
    assert converted.returncode == 0, converted.stderr
    return step, hf, dump


def test_transformers_logits_equal_ours(trained):
    step, hf, _ = trained
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf.iterdir()}
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    ours = load_model(CONFIG, str(step))
    from_hf_folder = load_model(CONFIG, str(hf))
    reference = transformers.LlamaForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(tokens).logits
        assert (ours(tokens) - expected).abs().max().item() <= 1e-4
        assert (from_hf_folder(tokens) - expected).abs().max().item() <= 1e-4
    # Trained weights, not the initialisation: step 3 differs from a fresh model.
    fresh = load_model(CONFIG)
    assert not torch.equal(fresh.layers["0"].attention.wq.weight, ours.layers["0"].attention.wq.weight)


def test_tokenizer_loads_in_transformers_with_the_same_ids(trained):
    _, hf, _ = trained
    from torchtitan.data import build_tokenizer

    ours = build_tokenizer("assets/tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf))
    text = "def add(a, b):\n    return a + b  # naïve café"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)


def test_convert_from_hf_gives_back_the_same_tensors_and_trains_from_hf(trained, tmp_path):
    step, hf, dump = trained
    back = tmp_path / "back"
    result = run_module("scripts.convert_from_hf", str(hf), str(back), "--config", CONFIG)
    assert result.returncode == 0, result.stderr
    original = load_model(CONFIG, str(step)).state_dict()
    restored = load_model(CONFIG, str(back)).state_dict()
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    # Training started from the HF folder and from the converted DCP folder begins at the same loss.
    first_losses = []
    for extra in (["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"],
                  ["--checkpoint.initial_load_path", str(back)]):
        out = tmp_path / f"run{len(first_losses)}"
        run = run_module("torchtitan.train", "--job.config_file", CONFIG, "--training.steps", "1",
                         "--checkpoint.enable", "--training.mixed_precision_param", "float32",
                         f"--job.dump_folder={out}", *extra)
        assert run.returncode == 0, run.stderr
        first_losses.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"])
    assert first_losses[0] == pytest.approx(first_losses[1], rel=1e-6)
    hf_tensors = read_safetensors(hf)
    assert "model.layers.0.self_attn.k_proj.weight" in hf_tensors and "lm_head.weight" in hf_tensors
