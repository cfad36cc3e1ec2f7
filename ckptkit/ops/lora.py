"""Merging a PEFT LoRA adapter into the checkpoint it was trained on, as PEFT's
``merge_and_unload()`` does: ``W' = W + scaling · (B @ A)``, one base tensor at a time.

The adapter is a folder PEFT's ``save_pretrained`` wrote: ``adapter_config.json`` (untrusted
JSON: bounded, every field used type-checked, every option not implemented here refused by
name) and ``adapter_model.safetensors`` (or ``adapter_model.bin``, read by the safe unpickler).
The base is any checkpoint ckptkit opens; the merged tensors go through the unshard plans and
writers (:mod:`.output_plans`) into a staged output published only on success.

PEFT's arithmetic is replayed step by step so the result is bit-equal: the adapter pair in the
dtype PEFT gives it (the base dtype, float16/bfloat16/float8 upcast to float32), the delta
``transpose(B @ A, fan_in_fan_out) * scaling`` in that dtype, then ``W += delta`` in place
(torch adds in float32 and rounds once to the base dtype); an embedding's delta is rounded to
the base dtype before the addition, as PEFT's ``Embedding.merge`` does.

Longer than most: the adapter config's validation (one refusal per PEFT option), the key rules
of PEFT's save format, and the merge itself belong together and are read together.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import dtypes, tunables
from ..catalog.model import Entry, refuse_tensors_left_as_objects
from ..dtypes import DType
from ..errors import (
    FormatError,
    KeyNotFoundError,
    MissingFileError,
    UnsupportedLayoutError,
    UsageError,
)
from ..extras import require
from ..storage import Storage, atomic_output
from ..units import parse_size, plural
from . import distributed, output_plans, work
from .convert import UnshardResult
from .convert import _refuse_another_checkpoint as refuse_another_checkpoint
from .output_plans import Copier
from .source import Source, open_source

__all__ = [
    "CONFIG_NAME",
    "WEIGHT_NAMES",
    "AdapterConfig",
    "MergeResult",
    "UnsupportedAdapterError",
    "merge_lora",
    "parse_adapter_config",
]

#: The adapter folder's files, as PEFT's ``save_pretrained`` names them (safetensors first,
#: as PEFT's loader prefers it).
CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
#: The prefix PEFT's saved keys carry (``PeftModel`` → ``base_model`` → ``model``).
_PEFT_PREFIX = "base_model.model."
#: Entries of ``rank_pattern`` / ``alpha_pattern`` at most, and characters of one pattern.
_MAX_PATTERNS = 100_000
_MAX_PATTERN_CHARS = 1024
#: Keys listed in a message at most.
_SHOWN = 8


class UnsupportedAdapterError(UnsupportedLayoutError):
    """The adapter uses a PEFT type or option :func:`merge_lora` does not implement (DoRA,
    trained biases, convolution LoRA…); ``option`` names it as the adapter config spells it."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(message)
        self.option = option


# -- the adapter config ---------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterConfig:
    """What of a PEFT ``LoraConfig`` decides the merge: the default rank and alpha, their
    per-module patterns (in the file's order: PEFT takes the first that matches), the scaling
    rule and layout, and the modules whose trained copies replace the base's."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    modules_to_save: tuple[str, ...] = ()

    def rank(self, module: str) -> int:
        """The rank PEFT gives ``module`` (its name in the model, ``model.layers.0.q_proj``)."""
        key = _pattern_key(self.rank_pattern, module)
        return self.r if key is None else self.rank_pattern[key]

    def alpha(self, module: str) -> float:
        """The ``lora_alpha`` PEFT gives ``module``."""
        key = _pattern_key(self.alpha_pattern, module)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling(self, module: str) -> float:
        """``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), as PEFT's ``update_layer``."""
        r, alpha = self.rank(module), self.alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def saves(self, key: str) -> bool:
        """Whether ``key`` (``lm_head.weight``) is a tensor of a ``modules_to_save`` module:
        one of its parent modules ends with a listed name, as PEFT's ``_set_trainable`` tests."""
        parts = key.split(".")
        return any(
            ".".join(parts[:n]).endswith(name)
            for n in range(1, len(parts))
            for name in self.modules_to_save
        )


#: Options that change what a merge must compute, and the value that leaves them off: any other
#: value is refused by name. Variants (DoRA, aLoRA…) and layer kinds PEFT merges differently.
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (weight-decomposed LoRA) merges through a magnitude vector"),
    "lora_bias": (False, "trained lora_B biases"),
    "bias": ("none", "trained biases (bias='all' / 'lora_only')"),
    "use_qalora": (False, "QA-LoRA"),
    "target_parameters": (None, "LoRA on nn.Parameters (target_parameters)"),
    "trainable_token_indices": (None, "trainable tokens"),
    "layer_replication": (None, "replicated layers"),
    "alora_invocation_tokens": (None, "activated LoRA (aLoRA)"),
    "arrow_config": (None, "Arrow routing"),
    "kasa_config": (None, "KaSA"),
    "velora_config": (None, "VeLoRA"),
    "monteclora_config": (None, "MonteCLoRA"),
    "use_bdlora": (None, "BD-LoRA"),
    "megatron_config": (None, "Megatron parallel LoRA layers"),
    "ensure_weight_tying": (False, "adapters tied between embedding and output layer"),
}
#: Values that leave an option off, whatever its type (PEFT tests them for truth).
_OFF: tuple[Any, ...] = (None, False, "", [], {})
#: Options that only decide how the adapter was trained or which modules PEFT wraps (the saved
#: weights say which modules have adapters): read for nothing.
_IGNORED = frozenset(
    {
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "target_modules",
        "exclude_modules",
        "lora_dropout",
        "init_lora_weights",
        "layers_to_transform",
        "layers_pattern",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "qalora_group_size",
        "runtime_config",
    }
)
#: Options the merge reads (type-checked in :func:`parse_adapter_config`).
_USED = frozenset(
    ("r", "lora_alpha", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern")
    + ("modules_to_save",)
)


def parse_adapter_config(raw: bytes, where: str) -> AdapterConfig:
    """The :class:`AdapterConfig` in ``raw`` (the bytes of ``adapter_config.json`` at
    ``where``): a JSON object of a ``LORA`` adapter, each field it uses of the right type, and
    no option this merge does not implement (:class:`UnsupportedAdapterError` naming it; an
    option unknown to this version counts as one unless it is empty or off)."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: not valid JSON ({_short(exc)})") from None
    if not isinstance(document, dict):
        raise FormatError(f"{where}: a JSON object expected, not {type(document).__name__}")
    peft_type = document.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedAdapterError(
            f"{where}: peft_type {_shown(peft_type)}; only LORA adapters can be merged",
            option="peft_type",
        )
    for option, (off, what) in _REFUSED.items():
        value = document.get(option, off)
        if value != off and value not in _OFF:
            raise UnsupportedAdapterError(
                f"{where}: {option}={_shown(value)}: {what} cannot be merged by ckptkit",
                option=option,
            )
    init = document.get("init_lora_weights")
    if init == "mica":
        raise UnsupportedAdapterError(
            f"{where}: init_lora_weights='mica': MiCA adapters cannot be merged by ckptkit",
            option="init_lora_weights",
        )
    for option, value in document.items():
        known = option in _USED or option in _IGNORED or option in _REFUSED
        if not known and value not in _OFF:
            raise UnsupportedAdapterError(
                f"{where}: option {_shown(option)}={_shown(value)} is unknown to ckptkit, so it "
                "cannot tell whether the merge would be right",
                option=str(option),
            )
    rank_pattern = _pattern_map(document, "rank_pattern", where, rank=True)
    return AdapterConfig(
        r=_rank(document.get("r", 8), "r", where),
        lora_alpha=_number(document.get("lora_alpha", 8), "lora_alpha", where),
        use_rslora=_flag(document, "use_rslora", where),
        fan_in_fan_out=_flag(document, "fan_in_fan_out", where),
        rank_pattern=rank_pattern,
        alpha_pattern=_pattern_map(document, "alpha_pattern", where, rank=False),
        modules_to_save=_names(document.get("modules_to_save"), where),
    )


def _rank(value: Any, name: str, where: str) -> int:
    if type(value) is not int or value <= 0:
        raise FormatError(f"{where}: {name} must be a positive integer, not {_shown(value)}")
    return value


def _number(value: Any, name: str, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise FormatError(f"{where}: {name} must be a finite number, not {_shown(value)}")
    return value


def _flag(document: dict, name: str, where: str) -> bool:
    value = document.get(name, False)
    if type(value) is not bool:
        raise FormatError(f"{where}: {name} must be true or false, not {_shown(value)}")
    return value


def _names(value: Any, where: str) -> tuple[str, ...]:
    """``modules_to_save``: null or a list of module names."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise FormatError(f"{where}: modules_to_save must be a list of names, not {_shown(value)}")
    return tuple(value)


def _pattern_map(document: dict, name: str, where: str, *, rank: bool) -> dict[str, Any]:
    """``rank_pattern`` / ``alpha_pattern``: an object of patterns (each a regex PEFT matches
    against module names) to ranks or alphas, bounded in size, each pattern compiled now."""
    value = document.get(name) or {}
    if not isinstance(value, dict):
        raise FormatError(f"{where}: {name} must be an object, not {_shown(value)}")
    if len(value) > _MAX_PATTERNS:
        raise FormatError(f"{where}: {name} has {len(value)} entries, at most {_MAX_PATTERNS}")
    checked = {}
    for pattern, number in value.items():
        label = f"{name}[{_shown(pattern)}]"
        if not isinstance(pattern, str):  # pragma: no cover - JSON object keys are strings
            raise FormatError(f"{where}: {label}: a pattern must be text")
        try:
            _compiled(pattern)
        except UnsupportedAdapterError as exc:
            raise UnsupportedAdapterError(f"{where}: {name}: {exc}", option=name) from None
        except FormatError as exc:
            raise FormatError(f"{where}: {name}: {exc}") from None
        checked[pattern] = _rank(number, label, where) if rank else _number(number, label, where)
    return checked


# -- PEFT's pattern matching (peft.utils.other.get_pattern_key) ------------------------------

#: A quantified group (``(a+)+``, ``(x|y)*``): the shape of patterns whose matching can take
#: exponential time; real rank/alpha patterns are module names, so they are refused.
_QUANTIFIED_GROUP = re.compile(r"\)[*+{]")
_REGEX_SYNTAX = re.compile(r"[\\.^$*+?{}\[\]|()]")


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str] | None:
    """PEFT's ``(.*\\.)?(PATTERN)$`` compiled (None for a plain name, matched without regex);
    a pattern too long, with a quantified group, or invalid is refused naming it (the caller
    adds where it comes from)."""
    if not pattern or len(pattern) > _MAX_PATTERN_CHARS:
        raise FormatError(f"pattern {_shown(pattern)} is empty or longer than {_MAX_PATTERN_CHARS}")
    if not _REGEX_SYNTAX.search(pattern):
        return None
    if _QUANTIFIED_GROUP.search(pattern):
        raise UnsupportedAdapterError(
            f"pattern {_shown(pattern)} repeats a group, which regular expression matching may "
            "take exponential time on; name the modules instead",
            option="rank_pattern/alpha_pattern",
        )
    try:
        return re.compile(rf"(.*\.)?({pattern})$")
    except re.error as exc:
        raise FormatError(f"pattern {_shown(pattern)}: {exc}") from None


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The first of ``patterns`` that matches ``module`` as PEFT's ``get_pattern_key`` does
    (``re.match(rf"(.*\\.)?({key})$", module)``), else None. A pattern with no regex syntax
    matches the name itself or a dotted suffix of it, exactly what the regex would do."""
    for pattern in patterns:
        compiled = _compiled(pattern)
        if compiled is None:
            if module == pattern or module.endswith("." + pattern):
                return pattern
        elif compiled.match(module):
            return pattern
    return None


# -- the adapter's weights ------------------------------------------------------------------


@dataclass
class _Pair:
    """One module's LoRA pair: ``A`` (r × in) and ``B`` (out × r) of a linear layer, or
    ``lora_embedding_A`` (r × vocabulary) and ``lora_embedding_B`` (dim × r) of an embedding."""

    module: str
    kind: Literal["linear", "embedding"]
    a: Entry | None = None
    b: Entry | None = None


@dataclass
class _Change:
    """What happens to one base tensor: replaced by the adapter's copy (``modules_to_save``,
    embedding layers PEFT saved), then the pair's delta added."""

    pair: _Pair | None = None
    replacement: Entry | None = None
    scaling: float = 0.0


_LINEAR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])(?:\.default)?\.weight")
_EMBEDDING_KEY = re.compile(r"(?P<module>.+)\.lora_embedding_(?P<side>[AB])(?:\.default)?")
_BASE_LAYER_KEY = re.compile(r"(?P<module>.+)\.base_layer\.(?P<name>[^.]+)")
#: Pieces of saved keys that belong to adapter kinds this merge refuses, by the option to name.
_REFUSED_KEYS = (
    (re.compile(r"\.lora_magnitude_vector(\.|$)"), "use_dora"),
    (re.compile(r"\.lora_B(\.default)?\.bias$"), "lora_bias"),
    (re.compile(r"\.trainable_tokens_(delta|original)(\.|$)"), "trainable_token_indices"),
)


def _changes(config: AdapterConfig, adapter: Source, where: str) -> dict[str, _Change]:
    """The adapter's tensors sorted into changes, by the key of the base tensor they change
    relative to the model (``model.layers.0.self_attn.q_proj.weight``)."""
    pairs: dict[str, _Pair] = {}
    replacements: dict[str, Entry] = {}
    unknown: list[str] = []
    for entry in adapter.catalog.entries.values():
        name = _saved_name(entry, where)
        if _add_to_pair(pairs, name, entry, where):
            continue
        target = _replaced_key(config, name)
        if target is None:
            unknown.append(entry.key)
        elif target in replacements:
            raise FormatError(f"{where}: {entry.key!r}: a second tensor for {target!r}")
        else:
            replacements[target] = entry
    if unknown:
        raise FormatError(
            f"{where}: {plural(len(unknown), 'tensor')} PEFT would not merge: "
            f"{_listed(unknown)} (not lora_A/lora_B, lora_embedding_A/B, a saved base layer "
            f"or a module in modules_to_save {list(config.modules_to_save)})"
        )
    changes = {target: _Change(replacement=entry) for target, entry in replacements.items()}
    for module, pair in pairs.items():
        if pair.a is None or pair.b is None:
            missing = "A" if pair.a is None else "B"
            raise FormatError(f"{where}: {module!r} has no lora_{missing} weight")
        change = changes.setdefault(f"{module}.weight", _Change())
        change.pair, change.scaling = pair, config.scaling(module)
    if not changes:
        raise FormatError(f"{where}: the adapter holds no LoRA weights")
    return changes


def _saved_name(entry: Entry, where: str) -> str:
    """The tensor's name as PEFT saved it, without ``base_model.model.`` (the model's own
    module names); a tensor of an adapter kind this merge refuses raises naming its option."""
    if entry.kind != "tensor":
        raise FormatError(f"{where}: {entry.key!r} is not a tensor")
    # the key inside the file: the entry's path below its group (the file's stem)
    inner = ".".join(map(str, entry.path[1:])) if len(entry.path) > 1 else entry.key
    name = inner.removeprefix(_PEFT_PREFIX)
    for pattern, option in _REFUSED_KEYS:
        if pattern.search(name):
            raise UnsupportedAdapterError(
                f"{where}: {entry.key!r} belongs to {option}, which ckptkit cannot merge",
                option=option,
            )
    return name


def _add_to_pair(pairs: dict[str, _Pair], name: str, entry: Entry, where: str) -> bool:
    """Put ``entry`` in its module's pair if ``name`` is a LoRA weight (``M.lora_A.weight``,
    ``M.lora_embedding_B``; ``.default.`` as a raw PEFT state dict spells them too)."""
    linear = _LINEAR_KEY.fullmatch(name)
    found = linear or _EMBEDDING_KEY.fullmatch(name)
    if found is None:
        return False
    kind: Literal["linear", "embedding"] = "linear" if linear else "embedding"
    module, side = found["module"], found["side"].lower()
    pair = pairs.setdefault(module, _Pair(module, kind))
    if pair.kind != kind or getattr(pair, side) is not None:
        raise FormatError(f"{where}: {entry.key!r}: a second lora_{side.upper()} of {module!r}")
    setattr(pair, side, entry)
    return True


def _replaced_key(config: AdapterConfig, name: str) -> str | None:
    """The base key a non-LoRA tensor replaces: ``M.base_layer.P`` (a layer PEFT saved whole,
    e.g. an embedding under LoRA) → ``M.P``; a ``modules_to_save`` tensor → itself; else None."""
    base_layer = _BASE_LAYER_KEY.fullmatch(name)
    if base_layer is not None:
        return f"{base_layer['module']}.{base_layer['name']}"
    return name if config.saves(name) else None


def _check_shapes(config: AdapterConfig, change: _Change, base: Entry, where: str) -> None:
    """Refuse, before anything is written, a change whose shapes or dtypes PEFT could not
    have loaded: a rank other than the config's, a pair that does not fit the base tensor,
    convolution LoRA, a non-floating base under a pair."""
    if change.replacement is not None and change.replacement.shape != base.shape:
        raise FormatError(
            f"{where}: {change.replacement.key!r} has shape {change.replacement.shape}, the "
            f"base tensor {base.key!r} {base.shape}"
        )
    pair = change.pair
    if pair is None:
        return
    assert pair.a is not None and pair.b is not None
    a_shape, b_shape, w_shape = pair.a.shape or (), pair.b.shape or (), base.shape or ()
    if len(a_shape) != 2 or len(b_shape) != 2 or len(w_shape) != 2:
        raise UnsupportedAdapterError(
            f"{where}: {pair.module!r}: LoRA of {len(w_shape)}-d weights with "
            f"{len(a_shape)}-d adapters (convolutions?) cannot be merged by ckptkit "
            f"(lora_A {a_shape}, lora_B {b_shape}, base {base.key!r} {w_shape})",
            option="conv",
        )
    rank = config.rank(pair.module)
    if a_shape[0] != rank or b_shape[1] != rank:
        raise FormatError(
            f"{where}: {pair.module!r}: lora_A {a_shape} and lora_B {b_shape} have rank "
            f"{a_shape[0]}/{b_shape[1]}; the config gives it rank {rank}"
        )
    if pair.kind == "embedding" or config.fan_in_fan_out:
        expected = (a_shape[1], b_shape[0])
    else:
        expected = (b_shape[0], a_shape[1])
    if w_shape != expected:
        raise FormatError(
            f"{where}: {pair.module!r}: the pair (lora_A {a_shape}, lora_B {b_shape}) gives a "
            f"{expected} delta, the base tensor {base.key!r} is {w_shape}"
        )
    for entry in (base, pair.a, pair.b):
        if entry.dtype is None or not entry.dtype.is_floating:
            raise FormatError(
                f"{where}: {entry.key!r} is {entry.dtype.name if entry.dtype else '?'}: "
                "a LoRA merge needs floating tensors"
            )


def _base_prefix(base: Source, targets: Sequence[str]) -> str:
    """The prefix the base's keys put before the model's names (``model.`` for a Hugging Face
    folder, whose keys start with their file's group): the one under which every target is a
    tensor. None, or several, is an error naming the keys."""
    keys = base.catalog.entries
    candidates: set[str] = set()
    for target in targets:
        candidates = {
            key[: len(key) - len(target)]
            for key in keys
            if key == target or key.endswith("." + target)
        }
        if candidates:
            break
    scored = sorted(
        ((sum(prefix + t in keys for t in targets), prefix) for prefix in candidates),
        key=lambda scored: (-scored[0], len(scored[1])),
    )
    complete = [prefix for count, prefix in scored if count == len(targets)]
    if len(complete) == 1:
        return complete[0]
    if complete:
        raise FormatError(
            f"{base.url}: the adapter's tensors are found under several prefixes "
            f"({_listed(complete)}); merge into a checkpoint holding one copy of the model"
        )
    prefix = scored[0][1] if scored else ""
    missing = [t for t in targets if prefix + t not in keys]
    raise KeyNotFoundError(
        f"{base.url}: no tensor for the adapter's {_listed([prefix + t for t in missing])} "
        f"({base.catalog.hint(prefix + missing[0])})"
    )


# -- the merge ------------------------------------------------------------------------------


@dataclass
class MergeResult(UnshardResult):
    """What :func:`merge_lora` wrote (as :class:`UnshardResult`), and what it changed:
    ``merged`` maps each base key that got a LoRA delta to its scaling, ``replaced`` lists the
    base keys whose values the adapter's copies replaced (``modules_to_save``, saved
    embedding layers)."""

    adapter: str = ""
    merged: dict[str, float] = field(default_factory=dict)
    replaced: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        scalings = sorted(set(self.merged.values()))
        shown = ", ".join(f"{s:g}" for s in scalings[:4]) + (" …" if len(scalings) > 4 else "")
        lines = [
            super().__str__(),
            f"merged {plural(len(self.merged), 'LoRA pair')} from {self.adapter} "
            f"(scaling {shown or '-'})",
        ]
        if self.replaced:
            lines.append(
                f"replaced {plural(len(self.replaced), 'tensor')} with the adapter's copies: "
                f"{_listed(self.replaced)}"
            )
        return "\n".join(lines)


def merge_lora(
    base: str | Source,
    adapter: str,
    dst: str,
    *,
    to: Literal["safetensors", "torch"] = "safetensors",
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> MergeResult:
    """Write ``base`` with the PEFT LoRA ``adapter`` merged in, into the directory ``dst``,
    bit-equal to PEFT's ``merge_and_unload()`` on CPU.

    Every base tensor is written (one file per group, as :func:`~ckptkit.unshard` names
    them: a Hugging Face folder gives ``model.safetensors`` with the model's own keys); those
    with an adapter pair become ``W + scaling · (B @ A)`` (``lora_alpha / r``, or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` per
    module as PEFT matches them; transposed with ``fan_in_fan_out``; embedding LoRA too), those
    of ``modules_to_save`` (and embedding layers PEFT saved) take the adapter's values. DoRA,
    trained biases, convolution LoRA and other variants are refused by name
    (:class:`UnsupportedAdapterError`); an adapter tensor PEFT would not merge, or whose base
    tensor is missing, is an error naming it. Non-tensor entries of the base are left out
    (listed in the result's ``dropped``). Memory stays at about the largest merged tensor
    twice (the tensor and its delta) plus its pair; nothing appears under a final name
    unless everything succeeded.

    Args:
        base: the checkpoint the adapter was trained on: a path or URL, or an opened
            checkpoint (:class:`Source`).
        adapter: the folder PEFT's ``save_pretrained`` wrote (``adapter_config.json`` and
            ``adapter_model.safetensors`` or ``adapter_model.bin``).
        dst: the output directory (local path or fsspec URL).
        to: ``"safetensors"`` or ``"torch"``.
        dtype: the dtype floating tensors are written in (merged first, in the base's dtype).
        max_shard_size: safetensors only: bytes per shard (``"5GB"`` or an int).
        storage_options: fsspec options for ``base`` (when a URL), ``adapter`` and ``dst``.
        overwrite: replace existing files of the same name instead of refusing.
        progress: show a progress bar.

    Returns:
        A :class:`MergeResult`: the files written, and the tensors merged (with their
        scaling) or replaced.

    Example:
        >>> result = ckptkit.merge_lora("Llama-3-8B/", "my-lora/", "merged/")
        >>> [f.name for f in result.files]
        ['model.safetensors']
    """
    if to not in ("torch", "safetensors"):
        raise UsageError(f"to must be 'torch' or 'safetensors', not {to!r}")
    cast = dtypes.dtype(dtype) if dtype is not None else None
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    adapter_storage = Storage(adapter, storage_options)
    config_where = adapter_storage.describe(CONFIG_NAME)
    raw = adapter_storage.read_file(CONFIG_NAME, max_bytes=tunables.SMALL_FILE_LIMIT)
    config = parse_adapter_config(raw, config_where)
    weights = _open_weights(adapter_storage, storage_options)
    source = open_source(base, storage_options)
    where = weights.url
    changes = _changes(config, weights, where)
    prefix = _base_prefix(source, sorted(changes))
    by_key = {prefix + target: change for target, change in changes.items()}
    for key, change in by_key.items():
        entry = source.catalog.entries[key]
        if entry.kind != "tensor":
            raise FormatError(f"{source.url}: {key!r} is not a tensor; the adapter changes it")
        _check_shapes(config, change, entry, where)

    destination = Storage(dst, storage_options)
    result = MergeResult(destination.describe(), adapter=adapter_storage.describe())
    result.merged = {k: c.scaling for k, c in by_key.items() if c.pair is not None}
    result.replaced = [k for k, c in by_key.items() if c.replacement is not None]
    entries = list(source.catalog.entries.values())
    refuse_tensors_left_as_objects(entries, source.url)
    for entry in entries:
        if entry.kind != "tensor":
            result.dropped[entry.key] = "not a tensor (merge-lora writes the model's tensors)"
    tensors = [e for e in entries if e.kind == "tensor"]
    tasks = output_plans.unsharded_tasks(tensors, {}, to, limit, cast)
    names = [name for task in tasks for name in task.names]
    total = sum(task.nbytes for task in tasks)
    written: list[output_plans.WrittenFile] = []
    with distributed.JobProgress(total, progress, "merge-lora", None) as bar:
        copier = _MergingCopier(source, weights, by_key, config.fan_in_fan_out, cast, bar)
        with atomic_output(destination, overwrite=overwrite) as output:
            output.refuse_existing(names)
            refuse_another_checkpoint(destination, names)  # one folder, one checkpoint
            for task in tasks:
                copier.reader.read_ahead([e for e in task.entries if e.key not in by_key])
                written += task.write(output, copier)
    result.files = written
    return result


def _open_weights(storage: Storage, storage_options: dict | None) -> Source:
    """The adapter's weights file opened (``adapter_model.safetensors``, else ``.bin``)."""
    for name in WEIGHT_NAMES:
        if storage.exists(name):
            url = storage.url.rstrip("/") + "/" + name
            return open_source(url, storage_options)
    raise MissingFileError(
        f"{storage.describe()}: no {' or '.join(WEIGHT_NAMES)} beside {CONFIG_NAME}"
    )


class _MergingCopier(Copier):
    """A :class:`Copier` whose changed tensors come out merged: the base tensor read whole,
    replaced and/or given its pair's delta the way PEFT computes it, then cast if asked."""

    def __init__(
        self,
        source: Source,
        adapter: Source,
        changes: dict[str, _Change],
        fan_in_fan_out: bool,
        cast: DType | None,
        bar: distributed.JobProgress,
    ) -> None:
        super().__init__(source.reader, cast, bar, work.Stop())
        self.adapter = adapter
        self.changes = changes
        self.fan_in_fan_out = fan_in_fan_out

    def __call__(self, entry: Entry) -> Iterator[memoryview]:
        change = self.changes.get(entry.key)
        return super().__call__(entry) if change is None else self._pieces(entry, change)

    def checked(self, entry: Entry) -> Iterator[memoryview]:
        change = self.changes.get(entry.key)
        return super().checked(entry) if change is None else self._pieces(entry, change)

    def _pieces(self, entry: Entry, change: _Change) -> Iterator[memoryview]:
        """The merged tensor's bytes, as one piece."""
        self.stop.check()
        torch = require("torch", "merge-lora")
        weight = self._merged(torch, entry, change)
        if self.cast is not None and entry.dtype.is_floating and self.cast != entry.dtype:
            weight = weight.to(dtypes.to_torch(self.cast))
        piece = memoryview(weight.contiguous().reshape(-1).view(torch.uint8).numpy())
        self.bar.update(len(piece))
        yield piece

    def _merged(self, torch, entry: Entry, change: _Change):
        """``entry``'s tensor after PEFT's merge: the replacement (cast to the base dtype, as
        ``load_state_dict`` copies it) or the base, then ``W += delta``."""
        if change.replacement is not None:
            weight = self.adapter.reader.read_tensor(change.replacement)
            weight = weight.to(dtypes.to_torch(entry.dtype))
        else:
            weight = self.reader.read_tensor(entry)
        pair = change.pair
        if pair is None:
            return weight
        assert pair.a is not None and pair.b is not None
        compute = torch.float32 if weight.dtype.itemsize <= 2 else weight.dtype
        lora_a = self.adapter.reader.read_tensor(pair.a).to(compute)
        lora_b = self.adapter.reader.read_tensor(pair.b).to(compute)
        delta = lora_b @ lora_a
        del lora_a, lora_b
        delta.mul_(change.scaling)  # in place: the values PEFT's `* scaling` gives, one copy
        if pair.kind == "embedding":  # peft Embedding: transpose(B @ A, True), cast, add
            weight += delta.T.to(weight.dtype)
        else:  # peft Linear: transpose(B @ A, fan_in_fan_out) * scaling, added in place
            weight += delta.T if self.fan_in_fan_out else delta
        return weight


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" … and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _shown(value: Any) -> str:
    """An untrusted JSON value for a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "…"


def _short(exc: BaseException) -> str:
    return _shown(str(exc)).strip("'\"")
