"""torchtitan: a native-PyTorch platform for pretraining large language models."""

__version__ = "0.1.0"
