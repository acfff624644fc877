"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, section 2.2) against references written here.

- mtp_targets: the tokens and labels k places ahead, against a plain loop over (row, depth, position).
- DeepseekV3Model's MTP forward: against the same computation spelled out from the model's own submodules.
- mtp_loss: the mean over depths of each depth's mean cross-entropy, values and gradients.
- the chunked loss head: each depth's summed loss equals the plain logits' cross-entropy.
- config validation refusals, and build_model with and without the MTP blocks.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.objectives.loss import build_cross_entropy_loss
from torchtitan.components.objectives.multi_token_prediction import count_mtp_targets, mtp_loss, mtp_targets
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.data.dataset import IGNORE_INDEX, Batch
from torchtitan.inference import build_model
from torchtitan.models.deepseek_v3 import DeepseekV3Model, deepseek_v3_flavors
from torchtitan.models.shared.chunked_cross_entropy import use_chunked_loss
from torchtitan.models.shared.decoder import TransformerBlock
from torchtitan.protocols import count_params

CONFIG = "train_configs/deepseek_v3_debug.toml"  # deepseek_v3 debug flavor with model.mtp_depth = 1
LLAMA_CONFIG = "train_configs/debug_model.toml"
VOCAB, SEQ = 256, 24


def random_seed() -> int:
    return torch.randint(0, 10_000, ()).item()


# ----- targets -----

def random_batch(rows: int, seq: int) -> Batch:
    tokens = torch.randint(0, VOCAB, (rows, seq))
    labels = torch.randint(0, VOCAB, (rows, seq))
    labels[torch.rand(rows, seq) < 0.2] = IGNORE_INDEX  # a loss mask: ignored labels stay ignored at every depth
    # Non-decreasing document ids: a few documents per row, starting at random places.
    documents = (torch.rand(rows, seq) < 0.2).long().cumsum(dim=1)
    positions = torch.arange(seq).expand(rows, seq).clone()
    return Batch(tokens, labels, documents, positions)


def reference_targets(batch: Batch, depth: int, block_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, seq = batch.input_ids.shape
    tokens = torch.zeros(rows, depth, seq, dtype=torch.long)
    labels = torch.full((rows, depth, seq), IGNORE_INDEX, dtype=torch.long)
    for b in range(rows):
        for k in range(1, depth + 1):
            for i in range(seq):
                if i + k >= seq:
                    continue
                tokens[b, k - 1, i] = batch.input_ids[b, i + k]
                same_document = batch.document_ids[b, i + k] == batch.document_ids[b, i]
                if not block_causal or same_document:
                    labels[b, k - 1, i] = batch.labels[b, i + k]
    return tokens, labels


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("block_causal", [False, True], ids=["causal", "block_causal"])
def test_mtp_targets_match_a_plain_loop(depth, block_causal):
    batch = random_batch(rows=3, seq=SEQ)
    assert batch.document_ids[:, -1].max() > 0  # several documents, so block_causal has something to cut
    ours = mtp_targets(batch, depth, block_causal)
    tokens, labels = reference_targets(batch, depth, block_causal)
    assert torch.equal(ours["mtp_tokens"], tokens)
    assert torch.equal(ours["mtp_labels"], labels)
    # The last k positions of each row have nothing to predict at depth k.
    for k in range(1, depth + 1):
        assert (ours["mtp_labels"][:, k - 1, -k:] == IGNORE_INDEX).all()


def test_mtp_targets_refuse_a_depth_that_leaves_nothing_to_predict():
    batch = random_batch(rows=2, seq=8)
    with pytest.raises(ValueError, match="leaves nothing to predict"):
        mtp_targets(batch, 8, block_causal=False)


# ----- the model -----

def mtp_model(depth: int = 2) -> DeepseekV3Model:
    args = dataclasses.replace(deepseek_v3_flavors["debug"], mtp_depth=depth).finalize(VOCAB, SEQ)
    with torch.device("meta"):
        model = DeepseekV3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(random_seed(), buffer_device=torch.device("cpu"))
    with torch.no_grad():  # routing that depends on the tokens, as a trained router's would
        for block in model.layers.values():
            if block.moe_enabled:
                block.moe.router.gate.weight.normal_(0, 1.0)
    return model


def reference_forward(model: DeepseekV3Model, tokens: torch.Tensor, mtp_tokens: torch.Tensor):
    """The main logits and each depth's, from the paper's equations and the model's own submodules."""
    n = model.args.n_layers
    h = model.tok_embeddings(tokens)
    for i in range(n):
        h = model.layers[str(i)](h, model.rope)
    main = model.output(model.norm(h))
    depths = []
    for k in range(1, model.args.mtp_depth + 1):
        block = model.layers[str(n + k - 1)]
        embedded = model.tok_embeddings(mtp_tokens[:, k - 1])
        x = block.eh_proj(torch.cat([block.enorm(embedded), block.hnorm(h)], dim=-1))
        h = TransformerBlock.forward(block, x, model.rope)  # depth k's hidden state feeds depth k + 1
        depths.append(model.output(block.norm(h)))
    return main, depths


def test_mtp_forward_matches_the_reference():
    model = mtp_model(depth=2)
    assert len(model.layers) == model.args.n_layers + 2
    batch = random_batch(rows=2, seq=SEQ)
    mtp = mtp_targets(batch, 2, block_causal=False)
    with torch.no_grad():
        main, *depths = model(batch.input_ids, **mtp)
        ref_main, ref_depths = reference_forward(model, batch.input_ids, mtp["mtp_tokens"])
        plain = model(batch.input_ids)  # without mtp_tokens: the main logits only
    assert len(depths) == 2
    torch.testing.assert_close(main, ref_main, rtol=1e-5, atol=1e-5)
    for ours, ref in zip(depths, ref_depths):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, ref_main, rtol=1e-5, atol=1e-5)
    # The depths predict different things: not a copy of the main head.
    assert (depths[0] - main).abs().max() > 1e-3 and (depths[1] - depths[0]).abs().max() > 1e-3


# ----- the loss -----

def test_mtp_loss_is_the_mean_over_depths_of_each_mean_cross_entropy():
    depth, rows = 3, 2
    labels = mtp_targets(random_batch(rows, SEQ), depth, block_causal=True)["mtp_labels"]
    logits = [torch.randn(rows, SEQ, VOCAB, requires_grad=True) for _ in range(depth)]
    ours = mtp_loss(build_cross_entropy_loss(), logits, labels, count_mtp_targets(labels))
    ours_grads = torch.autograd.grad(ours, logits)

    ref_logits = [t.detach().clone().requires_grad_() for t in logits]
    per_depth = [F.cross_entropy(out.flatten(0, 1), labels[:, k].flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="mean") for k, out in enumerate(ref_logits)]
    ref = sum(per_depth) / depth
    ref_grads = torch.autograd.grad(ref, ref_logits)

    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_chunked_loss_head_sums_each_depth_like_the_plain_logits():
    model = mtp_model(depth=2)
    batch = random_batch(rows=2, seq=SEQ)
    mtp = mtp_targets(batch, 2, block_causal=False)
    with torch.no_grad():
        main_logits, *depth_logits = model(batch.input_ids, **mtp)
        use_chunked_loss(model, chunk_size=7)  # a chunk size that does not divide the 48 tokens
        main_sum, *depth_sums = model(batch.input_ids, labels=batch.labels, **mtp)

    def summed_ce(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    torch.testing.assert_close(main_sum, summed_ce(main_logits, batch.labels), rtol=1e-5, atol=0)
    assert len(depth_sums) == 2
    for k, (ours, logits) in enumerate(zip(depth_sums, depth_logits)):
        torch.testing.assert_close(ours, summed_ce(logits, mtp["mtp_labels"][:, k]), rtol=1e-5, atol=0)


# ----- config -----

def check(overrides: list[str], world_size: int = 1, config: str = CONFIG) -> None:
    cfg, sources = load_config(["--job.config_file", config, *overrides])
    validate_config(cfg, sources, world_size=world_size)


def test_pipeline_parallelism_takes_mtp():
    check(["--parallelism.pipeline_parallel_degree", "2"], world_size=2)


def test_mtp_depth_on_a_model_without_mtp_blocks_is_refused():
    with pytest.raises(ConfigError, match=r"model\.mtp_depth = 1 needs a model with multi-token prediction"):
        check(["--model.mtp_depth", "1"], config=LLAMA_CONFIG)


def test_negative_mtp_depth_is_refused():
    with pytest.raises(ConfigError, match=r"model\.mtp_depth = -1 is invalid; it must be >= 0"):
        check(["--model.mtp_depth", "-1"])


def test_mtp_loss_weight_without_mtp_is_refused():
    with pytest.raises(ConfigError, match=r"training\.mtp_loss_weight = 0\.5 weighs a multi-token prediction loss"):
        check(["--training.mtp_loss_weight", "0.5"], config=LLAMA_CONFIG)


def test_exporting_mtp_blocks_a_model_does_not_have_is_refused():
    with pytest.raises(ConfigError, match=r"checkpoint\.hf_include_mtp = True exports multi-token prediction blocks"):
        check(["--checkpoint.hf_include_mtp", "--model.mtp_depth", "0"])
    check(["--checkpoint.hf_include_mtp"])  # the preset trains one block


def test_build_model_leaves_the_mtp_blocks_out_only_when_asked():
    cfg, _ = load_config(["--job.config_file", CONFIG, "--debug.seed", str(random_seed())])
    with_mtp, _ = build_model(cfg, mtp=True)
    without, _ = build_model(cfg, mtp=False)
    n = with_mtp.args.n_layers
    assert sorted(without.layers, key=int) == [str(i) for i in range(n)]
    assert sorted(with_mtp.layers, key=int) == [str(i) for i in range(n + 1)]
    assert (with_mtp.args.mtp_depth, without.args.mtp_depth) == (1, 0)
    # The same seed gives the main model the same weights either way.
    shared = without.state_dict()
    assert all(torch.equal(t, with_mtp.state_dict()[name]) for name, t in shared.items())
    # An MTP block adds a block's and an output head's work per token.
    flops_mtp = with_mtp.args.flops_per_token(count_params(with_mtp, exclude_embedding=True), SEQ)
    flops_plain = without.args.flops_per_token(count_params(without, exclude_embedding=True), SEQ)
    assert flops_mtp > flops_plain
