"""Reward functions registered from outside the package, as a module named in experimental.custom_import would:
the reward workers import this module to unpickle them (registering them again there, in their own registry)."""

import os
import time

from torchtitan.rl.rewards import register_reward


def length(completion: str, sample: dict) -> float:
    return len(completion) / (1 + len(sample["prompt"]))


def sleepy(completion: str, sample: dict) -> float:
    """Hangs on the completion "hang" (longer than any test's timeout), else 0.5."""
    if completion == "hang":
        time.sleep(60)
    return 0.5


def raising(completion: str, sample: dict) -> float:
    if completion == "ok":
        return 1.0
    raise KeyError("answer")


def not_a_number(completion: str, sample: dict):
    return {"text": "forty-two", "nan": float("nan"), "ok": 1}[completion]


def exits(completion: str, sample: dict) -> float:
    """Ends its process on "die" (as a crash in native code would), else 1."""
    if completion == "die":
        os._exit(3)
    return 1.0


for _fn in (length, sleepy, raising, not_a_number, exits):
    register_reward(f"test_{_fn.__name__}", _fn)
