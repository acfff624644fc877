"""Sample text from a checkpoint with the config's tokenizer.

    python scripts/generate.py --config train_configs/debug_model.toml \
        --checkpoint outputs/checkpoint/step-10 --prompt "def main():" --max_new_tokens 40

Prints the prompt followed by the generated text on stdout. --temperature 0 is greedy decoding (the
same text every run); otherwise tokens are sampled after top-k and top-p filtering, reproducibly
for a given --seed on a given device.
"""

import argparse
import sys
from pathlib import Path

from torchtitan.components.checkpoint import CheckpointError
from torchtitan.config import ConfigError, load_config
from torchtitan.device_arg import default_device, parse_device
from torchtitan.generation import SamplingConfig, generate
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the TOML the checkpoint was trained with")
    parser.add_argument("--checkpoint", help="DCP step folder or Hugging Face folder (default: untrained weights)")
    parser.add_argument("--prompt", default="", help="text to continue (BOS is prepended; default: empty)")
    parser.add_argument("--max_new_tokens", type=int, default=50, help="tokens to generate at most (default 50)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1.0)")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens; 0 = all (default)")
    parser.add_argument("--top_p", type=float, default=1.0,
                        help="sample among the most likely tokens holding this probability mass; 1 = all (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default=default_device(),
                        help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--no_stop_at_eos", action="store_true", help="keep generating past the end-of-text token")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    try:
        sampling.check()
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        device = parse_device(args.device)
        cfg, _ = load_config(["--job.config_file", args.config])
        tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
        model = load_model(args.config, args.checkpoint, device=str(device))
    except (ConfigError, CheckpointError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = tokenizer.encode(args.prompt, bos=True)
    new_ids = generate(model, prompt_ids, sampling, max_context=model.args.max_seq_len,
                       stop_id=None if args.no_stop_at_eos else tokenizer.eos_id, device=device)
    print(args.prompt + tokenizer.decode(new_ids))
    print(f"[{len(new_ids)} new tokens]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
