"""GRPO through the trainer (train_configs/grpo_debug.toml at a tiny size), in the suite-wide matrix:

- fixed rollouts (a file, served by tests/rl_doubles.py's replay sampler) train 4 fp32 steps alike in one process and
  under FSDP 2, TP 2, EP 2 (qwen3_moe) and LoRA (+ FSDP 2), with the KL to a frozen reference, and under PP 2 and
  CP 2 without one;
- the engine's own rollouts: the sampler's log-probabilities of the sampled tokens equal the trainer's within 1e-5
  for every token of the first 3 steps (fp32, one process);
- a run resumed from its step-2 checkpoint reproduces the straight run's steps 3-4 bitwise (losses, rewards).
"""

import json

import pytest
import torch

from tests.integration.parity import COMMON, Matrix, rows_of
from torchtitan.config.job_config import RL
from torchtitan.data.chat_template import ChatTemplate, chat_ids
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.rl.tasks import build_prompt_source

CONFIG = "train_configs/grpo_debug.toml"
STEPS, PROMPTS, GROUP, MAX_NEW = 4, 4, 4, 6
GRPO = [*COMMON, "--training.seq_len", "96", "--rl.prompts_per_step", str(PROMPTS), "--rl.group_size", str(GROUP),
        "--rl.max_new_tokens", str(MAX_NEW), "--rl.rewards", "text_shape", "--rl.reward_weights", "1.0",
        "--rl.reward_workers", "0", "--rl.kl_coeff", "0.05", "--experimental.custom_import", "tests.rl_doubles",
        "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "2", "--checkpoint.no_enable"]
REPLAY = ["--rl.sampler", "replay"]
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
LORA = ["--model.converters", "lora"]
NO_KL = ["--rl.kl_coeff", "0"]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]


def _layouts(folder) -> dict[str, tuple]:
    resume_from = folder / "grpo_sync" / "checkpoint" / "step-2"
    return {
        "replay_single": (1, [*REPLAY, "--training.local_batch_size", "8"]),
        "replay_fsdp2": (2, [*REPLAY, "--training.local_batch_size", "4"]),
        "replay_tp2": (2, [*REPLAY, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
        "replay_moe_single": (1, [*REPLAY, *MOE, "--training.local_batch_size", "8"]),
        "replay_moe_ep2": (2, [*REPLAY, *MOE, "--training.local_batch_size", "4",
                               "--parallelism.expert_parallel_degree", "2"]),
        "replay_lora_single": (1, [*REPLAY, *LORA, "--training.local_batch_size", "8"]),
        "replay_lora_fsdp2": (2, [*REPLAY, *LORA, "--training.local_batch_size", "4"]),
        # Pipeline and context parallelism train GRPO without a reference model.
        "replay_nokl_single": (1, [*REPLAY, *NO_KL, "--training.local_batch_size", "8"]),
        "replay_pp2": (2, [*REPLAY, *NO_KL, "--training.local_batch_size", "8",
                           "--parallelism.pipeline_parallel_degree", "2"]),
        "replay_cp2": (2, [*REPLAY, *NO_KL, "--training.local_batch_size", "8",
                           "--parallelism.context_parallel_degree", "2"]),
        # The engine's rollouts, checked token by token against the trainer; saved at step 2 and resumed below.
        "sync": (1, ["--training.local_batch_size", "8", *CHECKPOINTED], "tests.rl_doubles:train_checking_logprobs"),
        "sync_epochs2": (1, ["--training.local_batch_size", "8", "--rl.epochs_per_batch", "2"]),
        # An untrained model never answers with a bare integer: every group's format rewards are equal (0).
        "all_filtered": (1, ["--training.local_batch_size", "8", "--training.steps", "2", "--rl.rewards", "format"]),
        # The engine's rollouts from weights gathered across tensor-parallel shards and pipeline stages.
        "sync_tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
        "sync_pp2": (2, ["--training.local_batch_size", "8", *NO_KL, "--parallelism.pipeline_parallel_degree", "2"]),
        "sync_resumed": (1, ["--training.local_batch_size", "8", *CHECKPOINTED, "--checkpoint.initial_load_path",
                             str(resume_from), "--checkpoint.no_initial_load_model_only"]),
    }


def write_fixed_rollouts(path, seed: int = 0) -> None:
    """STEPS batches of random completions (some ended by EOS) of the arithmetic prompts the runs draw, with
    log-probabilities near a random-initialised model's (about -log(vocab)): ratios on both sides of the clip range."""
    tokenizer = get_train_spec("llama3").build_tokenizer_fn("assets/tokenizer")
    template = ChatTemplate(tokenizer.chat_template)
    prompts = build_prompt_source(RL(), seed)
    g = torch.Generator().manual_seed(1234)
    lines = []
    for call in range(STEPS):
        for index in range(call * PROMPTS, (call + 1) * PROMPTS):
            ids = chat_ids(tokenizer, template, [{"role": "user", "content": prompts[index]["prompt"]}],
                           add_generation_prompt=True)
            for _ in range(GROUP):
                n = int(torch.randint(1, MAX_NEW + 1, (1,), generator=g))
                tokens = torch.randint(3, tokenizer.vocab_size, (n,), generator=g).tolist()
                stopped = n < MAX_NEW
                if stopped:
                    tokens[-1] = tokenizer.eos_id
                logprobs = (-7.6 + 0.6 * (torch.rand(n, generator=g) - 0.5)).tolist()
                lines.append(json.dumps({"call": call, "prompt": ids, "tokens": tokens, "logprobs": logprobs,
                                         "finish_reason": "stop" if stopped else "length"}))
    path.write_text("\n".join(lines) + "\n")


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix; the replay sampler reads the fixed rollouts written here."""
    folder.mkdir(parents=True, exist_ok=True)
    write_fixed_rollouts(folder / "grpo_rollouts.jsonl")
    return {"grpo_": Matrix(_layouts(folder), CONFIG, GRPO)}


def assert_same_updates(rows, expected) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    for ours, ref in zip(rows, expected):
        for key in ("loss", "rl/kl", "rl/clip_fraction", "rl/mismatch_abs"):
            assert ours[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (ours["step"], key)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ours["step"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,reference", [("replay_fsdp2", "replay_single"), ("replay_tp2", "replay_single"),
                                              ("replay_moe_ep2", "replay_moe_single"),
                                              ("replay_lora_fsdp2", "replay_lora_single"),
                                              ("replay_pp2", "replay_nokl_single"),
                                              ("replay_cp2", "replay_nokl_single")])
def test_fixed_rollouts_train_alike_in_every_layout(debug_runs, layout, reference):
    expected = rows_of(debug_runs, f"grpo_{reference}")
    assert_same_updates(rows_of(debug_runs, f"grpo_{layout}"), expected)
    # The updates are not trivial: clipping is active, the policy moves (away from the reference), the loss changes.
    assert max(r["rl/clip_fraction"] for r in expected) > 0.05
    if "nokl" not in reference:
        assert expected[-1]["rl/kl"] > expected[0]["rl/kl"] >= 0
    assert len({round(r["loss"], 6) for r in expected}) == STEPS


@pytest.mark.slow
def test_the_lora_reference_is_the_base(debug_runs):
    # LoRA's B starts at zero: the policy equals its base (the reference) at step 1, so the KL is 0 there, and
    # only there.
    rows = rows_of(debug_runs, "grpo_replay_lora_single")
    assert rows[0]["rl/kl"] == 0.0
    assert rows[-1]["rl/kl"] > 0


@pytest.mark.slow
def test_the_sampler_and_the_trainer_agree_on_every_sampled_token(debug_runs, debug_folder):
    rows = rows_of(debug_runs, "grpo_sync")
    gaps = [json.loads(line) for line in (debug_folder / "grpo_sync" / "logprob_gaps.jsonl").read_text().splitlines()]
    assert len(gaps) == STEPS
    for step in gaps[:3]:
        assert step["tokens"] > 0
        assert step["max_gap"] < 1e-5, step
    assert rows[0]["rl/mismatch_abs"] < 1e-6
    # The step's reference is the policy itself at step 1 (a frozen copy of the starting weights).
    assert rows[0]["rl/kl"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sync_tp2", "sync_pp2"])
def test_the_sampler_gets_the_whole_policy_from_sharded_layouts(debug_runs, layout):
    # The first batch is sampled from the seeded initial weights, the same in every layout: gathered whole from
    # tensor-parallel shards or pipeline stages they sample the same completions (a wrong or missing tensor would
    # change them, or fail to load).
    ours, single = rows_of(debug_runs, f"grpo_{layout}")[0], rows_of(debug_runs, "grpo_sync")[0]
    for key in ("rl/reward_mean", "rl/reward_std", "rl/completion_length_mean", "rl/truncated_share"):
        assert ours[key] == single[key], key
    assert ours["rl/mismatch_abs"] < 1e-6
    # One reward function: its own mean and std are the total's.
    assert ours["rl/reward/text_shape"] == pytest.approx(ours["rl/reward_mean"])
    assert ours["rl/reward_std/text_shape"] == pytest.approx(ours["rl/reward_std"]) and ours["rl/reward_std"] > 0


@pytest.mark.slow
def test_each_batch_of_rollouts_trains_epochs_per_batch_steps(debug_runs):
    rows = rows_of(debug_runs, "grpo_sync_epochs2")
    same = ("rl/reward_mean", "rl/completion_length_mean")
    assert [rows[0][k] for k in same] == [rows[1][k] for k in same]
    assert [rows[2][k] for k in same] == [rows[3][k] for k in same]
    assert rows[2]["rl/reward_mean"] != rows[0]["rl/reward_mean"]
    # The second epoch scores the batch with the updated policy: the ratio to the sampler moves off 1.
    assert rows[1]["rl/mismatch_abs"] > 10 * rows[0]["rl/mismatch_abs"]


@pytest.mark.slow
def test_groups_with_equal_rewards_are_left_out(debug_runs):
    for row in rows_of(debug_runs, "grpo_all_filtered"):
        assert row["rl/filtered_groups"] == row["rl/groups"] == PROMPTS
        assert row["loss"] == 0 and row["grad_norm"] == 0


@pytest.mark.slow
def test_a_resumed_run_repeats_the_straight_run_bitwise(debug_runs):
    straight, resumed = rows_of(debug_runs, "grpo_sync"), rows_of(debug_runs, "grpo_sync_resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, theirs in zip(resumed, straight[2:]):
        for key in ("loss", "grad_norm", "rl/reward_mean", "rl/kl", "rl/completion_length_mean"):
            assert ours[key] == theirs[key], (ours["step"], key)
