"""Pre-tokenize a corpus into memory-mapped shards for ``training.dataset_format = "tokens"``.

    python scripts/tokenize_dataset.py --dataset pydocs --output data/pydocs_tokens
    python scripts/tokenize_dataset.py --dataset_path corpus/ --text_column text --output data/corpus_tokens
    python scripts/tokenize_dataset.py --hf_dataset HuggingFaceFW/fineweb-edu --hf_config sample-10BT \
        --output data/fineweb_tokens --workers 16

Reads a registered dataset, local files (JSONL/JSON/Parquet/Arrow/text, as training.dataset_path) or a Hugging
Face dataset (streamed), tokenizes with --workers processes (a progress bar counts documents) and writes the
shard folder described in torchtitan/data/shards.py: token ids (uint16 when the vocabulary fits, else uint32),
a document index per shard and manifest.json (tokenizer hash, vocab size, dtype, token and document counts,
source). Documents keep their order and shards are cut at fixed token counts, so the same input and tokenizer
give byte-identical output; the folder is replaced only once complete.

--output must be new, an empty folder, or a shard folder this script wrote (then it is replaced); it may not be,
hold or lie inside --dataset_path. Anything else is refused before reading the data, so nothing the script did not
write is ever overwritten or removed.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torchtitan.data import DataError, build_tokenizer, load_documents  # noqa: E402
from torchtitan.data.shards import is_shard_folder, output_problem, write_shards  # noqa: E402
from torchtitan.data.sources import HubDocuments  # noqa: E402
from torchtitan.remote import is_url  # noqa: E402
from torchtitan.script_args import ScriptParser, integer  # noqa: E402

_DOCUMENTS_PER_TASK = 256
_worker_tokenizer = None


def _start_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(tokenizer_path)


def _encode(texts: list[str]) -> list[list[int]]:
    # Empty documents are left out, as the text source leaves them out of the packed stream.
    kept = [text for text in texts if text.strip()]
    return _worker_tokenizer.encode_batch(kept, bos=True, eos=True)


def _chunks(documents, source: str):
    rows = iter(documents)
    index = 0
    while chunk := list(itertools.islice(rows, _DOCUMENTS_PER_TASK)):
        for text in chunk:
            if not isinstance(text, str):
                raise DataError(f"{source}: row {index} is {type(text).__name__}, not text")
            index += 1
        yield chunk


def _input_problem(output: pathlib.Path, dataset_path: str | None) -> str | None:
    """Why --output may not be written with this input: replacing it would remove or read back the input."""
    if dataset_path is None or is_url(dataset_path):
        return None
    out, data = output.resolve(), pathlib.Path(dataset_path).resolve()
    if out == data:
        return "is the input (--dataset_path); give another folder for the shards"
    if out in data.parents:
        return f"holds the input (--dataset_path {dataset_path}); give a folder outside it for the shards"
    if data in out.parents:
        return (f"lies inside the input (--dataset_path {dataset_path}), where its files would be read as data; "
                "give a folder outside it")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--dataset", help="a registered text dataset, e.g. pydocs")
    where.add_argument("--dataset_path", help="local file or folder (json/jsonl/parquet/arrow/txt)")
    where.add_argument("--hf_dataset", help="a Hugging Face dataset repository, streamed")
    parser.add_argument("--hf_config", default=None, help="the Hugging Face dataset's config (subset)")
    parser.add_argument("--split", default="train", help="split to read (default train)")
    parser.add_argument("--text_column", default="text", help="column holding the text (default text)")
    parser.add_argument("--tokenizer", default="assets/tokenizer", help="tokenizer folder (model.hf_assets_path)")
    parser.add_argument("--output", required=True, help="the shard folder to write (replaced when complete)")
    parser.add_argument("--workers", type=integer(1), default=max(1, multiprocessing.cpu_count() - 1),
                        help="tokenizing processes (default: CPU cores - 1)")
    parser.add_argument("--shard_tokens", type=integer(1), default=1 << 28,
                        help="tokens per shard, about (default 2^28)")
    args = parser.parse_args(argv)
    output = pathlib.Path(args.output)
    if problem := _input_problem(output, args.dataset_path) or output_problem(output):
        print(f"error: --output {args.output} {problem}", file=sys.stderr)
        return 2
    if args.dataset_path and is_shard_folder(args.dataset_path):
        print(f"error: --dataset_path {args.dataset_path} is already a folder of token shards (it holds "
              "manifest.json); train on it with dataset_format = 'tokens' (or kind = 'tokens' in [[data.sources]])",
              file=sys.stderr)
        return 2
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        if args.hf_dataset:
            source = f"hf:{args.hf_dataset}" + (f"/{args.hf_config}" if args.hf_config else "") + f" ({args.split})"
            documents = HubDocuments(args.hf_dataset, args.hf_config, args.split, args.text_column)
        else:
            source = args.dataset_path or f"{args.dataset} ({args.split})"
            documents = load_documents(args.dataset, args.dataset_path, args.split, args.text_column)
        from tqdm import tqdm

        progress = tqdm(unit="doc", desc="tokenizing", disable=None)
        with contextlib.ExitStack() as stack:
            if args.workers == 1:
                _start_worker(args.tokenizer)
                results = map(_encode, _chunks(documents, source))
            else:
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                    args.workers, _start_worker, (args.tokenizer,)))
                results = pool.imap(_encode, _chunks(documents, source))  # imap keeps the documents' order

            def ordered():
                for result in results:
                    progress.update(len(result))
                    yield from result

            manifest = write_shards(ordered(), tokenizer, args.output, source, args.shard_tokens)
        progress.close()
    except (DataError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens "
          f"({manifest['dtype']}) in {len(manifest['shards'])} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
