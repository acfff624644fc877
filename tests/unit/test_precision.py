"""The compute dtype rule (training.mixed_precision_param = "auto") and the bounded CPU peak calibration."""

import contextlib
import json
from pathlib import Path

import pytest
import torch

from torchtitan.components.metrics import peak_flops
from torchtitan.config import load_config
from torchtitan.config_check import validate_config
from torchtitan.distributed import precision


@pytest.fixture
def fast_bf16(monkeypatch):
    """Patch the CPU capability check: ``fast_bf16(True)`` or ``fast_bf16(False)``."""
    return lambda value: monkeypatch.setattr(precision, "cpu_computes_bf16_fast", lambda: value)


@pytest.mark.parametrize("fast, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_cpu_follows_the_bf16_capability(fast_bf16, fast, expected):
    fast_bf16(fast)
    dtype, why = precision.resolve_compute_dtype("auto", "cpu")
    assert dtype == expected and why.startswith("auto: this CPU")


@pytest.mark.parametrize("fast", [True, False])
def test_auto_is_bf16_on_gpus_and_explicit_values_are_obeyed(fast_bf16, fast):
    fast_bf16(fast)
    assert precision.resolve_compute_dtype("auto", "cuda")[0] == "bfloat16"
    for name in ("float32", "bfloat16", "float16"):
        assert precision.resolve_compute_dtype(name, "cpu") == (name, "as configured")


@pytest.mark.parametrize("flags, expected", [("fpu sse avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                             ("avx2 avx512f amx_bf16 amx_tile", True)])
def test_capability_comes_from_the_x86_flags(monkeypatch, flags, expected):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(precision, "cpuinfo_field", lambda name: flags if name == "flags" else None)
    monkeypatch.setattr(precision, "_bf16_matmul_is_faster", lambda: pytest.fail("must not time with x86 flags"))
    precision.cpu_computes_bf16_fast.cache_clear()
    try:
        assert precision.cpu_computes_bf16_fast() is expected
    finally:
        precision.cpu_computes_bf16_fast.cache_clear()


@pytest.mark.parametrize("faster", [True, False])
@pytest.mark.parametrize("flags, isa_limit", [(None, None), ("avx2 avx512_bf16", "AVX2")],
                         ids=["no-x86-flags", "isa-limited-by-onednn"])
def test_without_usable_x86_flags_a_timing_decides(monkeypatch, faster, flags, isa_limit):
    monkeypatch.setattr(precision, "cpuinfo_field", lambda name: flags)
    if isa_limit:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_limit)
    monkeypatch.setattr(precision, "_bf16_matmul_is_faster", lambda: faster)
    precision.cpu_computes_bf16_fast.cache_clear()
    try:
        assert precision.cpu_computes_bf16_fast() is faster
    finally:
        precision.cpu_computes_bf16_fast.cache_clear()


def test_the_timing_runs_and_answers():
    assert precision._bf16_matmul_is_faster(seconds=0.01, n=128) in (True, False)


@pytest.mark.parametrize("fast, expected", [(True, "bfloat16"), (False, "float32")])
def test_trainer_resolves_auto_logs_it_and_records_it_in_provenance(tmp_path, fast_bf16, fast, expected):
    from torchtitan.train import Trainer

    fast_bf16(fast)
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", f"--job.dump_folder={tmp_path}",
                                "--training.steps", "1"])
    validate_config(cfg, sources, world_size=1)
    assert cfg.training.mixed_precision_param == "auto"  # the default
    trainer = Trainer(cfg)
    try:
        assert cfg.training.mixed_precision_param == expected
        # Parameters are stored in float32: only a bfloat16 compute dtype needs autocast.
        assert (trainer.autocast is contextlib.nullcontext) == (expected == "float32")
        recorded = json.loads((tmp_path / "provenance.json").read_text())["compute_dtype"]
        assert recorded["dtype"] == expected and recorded["why"].startswith("auto: this CPU")
    finally:
        trainer.close()


class FakeMachine:
    """A clock that advances by each fake matmul's duration at ``flops_per_second``."""

    def __init__(self, flops_per_second: float):
        self.rate, self.now, self.sizes = flops_per_second, 0.0, []

    def clock(self) -> float:
        return self.now

    def matmul(self, a, b):
        self.sizes.append(a.shape[0])
        self.now += 2 * a.shape[0] ** 3 / self.rate


def test_calibration_on_a_slow_dtype_stays_within_its_budget():
    """0.73 GFLOP/s (bf16 on an AVX2-only EPYC): one 1024^2 matmul would take 3 s, a 4096^2 one 3 minutes."""
    machine = FakeMachine(0.73e9)
    tflops = peak_flops.measure_matmul_tflops(torch.float32, threads=1, budget_seconds=3.0,
                                              clock=machine.clock, matmul=machine.matmul)
    assert set(machine.sizes) == {256}  # 1024 would not fit the budget
    # A warm-up, then 6 timed matmuls of 46 ms fill each of the 3 rounds' 0.25 s slices.
    assert len(machine.sizes) == 1 + 3 * 6
    assert machine.now <= 3.0
    assert tflops == pytest.approx(0.73e-3)


def test_calibration_on_a_fast_dtype_measures_every_size_within_its_budget():
    machine = FakeMachine(2e12)
    tflops = peak_flops.measure_matmul_tflops(torch.float32, threads=1, budget_seconds=3.0,
                                              clock=machine.clock, matmul=machine.matmul)
    assert set(machine.sizes) == {256, 1024, 2048, 4096}
    assert machine.now <= 3.0
    assert tflops == pytest.approx(2.0)


def test_calibration_says_so_before_it_measures(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    said = []
    monkeypatch.setattr(peak_flops.logger, "info", said.append)

    def measure(dtype, threads):
        assert said and said[0].startswith("measuring this CPU's bfloat16 matmul peak")
        return 1.0

    monkeypatch.setattr(peak_flops, "measure_matmul_tflops", measure)
    assert peak_flops.cpu_machine_peak_tflops(torch.bfloat16) == 1.0


@pytest.mark.parametrize("fast, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_planner_picks_the_trainers_dtype(fast_bf16, fast, expected):
    from torchtitan.planner import plan

    fast_bf16(fast)
    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml"])
    assert cfg.training.mixed_precision_param == "auto"
    # A given efficiency skips the CPU timing; the dtype rule is the same either way.
    assert plan(cfg, "CPU", efficiency=0.5).compute_dtype == expected
    assert plan(cfg, "H100").compute_dtype == "bfloat16"
    assert cfg.training.mixed_precision_param == "auto"  # planning leaves the config as it was


def test_no_other_dtype_name_table_exists():
    """Dtype names map to torch dtypes in hardware.DTYPES only (a grep of the package and scripts)."""
    import re
    from pathlib import Path

    from torchtitan import hardware

    # name -> torch dtype, name -> byte size, or a dtype looked up by name on the torch module
    table = re.compile(r"""["'](float32|bfloat16|float16)["']\s*:\s*(torch\.|[1248]\s*[,}])|getattr\(torch,""")
    root = Path(hardware.__file__).parents[1]
    offenders = [f"{path.relative_to(root)}:{number}" for folder in ("torchtitan", "scripts", "benchmarks")
                 for path in sorted((root / folder).rglob("*.py")) if path != Path(hardware.__file__)
                 for number, line in enumerate(path.read_text().splitlines(), 1) if table.search(line)]
    assert offenders == []


PRESETS = sorted(path.name for path in (Path(__file__).parents[2] / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fast", [True, False])
def test_planner_and_trainer_pick_the_same_dtype_for_every_shipped_config(fast_bf16, preset, fast):
    from torchtitan.planner import plan

    fast_bf16(fast)
    cfg, _ = load_config(["--job.config_file", f"train_configs/{preset}"])
    for device, device_type in (("CPU", "cpu"), ("H100", "cuda")):
        trainer_dtype, _ = precision.resolve_compute_dtype(cfg.training.mixed_precision_param, device_type)
        world = cfg.parallelism.data_parallel_replicate_degree * cfg.parallelism.tensor_parallel_degree * \
            cfg.parallelism.pipeline_parallel_degree * cfg.parallelism.context_parallel_degree
        assert plan(cfg, device, world_size=world, efficiency=0.5).compute_dtype == trainer_dtype, (preset, device)


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """``calibrated(tflops)``: this machine's CPU peak, in a cache of the test's own, reads ``tflops``."""
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))

    def calibrate(tflops: float) -> None:
        monkeypatch.setattr(peak_flops, "measure_matmul_tflops", lambda dtype, threads: tflops)

    return calibrate


def cached_peaks(tmp_path) -> list[float]:
    return list(json.loads((tmp_path / peak_flops.CACHE_FILE).read_text()).values())


@pytest.mark.parametrize("calibrated_tflops", [2.0, 0.02])  # equal to what is achieved, and 100 times lower
def test_mfu_is_never_above_100_percent_and_a_higher_rate_raises_the_peak_for_the_run(tmp_path, calibrated,
                                                                                      calibrated_tflops):
    """Two one-thread trainings side by side on a 2-core CPU logged 98-107% against a peak calibrated under load."""
    calibrated(calibrated_tflops)
    peak = peak_flops.Peak(torch.device("cpu"), torch.float32, override=None)
    assert peak.tflops == calibrated_tflops
    assert peak.mfu(2.0) == pytest.approx(100.0) and peak.tflops == 2.0
    assert peak.mfu(1.0) == pytest.approx(50.0)  # a slower window is measured against the raised peak
    # The cache keeps the measured rate: a rate above it may come from a FLOP count that overstates the work.
    assert cached_peaks(tmp_path) == [calibrated_tflops]
    assert peak_flops.Peak(torch.device("cpu"), torch.float32, override=None).tflops == calibrated_tflops


@pytest.mark.parametrize("override, device", [(0.5, "cpu"), (None, "meta")])
def test_a_given_peak_is_raised_for_the_run_only_and_no_peak_is_no_mfu(tmp_path, calibrated, override, device):
    calibrated(1.0)
    peak = peak_flops.Peak(torch.device(device), torch.float32, override=override)
    if override is None:
        assert peak.tflops is None and peak.mfu(3.0) is None
        return
    assert peak.mfu(3.0) == pytest.approx(100.0) and peak.tflops == 3.0
    assert not (tmp_path / peak_flops.CACHE_FILE).exists()  # metrics.peak_tflops is the user's, not the cache's


@pytest.mark.parametrize("flops_per_token", [1e9, 1e13])
def test_the_metrics_row_never_shows_more_than_100_percent(tmp_path, calibrated, flops_per_token):
    from torchtitan.components.metrics.logger import MetricsLogger
    from torchtitan.config.job_config import Metrics

    calibrated(1e-6)  # far below what any step achieves
    metrics = MetricsLogger(Metrics(), str(tmp_path / "dump"), 0, torch.device("cpu"), torch.float32,
                            flops_per_token=flops_per_token, total_steps=1)
    metrics.record_step(1, local_tokens=4096, data_seconds=0.0)
    row = metrics.log(1, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert row["tflops"] > 1e-6 and row["mfu"] == pytest.approx(100.0)
    assert cached_peaks(tmp_path) == [1e-6]  # an overstated FLOP count (1e13) leaves no trace for later runs


def test_the_cpu_peak_is_kept_per_thread_count(tmp_path, monkeypatch):
    """A process on one of two cores computes faster than half the machine: its peak is its own thread count's."""
    calls = []
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_flops, "measure_matmul_tflops",
                        lambda dtype, threads: calls.append(threads) or 0.8 * threads)
    monkeypatch.setattr(peak_flops, "usable_cores", lambda: 2)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            assert peak_flops.device_peak_tflops(torch.device("cpu"), torch.bfloat16, None) == pytest.approx(0.8 * n)
    finally:
        torch.set_num_threads(threads)
    assert calls == [1, 2]  # each thread count measured once, then read from the cache
    assert peak_flops.cpu_machine_peak_tflops(torch.bfloat16) == pytest.approx(1.6)  # the planner's: all cores
