"""flash-linear-attention's Gated DeltaNet kernel (the ``fla`` extra) against the chunked PyTorch form on one GPU:
how far apart their outputs, final states and gradients are, and the forward + backward time of each, at one
Qwen3-Next linear-attention layer's shape (32 value heads, keys and values of 128) with packed documents and an
incoming state.

    python benchmarks/gated_delta_rule.py [--seq_len 8192] [--batch 1] [--heads 32] [--json PATH]

Parity is taken with float32 inputs: for each tensor the largest difference over the chunked form's largest
magnitude, which must stay within --tolerance (exit 1 otherwise; fla's Triton dots may round through TF32). The
times use what a Gated DeltaNet layer passes in bf16 training (q, k, g, beta in float32, v in bfloat16): median of
--repeats after two warm-up calls (the first call of fla autotunes its kernels). Needs a CUDA GPU and fla.
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

from report import append_json, environment  # noqa: E402

from torchtitan.models.shared import gated_deltanet  # noqa: E402
from torchtitan.models.shared.gated_delta_rule import gated_delta_rule  # noqa: E402

GRADIENTS = ("q", "k", "v", "g", "beta")


def layer_inputs(batch: int, length: int, heads: int, dim: int, value_dtype: torch.dtype, generator: torch.Generator):
    """q, k, v, g, beta, document starts and an incoming state as the layer makes them: unit-norm keys, queries
    scaled by dim**-0.5, decays in log space, write strengths in (0, 1), documents of a few hundred to a few
    thousand tokens."""
    device = generator.device

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    q = F.normalize(randn(batch, length, heads, dim), dim=-1) * dim**-0.5
    k = F.normalize(randn(batch, length, heads, dim), dim=-1)
    v = randn(batch, length, heads, dim).to(value_dtype)
    g = -torch.rand(batch, length, heads, generator=generator, device=device)
    beta = torch.rand(batch, length, heads, generator=generator, device=device)
    resets = torch.rand(batch, length, generator=generator, device=device) < 1 / 1500
    state = randn(batch, heads, dim, dim) * 0.1
    return [q, k, v, g, beta], resets, state


def relative_errors(candidate, inputs, resets, state, seed: int) -> dict[str, float]:
    """Largest difference of each output and gradient of ``candidate`` from the chunked form's, over the chunked
    form's largest magnitude."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    results = []
    for kernel in (candidate, gated_delta_rule):
        out, final = kernel(*leaves, resets, state)
        # The same random cotangent for both kernels.
        generator = torch.Generator(out.device).manual_seed(seed)
        cotangent = torch.randn(out.shape, generator=generator, device=out.device)
        results.append([out, final, *torch.autograd.grad((out.float() * cotangent).sum(), leaves)])
    names = ["output", "final state", *(f"d{name}" for name in GRADIENTS)]
    return {name: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            for name, a, b in zip(names, *results)}


def time_ms(kernel, inputs, resets, repeats: int) -> float:
    """Median forward + backward time of one call."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out, _ = kernel(*leaves, resets)
        torch.autograd.grad(out.float().sum(), leaves)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="value heads (the keys are repeated to them)")
    parser.add_argument("--dim", type=int, default=128, help="key and value head width")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=1e-2, help="largest relative difference that passes")
    parser.add_argument("--json", type=Path, help="also append each row here as one JSON line, as measured")
    args = parser.parse_args()
    for flag in ("seq_len", "batch", "heads", "dim", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    fla = gated_deltanet._fla_kernel() if torch.cuda.is_available() else None
    if fla is None:
        why = "no CUDA GPU here" if not torch.cuda.is_available() else "fla (fla-core) is not importable"
        print(f"error: this benchmark compares flash-linear-attention with the chunked form on a GPU: {why}",
              file=sys.stderr)
        return 2
    fla_kernel = gated_deltanet.recurrence_kernel(torch.device("cuda"))
    shape = f"batch {args.batch} x {args.seq_len}, {args.heads} heads of {args.dim}"
    print(f"# Gated delta rule: fla against the chunked form ({shape})\n\nEnvironment: {environment()}.\n")
    seed = int(torch.randint(0, 2**31, ()))
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs, resets, state = layer_inputs(args.batch, args.seq_len, args.heads, args.dim, torch.float32, generator)
    errors = relative_errors(fla_kernel, inputs, resets, state, seed + 1)
    print(f"| float32 inputs | max difference / max magnitude (passes below {args.tolerance:g}) |\n|---|---|")
    for name, error in errors.items():
        append_json(args.json, {"check": "parity", "tensor": name, "relative_error": error,
                                "tolerance": args.tolerance, "shape": shape})
        print(f"| {name} | {error:.2e} |", flush=True)
    print("\n| kernel (v bf16) | forward + backward (ms) | tokens/s |\n|---|---|---|")
    inputs[2] = inputs[2].to(torch.bfloat16)
    for name, kernel in (("fla", fla_kernel), ("chunked PyTorch form", gated_delta_rule)):
        ms = time_ms(kernel, inputs, resets, args.repeats)
        tokens = args.batch * args.seq_len / ms * 1e3
        append_json(args.json, {"check": "time", "kernel": name, "ms": ms, "tokens_per_s": tokens, "shape": shape})
        print(f"| {name} | {ms:.2f} | {tokens:,.0f} |", flush=True)
    return 0 if all(error <= args.tolerance for error in errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
