"""The package's modules import each other without cycles (deferred imports inside functions count too)."""

import ast
from pathlib import Path

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
                "torchtitan.hardware", "torchtitan.stop_signals", "torchtitan.config_fields")),
    ("data", ("torchtitan.data",)),
    ("config schema", ("torchtitan.config",)),
    ("protocols", ("torchtitan.protocols",)),
    ("models", ("torchtitan.models",)),
    ("distributed", ("torchtitan.distributed",)),
    ("components", ("torchtitan.components",)),
    # What users run: the trainer, the planner, the config pre-check (and `python -m torchtitan.config`, its
    # command, which lives in the schema's package), inference, evaluation, generation, the scripts' --device
    # helper, and the package root (torchtitan.load_model, deferred, so importing a module pulls in nothing).
    ("entry points", ("torchtitan", "torchtitan.train", "torchtitan.planner", "torchtitan.config_check",
                      "torchtitan.config.__main__", "torchtitan.inference", "torchtitan.evaluation",
                      "torchtitan.generation", "torchtitan.device_arg")),
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
