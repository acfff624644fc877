"""optimizer.name = "Muon": the same steps as torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the
rest, stacked experts orthogonalised one by one, and which parameter of each debug model lands in which group."""

import dataclasses

import pytest
import torch

from torchtitan.components.optimizers.muon import MuonWithAdamW, lr_factor, newton_schulz, split_parameters
from torchtitan.components.optimizers.optimizer import build_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.protocols.train_spec import get_train_spec


def debug_model(name: str, flavor: str = "debugmodel", n_layers: int | None = None):
    spec = get_train_spec(name)
    args = spec.flavors[flavor]
    args = dataclasses.replace(args, n_layers=n_layers or args.n_layers).finalize(2048, 32)
    model = spec.model_cls(args)
    model.init_weights(int(torch.randint(0, 2**31, ())))
    return model


def steps_of(optimizer, model, batches):
    for tokens in batches:
        optimizer.zero_grad()
        model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()  # any loss that reaches every weight
        optimizer.step()


@pytest.mark.parametrize("rule, implementation", [("original", "foreach"), ("match_rms_adamw", "fused"),
                                                  ("match_rms_adamw", "for-loop")])
def test_five_fp32_steps_equal_torch_muon_on_the_matrices_and_torch_adamw_on_the_rest(rule, implementation):
    cfg = OptimizerConfig(name="Muon", lr=3e-3, weight_decay=0.05, beta1=0.85, beta2=0.97, eps=1e-7,
                          muon_momentum=0.9, muon_adjust_lr=rule, implementation=implementation)
    # The tiny flavor (64 wide): torch.optim.Muon orthogonalises in bfloat16, ~40x slower than float32 on an
    # AVX2-only CPU, so the matrices are kept small.
    ours = debug_model("llama3", "tiny")
    theirs = debug_model("llama3", "tiny")
    theirs.load_state_dict(ours.state_dict())
    initial = {name: param.detach().clone() for name, param in ours.named_parameters()}
    muon, adamw = split_parameters([theirs])
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[implementation]
    reference = [torch.optim.Muon([p for _, p in muon], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=0.9,
                                  adjust_lr_fn=rule),
                 torch.optim.AdamW([p for _, p in adamw], lr=cfg.lr, betas=(0.85, 0.97), eps=1e-7,
                                   weight_decay=cfg.weight_decay, **impl)]
    batches = [torch.randint(0, 2048, (2, 33)) for _ in range(5)]
    steps_of(build_optimizer([ours], dataclasses.replace(cfg, muon_ns_dtype="bfloat16")), ours, batches)

    class Both:
        def zero_grad(self):
            for opt in reference:
                opt.zero_grad()

        def step(self):
            for opt in reference:
                opt.step()

    steps_of(Both(), theirs, batches)
    for (name, mine), theirs_param in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(mine, theirs_param, rtol=0, atol=1e-6, msg=name)
        assert (mine - initial[name]).abs().max() > 1e-4, f"{name} did not move"  # the steps did something


def test_a_stack_of_experts_is_orthogonalised_one_matrix_at_a_time():
    stack = torch.randn(3, 16, 40)
    together = newton_schulz(stack, 5, torch.float32)
    for e in range(3):
        torch.testing.assert_close(together[e], newton_schulz(stack[e], 5, torch.float32), rtol=1e-5, atol=1e-5)
    # Orthogonalised: the singular values are pulled towards 1 (the quintic leaves them in about [0.5, 1.5]).
    singular = torch.linalg.svdvals(together)
    assert singular.min() > 0.4 and singular.max() < 1.6


def test_lr_rules_read_rows_as_output_features_whatever_the_storage():
    linear = torch.empty(96, 32)  # nn.Linear: [out, in]
    experts = torch.empty(4, 32, 96)  # stacked experts: [experts, in, out]
    for param in (linear, experts):
        assert lr_factor("original", param) == pytest.approx(3 ** 0.5)  # sqrt(max(1, 96 / 32))
        assert lr_factor("match_rms_adamw", param) == pytest.approx(0.2 * 96 ** 0.5)
    assert lr_factor("original", torch.empty(32, 96)) == 1.0


@pytest.mark.parametrize("family, flavor, expected_adamw", [
    ("llama3", "debugmodel", {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight",
                              "layers.0.ffn_norm.weight"}),
    ("qwen3_moe", "debugmodel", {"tok_embeddings.weight", "output.weight", "norm.weight",
                                 "layers.0.moe.router.gate.weight", "layers.0.attention.q_norm.weight"}),
    ("deepseek_v3", "debug", {"tok_embeddings.weight", "output.weight", "norm.weight",
                                   "layers.2.moe.router.gate.weight", "layers.0.attention.kv_norm.weight"}),
])
def test_each_parameter_of_the_debug_models_lands_in_its_group(family, flavor, expected_adamw):
    model = debug_model(family, flavor)
    muon, adamw = (dict(group) for group in split_parameters([model]))
    assert set(muon) | set(adamw) == {name for name, _ in model.named_parameters()} and not set(muon) & set(adamw)
    assert expected_adamw <= set(adamw)
    for name, param in muon.items():
        assert name.startswith("layers.") and param.ndim in (2, 3) and "router" not in name, name
    for name, param in adamw.items():
        assert param.ndim == 1 or not name.startswith("layers.") or ".router." in name, name
    stacked = [name for name, param in muon.items() if param.ndim == 3]
    assert bool(stacked) == (family != "llama3")  # the routed experts' [experts, in, out] stacks
    print(f"{family}: {len(muon)} Muon, {len(adamw)} AdamW; stacked {stacked[:3]}")


def test_the_routing_bias_is_not_a_parameter_of_either_group():
    model = debug_model("qwen3_moe")
    names = {name for group in split_parameters([model]) for name, _ in group}
    assert not any("expert_bias" in name for name in names)
    assert any("expert_bias" in name for name, _ in model.named_buffers())


def test_muon_optimizer_groups_and_lr_scheduler_scale_both():
    from torchtitan.components.optimizers.lr_scheduler import build_lr_scheduler
    from torchtitan.config.job_config import LRScheduler

    model = debug_model("llama3")
    optimizer = build_optimizer([model], OptimizerConfig(name="Muon", muon_ns_dtype="float32"))
    assert isinstance(optimizer, MuonWithAdamW)
    assert [g["kind"] for g in optimizer.param_groups] == ["muon", "adamw"]
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=4), total_steps=10)
    assert len({g["lr"] for g in optimizer.param_groups}) == 1 and optimizer.param_groups[0]["lr"] < 8e-4
    scheduler.step()
    assert len({g["lr"] for g in optimizer.param_groups}) == 1


def test_a_checkpoint_of_another_optimizer_is_refused_in_one_line_and_loads_model_only(tmp_path):
    from tests.bad_input import assert_one_line_error, run_entry_point, snapshot
    from torchtitan.train import main

    common = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "2", "--checkpoint.enable",
              "--checkpoint.interval", "2", "--checkpoint.last_save_model_only=false", "--training.seq_len", "16",
              f"--job.dump_folder={tmp_path}"]
    code, text = run_entry_point(main, common)
    assert code == 0, text[-3000:]
    before = snapshot(tmp_path / "checkpoint")
    more = [*common, "--training.steps", "4", "--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
    assert_one_line_error(main, more, "step-2", "optimizer state holds exp_avg, exp_avg_sq, step",
                          "optimizer keeps exp_avg, exp_avg_sq, momentum_buffer, step", "exclude_from_loading",
                          unchanged=before)
    code, text = run_entry_point(main, [*more, "--checkpoint.exclude_from_loading", "optimizer"])
    assert code == 0 and "resumed from step 2" in text, text[-3000:]


def test_a_muon_option_without_muon_is_refused_not_ignored(tmp_path):
    from tests.bad_input import assert_one_line_error
    from torchtitan.train import main

    argv = ["--job.config_file", "train_configs/tiny.toml", f"--job.dump_folder={tmp_path}",
            "--optimizer.muon_momentum", "0.9"]
    assert_one_line_error(main, argv, "optimizer.muon_momentum = 0.9 is read by Muon alone",
                          "optimizer.name = 'AdamW' would ignore it")
    assert not (tmp_path / "metrics.jsonl").exists()
