"""TitanLM (torchtitan/components/evaluation/lm_eval_model.py) on hand-made requests: generation's stop strings,
length limit and cropping, its batches through the generation engine equal to the old one-request-at-a-time loop,
sampling after the gen_kwargs; log-likelihoods equal to a plain forward's."""

import functools
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from torch import nn

from torchtitan.components.evaluation.lm_eval_model import TitanLM
from torchtitan.config import load_config
from torchtitan.inference import build_model
from torchtitan.protocols.train_spec import get_train_spec


@pytest.fixture(scope="module")
def tokenizer():
    cfg, _ = load_config(["--job.config_file", "train_configs/tiny.toml"])
    return get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)


class Scripted(nn.Module):
    """Predicts, after a prompt of any length, the tokens of ``script`` one after another (then end-of-text). It has
    what the generation engine asks of a model: no token mixers to cache, the RoPE positions of its tokens (which
    count from each prompt's first token) telling it how far along the script it is."""

    def __init__(self, script: list[int], prompt_length: int, vocab: int, eos: int):
        super().__init__()
        self.script, self.prompt_length, self.vocab, self.eos = script, prompt_length, vocab, eos
        self.args = SimpleNamespace(max_seq_len=64, vocab_size=vocab)
        self.unused = nn.Parameter(torch.zeros(1))

    def main_layers(self) -> list[nn.Module]:
        return []

    def run_blocks(self, tokens: torch.Tensor, documents=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        return positions[..., None].float()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        produced = h[..., 0].long() + 1 - self.prompt_length
        nxt = torch.tensor(self.script + [self.eos])[produced.clamp(0, len(self.script))]
        return torch.zeros(*h.shape[:-1], self.vocab).scatter(-1, nxt[..., None], 10.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(tokens, positions=torch.arange(tokens.shape[1]).expand_as(tokens)))


def request(context: str, **kwargs) -> Instance:
    return Instance("generate_until", {}, (context, kwargs), 0)


def test_generation_stops_before_a_stop_string_and_at_the_length_limit(tokenizer):
    prompt = "Question: what follows?"
    script = tokenizer.encode(" alpha beta. gamma\n\ndelta")
    model = Scripted(script, len(tokenizer.encode(prompt)), tokenizer.vocab_size, tokenizer.eos_id)
    lm = TitanLM(model, tokenizer, max_length=64)
    full = tokenizer.decode(script)
    outputs = lm.generate_until([
        request(prompt, until=["."], max_gen_toks=64),
        request(prompt, until=["\n\n", "gamma"], max_gen_toks=64),
        request(prompt, until=["."], max_gen_toks=2),
        request(prompt, until=["never"], max_gen_toks=64),
        request(prompt, until="beta", max_gen_toks=64),
    ])
    assert outputs[0] == " alpha beta"
    assert outputs[1] == full[:full.index("gamma")]
    assert outputs[2] == tokenizer.decode(script[:2])
    assert outputs[3] == full  # ran to end-of-text, which is not part of the text
    assert outputs[4] == " alpha "


@pytest.fixture(scope="module")
def tiny_model():
    cfg, _ = load_config(["--job.config_file", "train_configs/tiny.toml"])
    model, _ = build_model(cfg)  # initialised from debug.seed: random weights, the same every run
    return model.eval()


@functools.cache
def one_at_a_time(model, tokenizer, context: str, until: tuple[str, ...], max_new: int, max_length: int = 64) -> str:
    """The adapter's old loop, one request at a time: the whole text through the model's forward for every token,
    greedy, stopping at end-of-text or once a stop string shows, the text cut before it. Its context is cropped as
    the adapter now documents (the last max_length - max_gen_toks tokens, at least max_length // 2), and it stops where
    context plus continuation reach max_length (where the old loop slid its window)."""
    ids = (tokenizer.encode(context) or [tokenizer.bos_id])[-(max_length - min(max_new, max_length // 2)):]
    new, text = [], ""
    for _ in range(min(max_new, max_length - len(ids))):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + new]))[0, -1].argmax())
        if token == tokenizer.eos_id:
            break
        new.append(token)
        text = tokenizer.decode(new)
        if any(stop in text for stop in until):
            break
    return text[:min([text.index(stop) for stop in until if stop in text], default=len(text))]


LONG = " ".join(f"item{i} = {i} * 2" for i in range(30))  # far more than 64 tokens: cropped from the left
CONTEXTS = ["def f(x):", "The quick brown fox jumps over the lazy dog because", "", LONG, "import os\nimport"]


def stop_words(model, tokenizer, context: str, max_new: int) -> list[str]:
    """Two words the greedy continuation of ``context`` holds, so that a stop string really cuts it."""
    words = re.findall(r"[A-Za-z]{3,}", one_at_a_time(model, tokenizer, context, (), max_new))
    assert len(words) >= 2, words
    return [words[len(words) // 2], words[-1]]


def count_engine_batches(monkeypatch) -> list[int]:
    """The number of prompts of each GenerationEngine.generate call from now on."""
    from torchtitan.generation import GenerationEngine

    sizes, generate = [], GenerationEngine.generate
    monkeypatch.setattr(GenerationEngine, "generate",
                        lambda self, prompts, *args, **kwargs: (sizes.append(len(prompts)),
                                                                generate(self, prompts, *args, **kwargs))[1])
    return sizes


def test_greedy_generation_in_batches_equals_the_one_at_a_time_loop(tiny_model, tokenizer, monkeypatch):
    """Requests of different lengths (one cropped from the left), different stop strings and max_gen_toks: one engine
    batch per set of gen_kwargs, and each output that of the one-at-a-time loop, in request order."""
    gen = [{"until": stop_words(tiny_model, tokenizer, CONTEXTS[0], 12)[:1], "max_gen_toks": 12},
           {"until": ["\n\n"], "max_gen_toks": 12},
           {"until": stop_words(tiny_model, tokenizer, CONTEXTS[4], 40), "max_gen_toks": 40, "do_sample": False}]
    chosen = [(0, 1), (1, 0), (2, 1), (3, 1), (4, 2), (0, 2), (3, 0), (4, 0), (1, 1)]
    requests = [request(CONTEXTS[c], **gen[g]) for c, g in chosen]
    sizes = count_engine_batches(monkeypatch)
    outputs = TitanLM(tiny_model, tokenizer, max_length=64, batch_size=2).generate_until(requests)
    expected = [one_at_a_time(tiny_model, tokenizer, CONTEXTS[c], tuple(gen[g]["until"]), gen[g]["max_gen_toks"])
                for c, g in chosen]
    assert outputs == expected
    assert sorted(sizes) == [2, 3, 4]  # one call per set of gen_kwargs (the cache budget splits them inside)
    assert any(len(out) < len(one_at_a_time(tiny_model, tokenizer, CONTEXTS[c], (), gen[g]["max_gen_toks"]))
               for out, (c, g) in zip(outputs, chosen))  # some stop string did cut


def test_sampled_requests_follow_their_gen_kwargs(tiny_model, tokenizer, monkeypatch):
    """do_sample with top_k = 1 is greedy at any temperature; a hot temperature samples something else, the same
    again after the same torch seed (lm-eval seeds it) and otherwise not; greedy requests beside them are unchanged."""
    lm = TitanLM(tiny_model, tokenizer, max_length=64)
    greedy = [request(c, until=["\n\n"], max_gen_toks=16) for c in CONTEXTS[:3]]
    top_1 = [request(c, until=["\n\n"], max_gen_toks=16, do_sample=True, temperature=3.0, top_k=1)
             for c in CONTEXTS[:3]]
    hot = [request(c, until=["\n\n"], max_gen_toks=16, do_sample=True, temperature=3.0) for c in CONTEXTS[:3]]
    expected = [one_at_a_time(tiny_model, tokenizer, c, ("\n\n",), 16) for c in CONTEXTS[:3]]
    torch.manual_seed(1234)
    first = lm.generate_until(greedy + top_1 + hot)
    assert first[:6] == expected + expected
    assert all(a != b for a, b in zip(first[6:], expected))
    torch.manual_seed(1234)
    again = lm.generate_until(hot)
    torch.manual_seed(1234)
    assert lm.generate_until(hot) == again != lm.generate_until(hot)
    # temperature 0 with do_sample, or no do_sample with a temperature, is greedy too
    assert lm.generate_until([request(CONTEXTS[0], until=["\n\n"], max_gen_toks=16, do_sample=True, temperature=0),
                              request(CONTEXTS[1], until=["\n\n"], max_gen_toks=16, temperature=3.0)]) == \
        expected[:2]


@pytest.mark.parametrize("max_gen_toks, kept", [(12, 52), (48, 32)])
def test_a_long_context_keeps_its_last_tokens(max_gen_toks, kept, tokenizer):
    """max_length 64: the context keeps its last 64 - max_gen_toks tokens, but at least 32, and the continuation stops
    at 64 tokens in all. The scripted model follows its script only after a prompt of exactly ``kept`` tokens."""
    script = tokenizer.encode(" ".join(f"w{i}" for i in range(40)))[:40]
    assert len(tokenizer.encode(LONG)) > 64 and len(script) == 40
    lm = TitanLM(Scripted(script, kept, tokenizer.vocab_size, tokenizer.eos_id), tokenizer, max_length=64)
    (output,) = lm.generate_until([request(LONG, until=["never"], max_gen_toks=max_gen_toks)])
    assert output == tokenizer.decode(script[:min(max_gen_toks, 64 - kept)])


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 4}, "gen_kwargs 'num_beams' = 4 is not supported; supported: until, max_gen_toks"),
    ({"max_new_tokens": 10}, "gen_kwargs 'max_new_tokens' = 10 is not supported"),
    ({"max_gen_toks": 0}, "max_gen_toks = 0 is invalid; it must be >= 1"),
    ({"max_gen_toks": -3}, "max_gen_toks = -3 is invalid; it must be >= 1"),
])
def test_gen_kwargs_it_cannot_honour_are_refused(kwargs, message, tokenizer):
    lm = TitanLM(Scripted([5], 1, tokenizer.vocab_size, tokenizer.eos_id), tokenizer, max_length=64)
    with pytest.raises(ValueError, match=re.escape(message)):
        lm.generate_until([request("x", until=["."], **kwargs)])


@pytest.mark.parametrize("share_across_ranks, broadcasts", [(True, False), (False, True)])
def test_only_ranks_running_the_same_requests_agree_on_tokens(share_across_ranks, broadcasts, tokenizer,
                                                               monkeypatch):
    """Under torchrun (two ranks, faked here), ranks that each score their own share generate alone: agreeing with
    rank 0 on different batches would hang. Ranks running the same requests (an FSDP-sharded model) agree."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD="the default group"))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group=None: calls.append(src))
    prompt = "Question: what follows?"
    script = tokenizer.encode(" alpha beta. gamma")
    lm = TitanLM(Scripted(script, len(tokenizer.encode(prompt)), tokenizer.vocab_size, tokenizer.eos_id), tokenizer,
                 max_length=64, share_across_ranks=share_across_ranks)
    assert lm.generate_until([request(prompt, until=["."], max_gen_toks=8)]) == [" alpha beta"]
    assert bool(calls) == broadcasts
    from torchtitan.generation import GenerationEngine

    with pytest.raises(ValueError, match="per_rank = True generates on each rank alone; leave group out"):
        GenerationEngine(lm.model, per_rank=True, group=dist.group.WORLD)


def test_loglikelihoods_are_the_plain_forwards_sums(tokenizer):
    cfg, _ = load_config(["--job.config_file", "train_configs/tiny.toml"])
    torch.manual_seed(0)
    model, _ = build_model(cfg)
    model.eval()
    pairs = [("The function returns", " a list"), ("x = ", "1 + 2"), ("", "import os"),
             ("A longer context that goes on for a while and then", " stops.")]
    lm = TitanLM(model, tokenizer, max_length=64, batch_size=3)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (score, greedy) in zip(pairs, got):
        whole = tokenizer.encode(context + continuation)
        context_ids = tokenizer.encode(context) if context else []
        if context and context.endswith(" "):
            context_ids = tokenizer.encode(context.rstrip(" "))
        target = whole[len(context_ids):] if context else tokenizer.encode(continuation)
        ids = (context_ids or [tokenizer.bos_id]) + target
        with torch.no_grad():
            logprobs = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), dim=-1)[0]
        picked = logprobs[-len(target):].gather(-1, torch.tensor(target)[:, None])
        assert score == pytest.approx(picked.sum().item(), abs=1e-4), (context, continuation)
        assert greedy == bool((logprobs[-len(target):].argmax(-1) == torch.tensor(target)).all())
    # Rolling: a text that fits is one window after BOS, the loglikelihood of the whole text from nothing.
    short = "def f(x):\n    return x + 1"
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)])[0]
    assert rolling == pytest.approx(lm.loglikelihood([Instance("loglikelihood", {}, ("", short), 0)])[0][0], abs=1e-4)
    # A longer one goes through windows of max_length that score each of its tokens exactly once.
    text = " ".join(f"word{i}" for i in range(60))
    scored = []
    score_tokens = lm._loglikelihood_tokens
    lm._loglikelihood_tokens = lambda requests: (scored.extend(x for _, _, t in requests for x in t),
                                                 score_tokens(requests))[1]
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert len(tokenizer.encode(text)) > 64 and scored == tokenizer.encode(text)


@pytest.mark.parametrize(("flags", "world_size", "message"), [
    (["--eval.freq", "5"], 1, "eval.enable = False but eval.freq is set"),
    (["--eval.enable", "--eval.freq", "0"], 1, "eval.freq = 0 is invalid; it must be > 0"),
    (["--eval.enable", "--eval.tasks", ""], 1, r"eval.tasks = \[\] is empty"),
    (["--eval.enable", "--eval.limit", "-1"], 1, r"eval.limit = -1 is invalid; it must be >= 0 \(0: every example\)"),
    (["--eval.enable", "--eval.num_fewshot", "-2"], 1, "eval.num_fewshot = -2 is invalid; it must be >= 0, or -1"),
    (["--eval.enable", "--parallelism.tensor_parallel_degree", "2"], 2, "parallelism.tensor_parallel_degree = 2; "
                                                                       "evaluate checkpoints with scripts/evaluate.py"),
])
def test_in_loop_eval_settings_that_cannot_work_are_refused(flags, world_size, message):
    from torchtitan.config import ConfigError
    from torchtitan.config_check import validate_config

    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", *flags])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, sources, world_size=world_size)
