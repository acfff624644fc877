"""Kimi Delta Attention: the gated delta rule with a decay per key channel (models/shared/gated_delta_rule.py)
against a plain token-by-token recurrence (forward and every gradient, packed documents, incoming state), against
the per-head form when all channels decay alike, against transformers' PyTorch functions, in float32 under strong
decays, through fla's varlen wrapper, and under exact context parallelism (CP 2 and CP 4, gloo ranks)."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.unit.test_context_parallel import _free_port
from tests.unit.test_gated_deltanet import assert_span_is_affine, fresh_generator, varlen_reference
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.distributed.context_parallel_linear import cp_recurrence
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.gated_delta_rule import (
    gated_delta_rule,
    gated_delta_step,
)

F64 = torch.float64


def recurrence(q, k, v, g, beta, resets=None, state=None):
    """KDA token by token, as its definition reads: S_t = (I - beta k k^T) diag(exp g_t) S_{t-1} + beta k v^T."""
    bsz, length, heads, dk = k.shape
    if state is None:
        state = q.new_zeros(bsz, heads, dk, v.shape[-1])
    outputs = []
    for t in range(length):
        if resets is not None:
            state = state * (~resets[:, t]).to(q.dtype)[:, None, None, None]
        kt, b = k[:, t], beta[:, t][..., None, None]
        forget = torch.eye(dk, dtype=q.dtype) - b * kt[..., :, None] * kt[..., None, :]
        state = forget @ (torch.diag_embed(g[:, t].exp()) @ state) + b * kt[..., :, None] * v[:, t][..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def channel_inputs(bsz, length, heads, dk, dv, dtype, generator, strong=0.0):
    """Random inputs with a decay per key channel down to exp(-2) per token; ``strong``: the first half of each
    head's channels decay by about that much per token instead (log space)."""
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, generator=generator)

    q = randn(bsz, length, heads, dk)
    k = F.normalize(randn(bsz, length, heads, dk), dim=-1)
    v = randn(bsz, length, heads, dv)
    g = -torch.rand(bsz, length, heads, dk, dtype=dtype, generator=generator) * 2
    if strong:
        g[..., : dk // 2] = -strong * (0.5 + torch.rand(bsz, length, heads, dk // 2, dtype=dtype,
                                                        generator=generator))
    beta = torch.rand(bsz, length, heads, dtype=dtype, generator=generator)
    return q, k, v, g, beta


def packed_resets(length):
    resets = torch.zeros(2, length, dtype=torch.bool)
    resets[0, [37, 64, 100, 101]] = True  # a document starting exactly on a chunk boundary, one of one token
    resets[1, [1, 63, length - 1]] = True
    return resets


def outputs_state_and_grads(kernel, inputs, resets, cotangents):
    out, state = kernel(*inputs[:5], resets, inputs[5])
    loss = (out * cotangents[0]).sum() + (state * cotangents[1]).sum()
    return out, state, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk_size", [64, 24])  # 24: the pairwise products pad the chunk to a power of two
def test_chunked_form_equals_the_recurrence_with_documents_forward_and_every_gradient(chunk_size):
    gen = fresh_generator()
    q, k, v, g, beta = channel_inputs(2, 150, 2, 8, 5, F64, gen, strong=8.0)  # 150: a partial last chunk
    state0 = torch.randn(2, 2, 8, 5, dtype=F64, generator=gen)
    resets = packed_resets(150)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, state0)]
    cotangents = (torch.randn(2, 150, 2, 5, dtype=F64, generator=gen), torch.randn(2, 2, 8, 5, dtype=F64,
                                                                                    generator=gen))
    ours = outputs_state_and_grads(lambda *a: gated_delta_rule(*a, chunk_size=chunk_size), inputs, resets,
                                   cotangents)
    reference = outputs_state_and_grads(recurrence, inputs, resets, cotangents)
    assert (ours[0] - reference[0]).abs().max() <= 1e-10
    assert (ours[1] - reference[1]).abs().max() <= 1e-10
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), ours[2], reference[2]):
        assert (a - b).abs().max() <= 1e-10, name
    # The documents are really apart, and the channels really decay apart: either shortcut changes the outputs.
    assert (gated_delta_rule(*inputs[:5], None, inputs[5])[0] - reference[0]).abs().max() > 1e-3
    per_head = inputs[3].mean(-1)
    assert (gated_delta_rule(*inputs[:3], per_head, inputs[4], resets, inputs[5])[0]
            - reference[0]).abs().max() > 1e-3


def test_equal_channel_decays_give_the_gated_deltanet_result():
    gen = fresh_generator()
    q, k, v, g, beta = channel_inputs(2, 150, 3, 8, 5, F64, gen)
    g_head = g[..., 0].clone()
    state0 = torch.randn(2, 3, 8, 5, dtype=F64, generator=gen)
    resets = packed_resets(150)
    cotangents = (torch.randn(2, 150, 3, 5, dtype=F64, generator=gen), torch.randn(2, 3, 8, 5, dtype=F64,
                                                                                    generator=gen))
    head_inputs = [t.requires_grad_() for t in (q, k, v, g_head, beta, state0)]
    per_head = outputs_state_and_grads(gated_delta_rule, head_inputs, resets, cotangents)
    channel_inputs_ = list(head_inputs)
    channel_inputs_[3] = g_head.detach()[..., None].expand(-1, -1, -1, 8).clone().requires_grad_()
    per_channel = outputs_state_and_grads(gated_delta_rule, channel_inputs_, resets, cotangents)
    assert (per_channel[0] - per_head[0]).abs().max() <= 1e-10
    assert (per_channel[1] - per_head[1]).abs().max() <= 1e-10
    grads = list(per_channel[2])
    grads[3] = grads[3].sum(-1)  # the head's decay feeds all its channels
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), grads, per_head[2]):
        assert (a - b).abs().max() <= 1e-10, name


def test_chunked_form_equals_transformers_on_one_document():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    gen = fresh_generator()
    q, k, v, g, beta = channel_inputs(2, 200, 4, 16, 8, torch.float32, gen)
    state0 = torch.randn(2, 4, 16, 8, generator=gen)
    theirs, their_state = chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=state0,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=False)
    ours, our_state = gated_delta_rule(q * 16**-0.5, k, v, g, beta, None, state0)  # it scales q by 1/sqrt(K)
    assert (ours - theirs).abs().max() <= 1e-5
    assert (our_state - their_state).abs().max() <= 1e-5
    # One decoding step from a state: their token-by-token form, our chunked form and our step agree.
    one = [t[:, :1] for t in (q, k, v, g, beta)]
    theirs, their_state = recurrent_kimi_delta_attention(*one, initial_state=state0, output_final_state=True)
    one[0] = one[0] * 16**-0.5
    ours, our_state = gated_delta_rule(*one, None, state0)
    step, step_state = gated_delta_step(*(t[:, 0] for t in one), state0)
    for a in (ours[:, 0], step):
        assert (a - theirs[:, 0]).abs().max() <= 1e-5
    for a in (our_state, step_state):
        assert (a - their_state).abs().max() <= 1e-5


@pytest.mark.parametrize("strong", [5.0, 30.0])
def test_float32_stays_exact_under_strong_channel_decays(strong):
    """Half the channels decay by ``strong`` per token (in log space): over a 64-token chunk far beyond what
    exp(+-Gamma) holds in float32. Float32 outputs, state and gradients stay finite and close to float64's."""
    gen = fresh_generator()
    inputs64 = list(channel_inputs(2, 160, 2, 16, 8, F64, gen, strong=strong))
    inputs64.append(torch.randn(2, 2, 16, 8, dtype=F64, generator=gen))
    resets = packed_resets(160)
    cotangents = (torch.randn(2, 160, 2, 8, dtype=F64, generator=gen), torch.randn(2, 2, 16, 8, dtype=F64,
                                                                                    generator=gen))
    inputs64 = [t.requires_grad_() for t in inputs64]
    inputs32 = [t.detach().float().requires_grad_() for t in inputs64]
    expected = outputs_state_and_grads(gated_delta_rule, inputs64, resets, cotangents)
    assert (expected[0] - recurrence(*inputs64[:5], resets, inputs64[5])[0]).abs().max() <= 1e-10
    got = outputs_state_and_grads(gated_delta_rule, inputs32, resets, [c.float() for c in cotangents])
    for name, a, b in zip(("out", "state"), got[:2], expected[:2]):
        assert torch.isfinite(a).all() and (a.double() - b).abs().max() <= 2e-5 * b.abs().max(), name
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), got[2], expected[2]):
        assert torch.isfinite(a).all() and (a.double() - b).abs().max() <= 2e-5 * b.abs().max(), name


def test_a_span_is_an_affine_map_of_its_incoming_state_with_channel_decays():
    gen = fresh_generator()
    assert_span_is_affine(*channel_inputs(2, 70, 2, 6, 4, F64, gen), gen)


def test_the_fla_wrapper_keeps_the_contract_with_channel_decays():
    """fla's chunk_kda takes the same varlen call as chunk_gated_delta_rule; through that contract (the chunked
    form standing in for fla on a CPU) the wrapper equals the chunked form, documents and carried state included."""
    from functools import partial

    from torchtitan.models.shared.gated_deltanet import _fla_gated_delta_rule

    gen = fresh_generator()
    q, k, v, g, beta = channel_inputs(2, 90, 3, 8, 5, F64, gen)
    resets = torch.zeros(2, 90, dtype=torch.bool)
    resets[0, [20, 21, 64]] = True
    resets[1, 0] = True
    kernel = partial(_fla_gated_delta_rule, varlen_reference)
    for state in (None, torch.randn(2, 3, 8, 5, dtype=F64, generator=gen).float().double()):
        args = (q, k, v, g, beta, resets) if state is None else (q, k, v, g, beta, resets, state)
        for ours, reference in zip(kernel(*args), gated_delta_rule(*args)):
            torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)


def test_a_decay_of_the_wrong_shape_is_refused_in_one_line():
    gen = fresh_generator()
    q, k, v, g, beta = channel_inputs(1, 10, 2, 8, 4, F64, gen)
    for bad in (g[..., :3], g[..., None]):
        with pytest.raises(ValueError, match=r"^g has shape .*expected \(1, 10, 2\) \(one decay per head\) or "
                                             r"\(1, 10, 2, 8\) \(one per key channel\)$"):
            gated_delta_rule(q, k, v, bad, beta)


def crossing_ids(seq: int, cut: int) -> torch.Tensor:
    """Document ids for two rows in which a document crosses every cut (multiples of ``cut``): row 0 starts one
    in the middle of every chunk, row 1 has a one-token document right after each cut and one a token before."""
    starts = torch.zeros(2, seq, dtype=torch.long)
    starts[0, cut // 2::cut] = 1
    starts[1, 1::cut] = 1
    starts[1, 2::cut] = 1
    starts[1, cut - 1::cut] = 1
    starts[:, 0] = 0
    return starts.cumsum(1)


def _cp_worker(rank, world, port, result_file, seed):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    worst = {}
    for cut in (5, 70):  # CP chunks of 5 tokens, and of 70 (more than one 64-token kernel chunk)
        gen = torch.Generator().manual_seed(seed + cut)  # every rank draws the same full tensors
        seq = 2 * world * cut
        inputs = [t.requires_grad_() for t in channel_inputs(2, seq, 2, 6, 4, F64, gen, strong=3.0)]
        cotangent = torch.randn(2, seq, 2, 4, dtype=F64, generator=gen)
        ids = crossing_ids(seq, cut)
        reference = gated_delta_rule(*inputs, F.pad(ids[:, 1:] != ids[:, :-1], (1, 0)))[0]
        expected_grads = torch.autograd.grad((reference * cotangent).sum(), inputs)
        local = [shard_sequence(t.detach(), 1, rank, world).requires_grad_() for t in inputs]
        documents = DocumentMask(shard_sequence(ids, 1, rank, world), flex=False)
        out, _ = cp_recurrence(*local, documents, group=dist.group.WORLD)
        grads = torch.autograd.grad((out * shard_sequence(cotangent, 1, rank, world)).sum(), local)
        errors = {"out": (out - shard_sequence(reference, 1, rank, world)).abs().max().item()}
        for name, grad, expected in zip(("q", "k", "v", "g", "beta"), grads, expected_grads):
            errors[f"d{name}"] = (grad - shard_sequence(expected, 1, rank, world)).abs().max().item()
        for key, err in errors.items():
            worst[key] = max(worst.get(key, 0.0), err)
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump(worst, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_is_exact_with_documents_crossing_every_cut(tmp_path, world):
    seed = torch.seed() % 2**31
    mp.start_processes(_cp_worker, args=(world, _free_port(), str(tmp_path / "worst"), seed), nprocs=world,
                       start_method="spawn")
    for rank in range(world):
        worst = json.loads((tmp_path / f"worst.{rank}").read_text())
        assert sorted(worst) == ["dbeta", "dg", "dk", "dq", "dv", "out"]
        for key, err in worst.items():
            assert err <= 1e-10, (rank, key, err, seed)


def test_a_document_is_bitwise_independent_of_the_one_before_it():
    """Changing every token of the first document (and the incoming state) leaves the second's outputs and the
    final state bitwise unchanged, the second starting inside a chunk."""
    gen = fresh_generator()
    first = channel_inputs(1, 100, 2, 8, 4, torch.float32, gen, strong=5.0)
    second = channel_inputs(1, 100, 2, 8, 4, torch.float32, gen, strong=5.0)
    resets = torch.zeros(1, 100, dtype=torch.bool)
    resets[0, 40] = True
    out, state = gated_delta_rule(*first, resets, torch.randn(1, 2, 8, 4, generator=gen))
    mixed = [torch.cat([b[:, :40], a[:, 40:]], dim=1) for a, b in zip(first, second)]
    out_mixed, state_mixed = gated_delta_rule(*mixed, resets, torch.randn(1, 2, 8, 4, generator=gen))
    assert torch.equal(out[:, 40:], out_mixed[:, 40:]) and torch.equal(state, state_mixed)
    assert not torch.equal(out[:, :40], out_mixed[:, :40])


def test_on_cuda_the_kernel_is_picked_per_call_by_the_decay_shape(monkeypatch):
    """With fla installed, every caller of recurrence_kernel (the layer, context parallelism, the generation
    cache's prefill) gets chunk_kda for a decay per key channel and chunk_gated_delta_rule for one per head; a
    release without chunk_kda leaves channel decays to the chunked form. fla's kernels are stood in for by the
    chunked form through their varlen contract (no GPU needed: the choice reads only the device type)."""
    from torchtitan.models.shared import gated_deltanet

    calls = []

    def fake(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            return varlen_reference(*args, **kwargs)
        return kernel

    gen = fresh_generator()
    q, k, v, g, beta = channel_inputs(2, 40, 2, 8, 4, F64, gen)
    resets = torch.zeros(2, 40, dtype=torch.bool)
    resets[0, 17] = True
    for kda in (fake("chunk_kda"), None):
        monkeypatch.setattr(gated_deltanet, "_fla_kernels", {"chunk_gated_delta_rule": fake("chunk_gated_delta_rule"),
                                                             "chunk_kda": kda})
        calls.clear()
        kernel = gated_deltanet.recurrence_kernel(torch.device("cuda"))
        for decay in (g, g[..., 0]):
            torch.testing.assert_close(kernel(q, k, v, decay, beta, resets)[0],
                                       gated_delta_rule(q, k, v, decay, beta, resets)[0], rtol=1e-10, atol=1e-10)
        assert calls == (["chunk_kda", "chunk_gated_delta_rule"] if kda else ["chunk_gated_delta_rule"])
    assert gated_deltanet.recurrence_kernel(torch.device("cpu")) is gated_delta_rule
