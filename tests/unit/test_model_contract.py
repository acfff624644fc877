"""The model-args contract and the MoE layer's typed calls, checked on the source: code outside a family's
folder reads model args through typed fields (no getattr probing), and nothing outside models/ assigns to a MoE
layer's attributes after it is built (MoE.configure, MoE.parallelize, take_stats, move_bias instead)."""

import ast
from pathlib import Path

import torch

import torchtitan
from torchtitan.models.shared.moe import MoE, MoEArgs

PACKAGE = Path(torchtitan.__file__).parent
MODELS = PACKAGE / "models"


def _sources(outside_families: bool):
    for path in sorted(PACKAGE.rglob("*.py")):
        in_family = path.parent != MODELS and MODELS in path.parents
        in_models = MODELS in path.parents
        if (outside_families and in_family) or (not outside_families and in_models):
            continue
        yield path, ast.parse(path.read_text())


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def getattr_on_model_args() -> list[str]:
    hits = []
    for path, tree in _sources(outside_families=True):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and _name(node.func) in ("getattr", "hasattr") and node.args
                    and (_name(node.args[0]).endswith("args") or _name(node.args[0]) == "flavor")):
                hits.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return hits


def moe_attribute_assignments() -> list[str]:
    with torch.device("meta"):
        moe = MoE(8, MoEArgs(num_experts=4, top_k=1, hidden_dim=8))
    names = set(vars(moe)) - {"training"} | set(moe._buffers) | set(moe._modules) | {"path"}
    names = {n for n in names if not n.startswith("_")}
    hits = []
    for path, tree in _sources(outside_families=False):
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else []
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr in names
                        and "moe" in ast.unparse(target.value).lower()):
                    hits.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(target)}")
    return hits


def test_no_getattr_probing_of_model_args_outside_the_families():
    assert getattr_on_model_args() == []


def test_nothing_outside_models_assigns_to_a_moe_layer():
    assert moe_attribute_assignments() == []


def test_the_checks_find_what_they_look_for(tmp_path, monkeypatch):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(model_args, moe):\n    getattr(model_args, 'moe', None)\n    moe.aux_loss_sum = 0\n"
                     "    moe.experts.path = 'loop'\n")
    monkeypatch.setattr(f"{__name__}._sources",
                        lambda outside_families: [(PACKAGE / "probe.py", ast.parse(probe.read_text()))])
    assert getattr_on_model_args() == ["probe.py:2"]
    assert moe_attribute_assignments() == ["probe.py:3: moe.aux_loss_sum", "probe.py:4: moe.experts.path"]
