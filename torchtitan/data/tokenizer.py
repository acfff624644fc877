"""Tokenizers behind one interface, loaded from a folder of tokenizer assets.

Two file formats are understood, picked by the files present in the folder (the first usable one):

* ``tokenizer.model``: a tiktoken BPE file in Llama 3's format, one ``base64(token bytes) rank`` per
  line, read with Llama 3's pre-tokenizer pattern. Its special tokens are not in the file: they come
  from ``added_tokens_decoder`` in ``tokenizer_config.json`` when the folder has one, otherwise they are
  Llama 3's 256 special tokens numbered after the last BPE rank (128000..128255 for Llama 3 itself).
  A tokenizer.model in another format (e.g. SentencePiece) is passed over.
* ``tokenizer.json``: a Hugging Face ``tokenizers`` file (any model it supports).

``tokenizer_config.json`` may also name the BOS/EOS/PAD tokens (Llama 3's names are the default) and
hold a Jinja ``chat_template`` (see torchtitan.data.chat_template).
Both formats encode special-token strings that occur in text as ordinary text, so a document can
never forge a document boundary: BOS/EOS ids appear only where the caller asks for them. The one
exception is ``encode_chat``, for text rendered by a chat template, whose special-token strings are
the template's own markers (e.g. the EOS that ends a turn) and must become special tokens.
"""

from __future__ import annotations

import abc
import base64
import json
import pathlib
import re
from collections.abc import Callable, Sequence

import tiktoken
import tokenizers

# Llama 3's pre-tokenizer: contractions, letter runs (with one leading non-letter), digit groups of at
# most three, punctuation runs, newlines and other whitespace. Both formats use it for our tokenizer.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_NUM_SPECIAL_TOKENS = 256

# Llama 3's special tokens in id order (3.1 names; the ids that matter, 128000/1/6/7/9, match 3.0).
_LLAMA3_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED_SPECIALS + [
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_NUM_SPECIAL_TOKENS - len(_LLAMA3_NAMED_SPECIALS))
]

# Used when the folder has no tokenizer_config.json, or it omits them.
DEFAULT_SPECIAL_TOKENS = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "pad_token": None,
}


class Tokenizer(abc.ABC):
    """Text <-> token ids; BOS/EOS are added only when asked for."""

    # The file build_tokenizer loaded it from (pre-tokenized data records its hash).
    source_file: pathlib.Path | None = None

    # The Jinja chat template from tokenizer_config.json, or None when the folder has none.
    chat_template: str | None = None

    def __init__(
        self,
        token_ids: dict[str, int],
        bos_token: str,
        eos_token: str,
        pad_token: str | None,
        chat_template: str | None = None,
    ):
        def require(token: str, role: str) -> int:
            if token not in token_ids:
                raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary")
            return token_ids[token]

        self._bos_id = require(bos_token, "bos_token")
        self._eos_id = require(eos_token, "eos_token")
        self._pad_id = None if pad_token is None else require(pad_token, "pad_token")
        # Chat templates insert the special tokens by name, as strings.
        self._bos_token, self._eos_token, self._pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template

    @abc.abstractmethod
    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special-token strings treated as plain text."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Decode token ids to text; special tokens are kept, so decode inverts encode."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text rendered by a chat template, and each token's (start, end) character offsets.

        Unlike encode, special-token strings in text become special tokens: the template wrote them
        (BOS, the EOS ending each turn). As in transformers, so do such strings inside a message's
        content; data that must not contain them should be checked before rendering. The offsets let a
        character span of the rendered text (an assistant turn) be mapped to tokens. A token holding part
        of a multi-byte character spans that whole character, so consecutive tokens can share offsets
        (as Hugging Face tokenizers report).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement encode_chat")

    @property
    def special_tokens(self) -> frozenset[str]:
        """The strings of the tokens marked special (BOS, EOS, a template's end of turn such as <|im_end|>).

        Chat templates write them as markers; where a template has no generation blocks, the first special
        token after an assistant's content ends its trained text (data/chat_template.py).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement special_tokens")

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Encode text to token ids, optionally prefixed with BOS and suffixed with EOS."""
        return self._wrap(self._encode_texts([text])[0], bos, eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """Encode several texts at once (in parallel where the backend can); same result as encode on each."""
        return [self._wrap(ids, bos, eos) for ids in self._encode_texts(list(texts))]

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-text token."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of the end-of-text token."""
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        """Id of the padding token, or None if the tokenizer has none."""
        return self._pad_id

    @property
    def bos_token(self) -> str:
        """The beginning-of-text token's string."""
        return self._bos_token

    @property
    def eos_token(self) -> str:
        """The end-of-text token's string."""
        return self._eos_token

    @property
    def pad_token(self) -> str | None:
        """The padding token's string, or None if the tokenizer has none."""
        return self._pad_token


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (tokenizer.json); its post-processor is never applied."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str,
        eos_token: str,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ):
        self._tokenizer = tokenizer
        self._tokenizer.encode_special_tokens = True
        # encode_chat needs special tokens recognised. The flag is per tokenizer object, and flipping it
        # around each call would race with other threads, so encode_chat gets its own copy (made on
        # first use: most runs never call it).
        self._chat_tokenizer: tokenizers.Tokenizer | None = None
        # Read once: chat data asks for it every conversation. Added tokens not marked special (e.g. Qwen3's
        # <think>, <tool_call>) are text the model writes.
        self._special_tokens = frozenset(
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
        super().__init__(tokenizer.get_vocab(with_added_tokens=True), bos_token, eos_token, pad_token, chat_template)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # The flag is not part of the pickled tokenizer, so copies sent to
        # dataloader worker processes would otherwise lose it.
        self._tokenizer.encode_special_tokens = True
        if self._chat_tokenizer is not None:
            self._chat_tokenizer.encode_special_tokens = False

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        if len(texts) == 1:
            return [self._tokenizer.encode(texts[0], add_special_tokens=False).ids]
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._chat_tokenizer is None:
            self._chat_tokenizer = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
            self._chat_tokenizer.encode_special_tokens = False
        # The Python binding reports offsets in characters (not bytes) of the original text; they are
        # exactly what transformers' char_to_token searches, so masks built from them agree with it.
        encoding = self._chat_tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(offset) for offset in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def special_tokens(self) -> frozenset[str]:
        return self._special_tokens

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE (Llama 3's tokenizer.model format) with the Llama 3 pre-tokenizer pattern."""

    def __init__(
        self,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        bos_token: str,
        eos_token: str,
        pad_token: str | None = None,
        name: str = "tokenizer.model",
        chat_template: str | None = None,
        not_special: frozenset[str] = frozenset(),
    ):
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special_tokens
        )
        self._vocab_size = len(ranks) + len(special_tokens)
        # tiktoken matches every added token alike; the config's "special": false ones are told apart here.
        self._special_tokens = frozenset(special_tokens) - not_special
        super().__init__(special_tokens, bos_token, eos_token, pad_token, chat_template)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        # encode_ordinary never matches special tokens: their strings stay text.
        if len(texts) == 1:
            return [self._encoding.encode_ordinary(texts[0])]
        return self._encoding.encode_ordinary_batch(texts)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self._encoding.encode(text, allowed_special="all")
        # tiktoken's decode_with_offsets gives start offsets only, so derive (start, end) from each token's
        # bytes the way Hugging Face's byte-level tokenizers do: a token spans every character it holds
        # a byte of. `chars` counts the characters begun in the bytes so far (UTF-8 continuation bytes
        # are 0b10xxxxxx); a token starting with a continuation byte starts inside the last one begun.
        offsets = []
        chars = 0
        for token in self._encoding.decode_tokens_bytes(ids):
            start = chars - 1 if token[0] & 0xC0 == 0x80 else chars
            chars += sum(1 for byte in token if byte & 0xC0 != 0x80)
            offsets.append((start, chars))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    @property
    def special_tokens(self) -> frozenset[str]:
        return self._special_tokens

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


def read_tiktoken_ranks(path: pathlib.Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one ``base64(token bytes) rank`` per non-empty line."""
    ranks = {}
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise ValueError(
                    f"{path}: line {line_number} is not 'base64(token bytes) rank': {line[:80]!r}"
                ) from None
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: two tokens share a rank; every rank must be unique")
    return ranks


def _read_config(folder: pathlib.Path) -> dict:
    config_path = folder / "tokenizer_config.json"
    return json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}


def _special_token_names(config: dict) -> dict[str, str | None]:
    names = dict(DEFAULT_SPECIAL_TOKENS)
    for key in names:
        value = config.get(key)
        # HF configs store a token either as its string or as an AddedToken dict.
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            names[key] = value
    return names


def _chat_template(config: dict) -> str | None:
    template = config.get("chat_template")
    # Older Hugging Face configs may hold several named templates; the "default" one is the chat format.
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _load_tokenizer_json(folder: pathlib.Path, config: dict) -> Tokenizer:
    return HFTokenizer(
        tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")),
        **_special_token_names(config),
        chat_template=_chat_template(config),
    )


def _load_tokenizer_model(folder: pathlib.Path, config: dict) -> Tokenizer:
    path = folder / "tokenizer.model"
    ranks = read_tiktoken_ranks(path)
    added = config.get("added_tokens_decoder")
    not_special = frozenset()
    if added:
        special_tokens = {entry["content"]: int(token_id) for token_id, entry in added.items()}
        not_special = frozenset(entry["content"] for entry in added.values() if entry.get("special") is False)
    else:
        first = max(ranks.values()) + 1
        special_tokens = {token: first + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    clash = set(special_tokens.values()) & set(ranks.values())
    if clash:
        raise ValueError(f"{path}: special token ids {sorted(clash)[:5]} are also BPE ranks")
    return TiktokenTokenizer(
        ranks, special_tokens, name=str(path), **_special_token_names(config), chat_template=_chat_template(config),
        not_special=not_special,
    )


def is_tiktoken_file(path: pathlib.Path) -> bool:
    """Whether a tokenizer.model holds tiktoken ranks (Llama 3) rather than, e.g., a SentencePiece model."""
    with path.open("rb") as f:
        fields = f.readline(4096).split()
    return len(fields) == 2 and fields[1].isdigit() and re.fullmatch(rb"[A-Za-z0-9+/]+=*", fields[0]) is not None


# Tokenizer files by order of preference (tiktoken encodes about 3x faster), each with its loader.
TOKENIZER_FORMATS: dict[str, Callable[[pathlib.Path, dict], Tokenizer]] = {
    "tokenizer.model": _load_tokenizer_model,
    "tokenizer.json": _load_tokenizer_json,
}


def build_tokenizer(hf_assets_path: str, file_name: str | None = None) -> Tokenizer:
    """Load the tokenizer in the folder hf_assets_path: file_name, or the first usable format present."""
    folder = pathlib.Path(hf_assets_path)
    expected = ", ".join(TOKENIZER_FORMATS)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist; expected a folder with: {expected}")
    if file_name is not None and file_name not in TOKENIZER_FORMATS:
        raise ValueError(f"unknown tokenizer file {file_name!r}; valid: {expected}")
    for name, load in TOKENIZER_FORMATS.items():
        path = folder / name
        if file_name not in (None, name) or not path.is_file():
            continue
        if name == "tokenizer.model" and not is_tiktoken_file(path):
            if file_name is None:
                continue  # e.g. a SentencePiece model next to the tokenizer.json that describes it
            raise ValueError(f"{path} is not a tiktoken BPE file ('base64(token bytes) rank' lines)")
        tokenizer = load(folder, _read_config(folder))
        tokenizer.source_file = path  # what pre-tokenized data records, to refuse data of another tokenizer
        return tokenizer
    raise FileNotFoundError(f"no usable tokenizer file in {str(folder)!r}; looked for: {file_name or expected}")
