"""Downstream tasks during training ([eval]): lm-evaluation-harness tasks (torchtitan/components/evaluation/lm_eval_model.py) every ``freq``
steps, their metrics logged beside the training rows as ``eval/{task}/{metric}``.

Every rank scores every request (the model's FSDP shards gather in lock-step that way, whatever each request's
length); the model is in eval mode without gradients, and every random stream lm-eval seeds (Python's, NumPy's,
torch's) is put back afterwards, so a run's training numbers are the same with and without evaluation.
"""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import torch
from torch import nn

from torchtitan.config.job_config import Eval as EvalConfig
from torchtitan.config.job_config import Parallelism
from torchtitan.config_fields import changed_fields
from torchtitan.data import Tokenizer


def config_problems(cfg: EvalConfig, parallelism: Parallelism) -> list[tuple[str, str]]:
    """Problems with the [eval] section as (field, reason) pairs."""
    if not cfg.enable:
        changed = changed_fields(cfg, skip=("enable",))
        return [("enable", f"but eval.{changed[0]} is set; enable it or leave [eval] out")] if changed else []
    if importlib.util.find_spec("lm_eval") is None:
        return [("enable", "needs lm-eval (pip install -e \".[eval]\", or pip install lm-eval)")]
    problems = []
    if not cfg.tasks:
        problems.append(("tasks", "is empty; name at least one task (e.g. pydocs_mc)"))
    for name in ("freq", "batch_size"):
        if getattr(cfg, name) <= 0:
            problems.append((name, "is invalid; it must be > 0"))
    if cfg.limit < 0:
        problems.append(("limit", "is invalid; it must be >= 0 (0: every example)"))
    if cfg.num_fewshot < -1:
        problems.append(("num_fewshot", "is invalid; it must be >= 0, or -1 for each task's default"))
    split = {"tensor_parallel_degree": parallelism.tensor_parallel_degree,
             "pipeline_parallel_degree": parallelism.pipeline_parallel_degree,
             "context_parallel_degree": parallelism.context_parallel_degree}
    for name, degree in split.items():
        if degree > 1:
            problems.append(("enable", f"runs the whole model forward on each rank (data parallelism only), but "
                                       f"parallelism.{name} = {degree}; evaluate checkpoints with "
                                       "scripts/evaluate.py --tasks instead"))
            break
    return problems


class TaskEvaluator:
    def __init__(self, cfg: EvalConfig, tokenizer: Tokenizer, max_length: int, device: torch.device, autocast):
        from torchtitan.components.evaluation.lm_eval_model import task_manager

        self.cfg, self.tokenizer, self.max_length, self.device, self.autocast = (cfg, tokenizer, max_length, device,
                                                                                 autocast)
        self.manager = task_manager(cfg.tasks)
        unknown = [task for task in cfg.tasks if task not in self.manager.all_tasks]
        if unknown:
            raise ValueError(f"eval.tasks: unknown lm-eval task {unknown[0]!r}")

    def should_run(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    def run(self, model_parts: list[nn.Module]) -> dict[str, float]:
        """Every task's metrics on the model as it is (every rank calls it and gets the same numbers)."""
        import lm_eval

        from torchtitan.components.evaluation.lm_eval_model import TitanLM

        model = model_parts[0]
        streams = random.getstate(), np.random.get_state(), torch.get_rng_state(), \
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        model.eval()
        try:
            lm = TitanLM(model, self.tokenizer, self.max_length, batch_size=self.cfg.batch_size, device=self.device,
                         autocast=self.autocast, share_across_ranks=False)
            results = lm_eval.simple_evaluate(
                model=lm, tasks=list(self.cfg.tasks), task_manager=self.manager, limit=self.cfg.limit or None,
                num_fewshot=None if self.cfg.num_fewshot < 0 else self.cfg.num_fewshot, log_samples=False,
                bootstrap_iters=0, verbosity="ERROR")["results"]
        finally:
            model.train()
            random.setstate(streams[0])
            np.random.set_state(streams[1])
            torch.set_rng_state(streams[2])
            if streams[3] is not None:
                torch.cuda.set_rng_state_all(streams[3])
        return {f"eval/{task}/{metric.split(',')[0]}": float(value) for task, row in results.items()
                for metric, value in row.items() if "," in metric and "stderr" not in metric
                and isinstance(value, (int, float))}
