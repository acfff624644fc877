"""The Mixture-of-Experts feed-forward every MoE family shares: router, stacked experts, shared experts.

One MoE step, as data: tokens -> router scores (float32 by default) -> top-k experts per token (a per-expert
bias may steer the choice, never the weights) -> tokens sorted by expert -> each expert's SwiGLU over its
tokens (dropless: every routed token is computed) -> back in token order, weighted, summed over the k
choices -> plus the shared experts (a SwiGLU every token goes through).

The layer holds no communication: the parallelisms hand it theirs in one typed call, ``MoE.parallelize``
(distributed/expert_parallel.py): expert parallelism an exchange that sends each token to the rank holding
its expert and back, tensor parallelism a gradient sum for the inputs every rank routes alike (see
``MoE.forward``), context parallelism the group of a sequence's shards for the sequence-wise auxiliary loss.
The trainer sets the training options (router dtype, expert path, auxiliary loss) from the [moe] section with
``MoE.configure`` and takes the expert loads after every step (components/expert_load.py).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.shared.feed_forward import FeedForward


@dataclass
class MoEArgs:
    """The architecture of a MoE feed-forward (what a released checkpoint fixes)."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    """Width of each routed expert's SwiGLU (HF: moe_intermediate_size)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    """Renormalise the k selected weights to sum to one (HF: norm_topk_prob)."""
    route_scale: float = 1.0
    """Factor on the routing weights (DeepSeek-V3: 2.5)."""
    n_groups: int = 1
    """Expert groups for group-limited routing (1: off)."""
    topk_group: int = 1
    """Groups each token may pick its experts from (the best ones by the sum of their two best scores)."""
    shared_hidden_dim: int = 0
    """Width of the shared experts' SwiGLU that every token goes through (0: none)."""
    shared_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(a learned projection of the token) (Qwen3-Next)."""
    router_bias: bool = False
    """The router's projection has a bias (gpt-oss); unlike the balancing bias it changes the weights too."""
    expert_biases: bool = False
    """Every routed expert's three projections have biases (gpt-oss); not the shared experts."""
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The routed experts' gated unit: silu(gate) * linear, or gpt-oss's clamped form (gate clamped above at
    swiglu_limit, linear to [-swiglu_limit, swiglu_limit], gate * sigmoid(swiglu_alpha * gate) * (linear + 1));
    shared experts stay SwiGLU."""
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def check(self) -> list[tuple[str, str]]:
        """Problems as (field, reason) pairs."""
        problems = [(name, f"{getattr(self, name)} must be positive")
                    for name in ("num_experts", "top_k", "hidden_dim", "n_groups", "topk_group")
                    if getattr(self, name) <= 0]
        if problems:
            return problems
        if self.top_k > self.num_experts:
            problems.append(("top_k", f"{self.top_k} is more than num_experts = {self.num_experts}"))
        if self.num_experts % self.n_groups:
            problems.append(("n_groups", f"{self.n_groups} does not divide num_experts = {self.num_experts}"))
        elif self.topk_group > self.n_groups:
            problems.append(("topk_group", f"{self.topk_group} is more than n_groups = {self.n_groups}"))
        elif self.top_k > self.topk_group * (self.num_experts // self.n_groups):
            problems.append(("top_k", f"{self.top_k} is more than the {self.topk_group} kept groups hold "
                                      f"({self.num_experts // self.n_groups} experts each)"))
        if self.route_scale <= 0:
            problems.append(("route_scale", f"{self.route_scale} must be positive"))
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(("score_func", f"{self.score_func!r} is not 'softmax' or 'sigmoid'"))
        if self.shared_hidden_dim < 0:
            problems.append(("shared_hidden_dim", f"{self.shared_hidden_dim} must be >= 0"))
        if self.activation not in ("swiglu", "clamped_swiglu"):
            problems.append(("activation", f"{self.activation!r} is not 'swiglu' or 'clamped_swiglu'"))
        elif self.activation == "clamped_swiglu" and self.swiglu_limit <= 0:
            problems.append(("swiglu_limit", f"{self.swiglu_limit} must be positive"))
        if self.shared_gate and not self.shared_hidden_dim:
            problems.append(("shared_gate", "gates the shared experts, but shared_hidden_dim is 0 (none)"))
        return problems

    def routed_params(self, dim: int) -> int:
        """Parameters of the routed experts of one layer (three [num_experts, dim, hidden] matrices, and their
        biases)."""
        biases = self.num_experts * (2 * self.hidden_dim + dim) if self.expert_biases else 0
        return 3 * self.num_experts * dim * self.hidden_dim + biases


def compute_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's where it is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _local(t: torch.Tensor) -> torch.Tensor:
    # Sharded experts (expert and tensor parallel) compute on the slices this rank holds.
    return t.to_local() if isinstance(t, DTensor) else t


class Router(nn.Module):
    """Scores every expert for every token and picks the top k."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None,
                dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (T, k) float32, expert indices (T, k), scores (T, E) float32) for tokens x (T, dim).

        ``dtype`` is what the gate computes in (None: the compute dtype). ``expert_bias`` is added to the
        scores only to choose the experts; the weights are the unbiased scores of the chosen ones.
        """
        a = self.args
        dtype = dtype or compute_dtype_of(x)
        bias = None if self.gate.bias is None else _local(self.gate.bias).to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), _local(self.gate.weight).to(dtype), bias).float()
        scores = logits.softmax(dim=-1) if a.score_func == "softmax" else logits.sigmoid()
        choice = scores if expert_bias is None else scores + expert_bias
        if a.n_groups > 1:
            grouped = choice.unflatten(-1, (a.n_groups, -1))
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            kept = group_scores.topk(a.topk_group, dim=-1).indices
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(-1, kept, False)
            choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(-2)
        indices = choice.topk(a.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, indices, scores


ExpertPath = Literal["grouped", "loop"]


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked: w1, w3 (E, dim, hidden) and w2 (E, hidden, dim); with
    ``args.expert_biases`` also b1, b3 (E, hidden) and b2 (E, dim).

    ``forward(x, counts)`` takes tokens already sorted by expert, ``counts[e]`` of them for expert e, and
    runs each expert over its own rows: with one grouped GEMM per matrix (``torch._grouped_mm``) or with a
    plain loop over the experts (the reference, and the path where the grouped kernel cannot run).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, args: MoEArgs | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if args is not None and args.expert_biases:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        else:
            self.b1 = self.b2 = self.b3 = None
        self.activation = _swiglu if args is None or args.activation == "swiglu" else partial(
            _clamped_swiglu, limit=args.swiglu_limit, alpha=args.swiglu_alpha)
        self.path: ExpertPath = "loop"
        # Tensor parallelism: each rank's outputs are partial sums over the hidden width, so b2 is added as
        # b2 / tp_degree by every rank, its gradient summed over them (set by MoE.parallelize).
        self.tp_degree, self.sum_partial_grad = 1, None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype_of(x)
        x = x.to(dtype)
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        biases = None
        if self.b1 is not None:
            b2 = _local(self.b2)
            if self.tp_degree > 1:
                b2 = self.sum_partial_grad(b2) / self.tp_degree
            biases = tuple(b.to(dtype) for b in (_local(self.b1), b2, _local(self.b3)))
        if self.path == "grouped" and grouped_mm_supported(dtype, x.device, x.shape[-1], w1.shape[-1]):
            return _grouped_swiglu(x, w1, w2, w3, counts, biases, self.activation)
        return _looped_swiglu(x, w1, w2, w3, counts, biases, self.activation)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, dim: int, hidden: int) -> bool:
    """Whether torch._grouped_mm runs experts of ``dim`` x ``hidden`` in ``dtype`` on ``device``: rows must be
    multiples of 16 bytes; CUDA takes bfloat16 on compute capability 8.0 or newer, the CPU float32 too."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] < 8):
        return False
    align = 16 // dtype.itemsize
    return dim % align == 0 and hidden % align == 0


def _swiglu(gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * linear


def _clamped_swiglu(gate: torch.Tensor, linear: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(alpha * gate) * (linear.clamp(-limit, limit) + 1)


def _grouped_swiglu(x, w1, w2, w3, counts, biases=None, activation=_swiglu):
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, linear = torch._grouped_mm(x, w1, offs=offsets), torch._grouped_mm(x, w3, offs=offsets)
    if biases is not None:
        # Each row's expert's bias: the biases repeated by the experts' token counts.
        b1, b2, b3 = (b.repeat_interleave(counts, dim=0, output_size=x.shape[0]) for b in biases)
        gate, linear = gate + b1, linear + b3
    out = torch._grouped_mm(activation(gate, linear), w2, offs=offsets)
    return out if biases is None else out + b2


def _looped_swiglu(x, w1, w2, w3, counts, biases=None, activation=_swiglu):
    # Split once: each expert's gradient is then its own slice, stacked once in backward. Indexing w1[e] per
    # expert instead made every expert's backward allocate and add a zero gradient the size of all experts.
    # The same for the tokens (split, not sliced: a slice's backward pads to all of x).
    w1, w2, w3 = w1.unbind(0), w2.unbind(0), w3.unbind(0)
    b1, b2, b3 = (b.unbind(0) for b in biases) if biases is not None else (None, None, None)
    outputs = []
    # An expert without tokens still multiplies an empty slice: its weights then get a zero gradient, which
    # every rank's gradient reduction expects.
    for expert, rows in enumerate(x.split(counts.tolist())):
        gate, linear = rows @ w1[expert], rows @ w3[expert]
        if b1 is not None:
            gate, linear = gate + b1[expert], linear + b3[expert]
        out = activation(gate, linear) @ w2[expert]
        outputs.append(out if b2 is None else out + b2[expert])
    return torch.cat(outputs)


class _AddAuxLoss(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward, gives ``aux_loss`` the gradient 1.

    The auxiliary loss thereby joins the training loss without travelling to it: this works alike under
    gradient accumulation, pipeline stages and activation checkpointing.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


def _in_backward() -> bool:
    # Activation checkpointing re-runs the forward inside backward; that rerun must not count tokens twice.
    return torch._C._current_graph_task_id() != -1


# (sorted tokens, tokens per expert, experts) -> the experts' outputs for the sorted tokens.
ExpertExchange = Callable[[torch.Tensor, torch.Tensor, GroupedExperts], torch.Tensor]


@dataclass(frozen=True)
class MoEParallelism:
    """The communication the parallelisms hand a MoE layer (distributed/expert_parallel.py)."""

    expert_exchange: ExpertExchange | None = None
    """Expert parallelism: runs the sorted tokens on the ranks holding their experts and brings them back."""
    sum_partial_grad: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Tensor parallelism: the identity whose backward sums the gradient over the TP ranks."""
    sequence_group: dist.ProcessGroup | None = None
    """Context parallelism: the ranks holding shards of the same sequences."""
    tp_degree: int = 1
    """Tensor parallelism's degree (the experts' output biases are shared out over its ranks)."""


@dataclass(frozen=True)
class MoETraining:
    """The training options of a MoE layer, set from the [moe] section (components/expert_load.py)."""

    router_dtype: torch.dtype | None = torch.float32
    """The dtype the router scores in; None: the compute dtype."""
    aux_loss_coeff: float = 0.0
    aux_loss_type: Literal["sequence", "batch"] = "sequence"
    aux_loss_scale: float = 1.0
    """1 / sequences in the global batch (see MoE._aux_loss)."""
    expert_path: ExpertPath = "loop"


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a block's feed-forward; input and output (B, S, dim)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, args)
        self.shared_experts = FeedForward(dim, args.shared_hidden_dim) if args.shared_hidden_dim else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_gate else None
        # Auxiliary-loss-free balancing: added to the scores to choose experts (persistent: it is trained state).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        # Tokens routed to each expert since the trainer last read them (training forwards only).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64),
                             persistent=False)
        self.options = MoETraining()
        self.parallelism = MoEParallelism()
        self.aux_loss_sum = torch.zeros(())  # detached, for metrics; reset with the loads

    def _apply(self, fn, recurse=True):
        # Module-wide dtype casts (model.to(bfloat16)) leave the routing bias in float32: its steps of ~1e-3 on
        # values near the scores would round away in bfloat16. Device moves still apply.
        kept = self.expert_bias
        super()._apply(fn, recurse)
        if self.expert_bias.dtype != kept.dtype and not kept.is_meta:
            self.expert_bias = kept.to(self.expert_bias.device)
        return self

    def configure(self, options: MoETraining) -> None:
        """Set the training options (the trainer, from the [moe] section)."""
        self.options = options
        self.experts.path = options.expert_path

    def parallelize(self, parallelism: MoEParallelism) -> None:
        """Take the communication the parallelisms need (see the module docstring)."""
        self.parallelism = parallelism
        self.experts.tp_degree, self.experts.sum_partial_grad = parallelism.tp_degree, parallelism.sum_partial_grad

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens routed to each expert and the summed auxiliary loss since the last call; both reset."""
        stats = self.tokens_per_expert.clone(), self.aux_loss_sum
        self.discard_stats()
        return stats

    def discard_stats(self) -> None:
        """Forget the loads and auxiliary loss recorded since the last ``take_stats`` (a skipped step)."""
        self.tokens_per_expert.zero_()
        self.aux_loss_sum = torch.zeros_like(self.aux_loss_sum)

    @torch.no_grad()
    def move_bias(self, step: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: add ``step`` (per expert) to the routing bias."""
        self.expert_bias += step

    def pending_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the trainer has not read yet (loads, auxiliary loss), for ``restore_stats``."""
        return self.tokens_per_expert.clone(), self.aux_loss_sum.clone()

    def restore_stats(self, stats: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Forget what forwards since ``pending_stats`` recorded (e.g. a pipeline stage's shape inference)."""
        self.tokens_per_expert.copy_(stats[0])
        self.aux_loss_sum = stats[1]

    def init_buffers(self, device: torch.device | None = None) -> None:
        device = device or self.expert_bias.device
        self.expert_bias = torch.zeros(self.args.num_experts, dtype=torch.float32, device=device)
        self.tokens_per_expert = torch.zeros(self.args.num_experts, dtype=torch.int64, device=device)
        self.aux_loss_sum = torch.zeros((), dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, indices, scores = self.router(tokens, self.expert_bias, self.options.router_dtype)
        counts = torch.zeros_like(self.tokens_per_expert).scatter_add_(
            0, indices.flatten(), torch.ones_like(indices.flatten()))
        aux_loss = None
        if self.options.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux_loss = self._aux_loss(scores, indices, counts, bsz, seqlen)
        self._record(counts, aux_loss)
        routed_input = tokens
        if (sum_partial_grad := self.parallelism.sum_partial_grad) is not None:
            # Under tensor parallelism every rank routes all tokens alike and its experts hold a slice of
            # the hidden width, so each rank's expert outputs (and the gradients they send back) are
            # partial sums: the output is reduced by the caller, the gradients here.
            routed_input = sum_partial_grad(tokens)
            weights = sum_partial_grad(weights)
        out = self._routed(routed_input, weights, indices, counts)
        if self.shared_experts is not None:
            out = out + self._shared(tokens)
        if aux_loss is not None:
            out = _AddAuxLoss.apply(out, aux_loss)
        return out.view(bsz, seqlen, dim)

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(tokens)
        if self.shared_gate is None:
            return shared
        # Read as a local tensor, like the router's gate. Under tensor parallelism the shared output is a partial
        # sum, so the gradient reaching the gate is too: summed over the ranks, as for the routing weights.
        gate = torch.sigmoid(F.linear(tokens, _local(self.shared_gate.weight).to(tokens.dtype)))
        if (sum_partial_grad := self.parallelism.sum_partial_grad) is not None:
            gate = sum_partial_grad(gate)
        return gate.to(shared.dtype) * shared

    def _routed(self, tokens: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """Dropless: sort the (token, choice) pairs by expert, run the experts, unsort, weight, sum."""
        k = indices.shape[1]
        order = indices.flatten().argsort(stable=True)
        sorted_tokens = tokens[order // k]
        if self._needs_eager(compute_dtype_of(tokens)):
            expert_out = self._experts_eager(sorted_tokens, counts)
        else:
            expert_out = self._experts(sorted_tokens, counts)
        unsorted = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        per_choice = expert_out[unsorted].view(-1, k, expert_out.shape[-1])
        return (per_choice * weights.to(per_choice.dtype).unsqueeze(-1)).sum(dim=1).to(tokens.dtype)

    def _experts(self, sorted_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.parallelism.expert_exchange is not None:
            return self.parallelism.expert_exchange(sorted_tokens, counts, self.experts)
        return self.experts(sorted_tokens, counts)

    @torch.compiler.disable
    def _experts_eager(self, sorted_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self._experts(sorted_tokens, counts)

    def _needs_eager(self, dtype: torch.dtype) -> bool:
        """Under torch.compile, what reads token counts on the host runs between compiled graphs: the token
        exchange of expert parallelism and the loop path. The grouped kernel traces in bfloat16 only."""
        if not torch.compiler.is_compiling():
            return False
        return (self.parallelism.expert_exchange is not None or self.experts.path != "grouped"
                or dtype != torch.bfloat16)

    @torch.compiler.disable
    def _record(self, counts: torch.Tensor, aux_loss: torch.Tensor | None) -> None:
        """Add this forward's expert loads (and auxiliary loss) to what the trainer reads after the step;
        validation forwards and activation checkpointing's recomputation do not count."""
        if not torch.is_grad_enabled() or _in_backward():
            return
        self.tokens_per_expert += counts
        if aux_loss is not None:
            self.aux_loss_sum = self.aux_loss_sum.to(aux_loss.device) + aux_loss.detach().float()

    def _aux_loss(self, scores: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, bsz: int,
                  seqlen: int) -> torch.Tensor:
        """coeff * sum_i f_i * P_i: f_i the share of the k choices given to expert i (times E), P_i the mean
        (normalised) score of expert i, per sequence ("sequence") or over this micro-batch ("batch"). It is
        scaled by 1 / (sequences in the global batch) per sequence, so that, summed over micro-batches and
        ranks, the sequence-wise loss is its mean over the global batch (the batch-wise one is weighted by
        each micro-batch's sequences). Under context parallelism the counts of a sequence are summed over
        its shards and each shard adds its part of P."""
        num_experts, k = self.args.num_experts, self.args.top_k
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.args.score_func == "sigmoid" else scores
        group = self.parallelism.sequence_group
        shards = 1 if group is None else dist.get_world_size(group)
        if self.options.aux_loss_type == "sequence":
            per_seq = torch.zeros(bsz, num_experts, dtype=torch.float32, device=scores.device)
            rows = torch.arange(bsz, device=scores.device).repeat_interleave(seqlen * k)
            per_seq.index_put_((rows, indices.flatten()), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
            per_seq = self._sum_over_shards(per_seq)
            f = per_seq * num_experts / (k * seqlen * shards)
            p = probs.view(bsz, seqlen, num_experts).sum(dim=1) / (seqlen * shards)
            loss = (f * p).sum()
        else:
            total = self._sum_over_shards(counts.float())
            f = total * num_experts / (k * bsz * seqlen * shards)
            p = probs.sum(dim=0) / (bsz * seqlen * shards)
            loss = (f * p).sum() * bsz
        return loss * self.options.aux_loss_coeff * self.options.aux_loss_scale

    @torch.compiler.disable
    def _sum_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        if self.parallelism.sequence_group is None:
            return t
        t = t.clone()
        dist.all_reduce(t, group=self.parallelism.sequence_group)
        return t


@contextmanager
def load_statistics_kept(model: nn.Module) -> Iterator[None]:
    """Forwards inside the block leave every MoE layer's load statistics as they were (generation, a frozen
    reference's scoring: the balancer must count the training forwards alone)."""
    kept = [(m, m.pending_stats()) for m in model.modules() if isinstance(m, MoE)]
    try:
        yield
    finally:
        for moe, stats in kept:
            moe.restore_stats(stats)
