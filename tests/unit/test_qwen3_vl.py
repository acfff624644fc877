"""Qwen3-VL: the vision tower, M-RoPE and the family against transformers' Qwen3VLForConditionalGeneration, and the
image preprocessing against Qwen2VLImageProcessorPil."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from torchtitan.components.checkpointing.hf_folder import check_hf_config, read_hf_model_state
from torchtitan.data.images import ImagePatching, image_patches, mrope_positions, open_image, pad_row_images
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.qwen3_vl import Qwen3VL, Qwen3VLModelArgs, Qwen3VLStateDictAdapter
from torchtitan.models.qwen3_vl.args import qwen3_vl_flavors
from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.rope import mrope_streams
from torchtitan.models.shared.vision import VisionArgs
from torchtitan.protocols import count_params

IMAGE, START, END = 90, 91, 92
# Patch grids (time, rows, columns) of three images of different sizes: the first conversation shows two.
GRIDS = [(1, 4, 6), (1, 2, 2), (1, 6, 4)]


def _args(**overrides) -> Qwen3VLModelArgs:
    vision = VisionArgs(depth=3, dim=32, ffn_dim=48, n_heads=2, patch_size=4, num_position_embeddings=64,
                        deepstack_indexes=(0, 2))
    fields = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=100,
                  mrope_section=(2, 3, 3), image_token_id=IMAGE, vision_start_token_id=START,
                  vision_end_token_id=END, max_seq_len=128, vision=vision)
    return Qwen3VLModelArgs(**{**fields, **overrides})


def _model(args: Qwen3VLModelArgs, seed: int) -> Qwen3VL:
    torch.manual_seed(seed)
    model = Qwen3VL(args)
    model.init_weights(seed)
    with torch.no_grad():  # off the initial values (unit norms, zero biases), which would hide a misplaced one
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def _conversation(grids) -> list[int]:
    tokens = [5, 6, 7]
    for t, h, w in grids:
        tokens += [START] + [IMAGE] * (t * h * w // 4) + [END, 8, 9]
    return tokens


def _batch(patch_dim: int):
    rows = [_conversation(GRIDS[:2]), _conversation(GRIDS[2:])]
    length = max(map(len, rows))
    rows = [row + [3] * (length - len(row)) for row in rows]
    positions = torch.stack([mrope_positions(rows[0], GRIDS[:2], IMAGE, 2),
                             mrope_positions(rows[1], GRIDS[2:], IMAGE, 2)])
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), patch_dim)
    return torch.tensor(rows), positions, pixels, torch.tensor(GRIDS)


def _per_row(pixels: torch.Tensor, grids=GRIDS, rows=((0, 1), (2,))) -> dict:
    """transformers' concatenated images as our per-row inputs (row 0 shows the first two images)."""
    sizes = [t * h * w for t, h, w in grids]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pixel_values, image_grid_thw = pad_row_images(
        [[(pixels[starts[i]:starts[i] + sizes[i]], grids[i]) for i in row] for row in rows], pixels.shape[1])
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}


def _transformers_model(adapter: Qwen3VLStateDictAdapter) -> transformers.Qwen3VLForConditionalGeneration:
    config = transformers.Qwen3VLConfig(**{k: v for k, v in adapter.hf_config(1, 2, "float32").items()
                                           if k != "architectures"})
    return transformers.Qwen3VLForConditionalGeneration(config).eval()


def test_our_export_loads_in_transformers_and_gives_our_logits_on_conversations_with_images():
    args = _args()
    model = _model(args, seed=int(torch.randint(0, 10_000, ())))
    adapter = Qwen3VLStateDictAdapter(args)
    hf = _transformers_model(adapter)
    missing, unexpected = hf.load_state_dict(adapter.to_hf(model.state_dict()), strict=False)
    assert not missing and not unexpected
    tokens, positions, pixels, grids = _batch(args.vision.patch_dim)
    with torch.no_grad():
        ours = model(tokens, positions=positions, **_per_row(pixels))
        theirs = hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(tokens == IMAGE).int()).logits
        assert (ours - theirs).abs().max().item() <= 1e-4
        text = torch.randint(0, 80, (2, 24))
        assert (model(text) - hf(input_ids=text).logits).abs().max().item() <= 1e-4


def test_a_checkpoint_saved_by_transformers_imports_with_its_logits(tmp_path):
    args = _args(tie_embeddings=True)
    hf = _transformers_model(Qwen3VLStateDictAdapter(args))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    config = __import__("json").loads((tmp_path / "config.json").read_text())
    imported = Qwen3VLStateDictAdapter.args_from_hf_config(config)
    assert imported == dataclasses.replace(args, max_seq_len=imported.max_seq_len)
    adapter = Qwen3VLStateDictAdapter(imported)
    check_hf_config(tmp_path, adapter)
    ours = Qwen3VL(imported)
    ours.init_weights(0)
    expected = {name: t.shape for name, t in ours.state_dict().items()}
    ours.load_state_dict(read_hf_model_state(tmp_path, adapter, expected), strict=True)
    tokens, positions, pixels, grids = _batch(args.vision.patch_dim)
    with torch.no_grad():
        theirs = hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(tokens == IMAGE).int()).logits
        assert (ours(tokens, positions=positions, **_per_row(pixels))
                - theirs).abs().max().item() <= 1e-4


def test_a_config_json_the_family_cannot_compute_is_refused_by_key():
    config = Qwen3VLStateDictAdapter(_args()).hf_config(1, 2, "float32")
    config["vision_config"]["hidden_act"] = "quick_gelu"
    with pytest.raises(ValueError, match="vision_config.hidden_act"):
        Qwen3VLStateDictAdapter.args_from_hf_config(config)


def test_a_text_only_batch_is_bitwise_the_text_model_with_the_same_weights():
    args = _args()
    vlm = _model(args, seed=int(torch.randint(0, 10_000, ())))
    text_fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Qwen3ModelArgs)}
    text = Decoder(Qwen3ModelArgs(**text_fields))
    text.load_state_dict({k: v for k, v in vlm.state_dict().items() if not k.startswith("visual.")})
    tokens = torch.randint(0, 80, (2, 40))
    one_stream = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        expected = text(tokens)
        assert torch.equal(vlm(tokens), expected)
        # Text positions on all three M-RoPE streams rotate exactly as one position.
        three = mrope_positions(tokens[0].tolist(), [], IMAGE, 2)[None].expand(2, -1, -1)
        assert torch.equal(vlm(tokens, positions=three), expected)
        assert torch.equal(vlm(tokens, positions=one_stream), expected)


def test_the_images_of_a_batch_never_see_each_other_in_the_tower():
    args = _args()
    model = _model(args, seed=int(torch.randint(0, 10_000, ())))
    _, _, pixels, grids = _batch(args.vision.patch_dim)
    first = GRIDS[0][1] * GRIDS[0][2]
    changed = pixels.clone()
    changed[first:first + 4] = torch.randn(4, args.vision.patch_dim)  # the second image
    with torch.no_grad():
        (before, deep_before), (after, deep_after) = model.visual(pixels, grids), model.visual(changed, grids)
    merged = [t * h * w // 4 for t, h, w in GRIDS]
    second = slice(merged[0], merged[0] + merged[1])
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    keep[second] = False
    assert torch.equal(before[keep], after[keep])
    assert all(torch.equal(b[keep], a[keep]) for b, a in zip(deep_before, deep_after))
    assert not torch.allclose(before[second], after[second])


def test_mrope_positions_are_transformers_rope_index():
    args = _args()
    hf = _transformers_model(Qwen3VLStateDictAdapter(args))
    tokens, positions, _, grids = _batch(args.vision.patch_dim)
    expected, _ = hf.model.get_rope_index(tokens, mm_token_type_ids=(tokens == IMAGE).int(), image_grid_thw=grids)
    assert torch.equal(positions.permute(2, 0, 1), expected)


def test_mrope_streams_interleave_height_and_width_within_their_sections():
    streams = mrope_streams((24, 20, 20), 64).tolist()
    assert streams[:6] == [0, 1, 2, 0, 1, 2] and streams[60:] == [0, 0, 0, 0]
    assert [streams.count(s) for s in range(3)] == [24, 20, 20]
    with pytest.raises(ValueError, match="summing to the 64"):
        mrope_streams((24, 20, 21), 64)


def test_positions_refuse_more_image_runs_than_grids():
    with pytest.raises(ValueError, match="image grids are used up"):
        mrope_positions(_conversation(GRIDS[:2]), GRIDS[:1], IMAGE, 2)


def test_preprocessing_equals_qwen2vl_image_processor_on_odd_images():
    rng = np.random.default_rng(int(torch.randint(0, 10_000, ())))
    patching = ImagePatching(min_pixels=32 * 32, max_pixels=128 * 128)
    reference = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                         min_pixels=patching.min_pixels, max_pixels=patching.max_pixels,
                                         image_mean=list(patching.mean), image_std=list(patching.std))
    images = [Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (301, 97, 4), dtype=np.uint8), "RGBA"),
              Image.fromarray(rng.integers(0, 256, (15, 23), dtype=np.uint8), "L"),
              Image.fromarray(rng.integers(0, 256, (64, 250, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (999, 45, 3), dtype=np.uint8)).convert("P")]
    for image in images:
        patches, grid = image_patches(open_image(image), patching)
        expected = reference(images=[image], return_tensors="np")
        assert [list(grid)] == expected["image_grid_thw"].tolist()
        assert np.abs(patches - expected["pixel_values"]).max() <= 1e-6


def test_published_flavors_build_on_meta_and_pass_their_checks():
    for name, args in qwen3_vl_flavors.items():
        assert args.check() == [], name
        assert args.vision.out_dim == args.dim
    with torch.device("meta"):
        model = Qwen3VL(qwen3_vl_flavors["8B"])
    # Qwen3-VL-8B-Instruct is published as 8.77B parameters.
    assert abs(count_params(model) / 1e9 - 8.77) < 0.01


def test_checks_name_the_offending_values():
    problems = dict(_args(mrope_section=(2, 3, 4)).check())
    assert "must be three counts summing to head_dim/2 = 8" in problems["mrope_section"]
    problems = dict(_args(vision=VisionArgs(depth=2, dim=30, n_heads=4, deepstack_indexes=(3,))).check())
    assert "vision.n_heads" in problems and "[3] are not blocks" in problems["vision.deepstack_indexes"]


def test_bad_images_are_one_line_errors_naming_the_file(tmp_path):
    from torchtitan.data.errors import DataError

    with pytest.raises(DataError, match=r"missing\.png: no such image file"):
        open_image(tmp_path / "missing.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=r"corrupt\.png: not a readable image"):
        open_image(tmp_path / "corrupt.png")
    tiny = Image.new("RGB", (5, 3))
    with pytest.raises(DataError, match=r"row 7 \(5 x 3 pixels\): .*too small for one 32 x 32 block"):
        image_patches(tiny, ImagePatching(min_pixels=0), where="row 7")
    with pytest.raises(DataError, match="aspect ratio 250 is above 200"):
        image_patches(Image.new("RGB", (500, 2)), ImagePatching(), where="row 8")


def test_images_that_do_not_match_their_grids_or_tokens_are_refused_in_one_line():
    args = _args()
    model = _model(args, seed=0)
    tokens, positions, pixels, _ = _batch(args.vision.patch_dim)
    inputs = _per_row(pixels)
    with torch.no_grad():
        short = inputs["pixel_values"][:, :-8]  # row 0 needs 28 patches
        with pytest.raises(ValueError, match=r"image_grid_thw makes up to 28 patches in a row, but pixel_values "
                                             r"\(2, 20, 96\) holds 20 per row"):
            model(tokens, positions=positions, pixel_values=short, image_grid_thw=inputs["image_grid_thw"])
        fewer = inputs["image_grid_thw"].clone()
        fewer[0, 1] = 0  # row 0 shows one image where its text has two images' tokens
        with pytest.raises(ValueError, match=r"rows have \[7, 6\] <\|image_pad\|> tokens \(id 90\) but their "
                                             r"images make \[6, 6\] merged patches"):
            model(tokens, positions=positions, pixel_values=inputs["pixel_values"], image_grid_thw=fewer)


def test_a_batch_without_images_still_trains_every_tower_parameter():
    """A data-parallel rank whose rows show no image runs the tower on nothing: every tower parameter gets a zero
    gradient, so that sharded data parallelism reduces the same tensors on every rank."""
    args = _args()
    model = _model(args, seed=0).train()
    tokens = torch.randint(0, 80, (2, 16))
    model(tokens, pixel_values=torch.zeros(2, 0, args.vision.patch_dim),
          image_grid_thw=torch.zeros(2, 0, 3, dtype=torch.long)).sum().backward()
    for name, param in model.visual.named_parameters():
        assert param.grad is not None and not param.grad.any(), name
