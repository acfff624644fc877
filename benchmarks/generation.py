"""Generation on CPU: the engine (torchtitan.generation.GenerationEngine) against the cache-free path it replaced
(generate_without_cache, one prompt at a time), in tokens/s at batch 1 and 16 on the six debug models; what the
engine's dropping of finished rows and torch.compile of the decode step give; and each family's cache bytes per
token per layer at its debug flavor and at its largest published one.

    python benchmarks/generation.py [--configs debug_model,qwen3_debug,...] [--new_tokens 256] [--prompt_len 32]
        [--batches 1,16] [--seq_len 512] [--repeats 3] [--threads 1] [--compile_configs debug_model]
        [--output benchmarks/results/generation_cpu.md]

Every run is greedy with no stop, so every row makes --new_tokens tokens; the weights are random (float32, from
debug.seed) and the prompts random ids. The old path runs a batch as one call per prompt, each call re-running the
whole context for every token. A figure is the fastest of --repeats runs (the machine may be shared; the fastest
run is the one least disturbed), except the old path at batch > 1: its calls run once each, one after another.
--threads 1 by default: on a 2-core machine shared with other jobs, two OpenMP threads wait on each other.
The results file ends with a reading of its figures written by hand; a rerun rewrites the file without it (copy it
back, updated to the new figures).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import Table, environment  # noqa: E402
from torchtitan.config import load_config  # noqa: E402
from torchtitan.generation import GenerationEngine, SamplingConfig, generate_without_cache  # noqa: E402
from torchtitan.generation.caches import KeyValueCache, LatentCache, RecurrentCache, cache_class  # noqa: E402
from torchtitan.inference import build_model  # noqa: E402
from torchtitan.planner import generation_cache_bytes, model_shape  # noqa: E402

CONFIGS = ["debug_model", "qwen3_debug", "qwen3_moe_debug", "deepseek_v3_debug", "gpt_oss_debug", "qwen3_next_debug"]
# Each family's largest published flavor, beside its debug one, for the cache sizes.
LARGEST = {"llama3": "405B", "qwen3": "32B", "qwen3_moe": "235B-A22B", "deepseek_v3": "671B", "gpt_oss": "120b",
           "qwen3_next": "80B-A3B"}
CACHE_LENGTHS = (4096, 32768, 131072)
STOP = "<stop>"


def load(config: str, seq_len: int, *flags: str):
    cfg, _ = load_config(["--job.config_file", f"train_configs/{config}.toml", "--training.seq_len", str(seq_len),
                          *flags])
    return cfg


def fastest(run, repeats: int):
    """(the fastest of ``repeats`` runs in seconds, the last run's result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def random_prompts(vocab: int, rows: int, length: int) -> list[list[int]]:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0)).tolist()


def cell(seconds: float, tokens: int) -> str:
    return f"{seconds:.2f} ({tokens / seconds:,.0f})"


def throughput(table: Table, name: str, model, prompts, sampling, batches, repeats) -> dict[int, list]:
    """One table row per batch size; returns the engine's tokens per batch size (the later sections reuse them)."""
    engine = GenerationEngine(model)
    warm = SamplingConfig(max_new_tokens=4, temperature=0)
    engine.generate(prompts[:2], warm)
    generate_without_cache(model, prompts[0], warm, max_context=model.args.max_seq_len)
    made = {}
    for batch in batches:
        rows = prompts[:batch]
        tokens = batch * sampling.max_new_tokens
        new_seconds, done = fastest(lambda rows=rows: engine.generate(rows, sampling), repeats)
        made[batch] = [c.tokens for c in done]

        def old_path(rows=rows):
            return [generate_without_cache(model, p, sampling, max_context=model.args.max_seq_len) for p in rows]

        old_seconds, old = fastest(old_path, repeats if batch == 1 else 1)
        same = sum(a == b for a, b in zip(old, made[batch]))
        table.add(f"| {name} | {batch} | {cell(old_seconds, tokens)} | {cell(new_seconds, tokens)} | "
                  f"{old_seconds / new_seconds:.1f}x | {same} of {batch} |")
    return made


def early_finish(table: Table, name: str, model, prompts, reference, sampling, stop_after, repeats) -> None:
    """Half the rows of the batch stop after ``stop_after`` tokens: a stop string that a stub decode function shows
    once a row's first tokens are those it made without a stop (greedy: it makes them again)."""
    engine = GenerationEngine(model)
    stopping = {tuple(reference[r][:stop_after]) for r in range(0, len(prompts), 2)}
    going = [r for r in range(len(prompts)) if tuple(reference[r][:stop_after]) not in stopping]

    def decoder(prefixes):
        def decode(tokens):
            return STOP if len(tokens) >= stop_after and tuple(tokens[:stop_after]) in prefixes else ""
        return decode

    runs = {f"{len(prompts)} rows, none stops": (prompts, decoder(set())),
            f"{len(prompts)} rows, {len(prompts) - len(going)} stop after {stop_after}": (prompts, decoder(stopping)),
            f"the {len(going)} rows that do not stop, alone": ([prompts[r] for r in going], decoder(set()))}
    best = {label: (float("inf"), None) for label in runs}
    for _ in range(repeats):  # interleaved, so that a disturbance hits every run alike
        for label, (rows, decode) in runs.items():
            start = time.perf_counter()
            done = engine.generate(rows, sampling, stop_strings=[STOP], decode=decode)
            best[label] = min(best[label][0], time.perf_counter() - start), done
    baseline = next(iter(best.values()))[0]
    for label, (seconds, done) in best.items():
        tokens = sum(len(c.tokens) for c in done)
        stopped = sum(c.finish_reason == "stop" for c in done)
        table.add(f"| {name} | {label} | {tokens:,} | {stopped} | {seconds:.2f} | {seconds / baseline:.0%} | "
                  f"{tokens / seconds:,.0f} |")


def compile_variants(table: Table, name: str, cfg, model, prompts, reference, sampling, batches, repeats) -> None:
    """Eager against two ways of compiling the decode step: the model's run_blocks as a whole (the caches' Python
    runs inside it), and each block's feed-forward or MoE alone (the part no cache touches)."""
    import torch._dynamo
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    def whole(m):
        m.run_blocks = torch.compile(m.run_blocks, dynamic=True)

    def feed_forwards(m):
        for block in m.main_layers():
            (block.moe if block.moe_enabled else block.feed_forward).compile(dynamic=True)

    engine = GenerationEngine(model)
    eager = {b: fastest(lambda b=b: engine.generate(prompts[:b], sampling), repeats)[0] for b in batches}
    table.add(f"| {name} | eager | - | - | " + " | ".join(cell(eager[b], b * sampling.max_new_tokens)
                                                       for b in batches) + " | yes |")
    for label, apply in (("run_blocks, dynamic=True", whole), ("each block's feed-forward / MoE, dynamic=True",
                                                               feed_forwards)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled, _ = build_model(cfg)  # the same weights (debug.seed), without the other variant's compilation
        compiled.eval()
        apply(compiled)
        engine = GenerationEngine(compiled)
        first = {}
        # A cold inductor cache: a compile time from earlier runs' cached kernels would be no compile time at all.
        with tempfile.TemporaryDirectory() as cold, temporary_cache_dir(cold):
            for b in batches:  # the first run compiles (a graph per new shape; guards may recompile later steps)
                start = time.perf_counter()
                engine.generate(prompts[:b], sampling)
                first[b] = time.perf_counter() - start
            timed = {b: fastest(lambda b=b, e=engine: e.generate(prompts[:b], sampling), repeats) for b in batches}
        same = all([c.tokens for c in timed[b][1]] == reference[b] for b in batches)
        stats = torch._dynamo.utils.counters["stats"]
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        compile_seconds = sum(first[b] - timed[b][0] for b in batches)
        table.add(f"| {name} | {label} | {compile_seconds:.0f} | {stats['unique_graphs']} graphs, {breaks} breaks | "
                  + " | ".join(f"{cell(timed[b][0], b * sampling.max_new_tokens)}, {eager[b] / timed[b][0]:.2f}x "
                               "eager's" for b in batches)
                  + f" | {'yes' if same else 'no'} |")


def kind_rows(table: Table, family: str, flavor: str, shape, dtype: torch.dtype) -> None:
    """One row per kind of layer cache of a flavor: its bytes per row per layer, and what it saves."""
    item = dtype.itemsize
    groups: dict[tuple, list] = {}
    for mixer in shape.mixers:
        cache = cache_class(mixer)
        groups.setdefault((cache, getattr(mixer, "window", None)), []).append(mixer)
    for (cache, window), layers in groups.items():
        m = layers[0]
        if cache is KeyValueCache:
            kv = m.wk.weight.shape[0] // m.head_dim
            per_token = cache.bytes_per_row(m, 1, dtype)
            kind = f"attention, {kv} KV heads x {m.head_dim}"
            if window is None:
                size, instead = f"{per_token:,} per token", ""
            else:
                kind = f"sliding-window {kind}"
                size = f"{cache.bytes_per_row(m, window, dtype):,} in all (a {window}-slot ring)"
                instead = (f"a full layer: {per_token:,} per token, {per_token * CACHE_LENGTHS[-1] / 2**20:,.0f} MiB "
                           f"at {CACHE_LENGTHS[-1]:,} tokens")
        elif cache is LatentCache:
            per_token = cache.bytes_per_row(m, 1, dtype)
            kind = f"MLA latent ({m.kv_lora_rank} + rope {m.rope_dim})"
            size = f"{per_token:,} per token"
            expanded = m.n_heads * (m.nope_dim + m.rope_dim + m.v_dim) * item
            instead = (f"expanded heads, {m.n_heads} x ({m.nope_dim} + {m.rope_dim} + {m.v_dim}): {expanded:,} per "
                       f"token ({expanded / per_token:.0f}x)")
        elif cache is RecurrentCache:
            state = cache.bytes_per_row(m, 1, dtype)
            kind = "Gated DeltaNet state (float32) and conv taps"
            size = f"{state:,} in all, at any length"
            attention = [x for x in shape.mixers if cache_class(x) is KeyValueCache]
            if attention:
                per_token = KeyValueCache.bytes_per_row(attention[0], 1, dtype)
                instead = (f"a full-attention layer of the model ({per_token:,} per token) holds as much at "
                           f"{state / per_token:,.0f} tokens")
            else:
                instead = ""
        else:
            kind, size, instead = cache.__name__, f"{cache.bytes_per_row(m, 1, dtype):,} at 1 token", ""
        table.add(f"| {family} | {flavor} | {len(layers)} x {kind} | {size} | {instead} |")


def uncompressed_bytes_per_token(shape, dtype: torch.dtype) -> int:
    """Bytes per token per row if every layer cached what full attention does: a sliding layer all its keys, MLA
    its expanded heads, a Gated DeltaNet layer the keys and values of the model's full-attention layers."""
    attention = [m for m in shape.mixers if cache_class(m) is KeyValueCache and getattr(m, "window", None) is None]
    total = 0
    for m in shape.mixers:
        if cache_class(m) is LatentCache:
            total += m.n_heads * (m.nope_dim + m.rope_dim + m.v_dim) * dtype.itemsize
        elif cache_class(m) is KeyValueCache:
            total += 2 * m.wk.weight.shape[0] * dtype.itemsize
        else:
            total += KeyValueCache.bytes_per_row(attention[0], 1, dtype)
    return total


def cache_sizes(table: Table, config: str, seq_len: int, dtype: torch.dtype) -> None:
    cfg = load(config, seq_len)
    for flavor in (cfg.model.flavor, LARGEST[cfg.model.name]):
        shape = model_shape(load(config, seq_len, "--model.flavor", flavor))
        kind_rows(table, cfg.model.name, flavor, shape, dtype)
        totals = [generation_cache_bytes(shape, 1, n, dtype) for n in CACHE_LENGTHS]
        plain = [uncompressed_bytes_per_token(shape, dtype) * n for n in CACHE_LENGTHS]
        kinds = {cache_class(m) for m in shape.mixers}
        label = ("the expanded heads" if LatentCache in kinds else "the Gated DeltaNet layers as full attention"
                 if RecurrentCache in kinds else "the sliding layers full")
        instead = "" if plain == totals else f"{label}: " + ", ".join(f"{p / 2**20:,.1f} MiB" for p in plain)
        table.add(f"| {cfg.model.name} | {flavor} | one row, all {len(shape.mixers)} layers | "
                  + ", ".join(f"{t / 2**20:,.1f} MiB at {n:,}" for t, n in zip(totals, CACHE_LENGTHS))
                  + f" | {instead} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="train_configs/<name>.toml, comma-separated")
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--seq_len", type=int, default=512, help="training.seq_len: the models' max_seq_len")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop_after", type=int, default=32, help="tokens the rows that finish early make")
    parser.add_argument("--compile_configs", default="debug_model", help="the configs the compile section runs")
    parser.add_argument("--output", default="benchmarks/results/generation_cpu.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0)
    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table = Table([(f"# Generation on CPU: the engine against the cache-free path ({environment()}; load average "
                    f"{load_average} at the start)"), "",
                   (f"Debug models, float32, random weights, greedy, no stop: every row makes {args.new_tokens} new "
                    f"tokens after a {args.prompt_len}-token prompt (max_seq_len {args.seq_len}). Seconds (tokens/s), "
                    f"the fastest of {args.repeats} runs; the old path at batch > 1 is one call per prompt, run once "
                    "each. `same tokens`: rows whose tokens the two paths agree on."), "",
                   "| model | batch | old path: s (tokens/s) | engine: s (tokens/s) | engine speed-up | same tokens |",
                   "|---|---|---|---|---|---|"], Path(args.output))
    cfgs, models, made = {}, {}, {}
    for config in configs:
        cfgs[config] = load(config, args.seq_len)
        model, _ = build_model(cfgs[config])
        model.eval()
        models[config] = model
        prompts = random_prompts(model.args.vocab_size, max(batches), args.prompt_len)
        made[config] = throughput(table, config, model, prompts, sampling, batches, args.repeats)

    big = max(batches)
    table.add("")
    table.add(f"## Rows that finish early leave the batch (batch {big}, {args.new_tokens} new tokens at most)")
    table.add("")
    table.add(f"Every other row stops after {args.stop_after} tokens (a stop string that a stub decode function shows "
              "once a row has made the tokens it made in the run above). Its caches are compacted away, so the run "
              "should cost about what the rows that go on cost alone, plus the first steps at the full batch.")
    table.add("")
    table.add("| model | run | tokens made | rows stopped | s | s against none stopping | tokens/s |")
    table.add("|---|---|---|---|---|---|---|")
    for config in configs:
        model = models[config]
        prompts = random_prompts(model.args.vocab_size, big, args.prompt_len)
        early_finish(table, config, model, prompts, made[config][big], sampling, args.stop_after, args.repeats)

    table.add("")
    table.add("## torch.compile of the decode step")
    table.add("")
    table.add("Compile s: the first run of each batch size less its fastest run, from a cold inductor cache. Seconds "
              "(tokens/s) as above; dynamo: the graphs it compiled and its graph breaks (8 graphs is its recompile "
              "limit, past which a frame whose guards fail runs eagerly).")
    table.add("")
    table.add("| model | compiled | compile s | dynamo | " + " | ".join(f"batch {b}: s (tokens/s)" for b in batches)
              + " | same tokens |")
    table.add("|---|---|---|---|" + "---|" * len(batches) + "---|")
    for config in filter(None, args.compile_configs.split(",")):
        model = models[config]
        prompts = random_prompts(model.args.vocab_size, big, args.prompt_len)
        compile_variants(table, config, cfgs[config], model, prompts, made[config], sampling, batches, args.repeats)

    table.add("")
    table.add("## Cache bytes per row per layer, bfloat16 (each layer's bytes_per_row; meta-device models)")
    table.add("")
    table.add("| family | flavor | layers | bytes per row per layer | compared with |")
    table.add("|---|---|---|---|---|")
    for config in configs:
        cache_sizes(table, config, args.seq_len, torch.bfloat16)


if __name__ == "__main__":
    main()
