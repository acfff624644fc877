"""µP against the standard parametrization (SP): the coordinate check and learning-rate transfer.

    python benchmarks/mup.py [--steps 200] [--output benchmarks/results/mup_cpu.md]

The models are the Llama 3 decoder (2 blocks, 4 heads, so the head size grows with the width) built, initialised
and optimised by the trainer's own code (Decoder, init_weights, build_optimizer, the µP lr multipliers, the lr
schedule); only the loop is plain. Data: the embedded pydocs corpus, the same batches for every run.

- Coordinate check: the mean absolute value of every layer's output (embedding, each block's attention,
  feed-forward and residual stream, the logits) on a fixed batch after 5 AdamW steps at a constant lr, for widths
  64 to 512. Under µP (base width 64) it should stay within a factor of 2; under SP it grows with the width.
- Transfer: the training loss (mean of the last 10 steps) after ``--steps`` AdamW steps for 5 learning rates at
  widths 128 (the base) and 512; under µP the best lr at 128 should be the best, or next to it, at 512.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.components.optimizers.lr_scheduler import build_lr_scheduler  # noqa: E402
from torchtitan.components.optimizers.mup import apply_lr_multipliers, lr_multipliers  # noqa: E402
from torchtitan.components.optimizers.optimizer import build_optimizer  # noqa: E402
from torchtitan.config.job_config import LRScheduler, Optimizer  # noqa: E402
from torchtitan.data import build_tokenizer  # noqa: E402
from torchtitan.data.pydocs import load_pydocs_documents  # noqa: E402
from torchtitan.hardware import cpu_model  # noqa: E402
from torchtitan.models.llama3.args import Llama3ModelArgs  # noqa: E402
from torchtitan.models.shared.decoder import Decoder  # noqa: E402

SEQ_LEN, BATCH, HEAD_COUNT = 128, 8, 4


def build(width: int, base_width: int | None, vocab: int, seed: int = 0) -> Decoder:
    """The 2-block Llama 3 of ``width``; µP relative to ``base_width`` (its head size: base_width / 4) or SP."""
    args = Llama3ModelArgs(dim=width, n_layers=2, n_heads=HEAD_COUNT, multiple_of=32).finalize(vocab, SEQ_LEN)
    if base_width is not None:
        args = args.with_mup(base_width, base_width // HEAD_COUNT)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def optimizer_for(model: Decoder, lr: float, steps: int, warmup: int):
    cfg = Optimizer(name="AdamW", lr=lr, weight_decay=0.0, implementation="foreach")
    optimizer = build_optimizer([model], cfg)
    if model.args.mup is not None:
        apply_lr_multipliers(optimizer, lr_multipliers([model], model.args.mup, model.args.dim, cfg))
    schedule = LRScheduler(warmup_steps=warmup, decay_ratio=0.8 if warmup else 0.0, decay_type="linear",
                           min_lr_factor=0.1)
    return optimizer, build_lr_scheduler(optimizer, schedule, steps)


def token_stream(n_tokens: int) -> tuple[torch.Tensor, int]:
    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    ids: list[int] = []
    for doc in load_pydocs_documents("train"):
        ids += tokenizer.encode(doc, bos=True, eos=True)
        if len(ids) >= n_tokens:
            break
    return torch.tensor(ids[:n_tokens]), tokenizer.vocab_size


def batch(stream: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of the stream: consecutive windows of SEQ_LEN + 1 tokens, inputs and next-token labels."""
    span = BATCH * (SEQ_LEN + 1)
    start = (step * span) % (len(stream) - span)
    rows = stream[start:start + span].view(BATCH, SEQ_LEN + 1)
    return rows[:, :-1], rows[:, 1:]


def train_step(model: Decoder, optimizer, scheduler, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def layer_outputs(model: Decoder, tokens: torch.Tensor) -> dict[str, float]:
    """Mean |output| of the embedding, each block's attention, feed-forward and residual stream, and the logits."""
    names = ["tok_embeddings"] + [f"layers.{i}.{part}" for i in range(model.args.n_layers)
                                  for part in ("attention", "feed_forward", "")] + ["logits"]
    modules = dict(model.named_modules())
    found: dict[str, float] = {}
    hooks = [modules[name.rstrip(".")].register_forward_hook(
        lambda _m, _i, out, name=name: found.__setitem__(name.rstrip(".") or name, out.abs().mean().item()))
        for name in names[:-1]]
    with torch.no_grad():
        found["logits"] = model(tokens).abs().mean().item()
    for hook in hooks:
        hook.remove()
    return found


def coordinate_check(widths: list[int], base_width: int | None, stream: torch.Tensor, vocab: int,
                     steps: int = 5, lr: float = 1e-2, seeds: int = 2) -> dict[int, dict[str, float]]:
    """Per width, each layer's mean |output| on batch 0 after ``steps`` steps at constant ``lr`` (seed mean)."""
    table = {}
    for width in widths:
        runs = []
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = build(width, base_width, vocab, seed)
            optimizer, scheduler = optimizer_for(model, lr, steps, warmup=0)
            for step in range(steps):
                train_step(model, optimizer, scheduler, *batch(stream, step + 1))
            runs.append(layer_outputs(model, batch(stream, 0)[0]))
        table[width] = {name: statistics.mean(run[name] for run in runs) for name in runs[0]}
    return table


def final_loss(width: int, base_width: int | None, lr: float, steps: int, stream: torch.Tensor, vocab: int) -> float:
    torch.manual_seed(0)
    model = build(width, base_width, vocab)
    optimizer, scheduler = optimizer_for(model, lr, steps, warmup=steps // 10)
    losses = [train_step(model, optimizer, scheduler, *batch(stream, step)) for step in range(steps)]
    return statistics.mean(losses[-10:])


def coordinate_table(title: str, table: dict[int, dict[str, float]]) -> list[str]:
    widths = sorted(table)
    layers = list(table[widths[0]])
    lines = [f"### {title}", "", "| layer | " + " | ".join(f"width {w}" for w in widths) + " | largest / smallest |",
             "|---|" + "---:|" * (len(widths) + 1)]
    for layer in layers:
        values = [table[w][layer] for w in widths]
        lines.append(f"| {layer} | " + " | ".join(f"{v:.3g}" for v in values) + f" | {max(values) / min(values):.2f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of each transfer run")
    parser.add_argument("--lrs", default="0.00125,0.0025,0.005,0.01,0.02", help="the learning rates swept")
    parser.add_argument("--widths", default="128,512", help="the transfer's base width, then the wider one")
    parser.add_argument("--output", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    torch.manual_seed(0)
    lrs = [float(x) for x in args.lrs.split(",")]
    small, large = (int(w) for w in args.widths.split(","))
    stream, vocab = token_stream((args.steps + 10) * BATCH * (SEQ_LEN + 1))
    started = time.perf_counter()

    lines = ["# µP: coordinate check and learning-rate transfer (CPU)", "",
             f"`python benchmarks/mup.py --steps {args.steps}` on {cpu_model()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads. Llama 3 decoder, 2 blocks, {HEAD_COUNT} heads (the head size "
             f"grows with the width), fp32, AdamW (betas 0.9/0.95, no weight decay), batch {BATCH} x {SEQ_LEN} "
             "tokens of pydocs.", "",
             "## Coordinate check", "",
             "Mean |output| of each layer on a fixed batch after 5 steps at a constant lr of 0.01, mean of 2 seeds. "
             "µP relative to width 64 (head size 16).", ""]
    widths = [64, 128, 256, 512]
    mup = coordinate_check(widths, 64, stream, vocab)
    sp = coordinate_check(widths, None, stream, vocab)
    lines += coordinate_table("µP", mup) + coordinate_table("Standard parametrization", sp)
    print("\n".join(lines))

    lines += ["## Learning-rate transfer", "",
              f"Training loss (mean of the last 10 of {args.steps} steps; warm-up {args.steps // 10} steps, then "
              f"linear decay to 0.1 x over the last 80 %). µP relative to width {small}. Best of each row in bold.", ""]
    for title, base in (("µP", small), ("Standard parametrization", None)):
        lines += [f"### {title}", "", "| width | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |",
                  "|---|" + "---:|" * (len(lrs) + 1)]
        for width in (small, large):
            losses = [final_loss(width, base, lr, args.steps, stream, vocab) for lr in lrs]
            best = min(range(len(lrs)), key=losses.__getitem__)
            cells = [f"**{x:.4f}**" if i == best else f"{x:.4f}" for i, x in enumerate(losses)]
            lines.append(f"| {width} | " + " | ".join(cells) + f" | {lrs[best]:g} |")
            print(lines[-1], flush=True)
        lines.append("")
    lines.append(f"Total time: {time.perf_counter() - started:.0f} s.")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        args.output.write_text(report)


if __name__ == "__main__":
    main()
