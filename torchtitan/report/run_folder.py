"""Reading a run folder for the report: metrics.jsonl, the per-rank timelines, the planner's prediction and the
Chrome traces, as far as they are there and readable.

A run folder is whatever a run left behind, and runs crash, are relaunched and resume: a file may be missing, its
last line cut short mid-write, a line garbled (a relaunch appending after a cut-short line puts both on one line),
rows repeated (a resume from an earlier checkpoint logs those steps again: the later row is the run that went on)
or out of order, a row missing keys or holding a value that is not a number. Nothing of that stops the reading:
each problem becomes one ``Problem`` (file, first line, what), the rows that can be used are, and a file that
cannot be read at all is left out.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TIMELINE_FOLDER = "timeline"
# Keys every training row of MetricsLogger.log has; a row without one was cut or written by something else.
TRAINING_KEYS = ("loss", "grad_norm", "lr", "tps", "memory_gib")
# The keys of the row the trainer writes beside a log step's training row: every rank's phases and memory
# (components/observability/rank_summary.py); the report reads them as part of that step's training row.
RANKS_PREFIXES = ("phase/", "memory/", "straggler/", "observability/")
# The only keys whose value is text (a timeline row's host name); every other value is a number or numbers.
TEXT_KEYS = ("host",)
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl(?:\.(\d+))?")
_TRACE_FILE = re.compile(r"trace_rank(\d+)\.json")
# A garbled line longer than this is not searched for a row appended after a cut-short one.
_RECOVER_MAX_CHARS = 1 << 20


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the run folder: the file (relative to the folder), its first line concerned, what."""

    file: str
    line: int | None
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}" if self.line is not None else f"{self.file}: {self.what}"


@dataclass
class Run:
    """What a run folder holds, each list sorted by step with one row per step."""

    folder: Path
    training: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    evaluation: list[dict] = field(default_factory=list)
    timeline: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its step rows
    plan: dict | None = None
    traces: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its trace events
    config: dict | None = None
    problems: list[Problem] = field(default_factory=list)


@dataclass
class _Entry:
    file: str
    line: int
    row: dict
    dropped: tuple[str, ...] = ()  # keys left out for their value (already a problem of their own)


def read_run(folder: str | Path) -> Run:
    """Everything the report uses from ``folder``; the caller has checked that metrics.jsonl exists."""
    folder = Path(folder)
    run = Run(folder)
    problems = run.problems
    entries = _read_jsonl(folder, [METRICS_FILE], problems)
    kinds = []  # (kind, entry) in file order
    for entry in entries:
        matched = _kinds_of(entry.row)
        if not matched:
            keys = ", ".join(sorted(entry.row)[:6]) or "none"
            problems.append(Problem(entry.file, entry.line, f"neither a training, validation, eval nor ranks row "
                                                            f"(keys: {keys}); skipped"))
        kinds += [(kind, entry) for kind in matched]
    _check_training_keys([entry for kind, entry in kinds if kind == "training"], problems)
    by_kind = _one_per_step(kinds, problems)
    run.training, run.validation, run.evaluation = (by_kind.get(kind, []) for kind in ("training", "validation",
                                                                                        "eval"))
    _join_ranks_rows(run.training, by_kind.get("ranks", []), problems)
    _read_timeline(folder, run)
    run.config = _read_config(folder, problems)
    # In reading order: by file, then line (a file's own problems first).
    problems.sort(key=lambda p: (p.file, p.line or 0))
    return run


def _join_ranks_rows(training: list[dict], ranks: list[dict], problems: list[Problem]) -> None:
    """Each log step's ranks row into its training row (the keys do not overlap)."""
    by_step = {row["step"]: row for row in training}
    orphans = []
    for row in ranks:
        if row["step"] in by_step:
            by_step[row["step"]].update({k: v for k, v in row.items() if k != "step"})
        else:
            orphans.append(row["step"])
    if orphans:
        problems.append(Problem(METRICS_FILE, None, f"{_count(len(orphans), 'ranks row')} (step {_span(orphans)}) "
                                                    "without the training row of their step; skipped"))


def _kinds_of(row: dict) -> list[str]:
    kinds = []
    if any(key in row for key in TRAINING_KEYS):
        kinds.append("training")
    elif any(key.startswith(RANKS_PREFIXES) for key in row):
        kinds.append("ranks")
    if any(key.startswith("val_") for key in row):
        kinds.append("validation")
    if any(key.startswith("eval/") for key in row):
        kinds.append("eval")
    return kinds


def _read_jsonl(folder: Path, names: list[str], problems: list[Problem]) -> list[_Entry]:
    """The rows of ``names`` (relative to ``folder``; one log in that order, e.g. a rotated file then its
    successor) that are JSON objects with an integer step, their values checked (``_clean``)."""
    entries = []
    bad_values: dict[tuple[str, str], list] = {}  # (file, key) -> [first line, count, example]
    for name in names:
        try:
            with open(folder / name, encoding="utf-8", errors="replace", newline="") as f:
                text = f.read()
        except OSError as e:
            problems.append(Problem(name, None, f"cannot be read ({e.strerror or e}); left out"))
            continue
        lines = text.split("\n")
        cut_short = lines[-1] != ""  # no newline after the last row: the writer stopped mid-line
        if not cut_short:
            lines.pop()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row, why = _parse(line)
            if row is None and number == len(lines) and cut_short:
                problems.append(Problem(name, number, "the last line is cut short (the run stopped while writing "
                                                      "it?); skipped"))
                continue
            if why:
                problems.append(Problem(name, number, why))
            if row is None:
                continue
            if not isinstance(row, dict):
                problems.append(Problem(name, number, f"a JSON {type(row).__name__}, not an object; skipped"))
                continue
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                problems.append(Problem(name, number, f"no integer \"step\" (found {step!r}); skipped"))
                continue
            kept = _clean(row, name, number, bad_values)
            entries.append(_Entry(name, number, kept, tuple(key for key in row if key not in kept)))
    for (name, key), (line, count, example) in bad_values.items():
        more = f" (and in {count - 1} more rows)" if count > 1 else ""
        problems.append(Problem(name, line, f"{key} is {example!r}, not a number{more}; left out"))
    return entries


def _parse(line: str) -> tuple[object | None, str | None]:
    """(the line's JSON value or None, a problem to report or None). A line that does not parse may be a row cut
    short with the next run's first row appended after it: that row, the longest tail that parses, is kept."""
    try:
        return json.loads(line), None
    except ValueError:
        pass
    if len(line) <= _RECOVER_MAX_CHARS:
        for start in (m.start() for m in re.finditer(r"\{\s*\"", line) if m.start() > 0):
            try:
                row = json.loads(line[start:])
            except ValueError:
                continue
            return row, ("a row cut short, with another appended after it (a crash, then a relaunch); the cut "
                         "part is skipped")
    return None, "not JSON; skipped"


def _clean(row: dict, name: str, line: int, bad_values: dict) -> dict:
    """``row`` with every value a number, None (a metric with no value, e.g. MFU on an unknown device), a list of
    numbers, an object of numbers (a timeline row's phases and memory) or, for TEXT_KEYS, text; anything else is
    left out and counted in ``bad_values`` per key."""
    kept = {}
    for key, value in row.items():
        if key == "step" or _is_value(value) or (isinstance(value, list) and all(map(_is_number, value))) or (
                isinstance(value, dict) and all(_is_value(v) for v in value.values())) or (
                key in TEXT_KEYS and isinstance(value, str)):
            kept[key] = value
            continue
        record = bad_values.setdefault((name, key), [line, 0, value])
        record[1] += 1
    return kept


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_value(value) -> bool:
    return value is None or _is_number(value)


def _check_training_keys(entries: list[_Entry], problems: list[Problem]) -> None:
    """One problem per key of TRAINING_KEYS that some training rows lack (the others have it)."""
    missing: dict[tuple[str, str], list[_Entry]] = {}
    for entry in entries:
        for key in TRAINING_KEYS:
            if key not in entry.row and key not in entry.dropped:
                missing.setdefault((entry.file, key), []).append(entry)
    for (name, key), rows in missing.items():
        problems.append(Problem(name, rows[0].line, f"{_count(len(rows), 'training row')} (step "
                                                    f"{_span(e.row['step'] for e in rows)}) without {key}; their "
                                                    "other values are used"))


def _one_per_step(entries: list[tuple[str, _Entry]], problems: list[Problem]) -> dict[str, list[dict]]:
    """{kind: its rows by step} from (kind, entry) pairs in file order, the later of two rows of a kind and step
    winning, with one problem per run of consecutive rows that went back (whatever their kinds): steps logged
    again (a relaunch resuming from an earlier step) or out of order."""
    latest: dict[str, dict[int, dict]] = {}
    highest: dict[str, int] = {}
    group: dict | None = None  # the run of rows going back now: file, line, kinds, steps, repeated
    for kind, entry in entries:
        step, rows = entry.row["step"], latest.setdefault(kind, {})
        back = kind in highest and step <= highest[kind]
        repeated = step in rows
        if back and group and group["file"] == entry.file and group["repeated"] == repeated:
            group["steps"].append(step)
            group["kinds"].setdefault(kind)
        else:
            _report_group(group, problems)
            group = {"file": entry.file, "line": entry.line, "kinds": {kind: None}, "steps": [step],
                     "repeated": repeated} if back else None
        rows[step] = entry.row
        highest[kind] = max(highest.get(kind, step), step)
    _report_group(group, problems)
    return {kind: [rows[step] for step in sorted(rows)] for kind, rows in latest.items()}


def _report_group(group: dict | None, problems: list[Problem]) -> None:
    if group is None:
        return
    rows = f"{' and '.join(group['kinds'])} rows of step {_span(group['steps'])}"
    what = (f"{rows} logged again (a relaunch resuming from an earlier step?); the later rows are used"
            if group["repeated"] else f"{rows} come after later steps (out of order); sorted by step")
    problems.append(Problem(group["file"], group["line"], what))


def _span(steps: Iterable[int]) -> str:
    """'5-9' for consecutive steps, else the first few: '3, 7, 12 and 4 more'."""
    steps = sorted(set(steps))
    if len(steps) > 1 and steps[-1] - steps[0] == len(steps) - 1:
        return f"{steps[0]}-{steps[-1]}"
    shown = ", ".join(map(str, steps[:3]))
    return shown + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _read_timeline(folder: Path, run: Run) -> None:
    """timeline/: each rank's step rows (a rotated file before its successor), the plan and the traces."""
    timeline = folder / TIMELINE_FOLDER
    if not timeline.is_dir():
        return
    problems = run.problems
    files: dict[int, list[tuple[int, str]]] = {}
    for path in timeline.iterdir():
        if m := _RANK_FILE.fullmatch(path.name):
            # rank0.jsonl.2 is older than rank0.jsonl.1, which is older than rank0.jsonl.
            age = int(m.group(2)) if m.group(2) else 0
            files.setdefault(int(m.group(1)), []).append((age, f"{TIMELINE_FOLDER}/{path.name}"))
    run.plan = _read_plan(timeline, problems)
    for rank in sorted(files):
        names = [name for _, name in sorted(files[rank], reverse=True)]
        entries = _read_jsonl(folder, names, problems)
        usable = []
        for entry in entries:
            if _is_number(entry.row.get("total_s")):
                usable.append(entry)
            else:
                problems.append(Problem(entry.file, entry.line, "no total_s number; the row is skipped"))
        rows = _one_per_step([(f"rank {rank}", entry) for entry in usable], problems)
        if rows:
            run.timeline[rank] = rows[f"rank {rank}"]
    world = max([*files, *(_trace_ranks(timeline))], default=-1) + 1
    planned = run.plan.get("world_size") if run.plan else None
    if _is_number(planned):
        world = max(world, int(planned))
    absent = [rank for rank in range(world) if rank not in files]
    if files and absent:
        problems.append(Problem(TIMELINE_FOLDER, None, f"no timeline file for rank {_span(absent)} of {world} ranks; "
                                                       "left out"))
    for rank in sorted(_trace_ranks(timeline)):
        name = f"{TIMELINE_FOLDER}/trace_rank{rank}.json"
        events = _read_trace(folder / name, name, problems)
        if events is not None:
            run.traces[rank] = events


def _trace_ranks(timeline: Path) -> list[int]:
    return [int(m.group(1)) for path in timeline.iterdir() if (m := _TRACE_FILE.fullmatch(path.name))]


def _read_json(path: Path, name: str, problems: list[Problem]):
    try:
        return json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as e:
        problems.append(Problem(name, None, f"cannot be read ({e.strerror or e}); left out"))
    except ValueError as e:
        problems.append(Problem(name, getattr(e, "lineno", None), f"not JSON ({getattr(e, 'msg', e)}); left out"))
    return None


def _read_plan(timeline: Path, problems: list[Problem]) -> dict | None:
    """plan.json when it holds the planner's total (absent when the planner could not plan the config)."""
    name = f"{TIMELINE_FOLDER}/plan.json"
    if not (timeline / "plan.json").exists():
        return None
    plan = _read_json(timeline / "plan.json", name, problems)
    if plan is None:
        return None
    memory = plan.get("memory_gib") if isinstance(plan, dict) else None
    total = memory.get("total") if isinstance(memory, dict) else None
    if not _is_number(total) or not math.isfinite(total):
        problems.append(Problem(name, None, "no memory_gib.total number; the plan line is left out"))
        return None
    return plan


def _read_trace(path: Path, name: str, problems: list[Problem]) -> list[dict] | None:
    trace = _read_json(path, name, problems)
    if trace is None:
        return None
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace  # the array form is a trace too
    if not isinstance(events, list):
        problems.append(Problem(name, None, "no traceEvents list; left out"))
        return None
    kept = [e for e in events if isinstance(e, dict)]
    if len(kept) < len(events):
        problems.append(Problem(name, None, f"{_count(len(events) - len(kept), 'trace event')} not an object; "
                                            "skipped"))
    return kept


def _read_config(folder: Path, problems: list[Problem]) -> dict | None:
    """The run's config.toml, for the report's heading (the model and flavor)."""
    path = folder / "config.toml"
    if not path.exists():
        return None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        problems.append(Problem("config.toml", None, f"cannot be read ({e}); the heading leaves the model out"))
        return None


def merged_trace(traces: dict[int, list[dict]]) -> dict:
    """One Chrome trace of every rank's events, each rank a process named "rank R" (Perfetto shows them one under
    another on the same clock)."""
    events = []
    for rank in sorted(traces):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events += [{**event, "pid": rank} for event in traces[rank]]
    return {"traceEvents": events, "displayTimeUnit": "ms"}
