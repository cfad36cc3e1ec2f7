"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3 and ``BF16_Optimizer``), read from the files alone.

Layout: a tag directory (``global_step2/``) holding ``mp_rank_00_model_states.pt`` (stages 1/2)
or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (stage 3, one per rank) and
``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``; its parent ("run" directory) names the
newest tag in ``latest``. Either opens; the run directory reads the tag ``latest`` names, records
lying under ``<tag>/``.

Keys (as the model's ``state_dict()`` names them):

* ``model.<name>``: what DeepSpeed's ``zero_to_fp32`` produces, in its order and dtypes:
  buffers (from the model states), frozen parameters (stage >= 2 only: stage 1 saves none),
  the fp32 master weights of the trainable parameters, then tied aliases (``shared_params``)
  with the same chunks as their source. A parameter's chunks are its pieces in the ranks' flat
  fp32 partitions (see :mod:`.parts.zero_geometry`): flat byte ranges of the rank files, the
  padding never exposed.
* ``module.<name>``: the module weights as saved (16-bit when training in bf16/fp16; stages
  1/2 only, since stage 3 saves zero-element placeholders: there only its buffers).
* ``optim.state.<name>.<stat>``: the optimizer state cut the same way (``exp_avg``,
  ``exp_avg_sq``; a group's 0-d ``step`` shown for each of its parameters),
  ``optim.param_groups.<i>.<field>`` and DeepSpeed's own optimizer fields
  (``optim.loss_scaler``, ``optim.zero_stage``…) as objects.
* ``train.<key>``: everything else rank 0's model states hold (``global_steps``,
  ``lr_scheduler``, ``ds_config``, client state…), as objects.

One difference from ``zero_to_fp32``'s state dict: it casts 16-bit *floating buffers* to fp32;
here a buffer keeps the dtype it was saved in (a catalog entry is stored bytes, never
converted). Its command line also casts frozen 16-bit parameters: ``unshard(dtype="float32")``
writes exactly what ``zero_to_fp32.py <dir> <out>`` writes.

Not supported (recognised, with a clear error): model/tensor parallelism (``mp_rank_01``…),
pipeline layer files (``layer_XX-model_YY-model_states.pt``), MoE expert files
(``*expp_rank_*`` / ``*expert_*_mp_rank_*``), and ZeRO-Infinity NVMe offload (the swap files it
copies to ``<tag>/offloaded_tensors/``).
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ...catalog.coverage import check_chunks
from ...catalog.model import (
    Catalog,
    CatalogBuilder,
    Chunk,
    Encoding,
    Entry,
    Facts,
    Record,
    pickle_leaf,
)
from ...decoding.unpickler import TensorRef, is_opaque
from ...errors import CorruptRecordError, FormatError, MissingFileError
from ...limits import count_missing, first_missing
from ...storage import Storage
from ..detection import Detection, file_location
from ..parts.torch_save_files import Pickled, leaves, load_pickles, tensor_record
from .geometry import Layout, Piece, partitioned_layout, stage3_layout, stage3_slices
from .pickles import ZERO_GLOBALS, FragmentAddress

NAME = "deepspeed_zero"
LATEST = "latest"
#: Files DeepSpeed copies beside the tags: its converters, never read.
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
PIPELINE_FILE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
MOE_FILE = re.compile(r"(?:^|_)expp_rank_\d+_|(?:^|_)expert_\d+_mp_rank_")
#: Where ZeRO-Infinity copies its NVMe swap files (``offloaded_tensors/rank{N}/``).
OFFLOAD_DIR = "offloaded_tensors"
#: A tag name ``latest`` may give: one plain path component.
TAG = re.compile(r"^[A-Za-z0-9_.+=-]{1,255}$")
MAX_LATEST_BYTES = 4096
#: optimizer_state_dict fields that are partition geometry (described by the chunks instead).
GEOMETRY_KEYS = (
    "single_partition_of_fp32_groups",
    "fp32_flat_groups",
    "base_optimizer_state",
    "optimizer_state_dict",
    "group_paddings",
    "param_alignment_paddings",
    "param_slice_mappings",
)
#: Top-level model-state keys not repeated under ``train``.
MODEL_KEYS = ("module", "frozen_param_fragments")


# --------------------------------------------------------------------------------------------
# Detection.


def detect(storage: Storage) -> Detection | None:
    """A ZeRO tag directory (``*_optim_states.pt`` beside ``*_model_states.pt``), or its parent
    whose ``latest`` names one."""
    if file_location(storage) is not None:
        return None
    try:
        listing = storage.listdir()
    except (MissingFileError, NotADirectoryError):
        return None
    evidence = _tag_evidence(listing)
    if evidence:
        return Detection(NAME, storage, evidence)
    if listing.get(LATEST, -1) < 0:
        return None
    try:
        tag = _latest(storage)
        inner = _tag_evidence(storage.listdir(tag))
    except (FormatError, MissingFileError, NotADirectoryError):
        return None
    if not inner:
        return None
    lines = [f"{LATEST} names tag {tag!r}: reading {tag}/"]
    lines += [f"{tag}/{line}" for line in inner]
    lines += [f"{name} (DeepSpeed's converter, not read)" for name in SCRIPTS if name in listing]
    return Detection(NAME, storage, lines)


def _tag_evidence(listing: Mapping[str, int]) -> list[str]:
    """Why a listing looks like a ZeRO tag directory (empty: it does not)."""
    optim = sorted(n for n in listing if OPTIM_FILE.match(n))
    model = sorted(n for n in listing if MODEL_FILE.match(n))
    other = sorted(n for n in listing if PIPELINE_FILE.match(n) or MOE_FILE.search(n))
    if not (optim and model) and not (other and (optim or model)):
        return []
    lines = []
    if model:
        lines.append(f"{model[0]} … ({len(model)} model-state files)")
    if optim:
        prefix = " (bf16_ prefix: bf16 training)" if optim[0].startswith("bf16_") else ""
        lines.append(f"{optim[0]} … ({len(optim)} optimizer partitions){prefix}")
    if other:
        lines.append(f"{other[0]} … (pipeline / MoE files: not supported)")
    return lines


def _latest(storage: Storage) -> str:
    """The tag ``latest`` names: one safe path component."""
    raw = storage.read_file(LATEST, max_bytes=MAX_LATEST_BYTES)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not TAG.match(tag) or tag in (".", ".."):
        raise FormatError(
            f"{storage.describe(LATEST)}: does not name a tag directory: {raw[:80]!r}"
        )
    return tag


# --------------------------------------------------------------------------------------------
# The files of a tag directory.


@dataclass
class TagFiles:
    """The ZeRO files of one tag directory, relative to the checkpoint root."""

    prefix: str  # "" or "<tag>/"
    optim: list[str]  # by DP rank
    model: list[str]  # one (stages 1/2) or one per DP rank (stage 3)
    sizes: dict[str, int]
    skipped: dict[str, str]


def _tag_files(storage: Storage, prefix: str) -> TagFiles:
    """Sort a tag directory's files; a clear error for layouts recognised but not read."""
    where = prefix.rstrip("/")
    listing = storage.listdir(where)
    source = storage.describe(where)
    optim: dict[int, str] = {}
    per_rank_model: dict[int, str] = {}
    shared_model: list[str] = []
    skipped: dict[str, str] = {}
    kinds = set()
    for name, size in sorted(listing.items()):
        _refuse_unsupported(name, size, source)
        if size < 0:
            skipped[prefix + name] = (
                "a directory (offload or universal-checkpoint state?): not read"
            )
        elif (m := OPTIM_FILE.match(name)) is not None:
            kinds.add(bool(m.group(1)))
            optim[int(m.group(2))] = prefix + name
        elif (m := MODEL_FILE.match(name)) is not None:
            if m.group(1) is None:
                shared_model.append(prefix + name)
            else:
                per_rank_model[int(m.group(1))] = prefix + name
        else:
            skipped[prefix + name] = "not a ZeRO model-state or optimizer-state file"
    if len(kinds) > 1:
        raise FormatError(f"{source}: both bf16_ and plain optimizer-state files: two saves mixed")
    if not optim:
        raise MissingFileError(f"{source}: no *_optim_states.pt files")
    world = len(optim)
    ranks = _all_ranks(optim, world, source, "optimizer-state")
    if per_rank_model:
        model = _all_ranks(per_rank_model, world, source, "model-state")
    elif shared_model:
        model = shared_model
    else:
        raise MissingFileError(f"{source}: no *_model_states.pt file")
    sizes = {prefix + n: s for n, s in listing.items() if s >= 0}
    return TagFiles(prefix, ranks, model, sizes, skipped)


def _refuse_unsupported(name: str, size: int, source: str) -> None:
    """A clear error for DeepSpeed files of layouts ckptkit recognises but does not read."""
    if size < 0 and name == OFFLOAD_DIR:
        raise FormatError(
            f"{source}: {name}/ holds ZeRO-Infinity NVMe-offloaded optimizer state (swap "
            "files); ckptkit does not read NVMe-offloaded ZeRO checkpoints"
        )
    if PIPELINE_FILE.match(name) or MOE_FILE.search(name):
        raise FormatError(
            f"{source}: {name} is a DeepSpeed pipeline-parallel or MoE file; ckptkit reads "
            "ZeRO data-parallel checkpoints only (no pipeline / expert parallelism)"
        )
    found = OPTIM_FILE.match(name) or MODEL_FILE.match(name)
    if found and int(found.group(found.re.groups)) != 0:
        raise FormatError(
            f"{source}: {name} belongs to model-parallel rank "
            f"{int(found.group(found.re.groups))}; ckptkit reads ZeRO checkpoints without "
            "tensor/model parallelism only (mp_rank_00)"
        )


def _all_ranks(files: Mapping[int, str], world: int, source: str, what: str) -> list[str]:
    """Files of ranks 0..world-1 in order; a missing one named."""
    if max(files) >= world or len(files) != world:
        missing = first_missing(files, max(files) + 1)
        raise MissingFileError(
            f"{source}: {what} files of ranks {missing} are missing "
            f"({count_missing(files, max(files) + 1)} in all; found ranks up to {max(files)})"
        )
    return [files[r] for r in range(world)]


# --------------------------------------------------------------------------------------------
# Describing.


def describe(storage: Storage, files: list[str] | None = None) -> Catalog:
    """The catalog of a ZeRO tag directory, or of the tag its run directory's ``latest`` names."""
    listing = storage.listdir()
    prefix, metadata, skipped = "", (), {}
    if not _tag_evidence(listing) and LATEST in listing:
        tag = _latest(storage)
        if listing.get(tag) != -1:
            raise MissingFileError(f"{storage.describe(tag)}: missing ({LATEST} names it)")
        prefix, metadata = f"{tag}/", (LATEST,)
        skipped = {n: "DeepSpeed's converter script, not read" for n in SCRIPTS if n in listing}
    tag_files = _tag_files(storage, prefix)
    skipped.update(tag_files.skipped)
    names = [*tag_files.model, *tag_files.optim]
    pickled = load_pickles(storage, names, tag_files.sizes, allow=ZERO_GLOBALS)
    zero = _Zero([pickled[f] for f in tag_files.model], [pickled[f] for f in tag_files.optim])
    builder = CatalogBuilder(NAME, object_globals=ZERO_GLOBALS)
    builder.add_files(names)
    source = storage.describe(prefix.rstrip("/"))
    try:
        entries = list(zero.entries())
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
        raise FormatError(
            f"{source}: unexpected DeepSpeed ZeRO state ({type(exc).__name__}: {exc})"
        ) from exc
    builder.add_all(entries, source=source)
    return builder.build(
        Facts(
            metadata_files=metadata,
            world_size=zero.world,
            version=_text(zero.model0.value.get("ds_version")),
            checkpoint_id=prefix.rstrip("/") or None,
            layout=zero.layout_name,
            skipped_files=skipped,
            bookkeeping_keys=tuple(f"optimizer_state_dict.{k}" for k in zero.geometry_keys),
        )
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _need(mapping: Any, key: str, pickled: Pickled, where: str = "") -> Any:
    """``mapping[key]``, or a :class:`FormatError` naming the file and the key."""
    if is_opaque(mapping):
        raise FormatError(
            f"{pickled.source}: {where.rstrip('.') or 'the pickle'} is a "
            f"{type(mapping).global_name} object (not decoded, nothing run) where DeepSpeed "
            f"saves a dict holding {key!r}"
        )
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise FormatError(f"{pickled.source}: no {where + key!r}: not a DeepSpeed ZeRO file")
    return mapping[key]


def _dict(value: Any, pickled: Pickled, key: str) -> Mapping:
    """``value`` when it is a dict, else a :class:`FormatError` naming the file and key."""
    if not isinstance(value, Mapping):
        what = f"a {type(value).global_name} object" if is_opaque(value) else "not a dict"
        raise FormatError(
            f"{pickled.source}: {key!r} is {what} (nothing was run): not a DeepSpeed ZeRO file"
        )
    return value


def _ref(value: Any, pickled: Pickled, key: str) -> TensorRef:
    """A 1-D contiguous tensor (a flat partition or fragment), else a typed error."""
    if not isinstance(value, TensorRef) or len(value.shape) != 1 or value.stride != (1,):
        raise CorruptRecordError(f"{pickled.source}: {key!r} is not a 1-D contiguous tensor")
    return value


def _shape(value: Any, pickled: Pickled, key: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(n) is int and n >= 0 for n in value):
        raise CorruptRecordError(f"{pickled.source}: {key!r} is not a shape: {reprlib.repr(value)}")
    return value


class _Zero:
    """The decoded model-state and optimizer-state pickles of one tag, turned into entries."""

    def __init__(self, models: list[Pickled], optims: list[Pickled]) -> None:
        self.models, self.optims, self.model0 = models, optims, models[0]
        if not isinstance(self.model0.value, Mapping) or "module" not in self.model0.value:
            raise FormatError(
                f"{self.model0.source}: no 'module': not a DeepSpeed model-state file"
            )
        self.module = self.model0.value["module"]
        if not isinstance(self.module, Mapping):
            what = type(self.module).global_name if is_opaque(self.module) else "not a dict"
            raise FormatError(
                f"{self.model0.source}: 'module' is {what} (not decoded, nothing run), "
                "not the dict of module tensors DeepSpeed saves"
            )
        self.world = len(optims)
        self.osds = [
            _dict(_need(o.value, "optimizer_state_dict", o), o, "optimizer_state_dict")
            for o in optims
        ]
        self.stage, self.layout_name = self._stage()
        if self.stage == 3 and len(models) != self.world:
            raise FormatError(
                f"{self.model0.source}: stage 3 needs one model-state file per rank "
                f"({self.world}), found {len(models)}"
            )
        self.flat_key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        self.state_key = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        self.geometry_keys = [k for k in GEOMETRY_KEYS if k in self.osds[0]]
        self.flats = [self._flat_groups(rank) for rank in range(self.world)]
        dtypes = {ref.dtype for groups in self.flats for ref in groups}
        if len(dtypes) != 1:
            raise CorruptRecordError(
                f"{optims[0].source}: the {self.flat_key} tensors have dtypes "
                f"{sorted(d.name for d in dtypes)}, not one dtype"
            )
        self.dtype = dtypes.pop()

    def _stage(self) -> tuple[int, str]:
        """The ZeRO stage (``BF16_Optimizer``: 1) and a name for it; checks partition_count."""
        osd, source = self.osds[0], self.optims[0].source
        if not isinstance(osd, Mapping):
            raise FormatError(f"{source}: 'optimizer_state_dict' is not a dict")
        stage = osd.get("zero_stage")
        if stage is None and "single_partition_of_fp32_groups" in osd:
            found = 1, "DeepSpeed BF16_Optimizer (ZeRO stage 1)"
        elif type(stage) is int and 1 <= stage <= 3:
            found = stage, f"DeepSpeed ZeRO stage {stage}"
        else:
            raise FormatError(
                f"{source}: optimizer_state_dict has no fp32 partitions of ZeRO stage 1-3 "
                f"(zero_stage {stage!r}; NVMe-offloaded optimizer state is not supported)"
            )
        counts = osd.get("partition_count")
        ints = isinstance(counts, list) and counts and all(type(c) is int for c in counts)
        count = max(counts) if ints else counts
        if count != self.world:
            raise FormatError(
                f"{source}: partition_count {reprlib.repr(counts)} but {self.world} "
                "optimizer-state files: "
                "ranks missing or files of another save mixed in"
            )
        return found

    def _flat_groups(self, rank: int) -> list[TensorRef]:
        optim = self.optims[rank]
        groups = _need(self.osds[rank], self.flat_key, optim, "optimizer_state_dict.")
        if not isinstance(groups, list):
            raise FormatError(f"{optim.source}: {self.flat_key!r} is not a list")
        return [
            _ref(g, optim, f"optimizer_state_dict.{self.flat_key}.{i}")
            for i, g in enumerate(groups)
        ]

    # -- where the parameters lie ------------------------------------------------------------

    def _param_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        groups = _need(self.model0.value, "param_shapes", self.model0)
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise FormatError(f"{self.model0.source}: 'param_shapes' is not a list of dicts")
        return [
            [
                (str(name), _shape(shape, self.model0, f"param_shapes.{g}.{name}"))
                for name, shape in group.items()
            ]
            for g, group in enumerate(groups)
        ]

    def _layout(self, shapes: list[list[tuple[str, tuple[int, ...]]]]) -> Layout:
        """Where every trainable parameter lies, checked against what each rank holds."""
        source = self.optims[0].source
        try:
            if self.stage == 3:
                sizes = [g.shape[0] for g in self.flats[0]]
                for rank, groups in enumerate(self.flats):
                    if [g.shape[0] for g in groups] != sizes:
                        raise CorruptRecordError(
                            f"{self.optims[rank].source}: flat groups of "
                            f"{[g.shape[0] for g in groups]} elements, rank 0 has {sizes}"
                        )
                params = [(n, math.prod(s)) for group in shapes for n, s in group]
                layout = stage3_layout(params, self.world, sizes)
            else:
                if len(shapes) != len(self.flats[0]):
                    raise CorruptRecordError(
                        f"'param_shapes' lists {len(shapes)} groups, {source} has "
                        f"{len(self.flats[0])} fp32 partitions"
                    )
                pads = self.osds[0].get("param_alignment_paddings")
                groups = [[(n, math.prod(s)) for n, s in group] for group in shapes]
                layout = partitioned_layout(groups, self.world, pads)
        except CorruptRecordError as exc:
            if str(exc).startswith(("/", self.model0.source, source)):
                raise
            raise CorruptRecordError(
                f"{self.model0.source}: 'param_shapes' does not fit the fp32 partitions of "
                f"{source}: {exc}"
            ) from None
        for rank, groups in enumerate(self.flats):
            self._check_holds(rank, groups, layout, f"{self.flat_key}.{{group}}")
        if self.stage != 3:
            self._check_mappings(layout)
        return layout

    def _check_holds(self, rank: int, refs: list, layout: Layout, label: str) -> None:
        """Each of a rank's flat tensors holds at least what the layout puts there."""
        optim = self.optims[rank]
        if len(refs) != len(layout.needed[rank]):
            raise CorruptRecordError(
                f"{optim.source}: {len(refs)} tensors "
                f"{'optimizer_state_dict.' + label.format(group='*')!r}, the layout has "
                f"{len(layout.needed[rank])} groups"
            )
        for g, ref in enumerate(refs):
            need, most = layout.needed[rank][g], layout.capacity[rank][g]
            where = "optimizer_state_dict." + label.format(group=g)
            if not isinstance(ref, TensorRef) or len(ref.shape) != 1:
                raise CorruptRecordError(f"{optim.source}: {where!r} is not a 1-D tensor")
            if not need <= ref.shape[0] <= most:
                raise CorruptRecordError(
                    f"{optim.source}: {where!r} holds {ref.shape[0]} elements; 'param_shapes' "
                    f"in {self.model0.source} puts {need} on rank {rank} (at most {most})"
                )

    def _check_mappings(self, layout: Layout) -> None:
        """Stages 1/2: DeepSpeed's own ``param_slice_mappings`` must agree with the layout."""
        for rank, optim in enumerate(self.optims):
            mappings = self.osds[rank].get("param_slice_mappings")
            if not isinstance(mappings, list):
                continue
            held = {
                (p.group, name): (p.numel, p.offset)
                for name, pieces in layout.pieces.items()
                for p in pieces
                if p.rank == rank
            }
            for g, mapping in enumerate(mappings):
                if not isinstance(mapping, Mapping):
                    raise FormatError(f"{optim.source}: param_slice_mappings.{g} is not a dict")
                for name, address in mapping.items():
                    where = held.get((g, str(name)))
                    if not isinstance(address, FragmentAddress) or where != (
                        getattr(address, "numel", None),
                        getattr(address, "start", None),
                    ):
                        raise CorruptRecordError(
                            f"{optim.source}: 'optimizer_state_dict.param_slice_mappings.{g}."
                            f"{name}' is {address!r}; 'param_shapes' in {self.model0.source} "
                            f"puts (numel, start) {where} there"
                        )

    # -- entries ----------------------------------------------------------------------------

    def entries(self) -> Iterable[Entry]:
        """``model``, ``module``, ``optim`` and ``train`` entries, ``model`` in zero_to_fp32's
        order (buffers, frozen, trainable, tied)."""
        shapes = self._param_shapes()
        layout = self._layout(shapes)
        params = {name: shape for group in shapes for name, shape in group}
        model: dict[str, Entry] = {}
        for entry in [*self._buffers(), *self._frozen()]:
            model[entry.key] = entry
        for name, shape in params.items():
            key = f"model.{name}"
            if key in model:
                raise FormatError(
                    f"{self.model0.source}: {name!r} is both a trainable parameter and a buffer "
                    "or frozen parameter"
                )
            label = f"{self.flat_key}.{{group}}"
            chunks = self._chunks(key, shape, layout.pieces[name], label, self.flats, self.optims)
            model[key] = Entry(key, ("model", name), "tensor", chunks, self.dtype, shape)
        model.update(self._shared(model))
        yield from model.values()
        yield from self._module(params)
        yield from self._optim(params, layout)
        yield from self._train()

    def _chunks(
        self,
        key: str,
        shape: tuple[int, ...],
        pieces: list[Piece],
        label: str,
        refs: list[list[TensorRef]],
        files: list[Pickled],
    ) -> tuple[Chunk, ...]:
        """A parameter's chunks: per piece, a flat byte range of the rank file holding it
        (``refs[rank][group]``, named ``label`` in messages); checked to tile the parameter."""
        if not math.prod(shape):
            return (Chunk((0,) * len(shape), shape, None),)
        chunks = []
        for piece in pieces:
            pickled, ref = files[piece.rank], refs[piece.rank][piece.group]
            where = label.format(group=piece.group)
            if piece.offset + piece.numel > ref.shape[0]:
                raise CorruptRecordError(
                    f"{pickled.source}: {where!r} holds {ref.shape[0]} elements; {key!r} needs "
                    f"[{piece.offset}, {piece.offset + piece.numel}) of it"
                )
            base = tensor_record(where, ref, pickled.index, pickled.source)
            itemsize = ref.dtype.itemsize
            record = Record(
                pickled.file,
                base.offset + piece.offset * itemsize,
                piece.numel * itemsize,
                Encoding.RAW,
            )
            if shape == ():
                chunks.append(Chunk((), (), record, piece.rank))
            else:
                chunks.append(Chunk((piece.start,), (piece.numel,), record, piece.rank, flat=True))
        ranks = sorted({p.rank for p in pieces})
        check_chunks(
            key, shape, chunks, source=files[0].source, pieces=f"the pieces of ranks {ranks}"
        )
        return tuple(chunks)

    def _whole(
        self, key: str, path: tuple, ref: TensorRef, inner: list, pickled: Pickled | None = None
    ) -> Entry:
        """A tensor saved whole in a file (rank 0's model states by default), as one chunk."""
        pickled = pickled or self.model0
        record = tensor_record(".".join(map(str, inner)), ref, pickled.index, pickled.source)
        chunk = Chunk((0,) * len(ref.shape), ref.shape, record)
        return Entry(key, path, "tensor", (chunk,), ref.dtype, ref.shape)

    def _object(self, pickled: Pickled, key: str, path: tuple, inner: list) -> Entry:
        """A non-tensor leaf of a file's pickle."""
        record = pickle_leaf(
            pickled.file, pickled.offset, pickled.length, inner, crc32=pickled.crc32
        )
        return Entry(key, path, "object", (Chunk((), (), record),))

    def _buffers(self) -> Iterable[Entry]:
        names = self.model0.value.get("buffer_names") or []
        if not isinstance(names, list):
            raise FormatError(f"{self.model0.source}: 'buffer_names' is not a list")
        for name in names:
            ref = self.module.get(name)
            if isinstance(ref, TensorRef):
                yield self._whole(f"model.{name}", ("model", str(name)), ref, ["module", name])

    def _frozen(self) -> Iterable[Entry]:
        shapes = self.model0.value.get("frozen_param_shapes")
        if not shapes:
            return  # stage 1 saves none, so zero_to_fp32 outputs none
        if not isinstance(shapes, Mapping):
            raise FormatError(f"{self.model0.source}: 'frozen_param_shapes' is not a dict")
        for name, shape in shapes.items():
            name, key = str(name), f"model.{name}"
            where = f"frozen_param_fragments.{name}"
            shape = _shape(shape, self.model0, f"frozen_param_shapes.{name}")
            if self.stage != 3:  # saved whole
                frags = _need(self.model0.value, "frozen_param_fragments", self.model0)
                ref = _need(frags, name, self.model0, "frozen_param_fragments.")
                if not isinstance(ref, TensorRef) or ref.shape != shape:
                    raise CorruptRecordError(
                        f"{self.model0.source}: {where!r} is not a tensor of shape {list(shape)}"
                    )
                yield self._whole(key, ("model", name), ref, ["frozen_param_fragments", name])
                continue
            refs = []  # stage 3: each rank's padded slice, in its own model-state file
            for model in self.models:
                frags = _need(model.value, "frozen_param_fragments", model)
                refs.append(
                    [_ref(_need(frags, name, model, "frozen_param_fragments."), model, where)]
                )
            if len({r[0].dtype for r in refs}) != 1:
                raise CorruptRecordError(f"{self.model0.source}: {where!r} differs across ranks")
            pieces = [
                Piece(r, 0, 0, s, n) for r, s, n in stage3_slices(math.prod(shape), self.world)
            ]
            chunks = self._chunks(key, shape, pieces, where, refs, self.models)
            yield Entry(key, ("model", name), "tensor", chunks, refs[0][0].dtype, shape)

    def _shared(self, model: Mapping[str, Entry]) -> dict[str, Entry]:
        """Tied aliases (rank 0's ``shared_params``) with their source's chunks."""
        shared = self.model0.value.get("shared_params") or {}
        if not isinstance(shared, Mapping):
            raise FormatError(f"{self.model0.source}: 'shared_params' is not a dict")
        out = {}
        for alias, source in shared.items():
            found, key = model.get(f"model.{source}"), f"model.{alias}"
            if found is not None and key not in model:  # zero_to_fp32 ties what it rebuilt
                path = ("model", str(alias))
                out[key] = Entry(key, path, "tensor", found.chunks, found.dtype, found.shape)
        return out

    def _module(self, params: Mapping[str, Any]) -> Iterable[Entry]:
        """The module weights as saved (stage 3: only what is not a parameter placeholder)."""
        skip: set[str] = set()
        if self.stage == 3:
            frozen = self.model0.value.get("frozen_param_shapes") or {}
            shared = self.model0.value.get("shared_params") or {}
            skip = set(params) | set(map(str, frozen)) | set(map(str, shared))
        for name, value in self.module.items():
            name = str(name)
            if name in skip:
                continue
            path = ("module", name)
            if isinstance(value, TensorRef):
                yield self._whole(f"module.{name}", path, value, ["module", name])
            else:
                yield self._object(self.model0, f"module.{name}", path, ["module", name])

    # -- optimizer ---------------------------------------------------------------------------

    def _optim(self, params: Mapping[str, tuple[int, ...]], layout: Layout) -> Iterable[Entry]:
        """Optimizer state per parameter, the param groups and DeepSpeed's optimizer fields."""
        ids, states = self._base_states()
        stats = list(dict.fromkeys(str(stat) for group in states[0] for stat in group))
        per_param: dict[str, list[Entry]] = {name: [] for name in params}
        for stat in stats:
            refs = [[group.get(stat) for group in rank] for rank in states]
            found = [r for rank in refs for r in rank]
            label = f"{self.state_key}.state.{{group}}.{stat}"
            if all(isinstance(r, TensorRef) for r in found) and len({r.dtype for r in found}) > 1:
                raise CorruptRecordError(
                    f"{self.optims[0].source}: optimizer state {stat!r} has several dtypes "
                    "across ranks or groups"
                )
            if all(isinstance(r, TensorRef) and len(r.shape) == 1 for r in found):
                for rank, rank_refs in enumerate(refs):
                    self._check_holds(rank, rank_refs, layout, label)
                make = self._sliced
            elif all(isinstance(r, TensorRef) and r.shape == () for r in found):
                make = self._replicated
            else:
                make = self._state_object
            for name, shape in params.items():
                key = f"optim.state.{name}.{stat}"
                path = ("optim", "state", name, stat)
                per_param[name].append(
                    make(key, path, shape, layout.pieces[name], refs, ids, label)
                )
        for entries in per_param.values():
            yield from entries
        yield from self._param_groups()
        for field in self.osds[0]:
            if str(field) not in GEOMETRY_KEYS:
                path = ("optim", str(field))
                yield self._object(
                    self.optims[0], f"optim.{field}", path, ["optimizer_state_dict", field]
                )

    def _sliced(self, key, path, shape, pieces, refs, ids, label) -> Entry:
        """A state tensor shaped like the flat partitions: cut like the parameter."""
        chunks = self._chunks(key, shape, pieces, label, refs, self.optims)
        return Entry(key, path, "tensor", chunks, refs[0][0].dtype, shape)

    def _replicated(self, key, path, shape, pieces, refs, ids, label) -> Entry:
        """A 0-d state tensor of the parameter's group (``step``): every rank's copy."""
        group = pieces[0].group if pieces else 0
        chunks = []
        for rank, optim in enumerate(self.optims):
            inner = ["optimizer_state_dict", self.state_key, "state", ids[rank][group], path[-1]]
            whole = self._whole(key, path, refs[rank][group], inner, optim)
            chunk = whole.chunks[0]
            chunks.append(Chunk(chunk.offsets, chunk.sizes, chunk.record, rank))
        return Entry(key, path, "tensor", tuple(chunks), refs[0][group].dtype, ())

    def _state_object(self, key, path, shape, pieces, refs, ids, label) -> Entry:
        """Any other state value: rank 0's, as an object."""
        group = pieces[0].group if pieces else 0
        inner = ["optimizer_state_dict", self.state_key, "state", ids[0][group], path[-1]]
        return self._object(self.optims[0], key, path, inner)

    def _base_states(self) -> tuple[list[list], list[list[Mapping]]]:
        """Per rank: the base optimizer's parameter ids and their state, one per flat group."""
        all_ids, all_states = [], []
        for rank, optim in enumerate(self.optims):
            where = f"optimizer_state_dict.{self.state_key}."
            base = _need(self.osds[rank], self.state_key, optim, "optimizer_state_dict.")
            state = _need(base, "state", optim, where)
            groups = _need(base, "param_groups", optim, where)
            ids = [
                pid
                for group in (groups if isinstance(groups, list) else [])
                if isinstance(group, Mapping) and isinstance(group.get("params"), list)
                for pid in group["params"]
            ]
            if len(ids) != len(self.flats[rank]) or not isinstance(state, Mapping):
                raise FormatError(
                    f"{optim.source}: the base optimizer lists {len(ids)} parameters; the "
                    f"checkpoint has {len(self.flats[rank])} flat partitions"
                )
            if not all(type(pid) in (int, str) for pid in ids):
                raise FormatError(f"{optim.source}: {where}param_groups lists odd parameter ids")
            values = [state.get(pid, {}) for pid in ids]
            if not all(isinstance(v, Mapping) for v in values):
                raise FormatError(f"{optim.source}: {where}state holds a non-dict")
            all_ids.append(ids)
            all_states.append(values)
        return all_ids, all_states

    def _param_groups(self) -> Iterable[Entry]:
        """Rank 0's base-optimizer param groups, leaf by leaf."""
        groups = self.osds[0][self.state_key]["param_groups"]
        inner0 = ["optimizer_state_dict", self.state_key, "param_groups"]
        for inner, _ in leaves(groups):
            path = ("optim", "param_groups", *inner)
            key = ".".join(map(str, path))
            yield self._object(self.optims[0], key, path, [*inner0, *inner])

    def _train(self) -> Iterable[Entry]:
        """Everything else rank 0's model states hold, under ``train``."""
        for inner, leaf in leaves(self.model0.value):
            if inner and inner[0] in MODEL_KEYS:
                continue
            path = ("train", *inner)
            key = ".".join(map(str, path))
            if isinstance(leaf, TensorRef):
                yield self._whole(key, path, leaf, list(inner))
            else:
                yield self._object(self.model0, key, path, list(inner))
