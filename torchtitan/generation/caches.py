"""What each kind of token mixer keeps between decode steps, and where the tokens of a step sit.

A batch of prompts is left-padded to its longest: token t of every row sits at the same slot, and row b's real tokens
start at slot ``starts[b]`` (its RoPE positions are slot - start). Pad tokens form a document of their own, so no
real token attends to one or takes state from one, exactly as document masking keeps packed documents apart in
training. Each forward of the engine (a prefill chunk, or one decode step) covers the slots [slot0, slot0 + length).
Under sequence parallelism the engine pads a forward to a multiple of the tensor-parallel degree with ``padding``
positions after its tokens (torch's sequence-parallel layouts split the positions evenly over the ranks): a cache
neither stores nor attends from them, and gives them zeros (``DecodeStep.trim`` and ``pad``).

A cache installs itself into its layer by swapping the functions the layer already calls through attributes (the
seams context parallelism uses too): ``attention_fn`` of an attention layer, ``latent_fn`` and ``attention_fn`` of
multi-head latent attention, ``conv_fn`` and ``recurrence_fn`` of Gated DeltaNet. The layers' own code computes the
projections, norms and RoPE as in training; only what is remembered changes. A family with another kind of mixer
registers a cache for it (``register_cache``).

- Attention: keys and values (after RoPE) per key/value head, preallocated for the batch's longest total length; a
  sliding-window layer keeps a ring of its window's size, and its sinks are folded into the softmax as in training.
- Multi-head latent attention: the compressed latent and the shared rotary key per token, kv_lora_rank +
  qk_rope_head_dim numbers (DeepSeek's own inference form), not the expanded heads. Decoding takes the expanded path:
  every step runs wkv_b over the cached latents and attends as training does (the absorbed-weights form would fold
  wkv_b into the query and output instead: fewer FLOPs for long contexts, but another summation order than the
  trainer's, which the token-for-token tests against it would see).
- Gated DeltaNet: the recurrent state (float32) and the conv's last kernel - 1 inputs; a prefill chunk runs the
  chunked kernel from the state, a decode step the one-step recurrence (models/shared/gated_delta_rule.py).
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.deepseek_v3.model import MultiHeadLatentAttention
from torchtitan.models.shared.decoder import Attention
from torchtitan.models.shared.gated_delta_rule import gated_delta_step
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet, causal_short_conv, recurrence_kernel


def _local(t: torch.Tensor) -> torch.Tensor:
    # Under tensor parallelism a rank caches its own heads only.
    return t.to_local() if isinstance(t, DTensor) else t


class DecodeStep:
    """The slots of the current forward and each row's first real slot, shared by every layer's cache."""

    def __init__(self, starts: torch.Tensor, capacity: int, position_table: torch.Tensor | None = None):
        self.starts = starts  # (B,) long
        self.capacity = capacity  # slots a row may fill: the longest prompt plus the most new tokens
        # Each slot's positions where they are not slot - start: M-RoPE's (B, capacity, 3) (generation/images.py).
        self.position_table = position_table
        self.slot0, self.length, self.padding = 0, 0, 0
        self._masks: dict[tuple, torch.Tensor] = {}

    def advance(self, slot0: int, length: int, padding: int = 0) -> None:
        self.slot0, self.length, self.padding = slot0, length, padding
        self._masks.clear()

    def trim(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This forward's tokens of ``t`` along ``dim`` (the positions), without the padding after them."""
        return t.narrow(dim, 0, self.length) if self.padding else t

    def pad(self, out: torch.Tensor, dim: int) -> torch.Tensor:
        """``out`` for this forward's tokens, with zeros for the padding positions after them."""
        if not self.padding:
            return out
        shape = list(out.shape)
        shape[dim] = self.padding
        return torch.cat([out, out.new_zeros(shape)], dim=dim)

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (the others finished)."""
        self.starts = self.starts[rows]
        if self.position_table is not None:
            self.position_table = self.position_table[rows]
        self._masks.clear()

    @property
    def slots(self) -> torch.Tensor:
        return torch.arange(self.slot0, self.slot0 + self.length, device=self.starts.device)

    def ring_slots(self, size: int) -> torch.Tensor:
        """(size,) the slot each entry of a ring of ``size`` entries holds before this forward (-1: none yet): entry
        i the latest slot s < slot0 with s % size == i, since every slot before slot0 has been written."""
        latest = self.slot0 - 1 - (self.slot0 - 1 - torch.arange(size, device=self.starts.device)) % size
        return latest.clamp(min=-1)

    def real(self, slots: torch.Tensor) -> torch.Tensor:
        """(B, len(slots)) bool: which of these slots hold a row's real tokens (not its left padding)."""
        return slots[None] >= self.starts[:, None]

    def positions(self) -> torch.Tensor:
        """(B, length) RoPE positions of this forward's tokens: slot - start (pads at 0); or the position table's
        (B, length, 3)."""
        if self.position_table is not None:
            return self.position_table[:, self.slot0:self.slot0 + self.length]
        return (self.slots[None] - self.starts[:, None]).clamp(min=0)

    def resets(self) -> torch.Tensor:
        """(B, length) bool: where a row's real tokens begin (a recurrent state starts from zero there)."""
        return self.slots[None] == self.starts[:, None]

    def key_mask(self, key_slots: torch.Tensor, window: int | None, ring: bool = False) -> torch.Tensor:
        """(B, 1, length, len(key_slots)) bool, True where a query may attend to a key: causal, within the query's
        own document (padding or text), within ``window`` keys back (itself included); negative slots are empty.
        Made once per forward for the layers that share it: the full layers' keys are the slots 0..end, every
        ring's the same slots too (``ring``)."""
        cache_key = (ring, len(key_slots), window)
        if cache_key not in self._masks:
            queries = self.slots
            back = queries[:, None] - key_slots[None]  # (length, keys)
            visible = (back >= 0) & (key_slots[None] >= 0)
            if window is not None:
                visible &= back < window
            same_document = self.real(queries)[:, :, None] == self.real(key_slots.clamp(min=0))[:, None, :]
            self._masks[cache_key] = (visible[None] & same_document)[:, None]
        return self._masks[cache_key]


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (B, H, T, E) over k (B, Hkv, S, E), v (B, Hkv, S, Ev) where ``mask`` (B, 1, T, S) allows;
    ``sinks`` (H,): one more logit per head with no value (gpt-oss), in the same softmax."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    if sinks is None and v.shape[-1] == q.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    work = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(work) @ k.to(work).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(work)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    weights = scores.softmax(dim=-1)[..., : k.shape[2]]
    return (weights @ v.to(work)).to(q.dtype)


class LayerCache:
    """One layer's remembered state; ``swaps`` names the layer attributes it replaces while installed."""

    swaps: tuple[tuple[str, str], ...] = ()
    # The tensors it holds per row (batch first), which finished rows leave.
    per_row: tuple[str, ...] = ()

    def __init__(self, module: nn.Module, step: DecodeStep):
        self.module, self.step = module, step

    @staticmethod
    def bytes_per_row(module: nn.Module, capacity: int, dtype: torch.dtype, tp: int = 1) -> int:
        """What one row of ``capacity`` slots holds in this layer, in bytes; ``tp``: on one of ``tp`` tensor-parallel
        ranks, for a module built whole (the planner's, on the meta device)."""
        raise NotImplementedError

    def keep(self, rows: torch.Tensor) -> None:
        """Drop the rows not in ``rows`` (finished ones)."""
        for name in self.per_row:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])


class KeyValueCache(LayerCache):
    """Keys and values of grouped-query (or multi-head) attention; a ring of ``window`` slots for a sliding one."""

    swaps = (("attention_fn", "attend"),)
    per_row = ("k", "v")

    def __init__(self, module: nn.Module, step: DecodeStep):
        super().__init__(module, step)
        self.window = getattr(module, "window", None)
        self.k = self.v = None

    @staticmethod
    def bytes_per_row(module: nn.Module, capacity: int, dtype: torch.dtype, tp: int = 1) -> int:
        window = getattr(module, "window", None)
        slots = capacity if window is None else min(window, capacity)
        return 2 * (_local(module.wk.weight).shape[0] // tp) * slots * dtype.itemsize

    def attend(self, q, k, v, documents=None, scale=None, window=None, sinks=None):
        step = self.step
        q, k, v = (step.trim(t, 2) for t in (q, k, v))
        if self.k is None:
            size = step.capacity if self.window is None else min(self.window, step.capacity)
            # Zeros, not empty: a ring's unused entries are masked, but a masked NaN would still poison the sum.
            self.k, self.v = (t.new_zeros(t.shape[0], t.shape[1], size, t.shape[3]) for t in (k, v))
        if self.window is None:
            end = step.slot0 + step.length
            self.k[:, :, step.slot0:end], self.v[:, :, step.slot0:end] = k, v
            keys, values, key_slots = self.k[:, :, :end], self.v[:, :, :end], torch.arange(end, device=k.device)
        else:
            # The window reaches back into the ring and over this forward's own keys; then the newest overwrite the
            # oldest.
            keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            size = self.k.shape[2]
            key_slots = torch.cat([step.ring_slots(size), step.slots])
            newest = step.slots[-size:]
            self.k[:, :, newest % size], self.v[:, :, newest % size] = k[:, :, -size:], v[:, :, -size:]
        return step.pad(attend_cached(q, keys, values, step.key_mask(key_slots, window, ring=self.window is not None),
                                      scale, sinks), 2)


class LatentCache(LayerCache):
    """Multi-head latent attention's compressed latent and shared rotary key per token."""

    swaps = (("latent_fn", "remember"), ("attention_fn", "attend"))
    per_row = ("latent", "k_rope")

    def __init__(self, module: nn.Module, step: DecodeStep):
        super().__init__(module, step)
        self.latent = self.k_rope = None

    @staticmethod
    def bytes_per_row(module: nn.Module, capacity: int, dtype: torch.dtype, tp: int = 1) -> int:
        # Every tensor-parallel rank computes the latent whole (models/deepseek_v3/parallelize.py).
        return (module.kv_lora_rank + module.rope_dim) * capacity * dtype.itemsize

    def remember(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.step
        latent, k_rope = step.trim(latent, 1), step.trim(k_rope, 1)
        if self.latent is None:
            self.latent = latent.new_empty(latent.shape[0], step.capacity, latent.shape[-1])
            self.k_rope = k_rope.new_empty(k_rope.shape[0], step.capacity, *k_rope.shape[2:])
        end = step.slot0 + step.length
        self.latent[:, step.slot0:end], self.k_rope[:, step.slot0:end] = latent, k_rope
        return self.latent[:, :end], self.k_rope[:, :end]

    def attend(self, q, k, v, documents=None, scale=None, window=None, sinks=None):
        step = self.step
        # k and v are expanded from every cached latent: slots 0, 1, ... (remember returned them).
        key_slots = torch.arange(k.shape[2], device=k.device)
        return step.pad(attend_cached(step.trim(q, 2), k, v, step.key_mask(key_slots, window), scale, sinks), 2)


class RecurrentCache(LayerCache):
    """Gated DeltaNet's state per value head and its short conv's last kernel - 1 inputs."""

    swaps = (("conv_fn", "convolve"), ("recurrence_fn", "recur"))
    per_row = ("history", "history_ids", "state")

    def __init__(self, module: nn.Module, step: DecodeStep):
        super().__init__(module, step)
        self.history = self.history_ids = self.state = None

    @staticmethod
    def bytes_per_row(module: nn.Module, capacity: int, dtype: torch.dtype, tp: int = 1) -> int:
        value_heads = _local(module.in_proj_b.weight).shape[0] // tp
        channels, kernel = _local(module.conv.weight).shape
        channels //= tp
        state = value_heads * module.key_head_dim * module.value_head_dim * 4  # float32
        return state + (kernel - 1) * (channels * dtype.itemsize + 8)  # the taps and their document ids

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, documents=None) -> torch.Tensor:
        x = self.step.trim(x, 1)
        ids = self.step.real(self.step.slots).long()
        if self.history is None:
            self.history = x.new_zeros(x.shape[0], weight.shape[-1] - 1, x.shape[-1])
            self.history_ids = ids.new_full((x.shape[0], weight.shape[-1] - 1), -1)
        out = causal_short_conv(x, weight, ids, self.history, self.history_ids)
        taps = self.history.shape[1]
        if taps:
            self.history = torch.cat([self.history, x], dim=1)[:, -taps:]
            self.history_ids = torch.cat([self.history_ids, ids], dim=1)[:, -taps:]
        return self.step.pad(out, 1)

    def recur(self, q, k, v, g, beta, documents=None):
        step = self.step
        q, k, v, g, beta = (step.trim(t, 1) for t in (q, k, v, g, beta))
        if q.shape[1] == 1 and self.state is not None:  # a decode step (real tokens only: no reset)
            out, self.state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], self.state)
            return step.pad(out[:, None].to(v.dtype), 1), self.state
        out, self.state = recurrence_kernel(q.device)(q, k, v, g, beta, step.resets(), self.state)
        return step.pad(out, 1), self.state


# The cache of each kind of token mixer, by the mixer's class (the nearest registered base class counts).
_CACHES: dict[type, type[LayerCache]] = {
    Attention: KeyValueCache,
    MultiHeadLatentAttention: LatentCache,
    GatedDeltaNet: RecurrentCache,
}


def register_cache(mixer_cls: type, cache_cls: type[LayerCache]) -> None:
    """Let the engine generate with a family's own token mixer: ``cache_cls`` (a LayerCache) remembers its state."""
    _CACHES[mixer_cls] = cache_cls


def cache_class(mixer: nn.Module) -> type[LayerCache] | None:
    for cls in type(mixer).__mro__:
        if cls in _CACHES:
            return _CACHES[cls]
    return None


def mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, token mixer) of each block the model's forward runs; refuses a mixer no cache is registered for."""
    found = []
    for block in model.main_layers():
        mixer = block.attention
        if cache_class(mixer) is None:
            raise ValueError(f"block {block.layer_id}'s token mixer {type(mixer).__name__} has no generation cache; "
                             "register one with torchtitan.generation.register_cache")
        found.append((f"layers.{block.layer_id}.attention", mixer))
    return found


def cache_bytes_per_row(model: nn.Module, capacity: int, dtype: torch.dtype) -> int:
    """Bytes one row of ``capacity`` tokens takes in every layer's cache (the local heads, under tensor parallelism)."""
    return mixers_bytes_per_row([m for _, m in mixers(model)], capacity, dtype)


def mixers_bytes_per_row(token_mixers, capacity: int, dtype: torch.dtype, tp: int = 1) -> int:
    """The same for these token mixers (e.g. of a meta-device model), on one of ``tp`` tensor-parallel ranks."""
    return sum(cache_class(m).bytes_per_row(m, capacity, dtype, tp) for m in token_mixers)


@contextmanager
def installed(model: nn.Module, step: DecodeStep):
    """Every layer's cache swapped into its mixer for the block; the training functions back afterwards."""
    caches, saved = [], []
    try:
        for _, mixer in mixers(model):
            cache = cache_class(mixer)(mixer, step)
            for attribute, method in cache.swaps:
                saved.append((mixer, attribute, getattr(mixer, attribute)))
                setattr(mixer, attribute, getattr(cache, method))
            caches.append(cache)
        yield caches
    finally:
        for mixer, attribute, original in reversed(saved):
            setattr(mixer, attribute, original)
