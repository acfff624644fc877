"""The pydocs_mc task's questions: from each documented function of the held-out pydocs split, the first paragraph
of its docstring and four dotted names (its own and three drawn from the others with a fixed seed)."""

import random
import re

QUESTIONS = 200
_DEF = re.compile(r"^def ([\w.]+)\(.*\)\n((?:.+\n?)+)", re.MULTILINE)


def questions() -> list[dict]:
    from torchtitan.data.pydocs import load_pydocs_documents

    found: dict[str, str] = {}
    for document in load_pydocs_documents("validation"):
        for match in _DEF.finditer(document):
            name, paragraph = match.group(1), " ".join(match.group(2).split())
            if name.split(".")[-1].startswith("_") or len(paragraph) < 40:
                continue
            found.setdefault(name, paragraph[:300])
    names = sorted(found)
    rng = random.Random(0)
    chosen = rng.sample(names, min(QUESTIONS, len(names)))
    rows = []
    for name in chosen:
        choices = [name, *rng.sample([other for other in names if other != name], 3)]
        rng.shuffle(choices)
        rows.append({"docstring": found[name], "choices": choices, "answer": choices.index(name)})
    return rows


def load(**kwargs):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(questions())})
