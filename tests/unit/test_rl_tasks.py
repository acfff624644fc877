"""RL prompt sources: the arithmetic task, files and saved datasets as endless seeded streams, the chat dataset
for fine-tuning first, and one-line errors for bad input."""

import json
import operator
import re

import pytest

from tests.conftest import TOKENIZER
from torchtitan.config.job_config import RL
from torchtitan.data import DataError, arithmetic, build_tokenizer, load_documents
from torchtitan.data.chat import encode_conversation
from torchtitan.data.chat_template import ChatTemplate
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.data.sources import DATASET_FORMATS
from torchtitan.rl.tasks import TASKS, PromptSource, build_prompt_source, config_problems

PROBLEM = re.compile(r"What is (\d+) ([+-]) (\d+)\?")
OPERATORS = {"+": operator.add, "-": operator.sub}


def one_line_error(match: str, call, error=DataError) -> str:
    with pytest.raises(error, match=match) as info:
        call()
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


def prompts(source: PromptSource, start: int = 0, count: int | None = None) -> list[str]:
    count = source.pass_size if count is None else count
    return [source[i]["prompt"] for i in range(start, start + count)]


# --- the arithmetic task ---


def test_arithmetic_answers_are_the_operations_results():
    for split in ("train", "heldout"):
        source = build_prompt_source(RL(), seed=5, split=split)
        for i in range(source.pass_size):
            sample = source[i]
            a, op, b = PROBLEM.fullmatch(sample["prompt"]).groups()
            a, b = int(a), int(b)
            assert 0 <= a < arithmetic.MAX_OPERAND and 0 <= b < arithmetic.MAX_OPERAND
            assert sample["answer"] == str(OPERATORS[op](a, b)) and int(sample["answer"]) >= 0


def test_the_stream_depends_on_seed_and_index_only():
    first, again = build_prompt_source(RL(), seed=1), build_prompt_source(RL(), seed=1)
    # Read out of order: a resumed stream starts anywhere.
    indices = [7000, 3, 5000, 0, 409, 410, 12]  # 410: the second pass's first
    assert [first[i] for i in indices] == [again[i] for i in reversed(indices)][::-1]
    assert prompts(first, 0, 50) == prompts(again, 0, 50)
    assert prompts(first, 0, 50) != prompts(build_prompt_source(RL(), seed=2), 0, 50)
    heldout = build_prompt_source(RL(), seed=1, split="heldout")
    assert prompts(heldout) == prompts(build_prompt_source(RL(), seed=1, split="heldout"))


def test_train_and_heldout_are_disjoint_fixed_and_cover_every_problem():
    train, heldout = build_prompt_source(RL(), seed=0), build_prompt_source(RL(), seed=0, split="heldout")
    assert heldout.pass_size == arithmetic.HELDOUT_SIZE == 200
    train_prompts, heldout_prompts = set(prompts(train)), set(prompts(heldout))
    assert len(train_prompts) == train.pass_size and len(heldout_prompts) == heldout.pass_size
    assert not train_prompts & heldout_prompts
    everything = {f"What is {a} {op} {b}?" for op in "+-" for a in range(arithmetic.MAX_OPERAND)
                  for b in range(arithmetic.MAX_OPERAND) if op == "+" or a >= b}
    assert train_prompts | heldout_prompts == everything
    # The held-out problems do not depend on the seed; only their order does.
    other = build_prompt_source(RL(), seed=9, split="heldout")
    assert set(prompts(other)) == heldout_prompts and prompts(other) != prompts(heldout)


def test_each_pass_visits_every_row_once_in_its_own_order():
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(23)]
    for seed in (0, 4):
        source = PromptSource(rows, seed, "rows")
        passes = [prompts(source, k * 23, 23) for k in range(3)]
        assert all(sorted(p) == sorted(r["prompt"] for r in rows) for p in passes)
        assert len({tuple(p) for p in passes}) == 3
    # Samples are copies: a caller may change one.
    source[0]["prompt"] = "changed"
    assert source[0]["prompt"] != "changed"
    one_line_error("negative", lambda: source[-1], IndexError)


def test_a_task_registered_from_outside_is_built():
    rows = [{"prompt": "hello", "target": "world"}]
    TASKS.register("test_greeting", lambda split, seed: PromptSource(rows, seed, f"greeting {split}"))
    try:
        assert config_problems(RL(prompts="test_greeting")) == []
        assert build_prompt_source(RL(prompts="test_greeting"), seed=0)[5] == rows[0]
    finally:
        TASKS._entries.pop("test_greeting")


# --- rl.prompts_path ---


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_rows_cycle_with_a_shuffled_order_per_pass(tmp_path):
    rows = [{"question": f"q{i}", "answer": i, "meta": {"id": i}} for i in range(11)]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    rl = RL(prompts_path=str(path), prompt_column="question")
    assert config_problems(rl) == []
    source = build_prompt_source(rl, seed=3)
    assert source.pass_size == 11
    passes = [[source[k * 11 + j] for j in range(11)] for k in range(3)]
    for samples in passes:
        # The prompt column is renamed; the others are kept as they are.
        assert sorted(s["meta"]["id"] for s in samples) == list(range(11))
        assert all(s == {"prompt": f"q{s['answer']}", "answer": s["answer"], "meta": {"id": s["answer"]}}
                   for s in samples)
    assert len({tuple(s["answer"] for s in samples) for samples in passes}) == 3
    again = build_prompt_source(rl, seed=3)
    assert [again[i] for i in range(33)] == [s for samples in passes for s in samples]


def test_a_folder_of_files_and_saved_datasets_are_read_offline(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = {"prompt": [f"p{i}" for i in range(6)], "answer": [str(i) for i in range(6)]}
    datasets.Dataset.from_dict(table).to_parquet(str(tmp_path / "parquet" / "part-0.parquet"))
    write_jsonl(tmp_path / "parquet" / "part-1.jsonl", [{"prompt": "p6", "answer": "6"}])
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "saved"))
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(table),
                                   "test": datasets.Dataset.from_dict({"prompt": ["t0", "t1"], "answer": ["0", "1"]})})
    splits.save_to_disk(str(tmp_path / "saved_splits"))

    folder = build_prompt_source(RL(prompts_path=str(tmp_path / "parquet")), seed=0)
    assert sorted(prompts(folder)) == [f"p{i}" for i in range(7)]
    for name in ("saved", "saved_splits"):
        rl = RL(prompts_path=str(tmp_path / name))
        assert config_problems(rl) == []
        source = build_prompt_source(rl, seed=1)
        assert sorted(prompts(source)) == table["prompt"]
        assert all(source[i]["answer"] == source[i]["prompt"][1:] for i in range(12))
    heldout = build_prompt_source(RL(prompts_path=str(tmp_path / "saved_splits")), seed=1, split="heldout")
    assert sorted(prompts(heldout)) == ["t0", "t1"]


def test_bad_prompt_files_fail_with_one_line_naming_file_row_and_column(tmp_path):
    good = {"prompt": "What?", "answer": "1"}
    missing = write_jsonl(tmp_path / "missing.jsonl", [good, good, {"answer": "2"}])
    one_line_error(r"missing.jsonl: row 2 has no value in column 'prompt'",
                   lambda: build_prompt_source(RL(prompts_path=str(missing)), seed=0))
    one_line_error(r"missing.jsonl: row 0 has no column 'question' .*set rl.prompt_column",
                   lambda: build_prompt_source(RL(prompts_path=str(missing), prompt_column="question"), seed=0))
    number = write_jsonl(tmp_path / "number.jsonl", [good, {"prompt": 5, "answer": "5"}])
    one_line_error(r"number.jsonl: row 1: column 'prompt' holds int 5, not text",
                   lambda: build_prompt_source(RL(prompts_path=str(number)), seed=0))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(good) + "\n{not json\n")
    one_line_error(r"broken.jsonl: row 1", lambda: build_prompt_source(RL(prompts_path=str(broken)), seed=0))
    both = write_jsonl(tmp_path / "both.jsonl", [{"question": "q", "prompt": "p"}])
    one_line_error(r"both.jsonl: row 0: has a column 'prompt' besides rl.prompt_column = 'question'",
                   lambda: build_prompt_source(RL(prompts_path=str(both), prompt_column="question"), seed=0)[0])
    one_line_error(r"good.jsonl' is one set of rows with no held-out split",
                   lambda: build_prompt_source(RL(prompts_path=str(write_jsonl(tmp_path / "good.jsonl", [good]))),
                                               seed=0, split="heldout"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    one_line_error(r"no rows|empty", lambda: build_prompt_source(RL(prompts_path=str(empty)), seed=0))


def test_bad_saved_datasets_and_hub_names_fail_with_one_line(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "saved"))
    one_line_error(r"saved' has no column 'prompt' \(columns: text\); set rl.prompt_column",
                   lambda: build_prompt_source(RL(prompts_path=str(tmp_path / "saved")), seed=0))
    one_line_error(r"saved' is one set of rows with no held-out split",
                   lambda: build_prompt_source(RL(prompts_path=str(tmp_path / "saved"), prompt_column="text"),
                                               seed=0, split="heldout"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    one_line_error(r"dd' has no 'test' or 'validation' split for the heldout prompts; its splits: train",
                   lambda: build_prompt_source(RL(prompts_path=str(tmp_path / "dd")), seed=0, split="heldout"))
    # The tests run offline (conftest): a hub name fails at once.
    one_line_error(r"rl.prompts_path 'nobody-here/no-such-prompts' is no local file or folder, and as a hub dataset "
                   r"it cannot be opened: ", lambda: build_prompt_source(RL(prompts_path="nobody-here/no-such-prompts"),
                                                                         seed=0))


def test_config_problems_name_the_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert config_problems(RL()) == config_problems(RL(prompts_path=str(path))) == []
    assert config_problems(RL(prompts_path="owner/dataset")) == []  # a hub name: opened when the prompts are built
    [(field, reason)] = config_problems(RL(prompts="sudoku"))
    assert field == "prompts" and "registered: arithmetic" in reason
    for missing in (str(tmp_path / "nope.jsonl"), str(tmp_path / "folder"), "./prompts", "data/prompts.parquet"):
        [(field, reason)] = config_problems(RL(prompts_path=missing))
        assert field == "prompts_path" and reason.startswith("does not exist"), missing
    # rl.prompts is not judged when the path replaces it.
    assert config_problems(RL(prompts="sudoku", prompts_path=str(path))) == []
    assert config_problems(RL(prompts_path=str(path), prompt_column="")) == [
        ("prompt_column", "is empty; name the column of rl.prompts_path rows that holds the prompt")]
    [(field, reason)] = config_problems(RL(prompts_path="nosuchprotocol://bucket/prompts.jsonl"))
    assert field == "prompts_path"
    one_line_error("names no registered prompt task; registered: arithmetic",
                   lambda: build_prompt_source(RL(prompts="sudoku"), seed=0))


# --- arithmetic_chat: the same problems, for supervised fine-tuning before GRPO ---


def test_arithmetic_chat_holds_the_problems_as_conversations():
    assert DATASET_FORMATS["arithmetic_chat"] == "chat"
    tokenizer = build_tokenizer(str(TOKENIZER))
    template = ChatTemplate(tokenizer.chat_template)
    for split, task_split in (("train", "train"), ("validation", "heldout")):
        conversations = list(load_documents("arithmetic_chat", None, split, "messages", "chat"))
        task = build_prompt_source(RL(), seed=0, split=task_split)
        assert len(conversations) == task.pass_size
        assert {(c[0]["content"], c[1]["content"]) for c in conversations} == {
            (task[i]["prompt"], task[i]["answer"]) for i in range(task.pass_size)}
        for messages in conversations[:5]:
            assert [m["role"] for m in messages] == ["user", "assistant"]
            _, labels = encode_conversation(tokenizer, template, messages)
            trained = tokenizer.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
            assert trained == messages[1]["content"] + "<|end_of_text|>"
    # Not all of one operator first: the training conversations are shuffled once.
    first = [c[0]["content"] for c in load_documents("arithmetic_chat", None, "train", "messages", "chat")[:20]]
    assert {"+", "-"} <= {PROBLEM.fullmatch(p).group(2) for p in first}
    one_line_error("unknown arithmetic_chat split 'test'", lambda: load_documents("arithmetic_chat", None, "test",
                                                                                  "messages", "chat"))
