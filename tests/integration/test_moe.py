"""Qwen3-MoE under every layout expert parallelism composes with: the single process's losses, grad norms and
routing biases (aux-loss-free balancing on, updated every step), resuming across expert-parallel degrees, the
Hugging Face export of a trained model, and a 200-step run that learns and stays balanced.

All layouts (names prefixed "moe_") run in the suite-wide matrix (integration/conftest.py: one launch per
process count) and share one reference.
"""

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers

from tests.generation_checks import SAVE_LAST_STEP
from tests.generation_checks import assert_trained_checkpoint_generates_as_the_no_cache_path as assert_generates
from tests.integration.parity import Matrix, assert_same_steps, rows_of
from torchtitan.inference import load_model

CONFIG = "train_configs/qwen3_moe_debug.toml"
STEPS = 6
N_LAYERS = 4
COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "32", "--training.steps", str(STEPS),
          "--metrics.log_freq", "1", "--moe.bias_update_rate", "1e-3", "--checkpoint.enable", "--checkpoint.interval",
          "3", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# name: (processes, flags); every layout trains global batch 8.
LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "ep2": (2, ["--training.local_batch_size", "4", *EP2]),
    "ep2_tp2": (4, ["--training.local_batch_size", "4", *EP2, "--parallelism.tensor_parallel_degree", "2"]),
    "ep2_pp2": (4, ["--training.local_batch_size", "4", *EP2, "--parallelism.pipeline_parallel_degree", "2"]),
    "ep2_cp2": (2, ["--training.local_batch_size", "8", *EP2, "--parallelism.context_parallel_degree", "2"]),
    "hsdp2x2_ep2": (4, ["--training.local_batch_size", "2", *EP2, "--parallelism.data_parallel_replicate_degree",
                        "2"]),
    "ep2_compile": (2, ["--training.local_batch_size", "4", *EP2, "--compile.enable"]),
    "ep2_accum2": (2, ["--training.local_batch_size", "2", "--training.global_batch_size", "8", *EP2]),
}


def _resume_from_ep2(folder, nproc: int, ep: int) -> tuple[int, list[str]]:
    # The whole state of the EP 2 run's step 3 (model, optimizer, schedule, data position, step).
    return nproc, ["--training.local_batch_size", str(8 // nproc), "--parallelism.expert_parallel_degree", str(ep),
                   "--checkpoint.initial_load_path", str(folder / "moe_ep2" / "checkpoint" / "step-3"),
                   "--checkpoint.no_initial_load_model_only"]


def _transformers_checkpoint(folder):
    """A random Qwen3MoeForCausalLM of the debug flavor's shape, saved by transformers."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]


# The preset as shipped (batch 8 x 256), 200 steps with a 10-step warmup, in fp32.
# The last step's model is saved: the generation engine is checked on it.
BALANCE = ["--training.mixed_precision_param", "float32", "--training.steps", "200", "--lr_scheduler.warmup_steps",
           "10", "--metrics.log_freq", "1", *SAVE_LAST_STEP]


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py)."""
    from_hf = _transformers_checkpoint(folder / "moe_hf")
    layouts = {
        # The reference also exports a Hugging Face folder at its last step, dropping the trained routing bias.
        "single": (1, ["--training.local_batch_size", "8", "--checkpoint.last_save_in_hf",
                       "--checkpoint.hf_drop_expert_bias"]),
        **LAYOUTS,
        # Listed after "ep2", whose step-3 checkpoint they start from (one launch runs its jobs in order).
        "resume_ep2": _resume_from_ep2(folder, 2, 2),
        "resume_ep1": _resume_from_ep2(folder, 2, 1),
        "resume_ep4": _resume_from_ep2(folder, 4, 4),
        # Starting from a transformers-saved checkpoint: the experts are split over the EP ranks as they load.
        "from_hf": (1, ["--training.local_batch_size", "8", *from_hf]),
        "from_hf_ep2": (2, ["--training.local_batch_size", "4", *EP2, *from_hf]),
    }
    long = {"balanced": (1, []), "unbalanced": (1, ["--moe.bias_update_rate", "0"])}
    return {"moe_": Matrix(layouts, CONFIG, COMMON), "moe200_": Matrix(long, CONFIG, BALANCE)}


class Runs:
    """The suite matrix's MoE runs, by this module's layout names."""

    def __init__(self, folder, runs):
        self.folder, self.runs = folder, runs

    def rows(self, name: str) -> list[dict]:
        return rows_of(self.runs, "moe_" + name)

    def checkpoint(self, name: str, step: int = STEPS):
        return self.folder / f"moe_{name}" / "checkpoint" / f"step-{step}"


@pytest.fixture(scope="module")
def moe_runs(suite_runs):
    return Runs(*suite_runs)


def expert_biases(step_folder) -> torch.Tensor:
    """The routing bias of every MoE layer in a checkpoint, (layers, experts)."""
    state = {"model": {f"layers.{i}.moe.expert_bias": torch.zeros(8) for i in range(N_LAYERS)}}
    dcp.load(state, checkpoint_id=str(step_folder), no_dist=True)
    return torch.stack([state["model"][f"layers.{i}.moe.expert_bias"] for i in range(N_LAYERS)])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process_losses_and_routing_biases(moe_runs, layout):
    reference = moe_runs.rows("single")
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert reference[-1]["loss"] != reference[0]["loss"]
    assert_same_steps(moe_runs.rows(layout), reference)
    # The expert loads the layout logged are the single process's (the same tokens went to the same experts).
    for ours, ref in zip(moe_runs.rows(layout), reference):
        assert ours["moe/max_over_mean"] == pytest.approx(ref["moe/max_over_mean"], abs=1e-3), ours["step"]
    expected = expert_biases(moe_runs.checkpoint("single"))
    assert expected.abs().max() > 0  # the biases moved, every step by +-1e-3 or 0
    torch.testing.assert_close(expert_biases(moe_runs.checkpoint(layout)), expected, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("resumed, bitwise", [("resume_ep2", True), ("resume_ep1", False), ("resume_ep4", False)])
def test_checkpoint_saved_under_ep2_resumes_under_another_ep_degree(moe_runs, resumed, bitwise):
    straight = moe_runs.rows("ep2")[3:]
    rows = moe_runs.rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    if bitwise:
        assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in straight]
    else:
        assert_same_steps(rows, straight)


@pytest.mark.slow
def test_a_transformers_checkpoint_starts_runs_under_expert_parallelism(moe_runs):
    single = moe_runs.rows("from_hf")
    assert single[0]["loss"] != moe_runs.rows("single")[0]["loss"]  # other weights than the seeded ones
    assert_same_steps(moe_runs.rows("from_hf_ep2"), single)


@pytest.mark.slow
def test_hf_export_of_the_trained_model_drops_the_bias_and_loads_in_transformers(moe_runs):
    export = moe_runs.checkpoint("single").parent / f"export-step-{STEPS}"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    ours = load_model(CONFIG, str(moe_runs.checkpoint("single")))
    assert ours.layers["0"].moe.expert_bias.abs().max() > 0
    tokens = torch.randint(0, config["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer in ours.layers.values():
            layer.moe.expert_bias.zero_()  # what the export dropped
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_200_steps_learn_and_aux_loss_free_balancing_keeps_the_experts_even(suite_runs):
    figures = {}
    for name in ("balanced", "unbalanced"):
        rows = rows_of(suite_runs[1], "moe200_" + name)
        assert len(rows) == 200 and all(math.isfinite(r["loss"]) for r in rows)
        last = rows[-20:]
        figures[name] = (rows[0]["loss"] - sum(r["loss"] for r in last) / 20,
                         sum(r["moe/max_over_mean"] for r in last) / 20)
    print(f"\nloss drop (nats), busiest/mean load over the last 20 steps: {figures}")
    drop, balance = figures["balanced"]
    assert drop >= 1.0
    assert balance <= 1.5
    # Without the routing bias the same run's experts are less even.
    assert figures["unbalanced"][1] > balance


def _moe_trainer(tmp_path, *flags):
    from torchtitan.config import load_config
    from torchtitan.config_check import validate_config
    from torchtitan.train import Trainer

    cfg, sources = load_config(["--job.config_file", CONFIG, f"--job.dump_folder={tmp_path}", "--training.seq_len",
                                "32", "--training.mixed_precision_param", "float32", *flags])
    validate_config(cfg, sources, world_size=1)
    return Trainer(cfg)


def test_loads_bias_updates_and_aux_loss_reach_the_console_jsonl_and_tensorboard(tmp_path, caplog):
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _moe_trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2", "--moe.aux_loss_coeff",
                           "0.01", "--metrics.enable_tensorboard")
    moes = [block.moe for block in trainer.model_parts[0].layers.values()]
    loads, biases = [], []
    collect, after_step = trainer.expert_loads.collect, trainer.expert_loads.after_step

    def collect_loads():  # the loads each step routed
        loads.append(torch.stack([m.tokens_per_expert.clone() for m in moes]))
        collect()

    def moved_biases():  # and the biases they moved
        after_step()
        biases.append(torch.stack([m.expert_bias.clone() for m in moes]))

    trainer.expert_loads.collect, trainer.expert_loads.after_step = collect_loads, moved_biases
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        trainer.train()
    trainer.close()
    assert all(load.sum(dim=1).tolist() == [8 * 32 * 2] * 4 for load in loads)  # every token, k = 2 copies
    previous = torch.zeros_like(biases[0])
    for load, bias in zip(loads, biases):
        load = load.float()
        torch.testing.assert_close(bias - previous, 1e-3 * torch.sign(load.mean(1, keepdim=True) - load))
        previous = bias
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4]  # a log step reports its own step's loads and auxiliary loss
    assert rows[2]["moe/aux_loss"] < 1.5 * rows[0]["moe/aux_loss"]
    for row in rows:
        load = loads[row["step"] - 1].float()
        assert row["moe/max_over_mean"] == pytest.approx((load.max(1).values / load.mean(1)).mean().item(), abs=1e-4)
        assert row["moe/layer2/max_tokens"] == load[2].max().item()
        busiest = load[2].max().item() / load[2].sum().item()
        assert row["moe/layer2/busiest_fraction"] == pytest.approx(busiest, abs=1e-6)
        for layer in range(N_LAYERS):  # every expert's share of each layer's routed tokens
            shares = (load[layer] / load[layer].sum()).tolist()
            assert row[f"moe/layer{layer}/expert_fractions"] == pytest.approx(shares, abs=1e-6)
        assert 0 < row["moe/aux_loss"] < 1
    assert "moe_load: " in caplog.text and "moe_aux: " in caplog.text
    acc = EventAccumulator(str(next((tmp_path / "tb" / "rank0").glob("events.out.tfevents.*"))))
    acc.Reload()
    assert [e.value for e in acc.Scalars("moe/max_over_mean")] == pytest.approx([r["moe/max_over_mean"] for r in rows])
    assert "moe/layer3/busiest_fraction" in acc.Tags()["scalars"]
    assert not any("expert_fractions" in tag for tag in acc.Tags()["scalars"])  # lists stay out of TensorBoard


def test_aux_loss_under_gradient_accumulation_equals_one_large_batch(tmp_path):
    flags = ("--training.steps", "1", "--moe.aux_loss_coeff", "0.1", "--optimizer.eps", "1e-6")
    big = _moe_trainer(tmp_path / "a", "--training.local_batch_size", "8", *flags)
    small = _moe_trainer(tmp_path / "b", "--training.local_batch_size", "2", "--training.global_batch_size", "8",
                         *flags)
    batch = next(iter(big.dataloader))
    data = iter(small.dataloader)
    micro = [next(data) for _ in range(4)]
    loss_big, norm_big = big.train_step([batch])
    loss_small, norm_small = small.train_step(micro)
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm_small, norm_big, rtol=1e-5, atol=1e-7)
    big_gate = big.model_parts[0].layers["1"].moe.router.gate.weight
    small_gate = small.model_parts[0].layers["1"].moe.router.gate.weight
    torch.testing.assert_close(small_gate.grad, big_gate.grad, rtol=1e-5, atol=1e-8)
    aux = [t.expert_loads.aux_loss.item() for t in (big, small)]
    assert aux[0] > 0 and aux[1] == pytest.approx(aux[0], rel=1e-6)


@pytest.mark.slow
def test_the_trained_model_generates_as_the_no_cache_path(suite_runs):
    assert len(rows_of(suite_runs[1], "moe200_balanced")) == 200
    assert_generates(CONFIG, suite_runs[0] / "moe200_balanced" / "checkpoint" / "step-200")
