import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    # Presets name paths relative to the repository root, as users run them.
    monkeypatch.chdir(REPO)


def run_module(module: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` from the repo root, capturing text output."""
    return run_command([sys.executable, "-m", module, *args], env=env, timeout=timeout)


def run_command(cmd: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env.get('PATH', '')}"
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
