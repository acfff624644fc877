r"""Sample text from a checkpoint with the config's tokenizer, through the generation engine (torchtitan/generation/).

    python scripts/generate.py --config train_configs/debug_model.toml \
        --checkpoint outputs/checkpoint/step-10 --prompt "def main():" --max_new_tokens 40

    python scripts/generate.py --config train_configs/debug_model.toml --checkpoint outputs/checkpoint/step-10 \
        --prompt "import os" --prompt "class Stack:" --stop $'\n\n' --temperature 0 --logprobs

    python scripts/generate.py --config train_configs/sft_debug.toml \
        --checkpoint outputs/sft/checkpoint/step-100 --chat --prompt "What does \`json.dumps(obj)\` do?"

    python scripts/generate.py --config train_configs/vlm_debug.toml --checkpoint outputs/vlm/checkpoint/step-600 \
        --chat --image picture.png --prompt "What colour are the shapes?" --temperature 0

Prints the prompt followed by the generated text on stdout. Several prompts (--prompt repeated, then the lines of
--prompts_file, one prompt per line) run as one batch; each completion is printed in their order after a line
``=== prompt I of N ===``. With --chat each prompt is a user message, rendered with the tokenizer's chat template (as
in fine-tuning, data/chat_template.py) up to where the assistant answers, and only the answer is printed. --image
(repeatable; a vision-language model, with --chat) shows the pictures at the start of every prompt's message,
prepared as the config's training.chat image settings say (data/image_chat.py).

A completion ends at the end-of-text token, which is not printed (--no_stop_at_eos generates past it), at a --stop
string (the text is cut before it), at --max_new_tokens, or where prompt plus new tokens reach the model's
max_seq_len (training.seq_len; a prompt that long is refused). --temperature 0 is greedy decoding: the same text
every run, and the same for a prompt alone or in a batch; otherwise tokens are sampled after top-k and top-p
filtering, reproducibly for a given --seed, device and batch of prompts.

--logprobs writes one JSON line per completion to stderr: {"prompt": I (from 0), "tokens": [every chosen id, the
end-of-text token that stopped it included], "pieces": [each token's text], "logprobs": [...], "finish_reason":
"stop" | "length"}. Greedy tokens' log-probabilities are under the model's distribution, sampled ones under the
distribution they were drawn from (after temperature, top-k and top-p; torchtitan/generation/sampling.py).

A model too big for one device generates tensor and expert parallel under torchrun, on W = --tp x --ep processes:

    torchrun --nproc_per_node 2 scripts/generate.py --config outputs/config.toml \
        --checkpoint outputs/checkpoint/step-10 --prompt "def main():" --temperature 0 --tp 2

The layout is --tp and --ep alone (default 1 each; they set parallelism.tensor_parallel_degree and
expert_parallel_degree, the names errors give): the config's [parallelism] section, the training run's layout, is
not read. Each rank runs on cuda:LOCAL_RANK (the CPU without CUDA; --device is refused), builds its shards as
the trainer does (torchtitan/generation/sharded.py) and loads them: from a DCP step folder only its own slices;
from a Hugging Face folder it reads the whole files and keeps its slices. A LoRA run's step checkpoint loads as
in one process (its frozen base from the config's checkpoint.initial_load_path). Every rank reads the same
prompts and generates the same tokens (rank 0's choices are broadcast); only rank 0 prints, and an error is one
line from rank 0, exit 2 on every rank. Greedy text equals the single process's up to last-bit differences of the
sharded sums (which can flip a near-tie).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.data import DataError
from torchtitan.data.chat_template import ChatTemplate, ChatTemplateError, assistant_token_mask
from torchtitan.data.image_chat import ImageChat
from torchtitan.device_arg import default_device, parse_device
from torchtitan.distributed import device as device_lib
from torchtitan.generation import GenerationEngine, SamplingConfig
from torchtitan.generation.sharded import build_sharded_model
from torchtitan.inference import load_checkpoint, load_model
from torchtitan.models.shared.vision_language import image_chat
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
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda if available); under torchrun, cuda:LOCAL_RANK")
    parser.add_argument("--tp", type=integer(1), default=1,
                        help="tensor-parallel degree, under torchrun with --tp x --ep processes (default 1)")
    parser.add_argument("--ep", type=integer(1), default=1,
                        help="expert-parallel degree of a MoE model, under torchrun with --tp x --ep processes "
                             "(default 1)")
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
    parser.add_argument("--image", action="append", default=[],
                        help="with --chat, a vision-language model: a picture shown before each prompt (repeatable)")
    return parser.parse_args(argv)


def chat_prompt(tokenizer, question: str, system: str | None = None, images: list[str] = (),
                reader: ImageChat | None = None, seq_len: int = 0) -> tuple[list[int], list]:
    """Token ids of a conversation of one user message (after an optional system one), rendered with the
    tokenizer's chat template and its generation prompt: where the assistant's answer begins; with ``images``
    (files, read by ``reader``) shown first in the message, those ids expanded and the images' patches."""
    if tokenizer.chat_template is None:
        raise ValueError("--chat needs a tokenizer with a chat_template (in its tokenizer_config.json)")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    template = ChatTemplate(tokenizer.chat_template)
    if images:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        return reader.prompt(tokenizer, template, [*messages, {"role": "user", "content": content}], list(images),
                             seq_len)
    messages.append({"role": "user", "content": question})
    ids, _ = assistant_token_mask(tokenizer, template, messages, add_generation_prompt=True)
    return ids, []


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


def check_layout(args: argparse.Namespace, world_size: int) -> bool:
    """Whether this run is sharded (several processes, or --tp/--ep above 1); ValueError when --tp x --ep is not
    the number of processes torchrun started, or --device is given to a sharded run."""
    ranks = args.tp * args.ep
    if ranks != world_size:
        launched = (f"torchrun started {world_size} processes (WORLD_SIZE)" if device_lib.launched_distributed()
                    else "this is one process, not started by torchrun")
        raise ValueError(f"--tp {args.tp} x --ep {args.ep} = {ranks}, but {launched}: they must be equal; launch "
                         f"torchrun --nproc_per_node {ranks}, or set --tp and --ep to multiply to {world_size}")
    if ranks > 1 and args.device is not None:
        raise ValueError(f"--device {args.device} is invalid under torchrun: each rank runs on cuda:LOCAL_RANK (the "
                         "CPU where there is no CUDA, e.g. CUDA_VISIBLE_DEVICES=''); leave --device out")
    return ranks > 1


def layout_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of a sharded run: generation's layout replaces the training run's, since every rank
    runs the same batch (generation/sharded.py)."""
    layout = {"tensor_parallel_degree": args.tp, "expert_parallel_degree": args.ep, "pipeline_parallel_degree": 1,
              "context_parallel_degree": 1, "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1}
    return [flag for key, value in layout.items() for flag in (f"--parallelism.{key}", str(value))]


def sharded_model(cfg, checkpoint: str | None):
    """The config's model over this torchrun world (the process group is joined here, after the layout checks),
    with the checkpoint's weights."""
    model = build_sharded_model(cfg)
    if checkpoint is not None:
        load_checkpoint(model, get_train_spec(cfg.model.name), cfg, checkpoint)
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    # Every rank reads the same command line and files and meets the same errors: rank 0 says them.
    rank = int(os.environ.get("RANK", "0")) if device_lib.launched_distributed() else 0
    try:
        sampling.check()
        if args.system is not None and not args.chat:
            raise ValueError("--system is a chat message; add --chat (or leave --system out)")
        if args.image and not args.chat:
            raise ValueError("--image shows pictures in a chat message; add --chat (or leave --image out)")
        if "" in args.stop:
            raise ValueError("--stop '' is empty, which would end every completion at once; give a non-empty string")
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        sharded = check_layout(args, device_lib.world_size())
        prompts = read_prompts(args)
        device = None if sharded else parse_device(args.device or default_device())
        cfg = load_model_config(args.config, layout_overrides(args) if sharded else ())
        tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
        model = (sharded_model(cfg, args.checkpoint) if sharded
                 else load_model(args.config, args.checkpoint, device=str(device)))
        reader = image_chat(model.args, cfg.training.chat)
        if args.image and reader is None:
            raise ValueError(f"--image needs a vision-language model; model.name {cfg.model.name!r} reads no images")
        images = None
        if args.chat:
            prompted = [chat_prompt(tokenizer, prompt, args.system, args.image, reader, cfg.training.seq_len)
                        for prompt in prompts]
            prompt_ids, images = [ids for ids, _ in prompted], [shown for _, shown in prompted]
        else:
            prompt_ids = [tokenizer.encode(prompt, bos=True) for prompt in prompts]
        stop_ids = [] if args.no_stop_at_eos else [tokenizer.eos_id]
        engine = GenerationEngine(model, cache_budget_bytes=args.cache_budget_bytes, prefill_chunk=args.prefill_chunk)
        completions = engine.generate(prompt_ids, sampling, stop_token_ids=stop_ids, stop_strings=args.stop,
                                      decode=lambda ids: tokenizer.decode(_without_stop(ids, stop_ids)),
                                      images=images if args.image else None)
    except (ConfigError, CheckpointError, ChatTemplateError, DataError, ValueError, RuntimeError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        report(args, prompts, completions, tokenizer, stop_ids)
    return 0


def report(args: argparse.Namespace, prompts: list[str], completions, tokenizer, stop_ids: list[int]) -> None:
    """Each completion on stdout, its count of new tokens (and with --logprobs its JSON line) on stderr."""
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


def _without_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    """``ids`` less the stop token that ended them (the engine keeps it; the text never shows it)."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


if __name__ == "__main__":
    sys.exit(main())
