"""The generation engine on tensor- and expert-parallel models (generation/sharded.py) against the same models in
one process.

Started as ``torchrun --nproc_per_node 2 -m tests.integration.generation_shard_worker OUT``. For each case every
rank builds the sharded model and, beside it, the plain one of inference.build_model (seeded_init gives both the
single process's weights), generates the same prompts with each, and writes ``OUT/rank{R}.json``: per case and
check, the sharded engine's tokens, the tokens the plain model gives, and the largest log-probability difference;
and the bytes each engine's caches would take for the same rows.

- greedy: a stop token that ends some rows early (their caches are compacted away) and a prefill in odd chunks;
  expected: the plain model's greedy tokens, cut after the stop token.
- sampled: temperature and top-p; each rank samples with its own seed (7 + rank), so only the broadcast of rank 0's
  choices keeps the ranks together; expected: the plain model's with seed 7.
- loaded_whole / loaded_dtensor: load_weights from the state of a plain model initialised from seed 2 (whole
  tensors), then from a sharded one of seed 3 (DTensors); expected: a fresh engine on a plain model of that seed.
- loaded_hf: inference.load_checkpoint from a Hugging Face folder of a plain model of seed 4 (every rank reads the
  whole files and keeps its slices, as scripts/generate.py loads one under torchrun); expected: that plain model's.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.config_check import load_model_config
from torchtitan.generation import GenerationEngine, SamplingConfig
from torchtitan.generation.sharded import build_sharded_model
from torchtitan.inference import build_model, load_checkpoint
from torchtitan.protocols.train_spec import get_train_spec

CASES = {
    "llama3_tp2": ("train_configs/debug_model.toml", ["--parallelism.tensor_parallel_degree", "2"]),
    "qwen3_moe_ep2": ("train_configs/qwen3_moe_debug.toml", ["--parallelism.expert_parallel_degree", "2"]),
}
PROMPT_LENGTHS = (5, 12, 19, 30)
NEW_TOKENS = 32
GREEDY = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0)


def sampled(seed: int) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=seed)


def plain(config: str, seed: int) -> GenerationEngine:
    model, _ = build_model(load_model_config(config, ["--debug.seed", str(seed)]), mtp=False)
    return GenerationEngine(model.eval())


def record(done, expected) -> dict:
    return {"sharded": [c.tokens for c in done], "reference": [c.tokens for c in expected],
            "finish": [c.finish_reason for c in done],
            "logprob_diff": max(abs(a - b) for c, e in zip(done, expected) for a, b in zip(c.logprobs, e.logprobs))}


def cut_after(completion, stop: int):
    """The greedy completion as a run with ``stop`` as stop token would end it."""
    if stop in completion.tokens:
        end = completion.tokens.index(stop) + 1
        completion.tokens, completion.logprobs = completion.tokens[:end], completion.logprobs[:end]
        completion.finish_reason = "stop"
    return completion


def hf_folder(config: str, seed: int, folder: Path) -> str:
    """``folder``, holding a plain model of ``seed`` in Hugging Face form."""
    cfg = load_model_config(config, ["--debug.seed", str(seed)])
    model, spec = build_model(cfg, mtp=False)
    write_hf_folder(folder, model.state_dict(), spec.state_dict_adapter(model.args),
                    spec.build_tokenizer_fn(cfg.model.hf_assets_path), cfg.model.hf_assets_path, "float32")
    return str(folder)


def run_case(config: str, flags: list[str], prompts: list[list[int]], scratch: Path) -> dict:
    cfg = load_model_config(config, flags)
    engine = GenerationEngine(build_sharded_model(cfg), prefill_chunk=7)
    rank = dist.get_rank()  # the process group is joined by build_sharded_model
    reference = plain(config, 0)
    # What a rank's caches take: its own key/value heads only, under tensor parallelism.
    out = {"cache_bytes": {"sharded": engine.cache_bytes(4, 64), "plain": reference.cache_bytes(4, 64)}}
    expected = reference.generate(prompts, GREEDY)
    stop = expected[1].tokens[NEW_TOKENS // 3]
    expected = [cut_after(c, stop) for c in expected]
    out["greedy"] = record(engine.generate(prompts, GREEDY, stop_token_ids=[stop]), expected)
    out["sampled"] = record(engine.generate(prompts, sampled(7 + rank)), reference.generate(prompts, sampled(7)))
    engine.load_weights(plain(config, 2).model.state_dict())
    out["loaded_whole"] = record(engine.generate(prompts, GREEDY), plain(config, 2).generate(prompts, GREEDY))
    other = build_sharded_model(load_model_config(config, [*flags, "--debug.seed", "3"]))
    engine.load_weights(other.state_dict())
    out["loaded_dtensor"] = record(engine.generate(prompts, GREEDY), plain(config, 3).generate(prompts, GREEDY))
    load_checkpoint(engine.model, get_train_spec(cfg.model.name), cfg, hf_folder(config, 4, scratch / f"hf{rank}"))
    out["loaded_hf"] = record(engine.generate(prompts, GREEDY), plain(config, 4).generate(prompts, GREEDY))
    return out


def main(out: Path) -> int:
    results = {}
    for name, (config, flags) in CASES.items():
        generator = torch.Generator().manual_seed(len(name))
        prompts = [torch.randint(1, 2000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        results[name] = run_case(config, flags, prompts, out / name)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
