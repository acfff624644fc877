"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh, arXiv 2412.06464): the recurrence of the
linear-attention layers, computed chunk by chunk.

Per head, with a state S of shape (K, V), for every token t (q_t, k_t of size K, v_t of size V, a decay
g_t <= 0 in log space and a write strength beta_t in (0, 1)):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

A token that starts a new document first sets S_{t-1} = 0, so documents packed into one row never see each
other (``resets``).

The chunked form (the CPU path and the reference for any faster kernel). Write S_t = exp(g_t) S_{t-1} + k_t u_t^T,
where u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) is what token t actually writes. Inside a chunk of C tokens
that starts from S_0, with G_t = exp(sum of g over the chunk up to t):

    S_t = G_t S_0 + sum_{s<=t} (G_t / G_s) k_s u_s^T
    (I + T) U = diag(beta) V - diag(beta G) K S_0,      T_ts = beta_t (G_t / G_s) k_t.k_s  for s < t

so U = U_0 - W S_0 with U_0 = (I + T)^-1 diag(beta) V and W = (I + T)^-1 diag(beta G) K, both found for every
chunk at once (one unit-triangular solve each); only S_0 -> U -> (outputs, next S_0) runs chunk after chunk.
Within a chunk every (t, s) term is kept only when t and s lie in the same document, and S_0 reaches only the
tokens before the chunk's first reset. Padding the last chunk with beta = 0, g = 0 tokens changes nothing.

The state after a chunk is affine in the state before it (S_out = M S_in + N, with outputs o_t = o0_t +
S_in^T qt_t): ``chunk_transition`` reads M, N and qt off one call by running V extra value channels that start as
the identity and write nothing. Context parallelism composes those maps along the ranks
(distributed/context_parallel_linear.py).
"""

import torch
import torch.nn.functional as F

CHUNK = 64


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     resets: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs (B, L, H, V), final state (B, H, K, V)) of the gated delta rule in chunks of ``chunk_size``.

    q, k (B, L, H, K); v (B, L, H, V); g, beta (B, L, H); ``resets`` (B, L) bool, True where a document starts
    (the state is zeroed before that token; None: one document per row); ``initial_state`` (B, H, K, V), None:
    zeros. Computes in float32 (float64 inputs stay float64); outputs come back in v's dtype.
    """
    dtype = v.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    bsz, length, heads, dk = k.shape
    dv = v.shape[-1]
    n = -(-length // chunk_size)
    pad = n * chunk_size - length
    # (B, H, N, C, ...) chunks; padded tokens write nothing (beta 0) and do not decay (g 0).
    q, k, v = (F.pad(t.to(work), (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (n, chunk_size))
               for t in (q, k, v))
    g, beta = (F.pad(t.to(work), (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (n, chunk_size)) for t in (g, beta))
    if resets is None:
        resets = torch.zeros(bsz, length, dtype=torch.bool, device=q.device)
    # Document segment of each token within its chunk; segment 0 is the one the incoming state continues.
    segment = F.pad(resets, (0, pad)).view(bsz, 1, n, chunk_size).long().cumsum(-1)
    same_doc = segment.unsqueeze(-1) == segment.unsqueeze(-2)  # (B, 1, N, C, C)
    continues = (segment == 0).to(work)  # (B, 1, N, C)

    gamma = _segment_cumsum(g, segment)  # log G_t, summed from the start of the chunk or of t's document
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pairs = same_doc & causal
    # G_t / G_s for s <= t in one document; exp only of the kept (non-positive) differences.
    ratio = torch.exp((gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~pairs, float("-inf")))
    T = (beta.unsqueeze(-1) * ratio * (k @ k.transpose(-1, -2))).tril(-1)
    eye = torch.eye(chunk_size, dtype=work, device=q.device)
    solve = torch.linalg.solve_triangular
    U0 = solve(eye + T, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    decay_in = gamma.exp() * continues  # G_t, where S_0 still reaches token t
    W = solve(eye + T, (beta * decay_in).unsqueeze(-1) * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * ratio  # (G_t/G_s) q_t.k_s, s <= t in one document
    q_in = decay_in.unsqueeze(-1) * q
    # What each token's write still weighs at the chunk's end (its document must reach the end).
    # exp only where the document reaches the end: an earlier document's own decay sum can be far above the last
    # one's, and exp of that difference overflows (inf * 0 = nan).
    to_end = torch.exp((gamma[..., -1:] - gamma).masked_fill(segment != segment[..., -1:], float("-inf")))
    k_out = to_end.unsqueeze(-1) * k
    decay_all = torch.exp(gamma[..., -1]) * continues[..., -1]  # (B, H, N): S_0's weight at the chunk's end

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
        state = decay[..., None, None] * state + kc.transpose(-1, -2) @ u
    return torch.stack(outputs, dim=2), state


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
    N (B, H, K, V). A reset at the span's first token makes M and qt zero. ``kernel``: gated_delta_rule by
    default; any function of its signature.
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

    q, k (B, H, K); v (B, H, V); g, beta (B, H); state (B, H, K, V). With S' = exp(g) S the update
    exp(g) (I - beta k k^T) S + beta k v^T is S' + beta k (v - S'^T k)^T: a decay, then the delta-rule write of
    what the state's recall of k is missing. Computes in the state's dtype (the chunked form hands back float32)."""
    work = state.dtype
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    state = state * g.exp()[..., None, None]
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - recalled))
    return torch.einsum("bhk,bhkv->bhv", q, state), state
