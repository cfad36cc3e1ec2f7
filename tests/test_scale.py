"""Scale-out: unshard / convert / verify / diff on several threads (``workers=``) and across the
ranks of torchrun, with outputs identical to one process's and all-or-nothing on failure."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
from byte_edits import damaged_copy

import ckptkit
from ckptkit import tunables
from ckptkit.errors import ChecksumError, UsageError
from ckptkit.ops import work

from isolated import torchrun
from oracle import assert_same_structure, digests, torch_unsharded

#: Small enough that the sample's model and optimizer split into many shards: many work items.
SHARD = "64KiB"


def dcp_metadata_without_save_id(root: Path) -> dict:
    """The DCP ``.metadata`` as torch reads it, minus its random ``save_id``."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(root)).read_metadata()
    return {
        "state": repr(metadata.state_dict_metadata),
        "storage": repr(sorted(metadata.storage_data.items(), key=repr)),
        "planner": repr(metadata.planner_data),
    }


def unshard_all(src: Path, out: Path, **kwargs) -> dict[str, list]:
    """Every target: torch.save, safetensors in many shards, DCP; what each result lists."""
    listed = {}
    for name, call in {
        "torch": lambda dst: ckptkit.unshard(str(src), dst, progress=False, **kwargs),
        "st": lambda dst: ckptkit.unshard(
            str(src), dst, to="safetensors", max_shard_size=SHARD, progress=False, **kwargs
        ),
        "dcp": lambda dst: ckptkit.convert(str(src), dst, to="dcp", progress=False, **kwargs),
    }.items():
        result = call(str(out / name))
        listed[name] = [(f.name, f.nbytes, f.tensors, f.objects) for f in result.files]
    return listed


def test_workers_write_the_same_bytes_as_one_process(ws2, tmp_path):
    """torch.save and safetensors shards: the same files, bit for bit. DCP: a data file per
    worker (as torch's writer has one per rank), read by torch as the same state."""
    one = unshard_all(ws2.path, tmp_path / "one")
    four = unshard_all(ws2.path, tmp_path / "four", workers=4)
    dcp_one, dcp_four = one.pop("dcp"), four.pop("dcp")
    assert one == four  # the same files, listed in the same (plan) order
    assert len(one["st"]) > 8  # the shard size made many work items
    for target in one:
        assert digests(tmp_path / "one" / target) == digests(tmp_path / "four" / target)
    assert_same_dcp(tmp_path / "one" / "dcp", tmp_path / "four" / "dcp", tmp_path)
    assert [name for name, *_ in dcp_one] == ["__0_0.distcp", ".metadata"]
    assert [name for name, *_ in dcp_four] == [f"__{i}_0.distcp" for i in range(4)] + [".metadata"]
    assert sum(f[1] for f in dcp_one[:-1]) == sum(f[1] for f in dcp_four[:-1])  # same records
    assert [sum(f[k] for f in dcp_four) for k in (2, 3)] == [dcp_one[0][2], dcp_one[0][3]]


def assert_same_dcp(a: Path, b: Path, tmp_path: Path) -> None:
    """Two DCP directories torch reads as the same state (the same keys and chunks, objects
    equal, tensors bit-equal), however their records are spread over data files."""
    assert dcp_metadata_without_save_id(a)["state"] == dcp_metadata_without_save_id(b)["state"]
    scratch = tmp_path / f"torch-{a.name}-{b.name}"
    scratch.mkdir()
    expected = torch_unsharded(a, scratch)
    (scratch / "dcp_to_torch_save.pt").unlink()
    assert_same_structure(torch_unsharded(b, scratch), expected, "state", ordered=True)


def test_workers_verify_and_diff_equal_one_process(ws2, mutant, tmp_path):
    damaged, _ = damaged_copy(ws2.path, tmp_path / "damaged")
    one, four = ckptkit.verify(str(damaged)), ckptkit.verify(str(damaged), workers=4)
    assert not one.empty and one["problem"].eq("checksum").any()
    assert one.equals(four)
    d1 = ckptkit.diff(str(ws2.path), str(mutant))
    d4 = ckptkit.diff(str(ws2.path), str(mutant), workers=4)
    assert d1.equals(d4)
    assert (d1["status"] != "equal").any()


def test_a_failing_worker_leaves_nothing_and_names_the_damage(ws2, tmp_path):
    damaged, key = damaged_copy(ws2.path, tmp_path / "damaged")
    dst = tmp_path / "out"
    with pytest.raises(ChecksumError, match=rf"__0_0\.distcp.*{key}"):
        ckptkit.unshard(str(damaged), str(dst), to="safetensors", max_shard_size=SHARD, workers=4)
    assert not dst.exists()  # no final file, no staging folder, no folder made for it


@pytest.fixture
def split_everything(monkeypatch):
    """Every file of more than a worker's share is split (the sample is small); the size each
    split file was opened at, by name."""
    from ckptkit.storage import AtomicOutput

    monkeypatch.setattr(tunables, "SPLIT_FILE_BYTES", 0)
    opened: dict[str, int] = {}
    original = AtomicOutput.open_ranges

    def open_ranges(self, name, size):
        opened[name] = size
        return original(self, name, size)

    monkeypatch.setattr(AtomicOutput, "open_ranges", open_ranges)
    return opened


@pytest.mark.parametrize(
    ("to", "names", "file"),
    [
        ("torch", "groups", "model.pt"),
        ("safetensors", "groups", "model.safetensors"),
        ("safetensors", "transformers", "model.safetensors"),
    ],
)
def test_one_file_written_by_workers_is_the_file_one_process_writes(
    ws2, tmp_path, split_everything, to, names, file
):
    """One ``model.pt`` / ``model.safetensors`` (no shard size) written by 4 workers as byte
    ranges: the same bytes as one worker writes, which torch / the safetensors library read
    back as the state the job held."""
    written = {}
    for workers in (1, 4):
        out = tmp_path / str(workers)
        result = ckptkit.unshard(
            str(ws2.path), str(out), to=to, names=names, workers=workers, progress=False
        )
        written[workers] = [(f.name, f.nbytes, f.tensors) for f in result.files]
    assert written[1] == written[4]
    assert digests(tmp_path / "1") == digests(tmp_path / "4")
    model = tmp_path / "4" / file
    assert split_everything[file] <= model.stat().st_size  # written in parts, not by one worker
    if to == "torch":
        import torch

        loaded = torch.load(model, weights_only=True, mmap=True)
    else:
        from safetensors.torch import load_file

        loaded = load_file(model)
    reference = ws2.reference()["model"]
    assert set(loaded) == set(reference)
    for key in reference:
        assert loaded[key].equal(reference[key]), key


def test_split_zip64_records_are_the_sequential_writers(
    ws2, tmp_path, split_everything, monkeypatch
):
    """zip64 fields (offsets and sizes past 4 GiB, forced here by a lower limit) written by
    workers at their places are byte for byte those one worker writes in order."""
    from ckptkit.ops.writers import torch_save

    monkeypatch.setattr(torch_save, "_ZIP64_LIMIT", 4096)
    for workers in (1, 4):
        ckptkit.unshard(
            str(ws2.path), str(tmp_path / str(workers)), workers=workers, progress=False
        )
    assert b"PK\x06\x06" in (tmp_path / "1" / "model.pt").read_bytes()  # zip64 end record
    assert digests(tmp_path / "1") == digests(tmp_path / "4")
    assert "model.pt" in split_everything


def test_a_failing_part_leaves_nothing_and_no_open_file(ws2, tmp_path, split_everything):
    """A damaged source under a split file: the error names the damage, no output, no staging
    folder, and the file every part was writing is closed."""
    damaged, key = damaged_copy(ws2.path, tmp_path / "damaged")
    before = len(os.listdir("/proc/self/fd"))
    for to in ("torch", "safetensors"):
        dst = tmp_path / to
        with pytest.raises(ChecksumError, match=rf"__0_0\.distcp.*{key}"):
            ckptkit.unshard(str(damaged), str(dst), to=to, workers=4, progress=False)
        assert not dst.exists()
    assert {"model.pt", "model.safetensors"} <= set(split_everything)  # failed in the parts
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize(
    ("sizes", "n"),
    [
        ([5, 5, 5, 5], 2),
        ([100, 1, 1, 1], 2),
        ([1, 1, 1, 100], 3),
        ([0, 0, 0], 2),
        ([7], 4),
        ([], 3),
    ],
)
def test_consecutive_runs_cover_every_index_once_in_at_most_n_runs(sizes, n):
    runs = work.consecutive_runs(sizes, n)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    assert len(runs) <= n and all(len(run) for run in runs)
    if sizes == [5, 5, 5, 5]:
        assert runs == [range(0, 2), range(2, 4)]


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_workers_must_be_a_positive_integer(ws2, tmp_path, workers):
    with pytest.raises(UsageError, match="workers"):
        ckptkit.unshard(str(ws2.path), str(tmp_path / "out"), workers=workers)
    assert not os.path.exists(tmp_path / "out")


# -- torchrun ---------------------------------------------------------------------------------

#: Run under torchrun by the tests below: the public API called inside an initialised process
#: group (:func:`api_report`). argv: out_dir, then source paths; rank 0 writes result.json.
API_UNDER_TORCHRUN = r"""
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, TESTS)
from test_scale import api_report

dist.init_process_group("gloo")
report = api_report(sys.argv[2:], sys.argv[1])
if dist.get_rank() == 0:
    with open(os.path.join(sys.argv[1], "result.json"), "w") as handle:
        json.dump(report, handle)
dist.destroy_process_group()
""".replace("TESTS", repr(str(Path(__file__).parent)))


def api_report(sources: list, out) -> dict:
    """unshard to torch / safetensors shards and convert to DCP (every target on the first
    source, safetensors on the others), verify and diff: what each returned, as JSON values."""
    import json

    report = {}
    for i, src in enumerate(map(str, sources)):
        targets = {
            "st": lambda dst, src=src: ckptkit.unshard(
                src, dst, to="safetensors", max_shard_size=SHARD, progress=False
            ),
            "torch": lambda dst, src=src: ckptkit.unshard(src, dst, progress=False),
            "dcp": lambda dst, src=src: ckptkit.convert(src, dst, to="dcp", progress=False),
        }
        for name, call in list(targets.items())[: 3 if i == 0 else 1]:
            result = call(os.path.join(out, f"{i}-{name}"))
            report[f"{i}-{name}"] = [[f.name, f.nbytes, f.tensors, f.objects] for f in result.files]
    report["verify"] = ckptkit.verify(str(sources[0])).to_dict("records")
    report["diff"] = ckptkit.diff(str(sources[0]), str(sources[-1])).astype(str).to_dict("records")
    return json.loads(json.dumps(report))


#: Sources of other formats (checked-in fixtures written by their projects' own tools).
FIXTURES = Path(__file__).parent / "fixtures"
OTHER_SOURCES = [
    FIXTURES / "deepspeed_zero3_ws2" / "checkpoint",
    FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint",
    FIXTURES / "olmo_core3_trainer_ws2" / "step3",
]


@pytest.mark.parametrize("nproc", [2, 4])
def test_api_under_torchrun_equals_one_process(ws2, mutant, tmp_path, nproc):
    """unshard (torch, safetensors shards), convert (DCP), verify and diff called inside a
    process group of 2 and 4 ranks: the same files, bit for bit, and the same tables as one
    process, for the FSDP2 sample and DeepSpeed, Megatron and OLMo-core sources."""
    import json

    sources = [ws2.path, *OTHER_SOURCES, mutant]
    script = tmp_path / "job.py"
    script.write_text(API_UNDER_TORCHRUN)
    torchrun(script, tmp_path / "ranks", *sources, nproc=nproc)
    expected = api_report(sources, tmp_path / "one")
    report = json.loads((tmp_path / "ranks" / "result.json").read_text())
    (tmp_path / "ranks" / "result.json").unlink()
    # DCP: a data file per rank, as torch's writer has; the same state
    dcp_files = [name for name, *_ in report.pop("0-dcp")]
    assert dcp_files == [f"__{r}_0.distcp" for r in range(nproc)] + [".metadata"]
    expected.pop("0-dcp")
    assert report == expected
    assert_same_dcp(tmp_path / "one" / "0-dcp", tmp_path / "ranks" / "0-dcp", tmp_path)
    shutil.rmtree(tmp_path / "one" / "0-dcp")
    shutil.rmtree(tmp_path / "ranks" / "0-dcp")
    assert digests(tmp_path / "ranks") == digests(tmp_path / "one")
    assert not list((tmp_path / "ranks").rglob(".ckptkit-*"))  # no staging left behind


#: Every rank writes byte ranges of one file (the sample is small: every file is split).
#: argv: out_dir, source, workers; rank 0 writes result.json.
SHARED_UNDER_TORCHRUN = r"""
import json, os, sys
import torch.distributed as dist
import ckptkit

ckptkit.tunables.SPLIT_FILE_BYTES = 0
dist.init_process_group("gloo")
out, src, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
report = {}
for to in ("torch", "safetensors"):
    result = ckptkit.unshard(src, os.path.join(out, to), to=to, workers=workers, progress=False)
    report[to] = [[f.name, f.nbytes, f.tensors, f.objects] for f in result.files]
# the gloo groups the jobs made are gone: left for interpreter shutdown, one can abort the process
report["groups"] = len(dist.distributed_c10d._world.pg_map)
if dist.get_rank() == 0:
    with open(os.path.join(out, "result.json"), "w") as handle:
        json.dump(report, handle)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("nproc", "workers"), [(2, 1), (2, 2)])
def test_ranks_write_byte_ranges_of_one_file(ws2, tmp_path, nproc, workers):
    """A file larger than a rank's share (the optimizer's ``optim.pt`` / ``optim.safetensors``)
    written by every rank (each its parts, on its threads), staged and published by one: the
    files one process writes, bit for bit, and nothing left behind."""
    import json

    script = tmp_path / "job.py"
    script.write_text(SHARED_UNDER_TORCHRUN)
    logs = tmp_path / "logs"
    torchrun(
        script,
        tmp_path / "ranks",
        ws2.path,
        workers,
        nproc=nproc,
        env={"CKPTKIT_RANK_LOGS": str(logs)},
    )
    report = json.loads((tmp_path / "ranks" / "result.json").read_text())
    (tmp_path / "ranks" / "result.json").unlink()
    assert report.pop("groups") == 1  # only the default group: nothing of ckptkit's outlives a job
    expected = {}
    for to in ("torch", "safetensors"):
        result = ckptkit.unshard(str(ws2.path), str(tmp_path / "one" / to), to=to, progress=False)
        expected[to] = [[f.name, f.nbytes, f.tensors, f.objects] for f in result.files]
    assert report == expected
    assert digests(tmp_path / "ranks") == digests(tmp_path / "one")
    assert not list((tmp_path / "ranks").rglob(".ckptkit-*"))
    for rank in range(nproc):  # each rank wrote parts of the largest file of each target
        text = (logs / f"rank{rank}.log").read_text()
        for name in ("optim.pt", "optim.safetensors"):
            found = re.search(rf"writing (\d+) of the (\d+) parts of {re.escape(name)} ", text)
            assert found and int(found[1]) >= 1 and int(found[2]) == nproc * workers, text


#: As above, on a damaged source: each rank records the error it raised. argv: out, source.
SHARED_FAILING = r"""
import json, os, sys
import torch.distributed as dist
import ckptkit

ckptkit.tunables.SPLIT_FILE_BYTES = 0
dist.init_process_group("gloo")
out, src = sys.argv[1], sys.argv[2]
try:
    ckptkit.unshard(src, os.path.join(out, "dst"), progress=False)
    raised = None
except Exception as exc:
    raised = [type(exc).__name__, str(exc)]
with open(os.path.join(out, f"error{dist.get_rank()}.json"), "w") as handle:
    json.dump(raised, handle)
dist.destroy_process_group()
"""


def test_a_damaged_part_of_a_shared_file_fails_every_rank_and_leaves_nothing(ws2, tmp_path):
    import json

    damaged, key = damaged_copy(ws2.path, tmp_path / "damaged")
    assert key.startswith("optim.")  # inside the file the ranks share
    script = tmp_path / "job.py"
    script.write_text(SHARED_FAILING)
    out = tmp_path / "out"
    out.mkdir()
    torchrun(script, out, damaged)
    errors = [json.loads((out / f"error{rank}.json").read_text()) for rank in range(2)]
    assert all(kind == "DistributedError" for kind, _ in errors), errors
    assert all("ChecksumError" in message and key in message for _, message in errors), errors
    assert not (out / "dst").exists()  # no file, no staging folder, no folder made for it


#: Rank 1 dies (as if killed) once it has written its first output bytes.
DIE_MID_WRITE = r"""
import os, sys
import torch.distributed as dist
import ckptkit
from ckptkit.ops.writers import safetensors as writer

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    original = writer.write
    def dying(stream, *args, **kwargs):
        stream.write(b"partial")
        stream.flush()
        os._exit(9)
    writer.write = dying
ckptkit.unshard(sys.argv[1], sys.argv[2], to="safetensors", max_shard_size="64KiB",
                progress=False)
"""


def test_a_rank_killed_mid_run_leaves_no_output_and_a_rerun_succeeds(ws2, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "die.py"
    script.write_text(DIE_MID_WRITE)
    dst = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), str(ws2.path), str(dst)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    final = [p.name for p in dst.iterdir() if not p.name.startswith(".ckptkit-")]
    assert final == []  # nothing under a final name; staging of killed ranks may remain
    result = ckptkit.unshard(str(ws2.path), str(dst), to="safetensors", max_shard_size=SHARD)
    assert [p.name for p in dst.iterdir() if p.name.startswith(".ckptkit-")] == []
    ckptkit.unshard(str(ws2.path), str(tmp_path / "one"), to="safetensors", max_shard_size=SHARD)
    assert digests(dst) == digests(tmp_path / "one") and len(result.files) > 8


def test_cli_on_two_hosts_writes_to_a_shared_s3_destination(ws2, s3, tmp_path):
    """Two torchrun "hosts" (node ranks 0 and 1, each its own local staging folder) unshard
    into one S3 prefix on the loopback server; the objects equal a single-process run's."""
    import subprocess
    import sys

    import fsspec

    endpoint = f"127.0.0.1:{_free_port()}"
    fs = fsspec.filesystem("s3")
    if not fs.exists("ckptkit-scale"):
        fs.mkdir("ckptkit-scale")
    dst = "s3://ckptkit-scale/two-hosts"
    nodes = []
    for node in range(2):
        staging = tmp_path / f"host{node}-tmp"
        staging.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        command += ["--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", endpoint, "--rdzv-id", "scale-test"]
        command += ["-m", "ckptkit", "unshard", str(ws2.path), dst, "--to", "safetensors"]
        command += ["--max-shard-size", SHARD, "--quiet"]
        env = {**os.environ, "TMPDIR": str(staging), "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0]
    assert "wrote" in outputs[0] and outputs[1] == ""  # rank 0 reports, once
    remote = {
        path.rsplit("/", 1)[1]: hashlib.sha256(fs.cat_file(path)).hexdigest()
        for path in fs.find("ckptkit-scale/two-hosts")
    }
    ckptkit.unshard(str(ws2.path), str(tmp_path / "one"), to="safetensors", max_shard_size=SHARD)
    assert remote == digests(tmp_path / "one")
    for node in range(2):  # each host staged its share locally and cleaned up
        assert list((tmp_path / f"host{node}-tmp").glob("*ckptkit*")) == []


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
