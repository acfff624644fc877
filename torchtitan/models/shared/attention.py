"""Attention kernels shared by the model families."""

import torch
import torch.nn.functional as F

from torchtitan.models.shared import amx_attention, attention_kernels

_aten = torch.ops.aten


class _CpuBf16FlashAttention(torch.autograd.Function):
    """Causal attention on CPU: PyTorch's flash kernel forward in bfloat16, its backward in float32.

    Measured with torch 2.13 on Sapphire Rapids (AMX), batch 8 x 2048, head_dim 16: the kernel's
    bfloat16 forward is about 1.3x faster than its float32 one, but its bfloat16 backward is about
    1.5x slower than the float32 one; pairing the two fast halves made the debug model's whole
    training step 1.15x (compiled) to 1.2x (eager) faster than computing both in float32. The
    backward gets the forward's float32 log-sum-exp and the bfloat16 output upcast, so it
    differentiates the forward that ran.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, True
            )
        return tuple(g.to(torch.bfloat16) for g in grads)


def with_value_head_size(kernel):
    """Let ``kernel(q, k, v, *args, scale=)`` take values whose head size differs from the queries' (MLA: 128 vs
    192): the values are zero-padded to the query head size, which adds zero output columns, cut off again.
    Exact (forward and gradients); the flash kernels refuse differing sizes. A kernel given scale=None uses
    1/sqrt(q head size), as before the padding."""

    def wrapped(q, k, v, *args, scale: float | None = None, **options):
        if v.shape[-1] == q.shape[-1]:
            return kernel(q, k, v, *args, scale=scale, **options)
        pad = q.shape[-1] - v.shape[-1]
        if pad < 0:
            raise ValueError(f"value head size {v.shape[-1]} is larger than the query head size {q.shape[-1]}")
        out = kernel(q, k, F.pad(v, (0, pad)), *args, scale=scale, **options)
        return out[..., : v.shape[-1]]

    return wrapped


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal scaled-dot-product attention of (batch, heads, seq, head_dim) tensors; k/v may have fewer heads.
    ``scale`` multiplies q.k (None: 1/sqrt(head_dim)); v may have a smaller head size than q and k.

    On CPU, bfloat16 inputs with head_dim 16 take the AMX kernel where the machine has one
    (models/shared/amx_attention.py), other bfloat16 inputs the mixed-precision flash kernel above, and float16
    ones are computed in float32 (the CPU float16 kernel is slower still); elsewhere the inputs' dtype is used.
    """
    return _causal_attention(q, k, v, scale=scale)


@with_value_head_size
def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    if scale is not None and scale != q.shape[-1] ** -0.5:
        # The CPU kernels above take no scale: fold it into q, which sdpa then scales by 1/sqrt(d).
        q = q * (scale * q.shape[-1] ** 0.5)
    gqa = q.shape[1] != k.shape[1]
    if amx_attention.supports(q, k, v):
        return amx_attention.causal_attention(q, k, v)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and k.dtype == v.dtype == torch.bfloat16:
        return _CpuBf16FlashAttention.apply(q, k, v)  # the kernel maps kv heads to query-head groups itself
    if q.device.type == "cpu" and q.dtype == torch.float16:
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class DocumentMask:
    """Which document each token of a batch belongs to, for block-causal attention: a token attends only to
    earlier tokens of its own document.

    ``ids`` is (batch, seq) and never decreases along a row (packing puts documents end to end), so each
    document is one contiguous span of its row. Built once per forward and handed to every layer, it makes
    each kernel's view of the mask once: the spans for the CPU path, flex attention's block mask on CUDA
    (built here, outside any compiled block, when ``flex`` is set). ``cache`` holds what another kernel
    derives once per forward (context parallelism's full-length ids).
    """

    def __init__(self, ids: torch.Tensor, flex: bool = True):
        self.ids = ids
        self.cache: dict[str, object] = {}
        self._spans: list[list[tuple[int, int]]] | None = None
        self.block_mask = _flex_block_mask(ids) if flex and ids.device.type == "cuda" else None

    def spans(self) -> list[list[tuple[int, int]]]:
        """Each row's documents as [start, end) token ranges, in order."""
        if self._spans is None:
            self._spans = document_spans(self.ids)
        return self._spans


def document_spans(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[start, end) of every run of equal ids in each row of a (batch, seq) tensor."""
    rows, cuts = (ids[:, 1:] != ids[:, :-1]).nonzero(as_tuple=True)
    seq = ids.size(1)
    bounds: list[list[int]] = [[0] for _ in range(ids.size(0))]
    for row, cut in zip(rows.tolist(), cuts.tolist()):
        bounds[row].append(cut + 1)
    return [list(zip(b, b[1:] + [seq])) for b in bounds]


_compiled_flex_attention = None
_compiled_create_block_mask = None


def _flex_block_mask(ids: torch.Tensor):
    # Compiled, the mask is evaluated block by block instead of materialising batch x seq x seq booleans.
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        _compiled_create_block_mask = torch.compile(create_block_mask)

    def same_document_causal(b, h, q, kv):
        return (ids[b, q] == ids[b, kv]) & (q >= kv)

    batch, seq = ids.shape
    return _compiled_create_block_mask(same_document_causal, batch, None, seq, seq, device=ids.device)


@with_value_head_size
def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float | None = None):
    # flex_attention only fuses its mask into one kernel when compiled; inside an already compiled block the
    # inner compile is traced through.
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@torch.compiler.disable
def _attention_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            spans: list[list[tuple[int, int]]], scale: float | None = None) -> torch.Tensor:
    # Causal attention run separately on each document: exact, no sequence x sequence mask, and with many
    # short documents it skips the cross-document work a masked kernel would still do. The Python loop over
    # spans cannot be traced, so a compiled block calls it eagerly.
    if all(len(row) == 1 for row in spans):
        return causal_attention(q, k, v, scale)
    rows = []
    for b, row in enumerate(spans):
        parts = [causal_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], scale) for s, e in row]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows)


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask,
                           scale: float | None = None) -> torch.Tensor:
    """Causal attention that stays within each document: flex attention on CUDA, per-document spans elsewhere."""
    if documents.block_mask is not None:
        return _flex_attention(q, k, v, documents.block_mask, scale=scale)
    return _attention_per_document(q, k, v, documents.spans(), scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None = None,
           scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's attention: causal, or block-causal when the batch's documents are given. ``scale``
    multiplies q.k (None: 1/sqrt(head size)); v's head size may be smaller than q's (MLA). ``window``: each query
    sees only the last ``window`` keys (itself included); ``sinks`` (heads,): a learned logit per head that joins
    every query's softmax as a key without a value (see windowed_attention)."""
    if window is not None or sinks is not None:
        return windowed_attention(q, k, v, documents, scale, window, sinks)
    if documents is None:
        return causal_attention(q, k, v, scale)
    return block_causal_attention(q, k, v, documents, scale)


# Query rows per block of sliding-window attention (at least the window).
WINDOW_BLOCK = 64


@torch.compiler.disable
def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
                       scale: float | None, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal (block-causal with ``documents``) attention with a sliding ``window`` and/or attention ``sinks``.

    Run as blocks that each hold every key their query rows may see: per document, one causal square without a
    window, else query blocks of max(window, 64) rows against the keys from ``window`` - 1 before them (masked to
    the window), so the work grows linearly with the sequence and keys outside every window are never read. A
    sink s joins the softmax as one more logit with no value: with the output o and log-sum-exp L over the real
    keys, the result is o * sigmoid(L - s), exact. The backward is the kernels' own, given that final output and
    log-sum-exp logaddexp(L, s) (the flash-attention backward is exact for any normaliser it is given), and the
    sink's gradient is -sum over queries of exp(s - L') * (dO . O).
    """
    attention_kernels.check_window(window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
    spans = [[(0, q.shape[2])]] if documents is None else documents.spans()
    return _BlockedAttention.apply(q, k, v, sinks, _window_blocks(spans, window, q.device), scale)


def _window_blocks(spans: list[list[tuple[int, int]]], window: int | None, device: torch.device) -> list[tuple]:
    """(batch rows, query start, end, key start, end, mask) blocks: ``mask`` True (a causal square) or a bool
    (queries, keys) tensor of what each query sees. ``spans``: one list for all rows, or one per row."""
    blocks = []
    for row, row_spans in enumerate(spans):
        rows = slice(None) if len(spans) == 1 else slice(row, row + 1)
        for start, end in row_spans:
            if window is None or window >= end - start:
                blocks.append((rows, start, end, start, end, True))
                continue
            size = max(window, WINDOW_BLOCK)
            for a in range(start, end, size):
                b = min(a + size, end)
                first_key = max(start, a - window + 1)
                back = torch.arange(a, b, device=device)[:, None] - torch.arange(first_key, b, device=device)
                blocks.append((rows, a, b, first_key, b, (back >= 0) & (back < window)))
    return blocks


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks, scale):
        dtype = attention_kernels._compute_dtype(q)
        kernel = attention_kernels._pick_kernel(q.device, dtype, q.shape[-1], True)
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))
        work = torch.promote_types(dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=work, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
        for rows, qs, qe, ks, ke, mask in blocks:
            o, l = attention_kernels._run_block(kernel, False, qc[rows, :, qs:qe].contiguous(),
                                                kc[rows, :, ks:ke].contiguous(), vc[rows, :, ks:ke].contiguous(),
                                                mask, scale)
            out[rows, :, qs:qe] = o.to(work)
            lse[rows, :, qs:qe] = l.to(work)
        if sinks is not None:
            out, lse = attention_kernels.fold_sinks(out, lse, sinks)
        out = out.to(dtype)
        ctx.save_for_backward(qc, kc, vc, out, lse, sinks)
        ctx.blocks, ctx.scale, ctx.kernel, ctx.dtypes = blocks, scale, kernel, (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        qc, kc, vc, out, lse, sinks = ctx.saved_tensors
        work = lse.dtype
        doutc = dout.to(qc.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=work, device=t.device) for t in (qc, kc, vc))
        for rows, qs, qe, ks, ke, mask in ctx.blocks:
            grads = attention_kernels._run_block(
                ctx.kernel, True, doutc[rows, :, qs:qe].contiguous(), qc[rows, :, qs:qe].contiguous(),
                kc[rows, :, ks:ke].contiguous(), vc[rows, :, ks:ke].contiguous(), out[rows, :, qs:qe].contiguous(),
                lse[rows, :, qs:qe].contiguous(), mask, ctx.scale)
            dq[rows, :, qs:qe] += grads[0].to(work)
            dk[rows, :, ks:ke] += grads[1].to(work)
            dv[rows, :, ks:ke] += grads[2].to(work)
        dsinks = None if sinks is None else attention_kernels.sink_grad(dout, out, lse, sinks)
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), dsinks, None, None


# Scores one chunk of the max-logit measurement may hold (float32: 64 MiB).
MAX_LOGIT_CHUNK = 2**24


def noting_max_logits() -> bool:
    """Whether this forward's logits count for QK-clip: only training forwards. Under no_grad (validation,
    generation) or in backward (activation checkpointing's recomputation, whose logits are the forward's) nothing is
    noted; the same answer on every rank, so measurements with collectives (context parallelism) stay in step."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


@torch.compiler.disable
def note_max_logits(into: torch.Tensor, q: torch.Tensor, k: torch.Tensor, documents: DocumentMask | None,
                    scale: float | None, window: int | None = None) -> None:
    """Fold into ``into`` (q's heads,) each head's largest pre-softmax logit scale * q.k over the pairs the mask
    lets attend (causal, within a document, within the window), for QK-clip (components/optimizers/qk_clip.py).
    The attention modules call it through their ``max_logit_fn`` (context parallelism swaps in one that sees the
    other ranks' keys).

    The kernels do not return their row maxima, so this recomputes the logits without gradients, in float32,
    in chunks of query rows against only the keys those rows may see: about one more q.k^T of the forward. Only
    training forwards count (noting_max_logits).
    """
    if not noting_max_logits():
        return
    # Without autocast, which would round the float32 logits to the compute dtype.
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        ids = None if documents is None else documents.ids
        _note_max_logits(into, q, k, scale, window, ids, ids)


def _note_max_logits(into, q, k, scale, window, q_ids=None, k_ids=None, first_position: int = 0) -> None:
    """The measurement for query rows at the consecutive positions ``first_position``, ... of a sequence whose keys
    are ``k`` (positions 0, 1, ...); ``q_ids``/``k_ids``: the rows' and keys' document ids (both or neither)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    # Query heads as (kv head, group) so that grouped heads share their key head without copying it.
    qg = q.reshape(batch, kv_heads, heads // kv_heads, seq, dim)
    rows = max(1, MAX_LOGIT_CHUNK // (batch * heads * k.shape[2]))
    best = torch.full((heads,), float("-inf"), dtype=work, device=q.device)
    positions = torch.arange(first_position + seq, device=q.device)
    for start in range(0, seq, rows):
        end = min(start + rows, seq)
        # The chunk's queries are at positions [lo, hi): they see keys up to hi - 1, and with a window from
        # lo - window + 1.
        lo, hi = first_position + start, first_position + end
        first = 0 if window is None else max(0, lo - window + 1)
        rows_q = qg[:, :, :, start:end].to(work)
        if q_ids is None and window is None and lo > 0:
            # Keys before the chunk are all visible: no mask to build or apply there, only on the diagonal block.
            earlier = torch.matmul(rows_q, k[:, :, None, :lo].to(work).transpose(-1, -2))
            best = torch.maximum(best, earlier.amax(dim=(0, 3, 4)).reshape(heads) * scale)
            first = lo
        scores = torch.matmul(rows_q, k[:, :, None, first:hi].to(work).transpose(-1, -2))
        back = positions[lo:hi, None] - positions[None, first:hi]
        allowed = back >= 0 if window is None else (back >= 0) & (back < window)
        if q_ids is not None:
            allowed = allowed & (q_ids[:, start:end, None] == k_ids[:, None, first:hi])[:, None, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).reshape(heads) * scale)
    into.copy_(torch.maximum(into, best.to(into.dtype)))
