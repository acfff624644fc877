"""DeepSeek-V3: multi-head latent attention against a plain reference, YaRN, flavors, Hugging Face both ways."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from torchtitan.components.checkpointing.hf_folder import read_hf_model_state, read_safetensors, write_hf_folder
from torchtitan.config import load_config
from torchtitan.data import build_tokenizer
from torchtitan.inference import build_model, load_hf_weights, load_model
from torchtitan.models.deepseek_v3 import DeepseekV3StateDictAdapter, MultiHeadLatentAttention, deepseek_v3_flavors
from torchtitan.models.shared.attention import DocumentMask, attend
from torchtitan.models.shared.rope import rope_table
from torchtitan.protocols import count_params

CONFIG = "train_configs/deepseek_v3_debug.toml"


# ----- a straightforward reference, written from the papers' formulas -----

def reference_yarn(args) -> tuple[torch.Tensor, float, float]:
    """(frequencies, cos/sin factor, softmax scale) for the rotary channels, from the YaRN formulas."""
    d, base = args.qk_rope_head_dim, args.rope_theta
    freqs = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    if args.rope_factor <= 1:
        return freqs, 1.0, scale
    s = args.rope_factor

    def dim_of(rotations):  # the channel whose wavelength fits `rotations` times in the original length
        return d * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_of(args.beta_fast)), 0), min(math.ceil(dim_of(args.beta_slow)), d - 1)
    blended = []
    for i, f in enumerate(freqs.tolist()):
        ramp = min(max((i - lo) / max(hi - lo, 1e-3), 0.0), 1.0)  # 0: extrapolate (keep f), 1: interpolate (f/s)
        blended.append(f / s * ramp + f * (1 - ramp))

    def mscale(m):
        return 0.1 * m * math.log(s) + 1

    factor = mscale(args.mscale) / mscale(args.mscale_all_dim)
    return torch.tensor(blended, dtype=torch.float64), factor, scale * mscale(args.mscale_all_dim) ** 2


def rope_interleaved(x: torch.Tensor, freqs: torch.Tensor, factor: float) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (batch, seq, heads, d) as complex numbers."""
    angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), freqs)
    cis = torch.polar(torch.full_like(angles, factor), angles).to(torch.complex64)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * cis[None, :, None]).flatten(-2)


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mla(m: MultiHeadLatentAttention, args, x: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    h, nope, rope_d, vd = args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    freqs, factor, scale = reference_yarn(args)
    if args.q_lora_rank:
        q = rms(x @ m.wq_a.weight.T, m.q_norm.weight, args.latent_norm_eps) @ m.wq_b.weight.T
    else:
        q = x @ m.wq.weight.T
    q = q.view(b, s, h, nope + rope_d)
    q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], freqs, factor)], dim=-1)
    a = x @ m.wkv_a.weight.T
    latent, k_r = a[..., :args.kv_lora_rank], a[..., args.kv_lora_rank:]
    k_r = rope_interleaved(k_r.view(b, s, 1, rope_d), freqs, factor)
    kv = (rms(latent, m.kv_norm.weight, args.latent_norm_eps) @ m.wkv_b.weight.T).view(b, s, h, nope + vd)
    k = torch.cat([kv[..., :nope], k_r.expand(b, s, h, rope_d)], dim=-1)
    v = kv[..., nope:]
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
    return out.reshape(b, s, h * vd) @ m.wo.weight.T


def mla_and_inputs(flavor: str, seq: int = 48, **changes):
    args = deepseek_v3_flavors[flavor].finalize(2048, seq)
    args = type(args)(**{**args.__dict__, **changes})
    torch.manual_seed(torch.randint(0, 10_000, ()).item())
    m = MultiHeadLatentAttention(args)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    rope = rope_table(args.rope_frequencies(), seq) * args.rope_attention_factor
    return m, args, rope, torch.randn(2, seq, args.dim)


@pytest.mark.parametrize("flavor,changes", [
    ("debug", {}), ("debug_qlora", {}), ("debug", {"rope_factor": 1.0}),
    ("debug_qlora", {"mscale": 0.707, "mscale_all_dim": 1.3}),  # the cos/sin factor and the scale both move
], ids=["yarn", "qlora_yarn", "no_yarn", "qlora_mscale"])
def test_mla_equals_the_reference_forward_and_gradients(flavor, changes):
    m, args, rope, x = mla_and_inputs(flavor, **changes)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = m(x_ours, rope)
    ours_grads = torch.autograd.grad(ours.square().sum(), [x_ours, *m.parameters()])
    ref = reference_mla(m, args, x_ref)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x_ref, *m.parameters()])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_mla_in_bfloat16_follows_the_float32_reference():
    m, args, rope, x = mla_and_inputs("debug_qlora")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = m(x, rope)
    ref = reference_mla(m, args, x)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "block_causal"])
def test_attention_kernels_take_a_scale_and_narrower_values(documents):
    q, k = torch.randn(2, 3, 40, 24), torch.randn(2, 3, 40, 24)
    v = torch.randn(2, 3, 40, 16)
    ids = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    mask = torch.ones(40, 40, dtype=torch.bool).tril() & (ids[:, :, None] == ids[:, None, :] if documents else True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None] if documents else mask, scale=0.3)
    ours = attend(q, k, v, DocumentMask(ids) if documents else None, scale=0.3)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_yarn_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = deepseek_v3_flavors["671B"]
    config = transformers.DeepseekV3Config(
        hidden_size=args.dim, num_attention_heads=args.n_heads, qk_rope_head_dim=args.qk_rope_head_dim,
        max_position_embeddings=163840, rope_theta=args.rope_theta,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(args.rope_frequencies().float(), inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(args.rope_attention_factor)
    assert args.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


# Published totals and activated parameters: DeepSeek-V3 671B / 37B (technical report), Moonlight-16B-A3B
# 16B / 3B (model card), Kimi K2 1T / 32B (model card); "activated" counted with the output projection.
@pytest.mark.parametrize("flavor,total,active,tolerance", [("671B", 671e9, 37e9, 0.02), ("16B", 16e9, 3e9, 0.1),
                                                           ("kimi_k2", 1.0e12, 32e9, 0.04)])
def test_published_sizes(flavor, total, active, tolerance):
    from torchtitan.models.deepseek_v3 import DeepseekV3Model

    # The published totals leave out the multi-token prediction module.
    args = dataclasses.replace(deepseek_v3_flavors[flavor], mtp_depth=0).finalize(2048, 4096)
    with torch.device("meta"):
        model = DeepseekV3Model(args)
    assert count_params(model) == pytest.approx(total, rel=tolerance)
    active_ours = args.active_params(count_params(model, exclude_embedding=True)) + args.vocab_size * args.dim
    assert active_ours == pytest.approx(active, rel=tolerance)


def test_the_671b_multi_token_prediction_module_has_its_published_size():
    from torchtitan.models.deepseek_v3 import DeepseekV3Model

    # The released checkpoint: 685B = 671B main model + 14B MTP module, whose 14B count its copies of the
    # embedding and output head (ours shares them).
    args = deepseek_v3_flavors["671B"].finalize(2048, 4096)
    with torch.device("meta"):
        with_mtp, without = DeepseekV3Model(args), DeepseekV3Model(dataclasses.replace(args, mtp_depth=0))
    assert args.mtp_depth == 1
    mtp = count_params(with_mtp) - count_params(without) + 2 * args.vocab_size * args.dim
    assert mtp == pytest.approx(14e9, rel=0.05)


# ----- Hugging Face -----

def _random_model(seed: int):
    model = load_model(CONFIG, overrides=["--debug.seed", str(seed)])
    with torch.no_grad():
        for layer in model.layers.values():
            if layer.moe_enabled:  # routing that depends on the tokens, and a trained-looking bias
                layer.moe.router.gate.weight.normal_(0, 1.0)
                layer.moe.expert_bias.uniform_(-0.05, 0.05)
    return model


def test_our_export_loads_in_transformers_with_our_logits(tmp_path):
    model = _random_model(seed=torch.randint(0, 1000, ()).item())
    adapter = DeepseekV3StateDictAdapter(model.args)
    write_hf_folder(tmp_path, model.state_dict(), adapter, build_tokenizer("assets/tokenizer"), "assets/tokenizer",
                    "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == (4, 2, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, model.args.vocab_size, (2, 48))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("flavor", ["debug", "debug_qlora"])
def test_a_transformers_saved_checkpoint_imports_with_its_logits(tmp_path, flavor):
    a = deepseek_v3_flavors[flavor]
    config = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=a.dim, intermediate_size=a.inter_dim, moe_intermediate_size=a.moe.hidden_dim,
        num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads,
        n_routed_experts=a.moe.num_experts, n_shared_experts=1, num_experts_per_tok=a.moe.top_k,
        n_group=a.moe.n_groups, topk_group=a.moe.topk_group, routed_scaling_factor=a.moe.route_scale,
        first_k_dense_replace=a.n_dense_layers, norm_topk_prob=True, q_lora_rank=a.q_lora_rank or None,
        kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, tie_word_embeddings=False,
        max_position_embeddings=256,
        rope_scaling={"type": "yarn", "factor": a.rope_factor, "original_max_position_embeddings": a.original_seq_len,
                      "beta_fast": a.beta_fast, "beta_slow": a.beta_slow, "mscale": a.mscale,
                      "mscale_all_dim": a.mscale_all_dim})
    torch.manual_seed(torch.randint(0, 1000, ()).item())
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers[a.n_dense_layers:]:
            layer.mlp.gate.weight.normal_(0, 1.0)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    hf.save_pretrained(tmp_path)
    ours = load_model(CONFIG, str(tmp_path), overrides=["--model.flavor", flavor])
    tokens = torch.randint(0, 2048, (2, 48))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_the_latent_norms_keep_transformers_epsilon_whatever_rms_norm_eps(tmp_path):
    """transformers builds MLA's q and kv latent norms with eps 1e-6 whatever rms_norm_eps says (Moonlight and Kimi
    use 1e-5); at its own initialisation the latents are small enough for the difference to show."""
    from torchtitan.components.checkpointing.hf_folder import read_hf_model_state
    from torchtitan.models.deepseek_v3 import DeepseekV3Model, DeepseekV3StateDictAdapter

    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(torch.randint(0, 1000, ()).item())
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    args = DeepseekV3StateDictAdapter.args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert args.norm_eps == 1e-5 and args.latent_norm_eps == 1e-6
    ours = DeepseekV3Model(args)
    ours.init_weights(0)
    ours.load_state_dict(read_hf_model_state(tmp_path, DeepseekV3StateDictAdapter(args),
                                             {n: t.shape for n, t in ours.state_dict().items()}), strict=True)
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert (ours.eval()(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_multi_token_prediction_blocks_go_to_hugging_face_only_when_asked_and_come_back(tmp_path):
    cfg, _ = load_config(["--job.config_file", CONFIG, "--debug.seed", str(torch.randint(0, 1000, ()).item())])
    model, spec = build_model(cfg)  # CONFIG trains one MTP block: layers.4
    n = model.args.n_layers
    assert model.args.mtp_depth == 1 and str(n) in model.layers
    with torch.no_grad():
        for layer in model.layers.values():
            if layer.moe_enabled:
                layer.moe.router.gate.weight.normal_(0, 1.0)
                layer.moe.expert_bias.uniform_(-0.05, 0.05)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    tokenizer = build_tokenizer("assets/tokenizer")

    plain = DeepseekV3StateDictAdapter(model.args)
    write_hf_folder(tmp_path / "plain", state, plain, tokenizer, "assets/tokenizer", "float32")
    assert not any(name.startswith(f"model.layers.{n}.") for name in read_safetensors(tmp_path / "plain"))
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["num_nextn_predict_layers"] == 0

    adapter = DeepseekV3StateDictAdapter(model.args)
    adapter.include_mtp = True
    write_hf_folder(tmp_path / "mtp", state, adapter, tokenizer, "assets/tokenizer", "float32")
    written = read_safetensors(tmp_path / "mtp")
    # DeepSeek-V3's released layout: a decoder layer plus the MTP tensors, with copies of the shared ends.
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.{n}.{name}" in written, name
    assert torch.equal(written[f"model.layers.{n}.embed_tokens.weight"], written["model.embed_tokens.weight"])
    assert torch.equal(written[f"model.layers.{n}.shared_head.head.weight"], written["lm_head.weight"])
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    # transformers runs the main model only, with our logits.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "mtp"), dtype=torch.float32).eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 40))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    # Back into a model with MTP: every tensor as it was; into one without (inference): the blocks are skipped.
    back = read_hf_model_state(tmp_path / "mtp", DeepseekV3StateDictAdapter(model.args))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], state[name]) for name in state)
    inference = load_model(CONFIG, str(tmp_path / "mtp"))
    assert len(inference.layers) == n
    with torch.no_grad():
        assert torch.equal(inference(tokens), model(tokens))
    # A file without the blocks does not fill a model that trains them.
    fresh, _ = build_model(cfg)
    with pytest.raises(Exception, match=f"missing.*layers.{n}"):
        load_hf_weights(fresh, spec, tmp_path / "plain")


def test_tensor_parallel_needs_whole_heads_on_every_rank():
    from torchtitan.config import ConfigError, load_config
    from torchtitan.config_check import validate_config

    cfg, sources = load_config(["--job.config_file", CONFIG, "--parallelism.tensor_parallel_degree", "8"])
    with pytest.raises(ConfigError, match="n_heads 4 is not divisible by the tensor-parallel degree 8"):
        validate_config(cfg, sources, world_size=8)
