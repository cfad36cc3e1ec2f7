"""The decoded model-state and optimizer-state pickles of one ZeRO tag, checked: the stage,
each rank's flat fp32 partitions, where every trainable parameter lies in them (against
what each rank holds and DeepSpeed's own ``param_slice_mappings``), and the chunk and entry
builders the model-state and optimizer entries share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...catalog.coverage import check_chunks
from ...catalog.model import Chunk, Encoding, Entry, Record, pickle_leaf
from ...decoding.bounded_repr import bounded_repr
from ...decoding.unpickler import TensorRef, is_opaque
from ...errors import CorruptRecordError, FormatError
from ..parts.torch_save_files import Pickled, tensor_record
from .geometry import Layout, Piece, partitioned_layout, stage3_layout
from .pickles import FragmentAddress

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


def need_key(mapping: Any, key: str, pickled: Pickled, where: str = "") -> Any:
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


def flat_tensor(value: Any, pickled: Pickled, key: str) -> TensorRef:
    """A 1-D contiguous tensor (a flat partition or fragment), else a typed error."""
    if not isinstance(value, TensorRef) or len(value.shape) != 1 or value.stride != (1,):
        raise CorruptRecordError(f"{pickled.source}: {key!r} is not a 1-D contiguous tensor")
    return value


def checked_shape(value: Any, pickled: Pickled, key: str) -> tuple[int, ...]:
    """A saved shape (a tuple of non-negative ints), else a typed error naming the key."""
    if not isinstance(value, tuple) or not all(type(n) is int and n >= 0 for n in value):
        raise CorruptRecordError(f"{pickled.source}: {key!r} is not a shape: {bounded_repr(value)}")
    return value


class ZeroState:
    """The decoded pickles of one tag, checked, and where its trainable parameters lie;
    the chunk and entry builders the model-state and optimizer entries share."""

    def __init__(
        self, models: list[Pickled], optims: list[Pickled], *, pipeline_stage: int | None = None
    ) -> None:
        self.models, self.optims, self.model0 = models, optims, models[0]
        if not isinstance(self.model0.value, Mapping) or "module" not in self.model0.value:
            raise FormatError(
                f"{self.model0.source}: no 'module': not a DeepSpeed model-state file"
            )
        self.module = self.model0.value["module"]
        self.world = len(optims)
        #: the global rank of this tag's DP rank 0 (a pipeline stage's: stage × DP world size)
        self.rank_base = (pipeline_stage or 0) * self.world
        if pipeline_stage is not None:  # the layer files hold the module
            if self.module is not None:
                raise FormatError(
                    f"{self.model0.source}: 'module' holds the module weights, but pipeline "
                    "layer files lie beside it (a pipeline save leaves it None): files of two "
                    "saves mixed"
                )
            self.module = {}
        if not isinstance(self.module, Mapping):
            what = type(self.module).global_name if is_opaque(self.module) else "not a dict"
            raise FormatError(
                f"{self.model0.source}: 'module' is {what} (not decoded, nothing run), "
                "not the dict of module tensors DeepSpeed saves"
            )
        self.osds = [
            _dict(need_key(o.value, "optimizer_state_dict", o), o, "optimizer_state_dict")
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
                f"{source}: partition_count {bounded_repr(counts)} but {self.world} "
                "optimizer-state files: "
                "ranks missing or files of another save mixed in"
            )
        return found

    def _flat_groups(self, rank: int) -> list[TensorRef]:
        optim = self.optims[rank]
        groups = need_key(self.osds[rank], self.flat_key, optim, "optimizer_state_dict.")
        if not isinstance(groups, list):
            raise FormatError(f"{optim.source}: {self.flat_key!r} is not a list")
        return [
            flat_tensor(g, optim, f"optimizer_state_dict.{self.flat_key}.{i}")
            for i, g in enumerate(groups)
        ]

    def _param_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        groups = need_key(self.model0.value, "param_shapes", self.model0)
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise FormatError(f"{self.model0.source}: 'param_shapes' is not a list of dicts")
        return [
            [
                (str(name), checked_shape(shape, self.model0, f"param_shapes.{g}.{name}"))
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
                chunks.append(Chunk((), (), record, self.rank_base + piece.rank))
            else:
                rank = self.rank_base + piece.rank
                chunks.append(Chunk((piece.start,), (piece.numel,), record, rank, flat=True))
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


__all__ = ["GEOMETRY_KEYS", "ZeroState", "checked_shape", "flat_tensor", "need_key"]
