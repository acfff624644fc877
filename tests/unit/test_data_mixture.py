"""Weighted mixtures in stages: proportions, stage switches, resume under any layout, config."""

import pathlib

import numpy as np
import pytest
import torch

from torchtitan.config import ConfigError, load_config
from torchtitan.config.loading import config_to_toml
from torchtitan.config_check import validate_config
from torchtitan.data import DataError, build_dataloader, build_tokenizer
from torchtitan.data.config import Data, DataSource, DataStage
from torchtitan.data.mixture import pick_sources
from torchtitan.data.sources import register_dataset

WORDS = {"mix_a": "apple", "mix_b": "zebra", "mix_c": "quartz"}


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer("assets/tokenizer")
    rng = np.random.default_rng(0)
    for name, word in WORDS.items():
        documents = [" ".join([word] * int(rng.integers(1, 30))) for _ in range(200)]
        register_dataset(name, lambda split, documents=documents: documents)
    return tok


def source_of(tokenizer, rows):
    """Which source each row came from, by the tokens its word encodes to (disjoint between the words)."""
    ids = {name: set(tokenizer.encode(f"{word} {word}")) for name, word in WORDS.items()}
    assert not set.intersection(*ids.values())
    out = []
    for row in rows.tolist():
        found = [i for i, name in enumerate(WORDS) if set(row) & ids[name]]
        assert len(found) == 1, row
        out.append(found[0])
    return np.array(out)


def mixture(weights=(0.5, 0.3, 0.2), stages=(), on_exhausted="repeat"):
    return Data(sources=[DataSource(name=name, dataset=name, weight=w) for name, w in zip(WORDS, weights)],
                stages=[DataStage(start_step=s, weights=list(w)) for s, w in stages], on_exhausted=on_exhausted)


def loader(tokenizer, data, **overrides):
    kwargs = dict(dataset="", dataset_path=None, seq_len=8, local_batch_size=50, dp_rank=0, dp_world_size=1,
                  mixture=data, global_batch_size=50)
    return build_dataloader(tokenizer, **{**kwargs, **overrides})


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_the_interleave_keeps_every_prefix_within_one_sequence_of_its_share():
    weights = np.array([0.5, 0.3, 0.2])
    counts = np.zeros(3, dtype=np.int64)
    picked = pick_sources(weights, counts, 10_000)
    running = np.stack([np.cumsum(picked == s) for s in range(3)], axis=1)
    ideal = np.arange(1, 10_001)[:, None] * weights
    assert np.abs(running - ideal).max() < 1


def test_every_thousand_sequences_hold_each_source_within_one_point(tokenizer):
    batches = take(loader(tokenizer, mixture()), 200)  # 10,000 sequences
    sources = source_of(tokenizer, torch.cat([b.input_ids for b in batches]))
    assert len(sources) == 10_000
    for s, weight in enumerate((0.5, 0.3, 0.2)):
        window = np.convolve(sources == s, np.ones(1000), mode="valid") / 1000
        assert np.abs(window - weight).max() <= 0.01, (s, np.abs(window - weight).max())


def test_a_stage_switches_the_weights_from_its_step_exactly(tokenizer):
    data = mixture(stages=[(5, (0, 0, 1))])
    chat_loader = loader(tokenizer, data)
    batches = take(chat_loader, 8)  # one micro-batch of 50 sequences per step
    sources = [source_of(tokenizer, b.input_ids) for b in batches]
    assert all(len(set(s)) == 3 for s in sources[:4])
    assert all((s == 2).all() for s in sources[4:])
    metrics = chat_loader.metrics()
    assert metrics["tokens/mix_c"] > metrics["tokens/mix_a"] > metrics["tokens/mix_b"] > 0
    assert sum(metrics[f"tokens/{name}"] for name in WORDS) == 8 * 50 * 8
    assert {key for key in metrics if key.startswith("epoch/")} == {f"epoch/{name}" for name in WORDS}


@pytest.mark.parametrize("stop_after", [2, 4, 6])  # inside stage 1, at the boundary, inside stage 2
def test_resume_inside_a_stage_and_at_its_boundary_under_another_layout(tokenizer, stop_after):
    data = mixture(stages=[(5, (0.2, 0.2, 0.6))])
    whole = take(loader(tokenizer, data), 9)
    interrupted = loader(tokenizer, data)
    it = iter(interrupted)
    for _ in range(stop_after):
        next(it)
    for rank in range(2):
        resumed = loader(tokenizer, data, local_batch_size=25, dp_rank=rank, dp_world_size=2, num_workers=rank)
        resumed.load_state_dict(interrupted.state_dict())
        for mine, full in zip(take(resumed, 9 - stop_after), whole[stop_after:], strict=True):
            assert torch.equal(mine.input_ids, full.input_ids.view(25, 2, -1)[:, rank])


def test_a_checkpoint_of_other_sources_is_refused(tokenizer):
    saved = loader(tokenizer, mixture())
    take(saved, 2)
    two = Data(sources=mixture().sources[:2])
    with pytest.raises(DataError, match=r"for the sources \['mix_a', 'mix_b', 'mix_c'\], not the configured "
                                        r"\['mix_a', 'mix_b'\]"):
        loader(tokenizer, two).load_state_dict(saved.state_dict())


def test_an_exhausted_source_repeats_with_a_pass_counter_or_ends_the_run(tokenizer):
    repeating = loader(tokenizer, mixture())
    take(repeating, 40)
    assert repeating.metrics()["epoch/mix_a"] >= 1
    with pytest.raises(DataError, match="data source 'mix_a' ran out of data at global sequence .* "
                                        "data.on_exhausted = 'repeat'"):
        take(loader(tokenizer, mixture(on_exhausted="stop")), 40)


REPO = pathlib.Path(__file__).resolve().parents[2]


def validate(tmp_path, table, *flags):
    path = tmp_path / "mix.toml"
    path.write_text(f'extends = "{REPO / "train_configs/tiny.toml"}"\n' + table)
    cfg, sources = load_config(["--job.config_file", str(path), *flags])
    validate_config(cfg, sources, world_size=1)
    return cfg


SOURCES = """
[[data.sources]]
name = "docs"
dataset = "pydocs"
weight = 3
[[data.sources]]
name = "more"
dataset = "pydocs"
weight = 1
"""


def test_config_tables_parse_validate_and_round_trip(tmp_path):
    cfg = validate(tmp_path, SOURCES + "[[data.stages]]\nstart_step = 5\nweights = [0, 1]\n")
    assert [s.weight for s in cfg.data.sources] == [3.0, 1.0] and cfg.data.stages[0].weights == [0.0, 1.0]
    saved = tmp_path / "saved.toml"
    saved.write_text(config_to_toml(cfg))  # what a run writes as its resolved config.toml
    assert load_config(["--job.config_file", str(saved)])[0].data == cfg.data
    errors = {
        SOURCES.replace("weight = 1", "weight = 0"): r"data.sources\[1\] = .* weight 0.0 must be > 0",
        SOURCES.replace('dataset = "pydocs"\nweight = 3', 'kind = "bogus"'):
            r"entry 0: kind = 'bogus' is invalid; expected one of text\|tokens",
        SOURCES + "[[data.stages]]\nstart_step = 5\nweights = [1]\n": r"data.stages\[0\] = .* must be 2 numbers",
        SOURCES + "[[data.stages]]\nstart_step = 0\nweights = [1, 1]\n": r"start_step 0 must be >= 1",
        SOURCES + "[[data.stages]]\nstart_step = 2\nweights = [nan, 1]\n": r"data.stages\[0\] = .* >= 0",
        SOURCES.replace('dataset = "pydocs"\nweight = 1', 'dataset = "nope"\nweight = 1'):
            r"data.sources\[1\] = .* dataset: is not a registered dataset",
    }
    for table, message in errors.items():
        with pytest.raises(ConfigError, match=message):
            validate(tmp_path, table)
    with pytest.raises(ConfigError, match="data.sources = .* replace training.dataset"):
        validate(tmp_path, SOURCES, "--training.dataset_path", "assets/tokenizer")
    with pytest.raises(ConfigError, match=r"entry 1: unknown key 'wieght'; valid: name, kind, path"):
        validate(tmp_path, SOURCES.replace("weight = 1", "wieght = 1"))
    with pytest.raises(ConfigError, match="training.shuffle_documents = True shuffles only pre-tokenized shards"):
        validate(tmp_path, SOURCES, "--training.shuffle_documents")
    with pytest.raises(ConfigError, match="tables are set in the TOML file"):
        validate(tmp_path, "", "--data.sources", "x")
