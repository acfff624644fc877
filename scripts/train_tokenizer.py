"""Train a byte-level BPE tokenizer and write it in both formats the trainer reads.

    python scripts/train_tokenizer.py --vocab-size 2048 --output-dir assets/tokenizer [--input FILE_OR_FOLDER ...]

It trains on the train split of the built-in pydocs corpus, or on ``--input`` files in any format
``training.dataset_path`` accepts (json/jsonl/parquet/arrow/txt). The output folder gets:

* ``tokenizer.model``: tiktoken ranks in Llama 3's format (ids after the special tokens);
* ``tokenizer.json``: the same tokenizer for the ``tokenizers`` library;
* ``tokenizer_config.json``: BOS/EOS/PAD names, the special-token ids (``added_tokens_decoder``) and
  our chat template (``chat_template``, see torchtitan.data.chat_template).

Both files give identical ids: they share Llama 3's pre-tokenizer pattern, and tokenizer.json's merge
list is derived from the ranks (every split of a token into two tokens is a merge, prioritised by the
token's rank), which is how tiktoken merges. The script checks this on the training text, before the folder is
put in place. The output folder must be new or empty (torchtitan/output_folder.py): to retrain the shipped
tokenizer, remove assets/tokenizer first.
"""

from __future__ import annotations

import base64
import json
import pathlib
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Let the script run from a checkout without installing the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torchtitan.data import DataError, build_tokenizer, load_documents  # noqa: E402
from torchtitan.data.chat_template import DEFAULT_CHAT_TEMPLATE  # noqa: E402
from torchtitan.data.tokenizer import LLAMA3_PATTERN  # noqa: E402
from torchtitan.output_folder import OutputError, folder_problem, written_whole  # noqa: E402
from torchtitan.script_args import ScriptParser, integer  # noqa: E402

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
# Ids 0, 1, 2: stable whatever the vocabulary size.
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

# Documents whose ids the two formats must agree on, besides a sample of the training text.
CHECK_TEXTS = ["", "héllo wörld — naïve café ☕ 数据 🙂", "  x\t\n\n  y\r\n", "'s 'LL 12345 <|end_of_text|>"]


def byte_to_char() -> dict[int, str]:
    """The reversible byte -> printable character map that byte-level BPE files (tokenizer.json) store tokens in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    # The other bytes (controls, space, ...) take the characters from U+0100 on, in byte order.
    for extra, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + extra)
    return mapping


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Llama 3's split pattern, then bytes to characters (the pattern must not run twice)."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_ranks(documents: list[str], vocab_size: int) -> dict[bytes, int]:
    """Train byte-level BPE; return its tokens as tiktoken ranks (merge order), numbered after the special tokens."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"--vocab-size {vocab_size} is too small: it must be at least {minimum} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Seeding all 256 bytes means any text can be encoded, even bytes unseen in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"--vocab-size {vocab_size}: the training text is too small to learn that many merges (it "
                         f"gave {tokenizer.get_vocab_size()} entries); give more text or a smaller --vocab-size")
    char_to_byte = {c: b for b, c in byte_to_char().items()}
    # The trainer numbers each merged token after the tokens it merges, so its ids are merge ranks.
    return {
        bytes(char_to_byte[c] for c in token): token_id
        for token, token_id in tokenizer.get_vocab().items()
        if token not in SPECIAL_TOKENS
    }


def tokenizer_from_ranks(ranks: dict[bytes, int], special_tokens: dict[str, int]) -> Tokenizer:
    """A `tokenizers` BPE that encodes like tiktoken with these ranks and Llama 3's pattern."""
    to_char = byte_to_char()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], text(left), text(right)))
    merges.sort()
    vocab = {text(token): rank for token, rank in ranks.items()} | special_tokens
    # ignore_merges: a pre-token that is itself a token is taken whole, as tiktoken does.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], ignore_merges=True))
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False) for token in sorted(special_tokens, key=special_tokens.get)
    ])
    return tokenizer


def save(ranks: dict[bytes, int], output_dir: pathlib.Path) -> None:
    """Write tokenizer.model, tokenizer.json and tokenizer_config.json into output_dir."""
    special_tokens = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    output_dir.mkdir(parents=True, exist_ok=True)
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in by_rank]
    (output_dir / "tokenizer.model").write_text("".join(lines))
    tokenizer_from_ranks(ranks, special_tokens).save(str(output_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for token, i in special_tokens.items()
        },
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def check_formats_agree(output_dir: pathlib.Path, texts: list[str]) -> None:
    """Raise if tokenizer.json and tokenizer.model give different ids for any of texts."""
    hf = build_tokenizer(str(output_dir), "tokenizer.json")
    tiktoken = build_tokenizer(str(output_dir), "tokenizer.model")
    for text, hf_ids, tiktoken_ids in zip(texts, hf.encode_batch(texts), tiktoken.encode_batch(texts)):
        if hf_ids != tiktoken_ids:
            raise RuntimeError(f"tokenizer.json and tokenizer.model disagree on {text[:60]!r}")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, train the tokenizer, save it and check the two formats agree."""
    parser = ScriptParser(description=__doc__.splitlines()[0])
    bytes_and_specials = integer(256 + len(SPECIAL_TOKENS), note=f"256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    parser.add_argument("--vocab-size", type=bytes_and_specials, default=2048,
                        help="total vocabulary size, special tokens included")
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("assets/tokenizer"))
    parser.add_argument("--input", nargs="+", help="files or folders to train on (default: pydocs train split)")
    parser.add_argument("--text-column", default="text", help="column holding the text in --input files")
    args = parser.parse_args(argv)
    if problem := folder_problem(args.output_dir):
        print(f"error: --output-dir {args.output_dir} {problem}", file=sys.stderr)
        return 2
    try:
        if args.input:
            documents = [doc for path in args.input for doc in load_documents("", path, "train", args.text_column)]
        else:
            documents = list(load_documents("pydocs", None, "train"))
    except DataError as e:
        print(f"error: --input: {e}", file=sys.stderr)
        return 2
    try:
        ranks = train_ranks(documents, args.vocab_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with written_whole(args.output_dir) as folder:
            save(ranks, folder)
            check_formats_agree(folder, CHECK_TEXTS + documents[::10])
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trained on {len(documents)} documents; wrote a {args.vocab_size}-token tokenizer to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
