"""Gated DeltaNet: the chunked gated delta rule against a plain step-by-step recurrence (forward and every
gradient, packed documents) and against transformers' PyTorch function; the short conv; the affine chunk map that
context parallelism composes."""

import torch
import torch.nn.functional as F

from torchtitan.models.shared.gated_delta_rule import apply_incoming, chunk_transition, gated_delta_rule
from torchtitan.models.shared.gated_deltanet import causal_short_conv, document_resets


def recurrence(q, k, v, g, beta, resets=None, state=None):
    """The gated delta rule token by token, as its definition reads (state (B, H, K, V))."""
    bsz, length, heads, dk = k.shape
    if state is None:
        state = q.new_zeros(bsz, heads, dk, v.shape[-1])
    outputs = []
    for t in range(length):
        if resets is not None:
            state = state * (~resets[:, t]).to(q.dtype)[:, None, None, None]
        decay = g[:, t].exp()[..., None, None]
        kt, b = k[:, t], beta[:, t][..., None, None]
        forget = torch.eye(dk, dtype=q.dtype) - b * kt[..., :, None] * kt[..., None, :]  # I - beta k k^T
        state = decay * forget @ state + b * kt[..., :, None] * v[:, t][..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def random_inputs(bsz, length, heads, dk, dv, dtype, generator):
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, generator=generator)

    q = randn(bsz, length, heads, dk)
    k = F.normalize(randn(bsz, length, heads, dk), dim=-1)
    v = randn(bsz, length, heads, dv)
    g = -torch.rand(bsz, length, heads, dtype=dtype, generator=generator) * 2  # decays down to exp(-2)
    beta = torch.rand(bsz, length, heads, dtype=dtype, generator=generator)
    return q, k, v, g, beta


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def test_chunked_form_equals_the_recurrence_with_documents_forward_and_every_gradient():
    gen = fresh_generator()
    q, k, v, g, beta = random_inputs(2, 150, 3, 8, 5, torch.float64, gen)  # 150: three chunks, the last partial
    state0 = torch.randn(2, 3, 8, 5, dtype=torch.float64, generator=gen)
    resets = torch.zeros(2, 150, dtype=torch.bool)
    resets[0, [37, 64, 100, 101]] = True  # one document starting exactly on a chunk boundary, one of one token
    resets[1, [1, 63, 149]] = True
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, state0)]
    cotangent = torch.randn(2, 150, 3, 5, dtype=torch.float64, generator=gen)
    state_cotangent = torch.randn(2, 3, 8, 5, dtype=torch.float64, generator=gen)

    def grads(fn):
        out, state = fn(*inputs[:5], resets, inputs[5])
        return out, state, torch.autograd.grad((out * cotangent).sum() + (state * state_cotangent).sum(), inputs)

    ours = grads(lambda *a: gated_delta_rule(*a, chunk_size=32))
    reference = grads(recurrence)
    assert (ours[0] - reference[0]).abs().max() <= 1e-10
    assert (ours[1] - reference[1]).abs().max() <= 1e-10
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), ours[2], reference[2]):
        assert (a - b).abs().max() <= 1e-10, name
    # The documents are really apart: without the resets the outputs differ.
    assert (gated_delta_rule(*inputs[:5])[0] - reference[0]).abs().max() > 1e-3


def test_chunked_form_equals_transformers_on_single_document_rows():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = fresh_generator()
    q, k, v, g, beta = random_inputs(2, 200, 4, 16, 8, torch.float32, gen)
    theirs, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False)
    ours, _ = gated_delta_rule(q * 16**-0.5, k, v, g, beta)  # it scales the queries by 1/sqrt(K) itself
    # Both in float32 over 200 tokens: against our float64 result transformers' own rounding alone reaches 7.8e-6 on
    # outputs up to about 2 (300 random draws), so a fixed 1e-5 failed now and then; the bound is relative.
    assert (ours - theirs).abs().max() <= 2e-5 * theirs.abs().max().clamp(min=1)


def test_a_span_is_an_affine_map_of_its_incoming_state():
    gen = fresh_generator()
    assert_span_is_affine(*random_inputs(2, 70, 2, 6, 4, torch.float64, gen), gen)


def assert_span_is_affine(q, k, v, g, beta, gen) -> None:
    """chunk_transition's map (2 rows of 70 tokens, 2 heads, K 6, V 4) gives the kernel's outputs and state for a
    random incoming state; a row whose span starts a document takes none of it."""
    incoming = torch.randn(2, 2, 6, 4, dtype=torch.float64, generator=gen)
    resets = torch.zeros(2, 70, dtype=torch.bool)
    resets[1, 0] = True  # this row's span starts a document: the incoming state must not reach it
    resets[0, 50] = True
    o0, qt, M, N = chunk_transition(q, k, v, g, beta, resets)
    out, state = gated_delta_rule(q, k, v, g, beta, resets, incoming)
    assert (apply_incoming(o0, qt, incoming) - out).abs().max() <= 1e-12
    assert ((M @ incoming + N) - state).abs().max() <= 1e-12
    assert M[1].abs().max() == 0 and qt[1].abs().max() == 0


def test_short_conv_is_the_causal_depthwise_conv_and_stays_within_documents():
    gen = fresh_generator()
    x = torch.randn(2, 20, 6, dtype=torch.float64, generator=gen)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    expected = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=3, groups=6)[..., :20].transpose(1, 2)
    assert (causal_short_conv(x, weight) - expected).abs().max() <= 1e-12
    ids = torch.tensor([[0] * 9 + [1] * 11, [0] * 2 + [1] * 18])
    per_document = causal_short_conv(x, weight, ids)
    for row, start in ((0, 9), (1, 2)):
        alone = causal_short_conv(x[row:row + 1, start:], weight)
        assert torch.equal(per_document[row:row + 1, start:], alone)
    # A history of the previous tokens continues the sequence exactly.
    tail = causal_short_conv(x[:, 12:], weight, history=x[:, 9:12])
    assert (tail - expected[:, 12:]).abs().max() <= 1e-12
    assert document_resets(ids)[0].nonzero().flatten().tolist() == [9]


def test_strong_decay_with_a_document_starting_inside_a_chunk_stays_finite_and_exact():
    # With strong decay (g = -exp(A_log) softplus(.) passes -1.6 per token at init, A up to 16) the earlier
    # document's decay sum lies far above the last one's: its weight at the chunk's end must be 0, not
    # exp(overflow) * 0. In float32 -1.6 per token over 60 tokens overflows; in float64 it takes about -12.
    gen = fresh_generator()
    q, k, v, _, beta = random_inputs(1, 128, 2, 8, 4, torch.float64, gen)
    g = -12 - 3 * torch.rand(1, 128, 2, dtype=torch.float64, generator=gen)
    resets = torch.zeros(1, 128, dtype=torch.bool)
    resets[0, 60] = True
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    out, state = gated_delta_rule(*inputs, resets)
    expected, expected_state = recurrence(*inputs, resets)
    assert torch.isfinite(out).all() and (out - expected).abs().max() <= 1e-10
    assert (state - expected_state).abs().max() <= 1e-10
    grads = torch.autograd.grad(out.sum() + state.sum(), inputs)
    want = torch.autograd.grad(expected.sum() + expected_state.sum(), inputs)
    for a, b in zip(grads, want):
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-10


def varlen_reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """fla's chunk_gated_delta_rule contract in varlen mode (one packed row, sequences cut at cu_seqlens, one
    incoming and one final state per sequence), computed with the chunked form: fla's stand-in on a CPU."""
    assert q.shape[0] == 1 and scale == 1.0 and output_final_state
    outputs, finals = [], []
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        state = None if initial_state is None else initial_state[i:i + 1]
        out, final = gated_delta_rule(*(t[:, start:end] for t in (q, k, v, g, beta)), None, state)
        outputs.append(out)
        finals.append(final)
    return torch.cat(outputs, dim=1), torch.cat(finals)


def test_the_fla_wrapper_is_called_as_the_layer_calls_it_and_keeps_the_contract():
    """The layer calls the kernel with six arguments (no incoming state), context parallelism with seven; through
    fla's varlen contract both equal the chunked form, documents and the carried state included."""
    from functools import partial

    from torchtitan.models.shared.gated_deltanet import _fla_gated_delta_rule

    gen = fresh_generator()
    q, k, v, g, beta = random_inputs(2, 90, 3, 8, 5, torch.float64, gen)
    resets = torch.zeros(2, 90, dtype=torch.bool)
    resets[0, [20, 21, 64]] = True
    resets[1, 0] = True  # the second row's first document does not continue the incoming state
    kernel = partial(_fla_gated_delta_rule, varlen_reference)
    # fla keeps states in float32: an incoming state that float32 holds exactly.
    for state in (None, torch.randn(2, 3, 8, 5, dtype=torch.float64, generator=gen).float().double()):
        args = (q, k, v, g, beta, resets) if state is None else (q, k, v, g, beta, resets, state)
        for ours, reference in zip(kernel(*args), gated_delta_rule(*args)):
            torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)
