"""Benchmark-only flavors, registered with --experimental.custom_import benchmarks.moe_flavors."""

import dataclasses

from torchtitan.models.qwen3_moe import qwen3_moe_flavors

# Qwen3-30B-A3B's widths (128 experts of 768, top 8, hidden 2048) cut to 4 layers: one GPU's comparison point;
# fewer layers for GPUs with less memory (benchmarks/moe.py --gpu_layers, sized by scripts/gpu_check.py).
for _layers in (1, 2, 3, 4):
    qwen3_moe_flavors[f"30B-A3B-{_layers}layers"] = dataclasses.replace(qwen3_moe_flavors["30B-A3B"], n_layers=_layers)
