"""The MoE layer (models/shared/moe.py) against plain references: fp32, fresh random inputs every run."""

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan.models.shared.moe import GroupedExperts, MoE, MoEArgs, MoETraining, Router

DIM, HIDDEN = 32, 16


def _moe(seed: int, **overrides) -> MoE:
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, "hidden_dim": HIDDEN, **overrides})
    moe = MoE(DIM, args)
    moe.init_buffers(torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def _expert_grads(experts: GroupedExperts) -> list[torch.Tensor]:
    return [experts.w1.grad.clone(), experts.w2.grad.clone(), experts.w3.grad.clone()]


@pytest.mark.parametrize("counts", [[5, 0, 7, 3, 0, 9, 1, 7], [32, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 32]])
def test_grouped_path_equals_the_loop_forward_and_backward(counts):
    """Including experts with no token and one expert receiving every token."""
    experts = GroupedExperts(DIM, HIDDEN, len(counts))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x = torch.randn(sum(counts), DIM, requires_grad=True)
    grad_out = torch.randn(sum(counts), DIM)
    results = {}
    for path in ("grouped", "loop"):
        experts.path = path
        experts.zero_grad()
        x.grad = None
        out = experts(x, torch.tensor(counts))
        out.backward(grad_out)
        results[path] = (out.detach(), x.grad.clone(), *_expert_grads(experts))
    for grouped, loop in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    # An expert without tokens gets a zero gradient, not none: every rank's gradient reduction expects one.
    idle = [e for e, c in enumerate(counts) if c == 0]
    assert all(results["grouped"][2][e].abs().sum() == 0 for e in idle)


def _indexed_loop(x, w1, w2, w3, counts):
    """The loop path as it was first written: each expert's weights indexed out of the stacked ones."""
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        rows = x[start:start + count]
        outputs.append((F.silu(rows @ w1[expert]) * (rows @ w3[expert])) @ w2[expert])
        start += count
    return torch.cat(outputs)


def test_loop_path_equals_indexing_each_expert_bit_for_bit():
    counts = [5, 0, 7, 3, 0, 9, 1, 7]
    experts = GroupedExperts(DIM, HIDDEN, len(counts))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x = torch.randn(sum(counts), DIM, requires_grad=True)
    grad_out = torch.randn(sum(counts), DIM)
    out = experts(x, torch.tensor(counts))
    out.backward(grad_out)
    ours = (out.detach(), x.grad.clone(), *_expert_grads(experts))
    experts.zero_grad()
    x.grad = None
    expected = _indexed_loop(x, experts.w1, experts.w2, experts.w3, counts)
    expected.backward(grad_out)
    for mine, ref in zip(ours, (expected.detach(), x.grad, *_expert_grads(experts))):
        assert torch.equal(mine, ref)


class _AllocatedShapes(TorchDispatchMode):
    """The shapes of the tensors the ops it sees return, views aside."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_loop_backward_allocates_each_gradient_once_not_once_per_expert():
    # Indexing w[e] out of the stacked weights made every expert's backward allocate (and add) a zero gradient
    # as large as all the experts' weights: 64 experts of 256 x 768 spent 81% of the step filling zeros.
    # Slicing the tokens did the same with x's gradient.
    experts_n = 16
    experts = GroupedExperts(DIM, HIDDEN, experts_n)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x = torch.randn(experts_n * 2, DIM, requires_grad=True)
    out = experts(x, torch.full((experts_n,), 2))
    grad_out = torch.randn_like(out)
    with _AllocatedShapes() as backward:
        out.backward(grad_out)
    stacked = [tuple(w.shape) for w in experts.parameters()]
    assert sum(shape in stacked for shape in backward.shapes) == 3  # one stack per weight; 3 x 2 x 16 before
    assert backward.shapes.count(tuple(x.shape)) <= 2  # x's gradient put together once; 2 x 16 before


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, mixed with the top-k weights (zero for the experts not chosen)."""
    tokens = x.reshape(-1, DIM)
    weights, indices, _ = moe.router(tokens, moe.expert_bias, torch.float32)
    mix = torch.zeros(tokens.shape[0], moe.args.num_experts).scatter(1, indices, weights)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    every = torch.stack([(F.silu(tokens @ w1[e]) * (tokens @ w3[e])) @ w2[e] for e in range(moe.args.num_experts)], 1)
    out = (every * mix.unsqueeze(-1)).sum(1)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(tokens)
    return out.view_as(x)


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("overrides", [{}, {"score_func": "sigmoid", "route_scale": 2.5, "shared_hidden_dim": 24},
                                       {"n_groups": 4, "topk_group": 2, "top_k": 3, "route_norm": False}])
def test_dropless_output_and_gradients_equal_a_dense_computation(path, overrides):
    moe = _moe(seed=torch.randint(0, 2**31, ()).item(), **overrides)
    moe.configure(MoETraining(expert_path=path))
    x = torch.randn(3, 11, DIM, requires_grad=True)
    out = moe(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ours = [x.grad.clone(), *(p.grad.clone() for p in moe.parameters())]
    moe.zero_grad()
    x.grad = None
    expected = _dense_reference(moe, x)
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for name, mine, ref in zip(["x", *(n for n, _ in moe.named_parameters())], ours,
                               [x.grad, *(p.grad for p in moe.parameters())]):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_router_matches_a_hand_computation_with_groups_bias_and_scale():
    args = MoEArgs(num_experts=8, top_k=2, score_func="sigmoid", route_norm=True, route_scale=2.5, n_groups=4,
                   topk_group=2)
    router = Router(DIM, args)
    x = torch.randn(64, DIM)
    bias = torch.randn(8) * 0.5
    weights, indices, scores = router(x, bias, torch.float32)
    expected_scores = torch.sigmoid(x @ router.gate.weight.T)
    torch.testing.assert_close(scores, expected_scores)
    for t in range(64):
        choice = expected_scores[t] + bias
        # A group's score is the sum of its two best (biased) scores; the best 2 of 4 groups are eligible.
        groups = choice.view(4, 2).sum(-1)
        eligible = [g for g in groups.argsort(descending=True)[:2].tolist()]
        candidates = [e for e in range(8) if e // 2 in eligible]
        best = sorted(candidates, key=lambda e: -choice[e].item())[:2]
        assert sorted(indices[t].tolist()) == sorted(best)
        # The weights are the unbiased scores of the chosen experts, renormalised, times the route scale.
        unbiased = expected_scores[t, indices[t]]
        torch.testing.assert_close(weights[t], 2.5 * unbiased / unbiased.sum())


def test_expert_bias_changes_the_choice_not_the_weights():
    moe = _moe(seed=1)
    x = torch.randn(2, 16, DIM)
    moe.expert_bias[3] = 100.0  # every token takes expert 3 ...
    moe.expert_bias[5] = -100.0  # ... and none expert 5
    weights, indices, scores = moe.router(x.view(-1, DIM), moe.expert_bias, torch.float32)
    assert (indices == 3).any(dim=1).all() and not (indices == 5).any()
    torch.testing.assert_close(weights, scores.gather(1, indices) / scores.gather(1, indices).sum(1, keepdim=True))


def test_loads_count_training_forwards_once_even_with_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    moe = _moe(seed=2)
    x = torch.randn(2, 16, DIM, requires_grad=True)
    with torch.no_grad():
        moe(x)  # validation: not counted
    assert moe.tokens_per_expert.sum() == 0
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # the recomputation in backward is not counted
    assert moe.tokens_per_expert.sum() == 2 * 16 * 2
    _, indices, _ = moe.router(x.detach().view(-1, DIM), moe.expert_bias, torch.float32)
    assert moe.tokens_per_expert.tolist() == torch.bincount(indices.flatten(), minlength=8).tolist()


def _aux_reference(scores, indices, bsz, seqlen, k, num_experts, per_sequence):
    """coeff-free load-balancing loss: sum_i f_i * P_i, per sequence and averaged, or over the whole batch."""
    scores, indices = scores.view(bsz, seqlen, -1), indices.view(bsz, seqlen, -1)
    if not per_sequence:
        scores, indices = scores.reshape(1, bsz * seqlen, -1), indices.reshape(1, bsz * seqlen, -1)
    total = 0.0
    for s, i in zip(scores, indices):
        f = torch.bincount(i.flatten(), minlength=num_experts).float() * num_experts / (k * i.shape[0])
        total += (f * s.mean(0)).sum()
    return total / (bsz if per_sequence else 1)


@pytest.mark.parametrize("kind", ["sequence", "batch"])
def test_aux_loss_value_and_gradient_join_the_loss(kind):
    moe = _moe(seed=3)
    bsz, seqlen = 4, 9
    # The whole global batch is this one micro-batch.
    moe.configure(MoETraining(aux_loss_coeff=0.01, aux_loss_type=kind, aux_loss_scale=1.0 / bsz))
    x = torch.randn(bsz, seqlen, DIM)
    moe(x).sum().backward()
    gate_grad = moe.router.gate.weight.grad.clone()
    _, indices, scores = moe.router(x.view(-1, DIM), moe.expert_bias, torch.float32)
    expected = 0.01 * _aux_reference(scores, indices, bsz, seqlen, 2, 8, per_sequence=kind == "sequence")
    assert moe.aux_loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
    # The same model without the auxiliary loss, plus the reference loss's own gradient.
    moe.zero_grad()
    moe.configure(MoETraining(aux_loss_coeff=0.0))
    (moe(x).sum() + expected).backward()
    torch.testing.assert_close(gate_grad, moe.router.gate.weight.grad, rtol=1e-4, atol=1e-5)


def test_sequence_aux_loss_sums_over_micro_batches_to_the_global_mean():
    moe = _moe(seed=4)
    moe.configure(MoETraining(aux_loss_coeff=0.1, aux_loss_type="sequence", aux_loss_scale=1.0 / 6))
    x = torch.randn(6, 8, DIM)
    moe(x).sum().backward()
    whole, grad = moe.aux_loss_sum.item(), moe.router.gate.weight.grad.clone()
    moe.init_buffers()
    moe.zero_grad()
    for half in x.split(3):
        moe(half).sum().backward()
    assert moe.aux_loss_sum.item() == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(moe.router.gate.weight.grad, grad, rtol=1e-4, atol=1e-5)


def test_router_computes_in_float32_under_autocast_unless_told_otherwise():
    moe = _moe(seed=5)
    x = torch.randn(2, 8, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, fp32_scores = moe.router(x.view(-1, DIM), None, torch.float32)
        _, _, bf16_scores = moe.router(x.view(-1, DIM), None, None)
    exact = torch.softmax(x.view(-1, DIM) @ moe.router.gate.weight.T, -1)
    assert (fp32_scores - exact).abs().max() < 1e-6
    assert (bf16_scores - exact).abs().max() > 1e-5  # the gate ran in bfloat16


def test_a_dtype_cast_keeps_the_routing_bias_in_float32():
    moe = _moe(seed=6)
    moe.move_bias(1e-3 * torch.arange(8))
    expected = moe.expert_bias.clone()
    moe.to(torch.bfloat16)
    assert moe.router.gate.weight.dtype == torch.bfloat16
    assert moe.expert_bias.dtype == torch.float32 and torch.equal(moe.expert_bias, expected)


def test_args_check_names_the_field():
    assert MoEArgs(num_experts=4, top_k=5).check()[0][0] == "top_k"
    assert MoEArgs(num_experts=6, n_groups=4).check()[0][0] == "n_groups"
    assert MoEArgs(num_experts=8, n_groups=4, topk_group=1, top_k=3).check()[0][0] == "top_k"
    assert MoEArgs(route_scale=0.0).check()[0][0] == "route_scale"
    assert MoEArgs().check() == []


def test_flops_per_token_counts_active_parameters_by_hand():
    from torchtitan.models.qwen3_moe import qwen3_moe_flavors
    from torchtitan.models.shared.decoder import Decoder
    from torchtitan.protocols import count_params

    args = qwen3_moe_flavors["debugmodel"].finalize(tokenizer_vocab_size=100, seq_len=32)
    with torch.device("meta"):
        model = Decoder(args)
    dim, layers, heads, head_dim, kv = 64, 4, 4, 16, 2
    attention = dim * heads * head_dim * 2 + dim * kv * head_dim * 2 + 2 * head_dim  # q, o; k, v; q/k norms
    router = 8 * dim
    active_experts = 2 * 3 * dim * 32  # top 2 of 8 experts, SwiGLU of width 32
    norms = 2 * dim
    per_layer = attention + router + active_experts + norms
    active = layers * per_layer + dim + 100 * dim  # blocks, final norm, output projection
    expected = 6 * active + 12 * layers * heads * head_dim * 32
    assert args.flops_per_token(count_params(model, exclude_embedding=True), 32) == expected
    # The same count for a dense model with all 8 experts active would be larger by the idle experts.
    assert count_params(model, exclude_embedding=True) - args.active_params(count_params(model, True)) == \
        layers * 6 * 3 * dim * 32
    assert math.isclose(expected, 6 * active + 12 * 4 * 4 * 16 * 32)


class _SlowedLoop:
    """The loop path made ``seconds_per_row`` slower on a clock that runs ahead of the real one; records the
    rows of every call."""

    def __init__(self, monkeypatch, seconds_per_row: float):
        from torchtitan.models.shared import moe as moe_module

        self.rows, self.ahead, real = [], 0.0, moe_module._looped_swiglu

        def slowed(x, *args):
            self.rows.append(x.shape[0])
            self.ahead += seconds_per_row * x.shape[0]
            return real(x, *args)

        monkeypatch.setattr(moe_module, "_looped_swiglu", slowed)

    def clock(self) -> float:
        return time.perf_counter() + self.ahead


@pytest.mark.parametrize("seconds_per_row, rows", [
    (0.0, [256] * 4 + [512] * 4 + [1024] * 4),  # fast paths: every size, warm-up and 3 rounds each
    (1e-3, [256] * 4),  # 1 s at 256 tokens: 512 would end past the 3 s budget
    (1e-2, [256] * 2),  # a pass over the budget: only the warm-up and the one round a verdict needs
])
def test_auto_probe_stops_where_its_budget_says(monkeypatch, seconds_per_row, rows):
    from torchtitan.components.expert_load import probe_expert_paths

    loop = _SlowedLoop(monkeypatch, seconds_per_row)
    result = probe_expert_paths(8, DIM, HIDDEN, 1024, torch.float32, torch.device("cpu"), budget_seconds=3.0,
                                clock=loop.clock)
    assert loop.rows == rows
    assert result["tokens"] == rows[-1]
    if seconds_per_row:
        assert result["loop"] >= seconds_per_row * rows[-1] > result["grouped"]


@pytest.mark.parametrize("grouped, loop, cached, measurements", [
    (1.00, 1.05, False, 2),  # 5% apart, the noise 10%: used, not cached, timed again at the next start
    (1.00, 1.25, False, 2),  # 25% apart, but the rounds themselves spread 30%
    (2.00, 1.00, True, 1),
])
def test_auto_caches_only_a_verdict_beyond_the_noise(monkeypatch, tmp_path, grouped, loop, cached, measurements):
    from torchtitan.components import expert_load

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    noise = 0.3 if loop == 1.25 else 0.1
    probes, logged = [], []
    monkeypatch.setattr(expert_load, "probe_expert_paths", lambda *args: probes.append(args) or {
        "grouped": grouped, "loop": loop, "tokens": 256, "noise": noise})
    monkeypatch.setattr(expert_load.logger, "info", logged.append)
    for _ in range(2):
        path, why = expert_load.choose_expert_path("auto", 8, DIM, HIDDEN, 512, torch.float32, torch.device("cpu"))
    assert len(probes) == measurements and path == ("grouped" if grouped < loop else "loop")
    margin = max(grouped, loop) / min(grouped, loop) - 1
    verdict = (f"cached, margin beyond the noise ({noise:.0%})" if cached else
               f"within the noise ({noise:.0%}): not cached, timed again at the next start")
    assert why == (f"auto: {grouped * 1e3:.2f} ms grouped vs {loop * 1e3:.2f} ms loop, {path} faster by "
                   f"{margin:.1%}, {verdict}; 8 experts of {DIM} x {HIDDEN}, 256 tokens, torch.float32")
    # Said before measuring, with the budget.
    assert len(logged) == measurements and "timing the grouped and loop paths" in logged[0] and "3 s" in logged[0]
    cache = tmp_path / expert_load.EXPERT_PATH_CACHE_FILE
    assert len(json.loads(cache.read_text()) if cache.exists() else {}) == cached


@pytest.mark.parametrize("field", ["moe.aux_loss_coeff", "moe.bias_update_rate"])
def test_non_finite_moe_coefficients_are_refused_by_the_config_check_and_the_trainer(monkeypatch, tmp_path, field):
    import sys

    from tests.bad_input import assert_one_line_error
    from torchtitan import train
    from torchtitan.config import __main__ as config_cli

    def check_config(argv):
        monkeypatch.setattr(sys, "argv", ["python -m torchtitan.config", *argv])
        return config_cli.main()

    for value in ("nan", "inf"):
        argv = ["--job.config_file", "train_configs/qwen3_moe_debug.toml", f"--{field}", value,
                "--job.dump_folder", str(tmp_path)]
        for entry_point in (check_config, train.main):
            assert_one_line_error(entry_point, argv, f"{field} = {value} is invalid; it must be >= 0 and finite")
    assert not any(tmp_path.iterdir())  # refused before anything was written
