"""Sample text from a checkpoint with the config's tokenizer.

    python scripts/generate.py --config train_configs/debug_model.toml \
        --checkpoint outputs/checkpoint/step-10 --prompt "def main():" --max_new_tokens 40

    python scripts/generate.py --config train_configs/sft_debug.toml \
        --checkpoint outputs/sft/checkpoint/step-100 --chat --prompt "What does \`json.dumps(obj)\` do?"

Prints the prompt followed by the generated text on stdout; with --chat the prompt is a user message,
rendered with the tokenizer's chat template (as in fine-tuning, data/chat_template.py) up to where the
assistant answers, and only the answer is printed. --temperature 0 is greedy decoding (the same text
every run); otherwise tokens are sampled after top-k and top-p filtering, reproducibly for a given
--seed on a given device.
"""

import argparse
import sys
from pathlib import Path

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.data.chat_template import ChatTemplate, ChatTemplateError, assistant_token_mask
from torchtitan.device_arg import default_device, parse_device
from torchtitan.generation import SamplingConfig, generate_without_cache as generate
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.script_args import SEED, ScriptParser, integer, real


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the TOML the checkpoint was trained with")
    parser.add_argument("--checkpoint", help="DCP step folder or Hugging Face folder (default: untrained weights)")
    parser.add_argument("--prompt", default="", help="text to continue (BOS is prepended; default: empty)")
    parser.add_argument("--max_new_tokens", type=integer(1), default=50, help="tokens to generate at most (default 50)")
    parser.add_argument("--temperature", type=real(0, note="0: greedy"), default=1.0,
                        help="softmax temperature; 0 = greedy (default 1.0)")
    parser.add_argument("--top_k", type=integer(0, note="0: all"), default=0,
                        help="sample among the k most likely tokens; 0 = all (default)")
    parser.add_argument("--top_p", type=real(0, 1, low_open=True, note="1: all"), default=1.0,
                        help="sample among the most likely tokens holding this probability mass; 1 = all (default)")
    parser.add_argument("--seed", type=SEED, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default=default_device(),
                        help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--no_stop_at_eos", action="store_true", help="keep generating past the end-of-text token")
    parser.add_argument("--chat", action="store_true",
                        help="treat --prompt as a user message and answer it through the tokenizer's chat template")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    return parser.parse_args(argv)


def chat_prompt(tokenizer, question: str, system: str | None = None) -> list[int]:
    """Token ids of a conversation of one user message (after an optional system one), rendered with the
    tokenizer's chat template and its generation prompt: where the assistant's answer begins."""
    if tokenizer.chat_template is None:
        raise ValueError("--chat needs a tokenizer with a chat_template (in its tokenizer_config.json)")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": question})
    ids, _ = assistant_token_mask(tokenizer, ChatTemplate(tokenizer.chat_template), messages,
                                  add_generation_prompt=True)
    return ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    try:
        sampling.check()
        if args.system is not None and not args.chat:
            raise ValueError("--system is a chat message; add --chat (or leave --system out)")
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        device = parse_device(args.device)
        cfg = load_model_config(args.config)
        tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
        model = load_model(args.config, args.checkpoint, device=str(device))
    except (ConfigError, CheckpointError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.chat:
        try:
            prompt_ids = chat_prompt(tokenizer, args.prompt, args.system)
        except (ChatTemplateError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        prompt_ids = tokenizer.encode(args.prompt, bos=True)
    stop_id = None if args.no_stop_at_eos else tokenizer.eos_id
    new_ids = generate(model, prompt_ids, sampling, max_context=model.args.max_seq_len, stop_id=stop_id,
                       device=device)
    if args.chat:
        print(tokenizer.decode(new_ids[:-1] if new_ids and new_ids[-1] == stop_id else new_ids))
    else:
        print(args.prompt + tokenizer.decode(new_ids))
    print(f"[{len(new_ids)} new tokens]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
