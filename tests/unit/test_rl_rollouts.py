"""Rollouts packed into rows (rl/rollouts.py's pack), GRPO's objective on packed rows against the loss of each
completion alone (components/objectives/grpo.py), and the [rl] section's checks."""

import pytest
import torch

from torchtitan.components.objectives.grpo import GRPO, aggregate, token_losses
from torchtitan.config import ConfigError
from torchtitan.config_check import load_and_validate
from torchtitan.config.job_config import RL
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.generation.engine import Completion
from torchtitan.rl.rollouts import pack


def _sequences(seed: int, count: int, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(1, 6, (1,), generator=g))
        completion = Completion(tokens=torch.randint(0, vocab, (n,), generator=g).tolist(),
                                logprobs=(-torch.rand(n, generator=g) * 4).tolist())
        out.append((prompt, completion, float(torch.randn((), generator=g))))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_each_sequence_is_packed_whole_with_labels_on_its_completion(seed):
    sequences = _sequences(seed, 7)
    batch = pack(sequences, rows=4, seq_len=16, pad_id=0)
    assert batch is not None
    found = []
    for row in range(4):
        docs = batch.document_ids[row]
        assert (docs[1:] >= docs[:-1]).all()  # documents in order along the row
        for doc in docs.unique().tolist():
            where = (docs == doc).nonzero().flatten()
            positions = batch.positions[row, where]
            assert positions.tolist() == list(range(len(where)))
            labels = batch.labels[row, where]
            if (labels == IGNORE_INDEX).all():
                continue  # the row's padding
            inputs = batch.input_ids[row, where].tolist()
            kept = labels != IGNORE_INDEX
            completion = labels[kept].tolist()
            first = int(kept.nonzero()[0])
            # inputs are prompt + completion but its last token; labels are the completion, from the prompt's end
            prompt = inputs[:first + 1]
            assert inputs == prompt + completion[:-1]
            assert kept[first:].all() and not kept[:first].any()
            found.append((prompt, completion, batch.sampler_logprobs[row, where][kept].tolist(),
                          batch.advantages[row, where][kept].unique().tolist(),
                          batch.inverse_lengths[row, where][kept].unique().tolist()))
    assert len(found) == len(sequences)
    for prompt, completion, advantage in sequences:
        match = [f for f in found if f[0] == prompt and f[1] == completion.tokens]
        assert match, (prompt, completion.tokens)
        _, _, logprobs, advantages, inverse = match[0]
        assert logprobs == pytest.approx(completion.logprobs, abs=1e-6)
        assert advantages == pytest.approx([advantage], abs=1e-6)
        assert inverse == pytest.approx([1 / len(completion.tokens)])


def test_rollouts_that_do_not_fit_are_reported():
    sequences = _sequences(0, 7)
    need = sum(len(p) + len(c.tokens) - 1 for p, c, _ in sequences)
    assert pack(sequences, rows=1, seq_len=need - 1, pad_id=0) is None
    assert pack(sequences, rows=2, seq_len=4, pad_id=0) is None  # a sequence longer than a row


@pytest.mark.parametrize("how", ["sequence_mean", "token_mean", "token_sum"])
@pytest.mark.parametrize("kl_coeff", [0.0, 0.1])
def test_the_objective_on_packed_rows_is_the_loss_of_each_completion_alone(how, kl_coeff):
    """The objective's loss and gradient on rows packing several completions equal the loss written per completion
    (one completion per row: grpo.aggregate's own convention) with the same log-probabilities."""
    rl = RL(loss_aggregation=how, kl_coeff=kl_coeff, max_new_tokens=5, clip_low=0.2, clip_high=0.28)
    sequences = _sequences(3, 6, vocab=11)
    batch = pack(sequences, rows=3, seq_len=20, pad_id=0)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 20, 11, generator=g, dtype=torch.float64).requires_grad_()
    ref = batch.ref_logprobs + torch.randn(3, 20, generator=g) * 0.1
    batch = batch._replace(ref_logprobs=ref)
    objective = GRPO(rl)
    _, targets = objective.prepare(batch)
    counts = objective.count(targets)
    assert counts.tolist() == [sum(len(c.tokens) for _, c, _ in sequences), len(sequences)]
    loss, parts = objective.loss(logits, targets, counts)
    loss.backward()

    # Per completion: its tokens' log-probabilities gathered from the same logits, one row each.
    mask = batch.labels != IGNORE_INDEX
    logits2 = logits.detach().clone().requires_grad_()
    all_logprobs = logits2.float().log_softmax(-1)
    rows = []
    for row in range(3):
        for doc in batch.document_ids[row].unique().tolist():
            where = ((batch.document_ids[row] == doc) & mask[row]).nonzero().flatten()
            if len(where):
                rows.append((row, where))
    width = max(len(w) for _, w in rows)
    lp, old, adv, rf, m = (torch.zeros(len(rows), width) for _ in range(5))
    lp = [torch.zeros(width) for _ in rows]
    for i, (row, where) in enumerate(rows):
        n = len(where)
        lp[i] = torch.cat([all_logprobs[row, where, batch.labels[row, where]], torch.zeros(width - n)])
        old[i, :n] = batch.sampler_logprobs[row, where]
        adv[i, :n] = batch.advantages[row, where]
        rf[i, :n] = ref[row, where]
        m[i, :n] = 1
    lp = torch.stack(lp)
    per_token = token_losses(lp, old, adv, m.bool(), 0.2, 0.28, kl_coeff, rf if kl_coeff else None)
    expected = aggregate(per_token.losses, m.bool(), how, len(rows), int(m.sum()), 5)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert parts[0].item() == pytest.approx(loss.item())
    assert torch.allclose(logits.grad.float(), logits2.grad.float(), atol=1e-6)
    assert parts[1].item() == pytest.approx(per_token.clipped.sum().item() / m.sum().item())


def _assert_refused(argv, message):
    with pytest.raises(ConfigError) as refused:
        load_and_validate(argv)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def _grpo(tmp_path, *flags):
    return ["--job.config_file", "train_configs/grpo_debug.toml", "--job.dump_folder", str(tmp_path), *flags]


@pytest.mark.parametrize("flags,message", [
    (["--rl.group_size", "1"], "rl.group_size = 1 is invalid; it must be >= 2"),
    (["--rl.temperature", "0"], "rl.temperature = 0.0 is invalid; rollouts are sampled"),
    (["--rl.max_new_tokens", "256"], "rl.max_new_tokens = 256 is invalid; it must be in [1, training.seq_len = 256)"),
    (["--rl.sampler", "vllm"], "rl.sampler = 'vllm' names no registered sampler; registered: "),
    (["--model.attention_mask", "causal"], "model.attention_mask = 'causal' must be 'block_causal' or 'auto'"),
    (["--checkpoint.interval", "3", "--rl.epochs_per_batch", "2"], "must be a multiple of rl.epochs_per_batch = 2"),
    (["--rl.rewards", "no_such_reward"], "rl.rewards"),
])
def test_the_rl_section_is_checked(tmp_path, flags, message):
    _assert_refused(_grpo(tmp_path, *flags), message)


@pytest.mark.parametrize("flags", [["--rl.group_size", "4"], ["--rl.kl_coeff", "0.1"]])
def test_rl_settings_without_grpo_are_refused(tmp_path, flags):
    argv = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path), *flags]
    _assert_refused(argv, "is read by training.objective = 'grpo' alone")


@pytest.mark.parametrize("field", ["pipeline_parallel_degree", "context_parallel_degree"])
def test_the_reference_is_refused_where_it_cannot_score_yet(field):
    from torchtitan.config import JobConfig
    from torchtitan.rl.config_problems import config_problems

    cfg = JobConfig()
    cfg.training.objective = "grpo"
    setattr(cfg.parallelism, field, 2)
    assert f"parallelism.{field}" not in dict(config_problems(cfg, set()))
    cfg.rl.kl_coeff = 0.1
    assert "is not supported with rl.kl_coeff > 0 yet" in dict(config_problems(cfg, set()))[f"parallelism.{field}"]
