"""Benchmark-only flavors, registered with --experimental.custom_import benchmarks.moe_flavors."""

import dataclasses

from torchtitan.models.qwen3_moe import qwen3_moe_flavors

# Qwen3-30B-A3B's widths (128 experts of 768, top 8, hidden 2048) cut to 4 layers: one GPU's comparison point.
qwen3_moe_flavors["30B-A3B-4layers"] = dataclasses.replace(qwen3_moe_flavors["30B-A3B"], n_layers=4)
