"""Generating text from our models: the engine (engine.py) with a cache for every kind of token mixer (caches.py),
the sampling rules (sampling.py), the cache-free reference path (reference.py), and a tensor-/expert-parallel model
for the engine under torchrun (sharded.py, imported on its own: it pulls in the parallelisms)."""

from torchtitan.generation.caches import LayerCache, register_cache
from torchtitan.generation.engine import Completion, GenerationEngine
from torchtitan.generation.reference import generate_without_cache
from torchtitan.generation.sampling import SamplingConfig, choose, filter_top_k, filter_top_p, processed_logits

__all__ = ["Completion", "GenerationEngine", "LayerCache", "SamplingConfig", "choose", "filter_top_k", "filter_top_p",
           "generate_without_cache", "processed_logits", "register_cache"]
