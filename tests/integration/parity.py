"""Shared by the parity tests: run the trainer under a layout and compare its metrics with a reference run."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import run_command, torchrun_command, trainer_command
from torchtitan.hardware import usable_cores

# The debug model (6 layers, so every pipeline split fits) at a short sequence, 4 steps (2 of warm-up, 2 of
# decay): a fraction of a second per step, where start-up and compiling are the cost.
STEPS = 4
COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "32", "--training.steps", str(STEPS),
          "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
CONFIG = "train_configs/debug_model.toml"

# The modules whose debug-model layouts run together; each has debug_layouts(folder) -> {name: (nproc, flags)}.
DEBUG_LAYOUT_MODULES = ("test_distributed", "test_pipeline", "test_context_parallel_training",
                        "test_document_masking_training", "test_chunked_loss_training", "test_objective_training",
                        "test_muon_training", "test_lora", "test_fault_tolerance", "test_mup_training",
                        "test_qk_clip_training")
# The modules with runs of other models or configs in the same launches; each has
# suite_matrices(folder) -> {prefix: Matrix}, and its layouts' names start with their prefix.
OTHER_MATRIX_MODULES = ("test_moe", "test_deepseek_v3_training", "test_gradient_sync", "test_qwen3",
                        "test_extensions", "test_muon_training", "test_optimizer_checkpoints", "test_lora",
                        "test_qwen3_next_training", "test_gpt_oss_training", "test_rl_training", "test_vlm_training",
                        "test_kimi_linear_training", "test_qk_clip_training", "test_step_timeline")


def read_rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_matches(rows, reference):
    """The steps of the debug-model reference run: losses and grad norms within 1e-4 relative."""
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert_same_steps(rows, reference)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it trains, so the comparison is not between constants


def train(dump: Path, nproc: int, flags: list[str], config: str = CONFIG, common=COMMON) -> list[dict]:
    result = run_command([*trainer_command(nproc), "--job.config_file", config, *common, *flags,
                          f"--job.dump_folder={dump}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_rows(dump)


def assert_same_steps(rows: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    for ours, ref in zip(rows, expected):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ours["step"]


# The layouts of 8 and 16 processes: the tiny flavor (fp32, global batch 8, 4 steps), where start-up, not
# training, is the cost; one launch per process count for all of them (the many_process_runs fixture).
TINY_CONFIG = "train_configs/tiny.toml"
TINY_COMMON = ["--training.mixed_precision_param", "float32", "--training.steps", "4", "--metrics.log_freq", "1",
               "--comm.init_timeout_seconds", "900", "--comm.train_timeout_seconds", "900"]
_PP2_TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]
_MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
MANY_PROCESS_LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "dp2_tp2_pp2": (8, ["--training.local_batch_size", "4", *_PP2_TP2]),
    "cp2_tp2_pp2": (8, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2", *_PP2_TP2]),
    # All four dimensions in one mesh.
    "fsdp2_cp2_tp2_pp2": (16, ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2",
                               *_PP2_TP2]),
    # Muon's owner exchange across pipeline stages whose meshes hold different matrices (test_muon_training.py).
    "muon_single": (1, ["--training.local_batch_size", "8", *_MUON]),
    "muon_dp2_tp2_pp2": (8, ["--training.local_batch_size", "4", *_PP2_TP2, *_MUON]),
}


def assert_tiny_matches_single_process(runs: dict[str, list[dict] | str], layout: str) -> None:
    """A layout of MANY_PROCESS_LAYOUTS trained the single process's 4 steps."""
    rows = rows_of(runs, layout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_same_steps(rows, rows_of(runs, "single"))


def assert_resumes_under_another_layout(tmp_path: Path, source: tuple[int, list[str]],
                                        target: tuple[int, list[str]]) -> None:
    """Saved at step 3 under ``source`` (nproc, flags), resumed under ``target``: steps 4-6 match the
    uninterrupted source run."""
    ckpt = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
            "--training.local_batch_size", "8"]
    straight = train(tmp_path / "straight", source[0], [*ckpt, *source[1]])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    result = run_command([*trainer_command(target[0]), "--job.config_file", CONFIG, *COMMON, *ckpt, *target[1],
                          f"--job.dump_folder={resumed}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from step 3" in result.stdout + result.stderr
    assert_same_steps(read_rows(resumed), straight[3:])


@dataclass
class Matrix:
    """Layouts sharing one config and common flags: name -> (nproc, flags) or (nproc, flags, entry). ``entry``
    ("module:function") runs each job in place of the trainer's main, e.g. one that also counts collectives;
    a layout's own entry takes precedence. Flags may name another ``--job.config_file`` (the last one wins)."""

    layouts: dict[str, tuple]
    config: str = CONFIG
    common: list[str] = field(default_factory=lambda: list(COMMON))
    entry: str = "torchtitan.train:main"


def train_matrix(folder: Path, layouts: dict[str, tuple], config: str = CONFIG, common=COMMON,
                 entry: str = "torchtitan.train:main") -> dict[str, list[dict] | str]:
    """Run every layout of one Matrix (see train_matrices)."""
    return train_matrices(folder, {"": Matrix(layouts, config, list(common), entry)})


def train_matrices(folder: Path, matrices: dict[str, Matrix]) -> dict[str, list[dict] | str]:
    """Run the layouts of every matrix with one torchrun launch per process count; a layout's name (and its
    job.dump_folder under ``folder``) is its matrix's key followed by its own name.

    Start-up (interpreters, imports, rendezvous) is paid once per launch instead of once per layout; the
    jobs run one after another in the same processes, in the order given (tests/integration/matrix_worker.py),
    which also writes each job's seconds to ``matrix-N.times.json``. Returns the metrics rows of each layout,
    or the reason it has none (its failure, or an earlier job's).
    """
    jobs: dict[str, tuple[int, list[str], str]] = {}
    for prefix, matrix in matrices.items():
        for name, layout in matrix.layouts.items():
            full = prefix + name
            assert full not in jobs, f"two layouts are named {full!r}"
            jobs[full] = (layout[0], ["--job.config_file", matrix.config, *matrix.common, *layout[1],
                                      f"--job.dump_folder={folder / full}"], (*layout, matrix.entry)[2])
    results: dict[str, list[dict] | str] = {}
    for nproc in _launch_order(jobs, folder):
        names = [name for name, job in jobs.items() if job[0] == nproc]
        # One-process jobs are split over two concurrent launches of one thread each: much of their time is
        # compiling, which is single-threaded, so two of them use two cores where one launch would use one.
        groups = _balanced_groups(names, jobs, folder) if nproc == 1 and usable_cores() > 1 else [names]
        threads = {"OMP_NUM_THREADS": str(max(1, usable_cores() // len(groups)))} if len(groups) > 1 else None
        with ThreadPoolExecutor(len(groups)) as pool:
            launches = [pool.submit(_launch, folder, f"{nproc}{'abcdefgh'[i] if len(groups) > 1 else ''}", nproc,
                                    group, jobs, threads) for i, group in enumerate(groups)]
            for launch in launches:
                results.update(launch.result())
    return results


def _launch_order(jobs: dict, folder: Path) -> list[int]:
    """The process counts in the order their launches run: fewest processes first, except that a launch whose
    jobs read another launch's folders (a checkpoint to resume) runs after it."""
    counts = sorted({job[0] for job in jobs.values()})
    after = {n: {jobs[other][0] for name, job in jobs.items() if job[0] == n for other in jobs
                 if jobs[other][0] != n and _reads(jobs, folder, name, other)} for n in counts}
    order: list[int] = []
    while len(order) < len(counts):
        ready = [n for n in counts if n not in order and after[n] <= set(order)]
        assert ready, f"launches that read each other's folders: {after}"
        order.append(ready[0])
    return order


def _reads(jobs: dict, folder: Path, name: str, other: str) -> bool:
    """Whether job ``name`` reads job ``other``'s folder (e.g. resumes its checkpoint)."""
    return f"{folder / other}/" in " ".join(jobs[name][1])


def _launch(folder: Path, tag: str, nproc: int, names: list[str], jobs: dict, env: dict | None
            ) -> dict[str, list[dict] | str]:
    """One torchrun launch of ``names`` in order (tests/integration/matrix_worker.py)."""
    spec = folder / f"matrix-{tag}.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps([{"name": name, "entry": jobs[name][2], "argv": jobs[name][1]} for name in names]))
    result = run_command([*torchrun_command(nproc, "tests.integration.matrix_worker"), str(spec)], env=env,
                         timeout=1800)
    codes_file = spec.with_suffix(".codes.json")
    codes = json.loads(codes_file.read_text()) if codes_file.exists() else {}
    output = result.stdout[-3000:] + result.stderr[-3000:]
    results: dict[str, list[dict] | str] = {}
    for name in names:
        if codes.get(name) == 0:
            results[name] = read_rows(folder / name)
        elif name in codes:
            results[name] = f"{name} exited {codes[name]}:\n{output}"
        else:
            results[name] = f"{name} did not run (launch exit {result.returncode}; an earlier job failed):\n{output}"
    return results


def _balanced_groups(names: list[str], jobs: dict, folder: Path, count: int = 2) -> list[list[str]]:
    """``names`` in ``count`` groups of about equal estimated time, each in the given order; a job that reads
    another's folder (a checkpoint it resumes) stays in that job's group."""
    owner = {name: name for name in names}  # union-find over jobs that read each other's folders

    def root(name: str) -> str:
        while owner[name] != name:
            name = owner[name]
        return name

    for name in names:
        for other in names:
            if other != name and _reads(jobs, folder, name, other):
                owner[root(name)] = root(other)

    def cost(name: str) -> float:
        argv = jobs[name][1]
        steps = [int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--training.steps"]
        # Compiling costs about 20 s cold, float8's emulated casts about 10 s; a step of these tiny models 0.15 s.
        return (1 + 20 * ("--compile.enable" in argv) + 10 * any("float8" in a for a in argv)
                + 0.15 * (steps[-1] if steps else 10))

    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(root(name), []).append(name)
    loads, chosen = [0.0] * count, {}
    for unit in sorted(units.values(), key=lambda unit: -sum(map(cost, unit))):
        group = loads.index(min(loads))
        loads[group] += sum(map(cost, unit))
        chosen.update(dict.fromkeys(unit, group))
    return [group for group in ([n for n in names if chosen[n] == g] for g in range(count)) if group]


def runs_under(results: dict[str, list[dict] | str], prefix: str) -> dict[str, list[dict] | str]:
    """One matrix's runs of a train_matrices result, by their names without the matrix's prefix."""
    return {name[len(prefix):]: rows for name, rows in results.items() if name.startswith(prefix)}


def rows_of(results: dict[str, list[dict] | str], name: str) -> list[dict]:
    """The metrics rows of one layout of a train_matrix, failing the test with the run's output if it has none."""
    rows = results[name]
    assert isinstance(rows, list), rows
    return rows


def embedding_copies(folder: Path, nproc: int) -> list[list[dict]]:
    """Per step, every rank's fingerprints of its token-embedding copies (shared_embedding_worker.py)."""
    ranks = [json.loads((folder / f"embedding-rank{rank}.json").read_text()) for rank in range(nproc)]
    return [[copy for rank in ranks for copy in rank[step]] for step in range(len(ranks[0]))]
