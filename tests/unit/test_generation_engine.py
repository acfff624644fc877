"""The generation engine against the model's full forward, on every family's debug flavor (fp32, random weights):
greedy tokens are the no-cache path's and the logits within 1e-5 (tests/generation_checks.py); sampled
log-probabilities are a teacher-forced forward's; and the engine's limits (cache budget, stop tokens and strings,
finished rows, max_seq_len, bad input, load_weights). The same check on trained checkpoints runs in each family's
training test module, on the suite matrix's runs."""

import functools

import pytest
import torch

from tests.generation_checks import PROMPT_LENGTHS, assert_engine_matches_full_forward, random_prompts
from torchtitan.generation import GenerationEngine, SamplingConfig, processed_logits
from torchtitan.inference import load_model
from torchtitan.models.shared.moe import MoE

CONFIGS = {
    "llama3": "train_configs/debug_model.toml",
    "qwen3": "train_configs/qwen3_debug.toml",
    "qwen3_moe": "train_configs/qwen3_moe_debug.toml",
    "deepseek_v3": "train_configs/deepseek_v3_debug.toml",
    "gpt_oss": "train_configs/gpt_oss_debug.toml",
    "qwen3_next": "train_configs/qwen3_next_debug.toml",
    "kimi_linear": "train_configs/kimi_linear_debug.toml",
}


@functools.cache
def model_of(family: str, seed: int = 0, seq_len: int = 512):
    return load_model(CONFIGS[family], overrides=["--training.seq_len", str(seq_len), "--debug.seed", str(seed)])


@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_generation_is_the_no_cache_path(family):
    model = model_of(family)
    figures = assert_engine_matches_full_forward(model, random_prompts(model.args.vocab_size, PROMPT_LENGTHS), 64)
    print(f"\n{family}: {figures}")


@pytest.mark.parametrize("family, chunk", [("gpt_oss", 7), ("gpt_oss", 48), ("qwen3_next", 48),
                                           ("deepseek_v3", 48), ("kimi_linear", 48)])
def test_prefill_in_chunks_is_the_same(family, chunk):
    """Chunks shorter than the window and longer, across the ring's and the recurrence's boundaries."""
    model = model_of(family)
    assert_engine_matches_full_forward(model, random_prompts(model.args.vocab_size, PROMPT_LENGTHS, seed=1), 16,
                                       prefill_chunk=chunk)


@pytest.mark.parametrize("family", ["llama3", "gpt_oss", "qwen3_next"])
def test_sampled_logprobs_are_a_teacher_forced_forward_under_the_sampling_transform(family):
    model = model_of(family)
    prompts = random_prompts(model.args.vocab_size, [3, 20, 41], seed=2)
    engine = GenerationEngine(model)
    cfg = SamplingConfig(max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=50, seed=5)
    first = engine.generate(prompts, cfg)
    again = engine.generate(prompts, cfg)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    other = engine.generate(prompts, SamplingConfig(max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=50, seed=6))
    assert [c.tokens for c in other] != [c.tokens for c in first]
    with torch.no_grad():
        for prompt, completion in zip(prompts, first):
            n = len(completion.tokens)
            logits = model(torch.tensor([prompt + completion.tokens]))[0, len(prompt) - 1: len(prompt) - 1 + n]
            expected = processed_logits(logits, cfg).log_softmax(-1).gather(-1, torch.tensor(completion.tokens)[:, None])
            assert torch.allclose(torch.tensor(completion.logprobs), expected[:, 0], atol=1e-5, rtol=0)
            # The filters mattered: some chosen token's probability changed by them.
            plain = logits.float().div(cfg.temperature).log_softmax(-1).gather(-1, torch.tensor(completion.tokens)[:, None])
            assert (plain[:, 0] - expected[:, 0]).abs().max() > 1e-3


def test_greedy_logprobs_are_the_model_distribution():
    model = model_of("qwen3")
    prompt = random_prompts(model.args.vocab_size, [9])[0]
    done = GenerationEngine(model).generate([prompt], SamplingConfig(max_new_tokens=8, temperature=0))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + done.tokens]))[0, len(prompt) - 1: len(prompt) + 7]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(done.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(done.logprobs), expected, atol=1e-5, rtol=0)


def test_a_cache_budget_splits_the_batch_and_a_row_that_cannot_fit_is_refused():
    model = model_of("qwen3_next")
    prompts = random_prompts(model.args.vocab_size, [30, 4, 17, 9, 22], seed=3)
    cfg = SamplingConfig(max_new_tokens=12, temperature=0)
    whole = GenerationEngine(model).generate(prompts, cfg)
    per_row = GenerationEngine(model).cache_bytes(1, 30 + 12)
    split = GenerationEngine(model, cache_budget_bytes=2 * per_row)
    groups = split._groups(prompts, [12] * len(prompts))
    assert len(groups) >= 3 and sorted(i for g in groups for i in g) == list(range(5))
    assert all(split.cache_bytes(len(g), max(len(prompts[i]) for i in g) + 12) <= 2 * per_row for g in groups)
    assert [c.tokens for c in split.generate(prompts, cfg)] == [c.tokens for c in whole]
    with pytest.raises(ValueError, match=r"cache_budget_bytes = 100 cannot hold prompt 1 alone \(4 \+ 12 new tokens need \d+ bytes\)"):
        GenerationEngine(model, cache_budget_bytes=100).generate(prompts, cfg)


def test_rows_that_stop_leave_the_batch_and_the_others_go_on_unchanged():
    model = model_of("deepseek_v3")
    prompts = random_prompts(model.args.vocab_size, [6, 19, 11], seed=4)
    cfg = SamplingConfig(max_new_tokens=20, temperature=0)
    free = GenerationEngine(model).generate(prompts, cfg)
    stop = free[1].tokens[3]
    assert stop not in free[0].tokens[:15]  # (the seed is chosen so that the stop token ends row 1 first)
    rows_per_step = []
    hook = model.tok_embeddings.register_forward_hook(lambda m, args, out: rows_per_step.append(out.shape[0]))
    try:
        done = GenerationEngine(model).generate(prompts, cfg, stop_token_ids=[stop])
    finally:
        hook.remove()
    assert done[1].tokens == free[1].tokens[:4] and done[1].finish_reason == "stop"
    for row in (0, 2):
        cut = free[row].tokens.index(stop) + 1 if stop in free[row].tokens else 20
        assert done[row].tokens == free[row].tokens[:cut]
    assert rows_per_step[0] == 3 and min(rows_per_step) < 3  # compacted, not masked


def test_stop_strings_cut_the_text():
    model = model_of("llama3")
    prompt = random_prompts(model.args.vocab_size, [7], seed=5)[0]

    def decode(ids):
        return "".join(f"<{i}>" for i in ids)

    free = GenerationEngine(model).generate([prompt], SamplingConfig(max_new_tokens=10, temperature=0),
                                            decode=decode)[0]
    stop = f"<{free.tokens[4]}><{free.tokens[5]}>"
    done = GenerationEngine(model).generate([prompt], SamplingConfig(max_new_tokens=10, temperature=0),
                                            stop_strings=[stop], decode=decode)[0]
    first = decode(free.tokens).index(stop)
    assert done.finish_reason == "stop" and done.text == decode(free.tokens)[:first]
    assert done.tokens == free.tokens[:len(done.tokens)] and len(done.tokens) <= 6


def test_generation_stops_at_max_seq_len_and_a_longer_prompt_is_refused():
    model = model_of("qwen3", seq_len=64)
    prompts = random_prompts(model.args.vocab_size, [60, 10], seed=6)
    done = GenerationEngine(model).generate(prompts, SamplingConfig(max_new_tokens=10, temperature=0))
    assert [len(c.tokens) for c in done] == [4, 10] and done[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens; the model's max_seq_len is 64"):
        GenerationEngine(model).generate([[1], [1] * 64], SamplingConfig(max_new_tokens=1))


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([], {}, "prompts is empty"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1, 10**7]], {}, r"prompt 0 has token id 10000000; ids must be in \[0, "),
    ([[1, -3]], {}, "prompt 0 has token id -3"),
    ([[1, 2]], {"stop_strings": ["x"]}, "stop_strings need a decode function"),
])
def test_bad_input_is_one_line(prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationEngine(model_of("llama3")).generate(prompts, SamplingConfig(max_new_tokens=2), **kwargs)


def test_load_weights_replaces_the_model_in_place():
    model = load_model(CONFIGS["qwen3_moe"], overrides=["--training.seq_len", "128"])
    other = load_model(CONFIGS["qwen3_moe"], overrides=["--training.seq_len", "128", "--debug.seed", "7"])
    prompts = random_prompts(model.args.vocab_size, [5, 12], seed=8)
    cfg = SamplingConfig(max_new_tokens=16, temperature=0.9, seed=1)
    engine = GenerationEngine(model)
    before = engine.generate(prompts, cfg)
    weight = model.layers["0"].attention.wq.weight
    engine.load_weights(other.state_dict())
    assert model.layers["0"].attention.wq.weight is weight  # in place, not rebuilt
    after = engine.generate(prompts, cfg)
    fresh = GenerationEngine(other).generate(prompts, cfg)
    assert [c.tokens for c in after] == [c.tokens for c in fresh] != [c.tokens for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in fresh]
    state = dict(other.state_dict())
    state.pop("norm.weight")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        engine.load_weights(state)


def test_generation_leaves_the_training_state_as_it_was():
    model = load_model(CONFIGS["qwen3_moe"], overrides=["--training.seq_len", "128"]).train()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    loads = moe.tokens_per_expert.clone()
    GenerationEngine(model).generate([[1, 2, 3]], SamplingConfig(max_new_tokens=4))
    assert model.training and torch.equal(moe.tokens_per_expert, loads)
    assert all(m.attention_fn.__name__ == "attend" for m in model.modules() if hasattr(m, "attention_fn"))
