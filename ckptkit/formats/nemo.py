"""NeMo checkpoints: ``.nemo`` archives read in place, and NeMo 2 checkpoint folders.

Longer than most: one adapter for three archive weight layouts (one of them merged from its
tensor-parallel ranks, with the model sizes read from the config), NeMo 2 folders, and the
re-rooting of the weights' own adapter's catalog.

A ``.nemo`` file (NeMo 1.x ``SaveRestoreConnector.save_to``: ``tarfile.open(path, "w:")`` of a
folder added as ``.``) is an uncompressed tar of ``model_config.yaml`` (the model's OmegaConf
config), the weights, and artifacts (``<uuid>_tokenizer.model``…). The weights are one of:

* ``model_weights.ckpt``: ``torch.save(model.state_dict())``, under the group ``model_weights``
  (as the extracted file opens);
* ``model_weights/``: a Megatron-core ``torch_dist`` folder (``NLPSaveRestoreConnector`` with
  distributed checkpointing), placed as the Megatron adapter places it (``model.*``,
  ``optimizer.*``, ``common.*``, ``stacked.*``);
* ``mp_rank_XX/model_weights.ckpt``: the tensor-parallel ranks of a Megatron GPT model (NeMo's
  ``MegatronGPTModel``), each a bare state dict with Megatron's names under NeMo's ``model.``
  (legacy ``model.language_model.…``, mcore ``model.decoder.…``). The split dimension is not
  saved: the ranks are merged into the TP=1 state dict (group ``model_weights``, as that model's
  ``model_weights.ckpt`` opens) by Megatron's parameter naming rules
  (:mod:`.parts.megatron_tp_rules`, shared with ``megatron_legacy``), every piece's shape
  checked against the sizes in ``model_config.yaml`` (``hidden_size``, ``ffn_hidden_size``,
  ``num_attention_heads``, ``num_layers``, ``tensor_model_parallel_size`` are required;
  ``num_query_groups``, ``kv_channels``, ``activation``, ``share_embeddings_and_output_weights``
  as NeMo defaults them). The vocabulary size is the tokenizer's, not in the config: the padded
  vocabulary is ``padded_vocab_size`` when given, else TP × the word embeddings' rows per rank
  (a multiple of ``make_vocab_size_divisible_by`` × TP when that is given). A missing size, a
  parameter without a rule, a shape that disagrees, pipeline parallelism (``mp_rank_XX_YYY``)
  and mixtures of experts are refused naming the file and key (:class:`MegatronTPError`, or
  :class:`UnsupportedLayoutError` for a layout), never guessed.

The archive is read through :mod:`ckptkit.storage.tar_archive`: its headers are indexed and each
member is a byte range of the archive, locally or remotely; nothing is extracted or copied.
A gzip-compressed ``.nemo`` (NeMo before 1.7 wrote ``w:gz``) cannot be read in place and is
refused, with the commands that extract or repack it.

A NeMo 2 checkpoint (``nemo.lightning``: ``weights/`` + ``context/``) is a folder: ``weights/``
is a Megatron-core ``torch_dist`` folder, ``context/`` holds ``model.yaml``, ``io.json`` and
artifacts; it opens as one checkpoint, its record files under ``weights/``.

The model config (``model_config.yaml``, NeMo 2's ``context/model.yaml``) is the checkpoint's
config (``Facts.config_file``: :attr:`ckptkit.Checkpoint.config` decodes it with
``yaml.safe_load``) and its values are object entries (``model_config.optim.lr``,
``context.model.…``, read from the file as a ``DOCUMENT`` record); it and ``context/io.json``
are decoded once here, bounded, and must hold a mapping. Weights are described by the adapter of their layout, found in the format registry
by name (adapters never import each other), and their record file names re-rooted under the
folder they sit in.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from ..catalog.model import (
    Catalog,
    CatalogBuilder,
    Chunk,
    Encoding,
    Entry,
    Facts,
    Record,
    pickle_leaf,
)
from ..decoding.run_config import MAX_CONFIG_BYTES, flatten, leaves, read_config
from ..errors import (
    CheckpointError,
    CorruptRecordError,
    CoverageError,
    FormatError,
    MissingFileError,
    UnsupportedLayoutError,
)
from ..storage import Store
from ..storage.tar_archive import open_tar_archive
from ..storage.tar_headers import BLOCK, GZIP_MAGIC, is_tar_header
from .detection import Detection, file_location
from .parts.megatron_tp import Naming, merge_model, warn_differing_copies
from .parts.megatron_tp_rules import MegatronTPError, ModelArgs
from .parts.torch_save_files import describe_files, group_of, load_pickles, pickle_entries

__all__ = [
    "CONFIG",
    "NAME",
    "NEMO2_CONFIG",
    "NEMO2_CONTEXT",
    "NEMO2_IO",
    "NEMO2_WEIGHTS",
    "RANK_DIR",
    "SUFFIX",
    "WEIGHTS_DIR",
    "WEIGHTS_FILE",
    "describe",
    "detect",
]

NAME = "nemo"
SUFFIX = ".nemo"
CONFIG = "model_config.yaml"
WEIGHTS_FILE = "model_weights.ckpt"
WEIGHTS_DIR = "model_weights"
#: NeMo's tensor (``mp_rank_00``) and tensor + pipeline (``mp_rank_00_001``) parallel folders.
RANK_DIR = re.compile(r"^mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?$")
NEMO2_WEIGHTS = "weights"
NEMO2_CONTEXT = "context"
NEMO2_CONFIG = "context/model.yaml"
NEMO2_IO = "context/io.json"
#: The registered adapter ``model_weights/`` and ``weights/`` are handed to.
_TORCH_DIST = "megatron_dist"
#: What marks a torch_dist folder (Megatron's ``metadata.json``).
_TORCH_DIST_MARKER = "metadata.json"


def detect(storage: Store) -> Detection | None:
    """A ``.nemo`` file (an uncompressed tar, or a gzip one to refuse by name), or a NeMo 2
    folder (``weights/metadata.json`` beside ``context/model.yaml`` or ``context/io.json``)."""
    located = file_location(storage)
    if located is not None:
        return _detect_archive(*located)
    if not storage.exists(f"{NEMO2_WEIGHTS}/{_TORCH_DIST_MARKER}"):
        return None
    context = [name for name in (NEMO2_CONFIG, NEMO2_IO) if storage.exists(name)]
    if not context:
        return None
    evidence = [f"found {NEMO2_WEIGHTS}/{_TORCH_DIST_MARKER} (Megatron-core torch_dist weights)"]
    return Detection(NAME, storage, evidence + [f"found {name} (NeMo 2)" for name in context])


def _detect_archive(parent: Store, name: str) -> Detection | None:
    """The ``.nemo`` file ``name``: detected by its name and its first block (tar magic and
    checksum, or gzip magic); a tar's headers are then indexed (a damaged one raises)."""
    if not name.lower().endswith(SUFFIX):
        return None
    size = parent.size(name)
    head = bytes(parent.read_ranges([(name, 0, min(size, BLOCK))])[0])
    if head.startswith(GZIP_MAGIC):
        return Detection(NAME, parent, [f"{name} is a gzip-compressed .nemo archive"], files=[name])
    if not is_tar_header(head):
        return None
    archive = open_tar_archive(parent, name)
    listing = archive.listdir()
    evidence = [f"{name} is an uncompressed tar (a .nemo archive, read in place)"]
    evidence += [
        f"found {member}" for member in (CONFIG, WEIGHTS_FILE) if listing.get(member, -1) >= 0
    ]
    if listing.get(WEIGHTS_DIR, 0) < 0:
        evidence.append(f"found {WEIGHTS_DIR}/ (Megatron-core torch_dist)")
    ranks = _rank_dirs(listing)
    if ranks:
        evidence.append(f"found {', '.join(ranks[:4])} (tensor-parallel ranks)")
    return Detection(NAME, archive, evidence)


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of a ``.nemo`` archive (as :func:`detect` opened it) or of a NeMo 2
    folder; a compressed ``.nemo`` and a pipeline-parallel one are refused, naming the layout
    (:class:`UnsupportedLayoutError`: not damage)."""
    if files is not None:
        raise _refused_file(storage, files[0])
    if storage.exists(CONFIG) or storage.exists(WEIGHTS_FILE) or storage.exists(WEIGHTS_DIR):
        return _describe_archive(storage)
    if storage.exists(NEMO2_WEIGHTS) and storage.exists(NEMO2_CONTEXT):
        return _describe_nemo2(storage)
    raise FormatError(
        f"{storage.describe()}: not a NeMo checkpoint: neither a .nemo archive "
        f"({CONFIG} + {WEIGHTS_FILE} | {WEIGHTS_DIR}/ | mp_rank_XX/) nor a NeMo 2 folder "
        f"({NEMO2_WEIGHTS}/ + {NEMO2_CONTEXT}/)"
    )


def _refused_file(parent: Store, name: str) -> FormatError:
    """Why the file ``name`` cannot be opened as a ``.nemo`` archive."""
    where = parent.describe(name)
    try:
        head = bytes(parent.read_ranges([(name, 0, min(parent.size(name), 2))])[0])
    except CheckpointError:
        head = b""
    if head.startswith(GZIP_MAGIC):
        stem = posixpath.basename(name)[: -len(SUFFIX)] or "model"
        return UnsupportedLayoutError(
            f"{where}: a compressed .nemo archive (gzip, as NeMo before 1.7 wrote them): its "
            "members cannot be read in place; extract it and open the folder "
            f"(mkdir {stem} && tar -xzf {name} -C {stem}), or repack it uncompressed "
            f"(tar -xzf {name} -C {stem} && tar -cf {stem}-uncompressed.nemo -C {stem} .)"
        )
    return FormatError(
        f"{where}: not a .nemo archive (an uncompressed tar holding {CONFIG}); ckptkit reads "
        ".nemo files by their ustar headers"
    )


# -- .nemo archives -------------------------------------------------------------------------


def _describe_archive(archive: Store) -> Catalog:
    listing = archive.listdir()
    if listing.get(CONFIG, -1) < 0:
        raise FormatError(
            f"{archive.describe()}: a .nemo archive without {CONFIG} (it holds "
            f"{_shown(listing)}): not one NeMo's save_to wrote"
        )
    config = _decoded_mapping(archive, CONFIG)
    ranks = _rank_dirs(listing)
    if listing.get(WEIGHTS_FILE, -1) >= 0:
        groups = {WEIGHTS_FILE: group_of(WEIGHTS_FILE)}
        entries = list(describe_files(archive, groups).values())
        inner = Catalog(NAME, {}, (WEIGHTS_FILE,))
        layout = f"NeMo .nemo archive: {WEIGHTS_FILE} (torch.save)"
    elif listing.get(WEIGHTS_DIR, 0) < 0:
        entries, inner = _delegated(_TORCH_DIST, archive, WEIGHTS_DIR)
        layout = f"NeMo .nemo archive: {WEIGHTS_DIR}/ ({inner.facts.layout or inner.format})"
    elif ranks:
        entries, inner = _tensor_parallel(archive, ranks, config)
        layout = (
            f"NeMo .nemo archive: mp_rank_XX/{WEIGHTS_FILE} (Megatron GPT, "
            f"TP={inner.facts.world_size}, merged)"
        )
    else:
        raise FormatError(
            f"{archive.describe()}: a .nemo archive with no weights: neither {WEIGHTS_FILE}, "
            f"{WEIGHTS_DIR}/ nor mp_rank_XX/{WEIGHTS_FILE} (it holds {_shown(listing)})"
        )
    read = {*inner.files, CONFIG, WEIGHTS_FILE, WEIGHTS_DIR, *ranks}
    references = _nemo_references(config)
    skipped = {
        name: _artifact_reason(name, size, references)
        for name, size in listing.items()
        if name not in read and not name.startswith(".")
    }
    entries += _document_entries(CONFIG, listing[CONFIG], config)
    facts = dataclasses.replace(
        inner.facts,
        config_file=CONFIG,
        layout=layout,
        skipped_files={**inner.facts.skipped_files, **skipped},
    )
    return _built(entries, inner, facts)


def _tensor_parallel(
    archive: Store, ranks: list[str], config: dict[str, Any]
) -> tuple[list[Entry], Catalog]:
    """The TP ranks' ``model_weights.ckpt`` merged into the TP=1 state dict (group
    ``model_weights``), and a catalog of those files and the world size."""
    _refuse_pipeline(archive, ranks, config)
    tp = _config_int(archive, config, "tensor_model_parallel_size")
    expected = [f"mp_rank_{rank:02d}" for rank in range(tp)]
    extra = sorted(set(ranks) - set(expected))
    if extra:
        raise MegatronTPError(
            f"{archive.describe(extra[0])}: not a rank of this model: {CONFIG} says "
            f"tensor_model_parallel_size {tp} (mp_rank_00 … mp_rank_{tp - 1:02d})",
            file=extra[0],
            key=f"{_CONFIG_GROUP}.tensor_model_parallel_size",
        )
    files = [f"{label}/{WEIGHTS_FILE}" for label in expected]
    sizes = archive.sizes(files)
    missing = [name for name in files if sizes.get(name) is None]
    if missing:
        shown = ", ".join(archive.describe(name) for name in missing[:4])
        raise CoverageError(
            f"{shown}: missing; {CONFIG} says tensor_model_parallel_size {tp}, "
            f"{len(ranks)} rank folder(s) are there"
        )
    pickled = load_pickles(archive, files, sizes)
    leaves: dict[str, list[Entry]] = {}
    for label, name in zip(expected, files, strict=True):
        if not isinstance(pickled[name].value, dict) or not pickled[name].value:
            raise MegatronTPError(
                f"{archive.describe(name)}: holds {type(pickled[name].value).__name__}, not a "
                "model state dict",
                file=name,
            )
        leaves[label] = list(pickle_entries(pickled[name], _WEIGHTS_GROUP))
    args = _model_args(archive, config, tp, leaves[expected[0]])
    model = merge_model(
        [
            _Rank(label, name, rank, 0, rank)
            for rank, (label, name) in enumerate(zip(expected, files, strict=True))
        ],
        leaves,
        args,
        archive.describe,
        naming=_NAMING,
    )
    warn_differing_copies(archive, model.copies)
    facts = Facts(world_size=tp, rank_files=tuple(files))
    return model.entries, Catalog(NAME, {}, tuple(files), facts)


@dataclasses.dataclass(frozen=True)
class _Rank:
    """One TP rank's file, as :func:`~.parts.megatron_tp.merge_model` takes it."""

    label: str
    file: str
    tp: int
    pp: int
    rank: int


#: Merged entries are ``model_weights.<NeMo key>``, as the TP=1 model's file opens; Megatron's
#: names are NeMo's keys less ``model.`` (the attribute holding Megatron's module).
_WEIGHTS_GROUP = group_of(WEIGHTS_FILE)
_NAMING = Naming(group=_WEIGHTS_GROUP, skip=1, prefix="model.")
#: The config's entries' group (``model_config.hidden_size``): keys in refusals.
_CONFIG_GROUP = posixpath.splitext(CONFIG)[0]
#: NeMo's ``activation`` values whose first MLP linear is ``[gate; up]`` (and those that are not).
_GATED = frozenset({"swiglu", "fast-swiglu", "geglu", "fast-geglu", "reglu", "fast-reglu"})
_PLAIN = frozenset({"gelu", "relu", "squared-relu", "approx-gelu"})
#: The word embeddings (or output layer) whose rows give the padded vocabulary.
_VOCAB_NAMES = (
    "language_model.embedding.word_embeddings.weight",
    "embedding.word_embeddings.weight",
    "language_model.output_layer.weight",
    "output_layer.weight",
)


def _refuse_pipeline(archive: Store, ranks: list[str], config: dict[str, Any]) -> None:
    """Pipeline stages, interleaving and experts are refused by name (not merged)."""
    staged = [name for name in ranks if RANK_DIR.match(name).group("pp") is not None]
    pp = config.get("pipeline_model_parallel_size")
    if staged or (pp is not None and pp != 1):
        raise UnsupportedLayoutError(
            f"{archive.describe()}: a pipeline-parallel .nemo archive ({', '.join(ranks[:4])}"
            f"{' …' if len(ranks) > 4 else ''}; pipeline_model_parallel_size {pp!r}) is "
            "recognised but not supported: only tensor-parallel ranks (mp_rank_XX/"
            f"{WEIGHTS_FILE}) are merged; save the model with NeMo at "
            "pipeline_model_parallel_size 1"
        )
    for name, what in (
        ("virtual_pipeline_model_parallel_size", "an interleaved (virtual) pipeline"),
        ("expert_model_parallel_size", "expert parallelism"),
        ("num_moe_experts", "a mixture of experts"),
    ):
        value = config.get(name)
        if value not in (None, False, 0, 1):
            raise MegatronTPError(
                f"{archive.describe(CONFIG)}: {name} = {value!r}: {what} is not supported",
                file=CONFIG,
                key=f"{_CONFIG_GROUP}.{name}",
            )


def _config_int(
    archive: Store, config: dict[str, Any], name: str, default: int | None = None
) -> int:
    """The config's positive int ``name`` (``default`` when it is missing or null; with no
    default, a :class:`MegatronTPError` naming it)."""
    value = config.get(name)
    if value is None:
        value = default
    if type(value) is not int or value <= 0:
        raise MegatronTPError(
            f"{archive.describe(CONFIG)}: {name} is {value!r}, not a positive int"
            + (" (needed to check the merged shapes)" if name not in config else ""),
            file=CONFIG,
            key=f"{_CONFIG_GROUP}.{name}",
        )
    return value


def _model_args(
    archive: Store, config: dict[str, Any], tp: int, first_rank: list[Entry]
) -> ModelArgs:
    """The model's sizes from ``model_config.yaml`` (the vocabulary from the word embeddings'
    rows when the config has no ``padded_vocab_size``), as the naming rules take them."""
    hidden = _config_int(archive, config, "hidden_size")
    heads = _config_int(archive, config, "num_attention_heads")
    num_layers = _config_int(archive, config, "num_layers")
    ffn = _config_int(archive, config, "ffn_hidden_size")
    activation = config.get("activation", "gelu")
    if activation not in _GATED | _PLAIN:
        raise MegatronTPError(
            f"{archive.describe(CONFIG)}: activation {activation!r} is not one ckptkit knows "
            f"the MLP layout of ({', '.join(sorted(_GATED | _PLAIN))})",
            file=CONFIG,
            key=f"{_CONFIG_GROUP}.activation",
        )
    positions = config.get("max_position_embeddings")
    return ModelArgs(
        tp=tp,
        pp=1,
        num_layers=num_layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        groups=_config_int(archive, config, "num_query_groups", heads),
        kv_channels=_config_int(archive, config, "kv_channels", hidden // heads or 1),
        vocab=_padded_vocab(archive, config, tp, first_rank),
        positions=positions if type(positions) is int else None,
        swiglu=activation in _GATED,
        tied=config.get("share_embeddings_and_output_weights", True) is not False,
        stage_layers=(num_layers,),
    )


def _padded_vocab(archive: Store, config: dict[str, Any], tp: int, first_rank: list[Entry]) -> int:
    """``padded_vocab_size`` when the config gives it, else TP × rank 0's word embedding rows,
    checked to be a multiple of ``make_vocab_size_divisible_by`` × TP when that is given."""
    if "padded_vocab_size" in config:
        return _config_int(archive, config, "padded_vocab_size")
    found = {_megatron_name(entry): entry for entry in first_rank}
    rows = next(
        (found[name].shape[0] for name in _VOCAB_NAMES if name in found and found[name].shape),
        None,
    )
    if rows is None:
        return 0  # no vocabulary-shaped parameter: no rule uses it
    vocab = rows * tp
    if "make_vocab_size_divisible_by" in config:
        multiple = _config_int(archive, config, "make_vocab_size_divisible_by") * tp
        if vocab % multiple:
            name = next(name for name in _VOCAB_NAMES if name in found)
            raise MegatronTPError(
                f"{archive.describe(f'mp_rank_00/{WEIGHTS_FILE}')}: "
                f"'{_WEIGHTS_GROUP}.model.{name}' holds {rows} rows per rank, a vocabulary of "
                f"{vocab}, not a multiple of make_vocab_size_divisible_by × TP = {multiple} "
                f"(as NeMo pads it)",
                file=f"mp_rank_00/{WEIGHTS_FILE}",
                key=f"{_WEIGHTS_GROUP}.model.{name}",
            )
    return vocab


def _megatron_name(entry: Entry) -> str:
    """A rank file entry's key as Megatron names it (NeMo's key less ``model.``)."""
    return ".".join(map(str, entry.path[_NAMING.skip :])).removeprefix(_NAMING.prefix)


def _artifact_reason(name: str, size: int, references: set[str]) -> str:
    """Why a member of the archive beside the config and weights is not read (``references``:
    the ``nemo:<member>`` values of the config)."""
    if size < 0:
        return "a folder in the .nemo archive, not part of the weights"
    if f"nemo:{name}" in references:
        return f"a NeMo artifact the model config names (nemo:{name}), not checkpoint data"
    return "a file in the .nemo archive, not checkpoint data"


def _nemo_references(config: dict[str, Any]) -> set[str]:
    """The ``nemo:<member>`` values of the config (how NeMo names its artifacts)."""
    try:
        rows = flatten(config)
    except FormatError:
        return set()
    return {value for _, value in rows if isinstance(value, str) and value.startswith("nemo:")}


def _rank_dirs(listing: dict[str, int]) -> list[str]:
    return sorted(name for name, size in listing.items() if size < 0 and RANK_DIR.match(name))


def _shown(listing: dict[str, int]) -> str:
    names = sorted(f"{n}/" if size < 0 else n for n, size in listing.items())
    return ", ".join(names[:8]) + (" …" if len(names) > 8 else "") if names else "nothing"


# -- NeMo 2 folders ---------------------------------------------------------------------------


def _describe_nemo2(storage: Store) -> Catalog:
    entries, inner = _delegated(_TORCH_DIST, storage, NEMO2_WEIGHTS)
    config_file = NEMO2_CONFIG if storage.exists(NEMO2_CONFIG) else None
    if config_file is not None:
        config = _decoded_mapping(storage, config_file)
        entries += _document_entries(config_file, storage.size(config_file), config)
    skipped: dict[str, str] = {}
    if storage.exists(NEMO2_IO):
        _decoded_mapping(storage, NEMO2_IO)
        skipped[NEMO2_IO] = (
            "NeMo 2's serialized model and trainer (nemo.lightning io.json, for "
            "io.load_context): decoded and checked, not shown; the config is "
            f"{NEMO2_CONFIG}"
        )
    try:
        context = storage.listdir(NEMO2_CONTEXT)
    except (MissingFileError, NotADirectoryError):
        context = {}
    for name, size in context.items():
        path = f"{NEMO2_CONTEXT}/{name}"
        if path not in (NEMO2_CONFIG, NEMO2_IO) and not name.startswith("."):
            skipped[f"{path}/" if size < 0 else path] = (
                "a NeMo 2 context artifact (tokenizer, vocabulary…), not checkpoint data"
            )
    facts = dataclasses.replace(
        inner.facts,
        config_file=config_file,
        layout=f"NeMo 2 checkpoint: {NEMO2_WEIGHTS}/ ({inner.facts.layout or inner.format}) "
        f"+ {NEMO2_CONTEXT}/",
        skipped_files={**inner.facts.skipped_files, **skipped},
    )
    return _built(entries, inner, facts)


# -- shared by both: the weights' adapter, re-rooted ------------------------------------------


def _adapter(name: str) -> ModuleType | None:
    """The registered adapter ``name``, None when there is none: looked up in the registry
    (:data:`ckptkit.formats.ADAPTERS`), not imported, as adapters never import each other."""
    from . import ADAPTERS  # the registry of this package, complete once it is imported

    return ADAPTERS.get(name)


def _delegated(format: str, top: Store, folder: str) -> tuple[list[Entry], Catalog]:
    """The entries of the ``format`` checkpoint in ``folder`` of ``top``, re-rooted at
    ``top``, and that checkpoint's own catalog (files and facts re-rooted too)."""
    adapter = _adapter(format)
    inner = top.child(folder)
    found = adapter.detect(inner) if adapter is not None else None
    if found is None or found.format != format:
        raise FormatError(
            f"{inner.describe()}: not a {format} checkpoint (no {_TORCH_DIST_MARKER} naming "
            "its backend), as the NeMo layout says it is"
        )
    if found.files is not None:
        catalog = adapter.describe(found.storage, files=found.files)
    else:
        catalog = adapter.describe(found.storage)
    prefix = _relative(top, found.storage)
    facts = catalog.facts
    facts = dataclasses.replace(
        facts,
        metadata_files=_names(prefix, facts.metadata_files),
        rank_files=_names(prefix, facts.rank_files),
        base64_key_files=_names(prefix, facts.base64_key_files),
        config_file=None,
        skipped_files=dict(
            zip(_names(prefix, facts.skipped_files), facts.skipped_files.values(), strict=True)
        ),
        header_metadata=dict(
            zip(_names(prefix, facts.header_metadata), facts.header_metadata.values(), strict=True)
        ),
    )
    rebased = dataclasses.replace(catalog, files=_names(prefix, catalog.files), facts=facts)
    return _rebased(catalog.entries.values(), prefix), rebased


def _relative(top: Store, inner: Store) -> str:
    """The folder ``inner`` is, relative to ``top`` (``""`` for ``top`` itself)."""
    root, below = top.root.rstrip("/"), inner.root.rstrip("/")
    if below == root:
        return ""
    if not below.startswith(root + "/"):
        raise FormatError(f"{inner.describe()}: not inside {top.describe()}")
    return below[len(root) + 1 :]


def _names(prefix: str, names: Iterable[str]) -> tuple[str, ...]:
    return tuple(posixpath.join(prefix, name) if prefix else name for name in names)


def _rebased(entries: Iterable[Entry], prefix: str) -> list[Entry]:
    """``entries`` with every record's file under ``prefix`` (a record shared by several
    chunks stays shared)."""
    entries = list(entries)
    if not prefix:
        return entries
    moved: dict[int, Record] = {}

    def record(old: Record | None) -> Record | None:
        if old is None:
            return None
        new = moved.get(id(old))
        if new is None:
            new = moved[id(old)] = dataclasses.replace(old, file=f"{prefix}/{old.file}")
        return new

    return [
        dataclasses.replace(
            entry,
            chunks=tuple(dataclasses.replace(c, record=record(c.record)) for c in entry.chunks),
        )
        for entry in entries
    ]


def _built(entries: list[Entry], inner: Catalog, facts: Facts) -> Catalog:
    builder = CatalogBuilder(NAME, object_globals=inner.object_globals)
    builder.add_files(inner.files)
    builder.add_all(entries, source=NAME)
    return builder.build(facts)


def _document_entries(name: str, size: int, config: dict[str, Any]) -> list[Entry]:
    """The config's values as object entries under its path (``context/model.yaml`` →
    ``context.model.…``), one per leaf; one entry for the whole file when a mapping key is not a
    plain string or integer or holds a dot (the leaves would not have keys of their own), or
    when there are too many."""
    base = tuple(posixpath.splitext(name)[0].split("/"))
    try:
        found = leaves(config)
    except FormatError:  # more values than a table holds (YAML aliases): the file as one value
        found = [((None,), None)]
    plain = all(
        type(k) is int or (type(k) is str and k and "." not in k) for path, _ in found for k in path
    )
    paths = [path for path, _ in found] if plain else [()]
    return [
        Entry(
            ".".join(map(str, (*base, *path))),
            (*base, *path),
            "object",
            (Chunk((), (), pickle_leaf(name, 0, size, path, encoding=Encoding.DOCUMENT)),),
        )
        for path in paths
    ]


def _decoded_mapping(storage: Store, name: str) -> dict[str, Any]:
    """The config file ``name`` decoded safely (``yaml.safe_load`` / ``json``, at most
    :data:`~ckptkit.decoding.run_config.MAX_CONFIG_BYTES`), which must be a mapping."""
    try:
        value = read_config(storage, name)
    except RecursionError:
        raise CorruptRecordError(f"{storage.describe(name)}: nested too deeply") from None
    if not isinstance(value, dict):
        raise CorruptRecordError(
            f"{storage.describe(name)}: not a mapping but {type(value).__name__} (a NeMo config "
            f"is one; at most {MAX_CONFIG_BYTES} bytes)"
        )
    return value
