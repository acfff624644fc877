"""Hugging Face round trip: our checkpoint -> HF folder -> transformers gives our logits, and back."""

import json

import pytest
import torch
import transformers

from tests.conftest import run_command, run_module, trainer_command
from torchtitan.components.checkpointing.hf_folder import read_safetensors
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec

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



# checkpoint.last_save_in_hf: the last step's model-only export is itself a Hugging Face folder.
EXPORT_FLAGS = ["--training.steps", "1", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                "--training.mixed_precision_param", "float32", "--comm.init_timeout_seconds", "600",
                "--comm.train_timeout_seconds", "600"]
QWEN3 = ("train_configs/qwen3_debug.toml", ["--training.seq_len", "128", "--training.local_batch_size", "2"])


def load_export_and_checkpoint(config: str, dump, overrides=()):
    """(export-step-1, the model loaded from it, the model loaded from the DCP step-1); checks that the
    export is a Hugging Face folder holding every weight of step-1, bit for bit."""
    export, step = dump / "checkpoint" / "export-step-1", dump / "checkpoint" / "step-1"
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert ".metadata" not in names  # not DCP
    from_export = load_model(config, str(export), overrides=overrides)  # refuses missing or unexpected weights
    from_dcp = load_model(config, str(step), overrides=overrides)
    ours, expected = from_export.state_dict(), from_dcp.state_dict()
    assert ours.keys() == expected.keys()
    for name in expected:
        assert torch.equal(ours[name], expected[name]), name
    return export, from_export, from_dcp


@pytest.mark.parametrize("config, flags", [(CONFIG, []), QWEN3], ids=["llama3_tiny", "qwen3_debug"])
def test_last_save_in_hf_exports_a_folder_transformers_loads_with_our_logits(tmp_path, config, flags):
    result = run_module("torchtitan.train", "--job.config_file", config, *EXPORT_FLAGS, *flags,
                        f"--job.dump_folder={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exported the model as a Hugging Face folder" in result.stdout + result.stderr
    export, from_export, from_dcp = load_export_and_checkpoint(config, tmp_path, flags)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    vocab = json.loads((export / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert (from_export(tokens) - expected).abs().max().item() <= 1e-4
        assert (from_dcp(tokens) - expected).abs().max().item() <= 1e-4
    # Trained weights, not the initialisation.
    fresh = load_model(config, overrides=flags)
    assert not torch.equal(fresh.layers["0"].attention.wq.weight, from_export.layers["0"].attention.wq.weight)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--training.local_batch_size", "2"],
                                   ["--parallelism.pipeline_parallel_degree", "2"]], ids=["fsdp2", "pp2"])
def test_last_save_in_hf_gathers_every_weight_from_parallel_layouts(tmp_path, flags):
    """FSDP shards every weight over both ranks; PP puts the last layers on rank 1: rank 0 writes them all."""
    result = run_command([*trainer_command(2), "--job.config_file", CONFIG, *EXPORT_FLAGS, *flags,
                          f"--job.dump_folder={tmp_path}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    export, from_export, _ = load_export_and_checkpoint(CONFIG, tmp_path)
    adapter = get_train_spec("llama3").state_dict_adapter(from_export.args)
    expected_names = set(adapter.to_hf(from_export.state_dict()))
    assert set(read_safetensors(export)) == expected_names and len(expected_names) == 21
