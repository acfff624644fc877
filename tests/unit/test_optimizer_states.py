"""optimizer.state_dtype = "bfloat16": AdamW moments and Muon momentum stored in bfloat16, math in float32;
the step is torch's AdamW arithmetic, it stays close to float32 states, and a resumed run repeats the straight
one bitwise."""

import json
import shutil

import pytest
import torch

from tests.bad_input import run_entry_point
from tests.unit.test_muon import debug_model, steps_of
from torchtitan.components.optimizers.muon import MuonWithAdamW
from torchtitan.components.optimizers.optimizer import KERNEL_FLAGS, build_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig


def test_the_float32_math_of_the_lean_step_is_torch_adamw():
    """The lean path's arithmetic, run on float32 states, gives torch.optim.AdamW's for-loop numbers."""
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    param = torch.randn(64, 32, requires_grad=True)
    initial = param.detach().clone()
    reference = param.detach().clone().requires_grad_()
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1,
                                    foreach=False)
    ours = MuonWithAdamW([], [param], cfg, KERNEL_FLAGS["for-loop"], ns_dtype=torch.float32)
    group, state = ours.param_groups[0], ours.state[param]
    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
    for _ in range(4):
        grad = torch.randn_like(param)
        param.grad, reference.grad = grad.clone(), grad.clone()
        with torch.no_grad():
            MuonWithAdamW._low_precision_adamw(param, state, group)
        torch_adamw.step()
    torch.testing.assert_close(param, reference, rtol=0, atol=1e-6)
    assert (param - initial).abs().max() > 1e-3  # the steps moved it


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_bfloat16_states_are_stored_in_bfloat16_and_stay_close_to_float32_states(name):
    base = debug_model("llama3", "tiny")
    batches = [torch.randint(0, 2048, (2, 33)) for _ in range(5)]
    results = {}
    for state_dtype in ("float32", "bfloat16"):
        model = debug_model("llama3", "tiny")
        model.load_state_dict(base.state_dict())
        cfg = OptimizerConfig(name=name, state_dtype=state_dtype, muon_ns_dtype="float32", lr=3e-3)
        optimizer = build_optimizer([model], cfg)
        steps_of(optimizer, model, batches)
        dtypes = {t.dtype for state in optimizer.state.values() for key, t in state.items() if key != "step"}
        assert dtypes == {getattr(torch, state_dtype)}
        results[state_dtype] = torch.cat([p.detach().flatten() for p in model.parameters()])
    start = torch.cat([p.detach().flatten() for p in base.parameters()])
    moved = (results["float32"] - start).norm()
    # bfloat16 keeps 8 bits of mantissa: the moments' rounding moves the weights by a small part of the update.
    assert 0 < (results["bfloat16"] - results["float32"]).norm() < 0.05 * moved


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_a_run_resumed_with_bfloat16_states_repeats_the_straight_run_bitwise(tmp_path, name):
    from torchtitan.train import main

    def run(folder, steps):
        argv = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", str(steps), "--metrics.log_freq",
                "1", "--training.mixed_precision_param", "float32", "--optimizer.name", name,
                "--optimizer.state_dtype", "bfloat16", "--checkpoint.enable",
                "--checkpoint.interval", "2", "--checkpoint.last_save_model_only=false", f"--job.dump_folder={folder}"]
        if name == "Muon":
            argv += ["--optimizer.muon_ns_dtype", "float32"]
        code, text = run_entry_point(main, argv)
        assert code == 0, text[-3000:]
        return [(r["step"], r["loss"], r["grad_norm"])
                for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())]

    # Steps 5 and 6 follow updates made from moments that were themselves updated after the resume, so they
    # differ unless the loaded moments are kept (and rounded) in bfloat16 as in the straight run.
    straight = run(tmp_path / "straight", 6)
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    assert run(tmp_path / "resumed", 6) == straight[2:]


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_loaded_bfloat16_states_stay_bfloat16(name):
    # torch's load_state_dict casts state to the parameters' dtype; ours must not end up in float32.
    cfg = OptimizerConfig(name=name, state_dtype="bfloat16", muon_ns_dtype="float32")
    models = [torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(8, 8)])}) for _ in range(2)]
    optimizers = [build_optimizer([model], cfg) for model in models]
    for p in models[0].parameters():
        p.grad = torch.randn_like(p)
    optimizers[0].step()
    optimizers[1].load_state_dict(optimizers[0].state_dict())
    for state in optimizers[1].state.values():
        assert {key: t.dtype for key, t in state.items() if key != "step"} == {
            key: torch.bfloat16 for key in state if key != "step"}


def _state_bytes(tensor) -> int:
    if hasattr(tensor, "qmap"):  # torchao's 8-bit state: codes, a scale per block, the code map
        return sum(_state_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("preset", ["train_configs/debug_model.toml", "train_configs/qwen3_moe_debug.toml",
                                    "train_configs/deepseek_v3_debug.toml"])
def test_the_planner_counts_the_optimizer_state_that_is_allocated(preset):
    """Per optimizer choice, the planner's optimizer bytes for the preset equal those of the states the optimizer
    allocates for the preset's model (AdamW8bit: torchao's buffers, quantised or not by its own rule)."""
    from torchtitan.config import load_config
    from torchtitan.planner import model_shape, predict_memory, resolve_layout
    from torchtitan.protocols.train_spec import build_model_args, get_train_spec

    model = None
    for name, state_dtype in [("AdamW", "float32"), ("AdamW", "bfloat16"), ("Muon", "float32"),
                              ("Muon", "bfloat16"), ("AdamW8bit", "float32")]:
        job, _ = load_config(["--job.config_file", preset, "--training.mixed_precision_param", "float32",
                              "--optimizer.name", name, "--optimizer.state_dtype", state_dtype,
                              "--optimizer.implementation", "for-loop" if name != "AdamW8bit" else "fused",
                              # the state is the same after any number of Newton-Schulz steps: one is quicker
                              *(["--optimizer.muon_ns_steps", "1"] if name == "Muon" else [])])
        shape = model_shape(job)
        if model is None:
            spec = get_train_spec(job.model.name)
            model = spec.model_cls(build_model_args(spec, job.model, shape.vocab, job.training.seq_len))
        optimizer = build_optimizer([model], job.optimizer)
        if name == "AdamW8bit":  # the buffers its first step would make, without compiling the step
            states = [optimizer._new_buffer(p, signed) for p in model.parameters() for signed in (True, False)]
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()
            states = [t for s in optimizer.state.values() for key, t in s.items() if key != "step"]
        measured = sum(_state_bytes(t) for t in states)
        planned = predict_memory(shape, job, resolve_layout(job, 1), on_cpu=True).optimizer
        assert planned == pytest.approx(measured, rel=1e-3), (name, state_dtype)


def test_the_planner_counts_optimizer_state_of_the_adapters_only_under_lora():
    """With LoRA the planner's optimizer bytes are those of the adapters, which the trainer's optimizer alone
    holds: AdamW's two float32 moments per adapter weight."""
    from torchtitan.components.lora.converter import LoRAConverter
    from torchtitan.config import load_config
    from torchtitan.planner import model_shape, predict_memory, resolve_layout
    from torchtitan.protocols.train_spec import build_model_args, get_train_spec

    job, _ = load_config(["--job.config_file", "train_configs/debug_model.toml", "--training.mixed_precision_param",
                          "float32", "--model.converters", "lora", "--lora.targets", "attention.*,feed_forward.w2"])
    shape = model_shape(job)
    spec = get_train_spec(job.model.name)
    model = spec.model_cls(build_model_args(spec, job.model, shape.vocab, job.training.seq_len))
    LoRAConverter(job, None).convert(model)
    adapters = [p for name, p in model.named_parameters() if ".lora_" in name]
    assert adapters and all(p.requires_grad for p in adapters)
    assert sum(p.requires_grad for p in model.parameters()) == len(adapters)
    optimizer = build_optimizer([model], job.optimizer)
    for p in adapters:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    measured = sum(_state_bytes(t) for s in optimizer.state.values() for key, t in s.items() if key != "step")
    memory = predict_memory(shape, job, resolve_layout(job, 1), on_cpu=True)
    assert memory.optimizer == pytest.approx(measured, rel=1e-6)
    assert memory.optimizer == pytest.approx(8 * sum(p.numel() for p in adapters), rel=1e-6)


def test_the_planner_counts_an_nf4_base_at_the_bytes_torchao_allocates():
    """QLoRA: the planner's parameter bytes equal those of the materialised model, whose NF4 weights are counted
    by torchao's inner tensors (codes and scales)."""
    from torchtitan.components.lora.converter import LoRAConverter
    from torchtitan.config import load_config
    from torchtitan.models.shared.nf4 import is_nf4
    from torchtitan.planner import model_shape, predict_memory, resolve_layout
    from torchtitan.protocols.train_spec import build_model_args, get_train_spec

    job, _ = load_config(["--job.config_file", "train_configs/debug_model.toml", "--training.mixed_precision_param",
                          "float32", "--model.converters", "lora", "--lora.base_dtype", "nf4"])
    shape = model_shape(job)
    spec = get_train_spec(job.model.name)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, job.model, shape.vocab, job.training.seq_len))
    converter = LoRAConverter(job, None)
    converter.convert(model)
    model.to_empty(device="cpu")
    model.init_weights(0)
    converter.init_weights(model, 0)
    assert sum(is_nf4(p) for p in model.parameters()) == 7 * len(model.layers)
    measured = sum(_state_bytes(p) if not is_nf4(p) else
                   sum(_state_bytes(getattr(p, n)) for n in p.__tensor_flatten__()[0]) for p in model.parameters())
    planned = predict_memory(shape, job, resolve_layout(job, 1), on_cpu=True).params
    assert planned == pytest.approx(measured, rel=1e-3)
