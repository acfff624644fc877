"""The package's modules import each other without cycles (deferred imports inside functions count too), run
down the floors, and sit in the rooms README's Layout table names."""

import ast
import importlib
from pathlib import Path

import pytest

import torchtitan

PACKAGE = Path(torchtitan.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the torchtitan modules it imports}. ``from pkg import sub`` depends on pkg.sub when sub is a
    module, and on pkg too: Python runs pkg/__init__ first (except for a module inside pkg, whose package is
    already being imported: a package importing its own submodules is no cycle)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                deps.update(submodules if len(submodules) == len(node.names) else [base, *submodules])
        # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless the importer lives inside them.
        parents = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)}
        deps |= {p for p in parents if not (name == p or name.startswith(p + "."))}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "torchtitan.protocols.train_spec" in graph["torchtitan.models.llama3"]  # it sees real edges


# The package's floors, bottom to top: a module imports only from its own floor or the floors below it.
# A module belongs to the floor of the longest prefix that names it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("torchtitan.log", "torchtitan.cache", "torchtitan.registry", "torchtitan.remote",
                "torchtitan.hardware", "torchtitan.stop_signals", "torchtitan.config_fields",
                "torchtitan.output_folder")),
    ("data", ("torchtitan.data",)),
    ("config schema", ("torchtitan.config",)),
    ("protocols", ("torchtitan.protocols",)),
    ("models", ("torchtitan.models",)),
    ("distributed", ("torchtitan.distributed",)),
    # The generation engine sits beside the components: the lm-eval adapter and the RL objective run on it; so do
    # reinforcement learning's prompts, rewards and rollouts.
    ("components", ("torchtitan.components", "torchtitan.generation", "torchtitan.rl")),
    # What users run: the trainer, the planner, the config pre-check (and `python -m torchtitan.config`, its
    # command, which lives in the schema's package), inference, evaluation, the scripts' argument
    # helpers (--device; numbers and one-line errors), the run report (scripts/report.py's reading, plots and page),
    # and the package root (torchtitan.load_model, deferred, so importing a module pulls in nothing).
    ("entry points", ("torchtitan", "torchtitan.train", "torchtitan.planner", "torchtitan.config_check",
                      "torchtitan.config.__main__", "torchtitan.inference", "torchtitan.evaluation",
                      "torchtitan.device_arg", "torchtitan.script_args", "torchtitan.report")),
]
# (importer, imported) pairs allowed to run up the floors, each with its reason. None today.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def floor_of(module: str) -> int:
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor: add it to FLOORS"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} ({FLOORS[floor_of(module)][0]}) imports {dep} ({FLOORS[floor_of(dep)][0]})"
            for module, deps in sorted(graph.items()) for dep in sorted(deps)
            if floor_of(dep) > floor_of(module) and (module, dep) not in UPWARD_EXCEPTIONS]


def test_imports_run_down_the_floors():
    assert upward_imports(import_graph()) == []


def test_models_import_neither_distributed_nor_components():
    graph = import_graph()
    assert [(m, d) for m, deps in graph.items() if m.startswith("torchtitan.models") for d in deps
            if d.startswith(("torchtitan.distributed", "torchtitan.components"))] == []


def test_an_upward_import_is_named():
    graph = {"torchtitan.models.shared.moe": {"torchtitan.distributed.collectives", "torchtitan.log"}}
    assert upward_imports(graph) == ["torchtitan.models.shared.moe (models) imports torchtitan.distributed.collectives "
                                     "(distributed)"]


# The rooms inside a floor: each (package, its subpackages by idea, the modules that stay single). A new module of
# components/ or models/ goes into a room or is named here, so neither grows back into one flat folder.
ROOMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "torchtitan.components": (
        ("checkpointing", "optimizers", "objectives", "evaluation", "metrics", "lora", "observability"),
        ("expert_load", "fault_tolerance", "float8", "preemption", "step_guard"),
    ),
    "torchtitan.models": (
        ("shared", "llama3", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_next", "gpt_oss", "qwen3_vl",
         "qwen3_5", "kimi_linear"),
        (),
    ),
}
# Import paths docs/extending.md, examples/ and tests/z_loss_objective.py gave before their modules moved into rooms:
# each is the moved module itself under its old name.
OLD_IMPORT_PATHS = {
    "torchtitan.models.decoder_args": "torchtitan.models.shared.decoder_args",
    "torchtitan.models.decoder_spec": "torchtitan.models.shared.decoder_spec",
    "torchtitan.models.decoder": "torchtitan.models.shared.decoder",
    "torchtitan.models.moe": "torchtitan.models.shared.moe",
    "torchtitan.models.decoder_state_dict_adapter": "torchtitan.models.shared.decoder_state_dict_adapter",
    "torchtitan.models.seeded_init": "torchtitan.models.shared.seeded_init",
    "torchtitan.models.attention": "torchtitan.models.shared.attention",
    "torchtitan.components.objective": "torchtitan.components.objectives.objective",
}


def rooms_problems(modules: list[str]) -> list[str]:
    problems = []
    for package, (rooms, singles) in ROOMS.items():
        for module in modules:
            if not module.startswith(package + "."):
                continue
            first = module[len(package) + 1:].split(".")[0]
            if first not in rooms + singles and module not in OLD_IMPORT_PATHS:
                problems.append(f"{module} is in no room of {package}: move it into one of {rooms} or name it "
                                "as a single")
    return problems


def test_every_component_and_model_module_sits_in_a_room():
    graph = import_graph()
    assert rooms_problems(sorted(graph)) == []
    for package, (rooms, singles) in ROOMS.items():
        for name in rooms + singles:  # each room and single exists
            assert any(m == f"{package}.{name}" for m in graph), f"{package}.{name}"


def test_a_module_outside_the_rooms_is_named():
    assert rooms_problems(["torchtitan.components.grab_bag", "torchtitan.components.metrics.logger"]) == [
        "torchtitan.components.grab_bag is in no room of torchtitan.components: move it into one of ('checkpointing', "
        "'optimizers', 'objectives', 'evaluation', 'metrics', 'lora', 'observability') or name it as a single"]


@pytest.mark.parametrize("old", sorted(OLD_IMPORT_PATHS))
def test_the_documented_import_paths_still_import_the_moved_modules(old):
    moved = importlib.import_module(OLD_IMPORT_PATHS[old])
    assert importlib.import_module(old) is moved
    # ``from old import name`` gives the moved module's object (one class, not a copy).
    public = [name for name in vars(moved) if not name.startswith("_")]
    assert public and all(getattr(importlib.import_module(old), name) is getattr(moved, name) for name in public)
