"""Mixture-of-Experts training around the layer: the [moe] options, the expert kernel choice, and the expert
loads after every step (auxiliary-loss-free balancing and the load metrics).

After each optimizer step the tokens every expert received, summed over the step's micro-batches, are summed
over every data-parallel and context-parallel rank (expert-parallel ranks are among them; tensor-parallel
ranks route the same tokens and are not summed), so all ranks see the same loads. With
``moe.bias_update_rate`` r > 0 each expert's routing bias then moves by r * sign(mean load - load): an
overloaded expert becomes less likely to be chosen, an idle one more. The bias steers the choice only, never
the weights (models/shared/moe.py).
"""

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.cache import cache_dir, measured_once
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.config.job_config import MoE as MoEConfig
from torchtitan.distributed.collectives import sum_now
from torchtitan.distributed.device import rank as device_rank
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.log import logger
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.moe import GroupedExperts, MoE, MoETraining, grouped_mm_supported
from torchtitan.protocols.model import BaseModelArgs

EXPERT_PATH_CACHE_FILE = "expert_path.json"
EXPERT_PATH_CACHE_VERSION = 3
# The timing probe stays small: at most this many tokens, and none for experts larger than this many bytes
# (the grouped kernel is then taken where it runs).
_TIMING_MAX_TOKENS = 8192
_TIMING_MAX_BYTES = 256 * 2**20
# It starts at this many tokens and doubles them while the time measured so far says the next size ends
# within the budget; the smallest size always runs, so there is a verdict even where a path is very slow.
_PROBE_MIN_TOKENS = 256
_PROBE_BUDGET_SECONDS = 3.0
# Timed rounds per size (after one warm-up round), each path once per round, interleaved so that a
# neighbour's load slows both alike.
_PROBE_ROUNDS = 3
# Two timings of the same work on a shared machine differ by this much (seen: 14.4 s vs 15.3 s under
# contention); a verdict closer than this, or than the spread its own rounds showed, is not cached.
_PROBE_NOISE_FLOOR = 0.10


def config_problems(cfg: MoEConfig, model_args: BaseModelArgs | None, expert_parallel_degree: int,
                    checkpoint: CheckpointConfig, hf_has_expert_bias: bool,
                    changed_from_defaults: list[str] = (), lora_frozen_base: bool = False) -> list[tuple[str, str]]:
    """Problems with the [moe] section and expert parallelism for ``model_args`` (None: unknown), as
    (full key, reason) pairs. ``hf_has_expert_bias``: the family's Hugging Face format has a routing bias;
    ``changed_from_defaults``: the MoE options changed from their defaults (keys, e.g. "moe.router_dtype");
    ``lora_frozen_base``: a LoRA run that leaves its base frozen (its Hugging Face export is a PEFT adapter)."""
    problems = []
    # Comparisons pass nan (and inf >= 0): a nan coefficient silently acted as 0, a nan rate or inf broke the bias.
    if not (math.isfinite(cfg.bias_update_rate) and cfg.bias_update_rate >= 0):
        problems.append(("moe.bias_update_rate", "is invalid; it must be >= 0 and finite (0 turns the "
                         "balancing off)"))
    if not (math.isfinite(cfg.aux_loss_coeff) and cfg.aux_loss_coeff >= 0):
        problems.append(("moe.aux_loss_coeff", "is invalid; it must be >= 0 and finite (0 turns the loss off)"))
    if cfg.aux_loss_type != "sequence" and cfg.aux_loss_coeff == 0:
        problems.append(("moe.aux_loss_type", "would do nothing: moe.aux_loss_coeff is 0 (the auxiliary loss is off)"))
    if model_args is None or problems:
        return problems
    moe = model_args.moe if isinstance(model_args, DecoderArgs) else None
    if moe is None:
        # On a dense model these would do nothing: refused rather than silently ignored.
        if expert_parallel_degree > 1:
            problems.append(("parallelism.expert_parallel_degree", "needs a model with MoE layers; this "
                             "model.flavor has none"))
        problems += [(key, "is set, but this model.flavor has no MoE layers") for key in changed_from_defaults]
        return problems
    if moe.num_experts % expert_parallel_degree:
        problems.append(("parallelism.expert_parallel_degree", f"does not divide the model's moe.num_experts = "
                                                               f"{moe.num_experts}"))
    if checkpoint.last_save_in_hf and cfg.bias_update_rate > 0 and lora_frozen_base:
        problems.append(("checkpoint.last_save_in_hf", "would write this LoRA run's adapters as a PEFT adapter "
                         "folder, which cannot carry the routing bias moe.bias_update_rate > 0 trains (the adapters "
                         "on the base would route differently); set moe.bias_update_rate = 0 (the base's bias stays), "
                         "or convert a step checkpoint with scripts/convert_to_hf.py --merge_lora"))
    elif checkpoint.last_save_in_hf and cfg.bias_update_rate > 0 and not hf_has_expert_bias and \
            not checkpoint.hf_drop_expert_bias:
        problems.append(("checkpoint.last_save_in_hf", "would export a routing bias that moe.bias_update_rate > 0 "
                         "trains, but this model's Hugging Face format has none, so the export would route "
                         "differently; set checkpoint.hf_drop_expert_bias = true to drop it, or moe.bias_update_rate "
                         "= 0"))
    return problems


def moe_layers(model_parts: list[nn.Module]) -> list[tuple[int, MoE]]:
    """(layer id, MoE) of every MoE block on this rank, by the block's name under ``layers``."""
    found = []
    for part in model_parts:
        for name, block in part.layers.items():
            found += [(int(name), m) for m in block.modules() if isinstance(m, MoE)]
    return found


def choose_expert_path(requested: str, num_experts: int, dim: int, hidden: int, tokens: int, dtype: torch.dtype,
                       device: torch.device) -> tuple[str, str]:
    """("grouped" or "loop", why) for ``moe.expert_compute = requested`` on experts of this rank's shape
    (``num_experts`` local experts of ``dim`` x ``hidden``, ``tokens`` routed rows per micro-batch).

    ``auto`` times both paths' forward and backward within a time budget (``probe_expert_paths``) and caches
    the verdict per device, dtype and shape (beside the CPU peak) when its margin is beyond the noise; a
    near-tie is used but measured again at the next start. Global rank 0 measures and the others follow, so
    every rank computes the same way. Every rank must call it.
    """
    runs = grouped_mm_supported(dtype, device, dim, hidden)
    if requested != "auto":
        if requested == "grouped" and not runs:
            return "loop", (f"moe.expert_compute = 'grouped', but torch._grouped_mm cannot run {dtype} experts of "
                            f"width {dim} x {hidden} on {device.type} (16-byte row strides); using the loop")
        return requested, "as configured"
    if not runs:
        return "loop", f"auto: torch._grouped_mm cannot run {dtype} experts of width {dim} x {hidden} on {device.type}"
    if 3 * num_experts * dim * hidden * torch.finfo(dtype).bits // 8 > _TIMING_MAX_BYTES:
        return "grouped", "auto: the grouped GEMM (experts too large to time both paths)"
    tokens = min(tokens, _TIMING_MAX_TOKENS)
    key = (f"v{EXPERT_PATH_CACHE_VERSION}|{_device_name(device)}|{dtype}|{num_experts}x{dim}x{hidden}|{tokens}|"
           f"torch {torch.__version__}")
    timings, cached = None, False
    if device_rank() == 0:
        def measure() -> dict[str, float]:
            logger.info(f"MoE expert_compute = 'auto': timing the grouped and loop paths on {num_experts} experts "
                        f"of {dim} x {hidden} in {dtype} (up to {tokens} tokens, at most "
                        f"~{_PROBE_BUDGET_SECONDS:g} s; a clear verdict is cached in {cache_dir()})")
            return probe_expert_paths(num_experts, dim, hidden, tokens, dtype, device)

        try:
            try:
                timings, measured = measured_once(EXPERT_PATH_CACHE_FILE, key, measure, keep=_is_clear)
                cached = not measured or _is_clear(timings)
            except OSError as e:  # a read-only cache folder only costs a measurement next time
                logger.warning(f"could not cache the MoE expert timing in {cache_dir()}: {e}")
                timings = measure()
        except RuntimeError as e:  # e.g. out of memory: the other ranks still wait for the choice below
            logger.warning(f"timing the MoE expert paths failed ({type(e).__name__}: {e}); using the loop")
            timings = {"grouped": math.inf, "loop": 0.0}
    path = "grouped" if timings is None or timings["grouped"] <= timings["loop"] else "loop"
    if dist.is_initialized():
        # Every rank computes the way global rank 0 measured (ranks timing at once would disturb each other).
        # A CPU tensor: the trainer's process group has a gloo side for those next to NCCL.
        choice = torch.tensor([path == "grouped"], dtype=torch.int64)
        dist.broadcast(choice, src=0)
        path = "grouped" if choice.item() else "loop"
    if not timings or not math.isfinite(timings["grouped"]):
        return path, f"auto: as measured on rank 0, for {num_experts} experts of {dim} x {hidden}, {dtype}"
    fast, slow = sorted((timings["grouped"], timings["loop"]))
    verdict = (f"cached, margin beyond the noise ({timings['noise']:.0%})" if cached else
               f"within the noise ({timings['noise']:.0%}): not cached, timed again at the next start")
    return path, (f"auto: {timings['grouped'] * 1e3:.2f} ms grouped vs {timings['loop'] * 1e3:.2f} ms loop, "
                  f"{path} faster by {slow / fast - 1:.1%}, {verdict}; {num_experts} experts of {dim} x {hidden}, "
                  f"{timings['tokens']} tokens, {dtype}")


def _is_clear(timings: dict[str, float]) -> bool:
    """Whether the faster path wins by more than the noise (then the verdict is worth caching)."""
    fast, slow = sorted((timings["grouped"], timings["loop"]))
    return slow > fast * (1 + timings["noise"])


class _PathTimer:
    """Random experts and ``tokens`` rows spread evenly over them; ``time(path)`` runs one forward + backward
    of a path and returns its seconds on ``clock``."""

    def __init__(self, num_experts: int, dim: int, hidden: int, tokens: int, dtype: torch.dtype,
                 device: torch.device):
        generator = torch.Generator().manual_seed(0)
        experts = GroupedExperts(dim, hidden, num_experts)
        with torch.no_grad():
            for w in experts.parameters():
                w.copy_(torch.randn(w.shape, generator=generator) * 0.02)
        self.experts = experts.to(device, dtype)
        self.x = torch.randn(tokens, dim, generator=generator).to(device, dtype).requires_grad_()
        self.counts = torch.full((num_experts,), tokens // num_experts, dtype=torch.int64, device=device)
        self.counts[: tokens % num_experts] += 1
        self.grad = torch.randn(tokens, dim, generator=generator).to(device, dtype)
        self.device = device

    def time(self, path: str, clock: Callable[[], float] = time.perf_counter) -> float:
        self.experts.path = path
        # Fresh gradients, as a step's first micro-batch writes them (accumulating would add a pass over them).
        self.experts.zero_grad(set_to_none=True)
        self.x.grad = None
        _synchronize(self.device)
        start = clock()
        self.experts(self.x, self.counts).backward(self.grad)
        _synchronize(self.device)
        return clock() - start


def time_expert_paths(num_experts: int, dim: int, hidden: int, tokens: int, dtype: torch.dtype,
                      device: torch.device, repeats: int = 3) -> dict[str, float]:
    """The fastest of ``repeats`` forward + backward passes of each expert path (after a warm-up), in seconds,
    on random weights and ``tokens`` rows spread evenly over the experts; no time limit (benchmarks)."""
    timer = _PathTimer(num_experts, dim, hidden, tokens, dtype, device)
    best = {}
    for path in ("grouped", "loop"):
        timer.time(path)
        best[path] = min(timer.time(path) for _ in range(repeats))
    return best


def probe_expert_paths(num_experts: int, dim: int, hidden: int, max_tokens: int, dtype: torch.dtype,
                       device: torch.device, budget_seconds: float = _PROBE_BUDGET_SECONDS,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Both paths timed at growing token counts, smallest first, within about ``budget_seconds``: {"grouped",
    "loop": the best forward + backward seconds at the largest count timed, "tokens": that count, "noise": the
    larger of the noise floor and the spread of that count's rounds, relative}.

    Never starts a size or a round that the times measured so far say would end past the budget; the smallest
    size's warm-up and first round always run.
    """
    deadline = clock() + budget_seconds
    tokens = min(max_tokens, max(_PROBE_MIN_TOKENS, num_experts))
    while True:
        timer = _PathTimer(num_experts, dim, hidden, tokens, dtype, device)
        rounds = []  # seconds of each path per round, the warm-up first
        while len(rounds) < _PROBE_ROUNDS + 1:
            if len(rounds) >= 2 and clock() + sum(rounds[-1].values()) > deadline:
                break
            rounds.append({path: timer.time(path, clock) for path in ("grouped", "loop")})
        timed = rounds[1:]
        result = {path: min(r[path] for r in timed) for path in ("grouped", "loop")}
        spread = max(max(r[path] for r in timed) / result[path] - 1 if result[path] > 0 else 0.0
                     for path in ("grouped", "loop"))
        result.update(tokens=tokens, noise=max(_PROBE_NOISE_FLOOR, spread))
        if tokens >= max_tokens:
            return result
        bigger = min(2 * tokens, max_tokens)
        # The next size's rounds scale with its tokens; predicted at twice that, as a larger size can run at a
        # lower rate (caches).
        predicted = 2 * sum(sum(r.values()) for r in rounds) * bigger / tokens
        if clock() + predicted > deadline:
            return result
        tokens = bigger


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from torchtitan.hardware import cpu_model

    return f"cpu {cpu_model()} x{torch.get_num_threads()}"


class ExpertLoadBalancer:
    """Configures every MoE layer of the model parts from [moe], then, after every optimizer step, sums the
    expert loads over the data-parallel ranks, moves the routing biases, and makes the load metrics."""

    def __init__(self, cfg: MoEConfig, model_parts: list[nn.Module], model_args: DecoderArgs,
                 parallel_dims: ParallelDims, global_sequences: int, local_tokens: int, compute_dtype: torch.dtype,
                 device: torch.device, across_groups=lambda counts: counts):
        """Every rank builds one (pipeline ranks without MoE layers too: they take part in the sums).
        ``across_groups`` sums the loads over the replica groups of a fault-tolerant run, so their biases agree."""
        self.cfg = cfg
        self.across_groups = across_groups
        self.layers = moe_layers(model_parts)
        # Multi-token prediction blocks follow the main ones (layer ids n_layers, ...).
        self.n_layers = model_args.n_layers + model_args.mtp_depth
        self.device = device
        self.data_mesh = parallel_dims.submesh("dp_cp")
        self.pp_mesh = parallel_dims.submesh("pp")
        moe_args = model_args.moe
        self.counts = torch.zeros(self.n_layers, moe_args.num_experts, dtype=torch.int64, device=device)
        self.aux_loss = torch.zeros((), dtype=torch.float32, device=device)  # this rank's, of the last step
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the loads collected, not yet applied
        path, why = choose_expert_path(cfg.expert_compute, moe_args.num_experts // parallel_dims.ep, model_args.dim,
                                       moe_args.hidden_dim // parallel_dims.tp, local_tokens * moe_args.top_k,
                                       compute_dtype, device)
        options = MoETraining(router_dtype=torch.float32 if cfg.router_dtype == "float32" else None,
                              aux_loss_coeff=cfg.aux_loss_coeff, aux_loss_type=cfg.aux_loss_type,
                              aux_loss_scale=1.0 / global_sequences, expert_path=path)
        for _, moe in self.layers:
            moe.configure(options)
        balancing = f"bias update rate {cfg.bias_update_rate:g}" if cfg.bias_update_rate > 0 else "no routing bias"
        aux = f"aux loss {cfg.aux_loss_coeff:g} ({cfg.aux_loss_type})" if cfg.aux_loss_coeff > 0 else "no aux loss"
        logger.info(f"MoE: {len(self.layers)} MoE layers here; routed experts compute with the {path} path ({why}); "
                    f"{balancing}; {aux}; router in {cfg.router_dtype}")

    @torch.no_grad()
    def collect(self) -> None:
        """Take this step's loads from the layers and sum them over the data-parallel ranks (and replica groups),
        before the step is decided: every rank of every group takes part whether the step is kept or not."""
        counts = torch.zeros_like(self.counts)
        aux = torch.zeros_like(self.aux_loss)
        for layer_id, moe in self.layers:
            counts[layer_id], aux_loss = moe.take_stats()
            aux += aux_loss.to(self.device)
        self._pending = self.across_groups(sum_now(counts, self.data_mesh)), aux

    def discard_step(self) -> None:
        """Forget the loads a skipped step routed (training.guard): its biases and counts stay as they were."""
        self._pending = None

    @torch.no_grad()
    def after_step(self) -> None:
        """Move the routing biases by the loads ``collect`` summed (every rank alike)."""
        self.counts, self.aux_loss = self._pending
        self._pending = None
        if self.cfg.bias_update_rate > 0:
            for layer_id, moe in self.layers:
                load = self.counts[layer_id].float()
                moe.move_bias(self.cfg.bias_update_rate * torch.sign(load.mean() - load))

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """Per-layer loads of the last step (max and mean tokens per expert, the busiest expert's share of the
        routed tokens, every expert's share) and their summary, plus the last step's auxiliary loss; every rank
        calls it."""
        counts = sum_now(self.counts, self.pp_mesh).float()
        row = {}
        ratios = []
        for layer_id in sorted({layer_id for layer_id in range(self.n_layers) if counts[layer_id].sum() > 0}):
            load = counts[layer_id]
            busiest, mean = load.max().item(), load.mean().item()
            row[f"moe/layer{layer_id}/max_tokens"] = busiest
            row[f"moe/layer{layer_id}/mean_tokens"] = mean
            row[f"moe/layer{layer_id}/busiest_fraction"] = round(busiest / load.sum().item(), 6)
            # One list per layer, not a key per expert: a large model has thousands of experts in all, which as
            # scalars would swell every row and TensorBoard (which skips lists); the report draws them as a heatmap.
            row[f"moe/layer{layer_id}/expert_fractions"] = [round(x, 6) for x in (load / load.sum()).tolist()]
            ratios.append(busiest / mean)
        summary = {"moe/max_over_mean": round(sum(ratios) / len(ratios), 4)} if ratios else {}
        if self.cfg.aux_loss_coeff > 0:
            # Summed over layers, micro-batches and ranks: the step's whole auxiliary loss.
            summary["moe/aux_loss"] = float(sum_now(sum_now(self.aux_loss, self.data_mesh), self.pp_mesh))
        return {**summary, **row}
