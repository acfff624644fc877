"""Optimizers and their schedules: the [optimizer] builder and clipped step, Muon, AdamW with 8-bit states, the
learning-rate schedule and µP's per-group learning rates."""
