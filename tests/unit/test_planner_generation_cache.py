"""The planner's generation cache bytes against the caches the engine really allocates, and under tensor parallelism
against the local heads of a model the families' own TP plans split; scripts/plan.py's --generate_batch and
--generate_length."""

import re
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from scripts import plan as plan_script
from tests.bad_input import assert_one_line_error, run_entry_point
from torchtitan.config import load_config
from torchtitan.distributed.precision import resolve_compute_dtype
from torchtitan.generation import GenerationEngine, SamplingConfig
from torchtitan.generation import engine as engine_module
from torchtitan.generation.caches import KeyValueCache, LatentCache, RecurrentCache, cache_bytes_per_row
from torchtitan.hardware import DTYPES
from torchtitan.inference import build_model
from torchtitan.planner import generation_cache_bytes, model_shape
from torchtitan.protocols.train_spec import build_model_args, get_train_spec

SEQ_LEN = 64
# Each family with the kinds of cache it must exercise.
FAMILIES = {"deepseek_v3_debug": {LatentCache}, "qwen3_next_debug": {RecurrentCache, KeyValueCache},
            "gpt_oss_debug": {KeyValueCache}}


def config(name: str, *overrides: str):
    cfg, _ = load_config(["--job.config_file", f"train_configs/{name}.toml", "--training.seq_len", str(SEQ_LEN),
                          *overrides])
    return cfg


def allocated(monkeypatch, model, prompts, new_tokens) -> tuple[int, list]:
    """Bytes of the per-row tensors of every cache the engine installed, after a generate in which no row stops
    early (so none was compacted away), and the caches."""
    seen = []
    real = engine_module.installed

    @contextmanager
    def recording(model, step):
        with real(model, step) as caches:
            seen.extend(caches)
            yield caches

    monkeypatch.setattr(engine_module, "installed", recording)
    done = GenerationEngine(model).generate(prompts, SamplingConfig(max_new_tokens=new_tokens, temperature=0))
    assert all(len(c.tokens) == new_tokens for c in done)
    total = sum(getattr(c, name).nbytes for c in seen for name in c.per_row if getattr(c, name) is not None)
    return total, seen


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("rows, prompt, new, dtype", [(3, 10, 12, torch.float32), (2, 20, 9, torch.bfloat16)])
def test_planner_sizes_the_caches_the_engine_allocates(monkeypatch, name, rows, prompt, new, dtype):
    cfg = config(name, "--debug.seed", str(rows))
    model, _ = build_model(cfg)
    model.to(dtype)
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, model.args.vocab_size, (rows, prompt), generator=gen).tolist()
    real, caches = allocated(monkeypatch, model, prompts, new)
    assert {type(c) for c in caches} == FAMILIES[name]
    if name == "gpt_oss_debug":  # its sliding layers keep a ring shorter than the row
        window = model.args.sliding_window
        assert prompt + new > window
        assert sorted({c.k.shape[2] for c in caches}) == [window, prompt + new]
    assert generation_cache_bytes(model_shape(cfg), rows, prompt + new, dtype) == real > 0


@pytest.fixture
def two_rank_mesh():
    """A tensor-parallel mesh of two ranks in this one process (a fake process group: no communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["debug_model", *FAMILIES])
def test_planner_divides_what_tensor_parallelism_splits(two_rank_mesh, name):
    """Each family's own TP plan applied to its meta model: the caches sized from the rank's local weights are what
    the planner predicts for tp = 2 (MLA's latent whole on every rank, every other cache halved)."""
    from torchtitan.distributed.tensor_parallel import apply_decoder_tp

    cfg = config(name)
    shape = model_shape(cfg)
    spec = get_train_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, cfg.model, shape.vocab, SEQ_LEN))
    apply_decoder_tp(model, two_rank_mesh, loss_parallel=False, block_plan=spec.tp_block_plan)
    for length in (5, 40):
        local = cache_bytes_per_row(model, length, torch.bfloat16)
        assert generation_cache_bytes(shape, 3, length, torch.bfloat16, tp=2) == 3 * local
    whole = generation_cache_bytes(shape, 1, 40, torch.bfloat16)
    assert (local == whole) == (name == "deepseek_v3_debug")


UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def reported(line: str, what: str) -> float:
    """The bytes the plan's line gives ``what`` (e.g. "per device"), from its rounded figure and unit."""
    number, unit = re.search(rf"([\d,.]+) (GiB|MiB|KiB) {what}", line).groups()
    return float(number.replace(",", "")) * UNITS[unit]


@pytest.mark.parametrize("name, flags", [
    ("qwen3_next_debug", {"--generate_batch": 4, "--generate_length": 300}),
    ("deepseek_v3_debug", {"--generate_length": 100}),
    ("gpt_oss_debug", {}),
])
def test_plan_script_reports_the_generation_cache(name, flags):
    """The line's bytes for the rows and length asked for, or the config's local batch and seq_len by default."""
    cfg, _ = load_config(["--job.config_file", f"train_configs/{name}.toml"])
    rows = flags.get("--generate_batch", cfg.training.local_batch_size)
    length = flags.get("--generate_length", cfg.training.seq_len)
    argv = ["--config", f"train_configs/{name}.toml", "--device", "CPU", "--efficiency", "0.5",
            *(str(x) for flag in flags.items() for x in flag)]
    code, text = run_entry_point(plan_script.main, argv)
    assert code == plan_script.FITS, text
    [line] = [line for line in text.splitlines() if line.startswith("generation cache:")]
    # The caches hold what the model computes in: training.mixed_precision_param as the trainer resolves it here
    # ("auto": bfloat16 where the CPU computes it natively, else float32).
    dtype, _ = resolve_compute_dtype(cfg.training.mixed_precision_param, "cpu")
    assert f"for {rows} rows x {length:,} tokens (prompt + new) in {dtype}" in line
    expected = generation_cache_bytes(model_shape(cfg), rows, length, DTYPES[dtype])
    assert reported(line, "per device") == pytest.approx(expected, rel=1e-3)
    assert reported(line, "per row") == pytest.approx(expected / rows, rel=1e-3)


@pytest.mark.parametrize("flags, needles", [
    (["--generate_length", "2000"], ["generate_length = 2000 is invalid", "[1, 510]"]),
    (["--generate_length", "0"], ["--generate_length", "0"]),
    (["--generate_batch", "-1"], ["--generate_batch", "-1"]),
])
def test_plan_script_refuses_a_bad_generation_size_in_one_line(flags, needles):
    assert_one_line_error(plan_script.main, ["--config", "train_configs/qwen3_next_debug.toml", "--device", "CPU",
                                             "--training.seq_len", "256", "--efficiency", "0.5", *flags], *needles)
