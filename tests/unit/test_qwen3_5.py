"""Qwen3.5, dense and MoE, against transformers' Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration: our export, a transformers-saved checkpoint, M-RoPE positions, the text-only
path and the published flavors."""

import dataclasses
import json
import re

import pytest
import torch
import transformers
from safetensors.torch import save_file

from torchtitan.components.checkpointing.hf_folder import check_hf_config, read_hf_model_state
from torchtitan.data.images import mrope_positions, pad_row_images
from torchtitan.models.qwen3_5 import Qwen3_5, Qwen3_5ModelArgs, Qwen3_5StateDictAdapter, qwen3_5_flavors
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5MoeStateDictAdapter
from torchtitan.models.qwen3_next import Qwen3NextModel, Qwen3NextModelArgs
from torchtitan.models.qwen3_vl.args import qwen3_vl_flavors
from torchtitan.models.shared.moe import MoEArgs
from torchtitan.models.shared.vision import VisionArgs
from torchtitan.protocols import count_params

IMAGE, START, END = 90, 91, 92
# Patch grids (time, rows, columns) of three images of different sizes: the first conversation shows two.
GRIDS = [(1, 8, 12), (1, 4, 4), (1, 12, 8)]
MOE = MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="softmax", route_norm=True, shared_hidden_dim=32,
              shared_gate=True)


def _args(moe: bool = False, **overrides) -> Qwen3_5ModelArgs:
    # 16 rotary channels of 64 (8 frequencies, interleaved 3/3/2); 2 linear key heads each serving 2 value heads.
    vision = VisionArgs(depth=2, dim=32, ffn_dim=48, n_heads=2, patch_size=4, num_position_embeddings=64)
    fields = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "hidden_dim": 96,
              "vocab_size": 100, "rope_theta": 10_000.0, "linear_n_key_heads": 2, "linear_n_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "mrope_section": (3, 3, 2),
              "image_token_id": IMAGE, "vision_start_token_id": START, "vision_end_token_id": END,
              "max_seq_len": 256, "vision": vision, "moe": MOE if moe else None}
    return Qwen3_5ModelArgs(**{**fields, **overrides})


def _model(args: Qwen3_5ModelArgs, seed: int) -> Qwen3_5:
    torch.manual_seed(seed)
    model = Qwen3_5(args)
    model.init_weights(seed)
    with torch.no_grad():  # off the initial values (zero-centred norms, unit norms), which would hide a misplaced one
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (1.0 if "router.gate" in name else 0.05))
    return model.eval()


def _conversation(grids, gen: torch.Generator) -> list[int]:
    # Text runs long enough that each row crosses the Gated DeltaNet's 64-token chunks.
    def text(n):
        return torch.randint(0, 80, (n,), generator=gen).tolist()
    tokens = text(30)
    for t, h, w in grids:
        tokens += [START] + [IMAGE] * (t * h * w // 4) + [END] + text(20)
    return tokens


def _batch(patch_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = [_conversation(GRIDS[:2], gen), _conversation(GRIDS[2:], gen)]
    length = max(map(len, rows))
    rows = [row + [3] * (length - len(row)) for row in rows]
    positions = torch.stack([mrope_positions(rows[0], GRIDS[:2], IMAGE, 2),
                             mrope_positions(rows[1], GRIDS[2:], IMAGE, 2)])
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), patch_dim, generator=gen)
    return torch.tensor(rows), positions, pixels, torch.tensor(GRIDS)


def _per_row(pixels: torch.Tensor) -> dict:
    """transformers' concatenated images as our per-row inputs (row 0 shows the first two images)."""
    sizes = [t * h * w for t, h, w in GRIDS]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pixel_values, image_grid_thw = pad_row_images(
        [[(pixels[starts[i]:starts[i] + sizes[i]], GRIDS[i]) for i in row] for row in ((0, 1), (2,))],
        pixels.shape[1])
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}


def _transformers_model(adapter: Qwen3_5StateDictAdapter):
    config_cls = transformers.Qwen3_5MoeConfig if adapter.args.moe else transformers.Qwen3_5Config
    config = config_cls(**{k: v for k, v in adapter.hf_config(1, 2, "float32").items() if k != "architectures"})
    return getattr(transformers, adapter.hf_architecture)(config).eval()


def _both(ours, hf, tokens, positions, pixels, grids) -> float:
    with torch.no_grad():
        theirs = hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(tokens == IMAGE).int()).logits
        return (ours(tokens, positions=positions, **_per_row(pixels)) - theirs).abs().max().item()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_our_export_loads_in_transformers_and_gives_our_logits_on_conversations_with_images(tmp_path, moe):
    args = _args(moe)
    seed = int(torch.randint(0, 10_000, ()))
    model = _model(args, seed)
    adapter = Qwen3_5StateDictAdapter(args)
    save_file({k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(1, 2, "float32")))
    architecture = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    hf, info = getattr(transformers, architecture).from_pretrained(tmp_path, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens, positions, pixels, grids = _batch(args.vision.patch_dim, seed)
    assert tokens.shape[1] > 64
    assert _both(model, hf.eval(), tokens, positions, pixels, grids) <= 1e-4
    with torch.no_grad():
        text = torch.randint(0, 80, (2, 80))
        assert (model(text) - hf(input_ids=text).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_checkpoint_saved_by_transformers_imports_with_its_logits(tmp_path, moe):
    args = _args(moe, tie_embeddings=not moe)
    seed = int(torch.randint(0, 10_000, ()))
    torch.manual_seed(seed)
    hf = _transformers_model(Qwen3_5StateDictAdapter(args))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("bias") or "mlp.gate." in name:
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    imported = Qwen3_5StateDictAdapter.args_from_hf_config(config)
    # A MoE format has no dense width: the unused hidden_dim keeps its default.
    assert imported == dataclasses.replace(args, max_seq_len=imported.max_seq_len, hidden_dim=imported.hidden_dim)
    adapter = Qwen3_5StateDictAdapter(imported)
    assert type(adapter) is (Qwen3_5MoeStateDictAdapter if moe else Qwen3_5StateDictAdapter)
    check_hf_config(tmp_path, adapter)
    ours = Qwen3_5(imported)
    ours.init_weights(0)
    expected = {name: t.shape for name, t in ours.state_dict().items()}
    ours.load_state_dict(read_hf_model_state(tmp_path, adapter, expected), strict=True)
    tokens, positions, pixels, grids = _batch(args.vision.patch_dim, seed)
    assert _both(ours.eval(), hf, tokens, positions, pixels, grids) <= 1e-4


def test_a_config_json_the_family_cannot_compute_is_refused_by_key():
    irregular = ["full_attention"] + ["linear_attention"] * 3  # no interval makes this pattern
    for moe, key, value, name in ((False, "hidden_act", "gelu", "hidden_act"), (True, "hidden_act", "gelu", "hidden_act"),
                                  (False, "layer_types", irregular, "layer_types[0]")):
        config = Qwen3_5StateDictAdapter(_args(moe)).hf_config(1, 2, "float32")
        config["text_config"][key] = value
        with pytest.raises(ValueError, match=rf"{re.escape(name)}: config.json has"):
            Qwen3_5StateDictAdapter.args_from_hf_config(config)
    config = Qwen3_5StateDictAdapter(_args()).hf_config(1, 2, "float32")
    config["vision_config"]["out_hidden_size"] = 32  # not the decoder's width: the tower could not write into it
    with pytest.raises(ValueError, match="vision_config.out_hidden_size: config.json has 32"):
        Qwen3_5StateDictAdapter.args_from_hf_config(config)
    with pytest.raises(ValueError, match=r"has no DeepStack; vision.deepstack_indexes = \(0,\)"):
        Qwen3_5StateDictAdapter(_args(vision=VisionArgs(depth=2, dim=32, n_heads=2, deepstack_indexes=(0,)))
                                ).hf_config(1, 2, "float32")
    with pytest.raises(ValueError, match="cannot express moe.route_norm = False"):
        unnormalised = dataclasses.replace(_args(), moe=dataclasses.replace(MOE, route_norm=False))
        Qwen3_5StateDictAdapter(unnormalised).hf_config(1, 2, "float32")


def test_a_qwen3_next_checkpoint_is_not_read_as_qwen3_5():
    """Qwen3-Next's fused projections are another format: named, not silently split."""
    adapter = Qwen3_5StateDictAdapter(_args())
    with pytest.raises(KeyError, match="unexpected Hugging Face weight 'model.language_model.layers.0.linear_attn"
                                       ".in_proj_qkvz.weight'"):
        adapter.from_hf({"model.language_model.layers.0.linear_attn.in_proj_qkvz.weight": torch.zeros(1, 64)})


def test_mrope_positions_are_transformers_rope_index():
    args = _args()
    hf = _transformers_model(Qwen3_5StateDictAdapter(args))
    tokens, positions, _, grids = _batch(args.vision.patch_dim, seed=int(torch.randint(0, 10_000, ())))
    expected, _ = hf.model.get_rope_index(tokens, mm_token_type_ids=(tokens == IMAGE).int(), image_grid_thw=grids)
    assert torch.equal(positions.permute(2, 0, 1), expected)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_text_only_batch_is_bitwise_the_text_model_with_the_same_weights(moe):
    args = _args(moe)
    vlm = _model(args, seed=int(torch.randint(0, 10_000, ())))
    text = Qwen3NextModel(Qwen3NextModelArgs(**{f.name: getattr(args, f.name)
                                                 for f in dataclasses.fields(Qwen3NextModelArgs)}))
    text.load_state_dict({k: v for k, v in vlm.state_dict().items() if not k.startswith("visual.")})
    tokens = torch.randint(0, 80, (2, 80))
    with torch.no_grad():
        expected = text.eval()(tokens)
        assert torch.equal(vlm(tokens), expected)
        # Text positions on all three M-RoPE streams rotate exactly as one position.
        three = mrope_positions(tokens[0].tolist(), [], IMAGE, 2)[None].expand(2, -1, -1)
        assert torch.equal(vlm(tokens, positions=three), expected)


def test_the_in_proj_qkv_regrouping_is_exact_both_ways():
    adapter = Qwen3_5StateDictAdapter(_args())
    qkv = torch.randn(2 * (16 + 16 + 2 * 16), 64)
    streams = adapter.to_streams(qkv)
    # The format's rows: both key heads' q, then both heads' k, then the four value heads.
    assert torch.equal(streams[:16], qkv[:16]) and torch.equal(streams[16:32], qkv[64:80])
    assert torch.equal(streams[32:48], qkv[16:32]) and torch.equal(streams[64:96], qkv[32:64])
    assert torch.equal(adapter.from_streams(streams), qkv)


def test_debug_flavors_use_the_debug_tokenizers_vision_ids():
    for args in (qwen3_5_flavors["debugmodel"], qwen3_5_flavors["debugmodel_moe"], qwen3_vl_flavors["debugmodel"]):
        assert (args.vision_start_token_id, args.vision_end_token_id, args.image_token_id) == (2048, 2049, 2051)
    assert qwen3_5_flavors["debugmodel"].moe is None and qwen3_5_flavors["debugmodel_moe"].moe is not None


def test_published_flavors_build_on_meta_and_pass_their_checks():
    for name, args in qwen3_5_flavors.items():
        assert args.check() == [], name
        assert args.vision.out_dim == args.dim and not args.vision.deepstack_indexes
        assert args.rotary_dim == 2 * sum(args.mrope_section)
    for name, total, active in (("9B", 9, None), ("35B-A3B", 35, 3)):
        args = qwen3_5_flavors[name]
        with torch.device("meta"):
            model = Qwen3_5(args)
        # The names' sizes: total parameters, and (A3B) those a token computes with outside the embeddings.
        assert round(count_params(model) / 1e9) == total, name
        if active is not None:
            assert round(args.active_params(count_params(model, exclude_embedding=True)) / 1e9) == active
        assert Qwen3_5StateDictAdapter(args).hf_config(0, 0, "bfloat16")["model_type"] == (
            "qwen3_5_moe" if args.moe else "qwen3_5")


def test_checks_name_the_offending_values():
    problems = dict(_args(mrope_section=(3, 3, 3)).check())
    assert "(3, 3, 3) must be three counts summing to rotary_dim/2 = 8" in problems["mrope_section"]
    problems = dict(_args(linear_n_value_heads=3).check())
    assert "not a multiple of linear_n_key_heads = 2" in problems["linear_n_value_heads"]
