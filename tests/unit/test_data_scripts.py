"""scripts/train_tokenizer.py and scripts/download_hf_assets.py (offline: arguments and errors only)."""

import base64
import json
import sys

import pytest

from tests.conftest import REPO, run_command
from torchtitan.data import build_tokenizer, load_pydocs_documents

sys.path.insert(0, str(REPO / "scripts"))
import download_hf_assets  # noqa: E402
import train_tokenizer  # noqa: E402


def test_train_tokenizer_writes_two_formats_that_agree(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = load_pydocs_documents("validation")
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_tokenizer.main(["--vocab-size", "400", "--output-dir", str(tmp_path / "tok"), "--input", str(corpus)])
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    fast, hf = (build_tokenizer(str(tmp_path / "tok"), name) for name in ("tokenizer.model", "tokenizer.json"))
    for tok in (fast, hf):
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (400, 0, 1, 2)
    texts = docs + ["ünïcödé 数据 🙂 <|pad|>", ""]
    assert fast.encode_batch(texts) == hf.encode_batch(texts)
    assert [fast.decode(ids) for ids in fast.encode_batch(texts)] == texts
    with pytest.raises(ValueError, match="--vocab-size 100 is too small: it must be at least 259"):
        train_tokenizer.train_ranks(docs, 100)


def test_the_shipped_tokenizer_is_what_the_script_writes(tmp_path):
    # Rebuilding tokenizer.json from the shipped ranks reproduces the shipped tokenizer.json.
    ranks = {}
    for line in (REPO / "assets" / "tokenizer" / "tokenizer.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    train_tokenizer.save(ranks, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        assert (tmp_path / name).read_bytes() == (REPO / "assets" / "tokenizer" / name).read_bytes(), name


def test_download_hf_assets_arguments(capsys):
    args = download_hf_assets.parse_args(["meta-llama/Meta-Llama-3.1-8B", "--assets", "tokenizer", "config"])
    assert args.assets == ["tokenizer", "config"] and str(args.local_dir) == "assets/hf/Meta-Llama-3.1-8B"
    for bad in (["no-owner"], ["a/b", "--assets", "weights"], []):
        with pytest.raises(SystemExit) as exit_info:
            download_hf_assets.parse_args(bad)
        assert exit_info.value.code == 2
    assert "repo_id 'no-owner' is invalid; expected 'owner/name'" in capsys.readouterr().err


def test_download_hf_assets_fails_with_one_line_offline(tmp_path):
    result = run_command([sys.executable, "scripts/download_hf_assets.py", "meta-llama/Meta-Llama-3.1-8B",
                          "--local-dir", str(tmp_path / "llama")], env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: cannot download tokenizer of 'meta-llama/Meta-Llama-3.1-8B' from the Hugging Face hub: "), lines
    assert "Traceback" not in result.stderr
