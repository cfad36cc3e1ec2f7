"""Writing a checkpoint in another format: unsharded torch.save / safetensors, or DCP.

Unsharding gives one output per top-level group (``model``, ``optim``, ``train``…); tensor bytes
are copied one tensor (or one row-chunk) at a time, and all files are staged and renamed into
place only on success. :func:`unshard` and :func:`convert` share one pipeline, :func:`_transfer`:
open the source, select the values, plan the output files (:mod:`.output_plans`), write them on
threads and ranks into a staged output, and gather what was written (:mod:`.output_runs`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .. import dtypes
from ..catalog import output_names
from ..catalog.keys import MODEL_GROUP
from ..catalog.model import Entry, refuse_tensors_left_as_objects
from ..decoding.bounded_repr import bounded_repr
from ..decoding.unpickler import paused_gc
from ..errors import (
    FormatError,
    MissingFileError,
    OutputExistsError,
    PickleLimitError,
    UnsafePickleError,
    UsageError,
)
from ..storage import Storage
from ..units import parse_size, plural
from . import distributed, output_plans, output_runs, work
from .output_plans import WrittenFile
from .source import Source, open_source, select_entries
from .writers import torch_save

if TYPE_CHECKING:
    pass

__all__ = [
    "Names",
    "ObjectPolicy",
    "Target",
    "UnshardResult",
    "WrittenFile",
    "convert",
    "unshard",
]

Target = Literal["torch", "safetensors", "dcp"]
#: How unshard/convert name their output files and keys: one file per group with keys relative
#: to it (``groups``: ``model.safetensors``, ``optim.safetensors``…), or as transformers'
#: ``save_pretrained`` does for the ``model`` group alone (``transformers``:
#: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``,
#: which ``from_pretrained`` loads with the model's ``config.json`` beside them).
Names = Literal["groups", "transformers"]
#: What unshard/convert do with an object whose pickle names globals not known to be harmless
#: (:data:`~ckptkit.decoding.known_objects.BENIGN_GLOBALS`), judged on the very pickle written:
#: write it back as the pickle built it (``keep``), leave the entry out (``drop``) or refuse
#: (``error``).
ObjectPolicy = Literal["keep", "drop", "error"]


@dataclass
class UnshardResult:
    """What :func:`unshard` wrote where; non-tensor entries of safetensors output are listed
    under the ``*.objects.pt`` side files that hold them. ``opaque`` names the object entries
    written back as their pickle built them, with every global their pickle names that is not
    known to be harmless (loading them imports those globals and runs their code);
    ``unsafe_globals`` the written objects' globals outside torch's ``weights_only`` allowlist
    (``torch.load(weights_only=True)`` refuses the files holding them); ``dropped`` the entries
    left out, and why."""

    destination: str
    files: list[WrittenFile] = field(default_factory=list)
    opaque: dict[str, list[str]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    unsafe_globals: dict[str, list[str]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([vars(f) for f in self.files])

    def __str__(self) -> str:
        from ..units import human_bytes

        lines = [
            f"wrote {plural(len(self.files), 'file')} ({human_bytes(self.nbytes)}) to "
            f"{self.destination}"
        ]
        lines += [
            f"  {f.name:<40} {human_bytes(f.nbytes):>10}  {plural(f.tensors, 'tensor')}, "
            f"{plural(f.objects, 'object')}"
            for f in self.files
        ]
        for title, notes in (
            ("written as pickled (globals not known to be harmless)", _joined(self.opaque)),
            ("left out", self.dropped),
        ):
            if notes:
                lines.append(f"{plural(len(notes), 'object')} {title}:")
                lines += [f"  {key}: {why}" for key, why in list(notes.items())[:_LISTED]]
                if len(notes) > _LISTED:
                    lines.append(f"  … and {len(notes) - _LISTED} more")
        if self.unsafe_globals:
            lines.append(_loading_sentence(self.unsafe_globals))
        return "\n".join(lines)


#: Keys listed per kind in :meth:`UnshardResult.__str__`, and globals named in its sentence.
_LISTED = 10


def _joined(opaque: dict[str, list[str]]) -> dict[str, str]:
    return {key: _names(names) for key, names in opaque.items()}


def _names(names: Sequence[str]) -> str:
    """Global names for a message: dotted names as they are, anything else (a pickle may name
    any string, escape sequences included) as a short, escaped repr."""
    shown = [
        name if all(part.isidentifier() for part in name.split(".")) else bounded_repr(name)
        for name in names[:_LISTED]
    ]
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(shown) + more


def _loading_sentence(unsafe: dict[str, list[str]]) -> str:
    """What loading the output will do, in one sentence, for objects naming ``unsafe``
    globals (by key) outside torch's ``weights_only`` allowlist."""
    names = sorted({name for listed in unsafe.values() for name in listed})
    return (
        f"Loading the output will import or call {_names(names)} (torch.load with "
        "weights_only=False runs them); torch.load(weights_only=True) will refuse the files "
        "holding them."
    )


def unshard(
    src: str | Source,
    dst: str,
    *,
    to: Literal["torch", "safetensors"] = "torch",
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
    objects: ObjectPolicy | None = None,
    exclude: Sequence[str] | str | None = None,
    workers: int = 1,
    names: Names = "groups",
) -> UnshardResult:
    """Write the checkpoint ``src`` unsharded into the directory ``dst``, one file per group.

    ``to="torch"``: ``<group>.pt`` holding exactly what torch's ``dcp_to_torch_save`` puts under
    that group (nesting, objects included), streamed so ``torch.load(mmap=True)`` works.
    ``to="safetensors"``: ``<group>.safetensors`` with dotted keys relative to the group (HF
    ``-0000i-of-0000N`` shards + index with ``max_shard_size``); the group's non-tensor entries
    go to ``<group>.objects.pt``. ``names="transformers"`` writes the ``model`` group alone as
    ``save_pretrained`` does (its files, sharding, index and tensor order; tied tensors once),
    so that ``from_pretrained`` loads ``dst`` once the model's ``config.json`` is copied there. Objects whose pickle names globals not known to be harmless
    (anywhere: classes, arguments, BUILD state, items) are written back as their pickle built
    them (``objects="keep"``, listed in the result's ``opaque``), left out (``"drop"``) or
    refused (``"error"``); nothing of them runs here. The result's ``unsafe_globals`` names what
    ``torch.load(weights_only=True)`` will refuse in the output. Memory stays at about the
    largest tensor; nothing appears under a final name unless everything succeeded.

    The output files are a plan's work items: ``workers`` threads write several at once, and
    inside an initialised torch.distributed process group (e.g. under ``torchrun``) each rank
    writes its share, balanced by bytes; a file larger than a worker's share is written by
    several, each its own byte ranges (the threads, and into a local destination the ranks).
    The files appear only when every rank succeeded.

    Args:
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        dst: the output directory (local path or fsspec URL).
        to: ``"torch"`` or ``"safetensors"``.
        keys: globs selecting entries by dotted key.
        groups: top-level groups to write (``"model"``, ``"optim"``…).
        dtype: the dtype floating tensors are cast to (e.g. ``"bfloat16"``); others keep theirs.
        max_shard_size: safetensors only: bytes per shard (``"5GB"`` or an int).
        storage_options: fsspec options for ``src`` (when a URL) and ``dst``.
        overwrite: replace existing files of the same name instead of refusing.
        progress: show a progress bar.
        objects: ``"keep"``, ``"drop"`` or ``"error"`` for objects naming harmful globals; the
            default (None) keeps them but refuses tensors left as objects (DTensors outside a
            set of rank files: :class:`~ckptkit.errors.TensorsLeftAsObjectsError`), which only
            ``"keep"`` writes back as pickled.
        exclude: globs of keys left out.
        workers: threads writing output files (or byte ranges of one) at once.
        names: ``"groups"`` (one file per group) or ``"transformers"`` (the ``model`` group
            under transformers' file names, ``to="safetensors"`` only; see :data:`Names`).

    Returns:
        An :class:`UnshardResult`: the files written (name, bytes, tensors, objects), the
        objects written back opaquely and the entries left out.

    Example:
        >>> result = ckptkit.unshard("ckpt/step_1000", "release/", to="safetensors",
        ...                          groups=["model"], dtype="bfloat16")
        >>> [f.name for f in result.files]
        ['model.safetensors']
    """
    if to not in ("torch", "safetensors"):
        raise UsageError(f"to must be 'torch' or 'safetensors', not {to!r}")
    options = _Options(
        keys=keys,
        groups=_named_groups(names, groups, to),
        exclude=exclude,
        objects=objects,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        workers=workers,
        storage_options=storage_options,
        progress=progress,
        names=names,
    )
    return _transfer(src, dst, target=to, options=options)


def convert(
    src: str | Source,
    dst: str,
    *,
    to: Target = "dcp",
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
    objects: ObjectPolicy | None = None,
    exclude: Sequence[str] | str | None = None,
    workers: int = 1,
    names: Names = "groups",
) -> UnshardResult:
    """Write ``src`` into ``dst`` as format ``to``.

    ``to="dcp"``: a DCP directory (``.metadata`` + ``__0_0.distcp``, one data file per rank and
    worker: ``__1_0.distcp``…) that torch's ``dcp.load`` reads at any world size; chunks keep
    their boxes and records already in torch.save form are copied byte for byte, so DCP → DCP
    with ``keys``/``groups`` is a cheap way to slim a checkpoint (e.g. drop the optimizer).
    ``"torch"`` / ``"safetensors"`` unshard.

    Args:
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        dst: the output directory (local path or fsspec URL).
        to: ``"dcp"``, or ``"torch"`` / ``"safetensors"`` (as :func:`unshard`).
        keys: globs selecting entries by dotted key.
        groups: top-level groups to write (``"model"``, ``"optim"``…).
        storage_options: fsspec options for ``src`` (when a URL) and ``dst``.
        overwrite: replace existing files of the same name instead of refusing.
        progress: show a progress bar.
        objects: ``"keep"``, ``"drop"`` or ``"error"``, as for :func:`unshard`.
        exclude: globs of keys left out.
        workers: threads writing output files at once (a DCP output gets a data file per
            worker).
        names: ``"groups"``, or ``"transformers"`` with ``to="safetensors"`` (as for
            :func:`unshard`).

    Returns:
        An :class:`UnshardResult` listing the files written and the objects kept or left out.

    Example:
        >>> result = ckptkit.convert("ckpt/step_1000", "slim/", to="dcp", groups=["model"])
        >>> [f.name for f in result.files]
        ['__0_0.distcp', '.metadata']
    """
    if to not in ("dcp", "torch", "safetensors"):
        raise UsageError(f"to must be 'dcp', 'torch' or 'safetensors', not {to!r}")
    options = _Options(
        keys=keys,
        groups=_named_groups(names, groups, to),
        exclude=exclude,
        objects=objects,
        overwrite=overwrite,
        workers=workers,
        storage_options=storage_options,
        progress=progress,
        names=names,
    )
    return _transfer(src, dst, target=to, options=options)


@dataclass(frozen=True)
class _Options:
    """The options of :func:`unshard` and :func:`convert`, defined once (meanings as documented
    there); ``dtype`` and ``max_shard_size`` only unshard offers."""

    keys: Sequence[str] | str | None = None
    groups: Sequence[str] | str | None = None
    exclude: Sequence[str] | str | None = None
    objects: ObjectPolicy | None = None
    dtype: str | None = None
    max_shard_size: int | str | None = None
    overwrite: bool = False
    workers: int = 1
    storage_options: dict | None = None
    progress: bool = True
    names: Names = "groups"


def _named_groups(
    names: str, groups: Sequence[str] | str | None, to: str
) -> Sequence[str] | str | None:
    """The groups to select under ``names``: transformers' names are the ``model`` group's
    own, written as safetensors; anything else is refused rather than silently dropped."""
    if names not in ("groups", "transformers"):
        raise UsageError(f"names must be 'groups' or 'transformers', not {names!r}")
    if names == "groups":
        return groups
    if to != "safetensors":
        raise UsageError(
            f"names='transformers' writes safetensors (model.safetensors, its shards and "
            f"index), not {to!r}: pass to='safetensors'"
        )
    asked = [groups] if isinstance(groups, str) else list(groups or [MODEL_GROUP])
    if asked != [MODEL_GROUP]:
        raise UsageError(
            f"names='transformers' writes the {MODEL_GROUP!r} group alone (what from_pretrained "
            f"loads), not groups={groups!r}"
        )
    return [MODEL_GROUP]


def _transfer(src: str | Source, dst: str, *, target: Target, options: _Options) -> UnshardResult:
    """The pipeline behind unshard and convert: open the source, select the values, plan the
    output files, write this process's share on threads into an output staged on every rank,
    and gather the files all ranks wrote (an interrupt once they are published changes nothing:
    the result is returned)."""
    work.check_workers(options.workers)
    source = open_source(src, options.storage_options)
    cast = dtypes.dtype(options.dtype) if options.dtype is not None else None
    limit = parse_size(options.max_shard_size) if options.max_shard_size is not None else None
    destination = Storage(dst, options.storage_options)
    result = UnshardResult(destination.describe())
    entries, values = _selected_values(source, options, result)
    with distributed.joined() as ranks:  # a collective: every rank writes its share
        # the plan: a few objects per entry, no cycle; kept for the job (see paused_gc)
        with paused_gc(promote=True):
            if target == "dcp":  # a data file per rank and worker, as torch's has per rank
                n_files = (ranks.world_size if ranks is not None else 1) * options.workers
                tasks = output_plans.dcp_tasks(entries, values, n_files)
            elif options.names == "transformers":
                tasks, tied = output_plans.transformers_tasks(entries, values, limit, cast)
                for key, kept in tied.items():
                    result.dropped[key] = f"the same stored bytes as {kept!r} (tied): written once"
            else:
                tasks = output_plans.unsharded_tasks(entries, values, target, limit, cast)
        names = [name for task in tasks for name in task.names]
        total = sum(task.nbytes for task in tasks)
        label = "convert" if target == "dcp" else "unshard"
        published = False
        try:
            with distributed.JobProgress(total, options.progress, label, ranks) as bar:
                with output_runs.staged(destination, options.overwrite, ranks) as output:
                    output.refuse_existing(names)
                    if target != "dcp":  # a DCP directory's file names name no group
                        _refuse_another_checkpoint(destination, names)
                    written = output_runs.run_tasks(
                        tasks, output, source, cast, bar, options.workers, ranks
                    )
                published = True
        except KeyboardInterrupt:  # Ctrl-C once every file is in place: done, not interrupted
            if not published:
                raise
        result.files = output_runs.gathered(written, ranks)
    return result


def _refuse_another_checkpoint(destination: Storage, names: list[str]) -> None:
    """One folder, one checkpoint: refuse to write groups the folder already holds in another
    format or sharding (``model.safetensors`` beside a new ``model.pt``), between which a
    reader could only choose silently. ``overwrite`` does not help: it replaces files of the
    same name, and the others would stay."""
    try:
        existing = destination.listdir()
    except MissingFileError:
        return
    ours = set(names)
    groups = {output_names.group_of_file(name) for name in names} - {None}
    others = sorted(
        n for n in existing if n not in ours and output_names.group_of_file(n) in groups
    )
    if others:
        shown = ", ".join(others[:4]) + (" …" if len(others) > 4 else "")
        raise OutputExistsError(
            f"{destination.describe()} already holds {shown}: the same group(s) in another "
            "format or sharding; write to an empty folder (one folder, one checkpoint)"
        )


def _selected_values(
    source: Source, options: _Options, result: UnshardResult
) -> tuple[list[Entry], dict[str, Any]]:
    """The entries to write and their objects' values (as pickled, tensors in memory), after
    ``keys`` / ``groups`` / ``exclude`` and the ``objects`` policy; records what was left out
    or carried opaquely in ``result``. Nothing left at all is an error, not an empty output."""
    keys, groups, policy = options.keys, options.groups, options.objects
    if policy not in (None, "keep", "drop", "error"):
        raise UsageError(f"objects must be 'keep', 'drop' or 'error', not {policy!r}")
    exclude = options.exclude
    excluded = [exclude] if isinstance(exclude, str) else list(exclude or ())
    # A group, key or exclude pattern that matches nothing is an error naming the closest names.
    entries = select_entries(source, keys, groups, exclude=excluded)
    kept = {e.key for e in entries}
    for entry in source.catalog.select(keys, groups):
        if entry.key not in kept:
            pattern = next(p for p in excluded if fnmatch.fnmatchcase(entry.key, p))
            result.dropped[entry.key] = f"exclude={pattern!r}"
    if policy != "keep":  # tensors left as objects: an output without them is silently partial
        refuse_tensors_left_as_objects(entries, source.url)
    objects = [e for e in entries if e.kind == "object"]
    raw = source.reader.read_objects(objects, decode=False, tensors="data") if objects else []
    values = dict(zip((e.key for e in objects), raw, strict=True))
    for key, value in values.items():
        found = _pickled_globals(key, value)
        names = list(found.harmful)
        if names and policy == "error":
            raise UnsafePickleError(
                f"{key!r} holds {_names(names)}, not known to be harmless (loading it would "
                "import and run them); objects='keep' writes it back as pickled, objects='drop' "
                "or exclude= leaves it out",
                global_name=names[0],
            )
        if names and policy == "drop":
            result.dropped[key] = f"holds {_names(names)} (objects='drop')"
            continue
        if names:
            result.opaque[key] = names
        if found.refused_by_weights_only:
            result.unsafe_globals[key] = list(found.refused_by_weights_only)
    entries = [e for e in entries if e.key not in result.dropped]
    if not entries:
        raise FormatError(
            f"{source.url}: nothing matches keys={keys!r} groups={groups!r}"
            + (
                f" ({plural(len(result.dropped), 'entry', 'entries')} left out)"
                if result.dropped
                else ""
            )
            + f"; {source.catalog.hint(keys, groups)}"
        )
    return entries, {k: v for k, v in values.items() if k not in result.dropped}


def _pickled_globals(key: str, value: Any) -> torch_save.PickledGlobals:
    """The globals the pickle written for ``key``'s ``value`` names; a value the writer cannot
    write (a class of ckptkit's own, a cycle through arguments, too many parts) refused naming
    the key."""
    try:
        return torch_save.pickled_globals(value)
    except UsageError as exc:
        raise UsageError(f"{key!r}: {exc}") from None
    except PickleLimitError as exc:
        raise PickleLimitError(f"{key!r}: {exc}", global_name=exc.global_name) from None
