"""Train the byte-level BPE tokenizer shipped in assets/tokenizer.

By default it trains on the train split of the built-in pydocs corpus; ``--input``
takes .txt files (one document per non-empty line) or .jsonl files (a "text" field
per line) instead. Example:

    python scripts/train_tokenizer.py --vocab-size 2048 --output-dir assets/tokenizer
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]


def read_documents(paths: list[pathlib.Path]) -> list[str]:
    """Read documents from .txt (one per non-empty line) or .jsonl ("text" field) files."""
    documents = []
    for path in paths:
        with path.open(encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                documents.extend(json.loads(line)["text"] for line in f if line.strip())
            elif path.suffix == ".txt":
                documents.extend(line.rstrip("\n") for line in f if line.strip())
            else:
                raise ValueError(f"unsupported input file {path}: expected a .txt or .jsonl file")
    return documents


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose vocabulary, special tokens included, has vocab_size entries."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: it must be at least "
            f"{len(alphabet) + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Seeding all 256 bytes means any text can be encoded, even bytes unseen in training.
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    if actual != vocab_size:
        raise RuntimeError(
            f"trained vocabulary has {actual} entries instead of {vocab_size}: "
            "the training text is too small to learn that many merges"
        )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, output_dir: pathlib.Path) -> None:
    """Write tokenizer.json and an HF-style tokenizer_config.json into output_dir."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, train the tokenizer and save it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048, help="total vocabulary size, special tokens included")
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("assets/tokenizer"))
    parser.add_argument(
        "--input",
        type=pathlib.Path,
        nargs="+",
        help=".txt/.jsonl files to train on (default: pydocs train split)",
    )
    args = parser.parse_args(argv)

    if args.input:
        documents = read_documents(args.input)
    else:
        # Let the script run from a checkout without installing the package.
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from torchtitan.data.pydocs import load_pydocs_documents

        documents = load_pydocs_documents("train")
    tokenizer = train_tokenizer(documents, args.vocab_size)
    save_tokenizer(tokenizer, args.output_dir)
    print(f"trained on {len(documents)} documents; wrote {args.vocab_size}-token tokenizer to {args.output_dir}")


if __name__ == "__main__":
    main()
