import ast
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"

# No test may reach the Hugging Face hub: hub loads fail fast instead (subprocesses inherit this).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# And anything else that tries HTTP(S) meets a proxy that refuses at once: the suite must pass offline.
# The values they had before are kept for the one setup step that must reach the network (online_env).
_PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
# pytest-xdist's workers inherit the environment this file already changed: they read the originals back.
_SAVED_PROXIES = "TORCHTITAN_TESTS_ORIGINAL_PROXY_ENV"
ORIGINAL_PROXY_ENV = json.loads(os.environ.get(_SAVED_PROXIES) or json.dumps(
    {var: os.environ.get(var) for var in (*_PROXIES, "NO_PROXY", "no_proxy")}))
os.environ[_SAVED_PROXIES] = json.dumps(ORIGINAL_PROXY_ENV)
for _var in _PROXIES:
    os.environ[_var] = "http://127.0.0.1:9"
os.environ["NO_PROXY"] = os.environ["no_proxy"] = ""
# `datasets` leaves a lock file per data file read in its cache; keep the tests' out of the user's cache.
_DATASETS_CACHE = tempfile.TemporaryDirectory(prefix="torchtitan-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE.name
# One inductor cache for every compiling test process, kept between runs: compiling is the slow part.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torchtitan-tests-inductor"))


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (the suite's default): one worker per core, at most 4; most tests start processes of their own
    and many spend seconds waiting on them (start-up, rendezvous, a killed rank's timeout), which the other
    worker's tests fill."""
    from torchtitan.hardware import usable_cores  # imports torch: only after this file has set its environment

    return max(1, min(4, usable_cores()))


def pytest_configure(config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from torchtitan.hardware import usable_cores

        # Each worker's own torch ops get their share of the cores: threads beyond them only wait on each other.
        torch.set_num_threads(max(1, usable_cores() // workers))
        # OpenMP threads that spin while they wait take the cores from the other worker's processes: a trainer's
        # step took 2 to 4 times longer beside another test's (measured), against 8 % slower alone when they sleep.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _read_module(path: Path) -> tuple[dict[str, set[str]], bool]:
    """A Python file's top-level functions (tests and fixtures) with the names of their parameters, and whether
    any fixture in it is module- or class-scoped (shared between its tests)."""
    tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[])
    functions = {node.name: {a.arg for a in node.args.args} for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    shares = any(isinstance(node, ast.keyword) and node.arg == "scope" and isinstance(node.value, ast.Constant)
                 and node.value.value in ("module", "class") for node in ast.walk(tree))
    return functions, shares


def pytest_xdist_make_scheduler(config, log):
    """Every test that reads the suite's matrix of training runs (a session fixture, tests/integration/conftest.py,
    directly or through another fixture) on one worker, so the matrix runs once; the other tests of a module that
    shares fixtures between its tests (module- or class-scoped) on one worker, so they run once; every other test
    on its own, so the workers finish together. The largest group, the matrix's, is scheduled first."""
    from xdist.scheduler import LoadScopeScheduling

    shared = _read_module(REPO / "tests" / "integration" / "conftest.py")[0]
    modules: dict[str, tuple[set[str], bool]] = {}

    def module_facts(module: str) -> tuple[set[str], bool]:
        """(the module's tests that read the matrix, whether it shares fixtures between tests)."""
        if module not in modules:
            own, shares = _read_module(REPO / module)
            functions = {**shared, **own}
            readers = {"suite_runs", "many_process_runs"}
            while grown := {name for name, params in functions.items() if params & readers} - readers:
                readers |= grown
            modules[module] = ({name for name in readers if name.startswith("test")}, shares)
        return modules[module]

    class MatrixAndModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, _, name = nodeid.partition("::")
            readers, shares = module_facts(module)
            if name.split("[")[0].split("::")[-1] in readers:
                return "training-matrix"
            return module if shares else nodeid

    return MatrixAndModuleScheduling(config, log)


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    # Presets name paths relative to the repository root, as users run them.
    monkeypatch.chdir(REPO)


def online_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: os.environ) with the proxy variables as they were before this file
    pointed them at the offline proxy: restored where they were set, removed where they were not.

    Only for a test's setup that must reach the network (installing Slurm); the test itself stays offline.
    """
    result = dict(os.environ if env is None else env)
    for var, value in ORIGINAL_PROXY_ENV.items():
        if value is None:
            result.pop(var, None)
        else:
            result[var] = value
    return result


def run_module(module: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` from the repo root, capturing text output."""
    return run_command([sys.executable, "-m", module, *args], env=env, timeout=timeout)


def torchrun_command(nproc: int, module: str, ranks: str | None = "0") -> list[str]:
    """``python -m module`` (or the script ``module``, a path ending in .py) on ``nproc`` local processes under
    torchrun, showing the output of ``ranks``, each line prefixed with its rank; ``ranks=None``: every rank's output
    as it is, unprefixed (a script whose rank 0 alone prints, as users run it).

    Where this host has GPUs but fewer than ``nproc``, the layout runs on the CPU (gloo): NCCL cannot put two
    ranks on one GPU, and the trainer refuses such a launch."""
    import torch

    too_few_gpus = torch.cuda.is_available() and nproc > torch.cuda.device_count()
    cpu_only = ["env", "CUDA_VISIBLE_DEVICES="] if too_few_gpus else []
    shown = [] if ranks is None else ["--local-ranks-filter", ranks, "--role", "rank", "--tee", "3"]
    target = [module] if module.endswith(".py") else ["-m", module]
    return [*cpu_only, sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend",
            "c10d", "--rdzv_endpoint=localhost:0", *shown, *target]


def trainer_command(nproc: int) -> list[str]:
    """The trainer on ``nproc`` processes, started directly: run_train.sh's config pre-check and its own
    torchrun cost seconds per launch, which tests that are not about run_train.sh need not pay."""
    return [sys.executable, "-m", "torchtitan.train"] if nproc == 1 else torchrun_command(nproc, "torchtitan.train")


def run_command(cmd: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env.get('PATH', '')}"
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
