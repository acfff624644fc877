"""Where the prompts of reinforcement learning come from.

A `PromptSource` is an endless, deterministic stream of samples: ``source[i]`` is a dict with at least
``"prompt"`` (the text the policy completes) and whatever the reward functions read (the built-in task's
``"answer"``). It holds finite rows and cycles over them in passes, each pass in its own order drawn from
(seed, pass), so every row comes once per pass and sample i depends on (seed, i) alone: a checkpoint stores the
next index and nothing else, and changing the parallel layout does not change the stream.

The rows come from a registered task (`TASKS`, rl.prompts) or from rl.prompts_path, which is used instead when
set:

* a JSONL/JSON/parquet/arrow file or a folder of them, local or a URL, read by the data layer's file reader
  (data/sources.py: rows counted from 0 in messages, bad rows named by file and row);
* a folder written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict with splits);
* a Hugging Face hub dataset named ``owner/name`` (loaded with ``datasets.load_dataset``, which needs the network
  the first time).

Column rl.prompt_column (which must hold text) becomes the sample's "prompt"; the other columns are kept as they
are.

Splits: "train" and "heldout", disjoint; held-out prompts measure what the policy learnt beyond the prompts it
trained on. A task builds both. Of a file or a flat folder there is only "train"; a DatasetDict (saved or on the
hub) gives "train" its "train" split and "heldout" its "test" split, or else its "validation" split.

A task is ``builder(split, seed) -> PromptSource``, registered in `TASKS`; a module named in
experimental.custom_import can register one beside the built-in "arithmetic" (data/arithmetic.py: "What is
17 + 5?", answer "22").
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from torchtitan.data import arithmetic
from torchtitan.data.chat_template import ChatTemplate, chat_ids
from torchtitan.data.errors import DataError
from torchtitan.data.sources import LocalFiles
from torchtitan.log import one_line
from torchtitan.registry import Registry
from torchtitan.remote import is_url, url_problem

if TYPE_CHECKING:
    from torchtitan.config.job_config import RL
    from torchtitan.data.tokenizer import Tokenizer

SPLITS = ("train", "heldout")
# The splits of a DatasetDict that serve as "heldout", in order of preference.
HELDOUT_SPLIT_NAMES = ("test", "validation")
# A hub dataset's name: owner/name, and not a path that merely does not exist (those have a data file's suffix).
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".txt", ".gz")


class PromptSource:
    """Samples of finite rows, endlessly: pass p visits every row once, in the order drawn from (seed, p).

    ``rows`` is a sequence of mappings (a list of dicts, a ``datasets.Dataset``); ``name`` says where they come
    from in messages, ``locate(row)`` (optional) names a row's file and line; ``prompt_column`` is renamed to
    "prompt" in each sample, which must then be text.
    """

    def __init__(self, rows: Sequence[Mapping], seed: int, name: str, prompt_column: str = "prompt",
                 locate: Callable[[int], str] | None = None):
        if len(rows) == 0:
            raise DataError(f"{name}: no rows to draw prompts from")
        self.rows, self.seed, self.name, self.prompt_column = rows, seed, name, prompt_column
        self._locate = locate or (lambda row: f"{name}: row {row}")
        self._order: tuple[int, np.ndarray] | None = None  # the last pass's order: samples are read in sequence

    @property
    def pass_size(self) -> int:
        """Samples per pass: ``source[k * pass_size + j]`` for j < pass_size are every row once."""
        return len(self.rows)

    def row_of(self, index: int) -> int:
        """The row that sample ``index`` is."""
        if index < 0:
            raise IndexError(f"sample index {index} is negative; a prompt stream starts at 0")
        epoch, position = divmod(index, self.pass_size)
        if self._order is None or self._order[0] != epoch:
            # SeedSequence takes non-negative entries; any int seed maps to one.
            self._order = epoch, np.random.default_rng([self.seed % 2**64, epoch]).permutation(self.pass_size)
        return int(self._order[1][position])

    def __getitem__(self, index: int) -> dict:
        row = self.row_of(index)
        sample = dict(self.rows[row])
        if self.prompt_column != "prompt":
            if "prompt" in sample:
                raise DataError(f"{self._locate(row)}: has a column 'prompt' besides rl.prompt_column = "
                                f"{self.prompt_column!r}, which becomes the sample's prompt; rename one of them")
            sample["prompt"] = sample.pop(self.prompt_column, None)
        if not isinstance(sample["prompt"], str):
            value = sample["prompt"]
            raise DataError(f"{self._locate(row)}: column {self.prompt_column!r} holds {type(value).__name__} "
                            f"{value!r:.40}, not text (a prompt)")
        return sample


TaskBuilder = Callable[[str, int], PromptSource]
"""``builder(split, seed)``: the prompts of split "train" or "heldout", their order drawn from ``seed``."""

TASKS: Registry[TaskBuilder] = Registry("prompt task")


def arithmetic_task(split: str, seed: int) -> PromptSource:
    """Integer addition and subtraction with exact answers (data/arithmetic.py): 200 fixed held-out problems,
    the rest for training."""
    if split not in SPLITS:
        raise DataError(f"task 'arithmetic' has no split {split!r}; valid: {', '.join(SPLITS)}")
    return PromptSource(arithmetic.problems(split), seed, f"task arithmetic ({split})")


TASKS.register("arithmetic", arithmetic_task)


def _split_of(splits: Mapping, split: str, where: str):
    """The split of a DatasetDict that serves as ours."""
    names = ("train",) if split == "train" else HELDOUT_SPLIT_NAMES
    for name in names:
        if name in splits:
            return splits[name]
    raise DataError(f"{where} has no {' or '.join(map(repr, names))} split for the {split} prompts; its splits: "
                    f"{', '.join(splits)}")


def _dataset_rows(dataset, split: str, where: str, column: str):
    """The rows of a loaded Dataset or DatasetDict for ``split``, checked to have the prompt column."""
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        dataset = _split_of(dataset, split, where)
    elif split != "train":
        raise DataError(f"{where} is one set of rows with no held-out split; save a DatasetDict with a 'test' split "
                        f"to hold prompts out")
    if column not in dataset.column_names:
        raise DataError(f"{where} has no column {column!r} (columns: {', '.join(dataset.column_names)}); set "
                        "rl.prompt_column")
    return dataset


def _path_rows(path: str, split: str, column: str) -> tuple[Sequence[Mapping], Callable[[int], str] | None]:
    """The rows of rl.prompts_path for ``split`` and, for files, what names a row's file and line."""
    import datasets

    local = pathlib.Path(path)
    if local.is_dir() and any((local / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
        try:
            loaded = datasets.load_from_disk(str(local))
        except Exception as e:  # a damaged save: whatever `datasets` raises, the user needs the folder
            raise DataError(f"rl.prompts_path {path!r}: cannot load the saved dataset: {one_line(e)}") from None
        return _dataset_rows(loaded, split, f"rl.prompts_path {path!r}", column), None
    if is_url(path) or local.exists():
        if split != "train":
            raise DataError(f"rl.prompts_path {path!r} is one set of rows with no held-out split; save a DatasetDict "
                            "with a 'test' split (datasets' save_to_disk) to hold prompts out")
        files = LocalFiles(path, column, whole_rows=True, column_field="rl.prompt_column")
        return list(files), files.locate
    try:
        loaded = datasets.load_dataset(path)
    except Exception as e:  # offline, unknown repo, gated without a token, ...
        raise DataError(f"rl.prompts_path {path!r} is no local file or folder, and as a hub dataset it cannot be "
                        f"opened: {one_line(e)}") from None
    return _dataset_rows(loaded, split, f"hub dataset {path}", column), None


def build_prompt_source(rl: RL, seed: int, split: str = "train") -> PromptSource:
    """The prompts of ``split`` ("train" or "heldout") as the [rl] section names them."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if rl.prompts_path is None:
        if rl.prompts not in TASKS:
            raise DataError(f"rl.prompts = {rl.prompts!r} names no registered prompt task; registered: "
                            f"{', '.join(TASKS.names())}")
        return TASKS.get(rl.prompts)(split, seed)
    rows, locate = _path_rows(rl.prompts_path, split, rl.prompt_column)
    return PromptSource(rows, seed, f"rl.prompts_path {rl.prompts_path!r} ({split})", rl.prompt_column, locate)


def prompt_ids(tokenizer: Tokenizer, template: ChatTemplate | None, prompt: str) -> list[int]:
    """The token ids the policy completes for ``prompt``: with a chat template (rl.chat), the prompt as a user message
    rendered up to where the assistant answers; without, BOS and the text. The trainer's rollouts and held-out
    evaluation (scripts/rl_eval.py) both render prompts here, so they ask the same question."""
    if template is None:
        return tokenizer.encode(prompt, bos=True)
    return chat_ids(tokenizer, template, [{"role": "user", "content": prompt}], add_generation_prompt=True)


def config_problems(rl: RL) -> list[tuple[str, str]]:
    """(field of [rl], reason) for the prompt source as configured (after custom modules are imported). A hub
    dataset is not reached here: it is opened when the prompts are built."""
    problems = []
    if rl.prompts_path is None:
        if rl.prompts not in TASKS:
            problems.append(("prompts", f"names no registered prompt task; registered: {', '.join(TASKS.names())} "
                                        "(a module named in experimental.custom_import can register one in "
                                        "torchtitan.rl.tasks.TASKS), or set rl.prompts_path"))
    elif is_url(rl.prompts_path):
        if (problem := url_problem(rl.prompts_path)) is not None:
            problems.append(("prompts_path", problem))
    elif not pathlib.Path(rl.prompts_path).exists() and (
            not _HUB_NAME.fullmatch(rl.prompts_path) or rl.prompts_path.endswith(_DATA_SUFFIXES)):
        problems.append(("prompts_path", "does not exist; give a JSONL/JSON/parquet/arrow file or a folder of them, "
                                         "a folder saved by datasets' save_to_disk, or a hub dataset as owner/name"))
    if not rl.prompt_column:
        problems.append(("prompt_column", "is empty; name the column of rl.prompts_path rows that holds the prompt"))
    return problems
