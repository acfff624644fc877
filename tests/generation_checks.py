"""The check the generation tests share: the engine's greedy tokens are the no-cache path's, and the logits it chose
each token from are the full forward's.

The no-cache path (generation/reference.py) runs the whole sequence through the model for every new token and takes
the argmax of the last position. Run once over each row's prompt followed by the engine's tokens (teacher forcing),
the full forward gives, at every step, the logits that path would have had had it chosen the same tokens so far: so
"each engine token is that argmax" is "the engine made the reference's tokens". At a near-tie (the top two logits
within 1e-5, where rounding may pick either) both tokens are accepted and the check goes on with the engine's.
"""

import torch

NEAR_TIE = 1e-5
LOGIT_TOLERANCE = 1e-5


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def assert_engine_matches_full_forward(model, prompts: list[list[int]], new_tokens: int,
                                       prefill_chunk: int = 256) -> dict:
    """Greedy generation of ``new_tokens`` per prompt: the no-cache path's tokens, per-step logits within 1e-5.
    Returns figures (largest logit difference, near-ties met) for the caller to print."""
    from torchtitan.generation import GenerationEngine, SamplingConfig

    engine = GenerationEngine(model, prefill_chunk=prefill_chunk)
    done = engine.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, temperature=0), keep_logits=True)
    worst, near_ties = 0.0, 0
    for row, (prompt, completion) in enumerate(zip(prompts, done)):
        assert len(completion.tokens) == new_tokens and completion.finish_reason == "length", row
        sequence = torch.tensor([prompt + completion.tokens], device=next(model.parameters()).device)
        full = model(sequence)[0, len(prompt) - 1: len(prompt) - 1 + new_tokens].float().cpu()
        ours = torch.stack(completion.logits)
        difference = (full - ours).abs().max().item()
        assert difference <= LOGIT_TOLERANCE, f"row {row}: logits differ by {difference}"
        worst = max(worst, difference)
        top2 = full.topk(2, dim=-1)
        for step, token in enumerate(completion.tokens):
            reference = int(top2.indices[step, 0])
            gap = float(top2.values[step, 0] - top2.values[step, 1])
            if token != reference:
                assert gap <= NEAR_TIE and token == int(top2.indices[step, 1]), (
                    f"row {row} step {step}: engine chose {token}, the no-cache path {reference} (gap {gap})")
                near_ties += 1
    return {"max_logit_difference": worst, "near_ties": near_ties}


# Four prompts of different lengths; the longest crosses three of the Gated DeltaNet kernel's 64-token chunks, and
# 64 new tokens run gpt-oss's 16-token windows round their ring four times.
PROMPT_LENGTHS = [5, 37, 130, 200]
# The trained checkpoints of the suite matrix are saved at their last step (model only) by these flags.
SAVE_LAST_STEP = ["--checkpoint.enable", "--checkpoint.interval", "1000"]


def assert_trained_checkpoint_generates_as_the_no_cache_path(config: str, step_folder) -> None:
    """The check on a checkpoint trained by the suite matrix: greedy, 4 prompts, 64 new tokens (fp32)."""
    from torchtitan.inference import load_model

    assert step_folder.is_dir(), f"{step_folder} was not saved"
    model = load_model(config, str(step_folder), overrides=["--training.seq_len", "512"])
    figures = assert_engine_matches_full_forward(model, random_prompts(model.args.vocab_size, PROMPT_LENGTHS), 64)
    print(f"\n{config} at {step_folder.name}: {figures}")
