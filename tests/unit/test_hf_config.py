"""A Hugging Face folder is read as the model its config.json describes: a config.json that computes otherwise than
model.flavor (rope theta, sliding window, rotary share, YaRN ...) is refused by every reader in one line naming each
key with both values, and ``model.flavor = "hf:<folder>"`` builds the family's model at the folder's own dimensions,
which gives transformers' logits."""

import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from scripts import convert_from_hf, convert_to_hf
from tests.bad_input import assert_one_line_error, snapshot
from tests.unit.test_bad_checkpoint_inputs import hf_folder
from torchtitan import train
from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.config import ConfigError
from torchtitan.inference import load_model
from torchtitan.protocols import count_params
from torchtitan.protocols.train_spec import get_train_spec

LLAMA, GPT_OSS, QWEN3_NEXT = "train_configs/tiny.toml", "train_configs/gpt_oss_debug.toml", \
    "train_configs/qwen3_next_debug.toml"
TOMLS = {"llama3": LLAMA, "qwen3": "train_configs/qwen3_debug.toml", "qwen3_moe": "train_configs/qwen3_moe_debug.toml",
         "deepseek_v3": "train_configs/deepseek_v3_debug.toml", "qwen3_next": QWEN3_NEXT, "gpt_oss": GPT_OSS}
SHORT = ["--training.seq_len", "96"]
RELEASED = Path(__file__).parents[1] / "data" / "hf_configs"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """Our own exports of the debug flavors: config.json exactly as the flavor writes it."""
    return {toml: hf_folder(toml, tmp_path_factory.mktemp(Path(toml).stem)) for toml in (LLAMA, GPT_OSS, QWEN3_NEXT)}


def with_config(source: Path, target: Path, edit) -> Path:
    """A copy of the folder ``source`` whose config.json ``edit(config)`` changed in place."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def _yarn(config: dict) -> None:
    yarn = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64}
    config.update(rope_parameters=yarn, rope_scaling=yarn)


# (toml, edit of config.json, what the one error line must say): a value of its own in each layout transformers
# writes, a key left out that transformers then reads at its default, and several keys at once.
MISMATCHES = {
    "llama rope_theta, transformers 4 layout": (
        LLAMA, lambda c: c.update(rope_theta=500_000.0),
        ["rope_theta: config.json has 500000.0, model.flavor has 10000.0"]),
    "llama rope_theta, transformers 5 layout": (
        LLAMA, lambda c: [c.pop("rope_theta"), c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6})],
        ["rope_theta: config.json has 1000000.0, model.flavor has 10000.0"]),
    "llama theta, eps and scaling together": (
        LLAMA, lambda c: c.update(rope_theta=500_000.0, rms_norm_eps=1e-6, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        ['rms_norm_eps: config.json has 1e-06, model.flavor has 1e-05', "rope_theta: config.json has 500000.0",
         'rope_type: config.json has "llama3", model.flavor has "default"']),
    "gpt-oss sliding window": (
        GPT_OSS, lambda c: c.update(sliding_window=64), ["sliding_window: config.json has 64, model.flavor has 16"]),
    "gpt-oss window left out (transformers' 128)": (
        GPT_OSS, lambda c: c.pop("sliding_window"), ["sliding_window: config.json has 128, model.flavor has 16"]),
    "gpt-oss YaRN": (GPT_OSS, _yarn, ['rope_type: config.json has "yarn", model.flavor has "default"']),
    "qwen3-next rotary share": (
        QWEN3_NEXT, lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
        ["partial_rotary_factor: config.json has 0.5, model.flavor has 0.25"]),
    "qwen3-next layer pattern": (
        QWEN3_NEXT, lambda c: c.update(layer_types=["linear_attention", "full_attention"] * 2),
        ['layer_types[1]: config.json has "full_attention", model.flavor has "linear_attention"']),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_a_config_json_of_another_model_is_refused_by_load_model_and_convert_from_hf(tmp_path, exported, case):
    toml, edit, needles = MISMATCHES[case]
    folder = with_config(exported[toml], tmp_path / "hf", edit)
    with pytest.raises(CheckpointError) as error:
        load_model(toml, str(folder), overrides=SHORT)
    line = str(error.value)
    assert "\n" not in line and line.startswith(f"{folder / 'config.json'} describes another model")
    for needle in [*needles, f'or to "hf:{folder}" to build the model']:
        assert needle in line
    before = snapshot(tmp_path)
    assert_one_line_error(convert_from_hf.main, [str(folder), str(tmp_path / "out"), "--config", toml], *needles,
                          unchanged=before)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["llama rope_theta, transformers 4 layout",
                                  "gpt-oss window left out (transformers' 128)"])
def test_a_folder_at_a_url_brings_its_config_json_and_is_refused_too(tmp_path, exported, monkeypatch, case):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    toml, edit, needles = MISMATCHES[case]
    folder = with_config(exported[toml], tmp_path / "hf", edit)
    with pytest.raises(CheckpointError) as error:
        load_model(toml, f"file://{folder}", overrides=SHORT)
    assert "\n" not in str(error.value) and all(needle in str(error.value) for needle in needles)


@pytest.mark.parametrize("case", ["llama rope_theta, transformers 5 layout", "gpt-oss sliding window",
                                  "qwen3-next rotary share"])
def test_the_trainer_refuses_it_before_a_step(tmp_path, exported, case):
    toml, edit, needles = MISMATCHES[case]
    folder = with_config(exported[toml], tmp_path / "hf", edit)
    before = snapshot(tmp_path)
    argv = ["--job.config_file", toml, "--training.steps", "1", "--training.mixed_precision_param", "float32",
            *SHORT, f"--job.dump_folder={tmp_path / 'dump'}", "--checkpoint.enable",
            f"--checkpoint.folder={tmp_path / 'ck'}", f"--checkpoint.initial_load_path={folder}",
            "--checkpoint.initial_load_in_hf"]
    assert_one_line_error(train.main, argv, str(folder / "config.json"), *needles, unchanged=before)
    assert (tmp_path / "dump" / "metrics.jsonl").read_text() == ""


def test_a_config_json_of_another_family_is_refused_naming_model_name(tmp_path, exported):
    folder = with_config(exported[LLAMA], tmp_path / "hf", lambda c: c.update(model_type="mistral"))
    with pytest.raises(CheckpointError, match="has model_type 'mistral', but this model \\(Llama\\) reads 'llama'.*"
                                              "check model.name"):
        load_model(LLAMA, str(folder), overrides=SHORT)


@pytest.mark.parametrize("toml", [LLAMA, GPT_OSS, QWEN3_NEXT])
def test_our_export_rewritten_by_transformers_in_its_own_layout_still_loads(tmp_path, exported, toml):
    """transformers 5 moves rope_theta (and the rotary share) into rope_parameters and writes every default: the same
    model, which is not refused."""
    folder = tmp_path / "resaved"
    shutil.copytree(exported[toml], folder)
    transformers.AutoConfig.from_pretrained(str(folder)).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    assert "rope_theta" not in config and "rope_parameters" in config
    load_model(toml, str(folder), overrides=SHORT)


def _randomise(model: torch.nn.Module) -> None:
    # Norms, biases, sinks and routers start at constants: moved off so that a misread shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("norm", "bias", "sinks", "gate.weight", "router")):
                param.normal_(0, 0.5)


# transformers' own tiny models with dimensions no flavor has (vocabulary unlike the tokenizer's, widths off every
# rule, a head_dim of their own, rope theta, scaling, windows ...).
YARN = {"rope_type": "yarn", "rope_theta": 20_000.0, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 24}
TRANSFORMERS_MODELS = {
    "llama3": lambda: transformers.LlamaConfig(
        vocab_size=2100, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=2048, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
        norm_topk_prob=True, mlp_only_layers=[0]),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=48, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, kv_lora_rank=24,
        q_lora_rank=20, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=12, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=256,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=2048, hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=12, linear_value_head_dim=8, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=20, full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=2048, hidden_size=48, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
        swiglu_limit=5.0, max_position_embeddings=256, rope_parameters={**YARN, "truncate": False}),
}


def transformers_folder(name: str, folder: Path) -> torch.nn.Module:
    """transformers' randomly initialised ``name`` model, saved to ``folder`` with save_pretrained; returned."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        config = TRANSFORMERS_MODELS[name]()
        torch.manual_seed(torch.randint(0, 1000, ()).item())
        implementation = "eager" if name == "gpt_oss" else "sdpa"  # transformers' sdpa path has no sinks
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
        _randomise(model)
        model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("name", TRANSFORMERS_MODELS)
def test_a_transformers_checkpoint_imports_at_its_own_dimensions_with_its_logits(tmp_path, name):
    theirs = transformers_folder(name, tmp_path)
    ours = load_model(TOMLS[name], str(tmp_path), overrides=["--model.flavor", f"hf:{tmp_path}", *SHORT])
    vocab = TRANSFORMERS_MODELS[name]().vocab_size
    assert ours.args.vocab_size == vocab
    tokens = torch.randint(0, vocab, (2, 90))  # several sliding windows and YaRN's original length
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert (ours(tokens) - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_the_trainer_and_both_converters_take_an_hf_flavor(tmp_path):
    theirs = transformers_folder("llama3", tmp_path / "hf")
    flavor = ["--model.flavor", f"hf:{tmp_path / 'hf' / 'config.json'}"]  # the file itself works as the folder does
    argv = ["--job.config_file", LLAMA, "--training.steps", "1", "--training.mixed_precision_param", "float32",
            *flavor, f"--job.dump_folder={tmp_path / 'dump'}", "--checkpoint.enable",
            f"--checkpoint.folder={tmp_path / 'ck'}", f"--checkpoint.initial_load_path={tmp_path / 'hf'}",
            "--checkpoint.initial_load_in_hf"]
    assert train.main(argv) == 0
    assert convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "dcp"), "--config", LLAMA, *flavor]) == 0
    assert convert_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "back"), "--config", LLAMA, *flavor,
                               "--dtype", "float32"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 2100, (2, 40))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, theirs(tokens).logits)


# config.json keys a family cannot compute, each refused by name (the built model's config.json is compared back).
INEXPRESSIBLE = {
    "llama attention biases": ("llama3", {"attention_bias": True}, ("attention_bias: config.json has true, the "
                                                                    "nearest model has false")),
    "llama head_dim of its own": ("llama3", {"head_dim": 16}, "head_dim: config.json has 16, the nearest model has 12"),
    "llama linear rope scaling": ("llama3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                                 "factor": 2.0}},
                                  'rope_type: config.json has "linear", the nearest model has "default"'),
    "qwen3 sliding window": ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                                       "layer_types": None},
                             ('layer_types[1]: config.json has "sliding_attention", the nearest model has '
                              '"full_attention"')),
    "gpt-oss every layer full": ("gpt_oss", {"layer_types": ["full_attention"] * 4},
                                 ('layer_types[0]: config.json has "full_attention", the nearest model has '
                                  '"sliding_attention"')),
    "gpt-oss YaRN truncated": ("gpt_oss", {"rope_parameters": {**YARN, "truncate": True}},
                               "rope_parameters.truncate: config.json has true, the nearest model has false"),
    "qwen3-moe sparse every other block": ("qwen3_moe", {"decoder_sparse_step": 2},
                                           "decoder_sparse_step: config.json has 2, the nearest model has 1"),
    "qwen3-next irregular layers": ("qwen3_next", {"layer_types": ["full_attention", "linear_attention",
                                                                   "linear_attention", "full_attention"]},
                                    ('layer_types[0]: config.json has "full_attention", the nearest model has '
                                     '"linear_attention"')),
}


@pytest.mark.parametrize("case", INEXPRESSIBLE)
def test_an_hf_flavor_the_family_cannot_express_is_refused_naming_the_key(tmp_path, case):
    name, changes, needle = INEXPRESSIBLE[case]
    config = TRANSFORMERS_MODELS[name]().to_dict()
    config.update(changes, model_type=get_train_spec(name).state_dict_adapter.hf_model_type)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as error:
        load_model(TOMLS[name], overrides=["--model.flavor", f"hf:{tmp_path}", *SHORT])
    assert "\n" not in str(error.value)
    assert f"model.flavor = 'hf:{tmp_path}' cannot be built: {tmp_path / 'config.json'}: " in str(error.value)
    assert needle in str(error.value)


def test_the_config_check_names_a_bad_hf_flavor_in_one_line(tmp_path):
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(TRANSFORMERS_MODELS["qwen3"]().to_dict()))
    (tmp_path / "empty").mkdir()
    cases = {f"hf:{tmp_path / 'nothing'}": f"names no config.json: {tmp_path / 'nothing'} does not exist",
             f"hf:{tmp_path / 'empty'}": f"names no config.json: {tmp_path / 'empty' / 'config.json'} does not exist",
             f"hf:{tmp_path / 'qwen'}": "config.json has model_type 'qwen3', not 'llama' (Llama): it describes a "
                                        "model of another family (check model.name)"}
    for flavor, needle in cases.items():
        argv = ["--job.config_file", LLAMA, "--model.flavor", flavor, f"--job.dump_folder={tmp_path / 'dump'}"]
        assert_one_line_error(train.main, argv, f"model.flavor = '{flavor}' ", needle)


@pytest.mark.parametrize("file, name, flavor", [
    ("llama3_8B.json", "llama3", "8B"), ("qwen3_0.6B.json", "qwen3", "0.6B"),
    ("qwen3_moe_30B-A3B.json", "qwen3_moe", "30B-A3B"), ("deepseek_v3_671B.json", "deepseek_v3", "671B"),
    ("qwen3_next_80B-A3B.json", "qwen3_next", "80B-A3B"), ("gpt_oss_20b.json", "gpt_oss", "20b")])
def test_a_released_config_json_describes_its_published_flavor_and_builds_it(file, name, flavor):
    """Released files (transformers 4's layout, keys of their own, keys left out) are read as the model they are."""
    config = json.loads((RELEASED / file).read_text())
    spec = get_train_spec(name)
    adapter = spec.state_dict_adapter
    published = dataclasses.replace(spec.flavors[flavor], mtp_depth=0).finalize(1000, 4096)
    assert adapter(published).hf_config_differences(config) == []
    built = adapter.args_from_hf_config(config).finalize(1000, 4096)
    assert adapter(built).hf_config_differences(adapter(published).hf_config(0, 0, "bfloat16")) == []
    with torch.device("meta"):
        assert count_params(spec.model_cls(built)) == count_params(spec.model_cls(published))
