"""How the scripts under scripts/ read their command lines: a parser whose errors are one line, and number types
that check the range while the line is parsed, so a bad number never reaches the code that would use it (where it
fails far from the flag, e.g. inside itertools, or is silently accepted)."""

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass


class ScriptParser(argparse.ArgumentParser):
    """argparse with the project's error form: one line ``error: --flag value is invalid; ...`` on stderr, exit 2
    (argparse's own prints the usage first, and says ``argument --flag:`` before the reason)."""

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+): ", r"\1 ", message)
        # Under torchrun every rank parses the same line: rank 0 alone says what is wrong.
        if os.environ.get("RANK", "0") == "0" or "WORLD_SIZE" not in os.environ:
            print(f"error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


@dataclass(frozen=True)
class Number:
    """An argparse ``type``: ``kind`` (int or float) in [low, high], either end open when ``*_open``, no bound
    where None; a float must be finite (nan slips through every comparison, inf through most)."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what a special value means, e.g. "0: greedy"

    def valid(self) -> str:
        """The valid values in words, e.g. 'an integer >= 1' or 'a number in (0, 1]'."""
        what = "an integer" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = (f"{what} in {self.low}..{self.high}" if self.kind is int and not (self.low_open or self.high_open)
                    else f"{what} in {left}{self.low}, {self.high}{right}")
        elif self.low is not None:
            text = f"{what} {'>' if self.low_open else '>='} {self.low}"
        elif self.high is not None:
            text = f"{what} {'<' if self.high_open else '<='} {self.high}"
        else:
            text = what
        return f"{text} ({self.note})" if self.note else text

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not self._in_range(value):
            # argparse puts the flag in front: "--limit -1 is invalid; it must be an integer >= 1"
            raise argparse.ArgumentTypeError(f"{text} is invalid; it must be {self.valid()}")
        return value

    def _in_range(self, value) -> bool:
        if self.low is not None and (value < self.low or self.low_open and value == self.low):
            return False
        return self.high is None or not (value > self.high or self.high_open and value == self.high)


def integer(low: int | None = None, high: int | None = None, note: str = "") -> Number:
    """An int in low..high (both included)."""
    return Number(int, low, high, note=note)


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
         note: str = "") -> Number:
    """A finite float between low and high, each end included unless ``*_open``."""
    return Number(float, low, high, low_open, high_open, note)


# torch.manual_seed takes any value a uint64 holds (negative ones wrap around); outside it, it raises.
SEED = integer(0, 2**64 - 1)
