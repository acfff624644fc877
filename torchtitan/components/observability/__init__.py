"""Seeing a run: per-rank step phases, stragglers, hangs and memory (docs/observability.md)."""
