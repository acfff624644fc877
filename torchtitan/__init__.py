"""torchtitan: a native-PyTorch platform for pretraining large language models."""

__version__ = "0.1.0"


def load_model(config_file: str, checkpoint: str | None = None, device: str = "cpu", overrides=()):
    """An eval-mode model from a config and a checkpoint (DCP step folder or HF folder); see torchtitan.inference."""
    from torchtitan.inference import load_model as _load_model

    return _load_model(config_file, checkpoint, device, overrides)
