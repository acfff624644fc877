"""LoRA adapters and PEFT: our export loads with peft.PeftModel on transformers' load of our base export with our
logits; an adapter peft made imports into ours with peft's logits; --merge_lora gives a plain model with them.

The tiny flavor's RoPE rotates adjacent pairs, so the q and k projections' rows (and their adapters' B) are
permuted on the way to Hugging Face: the comparisons cover that too.
"""

import json

import peft
import pytest
import torch
import transformers

from scripts import convert_to_hf
from tests.integration.test_training import make_trainer
from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.components.lora.peft_adapter import write_peft_adapter
from torchtitan.config import load_config
from torchtitan.inference import build_model, load_model
from torchtitan.models.shared.lora import adapter_settings, is_adapter_param, merge_adapters

CONFIG = "train_configs/tiny.toml"
TARGETS = "attention.*,feed_forward.*"
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokens(vocab: int = 2048) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(torch.seed() % 2**31))


def _hf(folder) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A Hugging Face folder of the tiny model at its seeded initialisation (seed 3, not the runs' 0)."""
    cfg, _ = load_config(["--job.config_file", CONFIG, "--debug.seed", "3"])
    model, spec = build_model(cfg)
    folder = tmp_path_factory.mktemp("base")
    tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
    write_hf_folder(folder, model.state_dict(), spec.state_dict_adapter(model.args), tokenizer,
                    cfg.model.hf_assets_path, "float32")
    return folder


def _lora_flags(base, *extra: str) -> list[str]:
    return ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", TARGETS,
            "--checkpoint.enable", "--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf",
            *extra]


def test_our_adapter_export_loads_in_peft_and_merges_with_our_logits(base, tmp_path):
    flags = _lora_flags(base, "--training.steps", "3", "--optimizer.lr", "1e-2", "--checkpoint.last_save_model_only",
                        "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32")
    trainer = make_trainer(tmp_path / "run", *flags)
    trainer.train()
    trainer.close()
    export = tmp_path / "run/checkpoint/export-step-3"
    config = json.loads((export / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, str(base))

    tokens = _tokens()
    ours = trainer.model_parts[0].eval()
    theirs = peft.PeftModel.from_pretrained(_hf(base), str(export)).eval()
    with torch.no_grad():
        expected = ours(tokens)
        assert (theirs(tokens).logits - expected).abs().max().item() <= 1e-4
        # The adapters matter: the base alone is far off.
        assert (_hf(base)(tokens).logits - expected).abs().max().item() > 1e-2

    # The same run's step checkpoint (adapters only) merged into a plain folder by the converter.
    toml = tmp_path / "lora.toml"
    toml.write_text(f'extends = "{(tmp_path.cwd() / CONFIG).as_posix()}"\n[model]\nconverters = ["lora"]\n'
                    f'[lora]\nrank = 4\nalpha = 8.0\ntargets = {json.dumps(TARGETS.split(","))}\n'
                    f'[checkpoint]\ninitial_load_path = "{base}"\ninitial_load_in_hf = true\n')
    merged = tmp_path / "merged"
    step = tmp_path / "run/checkpoint/step-3"
    assert convert_to_hf.main([str(step), str(merged), "--config", str(toml), "--merge_lora", "--dtype",
                               "float32"]) == 0
    with torch.no_grad():
        assert (_hf(merged)(tokens).logits - expected).abs().max().item() <= 1e-4
        # load_model tells the step checkpoint (adapters only) at a URL too.
        assert (load_model(str(toml), step.as_uri())(tokens) - expected).abs().max().item() <= 1e-5
    # And as a PEFT folder again, from the step checkpoint: the same tensors as the trainer's export.
    adapter = tmp_path / "adapter"
    assert convert_to_hf.main([str(step), str(adapter), "--config", str(toml), "--lora_adapter", "--dtype",
                               "float32"]) == 0
    from safetensors.torch import load_file
    exported, converted = (load_file(str(f / "adapter_model.safetensors")) for f in (export, adapter))
    assert exported.keys() == converted.keys() and all(torch.equal(exported[k], converted[k]) for k in exported)
    # A plain conversion of a LoRA checkpoint is refused, naming the two ways.
    assert convert_to_hf.main([str(step), str(tmp_path / "plain"), "--config", str(toml)]) == 2
    # Merging onto another base (a config without the run's initial_load_path: the seeded initialisation) is
    # refused by the checkpoint's base fingerprint, and nothing is written.
    no_base = tmp_path / "no_base.toml"
    no_base.write_text(toml.read_text().split("[checkpoint]")[0])
    assert convert_to_hf.main([str(step), str(tmp_path / "wrong"), "--config", str(no_base), "--merge_lora"]) == 2
    assert not (tmp_path / "wrong").exists()


def test_an_adapter_peft_made_imports_with_peft_logits_and_trains_on(base, tmp_path):
    torch.manual_seed(torch.seed() % 2**31)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=HF_TARGETS, init_lora_weights=False)
    made = peft.get_peft_model(_hf(base), config)  # init_lora_weights=False: B random too, so it shows
    made.save_pretrained(str(tmp_path / "peft"))
    tokens = _tokens()
    with torch.no_grad():
        expected = made.eval()(tokens).logits

    trainer = make_trainer(tmp_path / "run", *_lora_flags(base, "--lora.adapter_path", str(tmp_path / "peft"),
                                                          "--training.steps", "2"))
    model = trainer.model_parts[0]
    with torch.no_grad():
        assert (model.eval()(tokens) - expected).abs().max().item() <= 1e-4
    before = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_param(n)}
    model.train()
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if is_adapter_param(n))


def test_an_adapter_of_another_rank_or_other_layers_is_refused_in_one_line(base, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    peft.get_peft_model(_hf(base), config).save_pretrained(str(tmp_path / "peft"))
    from torchtitan.config import ConfigError
    with pytest.raises(ConfigError, match="r = 4, lora_alpha = 8, but this run has lora.rank = 8"):
        make_trainer(tmp_path / "a", *_lora_flags(base, "--lora.adapter_path", str(tmp_path / "peft"),
                                                  "--lora.rank", "8"))
    with pytest.raises(ConfigError, match="has no layers.0.attention.wk.lora_a.weight; set lora.targets"):
        make_trainer(tmp_path / "b", *_lora_flags(base, "--lora.adapter_path", str(tmp_path / "peft")))


def test_a_qlora_base_loads_from_a_hugging_face_folder_into_nf4(tmp_path):
    """lora.base_dtype = "nf4" with a Hugging Face base: each NF4 weight is exactly torchao's quantisation of the
    folder's weight (the load quantises the whole incoming tensor)."""
    from torchao.quantization import to_nf4

    from torchtitan.models.shared.nf4 import is_nf4

    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml", "--debug.seed", "5"])
    base, spec = build_model(cfg)
    write_hf_folder(tmp_path / "base", base.state_dict(), spec.state_dict_adapter(base.args),
                    spec.build_tokenizer_fn(cfg.model.hf_assets_path), cfg.model.hf_assets_path, "float32")
    trainer = make_trainer(tmp_path / "run", "--job.config_file", "train_configs/debug_model.toml",
                           *_lora_flags(tmp_path / "base", "--lora.base_dtype", "nf4"))
    expected = dict(base.named_parameters())
    nf4 = {name: p for name, p in trainer.model_parts[0].named_parameters() if is_nf4(p)}
    assert len(nf4) == 7 * len(base.layers)
    for name, p in nf4.items():
        reference = to_nf4(expected[name].detach().contiguous(), 64, 256).get_original_weight()
        assert torch.equal(p.get_original_weight(), reference), name


@pytest.mark.parametrize("broken, match", [
    ("missing", "a PEFT adapter folder holds adapter_config.json and adapter_model.safetensors"),
    ("config", "adapter_config.json is not valid JSON"),
    ("weights", "adapter_model.safetensors is not a complete safetensors file"),
])
def test_a_broken_adapter_folder_is_refused_in_one_line_and_left_alone(base, tmp_path, broken, match):
    from torchtitan.config import ConfigError

    folder = tmp_path / "peft"
    peft.get_peft_model(_hf(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=HF_TARGETS)).save_pretrained(
        str(folder))
    if broken == "missing":
        (folder / "adapter_model.safetensors").unlink()
    elif broken == "config":
        (folder / "adapter_config.json").write_text("{not json")
    else:
        (folder / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes()[:100])
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ConfigError, match=match) as error:
        make_trainer(tmp_path / "run", *_lora_flags(base, "--lora.adapter_path", str(folder)))
    assert "\n" not in str(error.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# ----- adapter_config.json fields: per-module ranks and scales, and what a plain import cannot compute -----

def _peft_adapter(base, folder, **config) -> peft.PeftModel:
    """A PEFT adapter on the tiny model, A and B both random (so every scale shows), saved to ``folder``; returned
    as PEFT loads it from there (the saved config's keys are sorted: the patterns' order is the file's)."""
    torch.manual_seed(torch.seed() % 2**31)
    config = {"r": 4, "lora_alpha": 8, "target_modules": HF_TARGETS, "init_lora_weights": False, **config}
    peft.get_peft_model(_hf(base), peft.LoraConfig(**config)).save_pretrained(str(folder))
    return peft.PeftModel.from_pretrained(_hf(base), str(folder)).eval()


def _imported(folder, *flags: str):
    """The tiny model at the base's seed with ``folder``'s adapter, as lora.adapter_path imports it."""
    cfg, _ = load_config(["--job.config_file", CONFIG, "--debug.seed", "3", "--model.converters", "lora",
                          "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", TARGETS,
                          "--lora.adapter_path", str(folder), *flags])
    return build_model(cfg)


@pytest.mark.parametrize("patterns", [
    {"alpha_pattern": {"q_proj": 32}},
    # The first key (in the file's order) that matches the end of a module's name after a dot wins: layers.1's
    # v_proj gets 2, the others 3; "proj" is no name's ending after a dot (it matches nothing); keys are regular
    # expressions (layer 0's down_proj: "down_proj" comes first).
    {"rank_pattern": {"proj": 7, "layers.1.self_attn.v_proj": 2, "v_proj": 3, "o_proj": 6},
     "alpha_pattern": {r"layers\.0\..*_proj": 3.5, "down_proj": 1}},
], ids=["alpha_pattern", "rank_and_alpha_patterns"])
def test_per_module_ranks_and_alphas_import_and_export_as_peft_computes_them(base, tmp_path, patterns):
    made = _peft_adapter(base, tmp_path / "peft", **patterns)
    model, spec = _imported(tmp_path / "peft")
    hf_adapter = spec.state_dict_adapter(model.args)
    ours = dict(model.named_modules())
    layers = [(n, m) for n, m in made.base_model.model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(layers) == 7 * len(model.layers)
    for name, layer in layers:
        mine = ours[hf_adapter.our_name(f"{name}.weight").removesuffix(".weight")]
        assert (mine.lora_a.out_features, mine.lora_scale) == (layer.r["default"], layer.scaling["default"]), name
    tokens = _tokens()
    with torch.no_grad():
        expected = made(tokens).logits
        assert (model(tokens) - expected).abs().max().item() <= 1e-4
    # Back out: a PEFT folder writing each module's rank and alpha, and the merged model.
    state = model.state_dict()
    write_peft_adapter(tmp_path / "out", state, hf_adapter, adapter_settings(model), "float32", str(base))
    write_hf_folder(tmp_path / "merged", merge_adapters(state, adapter_settings(model)), hf_adapter,
                    spec.build_tokenizer_fn("assets/tokenizer"), "assets/tokenizer", "float32")
    with torch.no_grad():
        assert (peft.PeftModel.from_pretrained(_hf(base), str(tmp_path / "out"))(tokens).logits
                - expected).abs().max().item() <= 1e-4
        assert (_hf(tmp_path / "merged")(tokens).logits - expected).abs().max().item() <= 1e-4


def test_a_run_on_per_module_ranks_exports_and_merges_them(base, tmp_path):
    """The trainer's export (PEFT folder) and convert_to_hf --merge_lora of its step checkpoint carry each
    module's rank and alpha."""
    _peft_adapter(base, tmp_path / "peft", rank_pattern={"layers.0.self_attn.q_proj": 2}, alpha_pattern={"o_proj": 2})
    flags = _lora_flags(base, "--lora.adapter_path", str(tmp_path / "peft"), "--training.steps", "1",
                        "--optimizer.lr", "1e-2", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf",
                        "--checkpoint.export_dtype", "float32")
    trainer = make_trainer(tmp_path / "run", *flags)
    trainer.train()
    trainer.close()
    export = tmp_path / "run/checkpoint/export-step-1"
    config = json.loads((export / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["rank_pattern"] == {r"model\.layers\.0\.self_attn\.q_proj": 2}
    assert config["alpha_pattern"] == {rf"model\.layers\.{i}\.self_attn\.o_proj": 2 for i in range(2)}
    tokens = _tokens()
    with torch.no_grad():
        expected = trainer.model_parts[0].eval()(tokens)
        theirs = peft.PeftModel.from_pretrained(_hf(base), str(export)).eval()
        assert (theirs(tokens).logits - expected).abs().max().item() <= 1e-4
    toml = tmp_path / "lora.toml"
    toml.write_text(f'extends = "{(tmp_path.cwd() / CONFIG).as_posix()}"\n[model]\nconverters = ["lora"]\n'
                    f'[lora]\nrank = 4\nalpha = 8.0\ntargets = {json.dumps(TARGETS.split(","))}\n'
                    f'adapter_path = "{tmp_path / "peft"}"\n'
                    f'[checkpoint]\ninitial_load_path = "{base}"\ninitial_load_in_hf = true\n')
    assert convert_to_hf.main([str(tmp_path / "run/checkpoint/step-1"), str(tmp_path / "merged"), "--config",
                               str(toml), "--merge_lora", "--dtype", "float32"]) == 0
    with torch.no_grad():
        assert (_hf(tmp_path / "merged")(tokens).logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("field, value", [
    ("bias", "all"), ("lora_bias", True), ("modules_to_save", ["lm_head"]), ("init_lora_weights", "pissa"),
    ("alora_invocation_tokens", [5, 6]), ("layer_replication", [[0, 2]]), ("trainable_token_indices", [3]),
    ("a_field_of_a_later_peft", {"on": True}),
])
def test_a_field_that_changes_the_computation_is_refused_naming_it(base, tmp_path, field, value):
    from torchtitan.config import ConfigError

    _peft_adapter(base, tmp_path / "peft")
    config_file = tmp_path / "peft/adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), field: value}))
    with pytest.raises(ConfigError, match=f"adapter_config.json: {field} = ") as error:
        _imported(tmp_path / "peft")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("target_modules, exclude, first", [
    (["q_proj"], None, "does not adapt model.layers.0.self_attn.k_proj"),  # PEFT would drop k, v, o, ...
    (r".*\.layers\.0\..*", None, "does not adapt model.layers.1.self_attn.k_proj"),  # a regex: the whole name
    (HF_TARGETS, ["layers.1.self_attn.q_proj"], "does not adapt model.layers.1.self_attn.q_proj"),
], ids=["list", "regex", "exclude_modules"])
def test_target_modules_that_disagree_with_the_tensors_are_refused(base, tmp_path, target_modules, exclude, first):
    """PEFT adapts the modules target_modules names (less exclude_modules) and drops the file's other tensors."""
    from torchtitan.config import ConfigError

    _peft_adapter(base, tmp_path / "peft")
    config_file = tmp_path / "peft/adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "target_modules": target_modules,
                                       "exclude_modules": exclude}))
    with pytest.raises(ConfigError, match=f"target_modules = .* {first}, which adapter_model.safetensors holds"):
        _imported(tmp_path / "peft")


@pytest.mark.parametrize("bad, tensor", [(float("nan"), "lora_A"), (float("inf"), "lora_B")])
def test_an_adapter_holding_nan_or_inf_is_refused_naming_the_file_and_tensor(base, tmp_path, bad, tensor):
    from safetensors.torch import load_file, save_file

    from torchtitan.config import ConfigError

    _peft_adapter(base, tmp_path / "peft")
    weights = tmp_path / "peft/adapter_model.safetensors"
    state = load_file(str(weights))
    name = sorted(k for k in state if f".{tensor}." in k)[3]
    state[name][1, 2] = bad
    save_file(state, str(weights))
    with pytest.raises(ConfigError, match=rf"{weights}: tensor {name} holds 1 non-finite values"):
        _imported(tmp_path / "peft")


@pytest.mark.parametrize("layers", [{"layers_to_transform": [1]},
                                    {"layers_to_transform": 0, "layers_pattern": "layers"}], ids=["list", "pattern"])
def test_an_adapter_on_some_blocks_only_is_refused_naming_layers_to_transform(base, tmp_path, layers):
    """PEFT's own file (the tensors of the blocks named) passes the target check; lora.targets adapts every block."""
    from torchtitan.config import ConfigError

    _peft_adapter(base, tmp_path / "peft", **layers)
    with pytest.raises(ConfigError, match="has no layers.*; set lora.targets .* layers_to_transform, does not import"):
        _imported(tmp_path / "peft")


def test_a_run_training_its_base_converts_merged_but_not_as_an_adapter(base, tmp_path, capsys):
    """lora.train_base: the step checkpoint is a full one; a PEFT folder would drop the trained base."""
    trainer = make_trainer(tmp_path / "run", *_lora_flags(base, "--lora.train_base", "--training.steps", "1",
                                                          "--optimizer.lr", "1e-2"))
    trainer.train()
    trainer.close()
    toml = tmp_path / "lora.toml"
    toml.write_text(f'extends = "{(tmp_path.cwd() / CONFIG).as_posix()}"\n[model]\nconverters = ["lora"]\n'
                    f'[lora]\nrank = 4\nalpha = 8.0\ntrain_base = true\ntargets = {json.dumps(TARGETS.split(","))}\n'
                    f'[checkpoint]\ninitial_load_path = "{base}"\ninitial_load_in_hf = true\n')
    step = str(tmp_path / "run/checkpoint/step-1")
    assert convert_to_hf.main([step, str(tmp_path / "adapter"), "--config", str(toml), "--lora_adapter"]) == 2
    assert "trains the base weights too (lora.train_base)" in capsys.readouterr().err
    assert not (tmp_path / "adapter").exists()
    assert convert_to_hf.main([step, str(tmp_path / "merged"), "--config", str(toml), "--merge_lora", "--dtype",
                               "float32"]) == 0
    tokens = _tokens()
    with torch.no_grad():
        assert (_hf(tmp_path / "merged")(tokens).logits - trainer.model_parts[0].eval()(tokens)).abs().max() <= 1e-4


@pytest.mark.slow
def test_a_pipelined_run_exports_the_rank_and_alpha_of_every_stage(base, tmp_path):
    """PP 2: layer 1's adapters live on rank 1 only; rank 0 writes their own rank and alpha into the export."""
    from tests.conftest import run_command, trainer_command

    _peft_adapter(base, tmp_path / "peft", rank_pattern={"layers.1.self_attn.q_proj": 2},
                  alpha_pattern={"layers.1.mlp.down_proj": 3})
    flags = _lora_flags(base, "--lora.adapter_path", str(tmp_path / "peft"), "--training.steps", "1",
                        "--optimizer.lr", "1e-2", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf",
                        "--checkpoint.export_dtype", "float32", "--parallelism.pipeline_parallel_degree", "2",
                        "--training.mixed_precision_param", "float32", "--comm.init_timeout_seconds", "600",
                        "--comm.train_timeout_seconds", "600")
    result = run_command([*trainer_command(2), "--job.config_file", CONFIG, *flags, f"--job.dump_folder={tmp_path}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    export = tmp_path / "checkpoint/export-step-1"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {r"model\.layers\.1\.self_attn\.q_proj": 2}
    assert config["alpha_pattern"] == {r"model\.layers\.1\.mlp\.down_proj": 3}
    toml = tmp_path / "lora.toml"
    toml.write_text(f'extends = "{(tmp_path.cwd() / CONFIG).as_posix()}"\n[model]\nconverters = ["lora"]\n'
                    f'[lora]\nrank = 4\nalpha = 8.0\ntargets = {json.dumps(TARGETS.split(","))}\n'
                    f'adapter_path = "{tmp_path / "peft"}"\n'
                    f'[checkpoint]\ninitial_load_path = "{base}"\ninitial_load_in_hf = true\n')
    tokens = _tokens()
    with torch.no_grad():
        expected = load_model(str(toml), str(tmp_path / "checkpoint/step-1"))(tokens)
        theirs = peft.PeftModel.from_pretrained(_hf(base), str(export)).eval()
        assert (theirs(tokens).logits - expected).abs().max().item() <= 1e-4
