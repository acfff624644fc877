"""Muon for the hidden weight matrices, AdamW for every other parameter, in one optimizer (optimizer.name = "Muon").

Muon (momentum orthogonalised by Newton-Schulz) updates each hidden matrix: the attention and MLA projections,
the dense and shared-expert FFNs, and each routed expert's matrices (a stacked ``[experts, in, out]`` parameter
is orthogonalised per expert). Embeddings, the output head, norms, biases, router gates and every other
parameter that is not a matrix inside a block go to AdamW with the same [optimizer] section's betas and eps.

Per Muon matrix with gradient G and momentum buffer B (both float32 math):

    B <- momentum * B + (1 - momentum) * G
    U <- (1 - momentum) * G + momentum * B   (Nesterov; B alone without)
    O <- NewtonSchulz5(U)                    (quintic, coefficients 3.4445, -4.7750, 2.0315; in ns_dtype)
    W <- W * (1 - lr * weight_decay) - lr * adjust(rows, cols) * O

with ``adjust`` = sqrt(max(1, rows / cols)) ("original") or 0.2 * sqrt(max(rows, cols)) ("match_rms_adamw", which
gives the update AdamW's typical RMS, so AdamW's lr and weight decay carry over). rows are output features and
cols input features whatever the storage: an nn.Linear weight is [out, in], a stacked expert [experts, in, out].

The numbers for a 2-D matrix are torch.optim.Muon's (same operations in the same order); the AdamW group is
torch's functional AdamW. Parameters sharded as DTensors (FSDP, TP, EP and their mixes) are orthogonalised whole
and once per step: each matrix (each expert of a stack) has one owner rank, which receives the pieces of the
update (in the Newton-Schulz dtype), orthogonalises, and sends every holder its piece back
(distributed/whole_matrices.py; docs/optimizers.md says how the work and the traffic divide).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.whole_matrices import WholeMatrices
from torchtitan.log import logger
from torchtitan.models.shared.gated_deltanet import ShortConv
from torchtitan.models.shared.moe import GroupedExperts, Router

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of a matrix, or of each matrix of a [n, r, c] stack."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    if x.ndim == 2:  # torch.optim.Muon's exact sequence of operations
        x = x / x.norm().clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def rows_and_cols(param: torch.Tensor) -> tuple[int, int]:
    """(output features, input features) of a Muon matrix: [out, in] for a Linear, [experts, in, out] stacked."""
    return (param.shape[0], param.shape[1]) if param.ndim == 2 else (param.shape[-1], param.shape[-2])


def lr_factor(rule: str, param: torch.Tensor) -> float:
    rows, cols = rows_and_cols(param)
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def split_parameters(model_parts: list[nn.Module]) -> tuple[list[tuple[str, nn.Parameter]],
                                                            list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) named trainable parameters: Muon takes the 2-D and stacked 3-D matrices inside the
    transformer blocks (any module under ``layers``), except router gates, the experts' stacked biases, the
    shared-expert gate (one row) and depthwise conv filters (per channel, not a matrix); AdamW takes the rest."""
    muon, adamw = [], []
    for part in model_parts:
        routers = [name + "." for name, module in part.named_modules() if isinstance(module, Router)]
        for module_name, module in part.named_modules():
            in_block = module_name.startswith("layers.")
            in_router = any(f"{module_name}.".startswith(router) for router in routers)
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad:
                    continue
                full = f"{module_name}.{name}" if module_name else name
                hidden_matrix = (in_block and param.ndim in (2, 3) and not in_router
                                 and not isinstance(module, nn.Embedding)
                                 and not (isinstance(module, GroupedExperts) and name in ("b1", "b2", "b3"))
                                 and not isinstance(module, ShortConv) and not module_name.endswith("shared_gate"))
                (muon if hidden_matrix else adamw).append((full, param))
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer with a "muon" and an "adamw" parameter group (see the module doc); the lr scheduler scales
    both groups' lr alike. Either group may be empty: AdamW with bfloat16 states is this class without Muon.

    ``kernel_flags`` are the AdamW group's ``fused``/``foreach`` (optimizer.implementation); ``state_dtype`` (None:
    the parameters' dtype) is the dtype the moments and momentum buffers are stored in;
    with a dtype other than the parameters', each step reads them into float32, updates, and rounds them back.
    """

    def __init__(self, muon_params: list[nn.Parameter], adamw_params: list[nn.Parameter], cfg: OptimizerConfig,
                 kernel_flags: dict[str, bool], ns_dtype: torch.dtype, state_dtype: torch.dtype | None = None,
                 muon_names: list[str] | None = None):
        defaults = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
        groups = [dict(params=muon_params, kind="muon", momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                       ns_steps=cfg.muon_ns_steps, adjust_lr=cfg.muon_adjust_lr),
                  dict(params=adamw_params, kind="adamw", betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                       **kernel_flags)]
        super().__init__([g for g in groups if g["params"]], defaults)
        self.ns_dtype, self.state_dtype = ns_dtype, state_dtype
        # The owner plan, when any rank's Muon matrices are DTensors (all ranks then take part in its collectives).
        names = muon_names or [f"muon[{i}]" for i in range(len(muon_params))]
        sharded = any(isinstance(p, DTensor) for p in muon_params)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(sharded)])  # a CPU tensor: gloo, which every backend() includes, reduces it
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            sharded = bool(flag.item())
        self.whole_matrices = WholeMatrices(muon_params, names) if sharded else None

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim.Optimizer.load_state_dict casts every state tensor but "step" to its parameter's dtype: put
        # lower-precision moments back in their dtype, or the resumed run would keep them in float32 (more memory,
        # and no longer the uninterrupted run's rounding).
        super().load_state_dict(state_dict)
        if self.state_dtype is None:
            return
        for state in self.state.values():
            for key, value in state.items():
                if key != "step" and value.is_floating_point():
                    state[key] = value.to(self.state_dtype)

    def _new_state(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param, dtype=self.state_dtype or param.dtype, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        updates = []
        for param in group["params"]:
            if param.grad is None:
                updates.append(None)
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = self._new_state(param)
            stored = state["momentum_buffer"]
            buf = stored if stored.dtype == param.grad.dtype else stored.float()
            buf.lerp_(param.grad, 1 - momentum)
            if buf is not stored:
                stored.copy_(buf)
            updates.append(param.grad.lerp(buf, momentum) if group["nesterov"] else buf)
        for param, update in zip(group["params"], self._orthogonalize(updates, group["ns_steps"])):
            if param.grad is None:
                continue
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-lr * lr_factor(group["adjust_lr"], param))

    def _orthogonalize(self, updates: list[torch.Tensor | None], steps: int) -> list[torch.Tensor | None]:
        """newton_schulz of each update: plain tensors here, DTensors' whole matrices on their owner ranks."""
        out = [None if u is None or isinstance(u, DTensor) else newton_schulz(u, steps, self.ns_dtype)
               for u in updates]
        if self.whole_matrices is None:
            return out
        pieces = []
        for param, update in zip(self.whole_matrices.params, updates):
            if not isinstance(param, DTensor):
                pieces.append(None)
            elif update is None:  # a parameter without a gradient sends zeros, and its result is dropped
                pieces.append(torch.zeros_like(param.to_local(), dtype=self.ns_dtype))
            else:
                pieces.append(update.to_local().to(self.ns_dtype))
        whole = self.whole_matrices.gather(pieces)
        results = {}
        stacked: dict[tuple, list[str]] = {}  # experts of the same shape go through one batched call
        for matrix in self.whole_matrices.owned:
            if matrix.expert is None:
                results[matrix.name] = newton_schulz(whole[matrix.name], steps, self.ns_dtype)
            else:
                stacked.setdefault(matrix.shape, []).append(matrix.name)
        for names in stacked.values():
            for name, result in zip(names, newton_schulz(torch.stack([whole[n] for n in names]), steps,
                                                         self.ns_dtype)):
                results[name] = result
        mine = self.whole_matrices.scatter(results, pieces)
        for i, (update, local) in enumerate(zip(updates, mine)):
            if update is not None and local is not None:
                out[i] = DTensor.from_local(local, update.device_mesh, update.placements, run_check=False,
                                            shape=update.shape, stride=update.stride())
        return out

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            lean = (self.state_dtype or param.dtype) != param.dtype
            if not state:
                # As torch.optim.AdamW keeps it: a float32 count, on the parameter's device for the fused kernel
                # (the lean step reads it on the host, per parameter, so there it stays on the host).
                device = param.device if group["fused"] and not lean else None
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = self._new_state(param)
                state["exp_avg_sq"] = self._new_state(param)
            if lean:
                self._low_precision_adamw(param, state, group)
                continue
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], fused=group["fused"],
                 decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    @staticmethod
    def _low_precision_adamw(param: torch.Tensor, state: dict, group: dict) -> None:
        """torch's single-tensor AdamW step in float32 on moments stored in a lower precision."""
        beta1, beta2 = group["betas"]
        lr, grad = group["lr"], param.grad.float()
        state["step"] += 1
        step = state["step"].item()
        exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        param.mul_(1 - lr * group["weight_decay"])
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)


def build_muon(model_parts: list[nn.Module], cfg: OptimizerConfig, kernel_flags: dict[str, bool],
               ns_dtype: torch.dtype, state_dtype: torch.dtype | None) -> MuonWithAdamW:
    muon, adamw = split_parameters(model_parts)

    def listed(named: list) -> str:
        names = [name for name, _ in named]
        return ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")

    logger.info(f"optimizer Muon: {len(muon)} matrices by Muon ({listed(muon)}); {len(adamw)} parameters by AdamW "
                f"({listed(adamw)})")
    return MuonWithAdamW([p for _, p in muon], [p for _, p in adamw], cfg, kernel_flags, ns_dtype, state_dtype,
                         muon_names=[name for name, _ in muon])
