"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh, arXiv 2412.06464) and its variant with a
decay per key channel (Kimi Delta Attention, KDA, Kimi Linear): the recurrence of the linear-attention layers,
computed chunk by chunk.

Per head, with a state S of shape (K, V), for every token t (q_t, k_t of size K, v_t of size V, a decay g_t <= 0
in log space and a write strength beta_t in (0, 1)):

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

with D_t = diag(exp(g_t)). Gated DeltaNet has one g_t per head (D_t = exp(g_t) I, which commutes with the write:
exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + ...); KDA has one per key channel, a vector of size K, and the decay comes
first: the state forgets row by row, then the delta rule writes what its decayed recall of k_t is missing (the
order transformers' and flash-linear-attention's KDA use). ``g`` of shape (B, L, H) is the first, (B, L, H, K) the
second; one piece of code computes both.

A token that starts a new document first sets S_{t-1} = 0, so documents packed into one row never see each
other (``resets``).

The chunked form (the CPU path and the reference for any faster kernel). Write S_t = D_t S_{t-1} + k_t u_t^T,
where u_t = beta_t (v_t - (D_t S_{t-1})^T k_t) is what token t actually writes. Inside a chunk of C tokens that
starts from S_0, with Gamma_t = the sum of g over the chunk up to t (per channel; log G_t) and a (.) b the
channelwise product:

    S_t = diag(exp Gamma_t) S_0 + sum_{s<=t} diag(exp(Gamma_t - Gamma_s)) k_s u_s^T
    (I + T) U = diag(beta) V - diag(beta) (K (.) exp Gamma) S_0,     T_ts = beta_t A_ts  for s < t,
    A_ts = sum_i k_t,i k_s,i exp(Gamma_t,i - Gamma_s,i)

(the decayed recall of k_t is S_0^T (k_t (.) exp Gamma_t) + sum_{s<t} A_ts u_s), so U = U_0 - W S_0 with
U_0 = (I + T)^-1 diag(beta) V and W = (I + T)^-1 diag(beta) (K (.) exp Gamma), both found for every chunk at once
(one unit-triangular solve each); only S_0 -> U -> (outputs, next S_0) runs chunk after chunk:

    o_t = S_0^T (q_t (.) exp Gamma_t) + sum_{s<=t} B_ts u_s,      B_ts = sum_i q_t,i k_s,i exp(Gamma_t,i - Gamma_s,i)
    next S_0 = diag(exp Gamma_C) S_0 + sum_s (k_s (.) exp(Gamma_C - Gamma_s)) u_s^T

With one decay per head every factor is a scalar: A = (K K^T) (.) (G_t / G_s) and B = (Q K^T) (.) (G_t / G_s), one
C x C ratio matrix, exp only of the kept (non-positive) differences. Within a chunk every (t, s) term is kept only
when t and s lie in the same document, and S_0 reaches only the tokens before the chunk's first reset. Padding the
last chunk with beta = 0, g = 0 tokens changes nothing.

Numerics of a decay per channel: the pairwise factor exp(Gamma_t,i - Gamma_s,i) differs per channel, so A and B are
no longer a matmul times a ratio matrix. Splitting it as (k_t (.) exp Gamma_t) . (k_s (.) exp -Gamma_s) overflows
float32 once a channel decays by more than about 88 within the chunk (-1.4 per token over 64 tokens), and the
exact pairwise tensor (C x C x K per chunk, as transformers' fallback builds it) costs C times the keys' memory.
``_decayed_products`` instead halves the chunk recursively: a pair (t, s) with s in the first half of a block and
t in the second meets through the first half's last token r, exp(Gamma_t - Gamma_r) exp(Gamma_r - Gamma_s), both
exponents <= 0 for any decay, so no factor ever overflows and only negligible ones underflow; each level is one
batched matmul on half the chunk's rescaled queries and keys, so the levels keep O(C K log2 C) per chunk for the
backward instead of C^2 K (measured at C = 64, K = V = 64: 35 times the keys' bytes saved against 20 with one
decay per head and 229 in transformers' fallback; forward and backward 1.8 times the per-head time on a CPU). One
decay per head keeps its cheaper single matmul.

The state after a chunk is affine in the state before it (S_out = M S_in + N, with outputs o_t = o0_t +
S_in^T qt_t): ``chunk_transition`` reads M, N and qt off one call by running V extra value channels that start as
the identity and write nothing. Context parallelism composes those maps along the ranks
(distributed/context_parallel_linear.py); a decay per channel changes nothing there.
"""

import torch
import torch.nn.functional as F

CHUNK = 64


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     resets: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs (B, L, H, V), final state (B, H, K, V)) of the gated delta rule in chunks of ``chunk_size``.

    q, k (B, L, H, K); v (B, L, H, V); g (B, L, H): one decay per head (Gated DeltaNet), or (B, L, H, K): one per key
    channel (Kimi Delta Attention); beta (B, L, H); ``resets`` (B, L) bool, True where a document starts (the state
    is zeroed before that token; None: one document per row); ``initial_state`` (B, H, K, V), None: zeros. Computes
    in float32 (float64 inputs stay float64); outputs come back in v's dtype.
    """
    dtype = v.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    bsz, length, heads, dk = k.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 4
    if g.shape[:3] != k.shape[:3] or (per_channel and g.shape[-1] != dk) or g.dim() not in (3, 4):
        raise ValueError(f"g has shape {tuple(g.shape)}; expected {tuple(k.shape[:3])} (one decay per head) or "
                         f"{tuple(k.shape)} (one per key channel)")
    n = -(-length // chunk_size)
    pad = n * chunk_size - length
    # (B, H, N, C, ...) chunks; padded tokens write nothing (beta 0) and do not decay (g 0). g keeps a last dim of
    # K (per channel) or 1 (per head), which broadcasts over the key channels below.
    q, k, v = (F.pad(t.to(work), (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (n, chunk_size))
               for t in (q, k, v))
    g = F.pad((g if per_channel else g.unsqueeze(-1)).to(work), (0, 0, 0, 0, 0, pad))
    g = g.transpose(1, 2).unflatten(2, (n, chunk_size))
    beta = F.pad(beta.to(work), (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (n, chunk_size))
    if resets is None:
        resets = torch.zeros(bsz, length, dtype=torch.bool, device=q.device)
    # Document segment of each token within its chunk; segment 0 is the one the incoming state continues.
    segment = F.pad(resets, (0, pad)).view(bsz, 1, n, chunk_size).long().cumsum(-1)
    continues = (segment == 0).to(work)  # (B, 1, N, C)

    # log G_t (B, H, N, C, K or 1), summed from the start of the chunk or of t's document.
    gamma = _segment_cumsum(g.transpose(-1, -2), segment.unsqueeze(-2)).transpose(-1, -2)
    if per_channel:
        kk, scores = _decayed_products((k, q), k, gamma, segment)
    else:
        pairs = (segment.unsqueeze(-1) == segment.unsqueeze(-2)) & torch.ones(
            chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
        # G_t / G_s for s <= t in one document; exp only of the kept (non-positive) differences.
        ratio = torch.exp((gamma - gamma.transpose(-1, -2)).masked_fill(~pairs, float("-inf")))
        kk, scores = (k @ k.transpose(-1, -2)) * ratio, (q @ k.transpose(-1, -2)) * ratio
    T = (beta.unsqueeze(-1) * kk).tril(-1)
    eye = torch.eye(chunk_size, dtype=work, device=q.device)
    solve = torch.linalg.solve_triangular
    U0 = solve(eye + T, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    decay_in = gamma.exp() * continues.unsqueeze(-1)  # G_t, where S_0 still reaches token t
    W = solve(eye + T, beta.unsqueeze(-1) * decay_in * k, upper=False, unitriangular=True)
    q_in = decay_in * q
    # What each token's write still weighs at the chunk's end (its document must reach the end).
    # exp only where the document reaches the end: an earlier document's own decay sum can be far above the last
    # one's, and exp of that difference overflows (inf * 0 = nan).
    apart = (segment != segment[..., -1:]).unsqueeze(-1)
    to_end = torch.exp((gamma[..., -1:, :] - gamma).masked_fill(apart, float("-inf")))
    k_out = to_end * k
    decay_all = torch.exp(gamma[..., -1, :]) * continues[..., -1:]  # (B, H, N, K or 1): S_0's weight at the end

    state = (initial_state.to(work) if initial_state is not None
             else torch.zeros(bsz, heads, dk, dv, dtype=work, device=q.device))
    out, state = _across_chunks(U0, W, q_in, scores, k_out, decay_all, state)
    return out.flatten(2, 3)[:, :, :length].transpose(1, 2).to(dtype), state


@torch.compiler.disable
def _across_chunks(U0, W, q_in, scores, k_out, decay_all, state):
    """The only sequential part: S_0 -> (U, outputs, next S_0), chunk after chunk. Left out of compiled graphs,
    which would otherwise unroll one copy per chunk (compile time growing with the sequence length) for little
    gain: its matmuls are the work."""
    outputs = []
    # Unbound once: indexing chunk c of a tensor in the loop would make each backward step allocate (and add) a
    # gradient of the whole tensor, quadratic in the sequence length.
    per_chunk = zip(*(t.unbind(2) for t in (U0, W, q_in, scores, k_out, decay_all)))
    for u0, w, qc, sc, kc, decay in per_chunk:
        u = u0 - w @ state
        outputs.append(qc @ state + sc @ u)
        state = decay.unsqueeze(-1) * state + kc.transpose(-1, -2) @ u
    return torch.stack(outputs, dim=2), state


def _decayed_products(xs: tuple[torch.Tensor, ...], y: torch.Tensor, gamma: torch.Tensor,
                      segment: torch.Tensor) -> list[torch.Tensor]:
    """For each x (..., C, K): the (..., C, C) matrix sum_i x_t,i y_s,i exp(gamma_t,i - gamma_s,i) for s <= t in
    one document (``segment`` (B, 1, N, C)), else 0, with no exponent above 0 (module docstring).

    Bottom-up over blocks of 1, 2, 4, ... tokens: two neighbouring blocks of h become one of 2h whose lower-left
    quarter (t in the second, s in the first) meets through r, the first block's last token. A token of another
    document than r's gets the factor 0 (exponent -inf before the exp), so the product keeps exactly the pairs of
    one document. The chunk is padded to a power of two with tokens of no document."""
    size = gamma.shape[-2]
    span = 1 << (size - 1).bit_length()
    if span != size:
        xs = tuple(F.pad(x, (0, 0, 0, span - size)) for x in xs)
        y, gamma = F.pad(y, (0, 0, 0, span - size)), F.pad(gamma, (0, 0, 0, span - size))
        segment = F.pad(segment, (0, span - size), value=-1)
    segment = segment.unsqueeze(-1)
    blocks = [(x * y).sum(-1)[..., None, None] for x in xs]  # (..., span, 1, 1): s = t, factor 1
    h = 1
    while h < span:
        def halves(t, h=h):  # (..., span, K) -> the first and the second h-token halves of each 2h-token block
            return t.unflatten(-2, (-1, 2, h)).unbind(-3)

        (g_first, g_second), (seg_first, seg_second) = halves(gamma), halves(segment)
        g_ref, seg_ref = g_first[..., -1:, :], seg_first[..., -1:, :]
        y_first = halves(y)[0] * torch.exp((g_ref - g_first).masked_fill(seg_first != seg_ref, float("-inf")))
        reach = torch.exp((g_second - g_ref).masked_fill(seg_second != seg_ref, float("-inf")))
        merged = []
        for x, block in zip(xs, blocks):
            lower = (halves(x)[1] * reach) @ y_first.transpose(-1, -2)  # (..., span / 2h, h, h)
            upper_left, lower_right = block.unflatten(-3, (-1, 2)).unbind(-3)
            merged.append(torch.cat([torch.cat([upper_left, torch.zeros_like(upper_left)], dim=-1),
                                     torch.cat([lower, lower_right], dim=-1)], dim=-2))
        blocks = merged
        h *= 2
    return [block[..., 0, :size, :size] for block in blocks]


def _segment_cumsum(g: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Cumulative sum of g (..., C) along the last dim that restarts where ``segment`` changes: a log-step scan
    (Hillis-Steele) that adds only terms of the same segment, so a document's sums never pass through (and round
    with) the previous document's decays; its tokens' outputs are then bitwise independent of that document."""
    out = g
    step = 1
    while step < g.shape[-1]:
        same = segment[..., step:] == segment[..., :-step]
        out = torch.cat([out[..., :step], out[..., step:] + torch.where(same, out[..., :-step], 0.0)], dim=-1)
        step *= 2
    return out


def chunk_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     resets: torch.Tensor | None,
                     kernel=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The span's map from incoming to outgoing state: (o0, qt, M, N) with, for any incoming S_in,
    outputs o0 + qt-applied S_in (``apply_incoming``) and outgoing state M S_in + N.

    o0 (B, L, H, V) are the outputs from a zero state, qt (B, L, H, K) the effective queries of S_in, M (B, H, K, K),
    N (B, H, K, V); g per head or per key channel, as gated_delta_rule takes it. A reset at the span's first token
    makes M and qt zero. ``kernel``: gated_delta_rule by default; any function of its signature.
    """
    kernel = kernel or gated_delta_rule
    dk, dv = k.shape[-1], v.shape[-1]
    bsz, _, heads, _ = v.shape
    # K extra value channels: they start as the identity and write nothing, so they carry M (and qt) along.
    # At least float32 throughout: qt and M meet the other ranks' states, not just this span's outputs.
    work = torch.promote_types(v.dtype, torch.float32)
    probe = torch.cat([v.to(work), v.new_zeros(*v.shape[:-1], dk, dtype=work)], dim=-1)
    start = torch.cat([v.new_zeros(dk, dv, dtype=work), torch.eye(dk, dtype=work, device=v.device)], dim=-1)
    out, state = kernel(q, k, probe, g, beta, resets, start.expand(bsz, heads, dk, -1))
    return out[..., :dv].to(v.dtype), out[..., dv:], state[..., dv:], state[..., :dv]


def apply_incoming(o0: torch.Tensor, qt: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
    """Outputs of a span given its incoming state (B, H, K, V): o0 + S_in^T qt per token."""
    return o0 + torch.einsum("blhk,bhkv->blhv", qt, incoming.to(qt.dtype)).to(o0.dtype)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, for decoding after a prefill: (output (B, H, V), next state (B, H, K, V)).

    q, k (B, H, K); v (B, H, V); g (B, H) per head or (B, H, K) per key channel; beta (B, H); state (B, H, K, V).
    With S' = diag(exp(g)) S the update (I - beta k k^T) S' + beta k v^T is S' + beta k (v - S'^T k)^T: a decay,
    then the delta-rule write of what the state's recall of k is missing. Computes in the state's dtype (the
    chunked form hands back float32)."""
    work = state.dtype
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    state = state * (g.exp()[..., None] if g.dim() == k.dim() else g.exp()[..., None, None])
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - recalled))
    return torch.einsum("bhk,bhkv->bhv", q, state), state
