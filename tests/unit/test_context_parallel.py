"""Context-parallel attention: head-tail layout helpers, per-block kernels, and exactness over gloo ranks."""

import json
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from torchtitan.distributed import context_parallel as cpa
from torchtitan.models.shared import attention_kernels
from torchtitan.distributed.context_parallel import (
    check_cp_seq_len,
    context_parallel_attention,
    cp_positions,
    shard_sequence,
    unshard_sequence,
)

TOL = 1e-5


# ---------------------------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_roundtrip_and_positions(cp):
    seq = 2 * cp * 3
    full = torch.arange(2 * seq).view(2, seq) * 10
    shards = [shard_sequence(full, 1, r, cp) for r in range(cp)]
    assert all(s.shape == (2, seq // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards, dim=1), full)
    for r in range(cp):
        positions = cp_positions(seq, r, cp)
        assert positions.dtype == torch.long
        assert torch.equal(shard_sequence(torch.arange(seq), 0, r, cp), positions)
        assert torch.equal(full[:, positions], shards[r])


def test_head_tail_layout_is_explicit():
    # seq 8 over cp 2: chunks of 2 tokens; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert shard_sequence(torch.arange(8), 0, 1, 2).tolist() == [2, 3, 4, 5]


def test_bad_lengths_name_the_values():
    with pytest.raises(ValueError, match=r"seq_len 10 .*2\*cp = 8 for cp=4, e\.g\. 8 or 16"):
        check_cp_seq_len(10, 4)
    with pytest.raises(ValueError, match=r"seq_len 20 .*cp=2.*tp=4.*multiple of 8, e\.g\. 16 or 24"):
        check_cp_seq_len(20, 2, tp=4)
    with pytest.raises(ValueError, match=r"seq_len 0 .*e\.g\. 4$"):
        check_cp_seq_len(0, 2)
    with pytest.raises(ValueError, match="cp=0"):
        check_cp_seq_len(8, 0)
    with pytest.raises(ValueError, match="seq_len 10"):
        shard_sequence(torch.zeros(1, 10), 1, 0, 4)
    with pytest.raises(ValueError, match="cp_rank 2 is out of range for cp=2"):
        cp_positions(8, 2, 2)
    check_cp_seq_len(16, 4)
    check_cp_seq_len(32, 2, tp=4)


def test_bad_arguments_raise():
    q = torch.zeros(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"method 'ulysses' is not one of allgather, ring"):
        context_parallel_attention(q, q, q, None, method="ulysses")
    with pytest.raises(ValueError, match="kv heads must divide"):
        context_parallel_attention(q, q[:, :3], q[:, :3], None)
    with pytest.raises(ValueError, match="must be even"):
        context_parallel_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], None)
    with pytest.raises(ValueError, match="got str"):
        context_parallel_attention(q, q, q, "cp")


# ---------------------------------------------------------------------------------------------------------
# Single-rank checks of the block kernels and the whole function
# ---------------------------------------------------------------------------------------------------------


def _reference(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("lq,lk,causal", [(5, 5, True), (5, 5, False), (3, 7, False), (6, 2, False)])
def test_cpu_kernel_block_matches_math_block(lq, lk, causal):
    g = torch.Generator().manual_seed(lq * 10 + lk)
    q, dout = torch.randn(2, 3, lq, 8, generator=g), torch.randn(2, 3, lq, 8, generator=g)
    k, v = torch.randn(2, 3, lk, 8, generator=g), torch.randn(2, 3, lk, 8, generator=g)
    out_m, lse_m = attention_kernels._math_forward(q, k, v, causal, 0.3)
    out_k, lse_k = attention_kernels._cpu_flash_forward(q, k, v, causal, 0.3)
    assert (out_m - out_k).abs().max() < TOL and (lse_m - lse_k).abs().max() < TOL
    for gm, gk in zip(attention_kernels._math_backward(dout, q, k, v, out_m, lse_m, causal, 0.3),
                      attention_kernels._cpu_flash_backward(dout, q, k, v, out_k, lse_k, causal, 0.3)):
        assert (gm - gk).abs().max() < TOL


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("method", cpa.METHODS)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_single_rank_matches_sdpa(use_kernel, method, kv_heads):
    g = torch.Generator().manual_seed(kv_heads)
    q, dout = torch.randn(2, 4, 12, 8, generator=g), torch.randn(2, 4, 12, 8, generator=g)
    k, v = torch.randn(2, kv_heads, 12, 8, generator=g), torch.randn(2, kv_heads, 12, 8, generator=g)
    expected = _reference(q, k, v, dout)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, None, method=method, use_kernel=use_kernel)
    out.backward(dout)
    for got, want in zip((out, q.grad, k.grad, v.grad), expected):
        assert (got - want).abs().max().item() < TOL


def test_cpu_bfloat16_is_computed_in_float32_and_returned_in_bfloat16():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    out = context_parallel_attention(q, k, v, None)
    out.float().sum().backward()
    assert out.dtype == q.grad.dtype == k.grad.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - expected).abs().max() < 1e-2


def test_cuda_kernel_wrappers_on_meta_tensors():
    # No GPU here: run the CUDA wrappers' argument plumbing and shapes through PyTorch's meta kernels.
    for name, dtype in (("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)):
        fwd, bwd = attention_kernels.KERNELS[name]
        q = torch.empty(2, 4, 40, 16, device="meta", dtype=dtype)
        k = torch.empty(2, 4, 24, 16, device="meta", dtype=dtype)
        out, lse = fwd(q, k, k, False, 0.25)
        assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
        grads = bwd(q, q, k, k, out, lse, False, 0.25)
        assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(k.shape)]
    assert attention_kernels._pick_kernel(torch.device("cuda"), torch.bfloat16, 128, True) == "cuda_flash"
    assert attention_kernels._pick_kernel(torch.device("cuda"), torch.float32, 128, True) == "cuda_efficient"
    assert attention_kernels._pick_kernel(torch.device("cpu"), torch.float32, 128, True) == "cpu_flash"
    assert attention_kernels._pick_kernel(torch.device("cpu"), torch.float32, 128, False) == "math"


def test_kernel_failure_falls_back_to_math(monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this input")

    monkeypatch.setitem(attention_kernels.KERNELS, "cpu_flash", (broken, broken))
    monkeypatch.setattr(attention_kernels, "_failed_kernels", set())
    q, k, v = (torch.randn(1, 2, 6, 8).requires_grad_() for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = context_parallel_attention(q, k, v, None)
    assert any("cpu_flash failed" in str(w.message) for w in caught)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - expected).abs().max() < TOL


# ---------------------------------------------------------------------------------------------------------
# Several gloo ranks against full attention on the unsharded sequence
# ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    worst = {}
    case = 0
    # Local chunks of 1, 2, 4 and 12 tokens.
    for seq in (2 * world, 4 * world, 8 * world, 24 * world):
        if seq == 24 * world:  # the fallback for gloo builds without reduce-scatter: all-reduce and slice
            def no_reduce_scatter(*args, **kwargs):
                raise RuntimeError("reduce-scatter unsupported")
            dist.reduce_scatter_tensor = no_reduce_scatter
        for method in cpa.METHODS:
            for kv_heads in (4, 2, 1):
                for use_kernel in (True, False):
                    case += 1
                    g = torch.Generator().manual_seed(case)  # every rank draws the same full tensors
                    q, dout = torch.randn(2, 4, seq, 8, generator=g), torch.randn(2, 4, seq, 8, generator=g)
                    k = torch.randn(2, kv_heads, seq, 8, generator=g)
                    v = torch.randn(2, kv_heads, seq, 8, generator=g)
                    expected = _reference(q, k, v, dout)
                    local = [shard_sequence(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
                    group = mesh if case % 2 else mesh.get_group()
                    out = context_parallel_attention(*local, group, method=method, use_kernel=use_kernel)
                    out.backward(shard_sequence(dout, 2, rank, world))
                    got = (out, local[0].grad, local[1].grad, local[2].grad)
                    for name, g_, want in zip(("out", "dq", "dk", "dv"), got, expected):
                        want = shard_sequence(want, 2, rank, world)
                        assert g_.shape == want.shape, (name, g_.shape, want.shape)
                        err = ((g_ - want).abs() / (1 + want.abs())).max().item()
                        key = f"{method}/{'kernel' if use_kernel else 'math'}/{name}"
                        worst[key] = max(worst.get(key, 0.0), err)
    # Block-causal: random documents, many crossing the shard boundaries, against the explicitly masked full
    # attention.
    from tests.unit.test_document_masking import masked_reference, random_document_ids
    from torchtitan.models.shared.attention import DocumentMask

    for seq in (4 * world, 8 * world, 24 * world):
        for method in cpa.METHODS:
            for kv_heads in (4, 1):
                for use_kernel in (True, False):
                    case += 1
                    g = torch.Generator().manual_seed(case)
                    ids = random_document_ids(g, 2, seq, seq // 3)
                    q, dout = torch.randn(2, 4, seq, 8, generator=g), torch.randn(2, 4, seq, 8, generator=g)
                    k, v = (torch.randn(2, kv_heads, seq, 8, generator=g) for _ in range(2))
                    full = [t.detach().requires_grad_() for t in (q, k, v)]
                    out = masked_reference(*full, ids)
                    out.backward(dout)
                    expected = (out, *(t.grad for t in full))
                    local = [shard_sequence(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
                    documents = DocumentMask(shard_sequence(ids, 1, rank, world))
                    out = context_parallel_attention(*local, mesh, method=method, use_kernel=use_kernel,
                                                     documents=documents)
                    out.backward(shard_sequence(dout, 2, rank, world))
                    for name, g_, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), expected):
                        want = shard_sequence(want, 2, rank, world)
                        err = ((g_ - want).abs() / (1 + want.abs())).max().item()
                        key = f"documents/{method}/{'kernel' if use_kernel else 'math'}/{name}"
                        worst[key] = max(worst.get(key, 0.0), err)
    assert not attention_kernels._failed_kernels  # the kernel cases really ran the kernel
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump({"worst": worst, "cases": case}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_matches_full_attention(tmp_path, world):
    """Outputs and q/k/v grads of every rank equal the slices of full causal SDPA (fp32, 48 cases), and of
    full block-causal attention with random documents (24 cases)."""
    result_file = tmp_path / "worst"
    mp.start_processes(_worker, args=(world, _free_port(), str(result_file)), nprocs=world, start_method="spawn")
    for rank in range(world):
        report = json.loads((tmp_path / f"worst.{rank}").read_text())
        assert report["cases"] == 48 + 24
        assert len(report["worst"]) == 32
        for key, err in report["worst"].items():
            assert err < TOL, (rank, key, err)


def test_config_errors_for_lengths_cp_cannot_split():
    from torchtitan.config import ConfigError, load_config
    from torchtitan.config_check import validate_config

    def validate(*flags, world_size=4):
        cfg, sources = load_config(["--job.config_file", "train_configs/debug_model.toml", *flags])
        validate_config(cfg, sources, world_size=world_size)

    validate("--parallelism.context_parallel_degree", "4", "--training.seq_len", "96")
    with pytest.raises(ConfigError, match=r"training.seq_len = 100 cannot be split for context parallelism: "
                                          r"seq_len 100 must be a positive multiple of 2\*cp = 8 for cp=4, e.g. 96 or 104"):
        validate("--parallelism.context_parallel_degree", "4", "--training.seq_len", "100")
    with pytest.raises(ConfigError, match=r"tp=2 \(sequence parallel\): it must be a positive multiple of 4"):
        validate("--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                 "--training.seq_len", "34")
    with pytest.raises(ConfigError, match=r"validation.seq_len = 512 must equal training.seq_len = 2048 with context"):
        validate("--parallelism.context_parallel_degree", "4", "--validation.enable", "--validation.seq_len", "512")


def test_a_model_without_attention_fn_cannot_use_context_parallelism():
    from torchtitan.config import ConfigError, load_config
    from torchtitan.config_check import import_custom_modules, validate_config

    cfg, sources = load_config(["--job.config_file", "examples/nanogpt/nanogpt.toml",
                                "--parallelism.context_parallel_degree", "2"])
    import_custom_modules(cfg, sources)
    with pytest.raises(ConfigError, match="is not supported by model.name = 'nanogpt': none of its modules has an "
                                          "attention_fn"):
        validate_config(cfg, sources, world_size=2)
