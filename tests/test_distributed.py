"""ckptkit.distributed on real torch.distributed jobs: 2 ranks on CPU/gloo started by torchrun
(one "host", and two "hosts" rendezvousing over c10d on this machine) or by plain env:// variables;
a failing, a killed and a hung rank; plus the pure parts (balance, single-process progress, logs)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import DistributedError, UsageError
from ckptkit.ops.distributed import JobProgress, Ranks, balance, joined, rank_logger

#: One rank of a test job: ``python job.py SCENARIO OUT_DIR``; writes OUT_DIR/rank{r}.json.
RANK_JOB = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from pathlib import Path

    from ckptkit.ops.distributed import JobProgress, from_environment, joined, rank_logger
    from ckptkit.errors import DistributedError

    scenario, out = sys.argv[1], Path(sys.argv[2])
    started = time.monotonic()


    def record(ranks, **facts):
        facts.update(rank=ranks.rank, world_size=ranks.world_size,
                     seconds=time.monotonic() - started)
        (out / f"rank{ranks.rank}.json").write_text(json.dumps(facts))


    def updates(rank):
        # a few counts big enough to be sent at once, and many small ones sent in batches
        return [9 << 20] * (rank + 1) + [1000 + rank] * 300


    with from_environment(timeout=float(os.environ["TEST_TIMEOUT"])) as ranks:
        if scenario == "ok":
            seen = ranks.all_gather({"rank": ranks.rank, "pid": os.getpid()})
            ranks.agree(None, "checking")
            with JobProgress(10**9, True, "test", ranks) as bar:
                amounts = updates(ranks.rank)

                def report(part):
                    for n in part:
                        bar.update(n)
                        time.sleep(0.001)

                threads = [threading.Thread(target=report, args=(amounts[i::2],)) for i in (0, 1)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            with JobProgress(100, False, "second job", ranks) as second:
                second.update(10 + ranks.rank)  # a job of its own: counted apart from the first
            rank_logger(ranks).info("finished %d updates", len(amounts))
            expected = sum(sum(updates(r)) for r in range(ranks.world_size))
            with joined() as inner:  # a job inside the command's: its ranks, no new group
                nested = inner is ranks
            record(ranks, gathered=seen, done=bar.done, expected=expected, second=second.done,
                   nested=nested)
        elif scenario == "fail":
            error = ValueError(f"boom on rank {ranks.rank}") if ranks.rank == 1 else None
            try:
                ranks.agree(error, "writing the outputs")
            except DistributedError as exc:
                cause = exc.__cause__
                record(ranks, message=str(exc), cause=None if cause is None else repr(cause))
                ranks.all_gather(None)  # both records are written before either rank exits
                raise
            record(ranks, message=None)
        elif scenario in ("kill", "hang"):
            ranks.all_gather(None)
            if ranks.rank == int(os.environ.get("TEST_VICTIM", "1")):
                time.sleep(1)  # the other rank is inside the agreement by now
                if scenario == "kill":
                    os._exit(1)
                time.sleep(120)
            try:
                ranks.agree(None, "publishing the outputs")
            except DistributedError as exc:
                record(ranks, message=str(exc))
                raise
            record(ranks, message=None)
    """
)

#: Variables a launcher sets; scrubbed so a test run under torchrun does not leak them.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update({"OMP_NUM_THREADS": "1", "TEST_TIMEOUT": "20"})
    env.update(extra)
    return env


def _job(tmp_path: Path) -> tuple[Path, Path]:
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(RANK_JOB)
    out.mkdir()
    return script, out


def _records(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def _torchrun(
    tmp_path: Path, scenario: str, **env: str
) -> tuple[subprocess.CompletedProcess, dict]:
    script, out = _job(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), scenario, str(out)]
    done = subprocess.run(
        command, env=_environment(**env), capture_output=True, text=True, timeout=60
    )
    return done, _records(out)


def _env_launch(
    tmp_path: Path, scenario: str, wait_for: tuple[int, ...] = (0, 1), **env: str
) -> tuple[list[int], dict, float]:
    """Two ranks started without torchrun (env:// variables, rank 0 hosts the store), so no
    agent tears the survivor down: what it does on its own shows. The exit codes of the ranks
    in ``wait_for`` (the others are killed then), the records, the wall time."""
    script, out = _job(tmp_path)
    port = str(_free_port())
    started = time.monotonic()
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), scenario, str(out)],
            env=_environment(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                **env,
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(2)
    ]
    codes: list[int] = []
    try:
        for rank in wait_for:
            codes.append(processes[rank].wait(timeout=60))
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return codes, _records(out), time.monotonic() - started


# --- under torchrun ------------------------------------------------------------------------


def test_two_ranks_gather_agree_and_count_progress(tmp_path):
    logs = tmp_path / "logs"
    started = time.monotonic()
    done, records = _torchrun(tmp_path, "ok", CKPTKIT_RANK_LOGS=str(logs))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(records) == [0, 1]
    pids = [record["gathered"][r]["pid"] for r, record in records.items()]
    for rank, record in records.items():
        assert (record["rank"], record["world_size"]) == (rank, 2)
        assert [g["rank"] for g in record["gathered"]] == [0, 1]
        assert record["gathered"] == records[0]["gathered"]
    assert len(set(pids)) == 2
    # rank 0's bar polled every rank's bytes from the store: exactly their sum, no more
    assert records[0]["done"] == records[0]["expected"] == (9 << 20) * 3 + 300 * 2001
    assert records[0]["second"] == 21
    assert records[0]["nested"] and records[1]["nested"]  # one gloo group for the command
    assert "test:" in done.stderr  # the bar (rank 0 only: one bar for the job)
    host = socket.gethostname()
    for rank in (0, 1):
        text = (logs / f"rank{rank}.log").read_text()
        assert f"[rank {rank}/2 {host}] finished {302 if rank else 301} updates" in text
    print(f"2-rank torchrun job: {time.monotonic() - started:.1f} s wall")


def test_a_failing_rank_fails_every_rank(tmp_path):
    done, records = _torchrun(tmp_path, "fail")
    assert done.returncode != 0
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert record["message"] == "writing the outputs: rank 1 failed: ValueError: boom on rank 1"
    assert records[0]["cause"] is None  # rank 0 did not fail: nothing local to chain
    assert records[1]["cause"] == "ValueError('boom on rank 1')"
    assert "DistributedError: writing the outputs: rank 1 failed" in done.stderr


def test_a_killed_rank_under_torchrun_ends_the_job_quickly(tmp_path):
    """Rank 1 dies (os._exit) while rank 0 waits in agree. Observed here: gloo reports the
    closed connection at once, rank 0 raises DistributedError, and torchrun SIGTERMs what is
    left; if torchrun's monitor won the race rank 0 would be torn down without a record.
    Either way the job ends in seconds, not at the 20 s timeout."""
    started = time.monotonic()
    done, records = _torchrun(tmp_path, "kill")
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert 1 not in records
    if 0 in records:
        assert records[0]["message"].startswith("rank lost during publishing the outputs: ")
        assert records[0]["seconds"] < 15
    else:
        assert "SIGTERM" in done.stderr
    assert elapsed < 40


def test_two_hosts_rendezvous_over_c10d(tmp_path):
    """Two torchrun agents (--nnodes 2, one rank each) meeting at a c10d rendezvous on this
    machine: the shape of a two-host job."""
    script, out = _job(tmp_path)
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            + ["--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
            + ["--rdzv-endpoint", endpoint, "--rdzv-id", "ckptkit-test"]
            + [str(script), "ok", str(out)],
            env=_environment(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        errors = [agent.communicate(timeout=60)[1] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    records = _records(out)
    assert sorted(records) == [0, 1]
    assert records[0]["gathered"] == records[1]["gathered"]
    assert records[0]["done"] == records[0]["expected"]


# --- without torchrun: the survivor on its own --------------------------------------------


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_reported_by_the_survivor(tmp_path, victim):
    """No agent to tear the survivor down: gloo's closed connection becomes DistributedError
    at once, whether the dead rank was a peer or rank 0 hosting the store."""
    codes, records, elapsed = _env_launch(tmp_path, "kill", TEST_VICTIM=str(victim))
    survivor = 1 - victim
    assert codes == [1, 1]
    assert list(records) == [survivor]
    message = records[survivor]["message"]
    assert message.startswith("rank lost during publishing the outputs: RuntimeError: ")
    assert "Connection closed by peer" in message
    assert records[survivor]["seconds"] < 15
    assert elapsed < 30


def test_a_hung_rank_is_reported_after_the_timeout(tmp_path):
    codes, records, elapsed = _env_launch(tmp_path, "hang", (0,), TEST_TIMEOUT="3")
    assert codes == [1]
    message = records[0]["message"]
    assert message.startswith("rank lost during publishing the outputs: RuntimeError: ")
    assert "Timed out" in message
    assert 3 <= records[0]["seconds"] < 20
    assert elapsed < 30


# --- in this process ---------------------------------------------------------------------


def test_outside_torchrun_nothing_is_distributed_and_torch_is_not_imported():
    probe = textwrap.dedent(
        """
        import sys
        from ckptkit.ops import distributed
        with distributed.joined() as ranks:
            assert ranks is None
        with distributed.from_environment() as ranks:
            assert ranks is None
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    for extra in ({}, {"WORLD_SIZE": "2", "RANK": "0"}, {"WORLD_SIZE": "1", "MASTER_ADDR": "x"}):
        env = _environment(**extra)
        done = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]"


def test_a_single_process_joins_no_ranks():
    with joined() as ranks:
        assert ranks is None


def test_python_dash_m_ckptkit_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "ckptkit", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert ckptkit.__version__ in done.stdout


def test_distributed_error_is_a_checkpoint_error():
    assert issubclass(ckptkit.DistributedError, ckptkit.CheckpointError)


def test_single_process_progress_counts_every_thread():
    with JobProgress(10**6, False, "test", None) as bar:
        threads = [
            threading.Thread(target=lambda: [bar.update(7) for _ in range(1000)]) for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert bar.done == 4 * 7 * 1000


def test_rank_logger_tags_records_and_writes_a_file_per_rank(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CKPTKIT_RANK_LOGS", str(tmp_path / "logs"))
    logger = rank_logger(None)
    try:
        assert logger.name == "ckptkit.distributed"
        with caplog.at_level(logging.INFO, logger="ckptkit.distributed"):
            logger.info("reading %s", "model.pt")
        tag = f"[rank 0/1 {socket.gethostname()}]"
        assert [r.rank_tag for r in caplog.records] == [tag]
        assert f"{tag} reading model.pt" in (tmp_path / "logs" / "rank0.log").read_text()
    finally:
        monkeypatch.delenv("CKPTKIT_RANK_LOGS")
        logger = rank_logger(None)
    assert not logger.handlers  # asked for nothing: nothing added, nothing left over


# --- balance -------------------------------------------------------------------------------


def test_balance_puts_the_largest_first_onto_the_least_loaded_rank():
    # 5 → r0; 4 → r1; 3 → r1 (4 < 5); 2 → r0 (5 < 7); 1 → r0 (7 = 7: lowest rank)
    assert balance([5, 1, 4, 2, 3], 2) == [0, 0, 1, 0, 1]
    assert balance([1, 1, 1, 1], 2) == [0, 1, 0, 1]  # ties: by item index, then rank
    assert balance([3, 3], 4) == [0, 1]
    assert balance([], 3) == []
    assert balance([9, 0, 4], 1) == [0, 0, 0]


@pytest.mark.parametrize(
    ("sizes", "world_size"), [([1], 0), ([1], -1), ([1], True), ([1], 2.0), ([-1], 2), ([1.5], 2)]
)
def test_balance_refuses_bad_arguments(sizes, world_size):
    with pytest.raises(UsageError):
        balance(sizes, world_size)


def _loads(sizes: list[int], owners: list[int], world_size: int) -> list[int]:
    loads = [0] * world_size
    for size, owner in zip(sizes, owners, strict=True):
        loads[owner] += size
    return loads


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10**12), max_size=60), st.integers(1, 9))
def test_balance_assigns_every_item_deterministically_within_a_largest_item(sizes, world_size):
    owners = balance(sizes, world_size)
    assert owners == balance(list(sizes), world_size)  # deterministic: every rank agrees
    assert len(owners) == len(sizes)
    assert all(0 <= owner < world_size for owner in owners)
    if sizes:
        # the optimum is at least the mean load, so this bounds max load by optimum + largest
        worst = max(_loads(sizes, owners, world_size))
        assert worst * world_size <= sum(sizes) + world_size * max(sizes)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=7), st.integers(2, 3))
def test_balance_is_within_four_thirds_of_the_optimum(sizes, world_size):
    """Largest-first greedy (LPT) is within 4/3 of the best assignment: checked by brute force."""
    worst = max(_loads(sizes, balance(sizes, world_size), world_size))
    best = min(
        max(_loads(sizes, list(owners), world_size))
        for owners in itertools.product(range(world_size), repeat=len(sizes))
    )
    assert 3 * worst <= 4 * best


def test_agree_reports_the_first_failing_rank():
    """The message format, checked without a process group: a stand-in gathers fixed reports."""

    class ThreeRanks(Ranks):
        def all_gather(self, value, what="all_gather"):
            return [None, ("OSError", "disk full"), value]

    ranks = ThreeRanks(0, 3, None)
    error = KeyError("k")
    with pytest.raises(DistributedError) as raised:
        ranks.agree(error, "writing")
    assert str(raised.value) == "writing: rank 1 failed: OSError: disk full (and 1 more)"
    assert raised.value.__cause__ is error
    assert raised.value.failures == [(1, "OSError", "disk full"), (2, "KeyError", "'k'")]
