"""The optimizer entries of a ZeRO tag: each parameter's optimizer state cut from the ranks'
flat partitions like the parameter (``optim.state.<name>.<stat>``), the base optimizer's
param groups and DeepSpeed's own optimizer fields, as objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ...catalog.model import Chunk, Entry
from ...decoding.unpickler import TensorRef
from ...errors import CorruptRecordError, FormatError
from ..parts.torch_save_files import leaves
from .geometry import Layout
from .state import GEOMETRY_KEYS, ZeroState, need_key


class OptimizerEntries(ZeroState):
    """Entries from the optimizer-state files: optimizer state, param groups, fields."""

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
            chunks.append(Chunk(chunk.offsets, chunk.sizes, chunk.record, self.rank_base + rank))
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
            base = need_key(self.osds[rank], self.state_key, optim, "optimizer_state_dict.")
            state = need_key(base, "state", optim, where)
            groups = need_key(base, "param_groups", optim, where)
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


__all__ = ["OptimizerEntries"]
