"""RL rewards: the built-in functions, the worker pool (same scores as in-process; raising, hanging, dying and
non-numeric calls score 0 and are counted; the pool keeps working), weights, and config_problems."""

import math
import random
import sys
import time
import types

import pytest

import tests.rl_user_rewards  # noqa: F401  (registers the test_* rewards)
from torchtitan.config.job_config import RL
from torchtitan.rl.rewards import REWARDS, RewardPool, config_problems, exact_answer, format_reward, register_reward

TIMEOUT = 0.5


def sample(answer="42", prompt="What is 40 + 2?"):
    return {"prompt": prompt, "answer": answer}


@pytest.fixture(scope="module")
def pool():
    """One worker, shared by the tests that leave it working."""
    with RewardPool(["exact_answer", "format", "test_length"], [1.0, 0.25, -0.5], workers=1,
                    timeout_seconds=TIMEOUT) as pool:
        yield pool


# --- the built-in functions ---


@pytest.mark.parametrize(("completion", "answer", "expected"), [
    ("42", "42", 1.0), (" 42\n", "42", 1.0), ("042", 42, 1.0), ("-0", "0", 1.0), ("-7", " -7 ", 1.0),
    ("41", "42", 0.0), ("42.", "42", 0.0), ("The answer is 42", "42", 0.0), ("+42", "42", 0.0), ("4 2", "42", 0.0),
    ("\u0664\u0662", "42", 0.0), ("", "42", 0.0), ("42 42", "42", 0.0), ("-42", "42", 0.0),
    ("1" * 5000, "1" * 5000, 1.0),
])
def test_exact_answer_reads_a_bare_integer(completion, answer, expected):
    assert exact_answer(completion, sample(answer)) == expected


def test_exact_answer_refuses_an_answer_that_is_no_integer():
    for answer in ("4.5", "forty"):
        with pytest.raises(ValueError, match=f"the sample's answer '{answer}' is not an integer"):
            exact_answer("4", sample(answer))


@pytest.mark.parametrize(("completion", "expected"), [
    ("42", 1.0), (" -3 \n", 1.0), ("0", 1.0), ("42.", 0.0), ("forty", 0.0), ("", 0.0), ("1 2", 0.0), ("+1", 0.0),
])
def test_format_rewards_a_bare_integer_right_or_wrong(completion, expected):
    assert format_reward(completion, sample("7")) == expected


# --- the pool ---


def random_completions(seed: int, n: int) -> tuple[list[str], list[dict]]:
    rng = random.Random(seed)
    completions, samples = [], []
    for _ in range(n):
        answer = rng.randint(-99, 99)
        form = rng.choice([str(answer), str(answer + rng.randint(1, 5)), f" {answer}\n", f"{answer}.", "words",
                           f"it is {answer}", ""])
        completions.append(form)
        samples.append(sample(str(answer), prompt="x" * rng.randint(1, 30)))
    return completions, samples


def test_the_pool_scores_as_in_process(pool):
    here = RewardPool(pool.names, pool.weights, workers=0)
    for seed in (0, 1):
        completions, samples = random_completions(seed, 40)
        scores = pool.score(completions, samples)
        assert scores == here.score(completions, samples)
        assert scores.failures == {name: 0 for name in pool.names} and scores.first_errors == {}
        # The total is the weighted sum of the functions' rewards.
        assert scores.total == [1.0 * e + 0.25 * f - 0.5 * n for e, f, n in
                                zip(*(scores.per_function[name] for name in pool.names))]
        assert 0 < sum(scores.per_function["exact_answer"]) < sum(scores.per_function["format"]) < 40


def test_weights_default_to_one_each():
    completions, samples = random_completions(2, 20)
    scores = RewardPool(["exact_answer", "format"]).score(completions, samples)
    assert scores.total == [e + f for e, f in zip(scores.per_function["exact_answer"], scores.per_function["format"])]
    with pytest.raises(ValueError, match="3 completions for 2 samples"):
        RewardPool(["format"]).score(["1", "2", "3"], samples[:2])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failing_call_scores_zero_and_is_counted(workers):
    names = ["test_raising", "test_not_a_number", "format"]
    with RewardPool(names, workers=workers, timeout_seconds=TIMEOUT) as rewards:
        scores = rewards.score(["ok", "text", "nan", "ok"], [sample()] * 4)
        nan = rewards.score(["nan"], [sample()])
    assert scores.per_function == {"test_raising": [1.0, 0.0, 0.0, 1.0], "test_not_a_number": [1.0, 0.0, 0.0, 1.0],
                                   "format": [0.0] * 4}
    assert scores.failures == {"test_raising": 2, "test_not_a_number": 2, "format": 0}
    assert scores.first_errors == {"test_raising": "KeyError: 'answer'",
                                   "test_not_a_number": "returned str 'forty-two', not a number"}
    assert scores.total == [2.0, 0.0, 0.0, 2.0]
    assert nan.first_errors["test_not_a_number"] == "returned nan, not a finite number" and nan.total == [0.0]


def test_a_call_past_its_timeout_scores_zero_its_worker_is_replaced_and_the_pool_goes_on():
    with RewardPool(["test_sleepy", "format"], workers=1, timeout_seconds=TIMEOUT) as rewards:
        hung = rewards._workers[0].process
        start = time.monotonic()
        scores = rewards.score(["1", "hang", "2"], [sample()] * 3)
        took = time.monotonic() - start
        assert took < 10 * TIMEOUT, took
        assert scores.per_function == {"test_sleepy": [0.5, 0.0, 0.5], "format": [1.0, 0.0, 1.0]}
        assert scores.failures == {"test_sleepy": 1, "format": 0}
        assert scores.first_errors == {"test_sleepy": f"timed out after {TIMEOUT:g} s"}
        assert hung.returncode is not None  # killed and reaped: no process is left behind
        # The next call runs on the replacement, at full speed.
        start = time.monotonic()
        scores = rewards.score(["3", "4"], [sample()] * 2)
        assert time.monotonic() - start < 10 * TIMEOUT
        assert scores.total == [1.5, 1.5] and scores.failures == {"test_sleepy": 0, "format": 0}
        # Two hung calls among others: each costs its own timeout, no more.
        start = time.monotonic()
        scores = rewards.score(["hang", "5", "hang"], [sample()] * 3)
        assert time.monotonic() - start < 20 * TIMEOUT
        assert scores.per_function["test_sleepy"] == [0.0, 0.5, 0.0] and scores.failures["test_sleepy"] == 2
        workers = [w.process for w in rewards._workers]
    assert all(process.returncode is not None for process in workers)  # closed and reaped


class Interrupted(BaseException):
    """Stands for Ctrl-C arriving in the middle of a score() call."""


class Unpicklable:
    def __init__(self, error: type[BaseException]):
        self.error = error

    def __reduce__(self):
        raise self.error("no pickling")


def test_a_sample_that_cannot_be_sent_and_an_interrupted_call_leave_the_pool_working():
    with RewardPool(["test_sleepy"], workers=2, timeout_seconds=TIMEOUT) as rewards:
        scores = rewards.score(["1", "2"], [sample(), {"prompt": "p", "extra": Unpicklable(TypeError)}])
        assert scores.per_function == {"test_sleepy": [0.5, 0.0]}
        assert scores.first_errors == {"test_sleepy": "cannot send the sample to a worker: TypeError: no pickling"}
        # Interrupted while a call hangs on one worker: the next call does not wait for it, nor take its answer.
        with pytest.raises(Interrupted):
            rewards.score(["hang", "2"], [sample(), {"prompt": "p", "extra": Unpicklable(Interrupted)}])
        start = time.monotonic()
        scores = rewards.score(["1", "2", "3"], [sample()] * 3)
        assert time.monotonic() - start < 10 * TIMEOUT
        assert scores.per_function == {"test_sleepy": [0.5] * 3} and scores.failures == {"test_sleepy": 0}


def test_a_worker_that_dies_scores_zero_and_is_replaced():
    with RewardPool(["test_exits", "format"], workers=2, timeout_seconds=5.0) as rewards:
        for completions in (["1", "die", "2", "die", "3"], ["4", "5"]):
            scores = rewards.score(completions, [sample()] * len(completions))
            dead = [c == "die" for c in completions]
            assert scores.per_function["test_exits"] == [0.0 if d else 1.0 for d in dead]
            assert scores.failures["test_exits"] == sum(dead)
        assert "the worker died during the call (exit code 3)" in rewards.score(["die"], [sample()]).first_errors[
            "test_exits"]


def test_a_function_the_workers_cannot_import_stops_the_pool_at_its_start():
    ghost = types.ModuleType("ghost_rewards_module")  # importable here only: it is no file

    def vanishing(completion, sample):
        return 1.0

    vanishing.__module__, vanishing.__qualname__ = ghost.__name__, "vanishing"
    ghost.vanishing = vanishing
    sys.modules[ghost.__name__] = ghost
    register_reward("test_vanishing", vanishing)
    try:
        with pytest.raises(RuntimeError, match="a reward worker cannot load the reward functions test_vanishing: "
                                               "ModuleNotFoundError: No module named 'ghost_rewards_module'"):
            RewardPool(["test_vanishing"], workers=1, timeout_seconds=TIMEOUT)
    finally:
        del sys.modules[ghost.__name__]
        REWARDS._entries.pop("test_vanishing")


def test_a_lambda_or_local_function_is_refused_for_workers_naming_the_reward():
    def local(completion, sample):
        return 1.0

    for name, fn in (("test_lambda", lambda completion, sample: 1.0), ("test_local", local)):
        register_reward(name, fn)
        try:
            with pytest.raises(ValueError, match=f"rl.rewards = \\['format', '{name}'\\] names '{name}', which cannot "
                                                 "be sent to the reward worker processes .* or set rl.reward_workers = "
                                                 "0") as info:
                RewardPool(["format", name], workers=1)
            assert "\n" not in str(info.value)
            assert RewardPool([name], workers=0).score(["x"], [sample()]).total == [1.0]
            assert config_problems(RL(rewards=[name], reward_workers=0)) == []
            [(field, _)] = config_problems(RL(rewards=[name], reward_workers=2))
            assert field == "rewards"
        finally:
            REWARDS._entries.pop(name)


# --- configuration ---


def test_config_problems_name_the_field():
    assert config_problems(RL()) == []
    assert config_problems(RL(rewards=["exact_answer", "format", "test_length"], reward_weights=[1, 0.1, -2])) == []
    cases = {
        "rewards": [RL(rewards=["exact"]), RL(rewards=[]), RL(rewards=["format", "format"])],
        "reward_weights": [RL(reward_weights=[1.0, 2.0]), RL(rewards=["format", "exact_answer"], reward_weights=[1.0]),
                           RL(reward_weights=[math.nan]), RL(reward_weights=[math.inf])],
        "reward_workers": [RL(reward_workers=-1), RL(reward_workers=-3)],
        "reward_timeout_seconds": [RL(reward_timeout_seconds=0), RL(reward_timeout_seconds=-1.0),
                                   RL(reward_timeout_seconds=math.nan), RL(reward_timeout_seconds=math.inf)],
    }
    for field, configs in cases.items():
        for rl in configs:
            assert [f for f, _ in config_problems(rl)] == [field], (field, rl)
    [(_, reason)] = config_problems(RL(rewards=["exact"]))
    assert reason.startswith("names 'exact', which is no registered reward function; registered: exact_answer, "
                             "format, ")
    assert "register_reward" in reason
    [(_, reason)] = config_problems(RL(rewards=["format", "format"]))
    assert reason == "names 'format' twice; name each once (rl.reward_weights weighs them)"
    [(_, reason)] = config_problems(RL(reward_weights=[1.0, 2.0]))
    assert reason.startswith("has 2 weights for 1 rewards (rl.rewards)")
    with pytest.raises(ValueError, match=r"rl.reward_workers = -1 is invalid; it must be >= 0"):
        RewardPool(["format"], workers=-1)
