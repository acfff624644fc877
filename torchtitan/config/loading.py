"""Build a JobConfig from defaults, a TOML file (with ``extends``) and command-line flags.

Precedence is CLI > TOML > defaults. Every problem becomes a ``ConfigError`` whose message is
one line naming where the value came from, the key, the value and what would be valid.

We parse flags ourselves rather than with argparse/tyro: both print multi-line usage blocks on
error and neither layers a TOML file (with ``extends``) under the flags.
"""

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w

from torchtitan.config.job_config import JobConfig

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


class ConfigError(Exception):
    """A bad config file, flag or value; the message is one line meant for the user."""


class ConfigSources(dict):
    """Maps a dotted key ("training.steps") to where its value came from."""

    def describe(self, key: str) -> str:
        return self.get(key, "default")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def takes_bool(tp: Any) -> bool:
    """Whether a field is set by a bare flag (--a.flag, --a.no_flag): a bool, or a choice among true, false and
    words (e.g. "auto" | true | false)."""
    return tp is bool or typing.get_origin(tp) is Literal and any(isinstance(c, bool) for c in typing.get_args(tp))


def _choice_name(choice: Any) -> str:
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def _strip_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0]


def type_name(tp: Any) -> str:
    """How a field's type reads in --help and in error messages."""
    if _is_optional(tp):
        return f"{type_name(_strip_optional(tp))} or none"
    if typing.get_origin(tp) is Literal:
        return "one of " + "|".join(_choice_name(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            keys = ", ".join(f.name for f in dataclasses.fields(item))
            return f"TOML array of tables ([[...]]), each with keys {keys}"
        return f"list of {type_name(item)} (comma-separated)"
    return {bool: "true|false", int: "an integer", float: "a number", str: "a string"}[tp]


def coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    """Convert a TOML value (or a CLI string when from_cli) to type tp; ValueError if impossible."""
    if _is_optional(tp):
        if value is None or (from_cli and str(value).lower() in _NONE):
            return None
        return coerce(value, _strip_optional(tp), from_cli)
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if from_cli and takes_bool(tp) and str(value).lower() in _TRUE + _FALSE:
            value = str(value).lower() in _TRUE
        # By type too: TOML's 1 equals true in Python, but is not the choice true.
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ValueError
        return value
    if dataclasses.is_dataclass(tp):
        # An entry of a TOML array of tables: every key must be a field, each value of its field's type.
        hints = _hints(tp)
        if from_cli or not isinstance(value, dict):
            raise ValueError("not a table")
        fields = {}
        for key, item in value.items():
            if key not in hints:
                raise ValueError(f"unknown key {key!r}; valid: {', '.join(hints)}")
            try:
                fields[key] = coerce(item, hints[key], False)
            except ValueError:
                raise ValueError(f"{key} = {item!r} is invalid; expected {type_name(hints[key])}") from None
        return tp(**fields)
    if origin is list:
        item_type = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item_type):
            if from_cli:
                raise ValueError("tables are set in the TOML file, not on the command line")
            if not isinstance(value, list):
                raise ValueError
            items = []
            for index, item in enumerate(value):
                try:
                    items.append(coerce(item, item_type, False))
                except ValueError as e:
                    raise ValueError(f"entry {index}: {e}") from None
            return items
        if from_cli:
            # A list of lists on the command line: ';' between the outer items, ',' inside them.
            nested = typing.get_origin(typing.get_args(tp)[0]) is list
            value = [v.strip() for v in value.split(";" if nested else ",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError
        return [coerce(v, typing.get_args(tp)[0], from_cli) for v in value]
    if tp is bool:
        if from_cli and str(value).lower() in _TRUE + _FALSE:
            return str(value).lower() in _TRUE
        if isinstance(value, bool):
            return value
        raise ValueError
    if tp is int:
        if from_cli:
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError
    if tp is float:
        if from_cli:
            return float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    raise TypeError(f"unsupported config field type {tp}")


def _resolve(cfg: JobConfig, dotted: str) -> tuple[Any, str, Any]:
    """(owning section object, field name, field type) for a dotted key; KeyError if unknown."""
    *path, name = dotted.split(".")
    obj = cfg
    for part in path:
        if part not in _hints(type(obj)) or not dataclasses.is_dataclass(_hints(type(obj))[part]):
            raise KeyError(part)
        obj = getattr(obj, part)
    hints = _hints(type(obj))
    if name not in hints or dataclasses.is_dataclass(hints[name]):
        raise KeyError(name)
    return obj, name, hints[name]


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in _hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += _valid_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _set(cfg: JobConfig, dotted: str, value: Any, source: str, sources: ConfigSources, from_cli: bool) -> None:
    try:
        obj, name, tp = _resolve(cfg, dotted)
    except KeyError:
        section = dotted.rsplit(".", 1)[0] if "." in dotted else ""
        nearby = [k for k in _valid_keys(JobConfig) if section and k.startswith(section + ".")]
        hint = f"valid keys in [{section}]: {', '.join(nearby)}" if nearby else (
            "valid sections: " + ", ".join(_hints(JobConfig)))
        raise ConfigError(f"{source}: unknown key '{dotted}'; {hint}") from None
    try:
        setattr(obj, name, coerce(value, tp, from_cli))
    except ValueError as e:
        detail = f" ({e})" if str(e) else ""
        raise ConfigError(f"{source}: {dotted} = {value!r} is invalid{detail}; expected {type_name(tp)}") from None
    sources[dotted] = source


def _apply_table(cfg: JobConfig, table: dict, prefix: str, source: str, sources: ConfigSources) -> None:
    for key, value in table.items():
        dotted = prefix + key
        if isinstance(value, dict):
            _apply_table(cfg, value, dotted + ".", source, sources)
        elif not prefix:
            raise ConfigError(
                f"{source}: top-level key '{key}' must be a [section]; valid sections: " + ", ".join(_hints(JobConfig))
            )
        else:
            _set(cfg, dotted, value, source, sources, from_cli=False)


def read_toml_chain(path: str | Path, flag: str = "--job.config_file") -> list[tuple[Path, dict]]:
    """The file and the files it ``extends``, base first; each ``extends`` is relative to its file."""
    chain: list[tuple[Path, dict]] = []
    seen: set[Path] = set()
    current, named_by = Path(path), flag
    while True:
        if not current.is_file():
            raise ConfigError(f"{named_by}: config file '{current}' does not exist")
        resolved = current.resolve()
        if resolved in seen:
            raise ConfigError(f"{current}: extends forms a cycle through '{resolved}'")
        seen.add(resolved)
        try:
            data = tomllib.loads(current.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{current}: not valid TOML: {e}") from None
        base = data.pop("extends", None)
        chain.append((current, data))
        if base is None:
            return chain[::-1]
        if not isinstance(base, str):
            raise ConfigError(f"{current}: extends = {base!r} is invalid; expected a file name string")
        current, named_by = current.parent / base, f"{current}: extends"


def split_cli(argv: list[str]) -> list[tuple[str, str | bool]]:
    """Turn ['--a.b', 'v', '--a.c=w', '--a.flag', '--a.no_other'] into (key, raw value) pairs.

    A bare flag becomes True; whether it names a bool (or a ``no_`` negation) is decided later,
    when the key is resolved against the config.
    """
    pairs: list[tuple[str, str | bool]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"command line: unexpected argument {arg!r}; options look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((key, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 1
        else:
            pairs.append((key, True))
        i += 1
    return pairs


def _apply_cli(cfg: JobConfig, pairs: list[tuple[str, str | bool]], sources: ConfigSources) -> None:
    for key, value in pairs:
        source = f"command line --{key}"
        leaf = key.rsplit(".", 1)[-1]
        try:
            _, _, tp = _resolve(cfg, key)
        except KeyError:
            negated = key[: len(key) - len(leaf)] + leaf[3:] if leaf.startswith("no_") else None
            if negated and value is True:
                try:
                    if takes_bool(_resolve(cfg, negated)[2]):
                        _set(cfg, negated, False, source, sources, from_cli=False)
                        continue
                except KeyError:
                    pass
            _set(cfg, key, value, source, sources, from_cli=True)  # raises the unknown-key error
            continue
        if value is True and not takes_bool(tp):
            raise ConfigError(f"{source}: missing value; expected {type_name(tp)}")
        _set(cfg, key, value, source, sources, from_cli=value is not True)


def load_config(argv: list[str]) -> tuple[JobConfig, ConfigSources]:
    """Defaults, then the TOML chain named by --job.config_file, then the other flags."""
    pairs = split_cli(argv)
    cfg, sources = JobConfig(), ConfigSources()
    config_files = [v for k, v in pairs if k == "job.config_file"]
    if config_files:
        path = config_files[-1]
        if path is True:
            raise ConfigError("command line --job.config_file: missing value; expected a TOML file path")
        for file, table in read_toml_chain(path):
            _apply_table(cfg, table, "", str(file), sources)
    _apply_cli(cfg, pairs, sources)
    return cfg, sources


def config_to_dict(obj: Any) -> dict:
    """The config as nested plain dicts, leaving out None (TOML has no null)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = config_to_dict(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            out[f.name] = [config_to_dict(item) for item in value]
        elif value is not None:
            out[f.name] = value
    return out


def config_to_toml(cfg: JobConfig) -> str:
    return tomli_w.dumps(config_to_dict(cfg))


def format_help(prog: str = "python -m torchtitan.train") -> str:
    """Every field with its type, default and one-line doc, grouped by section."""
    lines = [
        f"usage: {prog} [--job.config_file FILE.toml] [--section.field VALUE ...]",
        "",
        "Values: --a.b v or --a.b=v; booleans --a.flag / --a.no_flag; lists comma-separated.",
        "Precedence: command line > TOML file (which may 'extends' a base file) > defaults.",
    ]

    def walk(cls: type, prefix: str, doc: str) -> None:
        lines.extend(["", f"[{prefix.rstrip('.')}] {doc}"])
        defaults = cls()
        nested = []
        for f in dataclasses.fields(cls):
            tp = _hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((tp, f"{prefix}{f.name}.", f.metadata["doc"]))
                continue
            flag = f"--{prefix}{f.name}"
            if tp is bool:
                flag += f" / --{prefix}no_{f.name}"
            elif takes_bool(tp):
                flag += f" ({type_name(tp)}) / --{prefix}{f.name} / --{prefix}no_{f.name}"
            else:
                flag += f" ({type_name(tp)})"
            lines.append(f"  {flag}")
            lines.append(f"      {f.metadata['doc']} [default: {getattr(defaults, f.name)!r}]")
        for args in nested:
            walk(*args)

    for f in dataclasses.fields(JobConfig):
        walk(_hints(JobConfig)[f.name], f.name + ".", f.metadata["doc"])
    return "\n".join(lines)


def save_resolved_config(cfg: JobConfig) -> Path:
    """Write the resolved config to {job.dump_folder}/{job.save_config_file} (and print it with job.print_config)."""
    text = config_to_toml(cfg)
    if cfg.job.print_config:
        print(text)
    path = Path(cfg.job.dump_folder) / cfg.job.save_config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
