"""TitanLM (torchtitan/components/evaluation/lm_eval_model.py) on hand-made requests: generation's stop strings and length limit, and
log-likelihoods equal to a plain forward's."""

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
    """Predicts, after a prompt of any length, the tokens of ``script`` one after another (then end-of-text)."""

    def __init__(self, script: list[int], prompt_length: int, vocab: int, eos: int):
        super().__init__()
        self.script, self.prompt_length, self.vocab, self.eos = script, prompt_length, vocab, eos

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, self.vocab)
        produced = tokens.shape[1] - self.prompt_length
        nxt = self.script[produced] if produced < len(self.script) else self.eos
        logits[:, -1, nxt] = 10.0
        return logits


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
