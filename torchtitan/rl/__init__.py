"""Reinforcement learning from verifiable rewards: prompts (tasks.py), rewards (rewards.py), the sampler interface
(sampler.py), rollouts packed for the trainer (rollouts.py), the frozen reference (reference.py); the loss is
components/objectives/grpo.py (training.objective = "grpo"). docs/rl.md tells the whole loop."""
