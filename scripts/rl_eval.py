r"""Held-out evaluation of a GRPO (or fine-tuned) checkpoint on its config's prompts: mean reward and pass@k.

    python scripts/rl_eval.py --config train_configs/grpo_debug.toml --checkpoint outputs/grpo/checkpoint/step-100

Every prompt of the split (--split, default "heldout": the task's held-out problems, torchtitan/rl/tasks.py) is asked
once, rendered as the trainer renders it (rl.chat), and --samples completions of each are sampled at --temperature
(rl.top_k, rl.top_p and rl.max_new_tokens as in training) through the generation engine, in one batch (split into
groups by rl.cache_budget_bytes), reproducibly for a --seed on a device. The completions are scored by the config's
rl.rewards with rl.reward_weights, in this process (no reward workers, no timeout). Printed, over all samples:

* ``reward_mean``: the weighted total reward, and ``reward/NAME`` each function's mean;
* ``pass@1``: the mean of the --correct function (default exact_answer: the answer right), scored in addition when
  rl.rewards leaves it out; ``pass@K`` (K = --samples): the share of prompts with at least one sample scoring 1.

--limit N asks only the split's first N prompts (in the order of the stream for --seed); --json writes the figures
to a file too. A reward call that fails scores 0 and is counted in ``reward_failures/NAME``.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.components.objectives.grpo import rl_sampling
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.data import DataError
from torchtitan.data.chat_template import ChatTemplate, ChatTemplateError
from torchtitan.device_arg import default_device, parse_device
from torchtitan.generation import GenerationEngine
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.rl.config_problems import config_problems as rl_config_problems
from torchtitan.rl.rewards import REWARDS, RewardPool
from torchtitan.rl.tasks import SPLITS, build_prompt_source, prompt_ids
from torchtitan.script_args import SEED, ScriptParser, integer, real


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the TOML the checkpoint was trained with ([rl] section)")
    parser.add_argument("--checkpoint", help="DCP step folder or Hugging Face folder (default: untrained weights)")
    parser.add_argument("--samples", type=integer(1), default=8, help="completions sampled per prompt (default 8)")
    parser.add_argument("--temperature", type=real(0, note="0: greedy"), default=1.0,
                        help="sampling temperature; 0 = greedy (default 1.0)")
    parser.add_argument("--split", choices=SPLITS, default="heldout", help="which prompts (default heldout)")
    parser.add_argument("--limit", type=integer(1), default=None, help="ask only the first N prompts (default: all)")
    parser.add_argument("--seed", type=SEED, default=0, help="sampling seed and prompt order (default 0)")
    parser.add_argument("--correct", default="exact_answer",
                        help="registered reward function whose 1 means a right answer, for pass@k (default "
                             "exact_answer)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def evaluate(cfg, model: torch.nn.Module, tokenizer, args: argparse.Namespace) -> dict:
    """The figures the module docstring lists, for ``model`` on the config's prompts."""
    rl = cfg.rl
    for key, reason in rl_config_problems(cfg, changed=set()):
        raise ValueError(f"{args.config}: {key} {reason}")
    if args.correct not in REWARDS:
        raise ValueError(f"--correct {args.correct} is no registered reward function; registered: "
                         f"{', '.join(REWARDS.names())}")
    source = build_prompt_source(rl, args.seed, args.split)
    count = source.pass_size if args.limit is None else args.limit
    if count > source.pass_size:
        raise ValueError(f"--limit {args.limit} is invalid; the {args.split} split has {source.pass_size} prompts: "
                         f"give at most {source.pass_size}")
    samples = [source[i] for i in range(count)]
    template = ChatTemplate(tokenizer.chat_template) if rl.chat else None
    prompts = [prompt_ids(tokenizer, template, sample["prompt"]) for sample in samples]
    k = args.samples
    sampling = dataclasses.replace(rl_sampling(rl), temperature=args.temperature, seed=args.seed)
    engine = GenerationEngine(model, cache_budget_bytes=rl.cache_budget_bytes or None)
    completions = engine.generate([p for p in prompts for _ in range(k)], sampling,
                                  stop_token_ids=[tokenizer.eos_id])
    # Decoded as the trainer decodes rollouts for the rewards (rl/rollouts.py): without the stop token.
    texts = [tokenizer.decode(c.tokens[:-1] if c.finish_reason == "stop" else c.tokens) for c in completions]
    names = list(rl.rewards)
    weights = list(rl.reward_weights) or [1.0] * len(names)
    if args.correct not in names:  # scored for pass@k, weighed 0 in the total
        names.append(args.correct)
        weights.append(0.0)
    pool = RewardPool(names, weights, 0, rl.reward_timeout_seconds)
    try:
        scores = pool.score(texts, [sample for sample in samples for _ in range(k)])
    finally:
        pool.close()
    correct = torch.tensor(scores.per_function[args.correct], dtype=torch.float64).view(count, k)
    figures = {"checkpoint": args.checkpoint, "split": args.split, "prompts": count, "samples": k,
               "temperature": args.temperature, "seed": args.seed,
               "reward_mean": sum(scores.total) / len(scores.total)}
    for name in rl.rewards:
        figures[f"reward/{name}"] = sum(scores.per_function[name]) / len(texts)
    figures["pass@1"] = float(correct.mean())
    figures[f"pass@{k}"] = float((correct == 1).any(dim=1).double().mean())
    figures["completion_length_mean"] = sum(len(c.tokens) for c in completions) / len(completions)
    for name in names:
        figures[f"reward_failures/{name}"] = scores.failures.get(name, 0)
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        device = parse_device(args.device or default_device())
        cfg = load_model_config(args.config)
        tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
        model = load_model(args.config, args.checkpoint, device=str(device))
        figures = evaluate(cfg, model, tokenizer, args)
    except (ConfigError, CheckpointError, ChatTemplateError, DataError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{figures['prompts']} {args.split} prompts x {args.samples} samples at temperature {args.temperature:g} "
          f"(seed {args.seed}), checkpoint {args.checkpoint or '(untrained)'}:")
    for key, value in figures.items():
        if key.startswith(("reward", "pass@", "completion")):
            print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
