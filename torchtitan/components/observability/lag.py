"""How far each rank is behind the median rank in one step, on the common clock of the step starts.

Straggler detection (rank_summary.py) and the report's lag heatmap (torchtitan/report/) both measure it; it is
plain Python so that the report, which reads timelines on any machine, imports no torch for a few numbers.
"""

import itertools
import statistics


def phase_end_lags(starts: list[float], phases: list[list[float]]) -> list[list[float]]:
    """Seconds each rank reaches each point of the step after the median rank: one row per rank, one column for
    the start and one per phase end, the phases in step order (``starts`` unix seconds, ``phases`` seconds)."""
    ends = [[start, *(start + done for done in itertools.accumulate(row))] for start, row in zip(starts, phases)]
    # Of an even count the lower middle one (torch.median's choice): of two ranks, the one ahead.
    medians = [statistics.median_low(column) for column in zip(*ends)]
    return [[end - median for end, median in zip(row, medians)] for row in ends]


def lag_behind(lags: list[float]) -> float:
    """One rank's lag at a step from its row of ``phase_end_lags``: the most it is behind at a phase's end, 0 when
    it is nowhere behind. The start is left out: it is the previous step's end, whose lag that step counted."""
    return max([0.0, *lags[1:]])
