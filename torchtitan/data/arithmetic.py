"""The arithmetic problems: "What is 17 + 5?" with the answer "22", generated with no download.

One finite set of problems (every a + b and a - b with 0 <= a, b < MAX_OPERAND, and a >= b for subtraction, so no
answer is negative) is split once for all: the HELDOUT_SIZE problems whose SHA-256 of "a op b" sorts first are
held out, the rest are for training. The split depends on nothing but the constants below, so a held-out reward
measured in one run compares with another's. Reinforcement learning draws prompts from it (torchtitan/rl/tasks.py,
task "arithmetic"); the chat dataset "arithmetic_chat" holds the same problems as conversations for supervised
fine-tuning first (its "validation" split is the held-out set).

Change MAX_OPERAND (or OPERATORS) to make the task easier or harder; HELDOUT_SIZE must stay below the number of
problems.
"""

from __future__ import annotations

import hashlib

import numpy as np

from torchtitan.data.errors import DataError

# 20: 610 problems, 410 to train on, which the ~6M-parameter debug model learns in minutes on a CPU, leaving room
# for reinforcement learning (docs/rl.md, "The learning run"). At 50 the fine-tuned debug model still answered
# under 10% of held-out problems after 4,000 steps (17 minutes): it learned the answers' size, not their digits.
MAX_OPERAND = 20
OPERATORS = ("+", "-")
HELDOUT_SIZE = 200
SPLITS = ("train", "heldout")
# The chat dataset's split names (the loaders' convention) for ours.
CHAT_SPLITS = {"train": "train", "validation": "heldout"}
# The training conversations' order is shuffled once with this seed, so that supervised fine-tuning does not see
# all of one operator, then all of the other.
CHAT_ORDER_SEED = 0


def _all_problems() -> list[tuple[int, str, int]]:
    return [(a, op, b) for op in OPERATORS for a in range(MAX_OPERAND) for b in range(MAX_OPERAND)
            if op != "-" or a >= b]


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def problems(split: str) -> list[dict[str, str]]:
    """The problems of ``split`` ("train" or "heldout") as {"prompt", "answer"} rows, in a fixed order."""
    if split not in SPLITS:
        raise DataError(f"the arithmetic problems have no split {split!r}; valid: {', '.join(SPLITS)}")
    every = _all_problems()
    if HELDOUT_SIZE >= len(every):
        raise DataError(f"arithmetic: HELDOUT_SIZE = {HELDOUT_SIZE} leaves no training problems of the "
                        f"{len(every)} (MAX_OPERAND = {MAX_OPERAND}); raise MAX_OPERAND or lower HELDOUT_SIZE")
    by_hash = sorted(every, key=lambda p: hashlib.sha256(f"{p[0]} {p[1]} {p[2]}".encode()).hexdigest())
    heldout = set(by_hash[:HELDOUT_SIZE])
    chosen = [p for p in every if (p in heldout) == (split == "heldout")]
    return [{"prompt": f"What is {a} {op} {b}?", "answer": str(_answer(a, op, b))} for a, op, b in chosen]


def load_arithmetic_chat(split: str = "train") -> list[list[dict]]:
    """The arithmetic problems of a split ("train", or "validation": the held-out ones) as a user's question and
    the assistant's bare answer; deterministic."""
    if split not in CHAT_SPLITS:
        raise DataError(f"unknown arithmetic_chat split {split!r}; valid splits are {list(CHAT_SPLITS)}")
    rows = problems(CHAT_SPLITS[split])
    order = np.random.default_rng(CHAT_ORDER_SEED).permutation(len(rows))
    return [[{"role": "user", "content": rows[i]["prompt"]}, {"role": "assistant", "content": rows[i]["answer"]}]
            for i in order]
