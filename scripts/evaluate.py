"""Perplexity of a checkpoint on a dataset (default: the config's validation split), or its scores on
lm-evaluation-harness tasks (--tasks).

    python scripts/evaluate.py --config outputs/config.toml --checkpoint outputs/checkpoint/step-100
    python scripts/evaluate.py --config X.toml --checkpoint hf_folder --validation.dataset_path held_out.jsonl
    python scripts/evaluate.py --config X.toml --checkpoint step_folder --tasks pydocs_mc,hellaswag [--limit 100]
    torchrun --nproc_per_node 2 scripts/evaluate.py --config X.toml --checkpoint ... --tasks pydocs_mc

With --tasks (needs pip install -e ".[eval]") the results print as lm-eval prints them; --json prints lm-eval's
results dict instead. Under torchrun each rank scores its share of the requests. pydocs_mc is built in and offline.

The number is computed by the trainer's Validator with the config's precision, so it equals
exp(val_loss) the training run logged for the same step and data. Any trainer flag of the
[validation] (or other) sections may follow as an override: --validation.seq_len 512,
--validation.steps 20, --validation.local_batch_size 4 ...
"""

import json
import sys
from pathlib import Path

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.config import ConfigError
from torchtitan.data import DataError
from torchtitan.device_arg import default_device, parse_device
from torchtitan.evaluation import evaluate
from torchtitan.script_args import ScriptParser, integer


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0],
                                     epilog="Unrecognised --section.field flags are passed on as config overrides.")
    parser.add_argument("--config", required=True,
                        help="the TOML the checkpoint was trained with "
                             "(a run's resolved {dump_folder}/config.toml is best)")
    parser.add_argument("--checkpoint", help="DCP step folder or Hugging Face folder (default: untrained weights)")
    parser.add_argument("--device", default=default_device(),
                        help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--tasks", help="comma-separated lm-eval tasks (e.g. pydocs_mc, built in) instead of perplexity")
    parser.add_argument("--limit", type=integer(1), help="--tasks: at most this many examples per task")
    parser.add_argument("--num_fewshot", type=integer(0),
                        help="--tasks: few-shot examples per prompt (default: each task's)")
    parser.add_argument("--batch_size", type=integer(1), default=8, help="--tasks: sequences scored per forward")
    args, overrides = parser.parse_known_args(argv)
    bad = [flag for flag in overrides if flag.startswith("-") and not flag.startswith("--") or flag == "--"]
    if bad:
        print(f"error: unknown argument {bad[0]}; overrides look like --section.field value", file=sys.stderr)
        return 2
    try:
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        device = parse_device(args.device)
        if args.tasks:
            return evaluate_tasks(args, overrides, device)
        result = evaluate(args.config, args.checkpoint, overrides=overrides, device=device)
    except (ConfigError, CheckpointError, DataError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss: {result['val_loss']:.6f}  perplexity: {result['val_perplexity']:.4f}  "
              f"tokens: {result['val_tokens']:,}")
    return 0


def evaluate_tasks(args, overrides: list[str], device) -> int:
    from torchtitan.components.evaluation.lm_eval_model import run_tasks
    from torchtitan.config_check import load_model_config
    from torchtitan.distributed import device as device_lib
    from torchtitan.inference import load_model
    from torchtitan.protocols.train_spec import get_train_spec

    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    cfg = load_model_config(args.config, overrides)
    if device_lib.launched_distributed():
        device = device_lib.init_distributed(cfg.comm.init_timeout_seconds)
    model = load_model(args.config, args.checkpoint, device=str(device), overrides=overrides)
    tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
    results = run_tasks(model, tokenizer, tasks, cfg.training.seq_len, batch_size=args.batch_size, device=device,
                        limit=args.limit, num_fewshot=args.num_fewshot)
    if results is not None:  # rank 0
        if args.json:
            print(json.dumps(results["results"], default=str))
        else:
            from lm_eval.utils import make_table

            print(make_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
