"""A LoRA run's step checkpoint on a MoE family: besides its adapters it holds what the run trains outside the
frozen base (the routing bias of auxiliary-loss-free balancing), and is still told from a full checkpoint by the
base weights it leaves out. torchtitan.load_model gives the trained model's logits, scripts/convert_to_hf.py
--merge_lora a Hugging Face folder transformers computes them with, and --lora_adapter a PEFT folder peft does
(or, where the run trained the routing bias, which a PEFT adapter cannot carry, a one-line refusal)."""

import json

import peft
import pytest
import torch
import transformers

from scripts import convert_to_hf
from tests.integration.test_training import make_trainer
from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.components.checkpointing.storage import verify_checkpoint
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.inference import build_model, load_model

# (config, flags): DeepSeek-V3 trains its routing bias (its Hugging Face format has one); Qwen3-MoE, whose format
# has none, keeps it at zero. Multi-token prediction is left out: the base folder holds the main blocks only.
CASES = [("train_configs/deepseek_v3_debug.toml", ["--model.mtp_depth", "0", "--moe.bias_update_rate", "0.01"]),
         ("train_configs/qwen3_moe_debug.toml", ["--moe.bias_update_rate", "0"])]
TARGETS = "attention.*"


def _hf(folder) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("config, flags", CASES, ids=["deepseek_v3_bias_trained", "qwen3_moe_bias_off"])
def test_a_moe_lora_step_checkpoint_loads_and_converts_as_the_trained_model(tmp_path, capsys, config, flags):
    base = tmp_path / "base"
    cfg, _ = load_config(["--job.config_file", config, "--debug.seed", "3", *flags])
    model, spec = build_model(cfg)
    write_hf_folder(base, model.state_dict(), spec.state_dict_adapter(model.args),
                    spec.build_tokenizer_fn(cfg.model.hf_assets_path), cfg.model.hf_assets_path, "float32")
    trainer = make_trainer(tmp_path / "run", "--job.config_file", config, *flags, "--training.seq_len", "32",
                           "--training.local_batch_size", "2", "--training.steps", "1", "--optimizer.lr", "1e-2",
                           "--model.converters", "lora", "--lora.targets", TARGETS, "--checkpoint.enable",
                           "--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf")
    trainer.train()
    trainer.close()
    trained = trainer.model_parts[0].eval()
    step = tmp_path / "run/checkpoint/step-1"
    saved = verify_checkpoint(str(step)).state_dict_metadata
    assert any(name.endswith(".moe.expert_bias") for name in saved)  # beside the adapters
    rate = float(flags[flags.index("--moe.bias_update_rate") + 1])
    biases = {n: b for n, b in trained.named_buffers() if n.endswith("expert_bias")}
    assert all(b.abs().max().item() > 0 for b in biases.values()) == (rate > 0)

    toml = tmp_path / "lora.toml"
    overrides = dict(zip(flags[::2], flags[1::2]))
    mtp = f'mtp_depth = {overrides["--model.mtp_depth"]}\n' if "--model.mtp_depth" in overrides else ""
    toml.write_text(f'extends = "{(tmp_path.cwd() / config).as_posix()}"\n[model]\nconverters = ["lora"]\n{mtp}'
                    f'[lora]\ntargets = {json.dumps([TARGETS])}\n'
                    f'[moe]\nbias_update_rate = {rate}\n'
                    f'[checkpoint]\ninitial_load_path = "{base}"\ninitial_load_in_hf = true\n')
    loaded = load_model(str(toml), str(step))
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    with torch.no_grad():
        expected = trained(tokens)
        assert (loaded(tokens) - expected).abs().max().item() <= 1e-5
        # The same checkpoint at a URL.
        assert torch.equal(load_model(str(toml), step.as_uri())(tokens), loaded(tokens))
        # The adapters matter: the base alone is far off.
        assert (_hf(base)(tokens).logits - expected).abs().max().item() > 1e-2
    for name, bias in biases.items():
        assert torch.equal(loaded.get_buffer(name), bias), name

    merged = tmp_path / "merged"
    assert convert_to_hf.main([str(step), str(merged), "--config", str(toml), "--merge_lora", "--dtype",
                               "float32"]) == 0
    with torch.no_grad():
        assert (_hf(merged)(tokens).logits - expected).abs().max().item() <= 1e-4
    adapter = tmp_path / "adapter"
    code = convert_to_hf.main([str(step), str(adapter), "--config", str(toml), "--lora_adapter", "--dtype", "float32"])
    if rate > 0:  # the trained routing bias would be lost: refused, nothing written
        assert code == 2 and not adapter.exists()
        assert "trains the MoE routing bias too (moe.bias_update_rate > 0)" in capsys.readouterr().err
        return
    assert code == 0
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(_hf(base), str(adapter)).eval()
        assert (theirs(tokens).logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("config", [config for config, _ in CASES], ids=["deepseek_v3", "qwen3_moe"])
def test_a_peft_export_of_a_run_training_the_routing_bias_is_refused_before_training(config):
    """checkpoint.last_save_in_hf writes a frozen-base LoRA run's adapters alone, without the routing bias."""
    flags = ["--job.config_file", config, "--model.converters", "lora", "--checkpoint.enable",
             "--checkpoint.last_save_in_hf"]
    cfg, sources = load_config([*flags, "--moe.bias_update_rate", "0.001"])
    with pytest.raises(ConfigError, match=r"last_save_in_hf = True would write this LoRA run's adapters as a PEFT "
                                          r"adapter folder, which cannot carry the routing bias moe.bias_update_rate"):
        validate_config(cfg, sources, world_size=1)
    # The bias stays the base's; or the export is the merged model (Qwen3-MoE's format then drops the bias).
    for ok in (["--moe.bias_update_rate", "0"],
               ["--moe.bias_update_rate", "0.001", "--lora.train_base", "--checkpoint.hf_drop_expert_bias"]):
        cfg, sources = load_config([*flags, *ok])
        validate_config(cfg, sources, world_size=1)
