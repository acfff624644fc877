"""Bad checkpoints and Hugging Face weights given to the trainer and the conversion scripts: one line naming the
file and tensor, no traceback, and nothing that existed before written over or removed."""

import dataclasses
import io
import os
import pickle
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from scripts import convert_from_hf, convert_to_hf
from tests.bad_input import assert_one_line_error, calls_of_two_arriving_together, snapshot
from tests.unit.test_checkpoint_storage import FakeLoader
from torchtitan import train
from torchtitan.components.checkpointing.checkpoint import CheckpointManager
from torchtitan.components.checkpointing.hf_folder import WEIGHTS_FILE, write_hf_folder
from torchtitan.components.checkpointing.states import ModelState, TrainState
from torchtitan.components.checkpointing.storage import (
    CheckpointError,
    SafeLoadPlanner,
    open_storage,
    verify_checkpoint,
)
from torchtitan.components.optimizers.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizers.optimizer import build_optimizer
from torchtitan.components.step_guard import StepGuard
from torchtitan.config import load_config
from torchtitan.data import build_tokenizer
from torchtitan.inference import build_model
from torchtitan.protocols.train_spec import build_model_args, get_train_spec

TINY = "train_configs/tiny.toml"


def trainer_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--job.config_file", TINY, "--training.steps", "1", "--training.mixed_precision_param", "float32",
            f"--job.dump_folder={tmp_path / 'dump'}", *extra]


def hf_folder(config: str, folder: Path) -> Path:
    """The config's freshly initialised model as a Hugging Face folder."""
    cfg, _ = load_config(["--job.config_file", config])
    model, spec = build_model(cfg, mtp=False)
    adapter = spec.state_dict_adapter(model.args)
    write_hf_folder(folder, model.state_dict(), adapter, build_tokenizer("assets/tokenizer"), "assets/tokenizer",
                    "float32")
    return folder


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return hf_folder(TINY, tmp_path_factory.mktemp("tiny_hf"))


def edited(source: Path, target: Path, edit) -> Path:
    """A copy of the Hugging Face folder ``source`` whose weights ``edit(tensors)`` changed in place."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    return target


def test_unmarked_steps_in_the_checkpoint_folder_are_refused_and_left_byte_identical(tmp_path):
    """Steps another tool wrote (or whose marker was deleted) are neither loaded nor written over."""
    remote = tmp_path / "remote"  # a file:// folder: complete once step-N/.complete exists
    (remote / "step-1").mkdir(parents=True)
    (remote / "step-1" / ".metadata").write_bytes(b"another tool's metadata")
    (remote / "step-1" / "__0_0.distcp").write_bytes(b"another tool's weights")
    (remote / "export-step-1").mkdir()
    (remote / "export-step-1" / "model.safetensors").write_bytes(b"weights")
    local = tmp_path / "local"  # a plain folder: complete once renamed into place with its .metadata
    (local / "step-1").mkdir(parents=True)
    (local / "step-1" / "__0_0.distcp").write_bytes(b"a step without its .metadata")
    (local / "notes.partial").write_text("not a checkpoint: never touched")
    before = snapshot(tmp_path)
    line = assert_one_line_error(train.main, trainer_args(tmp_path, "--checkpoint.enable",
                                                          f"--checkpoint.folder=file://{remote}"),
                                 f"checkpoint folder file://{remote} holds export-step-1 (no .complete marker), "
                                 "step-1 (no .complete marker; it holds .metadata: to resume from it, add its "
                                 ".complete marker)", "written by another tool, or by a torchtitan version before "
                                 "this one, which did not mark the saves it left unfinished, or its marker was "
                                 "deleted", "move it away (or delete it, if it is a save that was cut short), or set "
                                 "checkpoint.folder", unchanged=before)
    assert "step: 1" not in line
    assert_one_line_error(train.main, trainer_args(tmp_path, "--checkpoint.enable", f"--checkpoint.folder={local}"),
                          f"checkpoint folder {local} holds step-1 (no .metadata)", unchanged=before)
    assert sorted(p.name for p in remote.iterdir()) == ["export-step-1", "step-1"]


def test_a_cut_short_save_of_our_own_is_still_removed_on_start(tmp_path):
    url = f"file://{tmp_path}/ck"
    storage = open_storage(url)
    storage.begin("step-3")  # marked as ours, then cut short
    (tmp_path / "ck" / "step-3" / "__0_0.distcp").write_bytes(b"half")
    assert storage.unowned() == []
    storage.remove_incomplete()
    assert not (tmp_path / "ck" / "step-3").exists()


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "a_file").write_text("precious")
    before = snapshot(tmp_path)
    for folder, needle in ((tmp_path / "a_file", f"checkpoint.folder: {tmp_path / 'a_file'} is a file"),
                           (tmp_path / "a_file" / "sub", f"lies under {tmp_path / 'a_file'}, which is a file"),
                           (f"file://{tmp_path / 'a_file'}", f"checkpoint.folder: file://{tmp_path / 'a_file'} is a "
                                                             "file")):
        args = trainer_args(tmp_path, "--checkpoint.enable", f"--checkpoint.folder={folder}")
        assert_one_line_error(train.main, args, needle, unchanged=before)
    assert (tmp_path / "dump" / "metrics.jsonl").read_text() == ""  # refused before step 1 trained


def test_bad_hugging_face_weights_fail_in_one_line_naming_the_file_and_tensor(tmp_path, tiny_hf):
    weights = WEIGHTS_FILE
    gate = "model.layers.0.mlp.gate_proj.weight"
    cases = {
        "shape": (lambda t: t.__setitem__(gate, torch.zeros(t[gate].shape[0] + 8, t[gate].shape[1])),
                  [f"{weights}: tensor {gate} has shape [200, 64], but this model (Llama, LlamaForCausalLM) "
                   "needs [192, 64]"]),
        "family": (lambda t: t.__setitem__("model.layers.1.self_attn.q_norm.weight", torch.ones(16)),
                   [f"{weights}: unexpected Hugging Face weight model.layers.1.self_attn.q_norm.weight", "model.name"]),
        "nan": (lambda t: t["model.layers.1.self_attn.v_proj.weight"].view(-1)[5].fill_(float("nan")),
                [f"{weights}: tensor model.layers.1.self_attn.v_proj.weight holds 1 non-finite values"]),
    }
    folders = {name: edited(tiny_hf, tmp_path / name, edit) for name, (edit, _) in cases.items()}
    folders["truncated"] = truncated = edited(tiny_hf, tmp_path / "truncated", lambda t: None)
    data = (truncated / weights).read_bytes()
    (truncated / weights).write_bytes(data[: len(data) // 2])
    folders["text"] = edited(tiny_hf, tmp_path / "text", lambda t: None)
    (folders["text"] / weights).write_text("version https://git-lfs.github.com/spec/v1\n")
    cases["truncated"] = cases["text"] = (None, [f"{weights} is not a complete safetensors file"])
    before = snapshot(tmp_path)
    for name, folder in folders.items():
        line = assert_one_line_error(train.main, trainer_args(tmp_path, "--checkpoint.enable", "--checkpoint.folder",
                                                              str(tmp_path / f"ck_{name}"),
                                                              f"--checkpoint.initial_load_path={folder}",
                                                              "--checkpoint.initial_load_in_hf"),
                                     str(folder / weights), *cases[name][1], unchanged=before)
        assert "lower optimizer.lr" not in line
    # The conversion script checks the same way, and writes nothing.
    assert_one_line_error(convert_from_hf.main, [str(folders["shape"]), str(tmp_path / "out"), "--config", TINY],
                          *cases["shape"][1], unchanged=before)
    assert not (tmp_path / "out").exists()


def test_a_moe_folder_missing_one_experts_tensors_is_named(tmp_path):
    folder = hf_folder("train_configs/qwen3_moe_debug.toml", tmp_path / "moe")
    tensors = load_file(str(folder / WEIGHTS_FILE))
    expert = "model.layers.1.mlp.experts.2"
    assert f"{expert}.gate_proj.weight" in tensors
    save_file({k: v for k, v in tensors.items() if not k.startswith(f"{expert}.")}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    before = snapshot(tmp_path)
    assert_one_line_error(convert_from_hf.main, [str(folder), str(tmp_path / "out"), "--config",
                                                 "train_configs/qwen3_moe_debug.toml"],
                          f"{folder} is missing tensor {expert}.", "(and 2 more)", unchanged=before)
    assert not (tmp_path / "out").exists()


def test_convert_to_hf_refuses_a_checkpoint_of_another_flavor_or_family(tmp_path):
    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml"])
    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, cfg.model, 2048, 64))
    model.to_empty(device="cpu")  # the values do not matter, only the names and shapes
    checkpoint = tmp_path / "debugmodel"
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(checkpoint), no_dist=True)
    before = snapshot(tmp_path)
    assert_one_line_error(convert_to_hf.main, [str(checkpoint), str(tmp_path / "out"), "--config", TINY],
                          f"cannot load checkpoint {checkpoint}: it holds tok_embeddings.weight with shape "
                          "[2048, 256], but the model needs [2048, 64]", "model.flavor", unchanged=before)
    assert_one_line_error(convert_to_hf.main, [str(checkpoint), str(tmp_path / "out"), "--config",
                                               "train_configs/qwen3_debug.toml"],
                          f"cannot load checkpoint {checkpoint}: it holds no layers.0.attention.k_norm.weight",
                          unchanged=before)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_weights_fetched_from_a_url_are_fetched_again_once_the_remote_file_changes(tmp_path, monkeypatch, scheme):
    import fsspec

    from torchtitan.remote import fetched_folder

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    fs = fsspec.filesystem(scheme)
    root = str(tmp_path / "remote") if scheme == "file" else f"/{tmp_path.name}/remote"
    url = f"{scheme}://{root}"
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/model.safetensors", b"broken")
    with fetched_folder(url, "*.safetensors") as local:
        assert (local / "model.safetensors").read_bytes() == b"broken"
    fs.pipe_file(f"{root}/model.safetensors", b"repaired")
    if scheme == "file":  # a rewrite within the file system's timestamp resolution still changes the size
        os.utime(f"{root}/model.safetensors", (1, 1))
    with fetched_folder(url, "*.safetensors") as local:
        assert (local / "model.safetensors").read_bytes() == b"repaired"
    fetched = []
    monkeypatch.setattr(type(fs), "get_file", lambda self, *a, **k: fetched.append(a))
    with fetched_folder(url, "*.safetensors") as again:  # unchanged: the copy is reused
        assert again == local and fetched == []


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_weights_fetched_once_are_reused_with_a_warning_when_the_url_cannot_be_listed(tmp_path, monkeypatch, caplog,
                                                                                       scheme):
    """An offline node (here: the remote folder deleted) keeps using a complete copy; without one it is an error."""
    import fsspec

    from torchtitan.log import logger
    from torchtitan.remote import RemoteError, fetched_folder

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    fs = fsspec.filesystem(scheme)
    root = str(tmp_path / "remote") if scheme == "file" else f"/{tmp_path.name}/remote"
    url = f"{scheme}://{root}"
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/model.safetensors", b"weights")
    with fetched_folder(url, "*.safetensors") as local:
        pass
    fs.rm(root, recursive=True)
    logger.addHandler(caplog.handler)
    try:
        with fetched_folder(url, "*.safetensors") as again:
            assert again == local and (again / "model.safetensors").read_bytes() == b"weights"
    finally:
        logger.removeHandler(caplog.handler)
    [warning] = {r.getMessage() for r in caplog.records if r.levelname == "WARNING"}  # propagated or not
    assert warning.startswith(f"cannot list {url} (FileNotFoundError: ") and root in warning
    assert warning.endswith(f"): using the copy of its *.safetensors fetched earlier, {local}")
    (local / ".complete").unlink()  # an interrupted copy is no copy
    with pytest.raises(RemoteError, match=f"^{url}: cannot list \\*.safetensors: FileNotFoundError"):
        with fetched_folder(url, "*.safetensors"):
            pass


def test_processes_arriving_together_list_the_url_once(tmp_path, monkeypatch):
    """A process that waited for the cache lock while another checked the copy reuses that check: the ranks of a
    node list the remote once, not once each."""
    import fsspec

    from torchtitan.remote import fetched_folder

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    fs = fsspec.filesystem("file")
    fs.makedirs(f"{tmp_path}/remote")
    fs.pipe_file(f"{tmp_path}/remote/model.safetensors", b"weights")
    url = f"file://{tmp_path}/remote"
    with fetched_folder(url, "*.safetensors"):
        pass

    def fetch():
        with fetched_folder(url, "*.safetensors") as local:
            return (local / "model.safetensors").read_bytes()

    listings, results = calls_of_two_arriving_together(monkeypatch, type(fs), "ls", fetch)
    assert results == {"first": b"weights", "second": b"weights"} and listings == ["first"]


class _CreatesAFile:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(tmp_path):
    victim = tmp_path / "created_by_unpickling"
    crafted = tmp_path / "crafted"
    cfg, _ = load_config(["--job.config_file", TINY])
    model, _ = build_model(cfg)
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(crafted), no_dist=True)
    (crafted / ".metadata").write_bytes(pickle.dumps(_CreatesAFile(victim)))
    before = snapshot(tmp_path)
    for location in (str(crafted), f"file://{crafted}"):
        args = trainer_args(tmp_path, "--checkpoint.enable", "--checkpoint.folder", str(tmp_path / "ck"),
                            f"--checkpoint.initial_load_path={location}")
        assert_one_line_error(train.main, args,
                              f"refusing checkpoint metadata {location}/.metadata: UnpicklingError: it names io.open, "
                              "which checkpoint metadata is never made of", unchanged=before)
        assert not victim.exists()


def _run(cfg, folder: str, loader_state=None):
    """A checkpoint manager over a fresh model, the trainer's optimizer and schedule, a dataloader stand-in and the
    train state, as the trainer builds them (CPU, synchronous saves)."""
    model, _ = build_model(cfg)
    optimizer = build_optimizer([model], cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    checkpoint = dataclasses.replace(cfg.checkpoint, enable=True, folder=folder, async_mode="disabled")
    return CheckpointManager(checkpoint, "unused", [model], optimizer, scheduler, FakeLoader(loader_state),
                             TrainState(), torch.device("cpu"), StepGuard(cfg.training.guard))


@pytest.fixture(scope="module")
def deepseek_cfg():
    cfg, _ = load_config(["--job.config_file", "train_configs/deepseek_v3_debug.toml"])
    return cfg


def _train_two_steps(manager) -> None:
    model = manager.model_parts[0]
    optimizer = manager.states["optimizer"].optimizer
    for _ in range(2):
        for param in model.parameters():  # every weight, the MTP block's too (its loss is not run here)
            param.grad = torch.randn_like(param)
        optimizer.step()
        optimizer.zero_grad()
        manager.states["lr_scheduler"].scheduler.step()
    manager.states["train_state"].step, manager.states["train_state"].tokens_seen = 2, 32


def test_every_state_the_trainer_saves_loads_back_whole_through_the_restricted_reader(tmp_path, deepseek_cfg):
    """MoE (stacked experts, routing bias) and MTP blocks, AdamW's state and param groups (stored as bytes), the
    schedule, the dataloader position and the train state with its RNG, under a local folder and a URL."""
    position = {"stream_position": {"sequence": 17, "sources": [{"epoch": 0, "document": 5, "offset": 9}]}}
    for folder in (str(tmp_path / "ck"), f"file://{tmp_path}/remote"):
        saved = _run(deepseek_cfg, folder, position)
        model = saved.model_parts[0]
        assert model.args.mtp_depth == 1 and model.args.moe is not None
        _train_two_steps(saved)
        rng = torch.get_rng_state()
        saved.save(2, last_step=100)
        assert "optimizer.param_groups.tok_embeddings.weight.betas" in verify_checkpoint(
            saved.storage.where("step-2")).state_dict_metadata  # what reaches the bytes path
        torch.manual_seed(123)
        loaded = _run(deepseek_cfg, folder)
        assert loaded.load() == 2
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.model_parts[0].state_dict()[name], tensor), name
        assert "layers.4.eh_proj.weight" in model.state_dict()  # the MTP block
        want, got = (m.states["optimizer"].optimizer.state_dict() for m in (saved, loaded))
        assert got["param_groups"] == want["param_groups"] and want["param_groups"][0]["betas"] == (0.9, 0.95)
        assert want["state"].keys() == got["state"].keys() and len(want["state"]) == len(list(model.parameters()))
        for index, entries in want["state"].items():
            for key, value in entries.items():
                assert torch.equal(got["state"][index][key], value), (index, key)
        schedules = [m.states["lr_scheduler"].scheduler for m in (saved, loaded)]
        assert schedules[1].last_epoch == 2 and schedules[1].get_last_lr() == schedules[0].get_last_lr()
        assert loaded.states["dataloader"].dataloader.loaded == position
        state = loaded.states["train_state"]
        assert (state.step, state.tokens_seen) == (2, 32) and torch.equal(torch.get_rng_state(), rng)


def _crafted_copy(manager, folder: Path, entry: str, value) -> None:
    """``manager``'s whole state saved to ``folder`` with the entry ``entry`` (a dotted name) replaced by
    ``value``: a checkpoint that looks like the trainer's, as someone else could write it."""
    state = {key: dict(stateful.state_dict()) for key, stateful in manager.states.items()}
    key, name = entry.split(".", 1)
    assert name in state[key]
    state[key][name] = value
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_a_crafted_bytes_entry_is_refused_naming_it_and_runs_nothing(tmp_path, deepseek_cfg):
    """Entries DCP stores as pickled bytes (the optimizer's param groups) are read with torch.load's weights-only
    unpickler: an object whose unpickling would create a file is refused, on resume and in the conversion script."""
    victim = tmp_path / "created_by_unpickling"
    manager = _run(deepseek_cfg, str(tmp_path / "ck"), {"position": 1})
    _train_two_steps(manager)
    entry = "optimizer.param_groups.layers.2.moe.experts.w1.lr"
    _crafted_copy(manager, tmp_path / "ck" / "step-2", entry, _CreatesAFile(victim))
    with pytest.raises(CheckpointError, match=rf"^cannot load checkpoint {tmp_path}/ck/step-2: refusing the entry "
                                              rf"{entry}: it names io.open; an entry is loaded only when it holds "
                                              r"plain values \(numbers, strings, tuples, tensors\)$"):
        _run(deepseek_cfg, str(tmp_path / "ck")).load()
    assert not victim.exists()
    # Model weights stored as bytes instead of tensors go the same way, here through convert_to_hf.py.
    cfg, _ = load_config(["--job.config_file", TINY])
    model, _ = build_model(cfg)
    crafted = tmp_path / "crafted"
    dcp.save({"model": {**ModelState([model]).state_dict(), "output.weight": _CreatesAFile(victim)}},
             checkpoint_id=str(crafted), no_dist=True)
    before = snapshot(tmp_path)
    assert_one_line_error(convert_to_hf.main, [str(crafted), str(tmp_path / "out"), "--config", TINY],
                          f"cannot load checkpoint {crafted}: refusing the entry model.output.weight: it names "
                          "io.open", unchanged=before)
    assert not victim.exists() and not (tmp_path / "out").exists()
    # Bytes that are not a pickle the weights-only unpickler reads: its reason, not its advice on loading anyway.
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optimizer.param_groups.w.lr"))
    for data, message in ((b"garbage", "refusing the entry optimizer.param_groups.w.lr: Unsupported operand 103; "
                                       "an entry is loaded only when it holds plain values"),
                          (b"", "cannot read the entry optimizer.param_groups.w.lr: EOFError")):
        with pytest.raises(CheckpointError, match=f"^{re.escape(message)}"):
            SafeLoadPlanner().load_bytes(item, io.BytesIO(data))


def as_mxfp4(tensors: dict[str, torch.Tensor]) -> None:
    """gpt-oss as OpenAI released it: each expert matrix as MXFP4 blocks (16 bytes: 32 four-bit values) and one
    scale byte per block, in place of the bf16 gate_up_proj / down_proj."""
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        matrix = tensors.pop(name).transpose(1, 2)  # (E, out, in), as the released files store it
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (*matrix.shape[:2], matrix.shape[2] // 32, 16),
                                                  dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(118, 130, (*matrix.shape[:2], matrix.shape[2] // 32),
                                                  dtype=torch.uint8)


def as_fp8(tensors: dict[str, torch.Tensor]) -> None:
    """Block-quantised FP8 as DeepSeek-V3 (and the Qwen3 *-FP8 models) are released: each projection in float8 with a
    float32 scale per 128 x 128 block beside it."""
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        weight = tensors[name]
        tensors[name] = weight.to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.rand(-(-weight.shape[0] // 128), -(-weight.shape[1] // 128)) + 0.5


@pytest.mark.parametrize("config, quantise, tensor, reason", [
    ("train_configs/gpt_oss_debug.toml", as_mxfp4, "model.layers.0.mlp.experts.down_proj_blocks",
     "is an MXFP4-quantised expert weight, which this trainer does not read; use a bf16 copy of the model"),
    (TINY, as_fp8, "model.layers.0.mlp.down_proj.weight_scale_inv",
     "is the block scale of an FP8-quantised weight, which this trainer does not read; dequantise the model to bf16"),
])
def test_quantised_hugging_face_weights_are_refused_as_such_before_their_names_are_checked(
        tmp_path, config, quantise, tensor, reason):
    """A checkpoint as released lacks the unquantised tensors as well: the refusal of its format comes first (not
    'missing tensor ... check model.flavor'), for the trainer, torchtitan.load_model and convert_from_hf alike."""
    import torchtitan

    folder = edited(hf_folder(config, tmp_path / "made"), tmp_path / "released", quantise)
    before = snapshot(tmp_path)
    needle = f"{folder / WEIGHTS_FILE}: {tensor} {reason}"
    line = assert_one_line_error(convert_from_hf.main, [str(folder), str(tmp_path / "out"), "--config", config],
                                 needle, unchanged=before)
    assert "missing" not in line and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        torchtitan.load_model(config, str(folder))
    trainer = ["--job.config_file", config, "--training.steps", "1", f"--job.dump_folder={tmp_path / 'dump'}",
               "--checkpoint.enable", f"--checkpoint.folder={tmp_path / 'ck'}",
               f"--checkpoint.initial_load_path={folder}", "--checkpoint.initial_load_in_hf"]
    assert_one_line_error(train.main, trainer, needle, unchanged=before)
