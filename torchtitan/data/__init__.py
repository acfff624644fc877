"""Data pipeline: tokenizers, document sources (pydocs, HF hub, local files), packing and the stateful loader."""

from torchtitan.data.dataloader import TokenDataLoader, build_dataloader
from torchtitan.data.dataset import Batch, PackedTokenDataset, StreamPosition, document_ids, document_positions
from torchtitan.data.errors import DataError
from torchtitan.data.pydocs import load_pydocs_documents
from torchtitan.data.sources import load_documents, register_dataset, registered_datasets
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "Batch",
    "DataError",
    "PackedTokenDataset",
    "StreamPosition",
    "TokenDataLoader",
    "Tokenizer",
    "build_dataloader",
    "build_tokenizer",
    "document_ids",
    "document_positions",
    "load_documents",
    "load_pydocs_documents",
    "register_dataset",
    "registered_datasets",
]
