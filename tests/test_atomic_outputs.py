"""All-or-nothing outputs: a killed, full-disk or refused unshard leaves the destination as it was."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptkit
import ckptkit.storage.atomic as storage_module

N_TENSORS, ROWS = 6, 4096  # six 64 MB float32 tensors


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    """A 384 MB DCP checkpoint written by torch: unsharding it takes a few seconds."""
    path = tmp_path_factory.mktemp("big") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(ROWS, 4096, generator=gen) for i in range(N_TENSORS)}}
    dcp.save(state, checkpoint_id=str(path))
    return path


def _staged_bytes(dst: Path) -> int:
    return sum(
        f.stat().st_size for d in dst.glob(".ckptkit-tmp-*") for f in d.rglob("*") if f.is_file()
    )


def test_sigkill_mid_unshard_leaves_no_final_file_and_a_rerun_succeeds(big_checkpoint, tmp_path):
    dst = tmp_path / "out"
    argv = [sys.executable, "-m", "ckptkit.cli", "unshard", str(big_checkpoint), str(dst)]
    argv += ["--dtype", "bfloat16", "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _staged_bytes(dst) == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "unshard finished before it could be killed"
    staged = _staged_bytes(dst)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert staged > 0
    assert not (dst / "model.pt").exists()
    assert [p.name for p in dst.iterdir() if not p.name.startswith(".ckptkit-tmp-")] == []

    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    loaded = torch.load(dst / "model.pt", weights_only=True, mmap=True)
    source = ckptkit.open(str(big_checkpoint))
    assert sorted(loaded) == [f"w{i}" for i in range(N_TENSORS)]
    assert torch.equal(loaded["w5"], source.read("model.w5").to(torch.bfloat16))


class _FillsUp:
    """A file that raises ENOSPC once ``room`` bytes were written, as a full disk does."""

    def __init__(self, stream, room: int) -> None:
        self.stream, self.room = stream, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()


def _snapshot(dst: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dst)): p.read_bytes() for p in dst.rglob("*") if p.is_file()}


def test_disk_full_leaves_the_destination_as_it_was(written, tmp_path, monkeypatch):
    src = written("fsdp2_ws2").path
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "model.pt").write_bytes(b"an older unshard")
    (dst / "notes.txt").write_text("keep me")
    before = _snapshot(dst)
    real_open = storage_module.AtomicOutput.open
    monkeypatch.setattr(
        storage_module.AtomicOutput,
        "open",
        lambda self, name: _FillsUp(real_open(self, name), 100_000),
    )
    with pytest.raises(OSError) as info:
        ckptkit.unshard(str(src), str(dst), overwrite=True, progress=False)
    assert info.value.errno == errno.ENOSPC
    assert _snapshot(dst) == before
    assert not list(dst.glob(".ckptkit-tmp-*"))


def test_unwritable_destination_is_refused_before_any_output(written, tmp_path):
    src = written("fsdp2_ws2").path
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output directory should go")
    with pytest.raises(OSError):
        ckptkit.unshard(str(src), str(blocker / "out"), progress=False)
    assert blocker.read_text() == "a file where the output directory should go"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


def test_permission_error_while_committing_leaves_the_destination_as_it_was(
    written, tmp_path, monkeypatch
):
    """A rename refused half-way through the commit (EACCES on the second file) must not leave
    the first file in place."""
    src = written("fsdp2_ws2").path
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    before = _snapshot(dst)
    real_replace = os.replace
    calls = []

    def refuse_second(a, b, **dir_fds):
        calls.append(b)
        if len(calls) == 2:
            raise PermissionError(errno.EACCES, "Permission denied", b)
        return real_replace(a, b, **dir_fds)

    monkeypatch.setattr(storage_module.os, "replace", refuse_second)
    with pytest.raises(PermissionError):
        ckptkit.unshard(str(src), str(dst), progress=False)  # model.pt, optim.pt, train.pt
    assert len(calls) >= 2
    assert _snapshot(dst) == before
    assert not list(dst.glob(".ckptkit-tmp-*"))
