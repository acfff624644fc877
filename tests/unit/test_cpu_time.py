"""tests/cpu_time.py (the opt-in CPU-time plugin) charges a test with the CPU of the processes it waited for,
across xdist's workers."""

import os
import subprocess
import sys

from tests.conftest import REPO

BUSY = """
import subprocess, sys

def test_busy():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + {seconds}\\n"
                    "while time.process_time() < end: pass"], check=True)

def test_idle():
    pass
"""


def test_a_child_process_cpu_is_charged_to_the_test_that_started_it(tmp_path):
    (tmp_path / "test_load.py").write_text(BUSY.format(seconds=0.6))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHTITAN_CPU_TIME_DIR": str(tmp_path / "rows")}
    (tmp_path / "rows").mkdir()
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.cpu_time", "-n", "2", "-p",
                             "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_load.py")],
                            check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "CPU time (tests.cpu_time)" in line)
    assert lines[start + 1].startswith("2 tests,")
    charged = {line.split()[-1].split("::")[-1]: float(line.split()[0]) for line in lines[start + 1:]
               if "::" in line}
    assert 0.6 <= charged["test_busy"] < 3 and charged["test_idle"] < 0.3
