r"""Sample text from a checkpoint with the config's tokenizer, through the generation engine (torchtitan/generation/).

    python scripts/generate.py --config train_configs/debug_model.toml \
        --checkpoint outputs/checkpoint/step-10 --prompt "def main():" --max_new_tokens 40

    python scripts/generate.py --config train_configs/debug_model.toml --checkpoint outputs/checkpoint/step-10 \
        --prompt "import os" --prompt "class Stack:" --stop $'\n\n' --temperature 0 --logprobs

    python scripts/generate.py --config train_configs/sft_debug.toml \
        --checkpoint outputs/sft/checkpoint/step-100 --chat --prompt "What does \`json.dumps(obj)\` do?"

Prints the prompt followed by the generated text on stdout. Several prompts (--prompt repeated, then the lines of
--prompts_file, one prompt per line) run as one batch; each completion is printed in their order after a line
``=== prompt I of N ===``. With --chat each prompt is a user message, rendered with the tokenizer's chat template (as
in fine-tuning, data/chat_template.py) up to where the assistant answers, and only the answer is printed.

A completion ends at the end-of-text token, which is not printed (--no_stop_at_eos generates past it), at a --stop
string (the text is cut before it), at --max_new_tokens, or where prompt plus new tokens reach the model's
max_seq_len (training.seq_len; a prompt that long is refused). --temperature 0 is greedy decoding: the same text
every run, and the same for a prompt alone or in a batch; otherwise tokens are sampled after top-k and top-p
filtering, reproducibly for a given --seed, device and batch of prompts.

--logprobs writes one JSON line per completion to stderr: {"prompt": I (from 0), "tokens": [every chosen id, the
end-of-text token that stopped it included], "pieces": [each token's text], "logprobs": [...], "finish_reason":
"stop" | "length"}. Greedy tokens' log-probabilities are under the model's distribution, sampled ones under the
distribution they were drawn from (after temperature, top-k and top-p; torchtitan/generation/sampling.py).
"""

import argparse
import json
import sys
from pathlib import Path

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.data.chat_template import ChatTemplate, ChatTemplateError, assistant_token_mask
from torchtitan.device_arg import default_device, parse_device
from torchtitan.generation import GenerationEngine, SamplingConfig
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.script_args import SEED, ScriptParser, integer, real


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the TOML the checkpoint was trained with")
    parser.add_argument("--checkpoint", help="DCP step folder or Hugging Face folder (default: untrained weights)")
    parser.add_argument("--prompt", action="append",
                        help="text to continue (BOS is prepended); repeat for a batch (default: one empty prompt)")
    parser.add_argument("--prompts_file", help="a text file of prompts, one per line (after any --prompt)")
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
    parser.add_argument("--stop", action="append", default=[],
                        help="end a completion at this string, cut before it; repeatable (e.g. --stop $'\\n\\n')")
    parser.add_argument("--cache_budget_bytes", type=integer(1), default=None,
                        help="run the batch in groups whose caches fit this many bytes (default: one group)")
    parser.add_argument("--prefill_chunk", type=integer(1), default=256,
                        help="prompt tokens per prefill forward (default 256; bounds the activations)")
    parser.add_argument("--logprobs", action="store_true",
                        help="write each completion's tokens and log-probabilities to stderr as a JSON line")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message and answer it through the tokenizer's chat template")
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


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The --prompt texts, then the lines of --prompts_file; one empty prompt when neither is given."""
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ValueError(f"--prompts_file {args.prompts_file} is not a file; give a text file, one prompt a line")
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines:
            raise ValueError(f"--prompts_file {args.prompts_file} is empty; give one prompt a line")
        prompts += lines
    return prompts or [""]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    try:
        sampling.check()
        if args.system is not None and not args.chat:
            raise ValueError("--system is a chat message; add --chat (or leave --system out)")
        if "" in args.stop:
            raise ValueError("--stop '' is empty, which would end every completion at once; give a non-empty string")
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        prompts = read_prompts(args)
        device = parse_device(args.device)
        cfg = load_model_config(args.config)
        tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
        model = load_model(args.config, args.checkpoint, device=str(device))
        if args.chat:
            prompt_ids = [chat_prompt(tokenizer, prompt, args.system) for prompt in prompts]
        else:
            prompt_ids = [tokenizer.encode(prompt, bos=True) for prompt in prompts]
        stop_ids = [] if args.no_stop_at_eos else [tokenizer.eos_id]
        engine = GenerationEngine(model, cache_budget_bytes=args.cache_budget_bytes, prefill_chunk=args.prefill_chunk)
        completions = engine.generate(prompt_ids, sampling, stop_token_ids=stop_ids, stop_strings=args.stop,
                                      decode=lambda ids: tokenizer.decode(_without_stop(ids, stop_ids)))
    except (ConfigError, CheckpointError, ChatTemplateError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        label = "" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
        if label:
            print(f"=== {label} ===")
        print(completion.text if args.chat else prompt + completion.text)
        new = len(_without_stop(completion.tokens, stop_ids))
        print(f"[{label + ': ' if label else ''}{new} new tokens]", file=sys.stderr)
        if args.logprobs:
            print(json.dumps({"prompt": i, "tokens": completion.tokens,
                              "pieces": [tokenizer.decode([t]) for t in completion.tokens],
                              "logprobs": completion.logprobs, "finish_reason": completion.finish_reason}),
                  file=sys.stderr)
    return 0


def _without_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    """``ids`` less the stop token that ended them (the engine keeps it; the text never shows it)."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


if __name__ == "__main__":
    sys.exit(main())
