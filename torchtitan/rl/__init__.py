"""Reinforcement learning from verifiable rewards: prompts, rewards, rollouts (GRPO)."""
