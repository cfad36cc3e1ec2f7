"""The entries read from a ZeRO tag's model-state files: buffers and frozen parameters
(``model.``), tied aliases, the module weights as saved (``module.``) and everything else
rank 0's model states hold (``train.``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ...catalog.model import Entry
from ...decoding.unpickler import TensorRef
from ...errors import CorruptRecordError, FormatError
from ..parts.torch_save_files import leaves
from .geometry import Piece, stage3_slices
from .state import ZeroState, checked_shape, flat_tensor, need_key

#: Top-level model-state keys not repeated under ``train``.
MODEL_KEYS = ("module", "frozen_param_fragments")


class ModelStateEntries(ZeroState):
    """Entries from the model-state files (and the tied aliases of trainable parameters)."""

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
            shape = checked_shape(shape, self.model0, f"frozen_param_shapes.{name}")
            if self.stage != 3:  # saved whole
                frags = need_key(self.model0.value, "frozen_param_fragments", self.model0)
                ref = need_key(frags, name, self.model0, "frozen_param_fragments.")
                if not isinstance(ref, TensorRef) or ref.shape != shape:
                    raise CorruptRecordError(
                        f"{self.model0.source}: {where!r} is not a tensor of shape {list(shape)}"
                    )
                yield self._whole(key, ("model", name), ref, ["frozen_param_fragments", name])
                continue
            refs = []  # stage 3: each rank's padded slice, in its own model-state file
            for model in self.models:
                frags = need_key(model.value, "frozen_param_fragments", model)
                refs.append(
                    [
                        flat_tensor(
                            need_key(frags, name, model, "frozen_param_fragments."), model, where
                        )
                    ]
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


__all__ = ["MODEL_KEYS", "ModelStateEntries"]
