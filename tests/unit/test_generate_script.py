"""scripts/generate.py through the generation engine, in-process on the tiny model's untrained weights: one prompt
prints what the cache-free reference path generates, a batch what each prompt gives alone, --stop cuts the text,
--logprobs reports the model's own log-probabilities, and bad values are one-line errors."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from scripts import generate as generate_script
from torchtitan.config_check import load_model_config
from torchtitan.generation import GenerationEngine, SamplingConfig, generate_without_cache
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec

CONFIG = "train_configs/tiny.toml"
PROMPTS = ["def main():", "import os\nimport sys\n\nclass Stack:\n    def push(self, item):", "x"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    cfg = load_model_config(CONFIG)
    return load_model(CONFIG, device="cpu"), get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)


def generate(capsys, *flags: str) -> tuple[list[str], str]:
    """Each completion the script printed (in order) and its stderr."""
    code = generate_script.main(["--config", CONFIG, "--device", "cpu", *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    sections = re.split(r"^=== prompt \d+ of \d+ ===\n", captured.out, flags=re.MULTILINE)
    texts = sections[1:] if len(sections) > 1 else sections
    return [text.removesuffix("\n") for text in texts], captured.err


def prompt_flags(*prompts: str) -> list[str]:
    return [flag for prompt in prompts for flag in ("--prompt", prompt)]


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_one_prompt_prints_what_the_reference_path_generates(prompt, model_and_tokenizer, capsys):
    model, tokenizer = model_and_tokenizer
    ids = tokenizer.encode(prompt, bos=True)
    new = generate_without_cache(model, ids, SamplingConfig(max_new_tokens=14, temperature=0), max_context=64,
                                 stop_id=tokenizer.eos_id)
    (text,), err = generate(capsys, "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "14")
    assert text == prompt + tokenizer.decode(new)
    assert f"[{len(new)} new tokens]" in err


@pytest.fixture(scope="module")
def alone():
    """Each prompt's greedy text, generated on its own."""
    return {}


@pytest.mark.parametrize("extra", [[], ["--prefill_chunk", "3", "--cache_budget_bytes", "40000"]])
def test_a_batch_of_prompts_prints_what_each_gives_alone(extra, alone, model_and_tokenizer, capsys):
    """Greedy: the batch (left-padded; with the second flags also prefilled 3 tokens at a time and split into groups
    by the cache budget) equals each prompt on its own, in the order given."""
    model, tokenizer = model_and_tokenizer
    flags = ["--temperature", "0", "--max_new_tokens", "12", "--no_stop_at_eos"]
    for prompt in PROMPTS:
        if prompt not in alone:
            alone[prompt] = generate(capsys, "--prompt", prompt, *flags)[0][0]
    together, err = generate(capsys, *prompt_flags(*PROMPTS), *flags, *extra)
    assert together == [alone[prompt] for prompt in PROMPTS]
    assert [line for line in err.splitlines() if "new tokens" in line] == \
        [f"[prompt {i} of 3: 12 new tokens]" for i in (1, 2, 3)]
    if extra:  # the budget holds one or two rows of this length, not three: the batch really was split
        engine = GenerationEngine(model)
        assert engine.cache_bytes(1, 64) <= 40000 < engine.cache_bytes(3, len(tokenizer.encode(PROMPTS[1])) + 12)


def test_prompts_file_lines_follow_the_prompt_flags(tmp_path, capsys):
    lines = ["import os", "class Stack:", "    def push(self, item):"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    flags = ["--temperature", "0", "--max_new_tokens", "6"]
    got, _ = generate(capsys, "--prompt", PROMPTS[0], "--prompts_file", str(path), *flags)
    want, _ = generate(capsys, *prompt_flags(PROMPTS[0], *lines), *flags)
    assert len(got) == 1 + len(lines) and got == want


def test_stop_strings_cut_the_text_before_the_first_one(capsys):
    """Two prompts in a batch, each with two stop strings from its own greedy text: each text ends before whichever
    of the four comes first in it."""
    flags = ["--temperature", "0", "--max_new_tokens", "20", "--no_stop_at_eos", *prompt_flags(*PROMPTS[:2])]
    full, _ = generate(capsys, *flags)
    new = [text[len(prompt):] for prompt, text in zip(PROMPTS, full)]
    stops = []
    for text in new:
        words = re.findall(r"[A-Za-z]{3,}", text)
        assert len(words) >= 2, text
        stops += [words[-1], words[len(words) // 2]]
    cut, _ = generate(capsys, *flags, *(flag for stop in stops for flag in ("--stop", stop)))
    for prompt, text, got in zip(PROMPTS, new, cut):
        assert got == prompt + text[:min(text.index(s) for s in stops if s in text)]
        assert len(got) < len(prompt + text)


def test_logprobs_are_the_models_own(model_and_tokenizer, capsys):
    """Greedy --logprobs: each token is the argmax of a full forward over the text so far, and its log-probability
    that forward's log-softmax; one JSON line per completion."""
    model, tokenizer = model_and_tokenizer
    _, err = generate(capsys, *prompt_flags(*PROMPTS[:2]), "--temperature", "0", "--max_new_tokens", "6",
                      "--logprobs")
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == [0, 1]
    for prompt, line in zip(PROMPTS, lines):
        ids = tokenizer.encode(prompt, bos=True)
        assert len(line["tokens"]) == len(line["logprobs"]) == len(line["pieces"]) == 6
        assert line["finish_reason"] == "length"
        for token, logprob in zip(line["tokens"], line["logprobs"]):
            with torch.no_grad():
                expected = F.log_softmax(model(torch.tensor([ids])).float()[0, -1], dim=-1)
            assert token == int(expected.argmax())
            assert logprob == pytest.approx(float(expected[token]), abs=1e-4)
            ids.append(token)


@pytest.mark.parametrize("flags, message", [
    (["--prefill_chunk", "0"], "error: --prefill_chunk 0 is invalid; it must be an integer >= 1"),
    (["--cache_budget_bytes", "-5"], "error: --cache_budget_bytes -5 is invalid; it must be an integer >= 1"),
    (["--stop", ""], "error: --stop '' is empty"),
    (["--prompts_file", "/nonexistent/prompts.txt"], "error: --prompts_file /nonexistent/prompts.txt is not a file"),
    (["--cache_budget_bytes", "100"], "error: cache_budget_bytes = 100 cannot hold prompt 0 alone"),
    (["--prompt", "word " * 70], "error: prompt 0 has 141 tokens; the model's max_seq_len is 64"),
])
def test_bad_values_are_one_line_errors(flags, message, capsys):
    try:
        code = generate_script.main(["--config", CONFIG, "--device", "cpu", *flags])
    except SystemExit as e:  # refused while parsing
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
