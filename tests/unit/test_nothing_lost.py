"""Nothing a user had is lost: the scripts that write folders or files refuse one holding anything they did not
write, before a byte is written, and write a new one whole; a run resumed from an earlier step never overwrites or
prunes the newer checkpoints unless told to discard them; token shards at a URL are read under the cache lock and
reused offline. Every file that existed before a run is byte-identical after it, refused or completed."""

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from scripts import convert_from_hf, convert_to_hf, download_hf_assets, generate_config, train_tokenizer
from tests.bad_input import (
    assert_one_line_error,
    assert_unchanged,
    calls_of_two_arriving_together,
    run_entry_point,
    snapshot,
)
from tests.unit.test_bad_checkpoint_inputs import TINY, hf_folder, trainer_args
from torchtitan import train
from torchtitan.components.checkpointing.states import ModelState
from torchtitan.components.checkpointing.storage import complete_steps
from torchtitan.config import load_config
from torchtitan.inference import build_model
from torchtitan.output_folder import OutputError, written_whole


def user_files(folder: Path) -> Path:
    """A folder holding what a user might keep where an output is asked for."""
    folder.mkdir(parents=True)
    (folder / "notes.md").write_text("my notes")
    (folder / "config.json").write_text('{"mine": true}')
    (folder / "sub").mkdir()
    (folder / "sub" / "model.safetensors").write_bytes(b"my weights")
    return folder


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    cfg, _ = load_config(["--job.config_file", TINY])
    model, _ = build_model(cfg)
    folder = tmp_path_factory.mktemp("ck") / "step-1"
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(folder), no_dist=True)
    return folder


def test_the_converters_refuse_a_folder_holding_anything_and_write_a_new_one_whole(tmp_path, tiny_checkpoint):
    hf = hf_folder(TINY, tmp_path / "hf")
    taken = user_files(tmp_path / "taken")
    (tmp_path / "a_file").write_text("precious")
    before = snapshot(tmp_path, tiny_checkpoint)
    to_hf = [str(tiny_checkpoint), "--config", TINY]
    for output, needle in ((taken, "holds 'config.json' and 2 more; give a new or empty folder"),
                           (hf, "holds 'config.json' and 4 more"),  # an earlier export: still the user's to remove
                           (tmp_path / "a_file", "is an existing file")):
        assert_one_line_error(convert_to_hf.main, [to_hf[0], str(output), *to_hf[1:]], f"output {output} {needle}",
                              unchanged=before)
        assert_one_line_error(convert_from_hf.main, [str(hf), str(output), "--config", TINY],
                              f"output {output} {needle}", unchanged=before)
    # New folders, and an empty one, are written whole; everything that was there is untouched.
    (tmp_path / "empty").mkdir()
    assert run_entry_point(convert_to_hf.main, [to_hf[0], str(tmp_path / "empty"), *to_hf[1:]])[0] == 0
    assert run_entry_point(convert_from_hf.main, [str(hf), str(tmp_path / "new" / "dcp"), "--config", TINY])[0] == 0
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "new" / "dcp" / ".metadata").is_file()
    assert_unchanged(before)
    assert not [p for p in tmp_path.rglob("*partial*")]


def test_an_empty_folder_is_written_in_place_and_a_refusing_file_system_is_one_line(tmp_path, monkeypatch):
    """An empty output (a mount point, a volume) is written inside itself, never beside it: its parent may not be
    writable. A file system that refuses a rename (another device) is an OutputError naming the folder."""
    import errno
    import os

    (tmp_path / "out").mkdir()
    with written_whole(tmp_path / "out") as folder:
        (folder / "model.safetensors").write_bytes(b"weights")
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "rename", cross_device)
    for target in (tmp_path / "new", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(OutputError, match=f"^cannot write {target}: OSError: Invalid cross-device link$"):
            with written_whole(target) as folder:
                (folder / "config.json").write_text("{}")
    assert not (tmp_path / "new").exists() and list((tmp_path / "empty").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]  # no partial folder left


def test_a_write_that_fails_leaves_the_folder_as_it_was(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "new"):
        existed = target.exists()
        with pytest.raises(RuntimeError, match="disk full"):
            with written_whole(target) as folder:
                (folder / "half.bin").write_bytes(b"half")
                raise RuntimeError("disk full")
        assert target.exists() == existed and not (target.exists() and any(target.iterdir()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no partial folder left
    with pytest.raises(OutputError, match="was written to while this script ran"):
        with written_whole(tmp_path / "raced") as folder:
            (folder / "ours").write_text("ours")
            user_files(tmp_path / "raced")
    assert (tmp_path / "raced" / "notes.md").read_text() == "my notes" and not (tmp_path / "raced" / "ours").exists()


def test_train_tokenizer_refuses_a_folder_holding_anything(tmp_path):
    taken = user_files(tmp_path / "taken")
    (taken / "tokenizer.json").write_text("my tokenizer")
    before = snapshot(tmp_path)
    for folder in (taken, Path("assets/tokenizer")):  # the default: the shipped tokenizer stays as it is
        argv = ["--vocab-size", "300", "--output-dir", str(folder)]
        assert_one_line_error(train_tokenizer.main, argv, f"--output-dir {folder} holds", unchanged=before)
    tok = ["--vocab-size", "270", "--output-dir", str(tmp_path / "tok")]
    assert_one_line_error(train_tokenizer.main, [*tok, "--input", str(taken / "notes.md")],
                          "--input: dataset_path", "unsupported file type", unchanged=before)
    assert not (tmp_path / "tok").exists()
    (tmp_path / "corpus.txt").write_text("a few words to learn merges from, a few words again\n" * 20)
    for size, needle in (("100", "--vocab-size 100 is invalid"), ("900", "--vocab-size 900: the training text is "
                                                                        "too small to learn that many merges")):
        assert_one_line_error(train_tokenizer.main, [*tok[:1], size, *tok[2:], "--input", str(tmp_path / "corpus.txt")],
                              needle, unchanged=before)
    assert run_entry_point(train_tokenizer.main, [*tok, "--input", str(tmp_path / "corpus.txt")])[0] == 0
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert_unchanged(before)


def test_download_hf_assets_writes_no_repository_file_over_one_it_did_not_download(tmp_path, monkeypatch):
    import os
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub._local_folder import write_download_metadata

    downloads = []
    files = [SimpleNamespace(rfilename=name) for name in ("tokenizer.json", "config.json", "README.md")]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, repo_id, **kw: SimpleNamespace(sha=f"{repo_id}@head", siblings=files))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: downloads.append(kw["local_dir"]))
    argv = ["--assets", "tokenizer", "config", "--local-dir"]
    mine = user_files(tmp_path / "mine")  # the user's config.json has a repository file's name
    (tmp_path / "a_file").write_text("precious")
    before = snapshot(tmp_path)
    assert_one_line_error(download_hf_assets.main, ["owner/model", *argv, str(mine)],
                          f"--local-dir {mine} already holds 'config.json', which this download would overwrite",
                          unchanged=before)
    assert_one_line_error(download_hf_assets.main, ["owner/model", *argv, str(tmp_path / "a_file")],
                          "is an existing file", unchanged=before)
    assert downloads == []
    # Files an earlier download of this commit left unchanged may be downloaded again (the folder topped up)...
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "tokenizer.json").write_text("downloaded")
    write_download_metadata(earlier, "tokenizer.json", "owner/model@head", "etag")
    (earlier / "notes.md").write_text("unrelated: never a repository file here")
    assert run_entry_point(download_hf_assets.main, ["owner/model", *argv, str(earlier)])[0] == 0
    assert downloads == [earlier]
    # ...but not another repository's (or revision's) over them, nor one the user edited since.
    before = snapshot(tmp_path)
    assert_one_line_error(download_hf_assets.main, ["other/model", *argv, str(earlier)], "already holds "
                          "'tokenizer.json', which this download would overwrite and which no earlier download of "
                          "other/model at this revision left there unchanged", unchanged=before)
    os.utime(earlier / "tokenizer.json", (2e9, 2e9))
    assert_one_line_error(download_hf_assets.main, ["owner/model", *argv, str(earlier)], "already holds "
                          "'tokenizer.json'", unchanged=before)
    assert downloads == [earlier]


def test_generate_config_replaces_only_a_file_it_generated(tmp_path, monkeypatch):
    monkeypatch.chdir(Path.cwd())
    flags = ["--flavor", "debugmodel", "--gpus_per_node", "2", "--global_batch_size", "4", "--seq_len", "256",
             "--device", "CPU"]
    mine = tmp_path / "mine.toml"
    mine.write_text("# my hand-tuned config\n[training]\nsteps = 7\n")
    before = snapshot(tmp_path)
    assert_one_line_error(generate_config.main, [*flags, "--output", str(mine)],
                          f"{mine} exists and was not written by this script", unchanged=before)
    assert_one_line_error(generate_config.main, [*flags, "--output", str(tmp_path)], "is a folder", unchanged=before)
    ours = tmp_path / "ours.toml"
    for _ in range(2):  # the second run replaces what the first generated
        assert run_entry_point(generate_config.main, [*flags, "--output", str(ours)])[0] == 0
    assert ours.read_text().startswith(generate_config.GENERATED)
    assert_unchanged(before)
    ours.write_text(ours.read_text().replace("steps = ", "steps = 1"))  # the user tuned the generated file
    before = snapshot(tmp_path)
    assert_one_line_error(generate_config.main, [*flags, "--output", str(ours)],
                          f"{ours} was written by this script but edited since", unchanged=before)


def test_resuming_from_an_earlier_step_never_touches_the_newer_checkpoints_unless_told(tmp_path):
    run = [*trainer_args(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "1"), "--training.steps", "3"]
    assert run_entry_point(train.main, run)[0] == 0
    folder = tmp_path / "dump" / "checkpoint"
    assert complete_steps(folder) == [1, 2, 3] and (folder / "export-step-3").is_dir()
    before = snapshot(folder)
    for step in (1, 2):
        assert_one_line_error(train.main, [*run, "--checkpoint.load_step", str(step)],
                              f"checkpoint.load_step = {step} is below the newest checkpoints in {folder}: "
                              + ("step-2, " if step == 1 else "") + "step-3, export-step-3",
                              f"To branch off step {step}, copy {folder / f'step-{step}'} into a new folder and give "
                              "that as checkpoint.folder", "checkpoint.discard_newer_steps = true", unchanged=before)
    assert_one_line_error(train.main, [*run, "--checkpoint.discard_newer_steps"],
                          "checkpoint.discard_newer_steps = True does nothing without checkpoint.load_step",
                          unchanged=before)
    # Branching as the refusal says: step 1 copied into a new folder, which the run resumes from.
    branch = tmp_path / "branch"
    branch.mkdir()
    shutil.copytree(folder / "step-1", branch / "step-1")
    code, text = run_entry_point(train.main, [*run, f"--checkpoint.folder={branch}"])
    assert code == 0 and "resumed from step 1" in text and complete_steps(branch) == [1, 2, 3]
    # load_only never writes: it may read any step.
    code, text = run_entry_point(train.main, [*run, "--checkpoint.load_step", "1", "--checkpoint.load_only"])
    assert code == 0 and "resumed from step 1" in text
    assert_unchanged(before)
    # Told to discard them: the newer ones go once step 1 has loaded, and the run trains on from there.
    code, text = run_entry_point(train.main, [*run, "--checkpoint.load_step", "1", "--checkpoint.discard_newer_steps"])
    assert code == 0 and "resumed from step 1" in text, text[-2000:]
    assert complete_steps(folder) == [1, 2, 3]
    assert (folder / "step-1" / ".metadata").read_bytes() == before[folder / "step-1" / ".metadata"]
    rows = [json.loads(line) for line in (tmp_path / "dump" / "metrics.jsonl").read_text().splitlines()]
    # The branch, then the load_only run (it trains too, saving nothing), then the discarding one.
    assert [row["step"] for row in rows] == [1, 2, 3, 2, 3, 2, 3, 2, 3]
    assert [row["loss"] for row in rows[3:]] == [row["loss"] for row in rows[1:3]] * 3  # the same steps again


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_shards_at_a_url_are_reused_offline_and_their_manifest_read_once_by_processes_arriving_together(
        tmp_path, monkeypatch, caplog, scheme):
    import fsspec

    from tests.unit.test_data_remote import upload
    from torchtitan.data.errors import DataError
    from torchtitan.data.shards import MANIFEST, TokenShards, write_shards
    from torchtitan.data.tokenizer import build_tokenizer
    from torchtitan.log import logger

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = build_tokenizer("assets/tokenizer")
    local = tmp_path / "shards"
    write_shards(([1, *tokenizer.encode(f"document {i}"), 2] for i in range(20)), tokenizer, local, "test", 64)
    fs = fsspec.filesystem(scheme)
    url = local.as_uri() if scheme == "file" else f"memory://{tmp_path.name}/shards"
    if scheme == "memory":
        upload(fs, local, url)
    reads, lengths = calls_of_two_arriving_together(monkeypatch, type(fs), "cat_file",
                                                    lambda: len(TokenShards(url, tokenizer)))
    assert lengths == {"first": 20, "second": 20} and reads == ["first"]
    # Offline (the remote gone): the complete copy serves, with a warning; without one it is an error.
    if scheme == "file":
        local.rename(tmp_path / "moved")
    else:
        fs.rm(url.removeprefix("memory:/"), recursive=True)
    logger.addHandler(caplog.handler)
    try:
        assert len(TokenShards(url, tokenizer)) == 20
    finally:
        logger.removeHandler(caplog.handler)
    assert any(r.getMessage().startswith(f"cannot read {url}/{MANIFEST} (") and "using the copy of the shards "
               "fetched earlier" in r.getMessage() for r in caplog.records)
    for copy in (tmp_path / "cache" / "shards").iterdir():
        if copy.is_dir():
            (copy / MANIFEST).unlink()
    with pytest.raises(DataError, match=f"^{url}/{MANIFEST}: cannot read the shard manifest"):
        TokenShards(url, tokenizer)
