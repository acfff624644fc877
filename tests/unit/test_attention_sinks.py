"""Attention sinks and sliding windows against a plain softmax with an explicit sink column and window mask: the
one-process paths (whole rows and per document, CPU flash kernel and the math block), forward and every gradient,
the sinks' included. The context-parallel paths are in test_context_parallel.py."""

import pytest
import torch

from tests.unit.test_document_masking import random_document_ids
from torchtitan.models.shared import attention_kernels
from torchtitan.models.shared.attention import DocumentMask, attend


def reference(q, k, v, sinks, window, ids=None):
    """Softmax over [the keys a query may see | its head's sink], the sink's column dropped afterwards."""
    bsz, heads, length, dim = q.shape
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * dim**-0.5
    back = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    visible = back >= 0
    if window is not None:
        visible = visible & (back < window)
    visible = visible.expand(bsz, 1, length, length)
    if ids is not None:
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(bsz, heads, length, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :length]
    return probs @ v


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _case(dtype, gen, length=150, kv_heads=2, documents=False):
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, generator=gen)

    q, k, v = randn(2, 4, length, 16), randn(2, kv_heads, length, 16), randn(2, kv_heads, length, 16)
    sinks = randn(4) * 2
    ids = random_document_ids(gen, 2, length, 6) if documents else None
    return [t.requires_grad_() for t in (q, k, v, sinks)], ids


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("window, with_sinks", [(None, True), (1, True), (7, True), (70, True), (7, False),
                                               (70, False)])
@pytest.mark.parametrize("documents", [False, True])
def test_sinks_and_windows_equal_the_explicit_softmax(dtype, tol, kernel, window, documents, with_sinks, monkeypatch):
    monkeypatch.setattr(attention_kernels, "_pick_kernel", lambda *args: kernel)
    calls = []
    run_block = attention_kernels._run_block
    monkeypatch.setattr(attention_kernels, "_run_block", lambda name, *args: calls.append(name) or run_block(name,
                                                                                                           *args))
    gen = fresh_generator()
    (q, k, v, sinks), ids = _case(dtype, gen, documents=documents)
    sinks_or_none = sinks if with_sinks else None
    cotangent = torch.randn(q.shape, dtype=dtype, generator=gen)
    inputs = [q, k, v, sinks] if with_sinks else [q, k, v]
    documents_mask = None if ids is None else DocumentMask(ids, flex=False)
    ours = attend(q, k, v, documents_mask, window=window, sinks=sinks_or_none)
    expected = reference(q, k, v, sinks_or_none, window, ids)
    assert (ours - expected).abs().max() <= tol
    got = torch.autograd.grad((ours * cotangent).sum(), inputs)
    want = torch.autograd.grad((expected * cotangent).sum(), inputs)
    for name, a, b in zip(["q", "k", "v", "sinks"], got, want):
        assert (a - b).abs().max() <= tol * max(1.0, b.abs().max().item()), name
    assert set(calls) == {kernel} and not attention_kernels._failed_kernels  # the kernel asked for ran


def test_a_sink_takes_attention_mass():
    gen = fresh_generator()
    (q, k, v, _), _ = _case(torch.float64, gen, length=20)
    plain = attend(q, k, v, window=5)
    heavy = attend(q, k, v, window=5, sinks=torch.full((4,), 30.0, dtype=torch.float64))
    assert heavy.abs().max() < 1e-6 * plain.abs().max()  # a huge sink logit leaves almost nothing for the keys


def test_a_bad_window_is_refused():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="window 0 must be >= 1"):
        attend(q, q, q, window=0)


# ---------------------------------------------------------------------------------------------------------
# Context parallelism: every rank's rows and gradients against the explicit softmax on the whole sequence
# ---------------------------------------------------------------------------------------------------------


def _cp_worker(rank, world, port, result_file, seed):
    import json

    import torch.distributed as dist

    from torchtitan.distributed.context_parallel import METHODS, context_parallel_attention, shard_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    worst, cases = {}, 0
    for dtype, use_kernel in ((torch.float64, False), (torch.float32, True)):
        for method in METHODS:
            for window in (1, 3, 7, None):
                for documents in (False, True):
                    cases += 1
                    gen = torch.Generator().manual_seed(seed + cases)  # every rank draws the same full tensors
                    (q, k, v, sinks), ids = _case(dtype, gen, length=12 * world, documents=documents)
                    expected = reference(q, k, v, sinks, window, ids)
                    cotangent = torch.randn(q.shape, dtype=dtype, generator=gen)
                    want = torch.autograd.grad((expected * cotangent).sum(), [q, k, v, sinks])
                    local = [shard_sequence(t.detach(), 2, rank, world).requires_grad_() for t in (q, k, v)]
                    local_sinks = sinks.detach().clone().requires_grad_()
                    mask = None if ids is None else DocumentMask(shard_sequence(ids, 1, rank, world), flex=False)
                    out = context_parallel_attention(*local, dist.group.WORLD, method, use_kernel=use_kernel,
                                                     documents=mask, window=window, sinks=local_sinks)
                    (out * shard_sequence(cotangent, 2, rank, world)).sum().backward()
                    dsinks = local_sinks.grad.clone()
                    dist.all_reduce(dsinks)  # each rank holds its rows' share of the sinks' gradient
                    got = [out, *(t.grad for t in local), dsinks]
                    wanted = [shard_sequence(expected, 2, rank, world),
                              *(shard_sequence(g, 2, rank, world) for g in want[:3]), want[3]]
                    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, wanted):
                        key = f"{dtype}/{method}/{name}"
                        err = ((a - b).abs() / (1 + b.abs())).max().item()
                        worst[key] = max(worst.get(key, 0.0), err)
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump({"worst": worst, "cases": cases}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_sinks_and_windows_equal_the_explicit_softmax(tmp_path, world):
    """allgather and ring, windows of 1, 3 and 7 tokens (crossing every cut) and none, with and without documents,
    sinks on: fp64 through the math blocks (<= 1e-10) and fp32 through the CPU kernel (<= 1e-5), relative to 1 +
    |value|."""
    import json

    import torch.multiprocessing as mp

    from tests.unit.test_context_parallel import _free_port

    seed = torch.seed() % 2**31
    mp.start_processes(_cp_worker, args=(world, _free_port(), str(tmp_path / "worst"), seed), nprocs=world,
                       start_method="spawn")
    for rank in range(world):
        report = json.loads((tmp_path / f"worst.{rank}").read_text())
        assert report["cases"] == 32 and len(report["worst"]) == 20
        for key, err in report["worst"].items():
            assert err < (1e-10 if "float64" in key else 1e-5), (rank, key, err, seed)
