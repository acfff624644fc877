"""One GPU check: the CUDA test tier, the dense and MoE throughput rows, fla against the chunked kernel and a
two-GPU NCCL run, within a time budget, into one report.

    scripts/gpu_check.sh [--budget 480] [--out benchmarks/results] [--logs DIR] [--plan]
    scripts/gpu_check.sh --out $OUT --logs $OUT/logs     # where only $OUT comes back from the machine

Runs from the source tree on the machine's own PyTorch, offline: where ``.gpu/whl`` holds wheels (torchao for
that torch, fla-core, pytest, ...) they are installed with ``pip --no-index --no-deps --target /tmp/site`` and put
on PYTHONPATH first. The parts run in priority order, each in its own process group with its own time limit: what
is left of the budget less what the later parts that apply here reserve. A part with less time left than it needs
is skipped, one that fails or overruns is recorded (exit code, last lines of output) and the next one runs. The
report, ``gpu_check_<gpu>_<date>.md`` in --out, is rewritten as each result comes, so a run cut short keeps its
figures. On a machine without a CUDA GPU (or with --plan) it prints the plan and exits 0, writing nothing.
Exit status: 0 when every part that ran passed, 1 otherwise, 2 for bad arguments or no importable torch.

Kept to the standard library: the parts import torch, this process only starts them.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: the parts' module beside it

from scripts.gpu_check_parts import PARTS, Machine, Part, fmt  # noqa: E402
from torchtitan.output_folder import folder_problem  # noqa: E402
from torchtitan.script_args import ScriptParser, real  # noqa: E402

WHEELS = REPO / ".gpu" / "whl"
SITE = Path("/tmp/site")
DEFAULT_BUDGET = 480
ENVIRONMENT_RESERVE = 30  # seconds the wheels and the version probe are planned to take

# Versions and GPUs, printed as one JSON line by a child process ("full": the packages too).
PROBE = r"""
import importlib, importlib.metadata, json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": []}
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        info["gpus"].append({"name": p.name, "capability": [p.major, p.minor], "total_gib": total / 2**30,
                             "free_gib": free / 2**30})
if sys.argv[-1] == "full":
    info["packages"] = {}
    for module, dist in [("torchao", "torchao"), ("fla.ops.gated_delta_rule", "fla-core"), ("triton", "triton"),
                         ("transformers", "transformers"), ("torchdata", "torchdata"), ("datasets", "datasets"),
                         ("pytest", "pytest"), ("xdist", "pytest-xdist")]:
        try:
            importlib.import_module(module)
        except Exception as e:
            info["packages"][dist] = {"error": (f"{type(e).__name__}: {e}".splitlines() or ["?"])[0][:160]}
        else:
            try:
                info["packages"][dist] = {"version": importlib.metadata.version(dist)}
            except importlib.metadata.PackageNotFoundError:
                info["packages"][dist] = {"version": "version unknown"}
print("PROBE " + json.dumps(info))
"""


# --- The machine -----------------------------------------------------------------------------------------------------

def probe(python: str, env: dict, full: bool, timeout: float) -> dict:
    result = subprocess.run([python, "-c", PROBE, "full" if full else "gpus"], env=env, cwd=REPO, text=True,
                            capture_output=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    if result.returncode or not lines:
        last = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise RuntimeError(f"{python} could not import torch: {last}")
    return json.loads(lines[-1][len("PROBE "):])


def child_env(site: Path | None) -> dict:
    """Offline, unbuffered, the wheels' folder and the tree first on the path, one inductor cache across runs."""
    path = [str(p) for p in (site, REPO) if p] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    env = {**os.environ, "PYTHONPATH": ":".join(path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torchtitan-tests-inductor"))
    return env


def install_wheels(python: str, site: Path, timeout: float) -> tuple[bool, str]:
    """(whether the wheels are on the path, the line the report shows about them)."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return False, f"no wheels in {WHEELS.relative_to(REPO)}: only the machine's own packages"
    command = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", str(site),
               *map(str, wheels)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"installing {len(wheels)} wheels from .gpu/whl took over {timeout:.0f} s; not used"
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"installing {len(wheels)} wheels from .gpu/whl failed (exit {result.returncode}: {last})"
    names = ", ".join("-".join(wheel.name.split("-")[:2]) for wheel in wheels)
    return True, f"{len(wheels)} wheels from .gpu/whl installed into {site}, first on PYTHONPATH: {names}"


def shell(command: list[str]) -> str | None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def describe_setup(machine: Machine) -> None:
    driver = shell(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    machine.notes["driver"] = driver.splitlines()[0] if driver else "unknown (no nvidia-smi)"
    commit = shell(["git", "rev-parse", "--short", "HEAD"])
    changed = shell(["git", "status", "--porcelain", "--untracked-files=no"])
    machine.notes["source tree"] = (f"git {commit}" + (" with local changes" if changed else "")) if commit else \
        "not a git checkout"


# --- Budget -----------------------------------------------------------------------------------------------------------

def time_limit(left: float, reserve: float, later_reserves: float) -> float:
    """A part's limit: what is left less what the later parts reserve, and at least its own reserve while that much
    is left; so time a part leaves unused goes to the next, and a short budget drops the last parts first."""
    return max(min(reserve, left), left - later_reserves)


def scale(budget: float) -> float:
    """Reserves grow with a budget above the default (never shrink: a shorter one runs fewer parts)."""
    return max(1.0, budget / DEFAULT_BUDGET)


# --- Running a part ---------------------------------------------------------------------------------------------------

@dataclass
class Result:
    status: str = "waiting"  # waiting, running, passed, failed, over its time limit, skipped: ...
    limit: float | None = None
    took: float | None = None
    command: str = ""
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)


_running: subprocess.Popen | None = None


def stop_group(process: subprocess.Popen) -> None:
    """The part and every process it started (its own session): SIGTERM, and SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader is gone; its children may not be
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def run_command(command: list[str], env: dict, log: Path, limit: float) -> int | None:
    """The exit status, or None when it ran past ``limit`` seconds and was stopped."""
    global _running
    with open(log, "w") as out:
        _running = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            return _running.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_group(_running)
            return None
        finally:
            _running = None


def run_parts(parts: list[Part], machine: Machine, report: Report, deadline: float, logs: Path) -> bool:
    """Every part in order under the budget ending at ``deadline`` (time.monotonic); True when all that ran passed."""
    applies = [part.skip_reason(machine) for part in parts]
    factor = report.scale
    all_passed = True
    for i, part in enumerate(parts):
        result = report.results[i]
        left = deadline - time.monotonic()
        later = sum(p.reserve * factor for p, why in zip(parts[i + 1:], applies[i + 1:]) if why is None)
        limit = time_limit(left, part.reserve * factor, later)
        if applies[i] is not None:
            result.status = f"skipped: {applies[i]}"
        elif limit < part.minimum:
            result.status = f"skipped: {max(left, 0):.0f} s of the budget left, it needs at least {part.minimum:.0f}"
        else:
            work = logs / f"{i + 1}_{re.sub(r'[^a-z0-9]+', '_', part.title.lower()).strip('_')}"
            work.mkdir(parents=True, exist_ok=True)
            command = part.command(machine, work)
            result.status, result.limit, result.command = "running", limit, shlex.join(command)
            report.write()
            print(f"[gpu_check] {i + 1}. {part.title}: limit {limit:.0f} s: {result.command}", flush=True)
            start = time.monotonic()
            code = run_command(command, machine.env, work / "output.log", limit)
            result.took = time.monotonic() - start
            output = (work / "output.log").read_text(errors="replace")
            try:
                result.lines, result.problems = part.figures(machine, work, output)
            except Exception as e:  # a figure reader meeting output it did not expect must not stop the check
                result.problems = [f"reading its figures: {type(e).__name__}: {e}"]
            if code is None:
                result.status = f"over its time limit ({limit:.0f} s), stopped"
            elif code != 0:
                result.status = f"failed: exit {code}"
            else:
                result.status = "failed: " + "; ".join(result.problems) if result.problems else "passed"
            if result.status != "passed":
                result.tail = output.splitlines()[-30:]
                all_passed = False
        print(f"[gpu_check] {i + 1}. {part.title}: {result.status}", flush=True)
        report.write()
    return all_passed


# --- The report -------------------------------------------------------------------------------------------------------

class Report:
    """The markdown report, rewritten whole (through a temporary file) at every change."""

    def __init__(self, path: Path | None, parts: list[Part], machine: Machine, budget: float, argv: list[str]):
        self.path, self.parts, self.machine, self.budget = path, parts, machine, budget
        self.scale = scale(budget)
        self.results = [Result() for _ in parts]
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.start = time.monotonic()
        self.command = shlex.join(["scripts/gpu_check.sh", *argv])
        self.outcome = "running"

    def environment(self) -> list[str]:
        info, gpus = self.machine.info, self.machine.gpus
        rows = [("GPU", "; ".join(f"{g['name']} (compute capability {g['capability'][0]}.{g['capability'][1]}, "
                                  f"{g['total_gib']:.1f} GiB, {g['free_gib']:.1f} GiB free)" for g in gpus) or "none"),
                ("driver", self.machine.notes.get("driver", "unknown")),
                ("torch", f"{info.get('torch')} (CUDA {info.get('cuda')})"), ("python", info.get("python"))]
        for dist, entry in info.get("packages", {}).items():
            rows.append((dist, entry.get("version") or f"not importable: {entry.get('error')}"))
        rows += [(key, value) for key, value in self.machine.notes.items() if key != "driver"]
        return ["| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in rows)]

    def render(self) -> str:
        used = time.monotonic() - self.start
        gpu = self.machine.gpus[0]["name"] if self.machine.gpus else "no GPU"
        lines = [f"# GPU check: {gpu}, {self.started:%Y-%m-%d}", "",
                 f"Result: {self.outcome}.", "",
                 f"`{self.command}`, started {self.started:%Y-%m-%d %H:%M} UTC; budget {self.budget:.0f} s, "
                 f"{used:.0f} s used so far.", "", "## Environment", "", *self.environment(), "",
                 "## Parts, in priority order", "", "| # | part | limit (s) | took (s) | result |",
                 "|---|---|---|---|---|"]
        for i, (part, result) in enumerate(zip(self.parts, self.results), 1):
            lines.append(f"| {i} | {part.title} | {fmt(result.limit, '.0f')} | {fmt(result.took, '.1f')} | "
                         f"{result.status} |")
        for i, (part, result) in enumerate(zip(self.parts, self.results), 1):
            if not result.command:
                continue
            lines += ["", f"## {i}. {part.title}: {result.status}", "", f"`{result.command}`", "", *result.lines]
            if result.tail:
                lines += ["", "Last lines of its output:", "", "```", *result.tail, "```"]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if self.path is None:
            return
        temporary = self.path.with_suffix(".md.tmp")
        temporary.write_text(self.render())
        temporary.replace(self.path)


# --- Plan and main ----------------------------------------------------------------------------------------------------

def report_name(gpu: str | None, date: datetime.date) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower().replace("nvidia", "")).strip("_") if gpu else "<gpu>"
    return f"gpu_check_{slug or 'gpu'}_{date:%Y-%m-%d}.md"


def unused(path: Path) -> Path:
    """``path``, or the first of path-2, path-3, ... that does not exist: a second check on the same GPU and day
    keeps the first one's report."""
    n = 1
    while path.with_stem(f"{path.stem}-{n}" if n > 1 else path.stem).exists():
        n += 1
    return path.with_stem(f"{path.stem}-{n}" if n > 1 else path.stem)


def plan_lines(parts: list[Part], machine: Machine | None, budget: float, report: Path) -> list[str]:
    """The parts in order with the limits they get if each takes its whole limit (with no GPU here: as if every
    part applied)."""
    factor = scale(budget)
    applies = [None if machine is None else part.skip_reason(machine) for part in parts]
    left = budget - ENVIRONMENT_RESERVE
    lines = [f"GPU check plan: budget {budget:.0f} s; the parts in priority order, each with the limit it gets when "
             "the earlier ones use theirs whole (time a part leaves unused goes to the next)"
             + (" and, with no GPU here, as if every part applied" if machine is None else ""),
             f"  0. environment: {'install the wheels in .gpu/whl' if WHEELS.is_dir() else 'no .gpu/whl here'}, "
             f"record the versions: about {ENVIRONMENT_RESERVE} s"]
    for i, (part, why) in enumerate(zip(parts, applies)):
        later = sum(p.reserve * factor for p, w in zip(parts[i + 1:], applies[i + 1:]) if w is None)
        limit = time_limit(left, part.reserve * factor, later)
        if why is not None:
            timing = f"skipped: {why}"
        elif limit < part.minimum:
            timing = f"skipped: {max(left, 0):.0f} s left, needs at least {part.minimum:.0f} s"
        else:
            timing = f"limit {limit:.0f} s (skipped with under {part.minimum:.0f} s left)"
            left -= limit
        lines.append(f"  {i + 1}. {part.title}: {part.what(machine)}: {timing}")
    lines.append(f"report: {report.relative_to(REPO) if report.is_relative_to(REPO) else report}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=real(0, low_open=True, note="seconds"), default=DEFAULT_BUDGET,
                        help="seconds for the whole check")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder of the report")
    parser.add_argument("--logs", type=Path, help="folder for each part's output and files (default: a new "
                        "temporary folder, named in the report)")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit, even on a GPU machine")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: is a file; give a folder for the report")
    if args.logs is not None and (problem := folder_problem(args.logs)):  # a part's files would mix with older ones
        parser.error(f"--logs {args.logs} {problem}")
    deadline = time.monotonic() + args.budget
    python = sys.executable
    try:
        info = probe(python, child_env(None), full=False, timeout=120)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    today = datetime.datetime.now(datetime.timezone.utc).date()
    if not info["gpus"]:
        print(f"No CUDA GPU here (torch {info['torch']}): the plan only; nothing runs and nothing is written.")
        print("\n".join(plan_lines(PARTS, None, args.budget, args.out / report_name(None, today))))
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu_check_site_") as scratch:
        site = Path(scratch) if args.plan else SITE
        installed, wheels_note = install_wheels(python, site, timeout=max(1, min(120, deadline - time.monotonic())))
        machine = Machine(python, child_env(site if installed else None), info, {"wheels": wheels_note})
        try:
            machine.info = probe(python, machine.env, full=True, timeout=max(1, min(120, deadline - time.monotonic())))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # an import that kills the interpreter
            machine.notes["packages"] = f"not known: importing them failed ({e})"
        path = unused(args.out / report_name(machine.gpus[0]["name"], today))
        print("\n".join(plan_lines(PARTS, machine, args.budget, path)), flush=True)
        if args.plan:
            return 0
    describe_setup(machine)
    machine.notes["set-up"] = f"{time.monotonic() - deadline + args.budget:.0f} s (probes, wheels, versions)"
    logs = args.logs or Path(tempfile.mkdtemp(prefix="gpu_check_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    machine.notes["logs"] = f"each part's output and files in {logs}"
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(path, PARTS, machine, args.budget, argv)
    report.start = deadline - args.budget

    def interrupted(signum, frame):
        if _running is not None:
            stop_group(_running)
        report.outcome = f"interrupted by signal {signum}"
        report.write()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    report.write()
    passed = run_parts(PARTS, machine, report, deadline, logs)
    ran = [(p.title, r.status) for p, r in zip(PARTS, report.results) if not r.status.startswith("skipped")]
    failed = [title for title, status in ran if status != "passed"]
    report.outcome = (f"passed: all {len(ran)} parts that ran" if passed else
                      f"FAILED: {len(failed)} of the {len(ran)} parts that ran ({', '.join(failed)})")
    report.write()
    print(f"[gpu_check] {report.outcome}; report: {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
