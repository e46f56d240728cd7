"""Where each key of a YAML job config is, so that every error names the file, the line and the key."""

from __future__ import annotations

from typing import Any

import yaml

from torch_batch_process.errors import InvalidArgumentError

__all__ = ["ConfigError", "KeyLines", "key_name", "type_name"]


class ConfigError(InvalidArgumentError):
    """A job config that cannot be run; the message names the file, the line and the key."""


class KeyLines:
    """Line numbers (1-based) of the keys of a YAML document, by key path."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.lines: dict[tuple[Any, ...], int] = {}

    def error(self, path: tuple[Any, ...], message: str) -> ConfigError:
        where = self.file
        probe = path
        while probe and probe not in self.lines:
            probe = probe[:-1]
        if probe in self.lines:
            where = f"{self.file}:{self.lines[probe]}"
        key = key_name(path)
        return ConfigError(f"{where}: {key + ': ' if key else ''}{message}")

    def index(self, node: yaml.Node, path: tuple[Any, ...] = ()) -> None:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else repr(key_node)
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise ConfigError(f"{self.file}:{line}: {key_name(path + (key,))}: the key is given twice")
                seen.add(key)
                self.lines[path + (key,)] = key_node.start_mark.line + 1
                self.index(value_node, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.lines[path + (i,)] = item.start_mark.line + 1
                self.index(item, path + (i,))


def key_name(path: tuple[Any, ...]) -> str:
    """A key path as written in messages: ``resources.nodes``, ``entrypoint[1]``."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def type_name(value: Any) -> str:
    """What a YAML value is, in words ("a mapping", "a list", "empty"...)."""
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "empty"}.get(
        type(value), f"a {type(value).__name__}"
    )
