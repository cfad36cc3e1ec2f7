"""Local names are walked folder by folder, links followed by ckptkit itself (issue 24, items 3
and 8): a Hugging Face cache snapshot reads through its links to ``blobs/``, a link to anywhere
else is refused, a folder swapped for a link mid-read never sends a read outside, and a link the
user made (a DeepSpeed tag or an OLMo ``model_and_optim/`` moved elsewhere) is named in the
error with how to allow it (``allow_roots=`` / ``--allow-root``)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import CheckpointError, UnsafePathError
from ckptkit.storage import Storage
from ckptkit.storage.anchored import MAX_LINKS

FIXTURES = Path(__file__).parent / "fixtures"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs and signed zeros included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().reshape(-1).view(torch.uint8).tolist()
        == b.contiguous().reshape(-1).view(torch.uint8).tolist()
    )


def tensors_of(ckpt) -> dict[str, torch.Tensor]:
    return {key: ckpt.read(key) for key in ckpt.tensors["key"]}


# -- a Hugging Face hub cache ---------------------------------------------------------------------


def hf_cache_repository(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """``cache/models--org--name`` as ``huggingface_hub`` lays it out: each file's bytes in
    ``blobs/<etag>`` (sha256 for weights, git's blob sha1 for small text files), ``refs/main``
    naming the revision, ``snapshots/<revision>/<file>`` a relative link to the blob. Returns
    the snapshot folder."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / REVISION
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REVISION)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        if name.endswith(".safetensors"):
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (folder / "blobs" / etag).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        depth = name.count("/") + 2
        link.symlink_to("../" * depth + "blobs/" + etag)
    return snapshot


@pytest.fixture
def hf_model(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A real safetensors file (written by the safetensors library) in a hub cache snapshot."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        "model.embed.weight": torch.randn(32, 8, generator=generator),
        "model.norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
        "lm_head.bias": torch.tensor([float("nan"), -0.0, 1.5]),
    }
    save_file(weights, str(tmp_path / "written.safetensors"))
    files = {
        "model.safetensors": (tmp_path / "written.safetensors").read_bytes(),
        "config.json": json.dumps({"model_type": "llama"}).encode(),
    }
    snapshot = hf_cache_repository(tmp_path / "hub", "org/name", files)
    return snapshot, weights


def test_hf_cache_snapshot_opens_as_a_folder_and_as_a_file_bit_equal(hf_model):
    snapshot, weights = hf_model
    assert (snapshot / "model.safetensors").is_symlink()
    for location in (snapshot, snapshot / "model.safetensors"):
        ckpt = ckptkit.open(str(location))
        assert ckpt.format == "safetensors"
        read = tensors_of(ckpt)  # safetensors keys come in group "model"
        assert sorted(read) == sorted(f"model.{key}" for key in weights)
        assert all(same_bits(read[f"model.{key}"], weights[key]) for key in weights)
    storage = Storage(str(snapshot))
    assert storage.read_file("config.json") == b'{"model_type": "llama"}'
    assert storage.size("model.safetensors") == os.path.getsize(snapshot / "model.safetensors")


@pytest.mark.parametrize("where", ["another repository", "outside the cache"])
def test_hf_cache_links_elsewhere_are_refused(hf_model, tmp_path, where):
    snapshot, _ = hf_model
    other = hf_cache_repository(tmp_path / "hub", "org/other", {"model.safetensors": b"x" * 64})
    target = other / "model.safetensors"
    if where == "outside the cache":
        target = tmp_path / "secret.safetensors"
        save_file({"secret": torch.ones(4)}, str(target))
    link = snapshot / "model.safetensors"
    link.unlink()
    link.symlink_to(os.path.relpath(target.resolve(), snapshot))
    with pytest.raises(UnsafePathError, match="a symlink leading outside") as info:
        ckptkit.open(str(snapshot))
    assert "model.safetensors leads to" in str(info.value)
    with pytest.raises(UnsafePathError, match="a symlink leading outside"):
        Storage(str(snapshot)).read_range("model.safetensors", 0, 8)


def test_only_a_complete_cache_layout_widens_the_folders(hf_model):
    """Without ``refs/`` beside ``blobs/`` it is not a hub cache: the blob is outside."""
    snapshot, _ = hf_model
    shutil.rmtree(snapshot.parent.parent / "refs")
    with pytest.raises(UnsafePathError, match="a symlink leading outside"):
        Storage(str(snapshot)).read_file("config.json")


# -- the swap race ----------------------------------------------------------------------------------


def _exchange(scratch: Path):
    """``exchange(a, b)``: swap two names at once (renameat2 RENAME_EXCHANGE), or failing that
    with two renames (the name is then missing for a moment, which only adds errors)."""

    def with_renames(a: str, b: str) -> None:
        os.rename(a, a + ".tmp")
        os.rename(b, a)
        os.rename(a + ".tmp", b)

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return with_renames

    def exchange(a: str, b: str) -> None:
        if renameat2(-100, a.encode(), -100, b.encode(), 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
            raise OSError(ctypes.get_errno(), "renameat2")

    (scratch / "x").mkdir(parents=True)
    (scratch / "y").mkdir()
    try:
        exchange(str(scratch / "x"), str(scratch / "y"))
    except OSError:  # not supported by this filesystem
        return with_renames
    return exchange


def test_a_folder_swapped_for_a_link_never_sends_a_read_outside(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    inside_bytes, outside_bytes = b"I" * 4096, b"O" * 4096
    (root / "sub" / "data.bin").write_bytes(inside_bytes)
    (outside / "data.bin").write_bytes(outside_bytes)
    (root / "swap").symlink_to(outside)
    exchange = _exchange(tmp_path / "probe")
    stop, swaps, failures = threading.Event(), [0], []

    def swapper() -> None:
        try:
            while not stop.is_set():
                exchange(str(root / "sub"), str(root / "swap"))
                swaps[0] += 1
        except OSError as exc:  # pragma: no cover - reported below
            failures.append(exc)

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    storage = Storage(str(root))
    got = {"inside": 0, "outside": 0, "error": 0}
    reads = [
        lambda: storage.read_range("sub/data.bin", 0, 4096),
        lambda: storage.read_file("sub/data.bin"),
    ]
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline:
            for read in reads:
                try:
                    data = read()
                except CheckpointError:
                    got["error"] += 1
                    continue
                got["outside" if data == outside_bytes else "inside"] += 1
                assert data in (inside_bytes, outside_bytes)
    finally:
        stop.set()
        thread.join()
    assert not failures
    assert swaps[0] > 100 and got["inside"] > 0
    assert got["outside"] == 0, got


# -- links users make ----------------------------------------------------------------------------


def test_a_linked_deepspeed_tag_names_the_link_and_opens_with_allow_roots(tmp_path, capsys):
    fixture = FIXTURES / "deepspeed_zero2_ws2" / "checkpoint"
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(fixture, run)
    tag = (run / "latest").read_text().strip()
    elsewhere.mkdir()
    (run / tag).rename(elsewhere / tag)
    (run / tag).symlink_to(elsewhere / tag)

    with pytest.raises(UnsafePathError) as info:
        ckptkit.open(str(run))
    message = str(info.value)
    assert "a symlink leading outside" in message and "missing" not in message
    assert f"{tag} leads to {elsewhere / tag}" in message
    assert "allow_roots=" in message and "--allow-root" in message

    opened = ckptkit.open(str(run), allow_roots=[str(elsewhere)])
    original = ckptkit.open(str(fixture))
    assert opened.keys() == original.keys()
    expected = tensors_of(original)
    assert all(same_bits(value, expected[key]) for key, value in tensors_of(opened).items())

    assert main(["inspect", str(run)]) == 2
    assert "a symlink leading outside" in capsys.readouterr().err
    assert main(["inspect", str(run), "--allow-root", str(elsewhere)]) == 0
    assert "deepspeed" in capsys.readouterr().out.lower()
    assert main(["verify", str(run), "--allow-root", str(elsewhere / tag)]) == 0


def test_an_olmo_step_folder_linked_elsewhere_names_the_link(tmp_path):
    fixture = FIXTURES / "olmo_core3_trainer_ws2" / "step3"
    step, elsewhere = tmp_path / "step3", tmp_path / "elsewhere"
    shutil.copytree(fixture, step)
    elsewhere.mkdir()
    (step / "model_and_optim").rename(elsewhere / "model_and_optim")
    (step / "model_and_optim").symlink_to(elsewhere / "model_and_optim")

    with pytest.raises(UnsafePathError) as info:
        ckptkit.open(str(step))
    assert f"model_and_optim leads to {elsewhere / 'model_and_optim'}" in str(info.value)

    opened = ckptkit.open(str(step), allow_roots=str(elsewhere / "model_and_optim"))
    original = ckptkit.open(str(fixture))
    assert opened.format == original.format == "olmo_dcp"
    expected = tensors_of(original)
    got = tensors_of(opened)
    assert sorted(got) == sorted(expected)
    assert all(same_bits(got[key], expected[key]) for key in expected)


# -- links inside: resolved by ckptkit, bounded ------------------------------------------------------


def test_links_inside_are_resolved_from_the_root_and_bounded(tmp_path):
    root = tmp_path / "ckpt"
    (root / "data").mkdir(parents=True)
    (root / "step" / "model").mkdir(parents=True)
    (root / "data" / "w.bin").write_bytes(b"weights")
    # relative, climbing from a sub-folder to the location's top; absolute, spelled through a
    # link to the location itself; a folder link; a loop
    (root / "step" / "model" / "w.bin").symlink_to("../../data/w.bin")
    (tmp_path / "alias").symlink_to(root)
    (root / "absolute.bin").symlink_to(tmp_path / "alias" / "data" / "w.bin")
    (root / "folder").symlink_to("data")
    (root / "loop").symlink_to("loop")
    storage = Storage(str(root))
    child = storage.child("step").child("model")
    assert child.read_file("w.bin") == b"weights"
    assert storage.read_file("absolute.bin") == b"weights"
    assert storage.read_range("folder/w.bin", 1, 4) == b"eig"
    assert storage.listdir("")["folder"] == -1 and storage.isdir("folder")
    assert storage.sizes(["folder/w.bin", "nothing.bin"]) == {
        "folder/w.bin": 7,
        "nothing.bin": None,
    }
    with pytest.raises(CheckpointError, match="symbolic links"):
        storage.read_file("loop")
    assert not storage.exists("loop")
    assert MAX_LINKS >= 8


def test_a_folder_link_leading_outside_is_refused_as_a_location(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "x.bin").write_bytes(b"secret")
    (root / "sub").symlink_to(outside)
    storage = Storage(str(root))
    with pytest.raises(UnsafePathError, match=r"sub leads to .*outside"):
        storage.child("sub")
    with pytest.raises(UnsafePathError, match="a symlink leading outside"):
        storage.read_file("sub/x.bin")
    allowed = Storage(str(root), allow_roots=[str(outside)])
    assert allowed.child("sub").read_file("x.bin") == b"secret"
    assert allowed.read_file("sub/x.bin") == b"secret"
