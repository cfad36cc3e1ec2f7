"""The files in a checkpoint folder that ckptkit does not read, each with why, so that nothing
is skipped without a word (``Facts.skipped_files``; ``inspect``, ``--json`` and ``sizes`` show
them).

Looked for in a local folder only: the folder itself (one level), the sub-folders the
checkpoint reads from, and the sub-folders other tools put beside one (``train/``, ``sharded/``);
any other sub-folder is named once (``logs/``). A remote store is never listed for this (a DCP
over S3 is opened without a listing and stays so); there only the reasons an adapter gave from
a listing it made anyway are reported. Hidden names are left out (ckptkit's own
``.ckptkit-tmp-*`` staging folders, ``.git``…), save for unread ``.metadata*`` files.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterable, Mapping

from ..catalog.model import Catalog
from ..errors import CheckpointError, UnsafePathError
from ..storage import Store
from .parts.rank_sets import NAMED_RANK_FILE, RANK_FILE
from .parts.torch_save_files import SUFFIXES as TORCH_SAVE_SUFFIXES

__all__ = ["KNOWN_FOLDERS", "FOLDER_REASON", "unread_files", "with_unread_files"]

#: Sub-folders other tools write beside a checkpoint: their files are listed one by one.
KNOWN_FOLDERS = frozenset({"train", "sharded"})
#: Why a sub-folder that nothing is read from is skipped.
FOLDER_REASON = "a folder ckptkit did not look into: open it by its path if it holds a checkpoint"
#: Sub-folders deep, at most, that the files read are followed into.
_MAX_DEPTH = 3
#: Formats whose checkpoint is a DCP directory (for the wording of the reasons).
_DCP_FORMATS = frozenset({"dcp", "olmo_dcp", "megatron_dist"})
_ACCELERATE_RNG = re.compile(r"^random_states_\d+\.pkl$")
_TEXT = (".json", ".yaml", ".yml", ".txt", ".md", ".toml", ".cfg", ".ini", ".log", ".csv")
_SCRIPTS = (".py", ".sh")
_CONFIGS = frozenset({"config.yaml", "config.yml", "config.json"})


def with_unread_files(catalog: Catalog, storage: Store) -> Catalog:
    """``catalog`` with every file of the local folder ``storage`` it does not read added to
    ``facts.skipped_files`` (the adapter's own reasons kept); ``catalog`` itself when the folder
    is remote, cannot be listed, or holds nothing else."""
    if not storage.local:
        return catalog
    facts = catalog.facts
    known = dict(facts.skipped_files)
    read = _read_names(catalog)
    try:
        found = unread_files(storage, read, known, catalog.format)
    except CheckpointError:  # the folder went away or cannot be listed: nothing to add
        return catalog
    added = {name: why for name, why in found.items() if name not in known}
    if not added:
        return catalog
    facts = dataclasses.replace(facts, skipped_files={**known, **added})
    return dataclasses.replace(catalog, facts=facts)


def unread_files(
    storage: Store, read: Iterable[str], known: Mapping[str, str], format: str
) -> dict[str, str]:
    """``{name: why}`` for each file of the folder ``storage`` outside ``read`` (names relative
    to it) and outside the folders ``known`` names (``sharded/``); a sub-folder nothing is read
    from and no tool is known to write is one entry, ``name/``."""
    read = set(read)
    folders_read = {folder for name in read for folder in _folders_of(name)}
    covered = {name.rstrip("/") for name in known if name.endswith("/")}
    out: dict[str, str] = {}
    pending = [("", 0)]
    while pending:
        folder, depth = pending.pop(0)
        for name, size in sorted(storage.listdir(folder).items()):
            path = f"{folder}/{name}" if folder else name
            if _hidden(name, size) or path in read or path in known or path in covered:
                continue
            if size < 0 and path in folders_read:  # followed _MAX_DEPTH folders deep at most
                if depth < _MAX_DEPTH:
                    pending.append((path, depth + 1))
            elif size < 0 and not folder and name in KNOWN_FOLDERS and not _refused(storage, path):
                for inner, inner_size in sorted(storage.listdir(path).items()):
                    if not _hidden(inner, inner_size):
                        out.update([_listed(storage, f"{path}/{inner}", inner_size, format)])
            else:
                out.update([_listed(storage, path, size, format)])
    return out


def _folders_of(name: str) -> list[str]:
    """The folders ``name`` lies in: ``a/b/c`` → ``["a", "a/b"]``."""
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _listed(storage: Store, path: str, size: int, format: str) -> tuple[str, str]:
    """The name a file (or, ``size`` < 0, a folder: ``name/``) nothing reads is listed under,
    and why it is skipped."""
    refused = _refused(storage, path)
    shown = _shown(path) if refused else path
    if size < 0:
        return f"{shown}/", refused or FOLDER_REASON
    return shown, refused or _reason(path, format)


def _refused(storage: Store, path: str) -> str:
    """Why ckptkit would refuse to open ``path`` (a control character in it…), '' if it would
    not: such a name is listed, escaped, and never looked into."""
    try:
        storage.path(path)
    except UnsafePathError:
        return "a name ckptkit refuses to open (a control character or the like in it)"
    return ""


def _shown(path: str) -> str:
    """``path`` as text can show it: escaped when it holds unprintable characters."""
    return path if path.isprintable() else ascii(path)[1:-1]


def _hidden(name: str, size: int) -> bool:
    """Hidden names are not listed (staging folders, ``.git``), save for ``.metadata*`` files."""
    return name.startswith(".") and not (size >= 0 and name.startswith(".metadata"))


def _reason(path: str, format: str) -> str:
    """Why ``path`` (a file nothing in the catalog reads) is skipped, from its name alone."""
    folder, name = posixpath.split(path)
    beside = "a DCP" if format in _DCP_FORMATS else f"the {format} checkpoint"
    if folder and (RANK_FILE.match(name) or NAMED_RANK_FILE.match(name)):
        what = "trainer state" if posixpath.basename(folder) == "train" else "files"
        return f"per-rank {what} beside {beside}: open {folder}/ to read it"
    if name == "meta.pt":
        return f"Lightning's metadata, a torch.save file beside {beside}: open {path} to read it"
    if _ACCELERATE_RNG.match(name):
        return f"Accelerate's RNG states, a torch.save file beside {beside}: open {path} to read it"
    if name.endswith(".distcp"):
        return "a DCP data file no record of the metadata points into"
    if name.endswith(".safetensors"):
        return f"a safetensors file beside {beside}, not part of it: open {path} to read it"
    if name.endswith(TORCH_SAVE_SUFFIXES):
        return f"a torch.save file beside {beside}, not part of it: open {path} to read it"
    if name.endswith((".pkl", ".pickle")):
        return "a plain pickle: ckptkit reads torch.save files, not these"
    if name.endswith(_SCRIPTS):
        return "a script: never run or read"
    if name in _CONFIGS:
        return "the run's config: not parsed for this format, read it as text"
    if name == "data_paths.txt":
        return "OLMo-core's list of the training data files"
    if name.endswith(_TEXT):
        return "text: a config, tokenizer, log or note, not checkpoint data"
    return f"not part of {beside}"


def _read_names(catalog: Catalog) -> set[str]:
    """Every file the catalog reads or describes itself with."""
    facts = catalog.facts
    names = {*catalog.files, *facts.metadata_files, *facts.rank_files}
    if facts.config_file:
        names.add(facts.config_file)
    return names
