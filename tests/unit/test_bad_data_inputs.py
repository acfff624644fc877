"""Bad token shards, mixture sources and tokenize_dataset.py outputs given to the entry points: one line naming the
file or field, no traceback, no endless loop, and nothing that existed before written over or removed."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts import tokenize_dataset
from tests.bad_input import assert_one_line_error, snapshot
from torchtitan import train
from torchtitan.components.preemption import PreemptionWatcher

TINY = "train_configs/tiny.toml"
REPO = Path(__file__).resolve().parents[2]


def trainer_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--job.config_file", TINY, "--training.steps", "1", f"--job.dump_folder={tmp_path / 'dump'}", *extra]


def on_shards(tmp_path: Path, folder: Path) -> list[str]:
    return trainer_args(tmp_path, "--training.dataset_format", "tokens", "--training.dataset_path", str(folder))


def tokenize(*argv: str) -> list[str]:
    return ["--workers", "1", "--tokenizer", str(REPO / "assets/tokenizer"), *argv]


def write_corpus(folder: Path, rows: list) -> Path:
    folder.mkdir(parents=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    documents = [f"document {i}: " + "words " * i for i in range(40)]
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus", documents)


@pytest.fixture(scope="module")
def shards(corpus) -> Path:
    folder = corpus.parent / "shards"
    assert tokenize_dataset.main(tokenize("--dataset_path", str(corpus), "--output", str(folder))) == 0
    return folder


def broken(shards: Path, target: Path, manifest=None, index=None, tokens=None) -> Path:
    """A copy of ``shards`` whose manifest (a dict, or raw text), first index or first token array is edited."""
    shutil.copytree(shards, target)
    if manifest is not None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest(json.loads(
            (target / "manifest.json").read_text())))
        (target / "manifest.json").write_text(text)
    for name, edit, dtype in (("tokens-00000.idx", index, np.int64), ("tokens-00000.bin", tokens, np.uint16)):
        if edit is not None:
            values = np.fromfile(target / name, dtype=dtype)
            edit(values)
            values.tofile(target / name)
    return target


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail (rather than hang the suite) if the block runs longer than ``seconds``."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# Data lost: the tokenize script writes only where nothing but its own marked output would be replaced.

def test_tokenize_refuses_outputs_that_would_lose_data(corpus, shards, tmp_path):
    own = shutil.copytree(corpus, tmp_path / "corpus")
    note = tmp_path / "notes.txt"
    note.write_text("keep me\n")
    mixed = shutil.copytree(shards, tmp_path / "mixed")
    (mixed / "keep.txt").write_text("not a shard\n")
    foreign_partial = tmp_path / "out.partial"
    foreign_partial.mkdir()
    (foreign_partial / "draft.txt").write_text("someone's draft\n")
    before = snapshot(tmp_path)
    for output, needles in (
        (own, ["--output", str(own), "is the input"]),
        (tmp_path, ["--output", str(tmp_path), "holds the input"]),
        (own / "tokens", ["--output", str(own / "tokens"), "inside the input"]),
        (note, ["--output", str(note), "is an existing file"]),
        (mixed, ["--output", str(mixed), "keep.txt", "not written by scripts/tokenize_dataset.py"]),
        (tmp_path / "out", [str(foreign_partial), "draft.txt"]),
    ):
        assert_one_line_error(tokenize_dataset.main, tokenize("--dataset_path", str(own), "--output", str(output)),
                              *needles, unchanged=before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "mixed", "notes.txt", "out.partial"]


def test_tokenize_replaces_only_its_own_output_and_cleans_up_after_a_failure(corpus, shards, tmp_path):
    output = shutil.copytree(shards, tmp_path / "out")
    shorter = write_corpus(tmp_path / "shorter", ["one document"])
    assert tokenize_dataset.main(tokenize("--dataset_path", str(shorter), "--output", str(output))) == 0
    assert json.loads((output / "manifest.json").read_text())["num_documents"] == 1  # its own output: replaced
    bad = write_corpus(tmp_path / "bad", ["fine"] * 300 + [5])  # fails after the partial folder was started
    before = snapshot(output)
    assert_one_line_error(tokenize_dataset.main, tokenize("--dataset_path", str(bad), "--output", str(output)),
                          str(bad / "a.jsonl"), "row 300", unchanged=before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out", "shorter"]  # no out.partial left behind


# Hang: shards without a token end at once with an error; a repeated stop signal is not swallowed.

def test_shards_without_tokens_end_with_an_error_instead_of_endless_passes(shards, tmp_path):
    def no_tokens(manifest):
        manifest["num_tokens"] = manifest["shards"][0]["num_tokens"] = 0
        return manifest

    empty = broken(shards, tmp_path / "empty", manifest=no_tokens, index=lambda idx: idx.fill(0))
    (empty / "tokens-00000.bin").write_bytes(b"")
    empty_documents = broken(shards, tmp_path / "empty_documents", index=lambda idx: idx.fill(0))
    before = snapshot(empty, empty_documents)
    with deadline(60):
        assert_one_line_error(train.main, on_shards(tmp_path, empty), str(empty), "no tokens", unchanged=before)
        assert_one_line_error(train.main, on_shards(tmp_path, empty_documents),
                              str(empty_documents / "tokens-00000.idx"), "ends at offset 0",
                              f"{len(np.fromfile(shards / 'tokens-00000.bin', dtype=np.uint16))} tokens",
                              unchanged=before)


def test_stop_signals_are_held_only_while_a_step_can_end(monkeypatch):
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        # Before the first step ended (a loader that never yields): nothing to save, the previous handler acts.
        watcher = PreemptionWatcher(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1] and watcher.received is None
        assert signal.getsignal(signal.SIGTERM) != watcher._record  # both handed back
        # After a step: held for a graceful stop; the same notice delivered twice at once is held too.
        watcher = PreemptionWatcher(torch.device("cpu"), repeat_after_s=60)
        assert not watcher.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1] and watcher.received == "SIGUSR1" and watcher.should_stop()
        watcher.close()
        # Sent again later, the run did not stop in between: no longer held.
        watcher = PreemptionWatcher(torch.device("cpu"), repeat_after_s=0)
        watcher.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # another kind of notice: held as well
        assert calls == [signal.SIGUSR1] and signal.getsignal(signal.SIGTERM) == watcher._record
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1, signal.SIGUSR1] and signal.getsignal(signal.SIGTERM) != watcher._record
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.slow
def test_a_second_sigterm_ends_a_hung_process():
    code = ("import time, torch\n"
            "from torchtitan.components.preemption import PreemptionWatcher\n"
            "PreemptionWatcher(torch.device('cpu'), repeat_after_s=0.5).should_stop()\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1)  # held for a graceful stop after the step
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()


# Accepted silently: an index that does not fit its tokens, ids beyond the vocabulary.

def test_an_index_beyond_its_tokens_and_ids_beyond_the_vocabulary_are_refused(shards, tmp_path):
    num_tokens = len(np.fromfile(shards / "tokens-00000.bin", dtype=np.uint16))
    beyond = broken(shards, tmp_path / "beyond", index=lambda idx: idx.__setitem__(-1, idx[-1] + 7))
    backwards = broken(shards, tmp_path / "backwards", index=lambda idx: idx.__setitem__(2, idx[1] - 1))
    big_id = broken(shards, tmp_path / "big_id", tokens=lambda ids: ids.__setitem__(1, 5000))
    big_vocab = broken(shards, tmp_path / "big_vocab", manifest=lambda m: {**m, "vocab_size": 70000})
    before = snapshot(tmp_path)
    for folder, needles in (
        (beyond, [str(beyond / "tokens-00000.idx"), f"ends at offset {num_tokens + 7}", f"{num_tokens} tokens"]),
        (backwards, [str(backwards / "tokens-00000.idx"), "offset", "decreases at document 1"]),
        (big_id, [str(big_id / "tokens-00000.bin"), "token id 5000", "vocabulary of 2048"]),
        (big_vocab, [str(big_vocab / "manifest.json"), "vocab_size 70000", "uint16"]),
    ):
        assert_one_line_error(train.main, on_shards(tmp_path, folder), *needles, unchanged=before)


# Tracebacks: a manifest that is JSON but not the expected object.

def test_malformed_manifests_are_one_line_errors_naming_the_file_and_key(shards, tmp_path):
    def shard_field(key, value):
        def edit(manifest):
            manifest["shards"][0][key] = value
            return manifest
        return edit

    cases = [
        ("list", "[1, 2]\n", "holds a list, not an object"),
        ("no_shards", lambda m: {k: v for k, v in m.items() if k != "shards"}, "key 'shards' is missing"),
        ("dtype", lambda m: {**m, "dtype": "float7"}, "dtype 'float7' is not one of uint16, uint32"),
        ("count", shard_field("num_tokens", "many"), "shards[0].num_tokens 'many' is not a whole number >= 0"),
        ("outside", shard_field("index", "../secret.idx"), "shards[0].index '../secret.idx' is not a file name"),
    ]
    folders = [broken(shards, tmp_path / name, manifest=edit) for name, edit, _ in cases]
    before = snapshot(tmp_path)
    for folder, (_, _, needle) in zip(folders, cases):
        assert_one_line_error(train.main, on_shards(tmp_path, folder), str(folder / "manifest.json"),
                              "not a torchtitan-tokens v1 manifest", needle, unchanged=before)


# Misleading: a shard folder read as text names the source entry and the kind that reads it.

def test_a_shard_folder_given_as_text_names_the_source_and_its_kind(shards, tmp_path):
    config = tmp_path / "mix.toml"
    config.write_text(f'extends = "{REPO / TINY}"\n'
                      '[[data.sources]]\nname = "docs"\ndataset = "pydocs"\n'
                      f'[[data.sources]]\nname = "shards"\npath = "{shards}"\n')
    before = snapshot(shards, config)
    line = assert_one_line_error(train.main, ["--job.config_file", str(config), "--training.steps", "1",
                                              f"--job.dump_folder={tmp_path / 'dump'}"],
                                 "data.sources[1]", "kind = 'text'", str(shards), 'kind = "tokens" would read it',
                                 unchanged=before)
    assert "text_column" not in line
    line = assert_one_line_error(train.main, trainer_args(tmp_path, "--training.dataset_path", str(shards)),
                                 "training.dataset_path", str(shards), "dataset_format = 'tokens' would read it",
                                 unchanged=before)
    assert "text_column" not in line
    assert_one_line_error(tokenize_dataset.main, tokenize("--dataset_path", str(shards), "--output",
                                                          str(tmp_path / "again")),
                          "--dataset_path", str(shards), "already a folder of token shards", unchanged=before)
