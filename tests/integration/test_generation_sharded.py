"""The generation engine on a tensor-parallel llama3 and an expert-parallel qwen3_moe debug model (2 processes, one
launch; generation_shard_worker.py says what each check runs) gives the single process's tokens, and after
load_weights (or inference.load_checkpoint of a Hugging Face folder) those of a fresh model holding the new
weights."""

import json

import pytest

from tests.conftest import run_command, torchrun_command
from tests.integration.generation_shard_worker import CASES, NEW_TOKENS, PROMPT_LENGTHS

CHECKS = ("greedy", "sampled", "loaded_whole", "loaded_dtensor", "loaded_hf")
# Each case's TP degree: a rank caches the keys and values of its own heads only.
TP = {"llama3_tp2": 2, "qwen3_moe_ep2": 1}


@pytest.fixture(scope="module")
def shard_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation_sharded")
    result = run_command([*torchrun_command(2, "tests.integration.generation_shard_worker", ranks="0,1"), str(out)],
                         timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sharded_generation_equals_one_process(shard_results, case):
    rank0, rank1 = (results[case] for results in shard_results)
    for check in CHECKS:
        got = rank0[check]
        assert got["sharded"] == got["reference"], (case, check)
        assert rank1[check]["sharded"] == got["sharded"], (case, check, "the ranks disagree")
        assert got["logprob_diff"] < 1e-4, (case, check, got["logprob_diff"])
        assert len(got["sharded"]) == len(PROMPT_LENGTHS)
    assert rank0["cache_bytes"]["sharded"] * TP[case] == rank0["cache_bytes"]["plain"], rank0["cache_bytes"]
    # The greedy check's stop token ended some rows early and not others (finished rows leave the caches).
    assert {"stop", "length"} <= set(rank0["greedy"]["finish"]), rank0["greedy"]["finish"]
    assert max(len(t) for t in rank0["greedy"]["sharded"]) == NEW_TOKENS
    # Each load changed what the model generates.
    greedy_full = rank0["loaded_whole"]["sharded"]
    assert greedy_full != rank0["loaded_dtensor"]["sharded"] != rank0["loaded_hf"]["sharded"]
    assert [t[:5] for t in greedy_full] != [t[:5] for t in rank0["greedy"]["sharded"]]
