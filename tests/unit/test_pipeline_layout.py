"""Pipeline stage split, placement and the config errors for layouts that cannot run."""

from pathlib import Path

import pytest

from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.distributed.pipeline_parallel import SCHEDULES, csv_stage_ranks, split_layers, stage_placement


def config(*flags):
    cfg, sources = load_config(["--job.config_file", "train_configs/debug_model.toml",
                                "--parallelism.pipeline_parallel_degree", "2", *flags])
    return cfg, sources


def test_even_split_counts_the_embedding_and_output_as_layers():
    assert split_layers(6, 2, 1, 1) == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                                        ["layers.3", "layers.4", "layers.5", "norm", "output"]]
    def blocks_per_stage(n_layers, num_stages):
        return [len([n for n in s if n.startswith("layers.")]) for s in split_layers(n_layers, num_stages, 1, 1)]

    assert blocks_per_stage(6, 4) == [1, 2, 2, 1]
    assert blocks_per_stage(6, 3) == [2, 3, 1]  # the remainder: one more layer per stage, middle ones first
    assert blocks_per_stage(13, 5) == [2, 3, 3, 3, 2]
    # Every block appears exactly once, in order.
    blocks = [n for s in split_layers(13, 5, 1, 1) for n in s if n.startswith("layers.")]
    assert blocks == [f"layers.{i}" for i in range(13)]
    with pytest.raises(ValueError, match="8 pipeline stages need more than the model's 6 transformer blocks"):
        split_layers(6, 8, 1, 1)


def test_placement_single_looped_and_v():
    cfg, _ = config()
    assert stage_placement(cfg.parallelism, 6) == {0: [0], 1: [1]}
    cfg, _ = config("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    assert stage_placement(cfg.parallelism, 6) == {0: [0, 2], 1: [1, 3]}
    for v in ("ZBVZeroBubble", "DualPipeV"):
        cfg, _ = config("--parallelism.pipeline_parallel_schedule", v)
        assert stage_placement(cfg.parallelism, 6) == {0: [0, 3], 1: [1, 2]}
    cfg, _ = config("--parallelism.pipeline_parallel_schedule", "LoopedBFS",
                    "--parallelism.pipeline_parallel_layers_per_stage", "2")
    assert stage_placement(cfg.parallelism, 6) == {0: [0, 2], 1: [1, 3]}


def test_csv_placement(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n")
    assert csv_stage_ranks(path) == {0: [0, 2], 1: [1, 3]}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_validates_for_the_debug_model(schedule):
    validate_config(*config("--parallelism.pipeline_parallel_schedule", schedule), world_size=2)


@pytest.mark.parametrize("flags, message", [
    (["--parallelism.pipeline_parallel_schedule", "Bogus"], "pipeline_parallel_schedule = 'Bogus' is unknown; valid: GPipe"),
    (["--training.local_batch_size", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     "gives 2 micro-batches (training.local_batch_size 2 / 1), fewer than the 4 stages"),
    (["--parallelism.pipeline_parallel_microbatch_size", "3"], "must be >= 1 and divide training.local_batch_size = 8"),
    (["--parallelism.pipeline_parallel_schedule", "LoopedBFS", "--parallelism.pipeline_parallel_layers_per_stage",
      "1", "--training.local_batch_size", "4"], "fewer than the 8 stages"),
    (["--parallelism.pipeline_parallel_schedule", "GPipe", "--parallelism.pipeline_parallel_layers_per_stage", "2"],
     "needs exactly 2 stages (one per rank), but the layer settings give 4"),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.pipeline_parallel_layers_per_stage",
      "1", "--training.local_batch_size", "16"], "needs exactly 4 stages (two per rank), but the layer settings give 8"),
    (["--parallelism.pipeline_parallel_first_stage_less_layers", "8"], "cannot be laid out: 2 pipeline stages need more"),
    (["--validation.enable", "--validation.local_batch_size", "8", "--validation.seq_len", "512"],
     "validation.seq_len = 512 must equal training.seq_len = 2048 with pipeline parallelism"),
])
def test_layouts_that_cannot_run_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate_config(*config(*flags), world_size=2)
    assert "\n" not in str(error.value)


def test_unknown_stage_module_names_and_csv_rows(tmp_path):
    toml = tmp_path / "pp.toml"
    toml.write_text(f'extends = "{Path("train_configs/debug_model.toml").resolve()}"\n'
                    '[parallelism]\npipeline_parallel_degree = 2\n'
                    'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.9", "norm", "output"]]\n')
    cfg, sources = load_config(["--job.config_file", str(toml)])
    with pytest.raises(ConfigError, match=r"names \['layers.9'\], which are not modules of the model"):
        validate_config(cfg, sources, world_size=2)
    csv = tmp_path / "three.csv"
    csv.write_text("0F0\n1F0\n2F0\n")
    with pytest.raises(ConfigError, match="has 3 rows but there are 2 pipeline ranks"):
        validate_config(*config("--parallelism.pipeline_parallel_schedule_csv", str(csv)), world_size=2)


def test_mtp_blocks_and_an_embedding_copy_go_to_the_last_stage():
    import dataclasses

    import torch

    from torchtitan.distributed.pipeline_parallel import keep_only, model_stage_names
    from torchtitan.models.deepseek_v3 import DeepseekV3Model, deepseek_v3_flavors

    cfg, _ = config()
    args = dataclasses.replace(deepseek_v3_flavors["debug"], mtp_depth=2).finalize(256, 32)
    with torch.device("meta"):
        model = DeepseekV3Model(args)
    names, shared = model_stage_names(model, cfg.parallelism, 2)
    assert shared
    assert names == [["tok_embeddings", "layers.0", "layers.1"],
                     ["layers.2", "layers.3", "norm", "output", "layers.4", "layers.5", "tok_embeddings"]]
    last = keep_only(model, names[1], first=False)
    assert list(last.layers) == ["2", "3", "4", "5"] and last.tok_embeddings is not None and not last.embeds_input
    assert keep_only(model, names[0], first=True).embeds_input
    # Without MTP (and untied) nothing is shared; one stage holds everything.
    with torch.device("meta"):
        plain = DeepseekV3Model(dataclasses.replace(args, mtp_depth=0))
    assert model_stage_names(plain, cfg.parallelism, 2) == (
        [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]], False)


def test_tied_embeddings_can_be_pipelined():
    # The last stage keeps its own copy of the embedding for the tied output head (SharedEmbedding).
    cfg, sources = load_config(["--job.config_file", "train_configs/qwen3_debug.toml", "--model.flavor", "0.6B",
                                "--parallelism.pipeline_parallel_degree", "2"])
    validate_config(cfg, sources, world_size=2)
    # Not yet where one rank holds both stages (V schedules): its two copies would share one checkpoint name.
    cfg, sources = load_config(["--job.config_file", "train_configs/qwen3_debug.toml", "--model.flavor", "0.6B",
                                "--parallelism.pipeline_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    with pytest.raises(ConfigError, match="puts the first and last stages on one rank.*an untied flavor"):
        validate_config(cfg, sources, world_size=2)


@pytest.mark.parametrize("stages, message", [
    ("tok_embeddings,layers.0;layers.5,norm,output", r"exactly once; missing \['layers.1', 'layers.2'"),
    ("output,layers.0,layers.1,layers.2;layers.3,layers.4,layers.5,norm,tok_embeddings",
     "tok_embeddings on the first stage and norm, output on the last"),
    ("tok_embeddings,layers.3,layers.4,layers.5;layers.0,layers.1,layers.2,norm,output", "blocks in order"),
    ("tok_embeddings,layers.0,layers.0;layers.1,layers.2,layers.3,layers.4,layers.5,norm,output",
     r"repeated \['layers.0'\]"),
])
def test_explicit_stage_names_must_cut_the_model_in_order(stages, message):
    cfg, sources = config("--parallelism.module_fqns_per_model_part", stages)
    assert len(cfg.parallelism.module_fqns_per_model_part) == 2  # ';' separates stages on the command line
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, sources, world_size=2)


def test_a_valid_cut_from_the_command_line():
    cfg, sources = config("--parallelism.module_fqns_per_model_part",
                          "tok_embeddings,layers.0;layers.1,layers.2,layers.3,layers.4,layers.5,norm,output")
    assert cfg.parallelism.module_fqns_per_model_part[0] == ["tok_embeddings", "layers.0"]
    validate_config(cfg, sources, world_size=2)


def test_csv_stages_must_be_numbered_0_to_n_minus_1_once_each(tmp_path):
    gap = tmp_path / "gap.csv"
    gap.write_text("0F0,0B0\n3F0,3B0\n")
    with pytest.raises(ConfigError, match=r"each of the stages 0..N-1 to exactly one rank; its rows hold stages "
                                          r"\[\[0\], \[3\]\]"):
        validate_config(*config("--parallelism.pipeline_parallel_schedule_csv", str(gap),
                                "--training.local_batch_size", "1"), world_size=2)


def test_interleaved_schedules_need_equal_rounds_of_micro_batches():
    with pytest.raises(ConfigError, match="gives 5 micro-batches, which schedule Interleaved1F1B cannot split"):
        validate_config(*config("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                "--training.local_batch_size", "5"), world_size=2)
