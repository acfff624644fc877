"""What QK-clip costs: one training step (forward + backward) of the debug model on CPU with and without the
per-head max-logit measurement, and the clip after the step.

    python benchmarks/qk_clip_cost.py [--batch 2 --seq 2048 --repeats 5 --dtype float32]

Our attention kernels do not return their row maxima, so with optimizer.qk_clip_threshold > 0 every attention
layer recomputes q.k^T without gradients (models/shared/attention.py: note_max_logits). Every repeat runs both
cases once, in rotating order, so drift on a shared machine spreads evenly; the table shows medians and the
fastest run.
"""

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from torchtitan.components.optimizers.qk_clip import QKClip
from torchtitan.hardware import DTYPES, cpu_model, usable_cores
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.shared.decoder import Decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--output", default="benchmarks/results/qk_clip_cost.md")
    args = parser.parse_args()

    model_args = llama3_flavors[args.flavor].finalize(2048, args.seq)
    with torch.device("meta"):
        model = Decoder(model_args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.to(DTYPES[args.dtype])
    tokens = torch.randint(3, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    clip = QKClip(1e9, [model], torch.device("cpu"))  # measures every step, clips nothing
    attentions = [attention for _, attention, _, _ in clip.layers]
    maxima = [attention.logit_max for attention in attentions]

    def step(measure: bool) -> tuple[float, float]:
        for attention, into in zip(attentions, maxima):
            attention.logit_max = into if measure else None
        start = time.perf_counter()
        model(tokens).float().square().mean().backward()
        middle = time.perf_counter()
        if measure:
            clip.after_step()
        model.zero_grad(set_to_none=True)
        return middle - start, time.perf_counter() - middle

    cases = {"without QK-clip": False, "with QK-clip": True}
    times = {name: [] for name in cases}
    after = []
    step(True), step(False)  # warm-up
    for repeat in range(args.repeats):
        names = list(cases)[repeat % 2:] + list(cases)[:repeat % 2]
        for name in names:
            seconds, clip_seconds = step(cases[name])
            times[name].append(seconds)
            if cases[name]:
                after.append(clip_seconds)

    base = statistics.median(times["without QK-clip"])
    lines = [f"# QK-clip's cost: the {args.flavor} training step on CPU", "",
             (f"`python benchmarks/qk_clip_cost.py --batch {args.batch} --seq {args.seq} --repeats {args.repeats} "
             f"--dtype {args.dtype}`; {cpu_model() or platform.processor()}, {usable_cores()} usable cores, torch "
             f"{torch.__version__}; {model_args.n_layers} layers of {model_args.n_heads} heads of "
             f"{model_args.head_dim}."), "",
             "| case | forward + backward, median (s) | fastest (s) | vs without |", "|---|---|---|---|"]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.3f} | {min(values):.3f} | {median / base:.3f}x |")
    lines += ["", (f"The clip after the step (the max all-reduce is absent in one process, the row scaling "
                   f"of every layer): median {statistics.median(after) * 1e3:.2f} ms."), ""]
    text = "\n".join(lines)
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
