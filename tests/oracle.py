"""torch as the trusted oracle: what torch's own DCP reader and converter say about a checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptkit


def digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` by relative name (DCP ``.metadata`` excluded: it
    pickles a fresh random ``save_id`` on every write)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != ".metadata"
    }


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's elements as contiguous little-endian bytes (what 'bit-equal' compares)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, key: str) -> None:
    assert actual.dtype == expected.dtype, f"{key}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, (
        f"{key}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert raw_bytes(actual) == raw_bytes(expected), f"{key}: bytes differ"


def assert_catalog_matches_torch(ckpt: ckptkit.Checkpoint, path: str | Path) -> None:
    """Every key, dtype, shape, chunk and byte record equals torch's FileSystemReader metadata."""
    metadata = FileSystemReader(str(path)).read_metadata()
    assert set(ckpt.keys()) == set(metadata.state_dict_metadata)
    records = {
        (index.fqn, tuple(index.offset) if index.offset is not None else None): info
        for index, info in metadata.storage_data.items()
    }
    for key, item in metadata.state_dict_metadata.items():
        entry = ckpt.entry(key)
        if isinstance(item, TensorStorageMetadata):
            assert entry.kind == "tensor", key
            assert entry.dtype.name == str(item.properties.dtype).removeprefix("torch."), key
            assert entry.shape == tuple(item.size), key
            expected = sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
            assert sorted((c.offsets, c.sizes) for c in entry.chunks) == expected, key
            for chunk in entry.chunks:
                info = records.get((key, chunk.offsets))
                if info is None:
                    assert chunk.record is None and chunk.numel == 0, key
                    continue
                assert (chunk.record.file, chunk.record.offset, chunk.record.length) == (
                    info.relative_path,
                    info.offset,
                    info.length,
                ), key
        else:
            assert entry.kind == "object", key
            info = records[(key, None)]
            record = entry.chunks[0].record
            assert (record.file, record.offset, record.length) == (
                info.relative_path,
                info.offset,
                info.length,
            )
    if metadata.planner_data:
        for key, path_ in metadata.planner_data.items():
            assert ckpt.entry(key).path == tuple(path_), key


def torch_unsharded(path: str | Path, tmp_dir: Path) -> dict:
    """The state dict torch's own ``dcp_to_torch_save`` produces (nested as torch nests it)."""
    out = tmp_dir / "dcp_to_torch_save.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def assert_same_structure(actual, expected, where: str, *, ordered: bool) -> None:
    """Nesting, keys, list indices and objects equal; tensors bit-equal. ``ordered``: dict keys
    also in the same order (torch's own converter orders them as its metadata lists them; the
    state a job held in memory may list them in another order)."""
    if isinstance(expected, torch.Tensor):
        assert_bit_equal(actual, expected, where)
    elif isinstance(expected, dict):
        if ordered:
            assert list(actual) == list(expected), where
        else:
            assert set(actual) == set(expected), where
        for key in expected:
            assert_same_structure(actual[key], expected[key], f"{where}.{key}", ordered=ordered)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_structure(a, e, f"{where}.{i}", ordered=ordered)
    else:
        assert actual == expected, where


def lookup(state: dict, path: tuple):
    value = state
    for part in path:
        value = value[part]
    return value


def assert_reads_match(ckpt: ckptkit.Checkpoint, reference: dict) -> int:
    """Every tensor ``read()`` is bit-equal to ``reference`` walked by the entry's path."""
    count = 0
    for key in ckpt:
        entry = ckpt.entry(key)
        if entry.kind == "tensor":
            assert_bit_equal(ckpt.read(key), lookup(reference, entry.path), key)
            count += 1
    return count


def assert_matches_sha256(ckpt: ckptkit.Checkpoint, reference_json: Path) -> int:
    """Every tensor listed in a fixture's ``tensors.sha256.json`` reads back with that hash."""
    listed = json.loads(reference_json.read_text())
    count = 0
    for file, tensors in listed.items():
        group = file.split(".")[0]
        for key, spec in tensors.items():
            tensor = ckpt.read(f"{group}.{key}")
            assert list(tensor.shape) == spec["shape"], key
            assert str(tensor.dtype).removeprefix("torch.") == spec["dtype"], key
            assert hashlib.sha256(raw_bytes(tensor)).hexdigest() == spec["sha256"], key
            count += 1
    return count


def _load_rank(
    rank: int, world_size: int, path: str, reference_path: str, result_path: str
) -> None:
    """Rank body of :func:`dcp_load_model`: FSDP2 TinyLM ← ``dcp.load`` ← ``path``, compared."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptkit.examples import TinyLM

    torch.manual_seed(1234)  # other weights than the checkpoint's
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world_size,))
    for module in [*model.blocks, model.adapter, model]:
        fully_shard(module, mesh=mesh)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    dist.barrier()
    if rank == 0:
        expected = torch.load(reference_path, weights_only=False)["model"]
        bad = [
            k
            for k, v in expected.items()
            if raw_bytes(full[k]) != raw_bytes(v) or full[k].dtype != v.dtype
        ]
        Path(result_path).write_text(json.dumps({"keys": len(full), "mismatched": bad}))


def dcp_load_model(path: Path, world_size: int, reference_path: Path, tmp_dir: Path) -> dict:
    """Load ``path`` with torch's ``dcp.load`` into an FSDP2 ``TinyLM`` at ``world_size`` ranks."""
    from ckptkit.examples import _spawn

    result = tmp_dir / f"dcp_load_ws{world_size}.json"
    _spawn(_load_rank, world_size, str(path), str(reference_path), str(result))
    return json.loads(result.read_text())


def torch_keys(path: str | Path, *, tensors_only: bool = False) -> list[str]:
    """The keys (or only the tensors' keys) torch's own ``FileSystemReader`` lists in a DCP
    checkpoint's metadata."""
    items = FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
    return [k for k, v in items if not tensors_only or isinstance(v, TensorStorageMetadata)]


#: Opens each path given with ``import torch`` blocked and checks what needs no oracle: the
#: tables are filled (objects: one row per entry), the summary's totals are the catalog's
#: shapes and the data files' sizes on disk, the objects table previews the values read, and
#: ``read()`` (which needs torch) refuses. Prints, for the test to compare with its oracle,
#: every tensor's bytes (sha256, as read by ``read_numpy``) and every object as read (pickled,
#: base64).
TORCH_FREE_INSPECTION = r"""
import base64, hashlib, math, os, pickle, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit
from ckptkit.catalog.tables import preview

seen = []
for path in sys.argv[1:]:
    ckpt = ckptkit.open(path)
    for table in (ckpt.tensors, ckpt.chunks, ckpt.files):
        assert len(table) > 0, path
    tensors, objects = ckpt.catalog.tensors(), ckpt.catalog.objects()
    assert len(ckpt.objects) == len(objects), path  # one row per object entry
    summary = ckpt.summary()
    model = [e for e in tensors if e.group == "model"]
    assert summary.parameters == sum(math.prod(e.shape) for e in model or tensors), path
    label = "parameters in 'model'" if model else "elements in all tensors (no 'model' group)"
    assert summary.parameters_text == f"{summary.parameters:,} {label}", path
    root = path if os.path.isdir(path) else os.path.dirname(path)
    names = [*ckpt.catalog.files, *ckpt.catalog.facts.metadata_files]
    on_disk = sum(os.path.getsize(os.path.join(root, f)) for f in names)
    assert summary.total_bytes == on_disk, (path, summary.total_bytes, on_disk)
    sizes = ckptkit.compare_sizes(ckpt).iloc[0]  # one set of numbers: inspect, summary, sizes
    assert (sizes["size"], sizes["files"]) == (summary.total_bytes, summary.files), path
    assert sizes["object_bytes"] == summary.by_group["object_bytes"].sum(), path
    assert f"<b>{summary.parameters_text}</b>" in summary._repr_html_()
    assert "<b>" in ckpt._repr_html_()
    values = {e.key: ckpt.read_object(e.key) for e in objects}
    previews = ckpt.objects.set_index("key")["preview"].to_dict()
    assert previews == {key: preview(value) for key, value in values.items()}, path
    digests = {}
    for e in tensors:
        array = ckpt.read_numpy(e.key)
        assert array.shape == e.shape, e.key
        digests[e.key] = hashlib.sha256(array.tobytes()).hexdigest()  # row-major bytes
    try:
        ckpt.read(tensors[0].key)
    except ImportError:
        pass
    else:
        raise AssertionError("read() must need torch")
    seen.append({"tensors": digests, "objects": values})
sys.stdout.write(base64.b64encode(pickle.dumps(seen)).decode())
"""


def inspect_without_torch(*paths: str | Path) -> list[dict]:
    """Run :data:`TORCH_FREE_INSPECTION` on ``paths``; per path, what it read without torch:
    ``{"tensors": {key: sha256 of the bytes}, "objects": {key: value}}``."""
    import base64
    import pickle

    from isolated import run_script

    out = run_script(TORCH_FREE_INSPECTION, *paths)
    return pickle.loads(base64.b64decode(out))  # noqa: S301 - our own subprocess's output
