"""QK-clip (components/optimizers/qk_clip.py): the per-head largest logit each attention notes, against the full
masked score matrix in float64; the clip on hand-made attentions (MHA, GQA, MLA) scales exactly the heads over the
threshold by the published factors, leaves the others bitwise, and brings their largest logit to the threshold;
under context parallelism the ranks' maxima, max-reduced, are the whole sequence's; QK-norm families are refused in
one line."""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.bad_input import assert_one_line_error
from tests.unit.test_context_parallel import _free_port
from torchtitan.components.optimizers import qk_clip
from torchtitan.components.optimizers.qk_clip import QKClip
from torchtitan.config.job_config import Optimizer
from torchtitan.distributed.context_parallel import apply_context_parallel, context_parallel_max_logits, shard_sequence
from torchtitan.models.deepseek_v3.args import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import MultiHeadLatentAttention
from torchtitan.models.shared import attention as attention_module
from torchtitan.models.shared.attention import DocumentMask, note_max_logits
from torchtitan.models.shared.decoder import Attention
from torchtitan.models.shared.rope import rope_frequencies, rope_table

SEQ = 24


def reference_max(q, k, scale, ids=None, window=None) -> torch.Tensor:
    """Each head's largest allowed logit from the whole (seq x seq) score matrix, in float64."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2])
    back = i[:, None] - i[None]
    allowed = (back >= 0) & (back < (window or q.shape[2] + 1))
    allowed = allowed[None, None] if ids is None else allowed & (ids[:, :, None] == ids[:, None, :])[:, None]
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


def seen_qk(module, x, rope, documents=None) -> dict:
    """The q, k (after RoPE) and keyword arguments that ``module``'s attention kernel receives for ``x``."""
    seen, real = {}, module.attention_fn

    def spy(q, k, v, docs, **options):
        seen.update(q=q.detach(), k=k.detach(), **options)
        return real(q, k, v, docs, **options)

    module.attention_fn = spy
    try:
        module(x, rope, documents=documents)
    finally:
        module.attention_fn = real
    return seen


def as_model(module: nn.Module) -> nn.Module:
    part = nn.Module()
    part.layers = nn.ModuleDict({"0": module})
    return part


def gqa_attention(heads: int, kv_heads: int, bias: bool, seed: int):
    torch.manual_seed(seed)
    head_dim = 8
    m = Attention(32, heads, kv_heads, head_dim, "pairs", bias=bias)
    rope = rope_table(rope_frequencies(head_dim, 10_000.0), SEQ)
    return m, rope, torch.randn(2, SEQ, 32)


def rows(weight: torch.Tensor, head: int, size: int) -> torch.Tensor:
    return weight[head * size:(head + 1) * size]


@pytest.mark.parametrize("case", ["mha", "gqa_documents", "window_documents", "chunks", "causal_chunks", "autocast"])
def test_the_noted_maximum_is_the_largest_allowed_logit(case, monkeypatch):
    torch.manual_seed(len(case))
    heads, kv_heads = (4, 2) if case != "mha" else (3, 3)
    q, k = torch.randn(2, heads, SEQ, 8), torch.randn(2, kv_heads, SEQ, 8)
    ids = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * 24]) if case not in ("mha", "causal_chunks") else None
    window = 4 if case == "window_documents" else None
    if case.endswith("chunks"):
        monkeypatch.setattr(attention_module, "MAX_LOGIT_CHUNK", 2 * heads * SEQ * 3)  # 3 query rows a chunk
    into = torch.full((heads,), float("-inf"))
    # Training under autocast: the logits are still computed (and kept) in float32.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        note_max_logits(into, q, k, None if ids is None else DocumentMask(ids, flex=False), 0.3, window)
    expected = reference_max(q, k, 0.3, ids, window)
    torch.testing.assert_close(into.double(), expected, rtol=1e-6, atol=0)
    # A forward without gradients (validation, generation) notes nothing.
    with torch.no_grad():
        note_max_logits(into, 10 * q, k, None, 0.3, window)
    torch.testing.assert_close(into.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "biased"])
def test_mha_clip_scales_exactly_the_heads_over_the_threshold(bias):
    m, rope, x = gqa_attention(2, 2, bias, seed=1 + bias)
    with torch.no_grad():  # head 0 sharp, head 1 flat
        for linear, factor in ((m.wq, 3.0), (m.wk, 3.0)):
            rows(linear.weight, 0, 8).mul_(factor)
            rows(linear.weight, 1, 8).mul_(0.2)
    before = {name: p.detach().clone() for name, p in m.named_parameters()}
    maxima = reference_max(**{n: v for n, v in seen_qk(m, x, rope).items() if n in "qk"}, scale=8 ** -0.5)
    tau = float(maxima[0]) / 2
    assert maxima[1] < tau < maxima[0]
    clip = QKClip(tau, [as_model(m)], torch.device("cpu"))
    m(x, rope)
    clip.after_step()
    assert torch.isinf(m.logit_max).all()  # cleared for the next step
    root = math.sqrt(tau / float(maxima[0]))
    for name in ("wq.weight", "wk.weight") + (("wq.bias", "wk.bias") if bias else ()):
        p = dict(m.named_parameters())[name]
        torch.testing.assert_close(rows(p, 0, 8), rows(before[name], 0, 8) * root, rtol=1e-6, atol=0)
        assert torch.equal(rows(p, 1, 8), rows(before[name], 1, 8))
    for name in ("wv.weight", "wo.weight"):
        assert torch.equal(dict(m.named_parameters())[name], before[name])
    after = reference_max(**{n: v for n, v in seen_qk(m, x, rope).items() if n in "qk"}, scale=8 ** -0.5)
    assert float(after[0]) == pytest.approx(tau, rel=1e-5)
    assert after[1] == maxima[1]
    assert clip.metrics() == {"qk_clip/heads_clipped": 1, "qk_clip/max_logit": pytest.approx(float(maxima[0]))}


def test_gqa_clip_leaves_a_shared_key_to_heads_under_the_threshold():
    """Key head 0 serves query heads 0 (over) and 1 (under): the key stays, query 0 takes all of gamma. Key
    head 1 serves heads 2 and 3, both over: the key takes sqrt of the larger gamma, each query the rest."""
    m, rope, x = gqa_attention(4, 2, bias=True, seed=3)
    with torch.no_grad():
        for head, factor in ((0, 4.0), (1, 0.2), (2, 3.0), (3, 5.0)):
            rows(m.wq.weight, head, 8).mul_(factor)
            rows(m.wq.bias, head, 8).mul_(factor)
        m.wk.weight.mul_(2.0)
    before = {name: p.detach().clone() for name, p in m.named_parameters()}
    maxima = reference_max(**{n: v for n, v in seen_qk(m, x, rope).items() if n in "qk"}, scale=8 ** -0.5)
    tau = float(maxima[[0, 2, 3]].min()) * 0.8
    assert maxima[1] < tau
    clip = QKClip(tau, [as_model(m)], torch.device("cpu"))
    m(x, rope)
    clip.after_step()
    gamma = (tau / maxima).clamp(max=1)
    key1 = math.sqrt(max(gamma[2], gamma[3]))
    expected_q = {0: gamma[0], 1: 1.0, 2: gamma[2] / key1, 3: gamma[3] / key1}
    for head, factor in expected_q.items():
        for name in ("wq.weight", "wq.bias"):
            new, old = rows(dict(m.named_parameters())[name], head, 8), rows(before[name], head, 8)
            if head == 1:
                assert torch.equal(new, old)
            else:
                torch.testing.assert_close(new, old * float(factor), rtol=1e-6, atol=0)
    assert torch.equal(rows(m.wk.weight, 0, 8), rows(before["wk.weight"], 0, 8))
    torch.testing.assert_close(rows(m.wk.weight, 1, 8), rows(before["wk.weight"], 1, 8) * key1, rtol=1e-6, atol=0)
    after = reference_max(**{n: v for n, v in seen_qk(m, x, rope).items() if n in "qk"}, scale=8 ** -0.5)
    torch.testing.assert_close(after[[0, 2, 3]], torch.full((3,), tau, dtype=torch.float64), rtol=1e-5, atol=0)
    assert after[1] == maxima[1]
    assert clip.metrics()["qk_clip/heads_clipped"] == 3


@pytest.mark.parametrize("flavor", ["debug", "debug_qlora"])
def test_mla_clip_scales_the_no_position_parts_by_sqrt_gamma_and_the_rotary_query_by_gamma(flavor):
    args = deepseek_v3_flavors[flavor].finalize(2048, SEQ)
    args = type(args)(**{**args.__dict__, "n_heads": 2})
    torch.manual_seed(5)
    m = MultiHeadLatentAttention(args)
    rope = rope_table(args.rope_frequencies(), SEQ) * args.rope_attention_factor
    x = torch.randn(2, SEQ, args.dim)
    wq = m.wq if m.wq is not None else m.wq_b
    n, r, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    with torch.no_grad():
        rows(wq.weight, 0, n + r).mul_(4.0)
        rows(wq.weight, 1, n + r).mul_(0.2)
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    documents = DocumentMask(ids, flex=False)
    before = {name: p.detach().clone() for name, p in m.named_parameters()}
    seen = seen_qk(m, x, rope, documents)
    maxima = reference_max(seen["q"], seen["k"], seen["scale"], ids)
    tau = float(maxima[0]) / 3
    assert maxima[1] < tau
    clip = QKClip(tau, [as_model(m)], torch.device("cpu"))
    m(x, rope, documents=documents)
    clip.after_step()
    gamma = tau / float(maxima[0])
    params = dict(m.named_parameters())
    wq_name = "wq.weight" if m.wq is not None else "wq_b.weight"
    head0 = rows(before[wq_name], 0, n + r)
    torch.testing.assert_close(rows(params[wq_name], 0, n + r)[:n], head0[:n] * math.sqrt(gamma), rtol=1e-6, atol=0)
    torch.testing.assert_close(rows(params[wq_name], 0, n + r)[n:], head0[n:] * gamma, rtol=1e-6, atol=0)
    kv0 = rows(before["wkv_b.weight"], 0, n + v)
    torch.testing.assert_close(rows(params["wkv_b.weight"], 0, n + v)[:n], kv0[:n] * math.sqrt(gamma), rtol=1e-6,
                               atol=0)
    assert torch.equal(rows(params["wkv_b.weight"], 0, n + v)[n:], kv0[n:])  # the values
    assert torch.equal(rows(params[wq_name], 1, n + r), rows(before[wq_name], 1, n + r))
    assert torch.equal(rows(params["wkv_b.weight"], 1, n + v), rows(before["wkv_b.weight"], 1, n + v))
    for name in before:
        if name not in (wq_name, "wkv_b.weight"):
            assert torch.equal(params[name], before[name]), name  # wkv_a (the shared rotary key), wo, norms
    seen = seen_qk(m, x, rope, documents)
    after = reference_max(seen["q"], seen["k"], seen["scale"], ids)
    assert float(after[0]) == pytest.approx(tau, rel=1e-5)
    assert after[1] == maxima[1]


def test_threshold_zero_notes_and_changes_nothing():
    m, rope, x = gqa_attention(2, 2, False, seed=7)
    before = {name: p.detach().clone() for name, p in m.named_parameters()}
    clip = QKClip(0.0, [as_model(m)], torch.device("cpu"))
    m(x, rope)
    clip.after_step()
    assert m.logit_max is None and clip.metrics() == {}
    assert all(torch.equal(p, before[name]) for name, p in m.named_parameters())


@pytest.mark.parametrize("tau", [-1.0, float("nan"), float("inf")])
def test_an_invalid_threshold_is_refused(tau):
    problems = qk_clip.config_problems(Optimizer(qk_clip_threshold=tau), "llama3", None)
    assert problems and problems[0][0] == "optimizer.qk_clip_threshold" and "must be > 0" in problems[0][1]


@pytest.mark.parametrize("config", ["qwen3_debug", "qwen3_next_debug"])
def test_qk_norm_families_are_refused_in_one_line(config, tmp_path):
    from torchtitan.train import main

    assert_one_line_error(main, ["--job.config_file", f"train_configs/{config}.toml", "--optimizer.qk_clip_threshold",
                                 "50", f"--job.dump_folder={tmp_path}"],
                          "optimizer.qk_clip_threshold", config.removesuffix("_debug"), "qk_norm")


def test_a_compiled_block_notes_what_the_eager_one_does():
    """The measurement runs eagerly between the compiled graphs (the trainer compiles without fullgraph then)."""
    m, rope, x = gqa_attention(4, 2, bias=False, seed=11)
    eager = QKClip(1e9, [as_model(m)], torch.device("cpu"))
    m(x, rope)
    expected = m.logit_max.clone()
    eager.discard_step()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=False)
    compiled(x, rope)
    torch.testing.assert_close(m.logit_max, expected, rtol=1e-6, atol=0)
    compiled(x * 0.5, rope)  # a later step's smaller logits leave the step's maximum as it was
    torch.testing.assert_close(m.logit_max, expected, rtol=1e-6, atol=0)


def crossing_documents(seq: int, cp: int) -> torch.Tensor:
    """Two rows of document ids: one document across each of the 2 * cp - 1 cuts between the head-tail chunks (its
    boundaries half-way into the chunks), and one document for the whole row."""
    chunk = seq // (2 * cp)
    return torch.stack([(torch.arange(seq) + chunk // 2) // chunk, torch.zeros(seq, dtype=torch.long)])


def _cp_worker(rank, world, port, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    worst, cases = 0.0, 0
    seq = 12 * world  # chunks of 6 tokens
    for kv_heads in (4, 2):  # multi-head, grouped-query
        for documents in (False, True):
            for window in (None, 5, 9):  # a window inside one chunk and one across two
                for chunk_rows in (None, 4):  # the measurement in one piece, or 4 query rows at a time
                    cases += 1
                    attention_module.MAX_LOGIT_CHUNK = 2**24 if chunk_rows is None else 2 * 4 * seq * chunk_rows
                    g = torch.Generator().manual_seed(cases)  # every rank draws the same full tensors
                    q = torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64)
                    k = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64)
                    ids = crossing_documents(seq, world) if documents else None
                    expected = torch.full((4,), float("-inf"), dtype=torch.float64)
                    note_max_logits(expected, q, k, None if ids is None else DocumentMask(ids, flex=False), 0.3,
                                    window)
                    local = [shard_sequence(t, 2, rank, world) for t in (q, k)]
                    mask = None if ids is None else DocumentMask(shard_sequence(ids, 1, rank, world), flex=False)
                    into = torch.full((4,), float("-inf"), dtype=torch.float64)
                    context_parallel_max_logits(into, *local, mask, 0.3, window, cp_group_or_mesh=mesh)
                    with torch.no_grad():  # not a training forward: nothing noted (and nothing gathered)
                        context_parallel_max_logits(into, 10 * local[0], local[1], mask, 0.3, window,
                                                    cp_group_or_mesh=mesh)
                    dist.all_reduce(into, op=dist.ReduceOp.MAX)
                    worst = max(worst, (into - expected).abs().max().item())
    # Through apply_context_parallel: an attention module's forward on this rank's tokens (its RoPE rows at their
    # global positions) notes, max-reduced, what the unsharded module notes, with and without documents.
    torch.manual_seed(0)
    attention = Attention(64, 8, 4, 8, "pairs").double()
    rope = rope_table(rope_frequencies(8, 10_000.0), seq).double()
    x, ids = torch.randn(2, seq, 64, dtype=torch.float64), crossing_documents(seq, world)
    expected = []
    for documents in (None, DocumentMask(ids, flex=False)):
        attention.logit_max = torch.full((8,), float("-inf"), dtype=torch.float64)
        attention(x, rope, documents=documents)
        expected.append(attention.logit_max)
    apply_context_parallel(as_model(attention), mesh, seq, "allgather")
    module_err = 0.0
    for documents, want in zip((None, DocumentMask(shard_sequence(ids, 1, rank, world), flex=False)), expected):
        attention.logit_max = torch.full((8,), float("-inf"), dtype=torch.float64)
        attention(shard_sequence(x, 1, rank, world), rope, documents=documents)
        dist.all_reduce(attention.logit_max, op=dist.ReduceOp.MAX)
        module_err = max(module_err, (attention.logit_max - want).abs().max().item())
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump({"worst": worst, "cases": cases, "module": module_err}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_maxima_are_the_whole_sequences(tmp_path, world):
    """fp64: each rank's maxima, max-reduced, equal the whole-sequence note (MHA and GQA, with and without
    documents crossing every cut, without a window and with windows inside and across chunks, in one piece and in
    chunks of query rows); and an attention module under apply_context_parallel notes the unsharded one's maxima."""
    mp.start_processes(_cp_worker, args=(world, _free_port(), str(tmp_path / "worst")), nprocs=world,
                       start_method="spawn")
    for rank in range(world):
        report = json.loads((tmp_path / f"worst.{rank}").read_text())
        assert report["cases"] == 24
        assert report["worst"] <= 1e-12 and report["module"] <= 1e-12, (rank, report)


def test_the_config_accepts_context_parallelism():
    from torchtitan.config import load_config
    from torchtitan.config_check import validate_config

    for flags in (["--training.seq_len", "64"], ["--training.seq_len", "96", "--parallelism.tensor_parallel_degree",
                                                  "2", "--parallelism.data_parallel_shard_degree", "1"]):
        cfg, sources = load_config(["--job.config_file", "train_configs/debug_model.toml", "--optimizer.name", "Muon",
                                    "--optimizer.qk_clip_threshold", "50", "--parallelism.context_parallel_degree",
                                    "2", *flags])
        validate_config(cfg, sources, world_size=4)
