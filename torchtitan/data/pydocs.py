"""The "pydocs" corpus: English technical prose that every Python installation carries.

Documents come from two sources, both read as plain text (no stdlib module is imported):

* the pydoc help topics in ``pydoc_data.topics`` (one document per topic), and
* the docstrings of the standard library's ``.py`` files, parsed with ``ast``
  (one document per module: the module docstring followed by the docstrings of
  its classes, functions and methods, each under a ``class``/``def`` header line).

The corpus is deterministic for a given Python and is cached as JSON lines under
``$TORCHTITAN_CACHE_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/torchtitan/pydocs``.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import sys
import sysconfig
import tempfile
import warnings

from torchtitan.cache import cache_dir
from torchtitan.data.errors import DataError

# Bump whenever the document extraction changes, so stale caches are not reused.
FORMAT_VERSION = 1

SPLITS = ("train", "validation")

# Every VALIDATION_EVERY-th document (by index) is held out for validation.
VALIDATION_EVERY = 50

# Shorter documents are mostly one-line stubs that add little but document boundaries.
MIN_DOC_CHARS = 200

# Directories that hold tests, third-party code or legacy tools rather than documented library code.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def _cache_dir() -> pathlib.Path:
    return cache_dir() / "pydocs"


def _topic_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def _definition_sections(body: list[ast.stmt], prefix: str) -> list[str]:
    sections = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            header = f"class {prefix}{node.name}"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            header = f"def {prefix}{node.name}({ast.unparse(node.args)})"
        else:
            continue
        doc = ast.get_docstring(node)
        if doc:
            sections.append(f"{header}\n{doc}")
        sections.extend(_definition_sections(node.body, f"{prefix}{node.name}."))
    return sections


def _module_document(path: pathlib.Path, module_name: str) -> str | None:
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            # Old escape sequences in stdlib sources warn on parse; they are irrelevant here.
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    sections = [f"Module {module_name}"]
    module_doc = ast.get_docstring(tree)
    if module_doc:
        sections.append(module_doc)
    sections.extend(_definition_sections(tree.body, f"{module_name}."))
    return "\n\n".join(sections)


def _stdlib_source_files(root: pathlib.Path) -> list[pathlib.Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files.extend(pathlib.Path(dirpath) / f for f in filenames if f.endswith(".py"))
    # Sorting the relative paths (not walk order) keeps the corpus independent of the filesystem.
    return sorted(files, key=lambda p: p.relative_to(root).parts)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def build_pydocs_documents() -> list[str]:
    """Extract all pydocs documents (both splits, in corpus order) from this Python."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    documents = _topic_documents()
    for path in _stdlib_source_files(root):
        doc = _module_document(path, _module_name(path, root))
        if doc is not None:
            documents.append(doc)
    return [doc for doc in documents if len(doc) >= MIN_DOC_CHARS]


def _write_atomically(path: pathlib.Path, documents: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build at once: each writes a private temp file and renames it,
    # so readers only ever see a missing file or a complete one.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for doc in documents:
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file private to this user; the cache may be shared.
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        pathlib.Path(tmp_name).unlink(missing_ok=True)
        raise


def pydocs_corpus_path() -> pathlib.Path:
    """Return the path of the cached corpus file, building it first if missing."""
    version = f"{sys.implementation.name}{'.'.join(map(str, sys.version_info[:3]))}"
    path = _cache_dir() / f"pydocs-{version}-v{FORMAT_VERSION}.jsonl"
    if not path.exists():
        _write_atomically(path, build_pydocs_documents())
    return path


def load_pydocs_documents(split: str = "train") -> list[str]:
    """Return the documents of one split ("train" or "validation") of the pydocs corpus."""
    if split not in SPLITS:
        raise DataError(f"unknown pydocs split {split!r}; valid splits are {list(SPLITS)}")
    with pydocs_corpus_path().open(encoding="utf-8") as f:
        documents = [json.loads(line)["text"] for line in f]
    held_out = split == "validation"
    return [doc for i, doc in enumerate(documents) if (i % VALIDATION_EVERY == 0) == held_out]
