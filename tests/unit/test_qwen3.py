"""Qwen3 dense: published sizes, QK-norm, initialisation, attention math and the HF mapping (all in memory)."""

import dataclasses
import math

import pytest
import torch
import transformers

from torchtitan.models.qwen3 import Qwen3StateDictAdapter, qwen3_flavors
from torchtitan.models.shared.decoder import Decoder
from torchtitan.protocols import count_params
from torchtitan.protocols.train_spec import get_train_spec

# Totals of the released checkpoints, embeddings included (counted once when tied).
PUBLISHED = {"0.6B": 0.596e9, "1.7B": 1.72e9, "4B": 4.02e9, "8B": 8.19e9, "14B": 14.8e9, "32B": 32.8e9}


@pytest.mark.parametrize("flavor,expected", PUBLISHED.items())
def test_published_sizes_build_on_meta_with_published_parameter_counts(flavor, expected):
    args = qwen3_flavors[flavor].finalize(tokenizer_vocab_size=2048, seq_len=4096)
    assert args.vocab_size == 151936  # the flavor fixes the vocab, not the tokenizer
    assert args.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))
    with torch.device("meta"):
        model = Decoder(args)
    assert abs(count_params(model) - expected) / expected < 0.01


def test_head_dim_is_independent_of_dim_over_heads():
    with torch.device("meta"):
        model = Decoder(qwen3_flavors["0.6B"].finalize(2048, 64))
    attention = model.layers["0"].attention
    # 16 heads of 128 make a 2048-wide attention inside a 1024-wide model.
    assert attention.wq.weight.shape == (2048, 1024)
    assert attention.wk.weight.shape == (8 * 128, 1024)
    assert attention.wo.weight.shape == (1024, 2048)


def _debug(seed=0, vocab=257, seq_len=32, **overrides):
    args = dataclasses.replace(qwen3_flavors["debugmodel"], **overrides).finalize(vocab, seq_len)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_registered_and_debug_flavor_takes_the_tokenizer_vocab():
    assert get_train_spec("qwen3").model_cls is Decoder
    assert _debug(vocab=300).output.weight.shape == (300, 256)


def test_every_layer_normalises_queries_and_keys_per_head():
    model = _debug(n_layers=2)
    for block in model.layers.values():
        assert block.attention.q_norm.weight.shape == block.attention.k_norm.weight.shape == (64,)
    # With QK-norm the attention output does not depend on the scale of the q and k projections (up to
    # the norm's eps, which the upward scales make smaller still; float64 keeps rounding out of it).
    model = model.double()
    attention = model.layers["0"].attention
    x = torch.randn(2, 16, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before = attention(x, model.rope.double())
    with torch.no_grad():
        attention.wq.weight.mul_(7.0)
        attention.wk.weight.mul_(3.0)
    torch.testing.assert_close(attention(x, model.rope.double()), before, rtol=1e-4, atol=1e-6)


def test_initialisation_depends_only_on_seed_and_names():
    a, b, c = _debug(0), _debug(0), _debug(1)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # Init visits parameters by name, so a model missing a layer (a pipeline stage) keeps the others' values.
    partial = _debug(0)
    del partial.layers["0"]
    partial.init_weights(0)
    assert torch.equal(partial.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_tied_embeddings_share_one_table_after_init():
    tied = _debug(tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count_params(tied) == count_params(_debug()) - 257 * 256


def _reference_attention(x, attn, theta):
    """Per-head loop in float64: explicit RMS of each head, RoPE as 2x2 rotations of (i, i + d/2), masked softmax."""
    bsz, seqlen, _ = x.shape
    hd = attn.head_dim

    def heads(w):
        return (x @ w.T).view(bsz, seqlen, -1, hd)

    def rms_norm(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + attn.q_norm.eps) * w

    q, k, v = heads(attn.wq.weight), heads(attn.wk.weight), heads(attn.wv.weight)
    q, k = rms_norm(q, attn.q_norm.weight), rms_norm(k, attn.k_norm.weight)

    def rotate(t):
        out = t.clone()
        for pos in range(seqlen):
            for i in range(hd // 2):
                angle = pos * theta ** (-2 * i / hd)
                a, b = t[:, pos, :, i], t[:, pos, :, i + hd // 2]
                out[:, pos, :, i] = a * math.cos(angle) - b * math.sin(angle)
                out[:, pos, :, i + hd // 2] = a * math.sin(angle) + b * math.cos(angle)
        return out

    q, k = rotate(q), rotate(k)
    group = q.shape[2] // k.shape[2]
    out = torch.zeros_like(q)
    for h in range(q.shape[2]):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), 1), float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ v[:, :, h // group]
    return out.reshape(bsz, seqlen, -1) @ attn.wo.weight.T


def test_attention_matches_a_float64_reference_with_gqa_and_qk_norm():
    model = _debug(3, seq_len=12, n_layers=1).double()
    attn = model.layers["0"].attention
    with torch.no_grad():  # non-trivial norm weights, so a skipped or misplaced QK-norm shows
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    assert attn.wq.weight.shape[0] != attn.wk.weight.shape[0]  # grouped-query attention is exercised
    x = torch.randn(2, 12, 256, dtype=torch.float64)
    expected = _reference_attention(x, attn, model.args.rope_theta)
    torch.testing.assert_close(attn(x, model.rope.double()), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformers_qwen3_built_from_our_config_and_weights_gives_our_logits(tie):
    model = _debug(5, n_layers=2, tie_embeddings=tie)
    with torch.no_grad():  # move the norm weights off 1 so their mapping matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    adapter = Qwen3StateDictAdapter(model.args)
    config = adapter.hf_config(tokenizer_bos=1, tokenizer_eos=2, dtype="float32")
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 64
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields, attn_implementation="eager"))
    hf_state = adapter.to_hf(model.state_dict())
    assert ("lm_head.weight" in hf_state) != tie
    missing, unexpected = reference.load_state_dict(hf_state, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if tie else [])
    tokens = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), reference.eval()(tokens).logits, rtol=1e-5, atol=1e-5)
    back = adapter.from_hf(hf_state)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_from_hf_names_unknown_weights_and_a_disagreeing_tied_head():
    args = qwen3_flavors["debugmodel"].finalize(257, 32)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_proj.bias"):
        Qwen3StateDictAdapter(args).from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})
    tied = Qwen3StateDictAdapter(dataclasses.replace(args, tie_embeddings=True))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        tied.from_hf({"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.ones(2, 2)})


def test_flops_per_token_counts_matmuls_and_attention():
    args = qwen3_flavors["8B"].finalize(2048, 4096)
    with torch.device("meta"):
        model = Decoder(args)
    non_embedding = count_params(model, exclude_embedding=True)
    attention = 12 * 36 * 32 * 128 * 4096
    assert args.flops_per_token(non_embedding, 4096) == 6 * non_embedding + attention
    # A tied output projection is still one matmul per token.
    tied = dataclasses.replace(args, tie_embeddings=True)
    assert tied.flops_per_token(non_embedding - 151936 * 4096, 4096) == 6 * non_embedding + attention


def test_checks_name_the_offending_values():
    debug = qwen3_flavors["debugmodel"]
    assert debug.check() == []
    assert dataclasses.replace(debug, n_kv_heads=3).check() == [("n_kv_heads", "3 does not divide n_heads=8")]
    assert dataclasses.replace(debug, head_dim=63).check()[0][0] == "head_dim"
    assert debug.check_tensor_parallel(4) == []
    assert debug.check_tensor_parallel(8) == [("n_kv_heads", "4 is not divisible by the tensor-parallel degree 8")]
