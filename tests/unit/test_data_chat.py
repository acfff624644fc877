"""Chat data: conversations packed whole, trained on the assistant's tokens, layout-independent and resumable."""

import json
import pickle
import re

import pytest
import torch

from tests.conftest import REPO
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import import_custom_modules, validate_config
from torchtitan.data import DataError, build_dataloader, build_tokenizer, document_positions
from torchtitan.data.chat import PackedChatDataset, encode_conversation, load_pydocs_chat
from torchtitan.data.chat_template import ChatTemplate
from torchtitan.data.config import Chat
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.data.sources import load_documents, register_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("assets/tokenizer")


def conversations(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = "list dict set the of a value key sort read write open file line number".split()
    out = []
    for i in range(n):
        def text(k):
            return " ".join(words[j] for j in torch.randint(0, len(words), (k,), generator=g).tolist())
        turns = [{"role": "system", "content": text(3)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            turns += [{"role": "user", "content": text(int(torch.randint(1, 8, (1,), generator=g)))},
                      {"role": "assistant", "content": text(int(torch.randint(0, 10, (1,), generator=g)))}]
        out.append(turns)
    return out


def loader(tokenizer, name, **overrides):
    kwargs = dict(dataset=name, dataset_path=None, seq_len=128, local_batch_size=2, dp_rank=0, dp_world_size=1,
                  dataset_format="chat")
    return build_dataloader(tokenizer, **{**kwargs, **overrides})


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_rows_hold_whole_conversations_with_loss_on_the_assistant_only(tokenizer):
    data = conversations(40)
    register_dataset("chat_rows", lambda split: data, "chat")
    template = ChatTemplate(tokenizer.chat_template)
    expected = [encode_conversation(tokenizer, template, m) for m in data]
    placed = 0
    for batch in take(loader(tokenizer, "chat_rows"), 6):
        assert torch.equal(batch.positions, document_positions(batch.document_ids))
        for row in range(2):
            ids = batch.document_ids[row]
            for doc in ids.unique().tolist():
                span = (ids == doc).nonzero().flatten()
                tokens, labels = batch.input_ids[row, span], batch.labels[row, span]
                if tokens[0] != tokenizer.bos_id:  # the padding document: no loss
                    assert (labels == IGNORE_INDEX).all() and doc == ids.max()
                    continue
                want_tokens, want_labels = expected[placed]
                assert tokens.tolist() == want_tokens.tolist() and labels.tolist() == want_labels.tolist()
                placed += 1
    assert placed > 12
    # Only assistant text (and its closing EOS) is trained: the decoded labels hold no user or system words.
    inputs, labels = expected[0]
    trained = tokenizer.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
    assistant = "".join(m["content"] + "<|end_of_text|>" for m in data[0] if m["role"] == "assistant")
    assert trained == assistant


def test_train_on_all_trains_every_next_token(tokenizer):
    data = conversations(5)
    register_dataset("chat_all", lambda split: data, "chat")
    batch = next(iter(loader(tokenizer, "chat_all", chat=Chat(train_on="all"))))
    real = batch.document_ids != batch.document_ids.max(dim=1, keepdim=True).values
    assert (batch.labels[real][:-1] != IGNORE_INDEX).all()


def test_every_layout_and_a_resume_see_the_same_rows(tokenizer):
    data = conversations(30, seed=1)
    register_dataset("chat_layouts", lambda split: data, "chat")
    single = take(loader(tokenizer, "chat_layouts", local_batch_size=4), 6)
    for rank in range(2):
        ours = take(loader(tokenizer, "chat_layouts", dp_rank=rank, dp_world_size=2, num_workers=rank * 2), 6)
        for mine, whole in zip(ours, single, strict=True):
            for field, full in zip(mine, whole):
                assert torch.equal(field, full.view(2, 2, -1)[:, rank])
    interrupted = loader(tokenizer, "chat_layouts", local_batch_size=4)
    it = iter(interrupted)
    for _ in range(3):
        next(it)
    resumed = loader(tokenizer, "chat_layouts", local_batch_size=2, dp_rank=1, dp_world_size=2)
    resumed.load_state_dict(pickle.loads(pickle.dumps(interrupted.state_dict())))
    for mine, whole in zip(take(resumed, 3), single[3:], strict=True):
        assert torch.equal(mine.input_ids, whole.input_ids.view(2, 2, -1)[:, 1])


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_conversations_are_cut_or_dropped_and_counted(tokenizer, overlong):
    long = [{"role": "user", "content": "read the file " * 60}, {"role": "assistant", "content": "ok"}]
    data = [conversations(1)[0], long, conversations(2)[1]]
    register_dataset("chat_long", lambda split: data, "chat")
    chat_loader = loader(tokenizer, "chat_long", chat=Chat(overlong=overlong), local_batch_size=1)
    batches = take(chat_loader, 3)
    key = f"conversations_{'truncated' if overlong == 'truncate' else 'dropped'}"
    assert chat_loader.counts[key] >= 1
    assert chat_loader.state_dict()["counts"] == chat_loader.counts
    cut = [b for b in batches if b.document_ids[0].max() == 0]  # one conversation filling the row
    assert bool(cut) == (overlong == "truncate")


def test_bad_rows_give_one_line_errors_naming_the_row(tokenizer, tmp_path):
    good = conversations(3)
    cases = {
        "no_messages.jsonl": ([{"messages": good[0]}, {"text": "hi"}], "row 1 has no value in column 'messages'"),
        "bad_role.jsonl": ([{"messages": good[0]}, {"messages": good[1]},
                            {"messages": [{"role": "robot", "content": "x"}]}],
                          "bad_role.jsonl: row 2: chat template refused the conversation: unknown chat role 'robot'"),
        "not_dict.jsonl": ([{"messages": ["hello"]}], "row 0: message 0 must be a dict with 'role' and 'content'"),
        "not_list.jsonl": ([{"messages": "hello"}], "row 0: column 'messages' holds str"),
    }
    for name, (rows, message) in cases.items():
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError, match=message) as error:
            take(loader(tokenizer, "x", dataset_path=str(path)), 3)
        assert "\n" not in str(error.value)
    failing = ChatTemplate("{% if messages | length > 2 %}{{ raise_exception('too long') }}{% endif %}{{ 'x' }}")
    dataset = PackedChatDataset([good[0][:2], good[1]], tokenizer, seq_len=16, template=failing)
    with pytest.raises(DataError, match="^dataset conversations: row 1: chat template refused the conversation: "
                                        "too long"):
        list(dataset)


def chat_file(path, rows):
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in rows))
    return path


def data_error(tokenizer, path, **overrides):
    """The one-line DataError that loading the first batch of chat data at ``path`` raises."""
    with pytest.raises(DataError) as error:
        take(loader(tokenizer, "x", dataset_path=str(path), **overrides), 1)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_errors_name_the_file_and_its_own_row(tokenizer, tmp_path):
    good = conversations(3)
    # A lone surrogate: Python's json reads it, the reader refuses its whole block; the row is found in the file,
    # and the reader's own count within the block is not repeated.
    surrogate = chat_file(tmp_path / "surrogate.jsonl", good[:1])
    with open(surrogate, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}\n')
    message = data_error(tokenizer, surrogate)
    assert message.startswith(f"{surrogate}: row 1: cannot read: ") and re.findall(r"row \d+", message) == ["row 1"]
    # In a folder, rows count from 0 in each file.
    folder = tmp_path / "folder"
    folder.mkdir()
    chat_file(folder / "a.jsonl", good)
    chat_file(folder / "b.jsonl", [good[0], [{"role": "robot", "content": "x"}]])
    assert data_error(tokenizer, folder).startswith(
        f"{folder / 'b.jsonl'}: row 1: chat template refused the conversation: unknown chat role 'robot'")
    (folder / "b.jsonl").write_text("")
    assert data_error(tokenizer, folder) == f"{folder / 'b.jsonl'}: the file is empty (no rows)"
    # A conversation whose assistant text cannot be located (a template without generation blocks that
    # rewrites the content and renders earlier turns differently later: Qwen3 taking reasoning out of the last
    # turn of a multi-turn conversation).
    qwen3 = ChatTemplate((REPO / "tests" / "data" / "chat_templates" / "qwen3.jinja").read_text())
    inline_reasoning = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                        {"role": "user", "content": "r"}, {"role": "assistant", "content": "<think>r</think>b"}]
    unlocatable = chat_file(tmp_path / "think.jsonl", [good[0], inline_reasoning])
    dataset = PackedChatDataset(load_documents("x", str(unlocatable), "train", "messages", "chat"), tokenizer,
                                seq_len=256, template=qwen3)
    with pytest.raises(DataError, match=f"^{re.escape(str(unlocatable))}: row 1: cannot locate the assistant's text"):
        next(iter(dataset))


def test_chat_data_with_nothing_to_train_is_refused_naming_it(tokenizer, tmp_path):
    questions = [[{"role": "user", "content": "hello"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]]
    path = chat_file(tmp_path / "questions.jsonl", questions)
    assert data_error(tokenizer, path) == (
        f"dataset {str(path)!r}: none of its 2 conversations has an assistant token to train on (an 'assistant' "
        "message the chat template renders, within seq_len 128), so every step's loss would be 0; add assistant "
        "replies or set training.chat.train_on = 'all'")
    # Some conversations without a reply among others: they train, on the others' assistant tokens.
    mixed = chat_file(tmp_path / "mixed.jsonl", questions + conversations(4))
    for batch in take(loader(tokenizer, "x", dataset_path=str(mixed)), 3):
        assert (batch.labels != IGNORE_INDEX).any()
    batch = take(loader(tokenizer, "x", dataset_path=str(path), chat=Chat(train_on="all")), 1)[0]
    assert (batch.labels != IGNORE_INDEX).sum() > 10


def test_training_on_bad_chat_data_stops_with_one_line(tmp_path):
    from tests.bad_input import assert_one_line_error, snapshot
    from torchtitan.train import main

    questions = chat_file(tmp_path / "questions.jsonl", [[{"role": "user", "content": "hello"}]] * 3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    before = snapshot(tmp_path)
    for path, needle in ((questions, "has an assistant token to train on"), (empty, "the file is empty")):
        assert_one_line_error(main, ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                                     str(tmp_path / "run"), "--training.dataset_format", "chat",
                                     "--training.dataset_path", str(path), "--training.steps", "1",
                                     "--training.seq_len", "64", "--training.local_batch_size", "1"],
                              str(path), needle, unchanged=before)


def test_data_where_no_conversation_fits_is_an_error_not_a_hang(tokenizer):
    data = conversations(3)
    for infinite in (True, False):
        dataset = PackedChatDataset(data, tokenizer, seq_len=4, overlong="drop", infinite=infinite)
        with pytest.raises(DataError, match="no conversation fits a row of seq_len 4 tokens with "
                                            "training.chat.overlong = 'drop'"):
            next(iter(dataset))


def test_null_content_renders_as_an_absent_message_content(tokenizer):
    data = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]]
    batch, _ = next(iter(PackedChatDataset(data, tokenizer, seq_len=32)))
    assert "<|assistant|>" in tokenizer.decode(batch[0, 0].tolist())  # the stacked fields: input_ids first


def test_pydocs_chat_asks_about_documented_definitions(tokenizer):
    data = load_pydocs_chat("validation")
    assert len(data) > 20
    template = ChatTemplate(tokenizer.chat_template)
    for messages in data[:20]:
        assert messages[-1]["role"] == "assistant" and messages[-2]["content"].count("`") == 2
        inputs, labels = encode_conversation(tokenizer, template, messages)
        assert (labels != IGNORE_INDEX).any() and inputs[0] == tokenizer.bos_id


def validate(*flags, config="train_configs/debug_model.toml", world_size=1):
    cfg, sources = load_config(["--job.config_file", config, *flags])
    import_custom_modules(cfg, sources)
    validate_config(cfg, sources, world_size=world_size)
    return cfg


def test_config_matches_the_dataset_format_and_the_model():
    from torchtitan.models.shared.document_masking import DocumentMasking

    cfg = validate("--training.dataset", "pydocs_chat", "--training.dataset_format", "chat")
    assert DocumentMasking.from_config(cfg.model, cfg.training) == DocumentMasking(True, True)
    cfg = validate()
    assert DocumentMasking.from_config(cfg.model, cfg.training) == DocumentMasking(False, False)
    with pytest.raises(ConfigError, match="training.dataset = 'pydocs_chat' holds chat data, not text"):
        validate("--training.dataset", "pydocs_chat")
    with pytest.raises(ConfigError, match="training.dataset = 'pydocs' holds text data, not chat"):
        validate("--training.dataset_format", "chat")
    with pytest.raises(ConfigError, match="model.attention_mask = 'auto' is ambiguous: training data is text and "
                                          "validation data chat"):
        validate("--validation.enable", "--validation.dataset", "pydocs_chat", "--validation.dataset_format", "chat")
    validate("--validation.enable", "--validation.dataset", "pydocs_chat", "--validation.dataset_format", "chat",
             "--model.attention_mask", "causal", "--model.positions", "global")
    with pytest.raises(ConfigError, match="model.attention_mask = 'block_causal' needs a model whose forward takes "
                                          "document_ids="):
        validate("--model.attention_mask", "block_causal", config="examples/nanogpt/nanogpt.toml")
