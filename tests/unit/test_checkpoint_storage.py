"""Checkpoint storage: local folders and URLs, what counts as complete, and the dataloader state's format."""

import json
import re
import uuid

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.integration.remote_trainer import register
from torchtitan.components.checkpointing.checkpoint import config_problems
from torchtitan.components.checkpointing.states import DataLoaderState
from torchtitan.components.checkpointing.storage import (
    CheckpointError,
    checkpoint_location,
    open_storage,
    verify_checkpoint,
    writer_for,
)
from torchtitan.config.job_config import Checkpoint
from torchtitan.config.loading import ConfigError
from torchtitan.config_check import load_and_validate


@pytest.fixture
def url():
    return f"memory://tests/{uuid.uuid4().hex}"


def save(storage, name: str, value: torch.Tensor) -> None:
    storage.begin(name)
    dcp.save({"w": value}, storage_writer=writer_for(storage.target(name)), no_dist=True)


def test_a_url_step_counts_only_once_its_marker_is_written_and_deletion_drops_the_marker_first(url):
    storage = open_storage(url)
    storage.check_reachable()
    save(storage, "step-2", torch.randn(5))
    assert storage.steps() == []  # written, not yet marked
    storage.commit("step-2")
    save(storage, "step-4", torch.randn(5))
    assert storage.steps() == [2]
    verify_checkpoint(storage.where("step-2"))
    storage.delete("step-4")
    fs = fsspec.filesystem("memory")
    assert fs.ls(url.removeprefix("memory:/"), detail=False) == [f"{url.removeprefix('memory:/')}/step-2"]
    calls = []
    real_rm = fs.rm

    def rm(path, **kw):
        calls.append(sorted(p.rsplit("/", 1)[-1] for p in path) if isinstance(path, list) else path.rsplit("/", 1)[-1])
        return real_rm(path, **kw)

    fs.rm = rm
    try:
        storage.delete("step-2")
    finally:
        del fs.rm
    # The completion marker goes first, the shards next; the in-progress marker (written first) goes with the folder,
    # last: a delete cut short is an unfinished operation of ours, removed on the next start.
    assert calls == [".complete", [".metadata", "__0_0.distcp"], "step-2"] and storage.steps() == []


def test_a_url_checkpoint_missing_a_file_is_refused_naming_it(url):
    storage = open_storage(url)
    save(storage, "step-1", torch.randn(3))
    storage.commit("step-1")
    fsspec.filesystem("memory").rm(f"{url.removeprefix('memory:/')}/step-1/__0_0.distcp")
    with pytest.raises(CheckpointError, match=f"^checkpoint file {url}/step-1/__0_0.distcp is missing$"):
        verify_checkpoint(storage.where("step-1"))


def test_a_local_folder_completes_by_rename_and_never_by_marker(tmp_path):
    storage = open_storage(str(tmp_path / "ck"))
    save(storage, "step-3", torch.randn(2))
    assert storage.steps() == [] and (tmp_path / "ck" / "step-3.partial").is_dir()
    storage.commit("step-3")
    assert storage.steps() == [3] and not (tmp_path / "ck" / "step-3" / ".complete").exists()


def test_an_absolute_folder_or_url_wins_over_the_dump_folder():
    assert checkpoint_location("out", "checkpoint") == "out/checkpoint"
    assert checkpoint_location("out", "/abs/ck") == "/abs/ck"
    assert checkpoint_location("out", "s3://bucket/run") == "s3://bucket/run"


def test_url_problems_are_config_errors_naming_the_field(tmp_path):
    problems = config_problems(Checkpoint(enable=True, folder="nosuch://b/run", initial_load_path="nosuch://b/init"),
                               1, "llama3", True)
    assert problems == [
        ("folder", "has the unknown protocol 'nosuch' (no fsspec implementation is registered for it)"),
        ("initial_load_path", "has the unknown protocol 'nosuch' (no fsspec implementation is registered for it)")]
    missing = config_problems(Checkpoint(folder="s3://bucket/run"), 1, "llama3", True)
    assert [field for field, _ in missing] == ["folder"] and "needs a package for s3://" in missing[0][1]
    with pytest.raises(ConfigError, match="job.dump_folder .* is a URL, but metrics, TensorBoard"):
        load_and_validate(["--job.config_file", "train_configs/tiny.toml", "--job.dump_folder", "memory://out"])


class FakeLoader:
    def __init__(self, state=None):
        self.state, self.loaded = state, None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def test_the_dataloader_state_round_trips_any_json_state_through_dcp(tmp_path):
    """A mixture's position (a list per source) and counts survive a save/load, into a fresh destination."""
    state = {"stream_position": {"sequence": 17, "stage_counts": [3, 2], "names": ["web", "code"],
                                 "sources": [{"epoch": 0, "document": 5, "offset": 9}] * 2},
             "counts": {"tokens/web": 1024, "tokens/code": 512}}
    dcp.save({"dataloader": DataLoaderState(FakeLoader(state))}, checkpoint_id=str(tmp_path), no_dist=True)
    target = DataLoaderState(FakeLoader())
    target.prepare_load(verify_checkpoint(str(tmp_path)))
    dcp.load({"dataloader": target}, checkpoint_id=str(tmp_path), no_dist=True)
    assert target.dataloader.loaded == json.loads(json.dumps(state))


def test_a_checkpoint_with_the_earlier_three_int_position_still_loads(tmp_path):
    legacy = {"stream_position": torch.tensor([1, 42, 7], dtype=torch.int64)}
    dcp.save({"dataloader": legacy}, checkpoint_id=str(tmp_path), no_dist=True)
    target = DataLoaderState(FakeLoader())
    target.prepare_load(verify_checkpoint(str(tmp_path)))
    dcp.load({"dataloader": target}, checkpoint_id=str(tmp_path), no_dist=True)
    assert target.dataloader.loaded == {"stream_position": {"epoch": 1, "document": 42, "offset": 7}}


def test_the_test_object_store_refuses_folder_renames(tmp_path, monkeypatch):
    """The stand-in the multi-process tests use behaves like an object store where it matters."""
    monkeypatch.setenv("OBJSTORE_ROOT", str(tmp_path))
    register()
    fs, path = fsspec.core.url_to_fs("objstore://bucket/a")
    fs.makedirs(path, exist_ok=True)
    with pytest.raises(OSError, match="object stores have no rename"):
        fs.mv(path, path + "-moved")


def test_a_folder_written_locally_is_uploaded_then_marked_and_fetched_back(url, tmp_path, monkeypatch):
    """The Hugging Face export's path to a URL, and initial_load_in_hf's way back."""
    from torchtitan.remote import fetched_folder

    storage = open_storage(url)
    seen = []

    def write(folder):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / "config.json").write_text("{}")
        seen.append(fsspec.filesystem("memory").exists(f"{url.removeprefix('memory:/')}/export-step-4/.complete"))
        return 2

    assert storage.write_folder("export-step-4", write) == 2 and seen == [False]
    root = url.removeprefix("memory:/")
    assert sorted(fsspec.filesystem("memory").ls(f"{root}/export-step-4", detail=False)) == [
        f"{root}/export-step-4/.complete", f"{root}/export-step-4/config.json",
        f"{root}/export-step-4/model.safetensors"]
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    with fetched_folder(storage.where("export-step-4"), "*.safetensors") as local:
        assert sorted(p.name for p in local.iterdir()) == [".complete", "model.safetensors"]
        assert (local / "model.safetensors").read_bytes() == b"weights"
    fetches = []
    fs = fsspec.filesystem("memory")
    monkeypatch.setattr(fs, "get_file", lambda *a, **k: fetches.append(a))
    with fetched_folder(storage.where("export-step-4"), "*.safetensors") as again:
        assert again == local and fetches == []  # one copy per machine, reused


def test_on_start_only_saves_of_ours_cut_short_are_removed_and_unmarked_steps_are_refused(url):
    storage = open_storage(url)
    save(storage, "step-3", torch.randn(2))
    storage.commit("step-3")  # in-progress marker dropped, completion marker written
    save(storage, "step-5", torch.randn(2))  # written to the end (metadata and all), cut short before its marker
    storage.begin("step-6")  # cut short before anything was written
    fs, root = fsspec.filesystem("memory"), url.removeprefix("memory:/")
    fs.pipe_file(f"{root}/step-7/__0_0.distcp", b"another tool's")  # neither marker: not ours
    fs.pipe_file(f"{root}/notes.txt", b"not a step: never looked at")
    assert storage.unowned() == ["step-7 (no .complete marker)"]
    storage.remove_incomplete()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["notes.txt", "step-3", "step-7"] and storage.steps() == [3]
    assert not fs.exists(f"{root}/step-3/.in-progress")
    fs.rm(f"{root}/step-3/.complete")  # a completion marker deleted by hand: not ours to remove any more
    with pytest.raises(CheckpointError, match=r"holds step-3 \(no .complete marker; it holds .metadata: to resume "
                                              r"from it, add its .complete marker\), step-7 \(no .complete marker\)"):
        storage.refuse_unowned()


def test_a_metrics_backend_that_cannot_be_imported_fails_validation_on_every_rank(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb = True needs wandb, which cannot be imported here "
                                          r"\(ModuleNotFoundError: import of wandb halted"):
        load_and_validate(["--job.config_file", "train_configs/tiny.toml", "--metrics.enable_wandb"])


def test_on_resume_rank_0_alone_looks_at_the_folder_and_every_rank_raises_its_verdict(url, monkeypatch):
    """Ranks listing a URL folder while rank 0 removes a save cut short could see it half removed and disagree,
    one raising alone while the others wait for it: rank 0 checks and cleans, then every rank gets its verdict."""
    from torchtitan.components.checkpointing import checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    manager = checkpoint.CheckpointManager(Checkpoint(enable=True, folder=url), "unused", [model], optimizer,
                                           scheduler, FakeLoader(), checkpoint.TrainState(), torch.device("cpu"),
                                           checkpoint.TrainState())
    storage = manager.storage
    save(storage, "step-7", torch.randn(2))  # cut short before its marker ...
    fsspec.filesystem("memory").rm(f"{url.removeprefix('memory:/')}/step-7/.in-progress")  # ... and not ours
    looked, sent = [], []
    for name in ("refuse_unowned", "remove_incomplete"):
        real = getattr(storage, name)
        monkeypatch.setattr(storage, name, lambda real=real, name=name: (looked.append(name), real())[1])
    monkeypatch.setattr(checkpoint.dist, "is_initialized", lambda: True)

    def broadcast(objects, src, group=None):
        assert src == 0
        if manager.rank == 0:
            sent.append(objects[0])
        else:
            objects[0] = sent[-1]

    monkeypatch.setattr(checkpoint.dist, "broadcast_object_list", broadcast)
    expected = f"checkpoint folder {url} holds step-7 (no .complete marker; it holds .metadata"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        manager.load()
    assert looked == ["refuse_unowned"] and sent[0].startswith(expected)
    manager.rank = 1
    with pytest.raises(CheckpointError) as raised:
        manager.load()
    assert str(raised.value) == sent[0] and looked == ["refuse_unowned"]  # rank 1 did not look
    storage.delete("step-7")
    storage.begin("step-8")  # a save of ours cut short: rank 0 removes it, every rank goes on
    manager.rank = 0
    assert manager.load() is None and sent[-1] is None and not storage._children()
    assert looked == ["refuse_unowned", "refuse_unowned", "remove_incomplete"]
