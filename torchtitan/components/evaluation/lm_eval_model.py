"""Our models behind EleutherAI's lm-evaluation-harness (``pip install -e ".[eval]"``).

``TitanLM`` is an lm-eval ``TemplateLM``: lm-eval splits each (context, continuation) pair into tokens the way it
does for its own causal models (the context's trailing spaces move to the continuation; an empty context is
preceded by BOS), and this class scores them in batches, rolls long texts through windows of the model's length,
and generates until a stop string or the length limit (batched through the generation engine,
torchtitan/generation/). Under ``torchrun`` each data-parallel rank takes its share of the requests (lm-eval's
evaluator splits and gathers them through ``rank``/``world_size`` and the collectives below).

    results = run_tasks(model, tokenizer, ["pydocs_mc"], max_length=2048)

``pydocs_mc``, shipped in ``torchtitan/eval_tasks``, needs no network: multiple choice over which standard-library
function a docstring of the held-out pydocs split describes. Other task names are lm-eval's own (their datasets
come from the Hub where the network allows).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan.data.tokenizer import Tokenizer
from torchtitan.generation import GenerationEngine, SamplingConfig

TASKS_DIR = Path(__file__).parents[2] / "eval_tasks"
BUILT_IN_TASKS = frozenset(path.stem for path in TASKS_DIR.glob("*.yaml"))


def _template_lm():
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError as e:
        raise ImportError("evaluating on tasks needs lm-eval: pip install -e \".[eval]\" (or pip install lm-eval)") \
            from e
    return TemplateLM


class TitanLM(_template_lm()):
    def __init__(self, model: nn.Module, tokenizer: Tokenizer, max_length: int, batch_size: int = 8,
                 device: torch.device | str = "cpu", autocast=None, share_across_ranks: bool = True):
        """``share_across_ranks``: under torchrun each rank scores its share of the requests; else every rank
        scores them all (an FSDP-sharded model, whose ranks must run the same forwards)."""
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size = max_length, batch_size
        self._device = torch.device(device)
        self.autocast = autocast
        distributed = dist.is_initialized() and share_across_ranks
        self._rank = dist.get_rank() if distributed else 0
        self._world_size = dist.get_world_size() if distributed else 1

    # ----- what lm-eval asks of a TemplateLM -----

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, bos=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [B, T, vocab] (float32) of right-padded rows."""
        longest = max(map(len, rows))
        batch = torch.full((len(rows), longest), self.tokenizer.eos_id, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, :len(row)] = torch.tensor(row)
        if self.autocast is None:
            logits = self.model(batch.to(self._device))
        else:
            with self.autocast():
                logits = self.model(batch.to(self._device))
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether greedy decoding gives it) per request, each
        request's tokens the last ``max_length`` + 1 of context + continuation."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # Longest first: similar lengths share a batch, and an out-of-memory shows at the first batch.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            rows, spans = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                whole = (context + continuation)[-(self.max_length + 1):]
                rows.append(whole[:-1])
                spans.append((len(whole) - 1 - len(continuation), continuation))
            logprobs = self._logits(rows)
            for row, i, (begin, continuation) in zip(logprobs, chunk, spans):
                scores = row[begin:begin + len(continuation)]
                target = torch.tensor(continuation, device=scores.device)
                total = scores.gather(-1, target[:, None]).sum().item()
                results[i] = (total, bool((scores.argmax(-1) == target).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood: windows of max_length tokens, each scoring only tokens no earlier
        window scored (lm-eval's own windowing), the first preceded by BOS."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        totals = []
        for (text,) in (request.args for request in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scored = self._loglikelihood_tokens([(None, context, target) for context, target in windows])
            totals.append(sum(score for score, _ in scored))
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, cut before the first of its stop strings (``until``), at most
        ``max_gen_toks`` tokens (default 256); the end-of-text token also stops. Greedy unless gen_kwargs say
        ``do_sample`` with a temperature > 0: then sampled (after ``top_k``/``top_p`` if given; the seed is drawn
        from torch's random stream, which lm-eval seeds). Requests with the same gen_kwargs run through the
        generation engine as one batch, whose caches are held to what ``batch_size`` rows of ``max_length`` tokens
        need (the engine splits a larger batch).

        Each context keeps its last ``max_length - max_gen_toks`` tokens, as lm-eval's ``hf`` model crops them, but
        never fewer than ``max_length // 2``: a cache cannot slide its window, so where ``max_gen_toks`` is more
        than half of ``max_length`` (256 on a short-context model) a continuation stops where context and
        continuation reach ``max_length``."""
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(_generation_kwargs(request.args[1]), []).append(i)
        # Ranks that each score their own share run different batches; an FSDP-sharded model runs the same on all.
        engine = GenerationEngine(self.model, per_rank=self._world_size > 1)
        length = min(self.max_length, engine.max_seq_len)
        engine.cache_budget_bytes = engine.cache_bytes(self.batch_size, length)
        eos = self.tokenizer.eos_id
        outputs: list[str | None] = [None] * len(requests)
        for (until, max_new, temperature, top_k, top_p), indices in groups.items():
            keep = length - min(max_new, length // 2)
            prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-keep:] for i in indices]
            seed = int(torch.randint(2**62, ())) if temperature > 0 else 0
            sampling = SamplingConfig(max_new_tokens=max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                                      seed=seed)
            with self.autocast() if self.autocast is not None else contextlib.nullcontext():
                done = engine.generate(prompts, sampling, stop_token_ids=[eos], stop_strings=until,
                                       decode=lambda ids: self.tok_decode(ids[:-1] if ids and ids[-1] == eos else ids))
            for i, completion in zip(indices, done):
                outputs[i] = completion.text
        return outputs

    # ----- collectives lm-eval's evaluator uses across data-parallel ranks -----

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size
        dist.all_gather_object(gathered, obj)
        return gathered if self._rank == dst else None

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()


# The gen_kwargs generate_until reads; any other is refused rather than ignored.
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _generation_kwargs(kwargs: dict) -> tuple[tuple[str, ...], int, float, int, float]:
    """(stop strings, max new tokens, temperature (0: greedy), top_k, top_p) of a request's gen_kwargs."""
    unknown = sorted(set(kwargs) - set(GEN_KWARGS))
    if unknown:
        raise ValueError(f"generate_until: gen_kwargs {unknown[0]!r} = {kwargs[unknown[0]]!r} is not supported; "
                         f"supported: {', '.join(GEN_KWARGS)}")
    until = kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    max_new = int(kwargs.get("max_gen_toks", 256))
    if max_new < 1:
        raise ValueError(f"generate_until: max_gen_toks = {max_new} is invalid; it must be >= 1")
    temperature = float(kwargs.get("temperature", 1.0))
    if not kwargs.get("do_sample", False) or temperature <= 0:
        return until, max_new, 0.0, 0, 1.0  # greedy: top_k and top_p change nothing
    return until, max_new, temperature, int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0)


def _not_custom_dataset_advice(record: logging.LogRecord) -> bool:
    # lm-eval advises on --metadata whenever a task builds its dataset in Python, as pydocs_mc does: noise here.
    return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(tasks: list[str]):
    """lm-eval's task registry: ours alone when every task is built in (lm-eval's thousands of task files are not
    read, so start-up stays fast), else lm-eval's with ours added."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.api.task").addFilter(_not_custom_dataset_advice)

    ours_only = set(tasks) <= BUILT_IN_TASKS
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=not ours_only, verbosity="ERROR")


def run_tasks(model: nn.Module, tokenizer: Tokenizer, tasks: list[str], max_length: int, *, batch_size: int = 8,
              device: torch.device | str = "cpu", limit: int | None = None, num_fewshot: int | None = None,
              autocast=None) -> dict:
    """lm-eval's results dict (``results[task][metric]``) for ``tasks``; every rank calls it under torchrun, and
    rank 0 gets the results (the others None). An unknown task is a ValueError naming it."""
    import lm_eval

    manager = task_manager(tasks)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task {unknown[0]!r}; built in: {', '.join(sorted(BUILT_IN_TASKS))} (others "
                         "come from lm-eval's registry, e.g. hellaswag, arc_easy, lambada_openai)")
    lm = TitanLM(model, tokenizer, max_length, batch_size=batch_size, device=device, autocast=autocast)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                   log_samples=False, bootstrap_iters=0, verbosity="ERROR")
