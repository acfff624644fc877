"""The generation engine with images: cached greedy generation of prompts that show pictures (batched, left-padded,
an image cut by a prefill chunk; Qwen3-VL and the hybrid Qwen3.5) equals a plain loop that runs the whole sequence
with its images every step."""

import pytest
import torch

from torchtitan.data.images import ImagePatching, image_patches, mrope_positions
from torchtitan.data.shapes import shapes_sample
from torchtitan.generation import GenerationEngine
from torchtitan.generation.sampling import SamplingConfig
from torchtitan.models.qwen3_vl import Qwen3VL
from torchtitan.protocols.train_spec import get_train_spec

PATCHING = ImagePatching(min_pixels=0)


def _model(seed: int, family: str = "qwen3_vl") -> Qwen3VL:
    spec = get_train_spec(family)
    args = spec.flavors["debugmodel"].finalize(2052, 128)
    torch.manual_seed(seed)
    model = spec.model_cls(args)
    model.init_weights(seed)
    with torch.no_grad():  # away from the initial values, so that the images matter to the tokens chosen
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def _prompt(texts: list[list[int]], pictures: list) -> tuple[list[int], list]:
    """Text pieces with a picture between each two: <|vision_start|> <|image_pad|> x merged <|vision_end|>."""
    images = [image_patches(p, PATCHING) for p in pictures]
    tokens = [0, *texts[0]]
    for (patches, grid), text in zip(images, texts[1:]):
        tokens += [2048, *[2051] * (len(patches) // 4), 2049, *text]
    return tokens, images


def _no_cache(model, prompt: list[int], images, steps: int) -> list[int]:
    """Greedy, every step the whole sequence with its images and M-RoPE positions."""
    from torchtitan.data.images import pad_row_images
    pixel_values, grids = pad_row_images([[(torch.from_numpy(p), g) for p, g in images]],
                                         model.args.vision.patch_dim)
    tokens = list(prompt)
    prompt_positions = mrope_positions(tokens, [g for _, g in images], 2051, 2)
    shown = torch.tensor(tokens) == 2051
    prompt_index = torch.where(shown, shown.cumsum(0) - 1, -1)
    with torch.no_grad():
        for step in range(steps):
            # Generated tokens are text, whatever their id (a random model may choose <|image_pad|>).
            after = prompt_positions.max() + 1 + torch.arange(step)
            positions = torch.cat([prompt_positions, after[:, None].expand(-1, 3)])[None]
            image_index = torch.cat([prompt_index, torch.full((step,), -1)])[None]
            logits = model(torch.tensor([tokens]), positions=positions, pixel_values=pixel_values,
                           image_grid_thw=grids, image_index=image_index)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("family,prefill_chunk", [("qwen3_vl", 256), ("qwen3_vl", 7), ("qwen3_5", 7)])
def test_cached_greedy_generation_with_images_equals_the_no_cache_path(family, prefill_chunk):
    model = _model(seed=int(torch.randint(0, 10_000, ())), family=family)
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    words = lambda n: torch.randint(3, 2000, (n,), generator=g).tolist()  # noqa: E731
    prompts = [_prompt([words(3), words(5), words(2)], [shapes_sample(1).image, shapes_sample(2, size=96).image]),
               _prompt([words(9), words(4)], [shapes_sample(3, size=128).image]),
               (list([0, *words(6)]), [])]  # text only, beside the others
    engine = GenerationEngine(model, prefill_chunk=prefill_chunk)
    done = engine.generate([p for p, _ in prompts], SamplingConfig(max_new_tokens=12, temperature=0),
                           images=[i for _, i in prompts])
    for (prompt, images), completion in zip(prompts, done):
        assert completion.tokens == _no_cache(model, prompt, images, 12)


def test_images_that_do_not_match_the_prompt_are_refused_in_one_line():
    model = _model(seed=0)
    prompt, images = _prompt([[5, 6], [7]], [shapes_sample(1).image])
    engine = GenerationEngine(model)
    with pytest.raises(ValueError, match=r"prompt 0 has 4 image tokens \(id 2051\) but its 2 images make 8 merged"):
        engine.generate([prompt], SamplingConfig(max_new_tokens=2, temperature=0), images=[images * 2])
    with pytest.raises(ValueError, match="images holds 2 lists for 1 prompts"):
        engine.generate([prompt], SamplingConfig(max_new_tokens=2, temperature=0), images=[images, images])
