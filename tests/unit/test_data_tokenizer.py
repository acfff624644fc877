"""Tokenizers: both file formats, the shipped tokenizer, Llama 3's format, and training a tokenizer."""

import base64
import json
import os
import pickle
import random
import shutil

import pytest

from tests.conftest import TOKENIZER
from torchtitan.data import build_tokenizer, load_pydocs_documents
from torchtitan.data.tokenizer import LLAMA3_SPECIAL_TOKENS, HFTokenizer, TiktokenTokenizer

# Non-ASCII (accents, CJK, emoji, combining marks), whitespace runs, digits, contractions, and
# special-token strings that must stay plain text.
SAMPLES = [
    "",
    "Hello, world!",
    "naïve café — résumé 数据 🙂 e\u0301 \u00a0nbsp",
    "  leading spaces\r\n\ttabs\n\n\nnewlines  ",
    "It's 12345 o'clock; they'LL see",
    "a <|begin_of_text|> b <|end_of_text|><|pad|>",
    "".join(map(chr, range(1, 300))),
]


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")  # shown by pytest when a test fails
    return random.Random(seed)


def random_texts(rng, count):
    pieces = [*"abcXYZ019 .,'\n\t", "é", "数", "🙂", "\u0301", "'s", "  ", "<|end_of_text|>", "def ", "ing"]
    return ["".join(rng.choices(pieces, k=rng.randrange(0, 50))) for _ in range(count)]


@pytest.fixture(scope="module", params=["tokenizer.model", "tokenizer.json"])
def shipped(request):
    return build_tokenizer(str(TOKENIZER), request.param)


def test_shipped_tokenizer_round_trips_in_both_formats(shipped, rng):
    assert shipped.vocab_size == 2048
    assert (shipped.bos_id, shipped.eos_id, shipped.pad_id) == (0, 1, 2)
    for text in SAMPLES + random_texts(rng, 50):
        ids = shipped.encode(text)
        assert shipped.decode(ids) == text
        assert all(3 <= i < shipped.vocab_size for i in ids)  # specials only where asked for
        assert shipped.encode(text, bos=True, eos=True) == [0, *ids, 1]
    assert shipped.encode_batch(SAMPLES, eos=True) == [shipped.encode(t, eos=True) for t in SAMPLES]
    assert shipped.decode([0, *shipped.encode("hi"), 1]) == "<|begin_of_text|>hi<|end_of_text|>"


def test_shipped_formats_give_identical_ids(rng):
    tiktoken_tok = build_tokenizer(str(TOKENIZER), "tokenizer.model")
    hf_tok = build_tokenizer(str(TOKENIZER), "tokenizer.json")
    assert isinstance(tiktoken_tok, TiktokenTokenizer) and isinstance(hf_tok, HFTokenizer)
    texts = SAMPLES + random_texts(rng, 300) + load_pydocs_documents("validation")
    assert tiktoken_tok.encode_batch(texts) == hf_tok.encode_batch(texts)
    # The folder default is the faster tiktoken file.
    assert isinstance(build_tokenizer(str(TOKENIZER)), TiktokenTokenizer)


def test_tokenizers_survive_pickling(shipped):
    copy = pickle.loads(pickle.dumps(shipped))
    text = "a <|begin_of_text|> b"
    assert copy.encode(text) == shipped.encode(text)
    assert shipped.bos_id not in copy.encode(text)


def write_llama3_style_model(folder, ranks):
    folder.mkdir(exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()]
    (folder / "tokenizer.model").write_text("".join(lines))


def test_llama3_format_without_config_appends_256_llama3_specials(tmp_path):
    # Llama 3's shape: 128000 BPE ranks (all bytes, then distinct multi-byte tokens), no config.
    tokens = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += [bytes([a, b, c]) for a in range(97, 123) for b in range(97, 123) for c in range(256)]
    ranks = {token: rank for rank, token in enumerate(tokens[:128000])}
    write_llama3_style_model(tmp_path, ranks)
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == 128256 and len(LLAMA3_SPECIAL_TOKENS) == 256
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (128000, 128001, None)
    special = {t: 128000 + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
    assert special["<|start_header_id|>"] == 128006 and special["<|eot_id|>"] == 128009
    assert tok.decode([128006, 128007, 128009]) == "<|start_header_id|><|end_header_id|><|eot_id|>"
    text = "zebra 数据 <|eot_id|>"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 128000


def test_tiktoken_specials_and_names_come_from_tokenizer_config(tmp_path):
    # A small rank file: ranks from 3 on, specials at 0..2 named in the config, as the shipped one.
    shutil.copy(TOKENIZER / "tokenizer.model", tmp_path)
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"},
              "added_tokens_decoder": {"0": {"content": "<s>"}, "1": {"content": "</s>"}, "2": {"content": "<x>"}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, None, 2048)
    assert tok.decode(tok.encode("<s>x</s>", bos=True)) == "<s><s>x</s>"


def test_tokenizer_file_choice_and_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*tokenizer\.model, tokenizer\.json"):
        build_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.model, tokenizer\.json"):
        build_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=r"'vocab\.txt'.*valid: tokenizer\.model, tokenizer\.json"):
        build_tokenizer(str(TOKENIZER), "vocab.txt")
    # A SentencePiece-style binary tokenizer.model is passed over for the tokenizer.json beside it.
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    assert isinstance(build_tokenizer(str(tmp_path)), HFTokenizer)
    with pytest.raises(ValueError, match="not a tiktoken BPE file"):
        build_tokenizer(str(tmp_path), "tokenizer.model")
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_text("YQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"tokenizer\.model: line 2 is not"):
        build_tokenizer(str(tmp_path))


def test_missing_special_token_is_named(tmp_path):
    shutil.copy(TOKENIZER / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"bos_token '<\|nope\|>' is not in the tokenizer's vocabulary"):
        build_tokenizer(str(tmp_path))
