"""pyproject.toml's Python floor covers the standard library the code imports."""

import ast
import re
import tomllib

from tests.conftest import REPO

# Standard-library modules and names added after Python 3.10, with the version that added them.
ADDED_AFTER_3_10 = {"tomllib": (3, 11), "typing.Self": (3, 11)}


def imported_names(*folders: str) -> set[str]:
    """Every module imported, and every ``module.name`` imported from one, under ``folders``."""
    names = set()
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_requires_python_covers_the_standard_library_used_and_no_backport_is_left_below_it():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floor = tuple(map(int, re.fullmatch(r">=\s*(\d+)\.(\d+)", project["requires-python"]).groups()))
    used = {name: version for name, version in ADDED_AFTER_3_10.items()
            if name in imported_names("torchtitan", "scripts")}
    assert "tomllib" in used  # the config loader reads TOML with it
    assert all(floor >= version for version in used.values()), (project["requires-python"], used)
    # A dependency only for Pythons below the floor (e.g. the tomli backport) can never be installed.
    for dep in project["dependencies"]:
        below = re.search(r"python_version\s*<\s*['\"](\d+)\.(\d+)['\"]", dep)
        assert not below or tuple(map(int, below.groups())) > floor, dep
