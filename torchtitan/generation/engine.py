"""The generation engine: batched prompts through a model with every layer's state cached between decode steps.

    engine = GenerationEngine(model, cache_budget_bytes=2 << 30)
    done = engine.generate([[1, 5, 9], [1, 7]], SamplingConfig(max_new_tokens=64, temperature=0.7, top_p=0.9),
                           stop_token_ids=[tokenizer.eos_id])
    done[0].tokens, done[0].logprobs, done[0].finish_reason

How a batch runs (caches.py has what each layer keeps):
- Rows are left-padded to the longest prompt, so a decode step writes every row at the same slot; each row's RoPE
  positions start at 0 on its first real token, and its padding is a separate document no real token sees.
- The prompts are prefilled in chunks of ``prefill_chunk`` tokens, so a long prompt's activations stay bounded; only
  the last position's logits are computed (the output projection of every prompt token would be the peak).
- Each decode step feeds one token per live row. A row that finishes (a stop token, a stop string, its
  max_new_tokens) leaves the batch: its caches are compacted away, so it costs nothing afterwards.
- ``cache_budget_bytes``: the rows are split into groups (shortest prompts together) whose caches fit; a single row
  that cannot fit is refused in one line.
- Past the model's length: RoPE is tabled up to max_seq_len (training.seq_len), and a cache cannot crop its oldest
  tokens the way the old path cropped its context from the left, so a row's prompt plus new tokens stop at
  max_seq_len (finish_reason "length"); a prompt of max_seq_len tokens or more is refused.

The model may be tensor (and expert) parallel under torchrun (sharded.py builds one from a config): every rank runs
the same batch; the chosen tokens are broadcast from rank 0 so the ranks never diverge. Under tensor parallelism the
hidden states between blocks are sequence shards, which torch's layouts split evenly: each forward is padded to a
multiple of the TP degree (caches.py), and the head gets the last real position, gathered. ``load_weights``
replaces the weights in place (RL's policy update). MoE layers route every token as in training (dropless); their
load statistics are left as training had them.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan.generation.caches import DecodeStep, cache_bytes_per_row, installed, mixers
from torchtitan.generation.images import GroupImages, Images, check_prompt_images
from torchtitan.generation.sampling import SamplingConfig, choose
from torchtitan.models.shared.moe import load_statistics_kept


@dataclass
class Completion:
    """One prompt's new tokens and, for each, the log-probability it was chosen with (sampling.py says which)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    """"stop" (a stop token or string; the token is included) or "length" (max_new_tokens or max_seq_len)."""
    text: str | None = None
    """With a ``decode`` function: the new text, cut before the first stop string."""
    logits: list[torch.Tensor] | None = None
    """With keep_logits: the float32 logits each token was chosen from."""


class GenerationEngine:
    def __init__(self, model: nn.Module, *, cache_budget_bytes: int | None = None, prefill_chunk: int = 256,
                 group: dist.ProcessGroup | None = None, per_rank: bool = False):
        """``group``: the ranks that run the same batch, whose tokens are made to agree (default: every rank, under
        torchrun); ``per_rank``: each rank generates its own prompts (a whole model per rank, e.g. data-parallel
        evaluation), so nothing is agreed across ranks."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk = {prefill_chunk} is invalid; it must be >= 1")
        if cache_budget_bytes is not None and cache_budget_bytes < 1:
            raise ValueError(f"cache_budget_bytes = {cache_budget_bytes} is invalid; it must be >= 1 (or None: "
                             "no limit)")
        self.model = model
        mixers(model)  # refuses a mixer without a cache now, not at the first generate
        self.cache_budget_bytes = cache_budget_bytes
        self.prefill_chunk = prefill_chunk
        self.max_seq_len = model.args.max_seq_len
        self.vocab_size = model.args.vocab_size
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self._tp_mesh = _tensor_parallel_mesh(model)
        self._tp = self._tp_mesh.size() if self._tp_mesh is not None else 1
        if per_rank and group is not None:
            raise ValueError("per_rank = True generates on each rank alone; leave group out")
        self.group = group if group is not None or per_rank or not dist.is_initialized() else dist.group.WORLD

    def cache_bytes(self, rows: int, length: int) -> int:
        """The caches' bytes for ``rows`` rows of ``length`` tokens (prompt + new) on this rank."""
        return rows * cache_bytes_per_row(self.model, length, self.dtype)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None, keep_logits: bool = False,
                 images: Sequence[Images] | None = None) -> list[Completion]:
        """One Completion per prompt (token ids), in order. ``stop_strings`` need ``decode`` (token ids -> text).
        ``images``: for a vision-language model, each prompt's images (generation/images.py)."""
        sampling.check()
        self._check(prompts, stop_strings, decode)
        if images is not None:
            check_prompt_images(self.model, prompts, images)
        budgets = [min(sampling.max_new_tokens, self.max_seq_len - len(p)) for p in prompts]
        groups = self._groups(prompts, budgets)
        generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        results: list[Completion | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            with load_statistics_kept(self.model):
                for group in groups:
                    done = self._generate_group([prompts[i] for i in group], [budgets[i] for i in group], sampling,
                                                generator, set(stop_token_ids), list(stop_strings), decode,
                                                keep_logits, None if images is None else [images[i] for i in group])
                    for i, completion in zip(group, done):
                        results[i] = completion
        finally:
            self.model.train(was_training)
        return results

    def _check(self, prompts, stop_strings, decode) -> None:
        if not prompts:
            raise ValueError("prompts is empty; give at least one prompt (a list of token ids)")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; it needs at least one token (e.g. BOS)")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; the model's max_seq_len is {self.max_seq_len} "
                                 "(training.seq_len), so a prompt may have at most max_seq_len - 1")
            low, high = min(prompt), max(prompt)
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"prompt {i} has token id {low if low < 0 else high}; ids must be in "
                                 f"[0, {self.vocab_size})")
        if stop_strings and decode is None:
            raise ValueError("stop_strings need a decode function (token ids -> text) to be seen")

    def _groups(self, prompts, budgets) -> list[list[int]]:
        """Prompt indices in groups whose caches fit the budget: the shortest prompts first, so that a group's
        padding stays small."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        if self.cache_budget_bytes is None:
            return [order]
        groups: list[list[int]] = []
        for i in order:
            candidate = (groups[-1] if groups else []) + [i]
            if groups and self._fits(candidate, prompts, budgets):
                groups[-1] = candidate
                continue
            if not self._fits([i], prompts, budgets):
                need = self.cache_bytes(1, len(prompts[i]) + budgets[i])
                raise ValueError(f"cache_budget_bytes = {self.cache_budget_bytes} cannot hold prompt {i} alone "
                                 f"({len(prompts[i])} + {budgets[i]} new tokens need {need} bytes); raise it or "
                                 "lower max_new_tokens")
            groups.append([i])
        return groups

    def _fits(self, group, prompts, budgets) -> bool:
        longest = max(len(prompts[i]) for i in group)
        capacity = longest + max(budgets[i] for i in group)
        return self.cache_bytes(len(group), capacity) <= self.cache_budget_bytes

    def _generate_group(self, prompts, budgets, sampling, generator, stop_ids, stop_strings, decode,
                        keep_logits, images) -> list[Completion]:
        rows = len(prompts)
        longest = max(len(p) for p in prompts)
        tokens = torch.zeros(rows, longest, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            tokens[b, longest - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        tokens = tokens.to(self.device)
        starts = torch.tensor([longest - len(p) for p in prompts], device=self.device)
        capacity = longest + max(budgets)
        shown = None if images is None else GroupImages(self.model, prompts, images, capacity, self.device)
        step = DecodeStep(starts, capacity, None if shown is None else shown.position_table)
        completions = [Completion(logits=[] if keep_logits else None) for _ in prompts]
        live = list(range(rows))  # the completions of the batch's rows, in row order
        with installed(self.model, step) as caches:
            for slot0 in range(0, longest, self.prefill_chunk):
                end = min(slot0 + self.prefill_chunk, longest)
                logits = self._forward(step, tokens[:, slot0:end], slot0,
                                       shown.prefill_inputs(slot0, end) if shown is not None else {})
            slot = longest
            while True:
                chosen, logprobs = choose(logits, sampling, generator)
                chosen, logprobs = self._agree(chosen, logprobs)
                keep = []
                for row, (b, token, logprob) in enumerate(zip(live, chosen.tolist(), logprobs.tolist())):
                    completion = completions[b]
                    completion.tokens.append(token)
                    completion.logprobs.append(logprob)
                    if keep_logits:
                        completion.logits.append(logits[row].float().cpu())
                    if not self._finished(completion, token, budgets[b], stop_ids, stop_strings, decode):
                        keep.append(row)
                if not keep:
                    break
                if len(keep) < len(live):
                    index = torch.tensor(keep, device=self.device)
                    step.keep(index)
                    for cache in caches:
                        cache.keep(index)
                    chosen = chosen[index]
                    live = [live[row] for row in keep]
                logits = self._forward(step, chosen[:, None], slot)
                slot += 1
        if decode is not None:
            for completion in completions:
                completion.text = _cut(decode(completion.tokens), stop_strings)
        return completions

    def _forward(self, step: DecodeStep, tokens: torch.Tensor, slot0: int,
                 images: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The logits (rows, vocab) after these tokens, which sit at slots slot0, slot0 + 1, ...; ``images``: the
        image inputs of a prefill chunk (generation/images.py)."""
        images = dict(images or {})
        length = tokens.shape[1]
        # Sequence parallelism splits the positions evenly over the TP ranks (a decode step has one): pad with
        # copies of the last token, which the caches neither store nor attend from (caches.py).
        padding = -length % self._tp
        step.advance(slot0, length, padding)
        positions = step.positions()
        if padding:
            tokens, positions = (_pad_last(t, padding) for t in (tokens, positions))
            if "image_index" in images:
                images["image_index"] = _pad_last(images["image_index"], padding)
        h = self.model.run_blocks(tokens, None, positions, **images)
        if self._tp_mesh is not None:
            # Each rank holds a slice of the positions: gather them, so that every rank hands the head the same
            # last position (the head's plan, reading its input as sequence shards, sees tp copies of it).
            h = DTensor.from_local(h, self._tp_mesh, [Shard(1)], run_check=False).full_tensor()
        logits = self.model.head(h[:, length - 1:length])
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[:, -1]

    def _agree(self, chosen: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's choice on every rank: sampling on ranks whose logits differ in the last bit would split them."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return chosen, logprobs
        dist.broadcast(chosen, src=dist.get_global_rank(self.group, 0), group=self.group)
        dist.broadcast(logprobs, src=dist.get_global_rank(self.group, 0), group=self.group)
        return chosen, logprobs

    @staticmethod
    def _finished(completion: Completion, token: int, budget: int, stop_ids, stop_strings, decode) -> bool:
        if token in stop_ids:
            completion.finish_reason = "stop"
            return True
        if stop_strings:
            text = decode(completion.tokens)  # once for all the stop strings
            if any(s in text for s in stop_strings):
                completion.finish_reason = "stop"
                return True
        return len(completion.tokens) >= budget

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the model's parameters and persistent buffers in place from ``state`` (name -> full tensor or
        DTensor of any layout, e.g. a training model's state_dict()); the model is not rebuilt, each rank keeps
        its own shard of the new values."""
        own = self.model.state_dict()
        missing = [name for name in own if name not in state]
        unexpected = [name for name in state if name not in own]
        if missing or unexpected:
            raise ValueError(f"load_weights: the state does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, target in own.items():
            source = state[name]
            if isinstance(source, DTensor):
                source = source.full_tensor()
            source = source.detach().to(device=target.device, dtype=target.dtype)
            if isinstance(target, DTensor):
                # Every rank holds the full tensor: each keeps its own slice, without communication.
                source = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=None)
                source, target = source.to_local(), target.to_local()
            if source.shape != target.shape:
                raise ValueError(f"load_weights: {name} has shape {tuple(source.shape)}; the model's is "
                                 f"{tuple(target.shape)}")
            target.copy_(source)


def _tensor_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The TP mesh when the model is tensor parallel (its embedding sharded over a "tp" mesh dimension, as
    distributed/parallel_dims.py names it), else None; the hidden states between its blocks are then sequence
    shards."""
    weight = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    if not isinstance(weight, DTensor) or "tp" not in (weight.device_mesh.mesh_dim_names or ()):
        return None
    mesh = weight.device_mesh
    return mesh if mesh.ndim == 1 else mesh["tp"]


def _pad_last(t: torch.Tensor, padding: int) -> torch.Tensor:
    """``t`` with its last position (dimension 1) repeated ``padding`` more times."""
    return torch.cat([t, t[:, -1:].expand(-1, padding, *t.shape[2:])], dim=1)


def _cut(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` before the first stop string in it."""
    return text[:min([text.index(s) for s in stop_strings if s in text], default=len(text))]
