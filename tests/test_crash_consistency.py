"""A run killed at any file boundary, then rerun once plainly, ends in the complete output.

The harness kills a real unshard (a DCP checkpoint written by torch) before its Nth file
operation, for every N: each write of a staged file, each ``os.write`` / ``fsync`` / ``mkdir``
/ ``link`` / ``rename`` / ``replace`` / ``unlink`` / ``rmdir``, and each upload or delete on S3.
The killed run and the rerun are processes of their own, forked from a zygote that imported
ckptkit once (so hundreds of kill points stay quick). After each kill: the plain rerun succeeds,
its files are bit-equal to an uninterrupted run's, nothing of ckptkit's is left (no staging
folder, no journal), and nothing outside the destination changed. On every other kill point the
killed run's leftovers are first settled on their own, and the destination must then be
exactly as it was before the run (or, with overwrite, complete): all or nothing.

Also here: staging folders planted to make the clean-up act outside the destination (a
symlinked ``.ckptkit-replaced``, a symlinked folder of the destination, links inside a staging
folder, a staging folder that is a link) leave every file outside the destination untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import ckptkit
from ckptkit.errors import DestinationError
from ckptkit.storage import AtomicOutput, Storage

#: Exit status of a run killed by the harness.
KILLED = 86

_ZYGOTE = r"""
import json, os, sys, tempfile, traceback
import ckptkit
import ckptkit.storage.atomic as atomic

KILLED = int(sys.argv[1])
# Warm up: every import a run makes (torch's for DCP metadata, s3fs) happens once, here.
import s3fs

for to in ("torch", "safetensors", "dcp"):
    operation = ckptkit.convert if to == "dcp" else ckptkit.unshard
    operation(sys.argv[2], os.path.join(sys.argv[3], to), to=to, progress=False)


def run(job, report):
    order = []

    def boundary(kind):
        order.append(kind)
        if len(order) == job["kill_at"]:
            os._exit(KILLED)

    def hooked(owner, name, kind):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            boundary(kind)
            return real(*args, **kwargs)

        setattr(owner, name, call)

    for name in ("write", "fsync", "mkdir", "link", "rename", "replace", "unlink", "rmdir"):
        hooked(os, name, name)
    if job["dst"].startswith("s3://"):  # the coroutines fsspec makes the sync methods of
        for name in ("put_file", "rm_file", "pipe_file"):
            real_coroutine = getattr(s3fs.S3FileSystem, "_" + name)

            async def request(*args, _real=real_coroutine, _kind="s3." + name, **kwargs):
                boundary(_kind)
                return await _real(*args, **kwargs)

            setattr(s3fs.S3FileSystem, "_" + name, request)

    class Counted:
        def __init__(self, stream):
            self._stream = stream

        def write(self, data):
            boundary("file.write")
            return self._stream.write(data)

        def __getattr__(self, name):
            return getattr(self._stream, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._stream.__exit__(*exc)

    real_open = atomic.AtomicOutput.open
    atomic.AtomicOutput.open = lambda self, name: Counted(real_open(self, name))
    tempfile.tempdir = job["tmpdir"]
    operation = ckptkit.convert if job["to"] == "dcp" else ckptkit.unshard
    operation(job["src"], job["dst"], to=job["to"], overwrite=job["overwrite"], progress=False)
    report.write(json.dumps({"order": order}))


for line in sys.stdin:
    job = json.loads(line)
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        status = 0
        with os.fdopen(write, "w") as report:
            try:
                run(job, report)
            except BaseException:
                report.write(json.dumps({"error": traceback.format_exc()}))
                status = 1
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    _, status = os.waitpid(pid, 0)
    reply = json.loads(text) if text else {}
    reply["status"] = os.waitstatus_to_exitcode(status)
    print(json.dumps(reply), flush=True)
"""


class Zygote:
    """A process that imported ckptkit once and forks one run per request: killed before
    its ``kill_at``-th file boundary (0: never), or plain; answers the run's exit status and,
    when it ran to the end, the kinds of its boundaries in order."""

    def __init__(self, warm_up: Path, scratch: Path) -> None:
        command = [sys.executable, "-c", textwrap.dedent(_ZYGOTE), str(KILLED), str(warm_up)]
        self.proc = subprocess.Popen(
            [*command, str(scratch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )

    def run(
        self, src, dst, *, to: str, tmpdir: Path, kill_at: int = 0, overwrite: bool = False
    ) -> dict:
        job = {
            "src": str(src),
            "dst": str(dst),
            "to": to,
            "tmpdir": str(tmpdir),
            "kill_at": kill_at,
            "overwrite": overwrite,
        }
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote(s3, source, tmp_path_factory):
    """Started after the S3 server, so its runs inherit the server's address."""
    process = Zygote(source, tmp_path_factory.mktemp("warm-up"))
    yield process
    process.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A DCP checkpoint written by torch: model, optimizer (tensors and objects), train state."""
    path = tmp_path_factory.mktemp("crash") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen)},
        "optim": {
            "state": {"w": {"exp_avg": torch.randn(32, 16, generator=gen), "step": 3}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
        "train": {"step": 7, "name": "crash"},
    }
    dcp.save(state, checkpoint_id=str(path))
    return path


def _tree(root: Path) -> dict[str, object]:
    """Everything under ``root``, links as links (never followed): path → bytes, link target
    or ``"folder"``."""
    found: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = "folder"
            else:
                found[rel] = path.read_bytes()
    return found


def _files(folder: Path) -> dict[str, object]:
    """The regular files of ``folder``; a DCP ``.metadata`` as torch reads it (each save
    records a new random id)."""
    found: dict[str, object] = {}
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            found[path.name] = path.read_bytes()
    if ".metadata" in found:
        found[".metadata"] = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return found


def _ckptkit_leftovers(*folders: Path) -> list[str]:
    return [
        str(p)
        for folder in folders
        if folder.exists()
        for p in folder.iterdir()
        if p.name.startswith((".ckptkit-", "ckptkit-"))
    ]


@pytest.fixture
def reference(source, tmp_path_factory):
    """Factory: the files an uninterrupted run writes for target ``to``."""
    made: dict[str, dict[str, bytes]] = {}

    def get(to: str) -> dict[str, bytes]:
        if to not in made:
            out = tmp_path_factory.mktemp("reference") / to
            operation = ckptkit.convert if to == "dcp" else ckptkit.unshard
            operation(str(source), str(out), to=to, progress=False)
            made[to] = _files(out)
        return made[to]

    return get


def _settle(dst: str) -> None:
    """What any later run does first: settle what killed runs left in ``dst``."""
    AtomicOutput(Storage(dst)).discard()


def _kill_points(order: list[str], every: int) -> list[int]:
    """Every boundary (numbered from 1), but only each ``every``-th write of a staged file
    (the first included): killed before publishing, these all leave the same."""
    points, writes = [], 0
    for number, kind in enumerate(order, 1):
        if kind == "file.write":
            writes += 1
            if (writes - 1) % every:
                continue
        points.append(number)
    return points


def _kill_everywhere(zygote, source, reference, tmp_path, *, to, prepare, overwrite=False, every=1):
    """Kill the run into a destination made by ``prepare(dst)`` at each of its boundaries
    (each ``every``-th staged write), rerun it plainly, and check the outcome each time; the
    number of kill points."""
    expected = reference(to)
    temp = tmp_path / "tmp"
    temp.mkdir()
    counted = tmp_path / "counted" / "out"
    prepare(counted)
    done = zygote.run(source, counted, to=to, tmpdir=temp, overwrite=overwrite)
    assert done["status"] == 0, done.get("error")
    assert {"file.write", "fsync", "rename", "replace", "unlink"} <= set(done["order"])
    points = _kill_points(done["order"], every)
    outside = _tree(source.parent)  # the source checkpoint's folder
    for kill_at in points:
        case = tmp_path / f"kill{kill_at}"
        dst = case / "out"
        prepare(dst)
        before = _tree(case)
        killed = zygote.run(source, dst, to=to, tmpdir=temp, kill_at=kill_at, overwrite=overwrite)
        assert killed["status"] == KILLED, (kill_at, killed)
        if kill_at % 2 == 0:  # its leftovers settled on their own: all or nothing
            _settle(str(dst))
            after = _tree(case)
            if "out" not in before and after.get("out") == "folder":
                before = {**before, "out": "folder"}  # the folder the killed run made stays
            complete = {**before, **{f"out/{n}": data for n, data in expected.items()}}
            assert after == before or (overwrite and after == complete), (
                kill_at,
                done["order"][kill_at - 1],
            )
        rerun = zygote.run(source, dst, to=to, tmpdir=temp, overwrite=overwrite)
        assert rerun["status"] == 0, (kill_at, done["order"][kill_at - 1], rerun.get("error"))
        files = _files(dst)
        assert {n: files[n] for n in expected} == expected, kill_at
        others = {rel: v for rel, v in before.items() if rel.split("/", 1)[-1] not in expected}
        assert {rel: v for rel, v in _tree(case).items() if rel in others} == others
        assert set(_tree(case)) == set(before) | {f"out/{n}" for n in expected} | {"out"}
        assert _ckptkit_leftovers(dst, temp) == [], kill_at
        shutil.rmtree(case)
    assert _tree(source.parent) == outside
    return len(points)


def _new_folder(dst: Path) -> None:
    dst.parent.mkdir(parents=True)


def _folder_with_other_files(dst: Path) -> None:
    """A destination holding other files, a folder, and a folder that is a symlink leading out."""
    outside = dst.parent / "outside"
    outside.mkdir(parents=True)
    (outside / "secret.txt").write_text("not the destination's")
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    (dst / "keep").mkdir()
    (dst / "keep" / "data.bin").write_bytes(b"\x00\x01" * 100)
    (dst / "linked").symlink_to(outside, target_is_directory=True)


def test_killed_unshard_into_a_new_folder_always_ends_complete(zygote, source, reference, tmp_path):
    points = _kill_everywhere(
        zygote, source, reference, tmp_path, to="safetensors", prepare=_new_folder
    )
    assert points > 40


def test_killed_unshard_into_a_folder_with_other_files_always_ends_complete(
    zygote, source, reference, tmp_path
):
    points = _kill_everywhere(
        zygote, source, reference, tmp_path, to="torch", prepare=_folder_with_other_files, every=4
    )
    assert points >= 20  # every publishing boundary, and each 4th staged write


def test_killed_overwrite_restores_or_completes(zygote, source, reference, tmp_path):
    """With overwrite, a killed run's leftovers give back the earlier outputs (or, once its
    journal is gone, leave the complete new ones); the rerun with overwrite completes."""

    def earlier_outputs(dst: Path) -> None:
        _folder_with_other_files(dst)
        for name in reference("torch"):
            (dst / name).write_bytes(b"an earlier output of " + name.encode())

    _kill_everywhere(
        zygote,
        source,
        reference,
        tmp_path,
        to="torch",
        prepare=earlier_outputs,
        overwrite=True,
        every=8,
    )


def test_killed_convert_to_dcp_always_ends_complete(zygote, source, reference, tmp_path):
    _kill_everywhere(zygote, source, reference, tmp_path, to="dcp", prepare=_new_folder, every=8)


# -- S3 ----------------------------------------------------------------------------------------


def _bucket_objects(fs, bucket: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {key: fs.cat_file(key) for key in fs.find(bucket)}


def test_killed_unshard_to_s3_always_ends_complete(zygote, source, reference, tmp_path):
    """An upload killed anywhere: the rerun deletes what the killed run had uploaded (its
    journal says which) and uploads all; the staging in the temporary folder is gone and no
    other object changed. Kill points: the first staged write, and every one from the journal on."""
    fs = fsspec.filesystem("s3")
    bucket = f"crash-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.pipe_file(f"{bucket}/runs/beside/keep.txt", b"not the destination's")
    expected = reference("safetensors")
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = zygote.run(source, f"s3://{bucket}/counted", to="safetensors", tmpdir=temp)
    assert done["status"] == 0, done.get("error")
    order = done["order"]
    journal = order.index("write")  # the journal, written before the first upload
    points = [order.index("file.write") + 1, *range(journal + 1, len(order) + 1)]
    assert sum(kind == "s3.put_file" for kind in order) == len(expected)
    for kill_at in points:
        dst = f"{bucket}/runs/out{kill_at}"
        fs.pipe_file(f"{dst}/notes.txt", b"keep me")
        before = _bucket_objects(fs, bucket)
        killed = zygote.run(source, f"s3://{dst}", to="safetensors", tmpdir=temp, kill_at=kill_at)
        assert killed["status"] == KILLED, (kill_at, killed)
        rerun = zygote.run(source, f"s3://{dst}", to="safetensors", tmpdir=temp)
        assert rerun["status"] == 0, (kill_at, order[kill_at - 1], rerun.get("error"))
        after = _bucket_objects(fs, bucket)
        assert after == {**before, **{f"{dst}/{n}": data for n, data in expected.items()}}
        assert _ckptkit_leftovers(temp) == [], (kill_at, order[kill_at - 1])
    assert len(points) > 10


# -- clean-up that never follows a link ----------------------------------------------------------


def _gone_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return int(proc.stdout)


def _dead_staging(dst: Path, name: str = "killed") -> Path:
    """A staging folder as a killed run leaves it: its owner (on this host) is gone."""
    folder = dst / f".ckptkit-tmp-{name}"
    folder.mkdir(parents=True)
    owner = {"pid": _gone_pid(), "host": socket.gethostname(), "start": None}
    (folder / ".ckptkit-owner").write_text(json.dumps(owner))
    return folder


@pytest.fixture
def victim(tmp_path) -> Path:
    """A folder outside the destination, with files the clean-up must never touch."""
    folder = tmp_path / "victim"
    (folder / "ssh").mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"the victim's model")
    (folder / "ssh" / "id_ed25519").write_text("private key")
    return folder


def test_a_symlinked_replaced_folder_is_not_followed(source, victim, tmp_path):
    """``.ckptkit-replaced`` of a dead staging folder leading out: nothing of the folder it
    leads to is moved into the destination (nor anywhere)."""
    dst = tmp_path / "out"
    staging = _dead_staging(dst)
    (staging / ".ckptkit-replaced").symlink_to(victim, target_is_directory=True)
    before = _tree(victim)
    ckptkit.unshard(str(source), str(dst), progress=False)
    assert _tree(victim) == before
    assert sorted(p.name for p in dst.iterdir()) == ["model.pt", "optim.pt", "train.pt"]
    assert torch.load(dst / "model.pt", weights_only=True)["w"].shape == (32, 16)


def test_restoring_never_writes_through_a_symlinked_folder_of_the_destination(
    source, victim, tmp_path
):
    """``dst/ssh`` leads out and a dead staging folder kept ``ssh/authorized_keys``: it is not
    written into the folder ``ssh`` leads to."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "ssh").symlink_to(victim / "ssh", target_is_directory=True)
    staging = _dead_staging(dst)
    (staging / ".ckptkit-replaced" / "ssh").mkdir(parents=True)
    (staging / ".ckptkit-replaced" / "ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA evil")
    before = _tree(victim)
    ckptkit.unshard(str(source), str(dst), progress=False)
    assert _tree(victim) == before
    assert not (victim / "ssh" / "authorized_keys").exists()
    assert (dst / "ssh").is_symlink() and _ckptkit_leftovers(dst) == []


def test_links_inside_a_dead_staging_folder_are_removed_not_followed(source, victim, tmp_path):
    dst = tmp_path / "out"
    staging = _dead_staging(dst)
    (staging / "model.pt").symlink_to(victim / "model.pt")
    (staging / "ssh").symlink_to(victim / "ssh", target_is_directory=True)
    (staging / ".ckptkit-replaced").mkdir()
    (staging / ".ckptkit-replaced" / "model.pt").symlink_to(victim / "model.pt")
    (staging / ".ckptkit-replaced" / "keys").symlink_to(victim / "ssh", target_is_directory=True)
    before = _tree(victim)
    ckptkit.unshard(str(source), str(dst), progress=False)
    assert _tree(victim) == before
    assert sorted(p.name for p in dst.iterdir()) == ["model.pt", "optim.pt", "train.pt"]
    assert not (dst / "model.pt").is_symlink()


def test_a_staging_name_that_is_a_link_is_left_alone(source, victim, tmp_path):
    """A link named like a staging folder (leading to a folder whose owner file says its owner
    is gone) is not ours: neither it nor what it leads to is touched."""
    dst = tmp_path / "out"
    dst.mkdir()
    owner = {"pid": _gone_pid(), "host": socket.gethostname(), "start": None}
    (victim / ".ckptkit-owner").write_text(json.dumps(owner))
    (dst / ".ckptkit-tmp-link").symlink_to(victim, target_is_directory=True)
    before = _tree(victim)
    ckptkit.unshard(str(source), str(dst), progress=False)
    assert _tree(victim) == before
    assert (dst / ".ckptkit-tmp-link").is_symlink()


def test_a_planted_journal_cannot_reach_outside(source, victim, tmp_path):
    """A dead owner's journal naming files outside (climbing names, a symlinked folder) and a
    kept file to restore through a link: rolled back inside the destination only."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "ssh").symlink_to(victim / "ssh", target_is_directory=True)
    staging = _dead_staging(dst)
    (staging / ".ckptkit-replaced" / "ssh").mkdir(parents=True)
    (staging / ".ckptkit-replaced" / "ssh" / "id_ed25519").write_text("replaced key")
    status = (victim / "model.pt").stat()
    key = (victim / "ssh" / "id_ed25519").stat()
    files = [
        {
            "name": "../victim/model.pt",
            "device": status.st_dev,
            "inode": status.st_ino,
            "replaced": False,
        },
        {"name": "ssh/id_ed25519", "device": key.st_dev, "inode": key.st_ino, "replaced": True},
    ]
    journal = {
        "version": 1,
        "owner": json.loads((staging / ".ckptkit-owner").read_text()),
        "files": files,
    }
    (dst / f"{staging.name}.journal").write_text(json.dumps(journal))
    before = _tree(victim)
    ckptkit.unshard(str(source), str(dst), progress=False)
    assert _tree(victim) == before
    assert _ckptkit_leftovers(dst) == []


def test_an_output_under_a_symlinked_folder_is_refused(victim, tmp_path):
    """Publishing ``ssh/authorized_keys`` where ``dst/ssh`` leads out: refused (ELOOP), nothing
    written there, the destination as it was."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "ssh").symlink_to(victim / "ssh", target_is_directory=True)
    before = _tree(victim)
    output = AtomicOutput(Storage(str(dst)))
    for name in ("a.pt", "ssh/authorized_keys"):
        with output.open(name) as stream:
            stream.write(b"data")
    with pytest.raises(DestinationError, match="symbolic link"):
        output.commit()
    assert _tree(victim) == before
    assert sorted(p.name for p in dst.iterdir()) == ["ssh"]


def test_a_remote_journal_in_the_shared_temporary_folder_is_only_trusted_from_its_user(
    s3, source, tmp_path, monkeypatch
):
    """A journal for an S3 destination in the temporary folder, owned by a dead process but not
    by this user, deletes nothing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another user")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    fs = fsspec.filesystem("s3")
    bucket = f"crash-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.pipe_file(f"{bucket}/out/model.pt", b"someone's model")
    destination = Storage(f"s3://{bucket}/out")
    owner = {"pid": _gone_pid(), "host": socket.gethostname(), "start": None}
    record = {
        "version": 1,
        "owner": owner,
        "files": [{"name": "model.pt"}],
        "destination": f"s3://{bucket}/out",
        "remove_on_rollback": True,
    }
    journal = temp / "ckptkit-planted.journal"
    journal.write_text(json.dumps(record))
    os.chown(journal, 12345, 12345)
    AtomicOutput(destination).discard()
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/out/model.pt") == b"someone's model"
    assert journal.exists()
    os.chown(journal, os.geteuid(), os.getegid())  # now this user's: rolled back
    AtomicOutput(destination).discard()
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/out/model.pt") and not journal.exists()
