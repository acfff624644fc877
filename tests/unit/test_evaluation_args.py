"""Argument checks of scripts/evaluate.py and scripts/generate.py: one-line errors, no model is trained."""

import argparse
import re

import pytest
import torch

from scripts import evaluate as evaluate_script
from scripts import generate as generate_script
from torchtitan.device_arg import parse_device
from torchtitan.script_args import integer, real

CONFIG = "train_configs/debug_model.toml"


def test_parse_device_accepts_cpu_and_names_the_flag_otherwise(monkeypatch):
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--device gpu is invalid; valid: cpu, cuda or cuda:N$"):
        parse_device("gpu")
    with pytest.raises(ValueError, match="--device meta is not supported"):
        parse_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda asks for CUDA, which this machine does not have"):
        parse_device("cuda")


@pytest.mark.parametrize("script", [evaluate_script, generate_script])
@pytest.mark.parametrize("device, message", [("gpu", "--device gpu is invalid"), ("cuda", "asks for CUDA")])
def test_scripts_reject_a_bad_device_in_one_line(script, device, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main(["--config", CONFIG, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("seq_len", ["4096", "0"])
def test_evaluate_rejects_a_validation_seq_len_the_model_cannot_take(seq_len, capsys):
    code = evaluate_script.main(["--config", CONFIG, "--device", "cpu", "--training.seq_len", "256",
                                 "--validation.seq_len", seq_len])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"validation.seq_len = {seq_len} is invalid; it must be in 1..256 (training.seq_len" in err


def one_line_exit(main, argv: list[str], capsys) -> str:
    """The one stderr line of a script's ``main(argv)`` that exits 2 while parsing its command line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    return err.rstrip("\n")


@pytest.mark.parametrize("flags, valid", [
    (["--limit", "-1"], "an integer >= 1"),  # lm-eval's islice said ValueError without naming --limit
    (["--num_fewshot", "-2"], "an integer >= 0"),  # was accepted and scores were printed
    (["--batch_size", "0"], "an integer >= 1"),
])
def test_evaluate_refuses_a_number_out_of_range_while_parsing(flags, valid, capsys):
    err = one_line_exit(evaluate_script.main, ["--config", CONFIG, "--tasks", "pydocs_mc", *flags], capsys)
    assert err == f"error: {flags[0]} {flags[1]} is invalid; it must be {valid}"


@pytest.mark.parametrize("flags, valid", [
    (["--temperature", "nan"], "a finite number >= 0 (0: greedy)"),  # nan passed `temperature < 0`
    (["--top_p", "0"], "a finite number in (0, 1] (1: all)"),
    (["--seed", "-1"], "an integer in 0..18446744073709551615"),  # torch's generator seed is a uint64
    (["--max_new_tokens", "2.5"], "an integer >= 1"),
])
def test_generate_refuses_a_number_out_of_range_while_parsing(flags, valid, capsys):
    err = one_line_exit(generate_script.main, ["--config", CONFIG, *flags], capsys)
    assert err == f"error: {flags[0]} {flags[1]} is invalid; it must be {valid}"


SCRIPTS = ["convert_from_hf", "convert_to_hf", "download_hf_assets", "evaluate", "generate", "generate_config",
           "gpu_check", "plan", "report", "rl_eval", "tokenize_dataset", "train_tokenizer"]
NOT_SCRIPTS = {"gpu_check_parts"}  # the GPU check's parts, a module of gpu_check.py


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_script_takes_a_number_without_its_range(name, monkeypatch):
    """Every int/float option of every script is a Number (checked while parsing) and its parser says errors in one
    line, so no script reads a number it has not range-checked."""
    import argparse
    import importlib
    from pathlib import Path

    from torchtitan.script_args import Number, ScriptParser

    assert sorted(p.stem for p in Path("scripts").glob("*.py") if p.stem != "__init__" and p.stem not in NOT_SCRIPTS) \
        == SCRIPTS
    parsers = []

    def capture(self, *args, **kwargs):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(SystemExit):
        importlib.import_module(f"scripts.{name}").main([])
    (parser,) = parsers
    assert isinstance(parser, ScriptParser)
    assert [action.dest for action in parser._actions if action.type in (int, float)] == []
    assert {action.dest for action in parser._actions if isinstance(action.type, Number)} == set(NUMBERS.get(name, ()))


# Each script's numeric options (the test above also finds any new one left a plain int/float).
NUMBERS = {"evaluate": ("limit", "num_fewshot", "batch_size"), "gpu_check": ("budget",),
           "generate": ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "cache_budget_bytes",
                        "prefill_chunk", "tp", "ep"),
           "plan": ("world_size", "efficiency", "vocab_size", "generate_batch", "generate_length"), "tokenize_dataset": ("workers", "shard_tokens"),
           "train_tokenizer": ("vocab_size",), "rl_eval": ("samples", "temperature", "limit", "seed"),
           "generate_config": ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                               "ffn_dim_multiplier", "nodes", "gpus_per_node", "global_batch_size", "seq_len",
                               "local_batch_size", "tokens", "tp", "pp", "dp_shard")}


def launched(monkeypatch, world_size: int, rank: int) -> None:
    """The environment torchrun gives rank ``rank`` of ``world_size`` (no process group is joined)."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(rank))


@pytest.mark.parametrize("world_size, flags, message", [
    (1, ["--tp", "2"], ("--tp 2 x --ep 1 = 2, but this is one process, not started by torchrun: they must be equal; "
                        "launch torchrun --nproc_per_node 2, or set --tp and --ep to multiply to 1")),
    (2, [], "--tp 1 x --ep 1 = 1, but torchrun started 2 processes (WORLD_SIZE)"),
    (4, ["--tp", "2", "--ep", "3"], "--tp 2 x --ep 3 = 6, but torchrun started 4 processes (WORLD_SIZE)"),
    (2, ["--tp", "2", "--device", "cpu"], "--device cpu is invalid under torchrun: each rank runs on cuda:LOCAL_RANK"),
])
def test_generate_refuses_a_layout_other_than_the_world_once_from_rank_0(world_size, flags, message, monkeypatch,
                                                                          capsys):
    for rank in range(world_size):
        if world_size > 1:
            launched(monkeypatch, world_size, rank)
        assert generate_script.main(["--config", CONFIG, *flags]) == 2
        err = capsys.readouterr().err
        if rank == 0:
            assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
        else:
            assert err == ""  # every rank exits 2; rank 0 alone says why


@pytest.mark.parametrize("config, flags, message", [
    ("train_configs/tiny.toml", ["--tp", "3"], ("parallelism.tensor_parallel_degree = 3 does not fit model.flavor = "
                                               "'tiny': its n_heads 4 is not divisible by the tensor-parallel degree 3")),
    ("train_configs/qwen3_moe_debug.toml", ["--ep", "3"], ("parallelism.expert_parallel_degree = 3 does not divide "
                                                           "the model's moe.num_experts = 8")),
    ("train_configs/tiny.toml", ["--ep", "3"], "parallelism.expert_parallel_degree = 3 needs a model with MoE layers"),
])
def test_generate_refuses_a_layout_the_model_cannot_take_before_joining(config, flags, message, monkeypatch, capsys):
    launched(monkeypatch, 3, 0)  # no rendezvous is set up: joining would fail with another message
    assert generate_script.main(["--config", config, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, valid", [(["--tp", "0"], "an integer >= 1"),
                                          (["--top_p", "0"], "a finite number in (0, 1] (1: all)")])
def test_a_bad_command_line_is_said_once_under_torchrun(flags, valid, monkeypatch, capsys):
    for rank, printed in ((0, True), (1, False)):
        launched(monkeypatch, 2, rank)
        with pytest.raises(SystemExit) as exit_info:
            generate_script.main(["--config", CONFIG, *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert err == (f"error: {flags[0]} {flags[1]} is invalid; it must be {valid}\n" if printed else "")


@pytest.mark.parametrize("kind, text, valid", [
    (integer(1), "0", "an integer >= 1"), (integer(0, 3), "4", "an integer in 0..3"),
    (real(0, 1, low_open=True), "0", "a finite number in (0, 1]"), (real(0, 1, high_open=True), "1", "in [0, 1)"),
    (real(0), "-inf", "a finite number >= 0"), (real(high=2), "nan", "a finite number <= 2"),
    (integer(), "1.0", "an integer"),
])
def test_a_number_out_of_range_names_the_range(kind, text, valid):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"{text} is invalid; it must be ") + ".*"
                       + re.escape(valid)):
        kind(text)


def test_a_number_in_range_is_returned_as_its_kind():
    assert integer(1)("7") == 7 and real(0, 1, low_open=True)("1") == 1.0 and real(0, 1, high_open=True)("0") == 0.0
    assert type(integer(0)("0")) is int and type(real()("3")) is float
