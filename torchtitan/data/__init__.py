"""Data pipeline: the pydocs corpus, tokenizers and the packed-token dataloader."""

from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.dataset import register_dataset
from torchtitan.data.pydocs import load_pydocs_documents
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["Tokenizer", "build_dataloader", "build_tokenizer", "load_pydocs_documents", "register_dataset"]
