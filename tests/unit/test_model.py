import math

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.args import RopeScaling, scaled_rope_frequencies
from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.rope import apply_rope
from torchtitan.protocols import count_params


@pytest.mark.parametrize("flavor,expected", [("8B", 8.03e9), ("70B", 70.6e9), ("405B", 405.9e9)])
def test_published_sizes_build_on_meta_with_published_parameter_counts(flavor, expected):
    args = llama3_flavors[flavor].finalize(tokenizer_vocab_size=2048, seq_len=8192)
    assert args.vocab_size == 128256  # the flavor fixes the vocab, not the tokenizer
    with torch.device("meta"):
        model = Decoder(args)
    assert abs(count_params(model) - expected) / expected < 0.005


def test_ffn_hidden_sizes_match_the_published_table():
    assert [llama3_flavors[f].ffn_hidden_dim for f in ("debugmodel", "8B", "70B", "405B")] == [768, 14336, 28672, 53248]


def test_flavors_without_a_vocab_take_the_tokenizers():
    assert llama3_flavors["debugmodel"].finalize(2048, 64).vocab_size == 2048
    assert llama3_flavors["60M"].finalize(5000, 64).vocab_size == 5000


def _tiny(seed=0, **overrides):
    args = llama3_flavors["tiny"].finalize(257, 32)
    for k, v in overrides.items():
        setattr(args, k, v)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_initialisation_depends_only_on_seed_and_names():
    a, b, c = _tiny(0), _tiny(0), _tiny(1)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # Init visits parameters by name, so a model missing a layer (a pipeline stage) keeps the others' values.
    partial = _tiny(0)
    del partial.layers["0"]
    partial.init_weights(0)
    assert torch.equal(partial.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_initial_loss_is_near_uniform():
    model = _tiny(0)
    tokens = torch.randint(0, 257, (4, 32))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(257)) < 1.0


def _reference_attention(x, attn, rope):
    """Plain-loop GQA with explicit causal mask and complex-number RoPE, in float64."""
    bsz, seqlen, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bsz, seqlen, -1, hd)
    k = (x @ attn.wk.weight.T).view(bsz, seqlen, -1, hd)
    v = (x @ attn.wv.weight.T).view(bsz, seqlen, -1, hd)
    rot = torch.polar(torch.ones_like(rope[:seqlen, :, 0]), torch.atan2(rope[:seqlen, :, 1], rope[:seqlen, :, 0]))
    def rotate(t):
        c = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(c * rot[None, :, None, :]).flatten(-2)
    q, k = rotate(q), rotate(k)
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), 1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(bsz, seqlen, -1)
    return out @ attn.wo.weight.T


def test_attention_matches_a_float64_reference_with_gqa():
    model = _tiny(3).double()
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape[0] != attn.wk.weight.shape[0]  # grouped-query attention is exercised
    x = torch.randn(2, 32, 64, dtype=torch.float64)
    ours = attn(x, model.rope.double())
    torch.testing.assert_close(ours, _reference_attention(x, attn, model.rope.double()), rtol=1e-6, atol=1e-6)


def test_llama31_rope_scaling_per_frequency():
    base = scaled_rope_frequencies(128, 500000.0, None)
    scaled = scaled_rope_frequencies(128, 500000.0, RopeScaling())
    for f, s in zip(base.tolist(), scaled.tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            assert s == f
        elif wavelen > 8192 / 1:
            assert math.isclose(s, f / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            assert math.isclose(s, (1 - smooth) * f / 8 + smooth * f)
    assert (scaled < base).any() and (scaled == base).any()


def test_rope_is_a_rotation_that_preserves_norms_and_relative_positions():
    model = _tiny(0)
    q = torch.randn(1, 32, 4, 16)
    rotated = apply_rope(q, model.rope)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    # <R(m) a, R(n) b> depends only on m - n.
    a, b = torch.randn(16), torch.randn(16)
    seq = torch.stack([a, b] * 16).view(1, 32, 1, 16)
    r = apply_rope(seq, model.rope)[0, :, 0]
    torch.testing.assert_close(r[0] @ r[1], r[10] @ r[11], rtol=1e-5, atol=1e-5)


def test_rope_and_its_hand_written_gradient_match_complex_multiplication_in_float64():
    model = _tiny(0)
    x = torch.randn(2, 32, 4, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 32, 4, 16, dtype=torch.float64)
    angles = torch.view_as_complex(model.rope[:32, None].double().contiguous())

    def reference(t):
        return torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2))) * angles).flatten(-2)

    (expected,) = torch.autograd.grad(reference(x), x, grad)
    (got,) = torch.autograd.grad(apply_rope(x, model.rope.double()), x, grad)
    torch.testing.assert_close(apply_rope(x, model.rope.double()), reference(x))
    torch.testing.assert_close(got, expected)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, model.rope.double()), x[:1, :4, :2])


def test_tied_embeddings_share_one_table():
    model = _tiny(0, tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert count_params(model) == count_params(_tiny(0)) - 257 * 64


def test_hf_adapter_permutes_q_and_k_rows_to_halves_and_round_trips():
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    args = llama3_flavors["tiny"].finalize(97, 16)
    model = Decoder(args)
    state = {name: torch.randn_like(t) for name, t in model.state_dict().items()}
    adapter = Llama3StateDictAdapter(args)
    hf = adapter.to_hf(state)
    assert len(hf) == len(state) and "model.layers.1.mlp.up_proj.weight" in hf
    # Our head h keeps channel pairs (2i, 2i+1) adjacent; transformers keeps the halves (i, i + head_dim/2).
    ours_q, hf_q, d = state["layers.0.attention.wq.weight"], hf["model.layers.0.self_attn.q_proj.weight"], args.head_dim
    for h in range(args.n_heads):
        torch.testing.assert_close(hf_q[h * d : h * d + d // 2], ours_q[h * d : (h + 1) * d : 2], rtol=0, atol=0)
    torch.testing.assert_close(hf["model.layers.0.self_attn.v_proj.weight"], state["layers.0.attention.wv.weight"])
    back = adapter.from_hf(hf)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="'model.layers.0.self_attn.q_norm.weight' for a Llama model"):
        adapter.from_hf({"model.layers.0.self_attn.q_norm.weight": torch.ones(2)})
