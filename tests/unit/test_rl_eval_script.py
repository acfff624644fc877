"""scripts/rl_eval.py in-process on the tiny model's untrained weights: its figures equal a direct computation (the
prompts rendered as chat messages, the engine's samples scored by the reward functions one by one), and bad input
is a one-line error."""

import json
from pathlib import Path

import pytest

from scripts import rl_eval
from tests.bad_input import assert_one_line_error
from torchtitan.config_check import load_model_config
from torchtitan.data.chat_template import ChatTemplate, chat_ids
from torchtitan.generation import GenerationEngine, SamplingConfig
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.rl.rewards import REWARDS
from torchtitan.rl.tasks import build_prompt_source

GRPO_CONFIG = Path("train_configs/grpo_debug.toml").resolve()


def tiny_config(folder: Path, rewards: list[str], weights: list[float]) -> str:
    path = folder / "tiny_grpo.toml"
    path.write_text(f'extends = "{GRPO_CONFIG}"\n[model]\nflavor = "tiny"\n[training]\nseq_len = 64\n'
                    f'[rl]\nrewards = {json.dumps(rewards)}\nreward_weights = {json.dumps(weights)}\n'
                    'max_new_tokens = 6\n[experimental]\ncustom_import = "tests.rl_doubles"\n')
    return str(path)


def direct(config: str, limit: int, samples: int, seed: int, temperature: float, correct: str) -> dict:
    """The figures computed here from the pieces: prompts, samples, reward calls."""
    cfg = load_model_config(config)
    rl = cfg.rl
    tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
    template = ChatTemplate(tokenizer.chat_template)
    source = build_prompt_source(rl, seed, "heldout")
    rows = [source[i] for i in range(limit)]
    prompts = [chat_ids(tokenizer, template, [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
               for r in rows]
    engine = GenerationEngine(load_model(config, device="cpu"))
    sampling = SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=temperature, seed=seed)
    completions = engine.generate([p for p in prompts for _ in range(samples)], sampling,
                                  stop_token_ids=[tokenizer.eos_id])
    texts = [tokenizer.decode([t for t in c.tokens if t != tokenizer.eos_id]) for c in completions]
    figures = {f"reward/{name}": 0.0 for name in rl.rewards}
    total, right = 0.0, [[0.0] * samples for _ in rows]
    for i, text in enumerate(texts):
        row = rows[i // samples]
        for name, weight in zip(rl.rewards, rl.reward_weights):
            value = REWARDS.get(name)(text, row)
            figures[f"reward/{name}"] += value / len(texts)
            total += weight * value
        right[i // samples][i % samples] = REWARDS.get(correct)(text, row)
    figures["reward_mean"] = total / len(texts)
    figures["pass@1"] = sum(map(sum, right)) / len(texts)
    figures[f"pass@{samples}"] = sum(1.0 in r for r in right) / len(rows)
    return figures


@pytest.mark.parametrize("rewards, weights, correct, limit, samples, seed", [
    (["text_shape", "odd_length"], [0.5, 2.0], "odd_length", 5, 4, 3),  # the right-answer reward among rl.rewards
    (["text_shape", "format"], [1.0, 0.25], "odd_length", 4, 3, 11),  # scored beside them, weighed 0
])
def test_figures_equal_a_direct_computation(rewards, weights, correct, limit, samples, seed, tmp_path, capsys):
    config = tiny_config(tmp_path, rewards, weights)
    out = tmp_path / "figures.json"
    code = rl_eval.main(["--config", config, "--device", "cpu", "--limit", str(limit), "--samples", str(samples),
                         "--seed", str(seed), "--correct", correct, "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    got = json.loads(out.read_text())
    want = direct(config, limit, samples, seed, 1.0, correct)
    assert got["prompts"] == limit and got["samples"] == samples
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
        assert f"{key}: {value:.4f}" in printed.out
    # Not a degenerate case: some samples are right and some wrong, and some prompts have no right sample.
    assert 0 < got["pass@1"] < 1 and got[f"pass@{samples}"] > 0


def test_bad_input_is_a_one_line_error(tmp_path):
    config = tiny_config(tmp_path, ["text_shape"], [1.0])
    assert_one_line_error(rl_eval.main, ["--config", config, "--limit", "201"], "--limit 201", "at most 200")
    assert_one_line_error(rl_eval.main, ["--config", config, "--limit", "0"], "--limit 0", ">= 1")
    assert_one_line_error(rl_eval.main, ["--config", config, "--samples", "0"], "--samples 0", ">= 1")
    assert_one_line_error(rl_eval.main, ["--config", config, "--correct", "nope"], "--correct nope",
                          "exact_answer")
    assert_one_line_error(rl_eval.main, ["--config", config, "--checkpoint", str(tmp_path / "none")],
                          "is not a folder")
    assert_one_line_error(rl_eval.main, ["--config", config, "--split", "test"], "--split", "heldout")
    assert_one_line_error(rl_eval.main, ["--config", tiny_config(tmp_path, ["nope"], [1.0])], "rl.rewards",
                          "'nope'")
