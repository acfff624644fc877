"""lm-evaluation-harness on our checkpoints: TitanLM against lm-eval's own ``hf`` model on our Hugging Face export
of the debug model, and scripts/evaluate.py --tasks on two ranks against one."""

import json

import pytest
from lm_eval.api.instance import Instance

from tests.conftest import run_command, torchrun_command
from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.config import load_config
from torchtitan.eval_tasks.pydocs_mc import questions
from torchtitan.components.evaluation.lm_eval_model import TitanLM, run_tasks, task_manager
from torchtitan.inference import build_model, load_model

pytestmark = pytest.mark.slow
CONFIG = "train_configs/debug_model.toml"


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    """The debug model as initialised from debug.seed, exported to a Hugging Face folder in float32."""
    cfg, _ = load_config(["--job.config_file", CONFIG])
    model, spec = build_model(cfg)
    folder = tmp_path_factory.mktemp("hf")
    write_hf_folder(folder, model.state_dict(), spec.state_dict_adapter(model.args),
                    spec.build_tokenizer_fn(cfg.model.hf_assets_path), cfg.model.hf_assets_path, "float32")
    return folder, cfg, spec.build_tokenizer_fn(cfg.model.hf_assets_path)


def test_our_lm_scores_as_lm_evals_hf_model_on_our_export(hf_export):
    """Must-show 1: the same log-likelihoods for 50 requests (<= 1e-4) and the same accuracy on pydocs_mc."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    folder, cfg, tokenizer = hf_export
    ours = TitanLM(load_model(CONFIG, str(folder)), tokenizer, max_length=cfg.training.seq_len)
    theirs = HFLM(pretrained=str(folder), device="cpu", batch_size=8, dtype="float32")
    requests = [Instance("loglikelihood", {}, (f"Docstring: {q['docstring']}\nFunction:", f" {choice}"), i)
                for i, (q, choice) in enumerate((q, c) for q in questions()[:13] for c in q["choices"])][:50]
    mine, reference = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert len(mine) == 50
    for (score, greedy), (expected, expected_greedy) in zip(mine, reference):
        assert score == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy
    kwargs = {"tasks": ["pydocs_mc"], "limit": 40, "task_manager": task_manager(["pydocs_mc"]), "log_samples": False,
              "bootstrap_iters": 0}
    accuracy = [lm_eval.simple_evaluate(model=lm, **kwargs)["results"]["pydocs_mc"] for lm in (ours, theirs)]
    assert accuracy[0]["acc,none"] == accuracy[1]["acc,none"]
    assert accuracy[0]["acc_norm,none"] == accuracy[1]["acc_norm,none"]
    assert run_tasks(ours.model, tokenizer, ["pydocs_mc"], cfg.training.seq_len, limit=40)["results"] == \
        lm_eval.simple_evaluate(model=ours, **kwargs)["results"]


def test_two_ranks_give_one_ranks_results(hf_export):
    folder = hf_export[0]
    args = ["scripts/evaluate.py", "--config", CONFIG, "--checkpoint", str(folder), "--tasks", "pydocs_mc",
            "--limit", "30", "--json"]
    import sys

    one = run_command([sys.executable, *args])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_command([*torchrun_command(2, "scripts.evaluate"), *args[1:]])
    assert two.returncode == 0, two.stderr[-3000:]
    # torchrun prefixes rank 0's lines with "[rank0]:".
    results = [json.loads([line for line in out.stdout.splitlines() if "{" in line][-1].split(":", 1)[-1]
                          if out is two else out.stdout.strip().splitlines()[-1]) for out in (one, two)]
    assert results[0]["pydocs_mc"]["sample_len"] == 30
    assert results[0] == results[1]
