"""µP: the model's factors (models/shared/mup.py), the learning-rate multipliers (components/optimizers/mup.py), the [model.mup]
checks, and a coordinate check small enough for the suite (benchmarks/mup.py has the full tables)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.test_data_validation import config_error
from torchtitan.components.optimizers.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizers.mup import apply_lr_multipliers, base_lr, lr_multipliers
from torchtitan.components.optimizers.optimizer import build_optimizer
from torchtitan.config.job_config import LRScheduler, Optimizer
from torchtitan.models.llama3.args import Llama3ModelArgs
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3_moe import qwen3_moe_flavors
from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.mup import hidden_matrices

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mup as mup_benchmark  # noqa: E402

VOCAB, SEQ = 96, 16


def args_of(width: int, base_width: int | None = None, base_head_dim: int = 0, n_heads: int = 4):
    args = Llama3ModelArgs(dim=width, n_layers=2, n_heads=n_heads, multiple_of=32).finalize(VOCAB, SEQ)
    return args.with_mup(base_width, base_head_dim) if base_width else args


def build(args, seed: int = 0) -> Decoder:
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def adamw_steps(model: Decoder, steps: int, lr: float = 1e-2, name: str = "AdamW") -> list[float]:
    cfg = Optimizer(name=name, lr=lr, implementation="for-loop", muon_ns_dtype="float32")
    optimizer = build_optimizer([model], cfg)
    if model.args.mup is not None:
        apply_lr_multipliers(optimizer, lr_multipliers([model], model.args.mup, model.args.dim, cfg))
    losses = []
    for step in range(steps):
        batch = tokens(step)
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
def test_at_the_base_width_mup_is_the_standard_parametrization_bit_for_bit(optimizer):
    width = 64
    standard, mup = build(args_of(width)), build(args_of(width, base_width=width))
    assert mup.args.attention_scale is None and mup.args.output_multiplier == 1
    for (name, a), b in zip(standard.state_dict().items(), mup.state_dict().values()):
        assert torch.equal(a, b), name
    assert adamw_steps(standard, 3, name=optimizer) == adamw_steps(mup, 3, name=optimizer)
    for (name, a), b in zip(standard.state_dict().items(), mup.state_dict().values()):
        assert torch.equal(a, b), name


def test_hidden_matrices_start_scaled_by_the_root_of_the_width_ratio():
    width, base = 128, 32
    standard, mup = build(args_of(width)), build(args_of(width, base_width=base))
    hidden = hidden_matrices(mup)
    assert hidden == {f"layers.{i}.{m}.weight" for i in range(2)
                      for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    mup_params = dict(mup.named_parameters())
    for name, param in standard.named_parameters():
        expected = param * math.sqrt(base / width) if name in hidden else param
        assert torch.equal(mup_params[name], expected), name


def test_logits_are_scaled_by_the_width_ratio_and_attention_by_the_base_head_size():
    width, base = 128, 32
    # The base head size equal to this model's: only the logits change.
    mup = build(args_of(width, base_width=base, base_head_dim=width // 4))
    standard = build(args_of(width))
    standard.load_state_dict(mup.state_dict())
    batch = tokens()
    torch.testing.assert_close(mup(batch), standard(batch) * (base / width), rtol=1e-5, atol=1e-6)

    # A smaller base head size: q.k * sqrt(base_head_dim) / head_dim, which is the standard attention with the
    # queries multiplied by sqrt(base_head_dim / head_dim) (RoPE is linear in q).
    head_dim, base_head_dim = width // 4, 8
    mup = build(args_of(width, base_width=width, base_head_dim=base_head_dim))
    assert mup.args.attention_scale == pytest.approx(math.sqrt(base_head_dim) / head_dim)
    state = mup.state_dict()
    for i in range(2):
        state[f"layers.{i}.attention.wq.weight"] = state[f"layers.{i}.attention.wq.weight"] * math.sqrt(
            base_head_dim / head_dim)
    standard.load_state_dict(state)
    torch.testing.assert_close(mup(batch), standard(batch), rtol=1e-4, atol=1e-5)


def test_lr_multipliers_per_optimizer_and_parameter():
    width, base, lr = 128, 32, 1e-3
    model = build(args_of(width, base_width=base))
    cfg = Optimizer(name="AdamW", lr=lr, implementation="for-loop")
    multipliers = {name: lr_multipliers([model], model.args.mup, width, cfg)[p]
                   for name, p in model.named_parameters()}
    hidden = hidden_matrices(model)
    assert {n: m for n, m in multipliers.items() if m != 1} == dict.fromkeys(hidden, 0.25)

    optimizer = build_optimizer([model], cfg)
    apply_lr_multipliers(optimizer, lr_multipliers([model], model.args.mup, width, cfg))
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=4), 10)
    names = {p: n for n, p in model.named_parameters()}
    by_lr = {group["lr"]: {names[p] for p in group["params"]} for group in optimizer.param_groups}
    assert by_lr == {lr / 4 * 0.25: hidden, lr / 4: set(names.values()) - hidden}  # warm-up step 1 of 4
    assert base_lr(optimizer, scheduler.get_last_lr()[0]) == pytest.approx(lr / 4)

    for rule, expected in (("match_rms_adamw", 0.5), ("original", 1.0)):
        muon = Optimizer(name="Muon", lr=lr, muon_adjust_lr=rule)
        got = lr_multipliers([model], model.args.mup, width, muon)
        assert {got[p] for n, p in model.named_parameters() if n in hidden} == {expected}
        assert got[model.tok_embeddings.weight] == got[model.output.weight] == 1.0

    # A MoE's router gate has a fan_in of the width: AdamW's rule, also when Muon leaves it to its AdamW group.
    moe_args = qwen3_moe_flavors["debugmodel"].finalize(VOCAB, SEQ).with_mup(16, 0)
    with torch.device("meta"):
        moe = Decoder(moe_args)
    for name in ("AdamW", "Muon"):
        got = lr_multipliers([moe], moe_args.mup, moe_args.dim, Optimizer(name=name))
        r = 16 / moe_args.dim
        assert got[moe.layers["0"].moe.router.gate.weight] == pytest.approx(r)
        assert got[moe.layers["0"].moe.experts.w1] == pytest.approx(r if name == "AdamW" else math.sqrt(r))


def test_mup_settings_that_cannot_work_are_one_line_errors():
    assert config_error("--model.mup.base_width", "32") is None
    assert "base_head_dim = 16 does nothing without model.mup.base_width" in config_error(
        "--model.mup.base_head_dim", "16")
    assert "both must be >= 0" in config_error("--model.mup.base_width", "-1")
    assert "not optimizer.name = 'SGD'" in config_error("--model.mup.base_width", "32", "--optimizer.name", "SGD")
    assert "does not combine with the lora converter" in config_error(
        "--model.mup.base_width", "32", "--model.converters", "lora")
    # Hugging Face models have no µP multipliers: loading or saving them away from the base width is refused (the
    # tiny preset is 64 wide), at the base width it is the standard model and allowed.
    hf = ["--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    assert "checkpoint.last_save_in_hf = True cannot be used with µP" in config_error(
        "--model.mup.base_width", "32", *hf)
    assert config_error("--model.mup.base_width", "64", *hf) is None
    adapter = Llama3StateDictAdapter(args_of(128, base_width=32))
    with pytest.raises(ValueError, match="no µP multipliers"):
        adapter.to_hf(build(args_of(128, base_width=32)).state_dict())
    tied = config_error("--model.mup.base_width", "32", "--model.name", "qwen3", "--model.flavor", "0.6B")
    assert "model.mup.base_width = 32 needs separate embedding and output matrices" in tied


@pytest.mark.slow
def test_coordinate_check_activations_stay_put_under_mup_and_grow_under_sp():
    """The benchmark's coordinate check (pydocs batches, 5 AdamW steps at lr 0.01) at widths 64 and 256: every
    layer's mean |output| within 2x under µP; under SP each attention and feed-forward output more than doubles."""
    stream, vocab = mup_benchmark.token_stream(8 * mup_benchmark.BATCH * (mup_benchmark.SEQ_LEN + 1))
    mup = mup_benchmark.coordinate_check([64, 256], 64, stream, vocab, seeds=1)
    sp = mup_benchmark.coordinate_check([64, 256], None, stream, vocab, seeds=1)
    for layer in mup[64]:
        ratio = mup[256][layer] / mup[64][layer]
        assert 0.5 < ratio < 2, (layer, ratio)
    grown = {layer: sp[256][layer] / sp[64][layer] for layer in sp[64] if layer.endswith(("attention", "forward"))}
    assert len(grown) == 4 and min(grown.values()) > 2, grown
