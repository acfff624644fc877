import dataclasses
import typing
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import run_command, run_module
from torchtitan.config import ConfigError, JobConfig, load_config
from torchtitan.config.loading import config_to_toml, format_help, read_toml_chain
from torchtitan.config_check import validate_config


def all_keys(cls=JobConfig, prefix=""):
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from all_keys(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f.metadata["doc"]


def test_every_field_has_a_doc_and_appears_in_help():
    text = format_help()
    keys = list(all_keys())
    assert len(keys) > 90
    for key, doc in keys:
        assert doc, key
        assert f"--{key}" in text, key
        assert doc in text, key


def test_help_from_the_command_line_lists_every_field():
    result = run_module("torchtitan.train", "--help")
    assert result.returncode == 0
    for key, _ in all_keys():
        assert f"--{key}" in result.stdout


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 1e-3\n')
    cfg, sources = load_config(["--job.config_file", str(toml), "--training.steps=3", "--optimizer.beta1", "0.8"])
    assert cfg.training.steps == 3  # CLI beats TOML
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.beta1 == 0.8
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert sources["training.seq_len"] == str(toml)
    assert sources["training.steps"].startswith("command line")


def test_booleans_lists_and_none():
    cfg, _ = load_config([
        "--checkpoint.enable", "--metrics.no_disable_color_printing", "--job.print_config=true",
        "--model.converters", "a,b", "--checkpoint.exclude_from_loading=optimizer, dataloader",
        "--lr_scheduler.decay_ratio", "none", "--compile.components", "loss",
    ])
    assert cfg.checkpoint.enable is True
    assert cfg.metrics.disable_color_printing is False
    assert cfg.job.print_config is True
    assert cfg.model.converters == ["a", "b"]
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.compile.components == ["loss"]
    cfg, _ = load_config(["--checkpoint.enable", "--checkpoint.no_enable"])
    assert cfg.checkpoint.enable is False


def test_extends_is_relative_to_the_file_and_deep_merges(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.toml").write_text('[training]\nsteps = 5\nseq_len = 32\n[model]\nflavor = "tiny"\n')
    child = tmp_path / "sub" / "child.toml"
    child.write_text('extends = "../base.toml"\n[training]\nsteps = 9\n')
    cfg, sources = load_config(["--job.config_file", str(child)])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.model.flavor) == (9, 32, "tiny")
    assert sources["training.seq_len"].endswith("base.toml")
    assert [p.name for p, _ in read_toml_chain(child)] == ["base.toml", "child.toml"]


def test_extends_cycle_is_an_error(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(["--job.config_file", str(tmp_path / "a.toml")])


def test_resolved_config_round_trips(tmp_path):
    cfg, _ = load_config(["--job.config_file", "train_configs/tiny.toml", "--training.steps", "4"])
    saved = tmp_path / "resolved.toml"
    saved.write_text(config_to_toml(cfg))
    again, _ = load_config(["--job.config_file", str(saved)])
    assert again.job.config_file == str(saved)
    again.job.config_file = cfg.job.config_file
    assert again == cfg


def test_world_size_must_match_the_parallel_degrees():
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml",
                                "--parallelism.data_parallel_shard_degree", "2"])
    validate_config(cfg, sources, world_size=2)
    with pytest.raises(ConfigError, match="world size is 4"):
        validate_config(cfg, sources, world_size=4)
    cfg.training.global_batch_size = 12  # local 4 x dp 2 = 8 does not divide 12
    with pytest.raises(ConfigError, match="global_batch_size = 12 is not divisible by"):
        validate_config(cfg, sources, world_size=2)


def test_compiled_loss_with_loss_parallel_is_refused_with_the_reason():
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", "--compile.enable",
                                "--parallelism.tensor_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="cannot be compiled with loss parallel"):
        validate_config(cfg, sources, world_size=2)
    cfg.compile.components = ["model"]  # compiled blocks with TP and loss parallel are fine
    validate_config(cfg, sources, world_size=2)
    cfg.compile.components = ["model", "loss"]
    cfg.parallelism.disable_loss_parallel = True
    validate_config(cfg, sources, world_size=2)


def test_async_tp_needs_cuda_and_compile(monkeypatch):
    from torchtitan.distributed import tensor_parallel

    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", "--parallelism.tensor_parallel_degree",
                                "2", "--parallelism.enable_async_tensor_parallel"])
    # Decided from the machine's device: both answers are checked on any machine.
    monkeypatch.setattr(tensor_parallel, "device_type", lambda: "cpu")
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        validate_config(cfg, sources, world_size=2)
    monkeypatch.setattr(tensor_parallel, "device_type", lambda: "cuda")
    with pytest.raises(ConfigError, match="needs compile.enable = true"):
        validate_config(cfg, sources, world_size=2)


def test_tp_degree_must_divide_heads():
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", "--parallelism.tensor_parallel_degree",
                                "3", "--training.seq_len", "66"])
    with pytest.raises(ConfigError, match="its n_heads 4 is not divisible by the tensor-parallel degree 3"):
        validate_config(cfg, sources, world_size=3)


def test_seed_checkpoint_and_hf_export_combinations_that_cannot_work_are_refused(monkeypatch):
    def check(flags, world_size=1):
        cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", *flags])
        validate_config(cfg, sources, world_size=world_size)

    seed = ["--checkpoint.create_seed_checkpoint"]
    check(["--checkpoint.enable", *seed])
    with pytest.raises(ConfigError, match=r"create_seed_checkpoint = True needs checkpoint.enable = true"):
        check(seed)
    with pytest.raises(ConfigError, match=r"create_seed_checkpoint = True must run as a single process "
                                          r"\(the world size is 2\)"):
        check(["--checkpoint.enable", *seed, "--parallelism.data_parallel_shard_degree", "2"], world_size=2)
    with pytest.raises(ConfigError, match=r"create_seed_checkpoint = True writes a checkpoint, but "
                                          r"checkpoint.load_only = true"):
        check(["--checkpoint.enable", *seed, "--checkpoint.load_only"])

    hf = ["--checkpoint.last_save_in_hf"]
    check(["--checkpoint.enable", *hf])
    with pytest.raises(ConfigError, match=r"last_save_in_hf = True needs checkpoint.enable = true"):
        check(hf)
    with pytest.raises(ConfigError, match=r"last_save_in_hf = True needs checkpoint.last_save_model_only = true"):
        check(["--checkpoint.enable", *hf, "--checkpoint.last_save_model_only=false"])
    from torchtitan.protocols import train_spec

    no_adapter = dataclasses.replace(train_spec.get_train_spec("llama3"), state_dict_adapter=None)
    monkeypatch.setitem(train_spec.TRAIN_SPECS._entries, "llama3_no_hf", no_adapter)
    check(["--checkpoint.enable", "--model.name", "llama3_no_hf"])  # fine without the HF export
    with pytest.raises(ConfigError, match=r"last_save_in_hf = True is not supported by model.name = 'llama3_no_hf': "
                                          r"its TrainSpec has no state_dict_adapter"):
        check(["--checkpoint.enable", *hf, "--model.name", "llama3_no_hf"])


BAD_FILES = {
    "unknown_section": ("[trainer]\nsteps = 3\n", "unknown key 'trainer.steps'"),
    "unknown_key": ("[training]\nstepz = 3\n", "unknown key 'training.stepz'"),
    "wrong_type": ('[training]\nsteps = "ten"\n', "training.steps = 'ten' is invalid; expected an integer"),
    "bad_toml": ("[training\nsteps = 3\n", "not valid TOML"),
    "bad_choice": ('[optimizer]\nname = "Lion"\n', "optimizer.name = 'Lion' is invalid; expected one of AdamW|Adam"),
    "top_level_key": ("steps = 3\n", "top-level key 'steps' must be a [section]"),
}

BAD_FLAGS = {
    "zero_steps": (["--training.steps", "0"], "training.steps = 0 is invalid; it must be > 0"),
    "negative_seq_len": (["--training.seq_len=-5"], "training.seq_len = -5 is invalid; it must be > 0"),
    "negative_lr": (["--optimizer.lr", "-1"], "optimizer.lr = -1.0 is invalid; it must be >= 0"),
    "batch_not_divisible": (["--training.global_batch_size", "6"], "global_batch_size = 6 is not divisible"),
    "degrees_vs_world": (["--parallelism.data_parallel_shard_degree", "4"], "the world size is 1"),
    "unknown_model": (["--model.name", "gpt5"], "model.name = 'gpt5' is unknown"),
    "unknown_flavor": (["--model.flavor", "13B"], "model.flavor = '13B' is not a flavor of 'llama3'; valid:"),
    "missing_config": (["--job.config_file", "nope.toml"], "config file 'nope.toml' does not exist"),
    "missing_dataset_path": (["--training.dataset_path", "/no/such/data"], "training.dataset_path = '/no/such/data' does not exist"),
    "missing_tokenizer": (["--model.hf_assets_path", "/no/such/dir"], "model.hf_assets_path = '/no/such/dir' does not exist"),
    "unknown_converter": (["--model.converters", "fp8"], "model.converters = ['fp8'] names unknown converters"),
    "unknown_dataset": (["--training.dataset", "c5"], "training.dataset = 'c5' is not a registered dataset"),
    "unknown_flag": (["--training.stepz", "3"], "unknown key 'training.stepz'"),
    "missing_value": (["--training.steps"], "missing value; expected an integer"),
    "not_a_flag": (["steps=3"], "unexpected argument 'steps=3'"),
    "bad_bool": (["--checkpoint.enable=maybe"], "checkpoint.enable = 'maybe' is invalid; expected true|false"),
    "bad_custom_import": (["--experimental.custom_import", "no_such_pkg.model"], "failed to import"),
}


def _cases(tmp_path):
    for name, (text, expected) in BAD_FILES.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        yield name, ["--job.config_file", str(path)], expected
    for name, (flags, expected) in BAD_FLAGS.items():
        base = [] if "--job.config_file" in flags else ["--job.config_file", "train_configs/tiny.toml"]
        yield name, base + flags, expected


def _assert_one_line_error(result, expected, name):
    assert result.returncode == 2, (name, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, (name, result.stderr)
    assert lines[0].startswith("error: "), (name, lines)
    assert expected in lines[0], (name, lines[0])
    assert "Traceback" not in result.stderr + result.stdout


def test_malformed_configs_give_one_line_errors_in_process(tmp_path, capsys):
    from torchtitan.train import main

    cases = list(_cases(tmp_path))
    assert len(cases) >= 20
    for name, argv, expected in cases:
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (name, err)


# One case per stage a config goes through (TOML parsing, the file's keys, flag parsing, the registries,
# imports, validation against the world size, a missing file): each in a real process below. Every case
# goes through main() in-process above, which is where their messages are checked.
REAL_PROCESS_CASES = ("bad_toml", "unknown_key", "missing_value", "unknown_model", "bad_custom_import",
                      "degrees_vs_world", "missing_config")


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["python -m torchtitan.train", "run_train.sh"])
def test_malformed_configs_exit_2_from_both_entry_points(tmp_path, entry):
    """In a real process: exit code 2, one line on stderr, no traceback, nothing trained."""
    cases = [case for case in _cases(tmp_path) if case[0] in REAL_PROCESS_CASES]
    assert len(cases) == len(REAL_PROCESS_CASES)

    def run(name: str, argv: list[str]):
        dump = tmp_path / f"out_{name}"
        argv = argv + [f"--job.dump_folder={dump}"] if name not in ("not_a_flag", "missing_value") else argv
        if entry == "run_train.sh":
            config = [a for a in argv if a.endswith(".toml")]
            others = [a for a in argv if not a.endswith(".toml") and a != "--job.config_file"]
            env = {"NGPU": "1", "CONFIG_FILE": config[0] if config else "train_configs/tiny.toml"}
            return run_command(["./run_train.sh", *others], env=env), dump
        return run_module("torchtitan.train", *argv), dump

    # Two at a time: each process is mostly Python's imports, on one core.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run(case[0], case[1]), cases))
    for (name, _, expected), (result, dump) in zip(cases, results):
        _assert_one_line_error(result, expected, name)
        assert not (dump / "metrics.jsonl").exists()


def test_the_checkpoint_section_is_checked_by_the_checkpoint_component():
    from torchtitan.components.checkpointing.checkpoint import config_problems
    from torchtitan.config.job_config import Checkpoint

    bad = Checkpoint(interval=0, keep_latest_k=-1, exclude_from_loading=["optimiser"], initial_load_path="/no/such")
    assert config_problems(bad, 1, "llama3", True) == [
        ("interval", "is invalid; it must be > 0"), ("keep_latest_k", "is invalid; it must be >= 0 (0 keeps all)"),
        ("exclude_from_loading", "names unknown state ['optimiser']; valid: model, optimizer, lr_scheduler, "
                                 "dataloader, train_state, guard, base, fault_tolerance, reference"),
        ("initial_load_path", "is read only with checkpoint.enable = true; set it"),
        ("initial_load_path", "is not a folder")]
    assert config_problems(Checkpoint(), 1, "llama3", True) == []
    seed = Checkpoint(enable=True, create_seed_checkpoint=True, last_save_in_hf=True)
    assert config_problems(seed, 2, "toy", False) == [
        ("create_seed_checkpoint", "must run as a single process (the world size is 2); later runs load the seed "
                                   "under any layout"),
        ("last_save_in_hf", "is not supported by model.name = 'toy': its TrainSpec has no state_dict_adapter "
                            "(no Hugging Face names)")]


def test_data_validation_and_converter_sections_are_checked_by_their_components(tmp_path):
    from torchtitan.components.evaluation.validate import config_problems as validation_problems
    from torchtitan.config.job_config import Validation
    from torchtitan.data.sources import source_problems
    from torchtitan.protocols.model_converter import config_problems as converter_problems

    assert source_problems("pydocs", None, "train") == []
    assert source_problems("fineweb-edu", None, "validation")[0][0] == "dataset"  # no validation split
    assert source_problems("c5", None, "train")[0][1].startswith("is not a registered dataset; valid: ")
    assert source_problems("c5", str(tmp_path), "train") == []  # local files replace the registered name
    assert source_problems("pydocs", str(tmp_path / "none"), "train") == [("dataset_path", "does not exist")]
    assert validation_problems(Validation(enable=False, freq=0), 64) == []
    assert [f for f, _ in validation_problems(Validation(enable=True, freq=0, steps=0, seq_len=128), 64)] == [
        "freq", "steps", "seq_len"]
    assert converter_problems(["float8"]) == [] and converter_problems(["fp8"])[0][0] == "converters"
