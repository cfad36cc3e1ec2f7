"""A Megatron tensor- (and pipeline-) parallel model as one TP=1, PP=1 state dict, shared by
the adapters whose rank files hold Megatron's parameter names (Megatron-LM legacy
``model_optim_rng.pt``, NeMo's ``mp_rank_XX/model_weights.ckpt``): each parameter's pieces from
the TP ranks of its pipeline stage become chunks at their offsets along the split dimension
:mod:`.megatron_tp_rules` gives, and each stage's layers are renumbered by the stage's offset.

Nothing is copied: a chunk is a RAW record over one rank file's storage (a SwiGLU piece is two
records, its gate and up halves). Shapes are checked against the model's sizes
(:class:`~.megatron_tp_rules.ModelArgs`) before any chunk is made; a parameter without a rule,
or whose pieces disagree with the sizes or with each other, refuses the checkpoint (the
caller's :class:`~.megatron_tp_rules.MegatronTPError` class, naming the file and key).

The copies of a replicated parameter (one per TP rank), and a tied copy of the word
embeddings, should hold the same bytes: reads give TP rank 0's copy (what Megatron's converters
keep), so copies that differ are reported (:func:`warn_differing_copies`), never silently
dropped. They are compared by the CRC-32 torch.save zips store for every storage (no byte is
read); records without one (pre-1.6 files, views of part of a storage) are read and compared, up
to :data:`~ckptkit.tunables.BATCH_BYTES` in all, the rest reported as not compared.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ... import tunables
from ...catalog.model import Chunk, Encoding, Entry, Record
from ...storage import Store
from .megatron_tp_rules import (
    EXTRA_STATE,
    LAYER_KEY,
    MegatronTPError,
    ModelArgs,
    Rule,
    Split,
    rule_for,
)

__all__ = [
    "MODEL_GROUP",
    "TIED_GROUP",
    "Copies",
    "MergedModel",
    "Naming",
    "TPRank",
    "differing_copies",
    "merge_model",
    "warn_differing_copies",
]

MODEL_GROUP = "model"
#: The alternate group of the last stage's copy of tied word embeddings (PP > 1): readable, left
#: out of whole-checkpoint operations (a TP=1, PP=1 model stores the embeddings once).
TIED_GROUP = "tied_copy"


class TPRank(Protocol):
    """One model-parallel rank's file: its folder (``label``), ``file`` (under the checkpoint),
    tensor- and pipeline-parallel ranks, and ``rank``, the rank its chunks carry."""

    @property
    def label(self) -> str: ...
    @property
    def file(self) -> str: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def rank(self) -> int: ...


@dataclass(frozen=True)
class Copies:
    """Records that should hold the same bytes (a replicated parameter on each TP rank, or a
    tied copy and the embeddings it copies), for :func:`differing_copies`."""

    key: str
    labels: tuple[str, ...]
    records: tuple[Record | None, ...]


@dataclass(frozen=True)
class MergedModel:
    """The merged model's entries (``model.*`` and ``tied_copy.*``) and the copies to compare."""

    entries: list[Entry]
    copies: list[Copies]


@dataclass(frozen=True)
class Naming:
    """Where Megatron's parameter names are in the rank files' entries and where the merged
    ones go: ``skip`` leading path parts dropped (Megatron-LM: ``(_, "model")``), then the
    dotted ``prefix`` the names start with (NeMo: ``model.``, its module holding Megatron's);
    merged entries are ``group`` + the rest of the path (layer index renumbered)."""

    group: str = MODEL_GROUP
    skip: int = 2
    prefix: str = ""


def merge_model(
    ranks: Sequence[TPRank],
    leaves: dict[str, list[Entry]],
    args: ModelArgs,
    describe: Callable[[str], str],
    *,
    naming: Naming = Naming(),
    error: type[MegatronTPError] = MegatronTPError,
) -> MergedModel:
    """Merge the model leaves of every rank file (``leaves[label]``: entries whose path is
    ``(_, "model", *inner)``, as :func:`~.torch_save_files.pickle_entries` gives them, or as
    ``naming`` says); ``describe(file)`` names a file in messages; refusals are ``error``."""
    merger = _Merger(args, describe, naming, error)
    for stage in range(args.pp):
        merger.stage(stage, [r for r in ranks if r.pp == stage], leaves)
    return MergedModel(merger.entries, merger.copies)


class _Merger:
    """One merge: entries and copies so far, and where each key came from."""

    def __init__(
        self,
        args: ModelArgs,
        describe: Callable[[str], str],
        naming: Naming,
        error: type[MegatronTPError],
    ) -> None:
        self.args = args
        self.describe = describe
        self.naming = naming
        self.error = error
        self.entries: list[Entry] = []
        self.copies: list[Copies] = []
        self.placed: dict[str, str] = {}  # merged key → the file it came from
        self.embeddings: tuple[Entry, tuple[TPRank, ...]] | None = None
        self.tied: list[tuple[Entry, tuple[TPRank, ...]]] = []

    def text(self, entry: Entry) -> str:
        """An entry's dotted path after the skipped parts (Megatron's name, with ``prefix``)."""
        return ".".join(map(str, entry.path[self.naming.skip :]))

    def refuse(self, rank: TPRank, name: str, why: str) -> MegatronTPError:
        key = f"{self.naming.group}.{self.naming.prefix}{name}"
        return self.error(f"{self.describe(rank.file)}: {key!r} {why}", file=rank.file, key=key)

    def stage(self, stage: int, ranks: list[TPRank], leaves: dict[str, list[Entry]]) -> None:
        """Merge one pipeline stage's TP ranks (``ranks`` in TP order)."""
        tables = [self.named(r, leaves[r.label]) for r in ranks]
        first = ranks[0]
        for rank, table in zip(ranks[1:], tables[1:], strict=True):
            for name in sorted(tables[0].keys() ^ table.keys()):
                holder, lacking = (first, rank) if name in tables[0] else (rank, first)
                raise self.refuse(
                    lacking, name, f"is missing, but {self.describe(holder.file)} holds it"
                )
        offset = self.args.stage_offsets[stage]
        layers: set[int] = set()
        for name, entry in tables[0].items():
            pieces = [table[name] for table in tables]
            path = entry.path[self.naming.skip :]
            layer = LAYER_KEY.match(name)
            if layer:
                local = int(layer.group("index"))
                if local >= self.args.stage_layers[stage]:
                    raise self.refuse(
                        first,
                        name,
                        f"is layer {local} of pipeline stage {stage}, which holds "
                        f"{self.args.stage_layers[stage]} layers by args (num_layers "
                        f"{self.args.num_layers}, PP={self.args.pp})",
                    )
                layers.add(local)
                shift = len(self.naming.prefix)
                path = _renumbered(
                    path, shift + layer.start("index"), shift + layer.end("index"), offset + local
                )
            if name.rsplit(".", 1)[-1] == EXTRA_STATE:
                self.add(self.per_rank(name, path, pieces, ranks), first)
                continue
            group = self.group_of(name, stage, first)
            rule = rule_for(name, self.args)
            if rule is None:
                raise self.refuse(
                    first,
                    name,
                    "has no Megatron tensor-parallel rule ckptkit knows (not a GPT "
                    "embedding, attention, MLP or norm parameter): its split dimension is "
                    "unknown, so the ranks are not merged",
                )
            merged = self.merged((group, *path), name, rule, pieces, ranks)
            self.add(merged, first)
            if group == TIED_GROUP:
                self.tied.append((merged, tuple(ranks)))
            elif name.endswith("word_embeddings.weight"):
                self.embeddings = (merged, tuple(ranks))
        expected = set(range(self.args.stage_layers[stage]))
        if layers != expected and self.args.stage_layers[stage]:
            missing = sorted(expected - layers)
            raise self.error(
                f"{self.describe(first.file)}: pipeline stage {stage} holds layers "
                f"{sorted(layers)}, args say {self.args.stage_layers[stage]} (missing "
                f"{missing})",
                file=first.file,
                key="model",
            )
        if stage == self.args.pp - 1:
            self.pair_tied_copies()

    def named(self, rank: TPRank, entries: list[Entry]) -> dict[str, Entry]:
        """A rank's entries by Megatron name: the dotted path after the skipped parts, less
        ``prefix`` (an entry without it is refused: not a parameter of Megatron's model)."""
        prefix = self.naming.prefix
        found: dict[str, Entry] = {}
        for entry in entries:
            text = self.text(entry)
            if not text.startswith(prefix):
                raise self.error(
                    f"{self.describe(rank.file)}: {entry.key!r} is not under {prefix!r} (the "
                    "module holding Megatron's model): it has no tensor-parallel rule, so the "
                    "ranks are not merged",
                    file=rank.file,
                    key=entry.key,
                )
            found[text[len(prefix) :]] = entry
        return found

    def add(self, entry: Entry, rank: TPRank) -> None:
        if entry.key in self.placed:
            raise self.error(
                f"{self.describe(rank.file)}: {entry.key!r} is also in "
                f"{self.describe(self.placed[entry.key])}: two pipeline stages hold it",
                file=rank.file,
                key=entry.key,
            )
        self.placed[entry.key] = rank.file
        self.entries.append(entry)

    def group_of(self, name: str, stage: int, rank: TPRank) -> str:
        """``tied_copy`` for the last stage's copy of tied embeddings, else ``model``."""
        last = stage == self.args.pp - 1 and self.args.pp > 1
        if name == "word_embeddings_for_head.weight":
            if not (last and self.args.tied):
                raise self.refuse(
                    rank,
                    name,
                    "is the head's copy of tied word embeddings, held only by the last of "
                    "several pipeline stages, but args say "
                    + ("untied embeddings" if not self.args.tied else f"PP={self.args.pp}"),
                )
            return TIED_GROUP
        if name == "output_layer.weight" and self.args.tied:
            if not last:
                raise self.refuse(
                    rank,
                    name,
                    "is saved, but args say the output layer shares the word embeddings "
                    "(no untie_embeddings_and_output_weights) with a single pipeline stage",
                )
            return TIED_GROUP
        return self.naming.group

    # ----------------------------------------------------------------------------------------

    def merged(
        self,
        path: tuple,
        name: str,
        rule: Rule,
        pieces: list[Entry],
        ranks: list[TPRank],
    ) -> Entry:
        """One parameter from its TP pieces, checked against ``rule``."""
        piece_shape = self.checked_piece_shape(name, rule, pieces, ranks)
        key = ".".join(map(str, path))
        dtype = pieces[0].dtype
        full, dim = rule.shape, rule.split.dim
        chunks: list[Chunk] = []
        for piece, rank in zip(pieces, ranks, strict=True):
            record = piece.chunks[0].record
            if dim is None:
                chunks.append(Chunk((0,) * len(full), full, record, rank.rank))
            elif rule.split is Split.GATED:
                half = piece_shape[0] // 2
                rest = piece_shape[1:]
                for part, start in enumerate((rank.tp * half, full[0] // 2 + rank.tp * half)):
                    sub = _rows(record, piece_shape, dtype.itemsize, part * half, (part + 1) * half)
                    chunks.append(Chunk((start, *(0,) * len(rest)), (half, *rest), sub, rank.rank))
            else:
                offsets = tuple(
                    rank.tp * piece_shape[d] if d == dim else 0 for d in range(len(full))
                )
                chunks.append(Chunk(offsets, piece_shape, record, rank.rank))
        if dim is None and len(ranks) > 1:
            self.copies.append(
                Copies(
                    key,
                    tuple(r.label for r in ranks),
                    tuple(p.chunks[0].record for p in pieces),
                )
            )
        return Entry(key, path, "tensor", tuple(chunks), dtype, full)

    def checked_piece_shape(
        self, name: str, rule: Rule, pieces: list[Entry], ranks: list[TPRank]
    ) -> tuple[int, ...]:
        """The shape each TP rank's piece has by ``rule`` and ``args``, once every piece is a
        tensor of that shape and of one dtype."""
        for piece, rank in zip(pieces, ranks, strict=True):
            if piece.kind != "tensor":
                raise self.refuse(rank, name, f"is not a tensor (the {rule.what})")
        dtypes = {piece.dtype for piece in pieces}
        if len(dtypes) > 1:
            raise self.refuse(
                ranks[0], name, f"has dtypes {sorted(d.name for d in dtypes)} on its TP ranks"
            )
        tp, full, dim = self.args.tp, rule.shape, rule.split.dim
        parts = tp * (2 if rule.split is Split.GATED else 1)
        if dim is not None and (len(full) <= dim or full[dim] % parts):
            raise self.refuse(
                ranks[0],
                name,
                f"cannot be split: args give it shape {list(full)} ({rule.what}), not "
                f"divisible by TP={tp}; {self.args_text()}",
            )
        if rule.what.startswith("QKV") and self.args.groups % tp:
            raise self.refuse(
                ranks[0],
                name,
                f"holds {self.args.groups} query groups (args), not divisible by TP={tp}: "
                "a TP rank would hold part of a group",
            )
        piece_shape = full if dim is None else (*full[:dim], full[dim] // tp, *full[dim + 1 :])
        for piece, rank in zip(pieces, ranks, strict=True):
            if piece.shape != piece_shape:
                raise self.refuse(
                    rank,
                    name,
                    f"has shape {list(piece.shape)} on TP rank {rank.tp}, but args give "
                    f"{list(piece_shape)} per rank ({list(full)} whole, {rule.what}, "
                    f"TP={tp}); {self.args_text()}",
                )
        return piece_shape

    def per_rank(self, name: str, path: tuple, pieces: list[Entry], ranks: list[TPRank]) -> Entry:
        """A module's ``_extra_state``: each TP rank's own value (objects, or tensors of one
        shape), rank 0's first: reads give TP rank 0's, ``rank=`` another's."""
        first = pieces[0]
        for piece, rank in zip(pieces, ranks, strict=True):
            if (piece.kind, piece.dtype, piece.shape) != (first.kind, first.dtype, first.shape):
                raise self.refuse(
                    rank,
                    name,
                    "differs in kind, dtype or shape between TP ranks: each rank's extra "
                    "state cannot be kept as copies of one value",
                )
        key = ".".join(map(str, (self.naming.group, *path)))
        chunks = tuple(
            Chunk(piece.chunks[0].offsets, piece.chunks[0].sizes, piece.chunks[0].record, rank.rank)
            for piece, rank in zip(pieces, ranks, strict=True)
        )
        return Entry(
            key,
            (self.naming.group, *path),
            first.kind,
            chunks,
            first.dtype,
            first.shape,
            tensor_class=first.tensor_class,
        )

    def pair_tied_copies(self) -> None:
        """Each tied copy's TP pieces against the word embeddings' on the same TP rank."""
        if self.embeddings is None:
            return
        embeddings, embedding_ranks = self.embeddings
        for copy, copy_ranks in self.tied:
            if copy.shape != embeddings.shape or copy.dtype != embeddings.dtype:
                raise self.error(
                    f"{self.describe(copy_ranks[0].file)}: {copy.key!r} (shape "
                    f"{list(copy.shape)}, {copy.dtype.name}) is a copy of the tied "
                    f"{embeddings.key!r} (shape {list(embeddings.shape)}, "
                    f"{embeddings.dtype.name}), but they differ",
                    file=copy_ranks[0].file,
                    key=copy.key,
                )
            for ours, theirs, a, b in zip(
                copy.chunks, embeddings.chunks, copy_ranks, embedding_ranks, strict=True
            ):
                self.copies.append(
                    Copies(
                        f"{copy.key} (TP rank {a.tp})",
                        (a.label, b.label),
                        (ours.record, theirs.record),
                    )
                )

    def args_text(self) -> str:
        a = self.args
        return (
            f"args: hidden_size {a.hidden}, ffn_hidden_size {a.ffn}, num_attention_heads "
            f"{a.heads}, query groups {a.groups}, kv_channels {a.kv_channels}, padded vocab "
            f"{a.vocab}, swiglu {a.swiglu}"
        )


def _renumbered(path: tuple, start: int, end: int, index: int) -> tuple:
    """``path`` with the layer index at ``[start, end)`` of its dotted key replaced."""
    out = []
    at = 0
    for part in path:
        text = str(part)
        if at <= start and end <= at + len(text):
            part = (
                index
                if isinstance(part, int)
                else text[: start - at] + str(index) + text[end - at :]
            )
        out.append(part)
        at += len(text) + 1
    return tuple(out)


def _rows(
    record: Record | None, shape: tuple[int, ...], itemsize: int, start: int, stop: int
) -> Record | None:
    """The RAW record of rows ``[start, stop)`` of a tensor ``shape`` that ``record`` holds."""
    sizes = (stop - start, *shape[1:])
    if record is None or not math.prod(sizes):
        return None
    stride = record.stride or tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, stride, strict=True))
    return Record(
        record.file,
        record.offset + (record.storage_offset + start * stride[0]) * itemsize,
        extent * itemsize,
        Encoding.RAW,
        stride=tuple(stride),
    )


# --------------------------------------------------------------------------------------------
# Copies that should hold the same bytes.


def differing_copies(storage: Store, copies: list[Copies]) -> tuple[list[str], list[str]]:
    """``(differing, unchecked)``: each a list of ``'model.x (mp_rank_00 vs mp_rank_01)'``."""
    differing: list[str] = []
    unchecked: list[str] = []
    to_read: list[Copies] = []
    budget = tunables.BATCH_BYTES
    for item in copies:
        records = item.records
        if all(r is None for r in records):
            continue  # no elements
        if any(r is None for r in records):
            differing.append(_shown(item, 0, records.index(None)))
            continue
        if all(r.crc32 is not None for r in records):
            first = (records[0].crc32, records[0].length)
            odd = next((i for i, r in enumerate(records) if (r.crc32, r.length) != first), None)
            if odd is not None:
                differing.append(_shown(item, 0, odd))
            continue
        layouts = {(r.length, r.stride) for r in records}
        size = sum(r.length for r in records)
        if len(layouts) > 1 or size > budget:
            unchecked.append(_shown(item, 0, len(records) - 1))
            continue
        budget -= size
        to_read.append(item)
    if to_read:
        ranges = [(r.file, r.offset, r.offset + r.length) for item in to_read for r in item.records]
        blobs = iter(storage.read_ranges(ranges))
        for item in to_read:
            data = [next(blobs) for _ in item.records]
            odd = next((i for i, blob in enumerate(data) if blob != data[0]), None)
            if odd is not None:
                differing.append(_shown(item, 0, odd))
    return differing, unchecked


def _shown(item: Copies, a: int, b: int) -> str:
    return f"{item.key} ({item.labels[a]} vs {item.labels[b]})"


def warn_differing_copies(storage: Store, copies: list[Copies]) -> None:
    """A warning naming the copies that differ (or could not be compared), if any."""
    differing, unchecked = differing_copies(storage, copies)
    if differing:
        shown = ", ".join(differing[:4]) + (
            f" and {len(differing) - 4} more" if len(differing) > 4 else ""
        )
        many = len(differing) > 1
        warnings.warn(
            f"{storage.describe()}: {len(differing)} {'copies' if many else 'copy'} of "
            f"replicated or tied parameters {'differ' if many else 'differs'} between the ranks "
            f"holding {'them' if many else 'it'}: {shown}; reads and unshard give TP rank 0's "
            "copy (as Megatron's converters keep), read(key, rank=N) gives rank N's",
            stacklevel=3,
        )
    if unchecked:
        shown = ", ".join(unchecked[:4]) + (
            f" and {len(unchecked) - 4} more" if len(unchecked) > 4 else ""
        )
        warnings.warn(
            f"{storage.describe()}: copies of replicated parameters not compared across ranks "
            f"(no CRC-32 stored, too large or laid out differently): {shown}",
            stacklevel=3,
        )
