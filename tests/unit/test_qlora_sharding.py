"""QLoRA's NF4 base sharded by FSDP (models/shared/nf4.py, seeded_init.assign_whole_, distributed/data_parallel.py):
which weights split into whole scale groups, slices of a whole quantisation that are exact slices of its values, and
the planner's bytes. The multi-process parity and bytes per rank are in tests/integration/test_lora.py."""

import logging
from types import SimpleNamespace

import pytest
import torch

from torchtitan.components.lora.converter import to_nf4
from torchtitan.config import load_config
from torchtitan.distributed.data_parallel import _prepare_nf4_weights
from torchtitan.models.shared.nf4 import NF4_BLOCK, NF4_SCALER_BLOCK, is_nf4, nf4_bytes, nf4_shardable, set_nf4_
from torchtitan.models.shared.seeded_init import assign_whole_
from torchtitan.planner import NF4_BYTES, model_shape
from torchtitan.protocols.model_converter import ModelConverters
from torchtitan.protocols.train_spec import build_model_args, get_train_spec

GROUP = NF4_BLOCK * NF4_SCALER_BLOCK
QLORA = ["--job.config_file", "train_configs/debug_model.toml", "--model.converters", "lora", "--lora.base_dtype",
         "nf4", "--lora.targets", "attention.*,feed_forward.*", "--training.seq_len", "32"]


@pytest.mark.parametrize(("shape", "degree", "shardable"), [
    ((256, 256), 4, True),  # 4 groups, 64 rows each
    ((256, 256), 8, False),  # 4 groups: half a group per rank
    ((512, 64), 2, True),
    ((6, GROUP // 2), 4, False),  # whole groups per rank, but 6 rows do not split in 4
    ((GROUP // 64, 64), 1, True),
])
def test_a_weight_shards_where_each_slice_holds_whole_scale_groups(shape, degree, shardable):
    assert nf4_shardable(shape, degree) is shardable


@pytest.mark.parametrize("rows", [512, 256])
def test_slices_of_a_whole_quantisation_are_its_exact_rows(rows):
    """Each shard FSDP would hold is the same codes and scales as the single process's rows, with the whole tensor's
    scale mean: dequantised, bitwise the rows of the whole dequantised weight."""
    full = torch.randn(rows, 256) * (1 + torch.rand(rows, 1) * 3)  # rows of different scales
    whole = to_nf4(full)
    expected = whole.get_original_weight()
    for pieces in (2, 4):
        for i, piece in enumerate(torch.chunk(whole, pieces)):
            target = to_nf4(torch.zeros(rows // pieces, 256))
            set_nf4_(target, piece)
            assert torch.equal(target.get_original_weight(), expected.chunk(pieces)[i])
            assert nf4_bytes(target) * pieces == nf4_bytes(whole) == NF4_BYTES * rows * 256
    # A shard quantised on its own has other scales: the error the whole quantisation avoids.
    alone = to_nf4(full.chunk(4)[1]).get_original_weight()
    assert not torch.equal(alone, expected.chunk(4)[1])


def test_a_whole_nf4_weight_takes_the_quantisation_of_its_value():
    full = torch.randn(128, 256)
    weight = to_nf4(torch.empty(128, 256, device="meta"))  # as the converter builds it, then materialised
    weight = torch.empty_like(weight, device="cpu")
    assign_whole_(weight, full)
    assert is_nf4(weight) and torch.equal(weight.get_original_weight(), to_nf4(full).get_original_weight())


def qlora_model():
    cfg, _ = load_config(QLORA)
    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, cfg.model, 2048, 32))
    ModelConverters(cfg.model.converters, cfg, None).convert(model)
    return model


@pytest.mark.parametrize(("degree", "whole"), [(4, 0), (8, 42)])
def test_weights_that_do_not_shard_stay_whole_and_are_named(caplog, degree, whole):
    model = qlora_model()
    mesh = SimpleNamespace(size=lambda dim=None: degree, device_type="cpu")
    from torchtitan.log import logger

    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            kept = _prepare_nf4_weights(model, mesh)
    finally:
        logger.removeHandler(caplog.handler)
    assert len(kept) == whole
    said = sorted({r.getMessage() for r in caplog.records if "stay whole" in r.getMessage()})  # propagated or not
    assert len(said) == bool(whole)
    if whole:
        assert said[0].startswith(f"lora: 42 of the 42 NF4 base weights stay whole on every rank: their rows do not "
                                  f"split into whole scale groups (64 x 256 values) over {degree} FSDP ranks "
                                  "(layers.0.attention.wk.weight")


def test_the_planner_divides_the_shardable_nf4_weights_by_the_fsdp_degree():
    cfg, _ = load_config(QLORA)
    shape = model_shape(cfg)
    assert shape.nf4_params == 5_111_808 and len(shape.nf4_shapes) == 42
    whole = NF4_BYTES * shape.nf4_params
    assert [shape.nf4_bytes(d) for d in (1, 2, 4, 8)] == [whole, whole / 2, whole / 4, whole]  # 8: none splits
