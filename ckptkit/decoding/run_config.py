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

__all__ = ["CONFIG_NAMES", "MAX_CONFIG_BYTES", "MAX_ROWS", "read_config", "flatten", "config_table"]

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
    data = storage.read_file(name)
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


def flatten(config: Any) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` per leaf: dicts are walked, and lists that hold dicts (by index);
    other lists are one value."""
    rows: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        prefix, value = stack.pop()
        if isinstance(value, Mapping) and value:
            items = [(str(k), v) for k, v in value.items()]
        elif isinstance(value, list) and any(isinstance(v, Mapping) for v in value):
            items = [(str(i), v) for i, v in enumerate(value)]
        else:
            rows.append((prefix, value))
            if len(rows) > MAX_ROWS:
                raise FormatError(f"config has more than {MAX_ROWS} values")
            continue
        stack.extend((f"{prefix}.{k}" if prefix else k, v) for k, v in reversed(items))
    return rows


def config_table(config: Any) -> pd.DataFrame:
    """The flattened config: one row per value, columns ``key`` (``model.d_model``), ``value``."""
    import pandas as pd

    rows = flatten(config) if config is not None else []
    return pd.DataFrame(rows, columns=["key", "value"])
