"""Config fields: a dataclass field with its default and the one-line doc that --help shows.

A leaf, so that a section can live beside the code it configures (data/config.py) and the schema
(config/job_config.py) composes them.
"""

from dataclasses import field, fields
from typing import Any


def option(default: Any, doc: str) -> Any:
    """A config field with a default and the one-line doc shown by --help."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def section(cls: type, doc: str) -> Any:
    """A nested config section (a dataclass) with its doc."""
    return field(default_factory=cls, metadata={"doc": doc})


def changed_fields(section: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Names of the fields of a section's dataclass that differ from their defaults, in declaration order: what a
    user set (a resolved config.toml lists every field, most at their defaults)."""
    default = type(section)()
    return [f.name for f in fields(section) if f.name not in skip and getattr(section, f.name) != getattr(default, f.name)]
