"""Opt-in pytest plugin: where the suite's CPU time goes. ``python -m pytest -p tests.cpu_time``.

A test's cost here is the CPU seconds of its worker and of the processes it started and waited for (torchrun
launches and their ranks, trainers, scripts): on a machine whose cores are all busy, which the suite's are, that is
what a test adds to the suite's time, while its wall time under the workers also counts the other worker's load.
Processes a test did not wait for are not counted: Slurm's jobs (they run under slurmd) and inductor's compile
workers that outlive the test. The summary goes to the terminal, the rows to a fresh folder (named in the summary)
made inside ``$TORCHTITAN_CPU_TIME_DIR``, an existing folder (default: the system's temporary folder).
"""

import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

_DIR = "TORCHTITAN_CPU_TIME_DIR"
_RUN_DIR = "TORCHTITAN_CPU_TIME_RUN_DIR"  # this run's rows, set by the controller for xdist's workers


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):
        return
    parent = os.environ.get(_DIR) or None
    if parent is not None and not Path(parent).is_dir():
        raise pytest.UsageError(f"{_DIR}={parent!r} is not a folder: name an existing folder, or unset it for the "
                                "system's temporary folder")
    # A folder of this run's own, so that rows of an earlier run in the same parent are neither read nor replaced.
    os.environ[_RUN_DIR] = tempfile.mkdtemp(prefix="torchtitan-cpu-time-", dir=parent)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = os.times(), time.perf_counter()
    yield
    after = os.times()
    row = {"test": item.nodeid, "wall": time.perf_counter() - start,
           "cpu": sum(getattr(after, f) - getattr(before, f)
                      for f in ("user", "system", "children_user", "children_system"))}
    with open(Path(os.environ[_RUN_DIR]) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter, config) -> None:
    if hasattr(config, "workerinput"):
        return
    folder = Path(os.environ[_RUN_DIR])
    rows = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    if not rows:
        return
    write = terminalreporter.write_line
    terminalreporter.section("CPU time (tests.cpu_time)")
    write(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.1f} CPU-s in all; rows in {folder}")
    modules = Counter()
    for row in rows:
        modules[row["test"].split("::")[0]] += row["cpu"]
    write("CPU-s  module")
    for module, cpu in modules.most_common(15):
        write(f"{cpu:6.1f}  {module}")
    write("CPU-s   wall-s  test")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:15]:
        write(f"{row['cpu']:6.1f}  {row['wall']:6.1f}  {row['test']}")
