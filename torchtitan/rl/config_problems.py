"""The [rl] section checked before anything is built (config_check.py calls it): (full key, reason) pairs."""

import dataclasses

from torchtitan.components.objectives.grpo import AGGREGATIONS
from torchtitan.config.job_config import RL


def config_problems(cfg, changed: set[str]) -> list[tuple[str, str]]:
    """``changed``: the keys the config sets (a file or flags), for refusing [rl] settings a run would ignore."""
    rl, training, p = cfg.rl, cfg.training, cfg.parallelism
    if training.objective != "grpo":
        default = RL()
        ignored = [f.name for f in dataclasses.fields(rl)
                   if f"rl.{f.name}" in changed and getattr(rl, f.name) != getattr(default, f.name)]
        return [(f"rl.{ignored[0]}", "is read by training.objective = 'grpo' alone; this run would ignore it (set "
                                     "training.objective = 'grpo' or leave it out)")] if ignored else []
    problems = []

    def need(key: str, ok: bool, reason: str) -> None:
        if not ok:
            problems.append((key, reason))

    need("rl.group_size", rl.group_size >= 2, "is invalid; it must be >= 2 (advantages compare a prompt's "
                                             "completions with each other)")
    need("rl.prompts_per_step", rl.prompts_per_step >= 1, "is invalid; it must be >= 1")
    need("rl.max_new_tokens", 1 <= rl.max_new_tokens < training.seq_len,
         f"is invalid; it must be in [1, training.seq_len = {training.seq_len})")
    need("rl.temperature", rl.temperature > 0, "is invalid; rollouts are sampled, so it must be > 0 (0, greedy, "
                                               "would give a group identical completions)")
    need("rl.top_k", rl.top_k >= 0, "is invalid; it must be >= 0 (0: every token)")
    need("rl.top_p", 0 < rl.top_p <= 1, "is invalid; it must be in (0, 1]")
    need("rl.clip_low", 0 <= rl.clip_low < 1, "is invalid; it must be in [0, 1)")
    need("rl.clip_high", rl.clip_high >= 0, "is invalid; it must be >= 0")
    need("rl.kl_coeff", rl.kl_coeff >= 0, "is invalid; it must be >= 0 (0: no reference model)")
    need("rl.loss_aggregation", rl.loss_aggregation in AGGREGATIONS, f"is invalid; valid: {', '.join(AGGREGATIONS)}")
    need("rl.epochs_per_batch", rl.epochs_per_batch >= 1, "is invalid; it must be >= 1")
    need("rl.max_staleness", rl.max_staleness >= 0, "is invalid; it must be >= 0 (0: synchronous)")
    need("rl.cache_budget_bytes", rl.cache_budget_bytes >= 0, "is invalid; it must be >= 0 (0: no limit)")
    from torchtitan.rl.sampler import SAMPLERS

    need("rl.sampler", rl.sampler in SAMPLERS, f"names no registered sampler; registered: {', '.join(SAMPLERS.names())} "
                                               "(a module of experimental.custom_import can register one in "
                                               "torchtitan.rl.sampler.SAMPLERS)")
    need("rl.chat", not rl.chat or _tokenizer_has_template(cfg), "renders prompts with the tokenizer's chat "
         f"template, and {cfg.model.hf_assets_path} has none; set rl.chat = false for plain-text prompts")
    for key, value, needed in (("model.attention_mask", cfg.model.attention_mask, "block_causal"),
                               ("model.positions", cfg.model.positions, "per_document")):
        need(key, value in ("auto", needed), f"must be {needed!r} or 'auto' with training.objective = 'grpo': each "
                                             "rollout was sampled on its own, so the trainer must score it so")
    for key, degree in (("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
                        ("parallelism.context_parallel_degree", p.context_parallel_degree)):
        need(key, degree == 1 or rl.kl_coeff == 0, "is not supported with rl.kl_coeff > 0 yet (the reference model "
                                                   "scores whole sequences on whole models); use 1, or rl.kl_coeff = 0")
    need("fault_tolerance.enable", not cfg.fault_tolerance.enable,
         "is not supported with training.objective = 'grpo' yet (a redone step would sample again); leave it off")
    need("checkpoint.interval", not cfg.checkpoint.enable or cfg.checkpoint.interval % rl.epochs_per_batch == 0,
         f"must be a multiple of rl.epochs_per_batch = {rl.epochs_per_batch}: a checkpoint inside a batch's epochs "
         "could not resume it exactly (its rollouts came from older weights)")
    from torchtitan.rl.rewards import config_problems as reward_problems
    from torchtitan.rl.tasks import config_problems as task_problems

    problems += [(f"rl.{field}", reason) for field, reason in task_problems(rl) + reward_problems(rl)]
    return problems


def _tokenizer_has_template(cfg) -> bool:
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        return get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path).chat_template is not None
    except Exception:  # a missing tokenizer is the model check's to report
        return True
