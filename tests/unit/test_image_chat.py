"""Image conversations: read from JSONL with paths, parquet with bytes and a Hugging Face Image column alike, each
<|image_pad|> expanded to its image's merged patches, packed without splitting an image, layout-independent, and the
packed rows through Qwen3-VL equal each conversation on its own; bad images and rows are one line."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.bad_input import assert_one_line_error, snapshot
from torchtitan import train
from torchtitan.data import build_dataloader, build_tokenizer
from torchtitan.data.config import Chat
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.data.image_chat import ImageChat
from torchtitan.data.images import ImagePatching, image_patches, mrope_positions
from torchtitan.data.shapes import shapes_sample
from torchtitan.models.qwen3_vl import Qwen3VL
from torchtitan.models.qwen3_vl.args import qwen3_vl_flavors
from torchtitan.models.shared.vision_language import image_chat

IMAGE_PAD = 2051
PATCHING = ImagePatching(min_pixels=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("assets/tokenizer_vision")


def _pictures(n: int, seed: int) -> list[Image.Image]:
    """Random RGB pictures of odd sizes (one to three merge blocks a side)."""
    g = np.random.default_rng(seed)
    return [Image.fromarray(g.integers(0, 256, (int(g.integers(20, 100)), int(g.integers(20, 100)), 3),
                                       dtype=np.uint8)) for _ in range(n)]


def _conversations(pictures: list[Image.Image]) -> list[tuple[list[dict], list[int]]]:
    """Conversations showing 0, 1 or 2 of the pictures, as (messages, the pictures' indexes)."""
    out, used = [], 0
    for i in range(len(pictures) // 2 + 3):
        shown = list(range(used, min(used + i % 3, len(pictures))))
        used += len(shown)
        content = [{"type": "image"} for _ in shown] + [{"type": "text", "text": f"what is in picture {i}?"}]
        out.append(([{"role": "user", "content": content},
                     {"role": "assistant", "content": [{"type": "text", "text": "a few dots " * (1 + i % 2)}]}],
                    shown))
    return out


def _write(tmp_path, pictures, conversations, form: str):
    """The conversations as a data file of ``form``: jsonl (paths), parquet (bytes) or hf (an Image column)."""
    import datasets
    import io
    folder = tmp_path / form
    folder.mkdir()
    if form == "jsonl":
        (folder / "pictures").mkdir()
        for k, picture in enumerate(pictures):
            picture.save(folder / "pictures" / f"{k}.png")
        rows = [{"messages": m, "images": [f"pictures/{k}.png" for k in shown]} for m, shown in conversations]
        (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return folder / "data.jsonl"

    def png(picture):
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        return buffer.getvalue()
    rows = {"messages": [m for m, _ in conversations],
            "images": [[{"bytes": png(pictures[k]), "path": None} for k in shown] for _, shown in conversations]}
    dataset = datasets.Dataset.from_dict(rows)
    if form == "hf":  # the column typed as images: `datasets` decodes them to PIL images when read
        dataset = dataset.cast_column("images", datasets.List(datasets.Image()))
    dataset.to_parquet(str(folder / "data.parquet"))
    return folder / "data.parquet"


def _loader(tokenizer, path, seq_len=128, train_on="assistant", **kwargs):
    chat = Chat(image_min_pixels=0, train_on=train_on)
    images = ImageChat(PATCHING, IMAGE_PAD, chat.images_column, chat.messages_column)
    layout = dict(local_batch_size=2, dp_rank=0, dp_world_size=1)
    return build_dataloader(tokenizer, dataset="shapes", dataset_path=str(path), seq_len=seq_len,
                            dataset_format="chat", chat=chat, image_chat=images, infinite=False,
                            **{**layout, **kwargs})


def test_jsonl_paths_parquet_bytes_and_an_image_column_give_the_same_batches_of_expanded_images(tokenizer, tmp_path):
    pictures = _pictures(7, seed=int(torch.randint(0, 10_000, ())))
    conversations = _conversations(pictures)
    batches = {form: list(_loader(tokenizer, _write(tmp_path, pictures, conversations, form)))
               for form in ("jsonl", "parquet", "hf")}
    for other in ("parquet", "hf"):
        assert len(batches[other]) == len(batches["jsonl"])
        for a, b in zip(batches["jsonl"], batches[other]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    # Each placed conversation: its images' patches in order, one <|image_pad|> per merged patch, its M-RoPE
    # positions, and no image token trained or predicted.
    expected = iter(conversations)
    shown = 0
    for batch in batches["jsonl"]:
        for row in range(batch.input_ids.shape[0]):
            ids = batch.document_ids[row]
            patches = [image_patches(pictures[k].convert("RGB"), PATCHING) for k in range(len(pictures))]
            row_patches, row_grids = [], []
            documents = ids.unique().tolist()
            pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
            if (batch.input_ids[row][ids == documents[-1]] == pad).all():  # the padding, unless the row is full
                documents = documents[:-1]
            for document in documents:
                messages, images = next(expected)
                at = ids == document
                tokens = batch.input_ids[row][at]
                grids = [patches[k][1] for k in images]
                assert int((tokens == IMAGE_PAD).sum()) == sum(t * h * w // 4 for t, h, w in grids)
                assert torch.equal(batch.positions[row][at], mrope_positions(tokens.tolist(), grids, IMAGE_PAD, 2))
                labels = batch.labels[row][at]
                assert not (labels[tokens == IMAGE_PAD] != IGNORE_INDEX).any()
                assert not torch.isin(labels, torch.tensor([IMAGE_PAD, 2048, 2049])).any()
                row_patches += [torch.from_numpy(patches[k][0]) for k in images]
                row_grids += grids
                shown += len(images)
            n = sum(len(p) for p in row_patches)
            if row_patches:
                assert torch.equal(batch.pixel_values[row, :n], torch.cat(row_patches))
            assert not batch.pixel_values[row, n:].any()
            real = batch.image_grid_thw[row][batch.image_grid_thw[row].prod(-1) > 0]
            assert real.tolist() == [list(g) for g in row_grids]
    assert shown > 0


def test_a_conversation_cut_to_seq_len_is_cut_before_the_image_it_cannot_hold(tokenizer, tmp_path):
    pictures = [Image.new("RGB", (64, 64), (200, 10, 10)), Image.new("RGB", (96, 64), (10, 10, 200))]
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "image"},
                                             {"type": "text", "text": "two"}, {"type": "image"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red then blue"}]}]
    path = _write(tmp_path, pictures, [(messages, [0, 1])], "jsonl")
    # The first image's 4 tokens sit at 10-13 between <|vision_start|> (9) and <|vision_end|> (14); the second's 6
    # at 18-23.
    for seq_len, kept in ((12, 0), (16, 4), (22, 4), (30, 10)):
        loader = _loader(tokenizer, path, seq_len=seq_len, local_batch_size=1, train_on="all")
        batch = next(iter(loader))
        assert loader.counts["conversations_truncated"] == 1  # the conversation is 40 tokens
        tokens = batch.input_ids[0][batch.document_ids[0] == 0]
        assert int((tokens == IMAGE_PAD).sum()) == kept
        assert int(batch.image_grid_thw[0].prod(-1).sum()) // 4 == kept  # the images kept are whole
        assert 2048 not in tokens[-2:].tolist()  # no <|vision_start|> left without its image


def test_every_data_parallel_rank_gets_its_rows_with_their_images(tokenizer, tmp_path):
    pictures = _pictures(9, seed=3)
    path = _write(tmp_path, pictures, _conversations(pictures), "jsonl")
    single = list(_loader(tokenizer, path, local_batch_size=2))
    for rank in range(2):
        mine = list(_loader(tokenizer, path, local_batch_size=1, dp_rank=rank, dp_world_size=2))
        assert len(mine) == len(single)
        for ours, whole in zip(mine, single):
            for field in ("input_ids", "labels", "document_ids", "positions", "image_index"):
                assert torch.equal(getattr(ours, field)[0], getattr(whole, field)[rank])
            n = int(ours.image_grid_thw[0].prod(-1).sum())
            assert torch.equal(ours.pixel_values[0, :n], whole.pixel_values[rank, :n])


def test_packed_rows_through_the_model_equal_each_conversation_alone(tokenizer):
    """Block-causal attention, per-document M-RoPE positions and per-row images: the logits of a packed row's
    conversations equal those of each conversation run on its own (fp32)."""
    rows = [{"messages": shapes_sample(i, seed=5, size=64 + 32 * (i % 2)).messages(),
             "images": [shapes_sample(i, seed=5, size=64 + 32 * (i % 2)).image]} for i in range(6)]
    from torchtitan.data.sources import register_dataset
    register_dataset("packed_shapes", lambda split: rows, "chat")
    args = qwen3_vl_flavors["debugmodel"].finalize(tokenizer.vocab_size, 256)
    torch.manual_seed(0)
    model = Qwen3VL(args)
    model.init_weights(0)
    model.eval()
    chat = Chat(image_min_pixels=0)
    loader = build_dataloader(tokenizer, dataset="packed_shapes", dataset_path=None, seq_len=256, local_batch_size=1,
                              dp_rank=0, dp_world_size=1, dataset_format="chat", chat=chat, infinite=False,
                              image_chat=image_chat(args, chat))
    batch = next(iter(loader))
    assert int(batch.document_ids.max()) >= 3  # several conversations share the row
    with torch.no_grad():
        packed = model(batch.input_ids, document_ids=batch.document_ids, positions=batch.positions,
                       pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                       image_index=batch.image_index)
        start = 0
        for k, row in enumerate(rows[:int(batch.document_ids.max())]):
            at = batch.document_ids[0] == k
            n = int(batch.image_grid_thw[0, k].prod())
            alone = model(batch.input_ids[:, at], positions=batch.positions[:, at],
                          pixel_values=batch.pixel_values[:, start:start + n],
                          image_grid_thw=batch.image_grid_thw[:, k:k + 1])
            start += n
            assert (packed[:, at] - alone).abs().max().item() <= 1e-4


def _trainer_args(tmp_path, data, *extra):
    return ["--job.config_file", "train_configs/vlm_debug.toml", "--training.steps", "1", "--validation.no_enable",
            "--checkpoint.no_enable", f"--job.dump_folder={tmp_path / 'dump'}", "--training.dataset_path", str(data),
            *extra]


def test_bad_images_and_rows_stop_training_with_one_line_naming_the_row_and_file(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(folder / "good.png")
    Image.new("RGB", (6, 6), (1, 2, 3)).save(folder / "tiny.png")
    Image.new("RGB", (1024, 1024), (1, 2, 3)).save(folder / "huge.png")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    ask = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
           {"role": "assistant", "content": "grey"}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
           {"role": "assistant", "content": "two"}]
    cases = {
        "missing": ([ask, ["missing.png"]], ["row 1", "missing.png", "no such image file"]),
        "corrupt": ([ask, ["corrupt.png"]], ["row 1", "corrupt.png", "not a readable image"]),
        "tiny": ([ask, ["tiny.png"]], ["row 1", "tiny.png", "too small for one 32 x 32 block"]),
        "placeholders": ([two, ["good.png"]], ["row 1", "shows 2 images", "holds 1"]),
        "huge": ([ask, ["huge.png"]], ["row 1", "huge.png", "1024 image tokens, more than seq_len 256"]),
    }
    for name, ((messages, images), needles) in cases.items():
        data = folder / f"{name}.jsonl"
        rows = [{"messages": ask, "images": ["good.png"]}, {"messages": messages, "images": images}]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        before = snapshot(folder)
        assert_one_line_error(train.main, _trainer_args(tmp_path, data, "--training.chat.image_min_pixels", "0"),
                              str(data), *needles, unchanged=before)


def test_the_vision_tokenizer_is_the_debug_one_with_four_tokens_appended_and_renders_images_like_transformers():
    import transformers
    base = build_tokenizer("assets/tokenizer")
    text = "def f(x):\n    return {'colour': x} # <|image_pad|> in text stays text"
    for file in ("tokenizer.model", "tokenizer.json"):
        vision = build_tokenizer("assets/tokenizer_vision", file)
        assert vision.vocab_size == base.vocab_size + 4
        assert vision.encode(text) == base.encode(text)
        assert vision.encode_chat("<|vision_start|><|vision_end|><|vision_pad|><|image_pad|>")[0] == [
            2048, 2049, 2050, 2051]
    messages = shapes_sample(3).messages()
    hf = transformers.AutoTokenizer.from_pretrained("assets/tokenizer_vision")
    theirs = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    from torchtitan.data.chat_template import ChatTemplate, chat_ids
    vision = build_tokenizer("assets/tokenizer_vision")
    assert chat_ids(vision, ChatTemplate(vision.chat_template), messages) == list(theirs)
    assert theirs.count(IMAGE_PAD) == 1


@pytest.mark.parametrize("flags,needles", [
    (["--model.positions", "global"], ["model.positions", "M-RoPE positions per conversation"]),
    (["--model.hf_assets_path", "assets/tokenizer"], ["model.hf_assets_path", "not as the model's image token 2051"]),
    (["--model.name", "llama3"], ["training.dataset", "holds image conversations", "'llama3' cannot read"]),
])
def test_a_config_that_cannot_place_the_images_is_refused_before_training(tmp_path, flags, needles):
    argv = ["--job.config_file", "train_configs/vlm_debug.toml", "--training.steps", "1",
            f"--job.dump_folder={tmp_path / 'dump'}", *flags]
    assert_one_line_error(train.main, argv, *needles)
    assert not (tmp_path / "dump").exists()
