"""gpt-oss in one process: the published sizes, the Hugging Face mapping both ways against transformers (sinks,
sliding windows, biased experts with the clamped SwiGLU, YaRN), and what the format cannot hold."""

import dataclasses
import json

import pytest
import torch
import transformers

from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.data import build_tokenizer
from torchtitan.inference import load_model
from torchtitan.models.gpt_oss import GptOssModel, GptOssStateDictAdapter, gpt_oss_flavors
from torchtitan.protocols import count_params

CONFIG = "train_configs/gpt_oss_debug.toml"


@pytest.mark.parametrize("flavor, total, active", [("20b", 20.91e9, 3.61e9), ("120b", 116.83e9, 5.13e9)])
def test_published_sizes(flavor, total, active):
    args = gpt_oss_flavors[flavor].finalize(tokenizer_vocab_size=2048, seq_len=4096)
    assert (args.vocab_size, args.sliding_window, args.rope_factor, args.moe.top_k) == (201088, 128, 32.0, 4)
    with torch.device("meta"):
        model = GptOssModel(args)
    assert abs(count_params(model) - total) / total < 0.005
    assert abs(args.active_params(count_params(model, exclude_embedding=True)) - active) / active < 0.005
    # A sliding block's attention FLOPs stop growing at the window; a full block's grow with the sequence.
    growth = args.attention_flops_per_token(8192) - args.attention_flops_per_token(4096)
    assert growth == 12 * args.n_heads * args.head_dim * 4096 * args.n_layers // 2


def _randomise(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name or name.endswith(("b1", "b2", "b3")):
                param.normal_(0, 0.5)  # zero at init: moved off so that a misread shows
            elif "router.gate" in name:
                param.normal_(0, 1.0)


def test_our_export_loads_in_transformers_with_our_logits(tmp_path):
    model = load_model(CONFIG, overrides=["--debug.seed", str(torch.randint(0, 1000, ()).item()),
                                          "--training.seq_len", "128"])
    _randomise(model)
    write_hf_folder(tmp_path, model.state_dict(), GptOssStateDictAdapter(model.args), build_tokenizer(
        "assets/tokenizer"), "assets/tokenizer", "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2 and config["sliding_window"] == 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    tokens = torch.randint(0, model.args.vocab_size, (2, 100))  # several windows long
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_a_transformers_saved_checkpoint_with_yarn_imports_with_its_logits(tmp_path):
    args = dataclasses.replace(gpt_oss_flavors["debugmodel"], rope_factor=4.0, original_seq_len=32)
    config = transformers.GptOssConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
    torch.manual_seed(torch.randint(0, 1000, ()).item())
    hf = transformers.GptOssForCausalLM(config).eval()
    _randomise(hf)
    state = {k: v for k, v in hf.state_dict().items()}
    ours = GptOssModel(args.finalize(2048, 128))
    adapter = GptOssStateDictAdapter(ours.args)
    missing = set(ours.state_dict()) - set(adapter.from_hf(state))
    ours.load_state_dict({**ours.state_dict(), **adapter.from_hf(state)})
    assert missing <= {f"layers.{i}.moe.expert_bias" for i in range(4)} | {f"layers.{i}.moe.tokens_per_expert"
                                                                           for i in range(4)}
    tokens = torch.randint(0, 2048, (2, 90))
    with torch.no_grad():
        assert (ours.eval()(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    # And back: the export holds transformers' tensors.
    back = adapter.to_hf(ours.state_dict())
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_mxfp4_expert_weights_are_refused_naming_what_to_use():
    adapter = GptOssStateDictAdapter(gpt_oss_flavors["debugmodel"].finalize(2048, 64))
    with pytest.raises(ValueError, match="MXFP4.*bf16 copy"):
        adapter.from_hf({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)})


def test_the_tensor_parallel_plan_extends_grouped_query_attentions_with_the_sinks():
    from torchtitan.models.gpt_oss.parallelize import gpt_oss_block_plan
    from torchtitan.models.shared.tensor_parallel_plan import grouped_query_attention_plan
    from torchtitan.protocols.tensor_parallel_plan import SplitByHeads

    with torch.device("meta"):
        block = GptOssModel(gpt_oss_flavors["debugmodel"].finalize(2048, 64)).layers["0"]
    plan, shared = gpt_oss_block_plan(block), grouped_query_attention_plan(block)
    assert plan.keys() - shared.keys() == {"attention.sinks"} and isinstance(plan["attention.sinks"], SplitByHeads)
    assert all(type(plan[name]) is type(style) for name, style in shared.items())
    assert all(name in dict(block.named_modules()) or name in dict(block.named_parameters()) for name in plan)
