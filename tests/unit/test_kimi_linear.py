"""Kimi Linear against transformers' KimiLinearForCausalLM: our export loads there with our logits, a checkpoint
transformers saved imports with its logits (sequences over several KDA chunks), a config.json we cannot compute is
refused by key, and the published flavor builds and plans."""

import dataclasses
import json

import pytest
import torch
import transformers

from torchtitan.components.checkpointing.hf_folder import check_hf_config, read_hf_model_state
from torchtitan.models.kimi_linear import KimiLinearModel, KimiLinearModelArgs, KimiLinearStateDictAdapter
from torchtitan.models.kimi_linear.args import kimi_linear_flavors
from torchtitan.models.shared.moe import MoEArgs
from torchtitan.protocols import count_params

LENGTH = 210  # several 64-token chunks of the KDA kernel, and a partial one


def _args(**overrides) -> KimiLinearModelArgs:
    fields = dict(dim=64, n_layers=4, n_heads=4, inter_dim=96, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, n_dense_layers=1, norm_eps=1e-5, kda_n_heads=4, kda_head_dim=16,
                  full_attention_layers=(1, 3), vocab_size=128, max_seq_len=256,
                  moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="sigmoid", route_norm=True,
                              route_scale=2.446, shared_hidden_dim=32))
    return KimiLinearModelArgs(**{**fields, **overrides})


def _model(args: KimiLinearModelArgs, seed: int) -> KimiLinearModel:
    torch.manual_seed(seed)
    model = KimiLinearModel(args)
    model.init_weights(seed)
    with torch.no_grad():  # off the initial values (unit norms, zero biases), which would hide a misplaced one
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.5 if "expert_bias" in name else 0.05))
    return model.eval()


def _transformers_model(adapter: KimiLinearStateDictAdapter) -> transformers.KimiLinearForCausalLM:
    config = {k: v for k, v in adapter.hf_config(1, 2, "float32").items() if k != "architectures"}
    return transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**config, pad_token_id=0)).eval()


def _load_released(hf: transformers.KimiLinearForCausalLM, state: dict, tmp_path) -> None:
    """Our export through the released format, as transformers reads a folder of it."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    loaded = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf.load_state_dict(loaded.state_dict())


def test_our_export_loads_in_transformers_and_gives_our_logits(tmp_path):
    args = _args()
    model = _model(args, seed=int(torch.randint(0, 10_000, ())))
    adapter = KimiLinearStateDictAdapter(args)
    hf = _transformers_model(adapter)
    _load_released(hf, adapter.to_hf(model.state_dict()), tmp_path)
    tokens = torch.randint(0, 128, (2, LENGTH))
    with torch.no_grad():
        assert (model(tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-4


def test_a_checkpoint_saved_by_transformers_imports_with_its_logits(tmp_path):
    args = _args()
    hf = _transformers_model(KimiLinearStateDictAdapter(args))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or "bias" in name:
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    imported = KimiLinearStateDictAdapter.args_from_hf_config(config)
    assert imported == dataclasses.replace(args, max_seq_len=imported.max_seq_len)
    adapter = KimiLinearStateDictAdapter(imported)
    check_hf_config(tmp_path, adapter)
    ours = KimiLinearModel(imported)
    ours.init_weights(0)
    expected = {name: t.shape for name, t in ours.state_dict().items()}
    ours.load_state_dict(read_hf_model_state(tmp_path, adapter, expected), strict=True)
    tokens = torch.randint(0, 128, (2, LENGTH))
    with torch.no_grad():
        assert (ours.eval()(tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-4


def test_a_config_json_the_family_cannot_compute_is_refused_by_key():
    config = KimiLinearStateDictAdapter(_args()).hf_config(1, 2, "float32")
    config["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        KimiLinearStateDictAdapter.args_from_hf_config(config)


def test_the_published_flavor_builds_and_counts_48b_of_which_3b_active():
    args = kimi_linear_flavors["48B-A3B"].finalize(163840, 4096)
    assert not args.check()
    with torch.device("meta"):
        model = KimiLinearModel(args)
    total = count_params(model)
    active = args.active_params(count_params(model, exclude_embedding=True))
    print(f"\nKimi-Linear 48B-A3B: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active without embeddings")
    assert 47e9 < total < 50e9 and 2.5e9 < active < 3.5e9
    assert [i for i in range(27) if args.layer_type(i) == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]


def test_muon_takes_the_matrices_and_leaves_convs_decays_and_norms_to_adamw():
    from torchtitan.components.optimizers.muon import split_parameters

    with torch.device("meta"):
        model = KimiLinearModel(_args())
    muon, adamw = (dict(group) for group in split_parameters([model]))
    kda, mla = "layers.0.attention.", "layers.1.attention."
    for name in ("in_proj_qkv.weight", "in_proj_b.weight", "f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight",
                 "g_b_proj.weight", "wo.weight"):
        assert kda + name in muon, name
    for name in ("conv.weight", "decay.A_log", "decay.dt_bias", "norm.weight"):
        assert kda + name in adamw, name
    assert {mla + n for n in ("wq.weight", "wkv_a.weight", "wkv_b.weight", "wo.weight")} <= set(muon)
    assert mla + "kv_norm.weight" in adamw and "layers.2.moe.router.gate.weight" in adamw
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw
