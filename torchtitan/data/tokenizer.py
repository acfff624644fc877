"""Tokenizer loading: turns a folder of tokenizer assets into a `Tokenizer`."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence

import tokenizers

# Llama 3 names, used when the folder has no tokenizer_config.json (or it omits them).
DEFAULT_SPECIAL_TOKENS = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "pad_token": None,
}


class Tokenizer:
    """Text <-> token ids, backed by a Hugging Face `tokenizers.Tokenizer`.

    BOS/EOS are added only when asked for, never by the underlying tokenizer's
    post-processor. Special-token strings that occur inside text are encoded as
    ordinary text, so a document cannot forge a document boundary.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str,
        eos_token: str,
        pad_token: str | None = None,
    ):
        self._tokenizer = tokenizer
        self._tokenizer.encode_special_tokens = True
        self._bos_id = self._require_id(bos_token, "bos_token")
        self._eos_id = self._require_id(eos_token, "eos_token")
        self._pad_id = None if pad_token is None else self._require_id(pad_token, "pad_token")

    def _require_id(self, token: str, role: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # The flag is not part of the pickled tokenizer, so copies sent to
        # dataloader worker processes would otherwise lose it.
        self._tokenizer.encode_special_tokens = True

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Encode text to token ids, optionally prefixed with BOS and suffixed with EOS."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, bos, eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """Encode several texts at once (in parallel); same result as encode on each."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, bos, eos) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Decode token ids to text; special tokens are kept, so decode inverts encode."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

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
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)


def _special_token_names(folder: pathlib.Path) -> dict[str, str | None]:
    names = dict(DEFAULT_SPECIAL_TOKENS)
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        for key in names:
            value = config.get(key)
            # HF configs store a token either as its string or as an AddedToken dict.
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                names[key] = value
    return names


def _load_tokenizer_json(path: pathlib.Path, special_tokens: dict[str, str | None]) -> Tokenizer:
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), **special_tokens)


# Tokenizer files by order of preference, each with its loader; new formats are added here.
_TOKENIZER_FORMATS: dict[str, Callable[[pathlib.Path, dict[str, str | None]], Tokenizer]] = {
    "tokenizer.json": _load_tokenizer_json,
}


def build_tokenizer(hf_assets_path: str) -> Tokenizer:
    """Load the tokenizer stored in the folder hf_assets_path (e.g. assets/tokenizer)."""
    folder = pathlib.Path(hf_assets_path)
    expected = ", ".join(_TOKENIZER_FORMATS)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist; expected a folder with: {expected}")
    for file_name, load in _TOKENIZER_FORMATS.items():
        path = folder / file_name
        if path.is_file():
            return load(path, _special_token_names(folder))
    raise FileNotFoundError(f"no tokenizer file in {str(folder)!r}; looked for: {expected}")
