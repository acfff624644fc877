"""Named extension points (model families, model converters, datasets), each one a ``Registry``.

Built-in entries register themselves from their own modules. A registry knows those modules by name
and imports them on its first lookup, so it depends on none of them: a custom entry registered from
``experimental.custom_import`` sits beside the built-ins, and no import cycle runs through a registry.
"""

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, builtin_modules: tuple[str, ...] = (), replace: bool = False):
        """``kind`` names an entry in messages ("model", "model converter", "dataset"); ``builtin_modules``
        register the built-in entries when imported; ``replace`` lets a name be registered again."""
        self.kind = kind
        self._builtin_modules = builtin_modules
        self._replace = replace
        self._entries: dict[str, T] = {}
        self._builtins_loaded = not builtin_modules

    def register(self, name: str, entry: T) -> None:
        if name in self._entries and not self._replace:
            raise ValueError(f"a {self.kind} named '{name}' is already registered")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        """The entry registered as ``name``; KeyError naming the registered ones otherwise."""
        if name not in self:
            raise KeyError(f"no {self.kind} named '{name}'; registered: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return name in self._entries

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True  # before importing: the modules call register() on this registry
        try:
            for module in self._builtin_modules:
                importlib.import_module(module)
        except BaseException:
            self._builtins_loaded = False
            raise
