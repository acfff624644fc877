"""Exact context-parallel (CP) causal attention that runs on CPU/gloo and GPU/NCCL alike.

The sequence is split over the ``cp`` ranks of a group. Causal attention is lopsided: the last tokens
attend to everything, the first to almost nothing. Handing rank ``r`` the contiguous ``r``-th slice
would leave the last rank with most of the work, so the sequence is cut into ``2 * cp`` equal chunks
and rank ``r`` holds chunk ``r`` (its "head") followed by chunk ``2*cp - 1 - r`` (its "tail"). Every
rank then does the same amount of attention work.

Each rank attends its queries to key/value blocks from the other ranks and combines the partial results
with their log-sum-exp (LSE), which is exact. Blocks that lie wholly above the causal diagonal are never
computed. Two ways to bring the keys/values over are offered:

* ``"allgather"``: gather all keys/values once, attend, and reduce-scatter their gradients in backward.
  Simple and few collectives; holds the full-length keys/values for the duration of the call.
* ``"ring"``: pass key/value blocks around the ring with send/recv, overlapping transfer with compute;
  only two blocks are resident at a time. Gradients of keys/values travel around with them in backward.

Backward does not differentiate through the merge. Given the merged output ``O`` and LSE ``L`` of a
query row, the gradient of each key/value block is what a flash-attention backward computes from that
block alone using ``O`` and ``L`` in place of its own partial ones, so each block's gradient is recomputed
independently and summed (the standard flash/ring attention backward).
"""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import Parallelism, Training, Validation
from torchtitan.log import logger
from torchtitan.models.shared.attention import (
    DocumentMask,
    _note_max_logits,
    document_spans,
    noting_max_logits,
    with_value_head_size,
)
from torchtitan.models.shared.attention_kernels import (
    _compute_dtype,
    _pick_kernel,
    _run_block,
    check_window,
    fold_sinks,
    sink_grad,
)

METHODS = ("allgather", "ring")


# ----------------------------------------------------------------------------------------------------------
# Head-tail layout
# ----------------------------------------------------------------------------------------------------------


def check_cp_seq_len(seq_len: int, cp: int, tp: int = 1) -> None:
    """Raise ``ValueError`` unless ``seq_len`` can be head-tail sharded over ``cp`` ranks.

    The sequence is cut into ``2 * cp`` chunks, so it must be a multiple of ``2 * cp``. Pass ``tp > 1``
    only when tensor parallelism also shards the sequence (sequence parallel): each rank's ``seq_len / cp``
    tokens must then split evenly over ``tp`` too.
    """
    if cp < 1 or tp < 1:
        raise ValueError(f"cp={cp} and tp={tp} must both be at least 1")
    multiple = math.lcm(2 * cp, cp * tp)
    if seq_len > 0 and seq_len % multiple == 0:
        return
    lower = max(seq_len // multiple * multiple, multiple)
    upper = (max(seq_len, 0) // multiple + 1) * multiple
    nearest = f"{lower} or {upper}" if lower != upper else f"{lower}"
    if tp > 1:
        raise ValueError(f"seq_len {seq_len} does not split over cp={cp} (2*cp chunks) and then tp={tp} "
                         f"(sequence parallel): it must be a positive multiple of {multiple}, e.g. {nearest}")
    raise ValueError(f"seq_len {seq_len} must be a positive multiple of 2*cp = {2 * cp} for cp={cp}, "
                     f"e.g. {nearest}")


def config_problems(p: Parallelism, t: Training, v: Validation) -> list[tuple[str, str]]:
    """The first problem (full config key, reason) with context parallelism as configured, or []."""
    if p.context_parallel_degree == 1:
        return []
    try:
        check_cp_seq_len(t.seq_len, p.context_parallel_degree, p.tensor_parallel_degree)
    except ValueError as e:
        return [("training.seq_len", f"cannot be split for context parallelism: {e}")]
    if v.enable and v.seq_len != t.seq_len:
        # Context parallelism picks each rank's RoPE positions for the training length once.
        return [("validation.seq_len", f"must equal training.seq_len = {t.seq_len} with context parallelism")]
    return []


def _chunk_starts(seq_len: int, cp_rank: int, cp: int) -> tuple[int, int, int]:
    check_cp_seq_len(seq_len, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is out of range for cp={cp}: expected 0..{cp - 1}")
    chunk = seq_len // (2 * cp)
    return chunk, cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk


def shard_sequence(t: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's head-tail shard of the full-length tensor ``t`` along ``dim``: chunks r and 2*cp-1-r."""
    chunk, head, tail = _chunk_starts(t.size(dim), cp_rank, cp)
    return torch.cat([t.narrow(dim, head, chunk), t.narrow(dim, tail, chunk)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Reassemble the full sequence from every rank's shard (``shards[r]`` from rank r) along ``dim``."""
    cp = len(shards)
    if cp == 0:
        raise ValueError("unshard_sequence needs at least one shard, got none")
    heads, tails = zip(*(s.chunk(2, dim=dim) for s in shards))
    return torch.cat([*heads, *reversed(tails)], dim=dim)


def full_document_ids(documents: DocumentMask, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence's document ids (B, S) from every rank's head-tail shard of them, gathered once per
    forward (cached on ``documents``) for all the layers."""
    full = documents.cache.get("cp_full_ids")
    if full is None:
        ids = documents.ids
        cp = 1 if group is None else dist.get_world_size(group)
        if cp == 1:
            full = ids
        else:
            out = ids.new_empty(cp * ids.size(0), ids.size(1))
            dist.all_gather_into_tensor(out, ids.contiguous(), group=group)
            full = unshard_sequence(list(out.view(cp, *ids.shape)), dim=1)
        documents.cache["cp_full_ids"] = full
    return full


def cp_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions (e.g. for RoPE) of the tokens this rank holds, in its local order."""
    chunk, head, tail = _chunk_starts(seq_len, cp_rank, cp)
    return torch.cat([torch.arange(head, head + chunk, device=device),
                      torch.arange(tail, tail + chunk, device=device)])


# ----------------------------------------------------------------------------------------------------------
# The CP attention itself
# ----------------------------------------------------------------------------------------------------------


class _Ctx:
    """What both methods share: the group, shapes, kernel choice, and the per-block forward/backward."""

    def __init__(self, group, q, k, method, scale, use_kernel, documents: DocumentMask | None = None,
                 window: int | None = None):
        self.group = group
        self.cp = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.method = method
        self.batch, self.heads, self.local_len, self.head_dim = q.shape
        self.kv_heads = k.size(1)
        self.chunk = self.local_len // 2
        self.scale = scale
        self.dtype = _compute_dtype(q)
        self.kernel = _pick_kernel(q.device, self.dtype, self.head_dim, use_kernel)
        # A sliding window: blocks get explicit masks from the global positions of their queries and keys, and a
        # block no query of which sees any of its keys is skipped (counted in ``skipped``).
        self.window = window
        self.q_pos = cp_positions(self.local_len * self.cp, self.rank, self.cp, device=q.device)
        self.skipped = 0
        # Block-causal attention: our tokens' document ids, the whole sequence's (in order), and the
        # per-document sub-blocks of each block, found once per forward and shared by all layers.
        self.documents = documents
        if documents is not None:
            self.local_ids = documents.ids
            self.full_ids = full_document_ids(documents, group)

    def document_blocks(self, key, rows: slice, key_ids: torch.Tensor):
        """None without documents; else (batch row, query start, end, key start, end) for every document
        present both in our query ``rows`` and in the block's keys (ids ``key_ids``), rows counted from
        ``rows.start``. Document ids never decrease along either side, so each document is one sub-block:
        attending it alone is exact, and a block whose documents do not meet costs nothing."""
        if self.documents is None:
            return None
        cache_key = ("cp_blocks", key)
        if cache_key not in self.documents.cache:
            self.documents.cache[cache_key] = _shared_documents(self.local_ids[:, rows], key_ids)
        return self.documents.cache[cache_key]

    @staticmethod
    def _fold(acc_out, acc_lse, out, lse, index):
        old_lse = acc_lse[index]
        lse = lse.to(old_lse.dtype)
        new_lse = torch.logaddexp(old_lse, lse)
        # A side that saw no key yet (lse -inf) weighs 0, also when both have none (where exp(-inf + inf) = nan).
        old_weight = torch.where(old_lse == float("-inf"), 0.0, torch.exp(old_lse - new_lse))
        new_weight = torch.where(lse == float("-inf"), 0.0, torch.exp(lse - new_lse))
        acc_out[index] = (acc_out[index] * old_weight.unsqueeze(-1)
                          + out.to(acc_out.dtype) * new_weight.unsqueeze(-1))
        acc_lse[index] = new_lse

    def key_positions(self, src: int) -> torch.Tensor:
        """Global positions of rank ``src``'s keys, in its local (head, tail) order."""
        return cp_positions(self.local_len * self.cp, src, self.cp, device=self.q_pos.device)

    def mask(self, causal, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """What a block's kernel is given: ``causal`` without a window; with one, the (queries, keys) bool mask of
        the window (None: no query sees any key, skip the block)."""
        if self.window is None:
            return causal
        back = q_pos[:, None] - k_pos[None, :]
        visible = (back >= 0) & (back < self.window)
        if not visible.any():
            self.skipped += 1
            return None
        return visible

    def run(self, backward: bool, mask, *args):
        """One block on the kernel, or on the math block where a query row of the mask sees no key (what the
        fused kernels do with such rows is not defined; the math block gives out 0 and lse -inf)."""
        kernel = self.kernel
        if isinstance(mask, torch.Tensor) and not mask.any(-1).all():
            kernel = "math"
        return _run_block(kernel, backward, *args, mask, self.scale)

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """(2, B, Hkv, L, D) stacked k/v -> (2, B, H, L, D) in the compute dtype (grouped-query attention)."""
        kv = kv.to(self.dtype)
        groups = self.heads // self.kv_heads
        if groups == 1:
            return kv
        two, b, hkv, n, d = kv.shape
        return kv.unsqueeze(3).expand(two, b, hkv, groups, n, d).reshape(two, b, hkv * groups, n, d)

    def reduce_heads(self, dkv: torch.Tensor) -> torch.Tensor:
        """Inverse of ``expand`` for gradients: sum each key/value head's query group."""
        groups = self.heads // self.kv_heads
        if groups == 1:
            return dkv
        two, b, _, n, d = dkv.shape
        return dkv.view(two, b, self.kv_heads, groups, n, d).sum(3)

    def parts(self, rows, causal, blocks, k_pos, n_keys):
        """Yield (batch rows, query rows, key range, mask) of every part of a block that computes: the whole block,
        or with ``blocks`` (see document_blocks) each document's rows against its own keys; with a window, each
        part's keys cut to those some query sees (the rest of a long block is never read)."""
        q_pos = self.q_pos[rows]
        first = rows.start or 0
        pieces = [(slice(None), 0, len(q_pos), 0, n_keys)] if blocks is None else [
            (slice(b, b + 1), qs, qe, ks, ke) for b, qs, qe, ks, ke in blocks]
        for batch, qs, qe, ks, ke in pieces:
            if (mask := self.mask(causal, q_pos[qs:qe], k_pos[ks:ke])) is None:
                continue
            if isinstance(mask, torch.Tensor):
                seen = mask.any(0).nonzero().flatten().tolist()
                mask, ks, ke = mask[:, seen[0]: seen[-1] + 1], ks + seen[0], ks + seen[-1] + 1
            yield batch, slice(first + qs, first + qe), slice(ks, ke), mask

    def forward_block(self, acc_out, acc_lse, q, kv, rows, causal, blocks=None, k_pos=None):
        """Attend q[rows] to the block kv = (k, v) (keys at global positions ``k_pos``) and fold the result into
        the running (out, lse)."""
        for batch, q_rows, keys, mask in self.parts(rows, causal, blocks, k_pos, kv.shape[-2]):
            index = (batch, slice(None), q_rows)
            out, lse = self.run(False, mask, q[index].contiguous(), kv[0, batch, :, keys].contiguous(),
                                kv[1, batch, :, keys].contiguous())
            self._fold(acc_out, acc_lse, out, lse, index)

    def backward_block(self, dq, dout, q, out, lse, kv, rows, causal, blocks=None, k_pos=None):
        """Add this block's query gradient into ``dq`` and return its (dk, dv) stacked, in float32 (or the
        inputs' wider dtype)."""
        work = dq.dtype
        dkv = torch.zeros(kv.shape, dtype=work, device=kv.device)
        for batch, q_rows, keys, mask in self.parts(rows, causal, blocks, k_pos, kv.shape[-2]):
            index = (batch, slice(None), q_rows)
            grads = self.run(True, mask, dout[index].contiguous(), q[index].contiguous(),
                             kv[0, batch, :, keys].contiguous(), kv[1, batch, :, keys].contiguous(),
                             out[index].contiguous(), lse[index].contiguous())
            dq[index] += grads[0].to(work)
            dkv[0, batch, :, keys] += grads[1].to(work)
            dkv[1, batch, :, keys] += grads[2].to(work)
        return self.reduce_heads(dkv)

    # -- ring: which rows of ours attend to which part of the block that started on rank ``src`` -------------
    def ring_block(self, src: int, kv: torch.Tensor):
        """(our query rows, part of kv, causal, document sub-blocks) for our queries against rank ``src``'s
        keys/values.

        With src == rank the local head+tail layout is itself causal in one square block. A lower rank's
        head chunk precedes both of our chunks and its tail follows both; a higher rank's chunks both lie
        between our head and tail, so only our tail sees them. Everything else is above the diagonal.
        """
        if src == self.rank:
            rows, block, causal = slice(None), kv, True
        elif src < self.rank:
            rows, block, causal = slice(None), kv[..., : self.chunk, :], False
        else:
            rows, block, causal = slice(self.chunk, None), kv, False
        blocks = None
        if self.documents is not None:
            key_ids = shard_sequence(self.full_ids, 1, src, self.cp)[:, : block.size(-2)]
            blocks = self.document_blocks(("ring", src), rows, key_ids)
        return rows, block, causal, blocks

    # -- allgather: the full sequence's keys/values in global order --------------------------------------
    def to_global(self, gathered: torch.Tensor) -> torch.Tensor:
        """(cp, 2, B, H, 2c, D) rank-major shards -> (2, B, H, S, D) in sequence order."""
        c = self.chunk
        chunks = torch.cat([gathered[..., :c, :], gathered[..., c:, :].flip(0)])  # (2cp, 2, B, H, c, D)
        two, b, h, d = chunks.size(1), chunks.size(2), chunks.size(3), chunks.size(5)
        return chunks.permute(1, 2, 3, 0, 4, 5).reshape(two, b, h, 2 * self.cp * c, d)

    def from_global(self, full: torch.Tensor) -> torch.Tensor:
        """Inverse of ``to_global``."""
        two, b, h, _, d = full.shape
        chunks = full.view(two, b, h, 2 * self.cp, self.chunk, d).permute(3, 0, 1, 2, 4, 5)
        return torch.cat([chunks[: self.cp], chunks[self.cp:].flip(0)], dim=-2).contiguous()

    def allgather_blocks(self):
        """Yield (query rows, key range, causal, document sub-blocks): each local chunk against all earlier
        chunks, then itself."""
        c = self.chunk
        for rows, index in ((slice(0, c), self.rank), (slice(c, None), 2 * self.cp - 1 - self.rank)):
            blocks = []
            if index > 0:
                blocks.append((rows, slice(0, index * c), False))
            blocks.append((rows, slice(index * c, (index + 1) * c), True))
            for rows_, keys, causal in blocks:
                documents = None
                if self.documents is not None:
                    key = ("allgather", rows_.start, keys.start, keys.stop)
                    documents = self.document_blocks(key, rows_, self.full_ids[:, keys])
                yield rows_, keys, causal, documents

    def all_gather(self, kv: torch.Tensor) -> torch.Tensor:
        """(2, B, Hkv, L, D) -> (cp, 2, B, Hkv, L, D), rank-major. Collectives concatenate along dim 0."""
        out = kv.new_empty(self.cp * kv.size(0), *kv.shape[1:])
        dist.all_gather_into_tensor(out, kv.contiguous(), group=self.group)
        return out.view(self.cp, *kv.shape)

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """Sum (cp, 2, B, Hkv, L, D) over the ranks and keep this rank's (2, B, Hkv, L, D)."""
        full = full.flatten(0, 1)
        out = full.new_empty(full.size(0) // self.cp, *full.shape[1:])
        try:
            dist.reduce_scatter_tensor(out, full, group=self.group)
        except (RuntimeError, NotImplementedError):
            # Some gloo builds lack reduce-scatter; elsewhere a failed collective is a real error.
            if dist.get_backend(self.group) != "gloo":
                raise
            dist.all_reduce(full, group=self.group)
            out = full.view(self.cp, *out.shape)[self.rank]
        return out


def _exchange(send: torch.Tensor, recv: torch.Tensor, ctx: _Ctx, tag: int):
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
    nxt, prev = (dist.get_global_rank(ctx.group, (ctx.rank + step) % ctx.cp) for step in (1, -1))
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, ctx.group, tag),
                                   dist.P2POp(dist.irecv, recv, prev, ctx.group, tag)])


def _wait(works) -> None:
    for work in works:
        work.wait()


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cp: _Ctx):
        kv = torch.stack([k, v]).contiguous()
        qc = q.to(cp.dtype)
        work = torch.promote_types(cp.dtype, torch.float32)
        acc_out = torch.zeros(q.shape, dtype=work, device=q.device)
        acc_lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
        if cp.method == "allgather" and cp.cp > 1:
            full = cp.expand(cp.to_global(cp.all_gather(kv)))
            for rows, keys, causal, blocks in cp.allgather_blocks():
                cp.forward_block(acc_out, acc_lse, qc, full[..., keys, :], rows, causal, blocks,
                                 torch.arange(keys.start, keys.stop, device=q.device))
        else:
            for step in range(cp.cp):
                works = None
                if step < cp.cp - 1:
                    incoming = torch.empty_like(kv)
                    works = _exchange(kv, incoming, cp, tag=0)
                src = (cp.rank - step) % cp.cp
                rows, block, causal, blocks = cp.ring_block(src, cp.expand(kv))
                cp.forward_block(acc_out, acc_lse, qc, block, rows, causal, blocks,
                                 cp.key_positions(src)[: block.size(-2)])
                if works is not None:
                    _wait(works)
                    kv = incoming
        if sinks is not None:
            # The sink joins each query's softmax once, here, not once per block or rank.
            acc_out, acc_lse = fold_sinks(acc_out, acc_lse, sinks)
        if cp.window is not None and cp.skipped:
            logger.debug(f"context parallel: {cp.skipped} blocks outside every query's window skipped")
        out = acc_out.to(cp.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse, sinks)
        ctx.cp = cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp: _Ctx = ctx.cp
        kv = torch.stack([k, v]).contiguous()
        qc, doutc = q.to(cp.dtype), dout.to(cp.dtype)
        work = lse.dtype
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        args = (dq, doutc, qc, out, lse)
        if cp.method == "allgather" and cp.cp > 1:
            # Gather again rather than keep the full-length keys/values alive between forward and backward.
            full = cp.expand(cp.to_global(cp.all_gather(kv)))
            dfull = torch.zeros((2, *k.shape[:2], full.size(-2), k.size(-1)), dtype=work, device=q.device)
            for rows, keys, causal, blocks in cp.allgather_blocks():
                dfull[..., keys, :] += cp.backward_block(*args, full[..., keys, :], rows, causal, blocks,
                                                         torch.arange(keys.start, keys.stop, device=q.device))
            dkv = cp.reduce_scatter(cp.from_global(dfull))
        else:
            # The gradient of each key/value block travels the ring with it and arrives home after cp hops.
            dkv, dkv_works = None, None
            for step in range(cp.cp):
                works = None
                if step < cp.cp - 1:
                    incoming = torch.empty_like(kv)
                    works = _exchange(kv, incoming, cp, tag=1)
                src = (cp.rank - step) % cp.cp
                rows, block, causal, blocks = cp.ring_block(src, cp.expand(kv))
                block_grad = torch.zeros((2, *kv.shape[1:]), dtype=work, device=q.device)
                block_grad[..., : block.size(-2), :] = cp.backward_block(*args, block, rows, causal, blocks,
                                                                         cp.key_positions(src)[: block.size(-2)])
                if dkv_works is not None:
                    _wait(dkv_works)
                    block_grad += dkv
                dkv = block_grad
                if cp.cp > 1:  # pass it on; the receive is waited for before the next use
                    dkv = torch.empty_like(block_grad)
                    dkv_works = _exchange(block_grad, dkv, cp, tag=2)
                if works is not None:
                    _wait(works)
                    kv = incoming
            if dkv_works is not None:
                _wait(dkv_works)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None


def _shared_documents(query_ids: torch.Tensor, key_ids: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """(row, query start, end, key start, end) of each document that has both query rows and keys."""
    blocks = []
    q_rows, k_rows = query_ids.tolist(), key_ids.tolist()
    for b, (q_spans, k_spans) in enumerate(zip(document_spans(query_ids), document_spans(key_ids))):
        keys = {k_rows[b][start]: (start, end) for start, end in k_spans}
        for start, end in q_spans:
            if (span := keys.get(q_rows[b][start])) is not None:
                blocks.append((b, start, end, *span))
    return blocks


def _resolve_group(cp_group_or_mesh):
    if cp_group_or_mesh is None:
        return None
    if isinstance(cp_group_or_mesh, DeviceMesh):
        if cp_group_or_mesh.ndim != 1:
            raise ValueError(f"context parallel needs a 1-D cp mesh, got a {cp_group_or_mesh.ndim}-D mesh "
                             f"{cp_group_or_mesh.mesh_dim_names}; pass mesh['cp'] instead")
        return cp_group_or_mesh.get_group()
    if isinstance(cp_group_or_mesh, dist.ProcessGroup):
        return cp_group_or_mesh
    raise ValueError(f"cp_group_or_mesh must be a 1-D DeviceMesh, a ProcessGroup or None, "
                     f"got {type(cp_group_or_mesh).__name__}")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cp_group_or_mesh: DeviceMesh | dist.ProcessGroup | None,
                               method: str = "allgather", scale: float | None = None, *,
                               use_kernel: bool = True, documents: DocumentMask | None = None,
                               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of head-tail sharded q (B, H, L, D) and k/v (B, Hkv, L, D) over a CP group.

    Returns this rank's (B, H, L, D) rows of causal attention over the full, unsharded sequence, with
    exact gradients for q, k and v. ``Hkv`` must divide ``H`` (grouped-query attention). ``method`` is
    ``"allgather"`` or ``"ring"`` (see the module docstring); ``scale`` defaults to ``1/sqrt(D)``.
    ``cp_group_or_mesh`` is the 1-D cp DeviceMesh or its ProcessGroup; None means a single rank.
    ``use_kernel=False`` forces the pure-PyTorch math blocks instead of the fused SDPA kernels.
    ``documents`` (this rank's head-tail shard of the document ids) makes it block-causal: no token
    attends across a document boundary, also where a document spans several ranks. ``window`` and ``sinks`` as in
    models/shared/attention.py: a sliding window (blocks outside every query's window are skipped) and a learned logit
    per head (H,) joining each query's softmax once.
    """
    if method not in METHODS:
        raise ValueError(f"context parallel method {method!r} is not one of {', '.join(METHODS)}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q (B, H, L, D) and k, v of one (B, Hkv, L, D) shape, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if (k.size(0), k.size(2), k.size(3)) != (q.size(0), q.size(2), q.size(3)) or q.size(1) % k.size(1):
        raise ValueError(f"k/v shape {tuple(k.shape)} does not fit q {tuple(q.shape)}: batch, length and "
                         f"head_dim must match and the kv heads must divide the {q.size(1)} query heads")
    if q.size(2) % 2:
        raise ValueError(f"local sequence length {q.size(2)} must be even (a head and a tail chunk per rank)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    if documents is not None and documents.ids.shape != (q.size(0), q.size(2)):
        raise ValueError(f"document ids of shape {tuple(documents.ids.shape)} do not match the (batch, local "
                         f"length) = {(q.size(0), q.size(2))} of q")
    check_window(window)
    ctx = _Ctx(_resolve_group(cp_group_or_mesh), q, k, method, scale, use_kernel, documents, window)
    return _CPAttention.apply(q, k, v, sinks, ctx)


@torch.compiler.disable
def context_parallel_max_logits(into: torch.Tensor, q: torch.Tensor, k: torch.Tensor, documents: DocumentMask | None,
                                scale: float | None, window: int | None = None, *,
                                cp_group_or_mesh: DeviceMesh | dist.ProcessGroup | None) -> None:
    """models/shared/attention.py's note_max_logits (QK-clip's per-head largest logit) for head-tail sharded q and k
    (and document ids) over a CP group: exactly what it notes on the whole sequence, max-reduced over the ranks.

    Each rank gathers the keys (and the document ids, which the attention shares) once, without gradients, and
    measures its head and tail query rows at their global positions against all of them: one more all-gather of
    k per attention layer per training forward, for the measurement only. Every rank of the group must call it
    alike; it notes (and gathers) only in training forwards, a decision all ranks share.
    """
    if not noting_max_logits():
        return
    group = _resolve_group(cp_group_or_mesh)
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        full_k, full_ids = k.detach(), None if documents is None else full_document_ids(documents, group)
        if cp > 1:
            out = full_k.new_empty(cp * k.size(0), *k.shape[1:])
            dist.all_gather_into_tensor(out, full_k.contiguous(), group=group)
            full_k = unshard_sequence(list(out.view(cp, *k.shape)), dim=2)
        chunk, head, tail = _chunk_starts(full_k.size(2), rank, cp)
        for rows, first_position in ((slice(0, chunk), head), (slice(chunk, 2 * chunk), tail)):
            q_ids = None if documents is None else documents.ids[:, rows]
            _note_max_logits(into, q[:, :, rows], full_k, scale, window, q_ids, full_ids, first_position)


def apply_context_parallel(model: torch.nn.Module, cp_mesh: DeviceMesh, seq_len: int, method: str) -> None:
    """Make every attention module of ``model`` attend over the cp-sharded sequence.

    A model opts in by giving its attention modules an ``attention_fn(q, k, v, documents=None)`` attribute
    and a ``forward(x, rope, ..., positions=None)`` whose RoPE table is indexed by position; a ``max_logit_fn``
    (QK-clip's measurement) becomes context_parallel_max_logits over the same group. Each rank's
    tokens are its head and tail chunks, so without explicit ``positions`` its RoPE rows are those of
    ``cp_positions``; the training sequence length is fixed, so the rows are chosen once here rather than
    passed through the model on every call. Explicit positions (sharded like the tokens) are used as given.
    """
    positions = cp_positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size())
    on_device: dict[torch.device, torch.Tensor] = {}

    @with_value_head_size
    def attention(q, k, v, documents=None, scale=None, window=None, sinks=None):
        return context_parallel_attention(q, k, v, cp_mesh, method, scale=scale, documents=documents, window=window,
                                          sinks=sinks)

    def max_logits(into, q, k, documents, scale, window=None):
        context_parallel_max_logits(into, q, k, documents, scale, window, cp_group_or_mesh=cp_mesh)

    def rope_rows_of_this_rank(module, args, kwargs):
        if kwargs.get("positions") is not None:
            return None
        x, rope, *rest = args
        if rope.device not in on_device:
            on_device[rope.device] = positions.to(rope.device)
        return (x, rope[on_device[rope.device]], *rest), kwargs

    if hasattr(model, "flex_block_mask"):
        model.flex_block_mask = False  # see Decoder.flex_block_mask
    patched = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            # Dynamo cannot trace the send/recv inside; compiled blocks call it eagerly.
            module.attention_fn = torch.compiler.disable(attention)
            if hasattr(module, "max_logit_fn"):
                module.max_logit_fn = max_logits
            module.register_forward_pre_hook(rope_rows_of_this_rank, with_kwargs=True)
            patched += 1
    if patched == 0:
        raise ValueError(f"{type(model).__name__} has no attention module with an attention_fn attribute; "
                         "it cannot run with context parallelism")
