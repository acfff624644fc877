"""tests/cpu_time.py (the opt-in CPU-time plugin) charges a test with the CPU of the processes it waited for,
across xdist's workers, and refuses a TORCHTITAN_CPU_TIME_DIR that is not a folder."""

import json
import os
import subprocess
import sys

import pytest

from tests.bad_input import assert_unchanged, snapshot
from tests.conftest import REPO

BUSY = """
import subprocess, sys

def test_busy():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\n"
                    "while time.process_time() < end: pass"], check=True)

def test_idle():
    pass
"""


def _pytest_with_the_plugin(tmp_path, rows_dir) -> subprocess.CompletedProcess:
    (tmp_path / "test_load.py").write_text(BUSY)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHTITAN_CPU_TIME_DIR": str(rows_dir)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.cpu_time", "-n", "2", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_load.py")],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_child_process_cpu_is_charged_to_the_test_that_started_it(tmp_path):
    rows = tmp_path / "rows"
    rows.mkdir()
    # An earlier run's rows in the same folder: neither counted nor touched.
    (rows / "1.jsonl").write_text(json.dumps({"test": "old.py::test_old", "wall": 9.0, "cpu": 99.0}) + "\n")
    before = snapshot(rows)
    result = _pytest_with_the_plugin(tmp_path, rows)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "CPU time (tests.cpu_time)" in line)
    assert lines[start + 1].startswith("2 tests,")
    charged = {line.split()[-1].split("::")[-1]: float(line.split()[0]) for line in lines[start + 1:]
               if "::" in line}
    assert set(charged) == {"test_busy", "test_idle"}
    assert 0.6 <= charged["test_busy"] < 3 and charged["test_idle"] < 0.3
    assert_unchanged(before)


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_rows_folder_that_is_not_a_folder_is_one_line_naming_it(tmp_path, kind):
    rows = tmp_path / "rows"
    if kind == "file":
        rows.write_text("not a folder\n")
    before = snapshot(tmp_path)
    result = _pytest_with_the_plugin(tmp_path, rows)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "TORCHTITAN_CPU_TIME_DIR" in line]
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert "Traceback" not in output and len(errors) == 1 and str(rows) in errors[0], output
    assert_unchanged(before)
