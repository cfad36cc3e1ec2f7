"""DeepSpeed pipeline-parallel tags (``PipelineModule``): the layer files as the model, each
stage's ZeRO (stage 0-1) optimizer partitions as the optimizer.

What DeepSpeed writes (``PipelineEngine.save_checkpoint``): one ``layer_XX-model_states.pt`` per
layer holding a ``state_dict()`` (``XX`` the global layer index; functions have none; a
``TiedLayerSpec`` with a ``forward_fn`` neither), one ``mp_rank_{stage}_model_states.pt`` per
stage (``module`` None; ``param_shapes`` / ``buffer_names`` name the stage's parameters as
``PipelineModule.state_dict()`` does) and, per stage, ``zero_pp_rank_{dp}_mp_rank_{stage}_
optim_states.pt`` of its data-parallel ranks: a ZeRO stage-1 checkpoint of that stage's
parameters, read with the ZeRO machinery (:class:`.state.ZeroState`).

Keys:

* ``model.<name>``: each layer file's tensors (and objects) as saved, named as
  ``PipelineModule.state_dict()`` names them: ``<layer>.<param>``, or
  ``tied_modules.<key>.<param>`` for a tied layer (told apart by the stages' ``param_shapes``
  and ``buffer_names``, which name it so); a tied module saved by several layers is one entry
  with a chunk per file. This is what DeepSpeed's ``load_checkpoint`` puts in the module.
* ``optim.fp32.<name>``: the fp32 master weights from the stages' flat partitions.
* ``optim.state.<name>.<stat>``: the optimizer state, cut like the masters. A tied parameter
  is in the partitions of every stage using it (kept equal by DeepSpeed): the first stage's
  copy is read, the others are counted as file overhead.
* ``optim.param_groups.*``, ``optim.<field>`` and ``train.*``: stage 0's (global rank 0's),
  as objects, as for ZeRO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from ...catalog.model import Entry
from ...decoding.unpickler import TensorRef, is_opaque
from ...errors import CorruptRecordError, FormatError, MissingFileError, UnsupportedLayoutError
from ..parts.torch_save_files import Pickled
from .detection import TagFiles
from .model_states import ModelStateEntries
from .optimizer import OptimizerEntries

TIED = "tied_modules"


class _Stage(ModelStateEntries, OptimizerEntries):
    """One pipeline stage's model states and ZeRO optimizer partitions."""

    def names(self) -> dict[str, tuple[int, ...] | None]:
        """The stage's parameter and buffer names (``PipelineModule.state_dict()`` names) and
        the shapes of those the optimizer holds (buffers: None)."""
        found: dict[str, tuple[int, ...] | None] = {}
        buffers = self.model0.value.get("buffer_names") or []
        if not isinstance(buffers, list):
            raise FormatError(f"{self.model0.source}: 'buffer_names' is not a list")
        found.update((str(name), None) for name in buffers)
        for group in self._param_shapes():
            found.update(group)
        return found

    def optimizer_entries(self) -> tuple[dict[str, Entry], list[Entry]]:
        """``optim.fp32.<name>`` and ``optim.state.<name>.<stat>`` by key, and the stage's
        other optimizer entries (param groups, DeepSpeed's fields)."""
        shapes = self._param_shapes()
        layout = self._layout(shapes)
        params = {name: shape for group in shapes for name, shape in group}
        per_param: dict[str, Entry] = {}
        for name, shape in params.items():
            key = f"optim.fp32.{name}"
            label = f"{self.flat_key}.{{group}}"
            chunks = self._chunks(key, shape, layout.pieces[name], label, self.flats, self.optims)
            per_param[key] = Entry(
                key, ("optim", "fp32", name), "tensor", chunks, self.dtype, shape
            )
        others = []
        for entry in self._optim(params, layout):
            if entry.path[1] == "state":
                per_param[entry.key] = entry
            else:
                others.append(entry)
        return per_param, others


class PipelineTag:
    """The decoded files of one pipeline-parallel tag, turned into entries."""

    def __init__(self, files: TagFiles, pickled: Mapping[str, Pickled]) -> None:
        if not files.optim:
            _refuse_without_partitions(pickled[files.model[0]])
        self.stages = [
            _Stage([pickled[s.model]], [pickled[f] for f in s.optim], pipeline_stage=stage)
            for stage, s in enumerate(files.stages)
        ]
        self.layers = {index: pickled[file] for index, file in files.layers.items()}
        first = self.stages[0]
        self.model0, self.geometry_keys = first.model0, first.geometry_keys
        self.data_parallel = first.world
        self.world = len(self.stages) * self.data_parallel
        ranks = "rank" if self.data_parallel == 1 else "ranks"
        self.layout_name = (
            f"DeepSpeed pipeline parallel ({len(self.stages)} stages × {self.data_parallel} "
            f"data-parallel {ranks}), {first.layout_name.removeprefix('DeepSpeed ')}"
        )
        for stage in self.stages:
            self._check_dimensions(stage)

    def _check_dimensions(self, stage: _Stage) -> None:
        """The parallel degrees a stage's model states record agree with the files found."""
        value, source = stage.model0.value, stage.model0.source
        dims = value.get("checkpoint_parallel_dimensions")
        tp = dims.get("tp_degree") if isinstance(dims, Mapping) else None
        if type(tp) is int and tp > 1:
            raise UnsupportedLayoutError(
                f"{source}: saved with tensor parallelism (tp_degree {tp}) besides the pipeline; "
                "ckptkit reads DeepSpeed pipeline checkpoints without tensor parallelism only "
                "(the layer files do not record which dimension each tensor is split along)"
            )
        pp = dims.get("pp_degree") if isinstance(dims, Mapping) else value.get("mp_world_size")
        if type(pp) is int and pp != len(self.stages):
            raise MissingFileError(
                f"{source}: a pipeline of {pp} stages, but {len(self.stages)} stages' "
                "mp_rank_XX_model_states.pt files are here"
            )
        dp = value.get("dp_world_size")
        if type(dp) is int and dp != stage.world:
            raise MissingFileError(
                f"{source}: {dp} data-parallel ranks, but {stage.world} optimizer-state files "
                "of this stage are here"
            )

    def entries(self) -> Iterable[Entry]:
        """``model`` (layer files), ``optim`` (masters and state: first stage holding each
        parameter; stage 0's param groups and fields) and ``train`` (stage 0's) entries."""
        names: dict[str, tuple[int, ...] | None] = {}
        named_by: dict[str, Pickled] = {}  # the model states naming each
        for stage in self.stages:
            for name, shape in stage.names().items():
                names.setdefault(name, shape)
                named_by.setdefault(name, stage.model0)
        model = self._layer_entries(names)
        self._check_named(model, names, named_by)
        yield from model.values()
        per_param: dict[str, Entry] = {}
        others: list[Entry] = []
        for index, stage in enumerate(self.stages):
            found, rest = stage.optimizer_entries()
            for key, entry in found.items():
                kept = per_param.setdefault(key, entry)
                if (kept.shape, kept.dtype) != (entry.shape, entry.dtype):
                    raise CorruptRecordError(
                        f"{stage.optims[0].source}: {key!r} is {entry.dtype} {list(entry.shape)}; "
                        f"an earlier stage's (a tied parameter) is {kept.dtype} {list(kept.shape)}"
                    )
            if index == 0:
                others = rest
        yield from per_param.values()
        yield from others
        yield from self.stages[0]._train()

    def _layer_entries(self, names: Mapping[str, tuple[int, ...] | None]) -> dict[str, Entry]:
        """Every layer file's leaves as ``model.<prefix><name>`` (a tied module saved by several
        layers: one entry, a chunk per file)."""
        tied = _tied_modules(names)
        plain = {int(head) for head, _, _ in (n.partition(".") for n in names) if head.isdigit()}
        stage = self.stages[0]
        model: dict[str, Entry] = {}
        for index, pickled in self.layers.items():
            state = pickled.value
            if not isinstance(state, Mapping):
                what = f"a {type(state).global_name} object" if is_opaque(state) else "not a dict"
                raise FormatError(
                    f"{pickled.source}: {what} (nothing was run), not the state dict of a "
                    "pipeline layer"
                )
            prefix = f"{index}." if index in plain else _tied_prefix(index, state, tied, pickled)
            for name, value in state.items():
                if not isinstance(name, str):
                    raise FormatError(f"{pickled.source}: a key {name!r} that is not a string")
                key, path = f"model.{prefix}{name}", ("model", f"{prefix}{name}")
                if isinstance(value, TensorRef):
                    entry = stage._whole(key, path, value, [name], pickled)
                else:
                    entry = stage._object(pickled, key, path, [name])
                model[key] = _merged(model.get(key), entry, pickled)
        return model

    def _check_named(
        self,
        model: Mapping[str, Entry],
        names: Mapping[str, tuple[int, ...] | None],
        named_by: Mapping[str, Pickled],
    ) -> None:
        """Every parameter and buffer the stages name is in a layer file, in the shape the
        optimizer holds it."""
        sources = {pickled.file: pickled.source for pickled in self.layers.values()}
        for name, shape in names.items():
            entry, states = model.get(f"model.{name}"), named_by[name].source
            if entry is None:
                head = name.split(".", 1)[0]
                if head.isdigit() and int(head) not in self.layers:
                    raise MissingFileError(
                        f"{states}: names {name!r} of pipeline layer {int(head)}, whose file "
                        f"layer_{int(head):02d}-model_states.pt is missing"
                    )
                raise FormatError(
                    f"{states}: names {name!r} (param_shapes / buffer_names), but no layer "
                    "file holds it"
                )
            if shape is not None and (entry.kind != "tensor" or entry.shape != shape):
                file = next(c.record.file for c in entry.chunks if c.record is not None)
                found = list(entry.shape) if entry.kind == "tensor" else "an object"
                raise CorruptRecordError(
                    f"{sources.get(file, file)}: {name!r} is {found}, 'param_shapes' in "
                    f"{states} says {list(shape)}"
                )


def _refuse_without_partitions(model0: Pickled) -> None:
    """No optimizer partitions beside the layer files: ZeRO stage 0 (the optimizer pickled in
    the model states, not read) or every partition missing."""
    value = model0.value
    if isinstance(value, Mapping) and value.get("optimizer") is not None:
        raise UnsupportedLayoutError(
            f"{model0.source}: a DeepSpeed pipeline checkpoint without ZeRO (stage 0): each "
            "stage's optimizer is pickled in its mp_rank_XX_model_states.pt without parameter "
            "names; ckptkit reads DeepSpeed pipeline checkpoints with ZeRO stage 1 only"
        )
    raise MissingFileError(
        f"{model0.source}: pipeline layer files and model states, but no optimizer partitions "
        "(zero_pp_rank_*_mp_rank_XX_optim_states.pt) are here"
    )


def _tied_modules(
    names: Mapping[str, tuple[int, ...] | None],
) -> dict[str, dict[str, tuple[int, ...] | None]]:
    """``tied_modules.<key>.<rest>`` names by tied key: ``{key: {rest: shape}}``."""
    tied: dict[str, dict[str, tuple[int, ...] | None]] = {}
    for name, shape in names.items():
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == TIED:
            tied.setdefault(parts[1], {})[parts[2]] = shape
    return tied


def _tied_prefix(
    index: int,
    state: Mapping,
    tied: Mapping[str, dict[str, tuple[int, ...] | None]],
    pickled: Pickled,
) -> str:
    """The prefix of a layer whose index the stages name no parameter of:
    ``"tied_modules.<key>."`` when exactly one tied module's names and shapes fit the file's
    tensors, else ``"<index>."`` (a layer of frozen parameters only)."""
    fits = [
        key
        for key, members in tied.items()
        if members
        and all(
            rest in state
            and (
                shape is None or (isinstance(state[rest], TensorRef) and state[rest].shape == shape)
            )
            for rest, shape in members.items()
        )
    ]
    if len(fits) > 1:
        raise FormatError(
            f"{pickled.source}: layer {index} could be any of the tied modules "
            f"{', '.join(fits)} (same parameter names and shapes): cannot name its tensors"
        )
    return f"{TIED}.{fits[0]}." if fits else f"{index}."


def _merged(kept: Entry | None, entry: Entry, pickled: Pickled) -> Entry:
    """A leaf a second layer file holds too (a tied module used by two layers): one tensor
    with both files' chunks (replicas), or the first object."""
    if kept is None:
        return entry
    if kept.kind != entry.kind or (kept.shape, kept.dtype) != (entry.shape, entry.dtype):
        raise CorruptRecordError(
            f"{pickled.source}: {entry.key!r} is {entry.dtype} {entry.shape}; another layer "
            f"file holds it as {kept.dtype} {kept.shape}"
        )
    if kept.kind == "object" or not math.prod(kept.shape or ()):
        return kept
    return Entry(
        kept.key, kept.path, "tensor", (*kept.chunks, *entry.chunks), kept.dtype, kept.shape
    )


__all__ = ["PipelineTag"]
