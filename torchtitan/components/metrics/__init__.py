"""What a run reports about itself: the per-step metrics line and rows, their backends (jsonl, TensorBoard, W&B),
peak FLOP/s for MFU, profiler traces and memory snapshots, and host memory reuse on CPUs."""
