"""What a step trains: the objectives (training.objective) and their registry, the cross-entropy loss, multi-token
prediction, and the forward/backward runners (one process or a pipeline) that call them."""
