"""Built-in model families; importing this package registers them."""

from torchtitan.models import llama3, qwen3, qwen3_moe  # noqa: F401
