"""The training run's config saved beside a checkpoint (OLMo ``config.yaml``, OLMo-core and HF
``config.json``): parsed safely, and flattened into a table."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..storage import Store

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CONFIG_NAMES",
    "MAX_CONFIG_BYTES",
    "MAX_ROWS",
    "read_config",
    "parse_document",
    "flatten",
    "leaves",
    "config_table",
]

#: Looked for in the checkpoint's directory, in this order, when the format names none.
CONFIG_NAMES = ("config.yaml", "config.json")
#: Larger files are refused: a config is a few kB.
MAX_CONFIG_BYTES = 16 << 20
#: Rows of a flattened config, at most (YAML aliases can make a small file expand hugely).
MAX_ROWS = 100_000


def read_config(storage: Store, name: str | None = None) -> Any:
    """The parsed config file ``name`` (or the first of :data:`CONFIG_NAMES` that exists) in
    ``storage``; None when there is none. YAML is read with ``yaml.safe_load`` (no tags run)."""
    if name is None:
        name = next((n for n in CONFIG_NAMES if storage.exists(n)), None)
        if name is None:
            return None
    source = storage.describe(name)
    try:
        size = storage.size(name)
    except MissingFileError:
        return None
    if size > MAX_CONFIG_BYTES:
        raise FormatError(f"{source}: {size} bytes is too large for a config file")
    return parse_document(storage.read_file(name), name, source)


def parse_document(data: bytes, name: str, source: str) -> Any:
    """A JSON or YAML file's value (YAML when ``name`` ends in .yaml/.yml), parsed without
    running anything (``yaml.safe_load``: no tags construct objects); at most
    :data:`MAX_CONFIG_BYTES`."""
    if len(data) > MAX_CONFIG_BYTES:
        raise FormatError(f"{source}: {len(data)} bytes is too large for a config file")
    try:
        if posixpath.splitext(name)[1] in (".yaml", ".yml"):
            import yaml

            try:
                return yaml.safe_load(data)
            except yaml.YAMLError as exc:
                raise CorruptRecordError(f"{source}: not valid YAML: {exc}") from exc
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptRecordError(f"{source}: not valid JSON: {exc}") from exc
    except RecursionError:
        raise CorruptRecordError(f"{source}: nested too deeply") from None


def flatten(config: Any) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` per leaf: dicts are walked, and lists that hold dicts (by index);
    other lists are one value."""
    return [(".".join(map(str, path)), value) for path, value in leaves(config)]


def leaves(config: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, value)`` per leaf, as :func:`flatten` walks them; a path holds the mapping keys
    and list indices that lead to the value (at most :data:`MAX_ROWS` leaves)."""
    rows: list[tuple[tuple[Any, ...], Any]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), config)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping) and value:
            items = list(value.items())
        elif isinstance(value, list) and any(isinstance(v, Mapping) for v in value):
            items = list(enumerate(value))
        else:
            rows.append((path, value))
            if len(rows) > MAX_ROWS:
                raise FormatError(f"config has more than {MAX_ROWS} values")
            continue
        stack.extend(((*path, k), v) for k, v in reversed(items))
    return rows


def config_table(config: Any) -> pd.DataFrame:
    """The flattened config: one row per value, columns ``key`` (``model.d_model``), ``value``."""
    import pandas as pd

    rows = flatten(config) if config is not None else []
    return pd.DataFrame(rows, columns=["key", "value"])
